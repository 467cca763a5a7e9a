r"""The learning-rate profiles' report (``configs/sweeps/tying_study.py:
profiles``), written from the rows of its ``runs.csv`` alone
(:func:`report_from_csv`): one figure per profiled cell (validation loss
against the learning rate, one curve per arm, the mean over the tuning seeds
and each seed's point) and one of them all, the table of the curves, and the
contrasts b - a and c - a at each arm's best rate with their selection
uncertainty (:func:`bootstrap`). ``docs/tying_study/README.md`` ("Learning-rate
profiles") describes the design and how to read it.
"""

import dataclasses
import itertools
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.ticker
import numpy as np

from lmhead.lab import report
from studies.tying import table

PLOT = "profile_{vocab}_{amount}.png"
ALL_PLOT = "profiles.png"
# Rungs that a figure's rate labels fit in level; more are slanted.
CROWDED = 8
CONTRASTS = (("b", "a"), ("c", "a"))
# Tuning seeds up to this many: every ordered resample (n^n); more: DRAWS.
EXACT_UP_TO = 6
DRAWS = 10_000
LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Profile:
    """One cell's profile: each arm's validation loss (nats per token,
    ``inf``: diverged or never evaluated) and bits per character by rate and
    tuning seed, from its finished runs; ``planned`` and ``finished`` count
    its rows."""

    vocab: str
    amount: float
    seeds: tuple[int, ...]
    loss: Mapping[str, Mapping[float, Mapping[int, float]]]
    bpc: Mapping[str, Mapping[float, Mapping[int, float]]]
    eval_every: int | None
    first_eval_bests: int
    planned: int
    finished: int
    best_steps: tuple[int, ...] = ()
    steps_cap: int | None = None

    @property
    def rates(self) -> list[float]:
        return sorted({lr for curve in self.loss.values() for lr in curve})

    @property
    def arms(self) -> list[str]:
        return sorted(self.loss)

    def complete(self, arm: str) -> list[float]:
        """The rates at which every tuning seed of ``arm`` has finished."""
        curve = self.loss.get(arm, {})
        return [lr for lr in sorted(curve) if set(self.seeds) <= set(curve[lr])]


def _finite(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else math.inf


def arm_label(row: Mapping[str, Any]) -> str:
    """A row's arm, with its table learning-rate multiplier k where not 1
    (an arm of its own: ``b×2``).

    Examples:
        >>> arm_label({"arm": "b", "table_lr_multiplier": 2.0})
        'b×2'
        >>> arm_label({"arm": "a", "table_lr_multiplier": None})
        'a'
    """
    k = row["table_lr_multiplier"] or 1.0
    return row["arm"] if k == 1.0 else f"{row['arm']}×{k:g}"


def profiles(rows: Sequence[Mapping[str, Any]]) -> list[Profile]:
    """The tuning rows of each vocabulary, amount and step budget (two
    budgets of one amount are two cells), in the rows' order, as
    :class:`Profile` s; the seeds are those of the cell's tuning rows."""
    cells: dict[tuple, list] = {}
    for row in rows:
        if row["role"] == "tune":
            key = (row["vocab"], row["amount"], row["steps_cap"])
            cells.setdefault(key, []).append(row)
    found = []
    for (vocab, amount, _), own in cells.items():
        loss: dict = {}
        bpc: dict = {}
        done = [r for r in own if r["status"] == "finished"]
        for r in done:
            arm = arm_label(r)
            loss.setdefault(arm, {}).setdefault(r["lr"], {})[r["seed"]] = _finite(
                r["val_loss"]
            )
            value = r["val_bpc"]
            bpc.setdefault(arm, {}).setdefault(r["lr"], {})[r["seed"]] = (
                math.inf if value is None or not math.isfinite(value) else value
            )
        every = {r["eval_every"] for r in own} - {None}
        found.append(
            Profile(
                vocab=vocab,
                amount=amount,
                seeds=tuple(sorted({r["seed"] for r in own})),
                loss=loss,
                bpc=bpc,
                eval_every=min(every) if every else None,
                first_eval_bests=sum(
                    r["steps_to_best"] is not None
                    and r["steps_to_best"] == r["eval_every"]
                    for r in done
                ),
                planned=len(own),
                finished=len(done),
                best_steps=tuple(
                    sorted(
                        r["steps_to_best"]
                        for r in done
                        if r["steps_to_best"] is not None
                    )
                ),
                steps_cap=max((r["steps_cap"] or 0 for r in own), default=None) or None,
            )
        )
    return found


def best_rate(
    curve: Mapping[float, Mapping[int, float]],
    seeds: Sequence[int],
    rates: Sequence[float],
) -> float | None:
    """The rate of ``rates`` with the lowest mean of ``curve`` over
    ``seeds`` (a seed may repeat: a resample), ties to the lower rate; None
    when every one is ``inf`` (diverged) or there is no rate.

    Examples:
        >>> curve = {1e-3: {0: 2.0, 1: 2.2}, 2e-3: {0: 2.1, 1: 1.9}}
        >>> best_rate(curve, (0, 1), [1e-3, 2e-3]), best_rate(curve, (0, 0), [1e-3, 2e-3])
        (0.002, 0.001)
    """
    means = {lr: statistics.fmean(curve[lr][s] for s in seeds) for lr in rates}
    finite = sorted(lr for lr in means if math.isfinite(means[lr]))
    return min(finite, key=lambda lr: means[lr]) if finite else None


def contrast(
    profile: Profile, arm: str, reference: str, seeds: Sequence[int]
) -> tuple[float | None, float | None, float]:
    r"""``(arm's best rate, reference's best rate, difference)``: each arm's
    best rate on the mean validation loss over ``seeds``
    (:func:`best_rate`, over the rates where every tuning seed finished),
    and the difference of the mean validation bits per character there,

    .. math::
        \Delta = \tfrac1n \sum_i \mathrm{bpc}_{x}(\eta^*_x, s_i)
               - \tfrac1n \sum_i \mathrm{bpc}_{a}(\eta^*_a, s_i).

    NaN when an arm has no best rate."""
    best = {}
    for which in (arm, reference):
        best[which] = best_rate(profile.loss[which], seeds, profile.complete(which))
    if None in best.values():
        return best[arm], best[reference], math.nan
    means = [
        statistics.fmean(profile.bpc[w][best[w]][s] for s in seeds)
        for w in (arm, reference)
    ]
    return best[arm], best[reference], means[0] - means[1]


def resamples(seeds: Sequence[int], rng_seed: int = 0) -> list[tuple[int, ...]]:
    """The bootstrap's resamples of ``seeds`` with replacement: every ordered
    one (:math:`n^n`, equally likely: the exact bootstrap distribution) up
    to :data:`EXACT_UP_TO` seeds, else :data:`DRAWS` random ones.

    Examples:
        >>> resamples((100, 101))
        [(100, 100), (100, 101), (101, 100), (101, 101)]
    """
    seeds = tuple(seeds)
    if len(seeds) <= EXACT_UP_TO:
        return list(itertools.product(seeds, repeat=len(seeds)))
    rng = np.random.default_rng(rng_seed)
    draws = rng.integers(0, len(seeds), size=(DRAWS, len(seeds)))
    return [tuple(seeds[i] for i in draw) for draw in draws]


@dataclasses.dataclass(frozen=True)
class Bootstrap:
    """A contrast at the arms' best rates and its selection uncertainty:
    ``low`` and ``high`` the percentile interval at :data:`LEVEL`, ``picks``
    each arm's share of resamples that chose each rate."""

    arm: str
    reference: str
    best: float | None
    reference_best: float | None
    difference: float
    low: float
    high: float
    picks: Mapping[str, Mapping[float, float]]
    resamples: int


def bootstrap(
    profile: Profile, arm: str, reference: str = "a", level: float = LEVEL
) -> Bootstrap:
    r"""The contrast ``arm - reference`` at each one's best rate
    (:func:`contrast` on all tuning seeds) and its selection uncertainty by
    bootstrap over tuning seeds: for each resample of the seeds with
    replacement (:func:`resamples`, the same seeds for both arms, so that
    the pairing by seed stays), each arm's best rate is chosen again on the
    resampled mean losses and the contrast recomputed from the resampled
    runs. The interval is the :math:`(1 \pm \text{level})/2` percentiles of
    the finite contrasts (``np.percentile``, linear interpolation).

    Examples:
        >>> p = Profile("512", 0.003, (0, 1), loss={"a": {1e-3: {0: 2.0, 1: 2.0}},
        ...     "b": {1e-3: {0: 1.0, 1: 3.0}}}, bpc={"a": {1e-3: {0: 2.0, 1: 2.0}},
        ...     "b": {1e-3: {0: 1.0, 1: 3.0}}}, eval_every=25, first_eval_bests=0,
        ...     planned=4, finished=4)
        >>> b = bootstrap(p, "b")
        >>> b.difference, round(b.low, 3), round(b.high, 3), b.resamples
        (0.0, -0.925, 0.925, 4)
    """
    best, reference_best, difference = contrast(profile, arm, reference, profile.seeds)
    values = []
    picks: dict[str, dict[float, int]] = {arm: {}, reference: {}}
    draws = resamples(profile.seeds)
    for seeds in draws:
        x, a, value = contrast(profile, arm, reference, seeds)
        for which, rate in ((arm, x), (reference, a)):
            if rate is not None:
                picks[which][rate] = picks[which].get(rate, 0) + 1
        if math.isfinite(value):
            values.append(value)
    tail = 100 * (1 - level) / 2
    low, high = (
        np.percentile(values, [tail, 100 - tail]).tolist() if values else [math.nan] * 2
    )
    shares = {
        which: {lr: count / len(draws) for lr, count in sorted(found.items())}
        for which, found in picks.items()
    }
    return Bootstrap(
        arm, reference, best, reference_best, difference, low, high, shares, len(draws)
    )


# --- The report -------------------------------------------------------------


def cell_label(profile: Profile, budget: bool = False) -> str:
    """The cell's vocabulary and amount, with ``budget`` its step budget too.

    Examples:
        >>> p = Profile("2048", 1.0, (100,), {}, {}, 100, 0, 0, 0, steps_cap=3000)
        >>> cell_label(p), cell_label(p, budget=True)
        ('BPE 2048 on 100% of the text', 'BPE 2048 on 100% of the text, 3000 steps')
    """
    return cell_text(profile.vocab, profile.amount, budget and profile.steps_cap)


def cell_text(vocab: str, amount: float, steps: int | None = None) -> str:
    """A vocabulary (as ``runs.csv`` writes it) on an amount, in words, with
    a step budget where given.

    Examples:
        >>> cell_text("char", 0.003), cell_text("512", 1.0, 300)
        ('characters on 0.3% of the text', 'BPE 512 on 100% of the text, 300 steps')
    """
    words = "characters" if vocab == "char" else f"BPE {vocab}"
    budget = f", {steps} steps" if steps else ""
    return f"{words} on {100 * amount:g}% of the text{budget}"


def plot_path(out_dir: str, profile: Profile, budget: bool = False) -> str:
    """``PLOT`` in ``out_dir``; with ``budget``, the step budget in the name."""
    name = PLOT.format(vocab=profile.vocab, amount=f"{profile.amount:g}")
    if budget:
        name = name.replace(".png", f"_{profile.steps_cap}steps.png")
    return os.path.join(out_dir, name)


_LEGEND = "line: mean over tuning seeds {seeds}; dots: each seed"
_MARKS = "circle: the arm's best rate; x: diverged"


def plot_profile(profile: Profile, path: str, budget: bool = False) -> None:
    """Validation loss against the rate (log axis): per arm each seed's
    point and the mean over seeds at the rates where all finished, its best
    circled; a diverged run is a cross at the top of the axes (``budget``:
    the title names the step budget)."""
    seeds = ", ".join(map(str, profile.seeds))
    title = (
        f"{cell_label(profile, budget)}: validation loss at the best evaluation\n"
        f"{_LEGEND.format(seeds=seeds)}\n{_MARKS}"
    )
    with report.panels(path, 1, (7.5, 5.0), title) as (axis,):
        _draw_profile(axis, profile)


def plot_profiles(found: Sequence[Profile], path: str) -> None:
    """:func:`plot_profile`'s curves of every cell in ``found`` in one
    figure, two panels a row, each titled by its cell."""
    seeds = ", ".join(map(str, sorted({s for p in found for s in p.seeds})))
    title = (
        "Validation loss at the best evaluation against the peak learning "
        f"rate, per arm\n{_LEGEND.format(seeds=seeds)}; {_MARKS}"
    )
    columns = min(len(found), 2)
    with report.panels(path, len(found), (6.0, 4.2), title, columns) as axes:
        for axis, profile in zip(axes, found):
            _draw_profile(axis, profile)
            axis.set_title(cell_label(profile))
            axis.tick_params(axis="x", labelrotation=30)


def _draw_profile(axis, profile: Profile) -> None:
    finite = [
        v
        for curve in profile.loss.values()
        for by_seed in curve.values()
        for v in by_seed.values()
        if math.isfinite(v)
    ]
    top = max(finite) if finite else 1.0
    for arm in profile.arms:
        curve = profile.loss[arm]
        rates = profile.complete(arm)
        means = [statistics.fmean(curve[lr].values()) for lr in rates]
        shown = [(lr, m) for lr, m in zip(rates, means) if math.isfinite(m)]
        (line,) = axis.plot(
            [lr for lr, _ in shown], [m for _, m in shown], "-", label=f"arm {arm}"
        )
        color = line.get_color()
        points = [(lr, v) for lr in curve for v in curve[lr].values()]
        axis.scatter(
            [lr for lr, v in points if math.isfinite(v)],
            [v for _, v in points if math.isfinite(v)],
            s=14,
            color=color,
            alpha=0.6,
        )
        diverged = [lr for lr, v in points if not math.isfinite(v)]
        if diverged:
            axis.scatter(diverged, [top] * len(diverged), marker="x", color=color)
        best = best_rate(curve, profile.seeds, rates)
        if best is not None:
            axis.scatter(
                [best],
                [statistics.fmean(curve[best].values())],
                s=160,
                facecolors="none",
                edgecolors=color,
            )
    axis.set(
        xscale="log",
        xlabel="peak learning rate",
        ylabel="validation loss (nats per token)",
    )
    # One tick per rung, instead of log-scale decades.
    axis.set_xticks(profile.rates, [f"{lr:g}" for lr in profile.rates])
    axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if len(profile.rates) > CROWDED:
        axis.tick_params(axis="x", labelrotation=30)
    axis.legend()


def curve_table(profile: Profile) -> str:
    """Each rate's mean validation loss per arm, with each seed's in
    brackets; the arm's best in bold; ``-``: not run or not finished."""
    rows = []
    for lr in profile.rates:
        cells = [f"{lr:g}"]
        for arm in profile.arms:
            by_seed = profile.loss[arm].get(lr, {})
            if not by_seed:
                cells.append("-")
                continue
            seeds = " / ".join(
                f"{by_seed[s]:.4f}" if s in by_seed else "-" for s in profile.seeds
            )
            complete = lr in profile.complete(arm)
            mean = statistics.fmean(by_seed.values()) if complete else None
            text = "-" if mean is None else f"{mean:.4f}"
            if lr == best_rate(profile.loss[arm], profile.seeds, profile.complete(arm)):
                text = f"**{text}**"
            cells.append(f"{text} ({seeds})")
        rows.append(cells)
    header = ["rate"] + [f"arm {arm}: mean (seeds)" for arm in profile.arms]
    return report.markdown_table(header, rows)


def _picks(shares: Mapping[float, float]) -> str:
    return ", ".join(f"{lr:g}: {share:.0%}" for lr, share in shares.items()) or "-"


def _margins(profile: Profile, arm: str) -> str:
    """Rungs of the ladder below and above the arm's best."""
    rates = profile.complete(arm)
    best = best_rate(profile.loss[arm], profile.seeds, rates)
    if best is None:
        return "-"
    return f"{rates.index(best)} / {len(rates) - 1 - rates.index(best)}"


def _signed(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.4f}"


def _best_steps(profile: Profile) -> str:
    steps = profile.best_steps
    if not steps:
        return ""
    return (
        f" Best evaluations at steps {steps[0]}–{steps[-1]} (median "
        f"{statistics.median(steps):g}) of {profile.steps_cap}."
    )


def contrast_table(
    found: Sequence[tuple[Profile, Bootstrap]], budget: bool = False
) -> str:
    """The contrasts at the best rates with their selection uncertainty, a
    row each (``budget``: each cell's step budget named)."""
    rows = []
    for profile, b in found:
        rows.append(
            [
                cell_label(profile, budget),
                f"{b.arm} − {b.reference}",
                "-" if b.best is None else f"{b.best:g}",
                "-" if b.reference_best is None else f"{b.reference_best:g}",
                _signed(b.difference),
                "-" if math.isnan(b.low) else f"[{b.low:+.4f}, {b.high:+.4f}]",
                _picks(b.picks[b.arm]),
                _picks(b.picks[b.reference]),
                f"{_margins(profile, b.arm)}; {_margins(profile, b.reference)}",
            ]
        )
    header = [
        "cell",
        "contrast",
        "best rate",
        "a's best rate",
        "Δ val bits/char",
        f"{LEVEL:.0%} bootstrap interval",
        "picks of the arm's best",
        "picks of a's best",
        "rungs below / above the bests",
    ]
    return report.markdown_table(header, rows)


def cell_section(
    profile: Profile, out_dir: str, budget: bool = False
) -> tuple[str, str]:
    """A cell's section of the report (its runs, the figure, the curves'
    table) and its figure's path, the figure written (:func:`plot_profile`);
    ``budget``: the step budget in the heading and the figure's name."""
    path = plot_path(out_dir, profile, budget)
    plot_profile(profile, path, budget)
    label = cell_label(profile, budget)
    text = (
        f"## {label}\n\n"
        f"{profile.finished} of {profile.planned} runs finished; tuning seeds "
        f"{', '.join(map(str, profile.seeds))}; evaluated every "
        f"{profile.eval_every} steps; {profile.first_eval_bests} runs best "
        f"at their first evaluation.{_best_steps(profile)}\n\n"
        f"![{label}]({os.path.basename(path)})\n\n" + curve_table(profile)
    )
    return text, path


def write_report(rows: Sequence[Mapping[str, Any]], out_dir: str):
    """``out_dir/REPORT.md``, one plot per profiled cell and one of them all
    (:data:`ALL_PLOT`) from ``rows``: ``(REPORT.md's text, plot paths)``."""
    os.makedirs(out_dir, exist_ok=True)
    found = profiles(rows)
    plots, sections, contrasts = [], [], []
    figure = []
    if found:
        plots.append(os.path.join(out_dir, ALL_PLOT))
        plot_profiles(found, plots[0])
        figure = [f"![Every profiled cell's curves]({ALL_PLOT})"]
    for profile in found:
        section, path = cell_section(profile, out_dir)
        sections.append(section)
        plots.append(path)
        contrasts += [
            (profile, bootstrap(profile, arm, reference))
            for arm, reference in CONTRASTS
            if arm in profile.loss and reference in profile.loss
        ]
    seeds = sorted({s for p in found for s in p.seeds})
    intro = (
        "# Learning-rate profiles\n\n"
        "Arms a, b and c of each cell on one shared √2 ladder of peak rates, "
        f"tuning seeds {', '.join(map(str, seeds))}, written from `runs.csv` "
        "alone. Validation loss is at each run's best evaluation. An arm's best "
        "rate has the lowest mean validation loss over the tuning seeds (a "
        "diverged run is worse than any finite one). The contrasts are in "
        "validation bits per character at each arm's best rate. Their "
        "interval is the selection uncertainty: the tuning seeds are resampled "
        "with replacement (every ordered resample), each arm's best rate is "
        "chosen again, and the contrast is recomputed. The picks are the share "
        "of resamples that chose each rate."
    )
    text, _ = report.write_markdown(
        out_dir,
        [intro, "## Contrasts at the best rates", contrast_table(contrasts)]
        + figure
        + sections,
    )
    return text, plots


def report_from_csv(path: str, out_dir: str):
    """:func:`write_report` of the rows of the ``runs.csv`` at ``path``."""
    return write_report(table.read_rows(path), out_dir)
