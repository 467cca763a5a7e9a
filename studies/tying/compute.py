r"""The tying study's compute axis (``configs/sweeps/tying_study.py:
compute``): one cell's arms a and b at several step budgets, each budget
profiled and annealed, and how :math:`b - a` moves with the tokens trained
per parameter. The report is written from the rows of its ``runs.csv``
(:func:`report_from_csv`), joined by the test runs of the cell's other
budgets from the tables that hold them (the confirmatory runs' for 1000
steps).

For a budget of :math:`T` steps of :math:`N_\text{step}` tokens, an arm of
:math:`P` parameters trains on :math:`T N_\text{step} / P` tokens per
parameter. At each budget :math:`b - a` is the paired difference of test
bits per character over the seeds both arms finished,
:math:`\bar d_T \pm t_{0.975,\,n-1}\, s_d/\sqrt n`; the change from budget
:math:`T_1` to :math:`T_2` is the paired difference of those differences
by seed, :math:`d_{T_2,s} - d_{T_1,s}`, with its own t-interval
(:func:`change`). ``docs/tying_study/README.md`` ("One compute axis")
describes the design.
"""

import dataclasses
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from lmhead.lab import report, stats
from studies.tying import confirm, failures, profiles, table
from studies.tying.report_text import p_text

PLOT = "compute_axis.png"
ARMS = ("a", "b")
NOT_RUN = "not yet run"
PROFILE_UNFINISHED = "profile unfinished"


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm's finished test runs at a budget: its rate, parameters,
    tokens trained per parameter (:func:`tokens_per_param`), passes over the
    training text, test bits/char by seed and the median best step."""

    rate: float | None
    params: int | None
    tokens_per_param: float | None
    passes: float | None
    test_bpc: Mapping[int, float]
    best_step: float | None


@dataclasses.dataclass(frozen=True)
class Point:
    """A budget of ``steps``: its test runs of arms a and b planned and
    finished, each arm (:class:`Arm`), :math:`b - a` by seed and paired
    (None without two seeds of both), and its ``status``: ``""`` when
    every planned run finished, else why not."""

    steps: int
    planned: int
    finished: int
    arms: Mapping[str, Arm]
    per_seed: Mapping[int, float]
    difference: stats.PairedDifference | None
    p: float
    status: str


def tokens_per_param(steps: int, step_tokens: int | None, params: int | None):
    """Tokens trained per parameter in ``steps`` steps of ``step_tokens``.

    Examples:
        >>> tokens_per_param(3000, 768, 1_152_000), tokens_per_param(3000, None, 1)
        (2.0, None)
    """
    if step_tokens is None or not params:
        return None
    return steps * step_tokens / params


def _one(values) -> Any:
    """The value the rows share (the median if they differ), None if none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return values[0] if len(set(values)) == 1 else statistics.median(values)


def _arm(steps: int, own: Sequence[Mapping[str, Any]]) -> Arm:
    finished = [r for r in own if r["status"] == "finished"]
    params = _one(r["params"] for r in finished)
    step_tokens = _one(r["step_tokens"] for r in finished)
    train_tokens = _one(r["train_tokens"] for r in finished)
    trained = tokens_per_param(steps, step_tokens, params)
    best = [r["steps_to_best"] for r in finished if r["steps_to_best"] is not None]
    return Arm(
        rate=_one(r["lr"] for r in own),
        params=params,
        tokens_per_param=trained,
        passes=None
        if trained is None or not train_tokens
        else steps * step_tokens / train_tokens,
        test_bpc={
            r["seed"]: r["test_bpc"] for r in finished if r["test_bpc"] is not None
        },
        best_step=statistics.median(best) if best else None,
    )


def point(
    rows: Sequence[Mapping[str, Any]], vocab: str, amount: float, steps: int
) -> Point:
    """The budget ``steps`` of the cell (``vocab`` as ``runs.csv`` writes
    it, ``amount`` the fraction) from ``rows``: its test runs of arms a and
    b at table multiplier 1, and a status of :data:`NOT_RUN` (no runs of the
    budget), :data:`PROFILE_UNFINISHED` (tuning runs but no test runs yet) or
    ``k of n finished``.

    Examples:
        >>> def row(arm, seed, bpc):
        ...     return dict.fromkeys(table.COLUMNS) | {"role": "test", "vocab": "2048",
        ...         "amount": 1.0, "steps_cap": 3000, "arm": arm, "seed": seed,
        ...         "test_bpc": bpc, "status": "finished", "params": 1_152_000,
        ...         "step_tokens": 768}
        >>> t = point([row("a", 0, 2.0), row("a", 1, 2.1), row("b", 0, 1.9),
        ...            row("b", 1, 2.2)], "2048", 1.0, 3000)
        >>> t.per_seed, t.arms["a"].tokens_per_param, t.status
        ({0: -0.1, 1: 0.1}, 2.0, '')
        >>> point([], "2048", 1.0, 10_000).status
        'not yet run'
    """
    own = [
        r
        for r in rows
        if (r["vocab"], r["amount"], r["steps_cap"]) == (vocab, amount, steps)
        and r["arm"] in ARMS
        and (r["table_lr_multiplier"] or 1.0) == 1.0
    ]
    tests = [r for r in own if r["role"] == "test"]
    arms = {arm: _arm(steps, [r for r in tests if r["arm"] == arm]) for arm in ARMS}
    x, y = arms["b"].test_bpc, arms["a"].test_bpc
    per_seed = {s: x[s] - y[s] for s in sorted(x) if s in y}
    difference = stats.paired_difference(x, y) if len(per_seed) >= 2 else None
    finished = sum(r["status"] == "finished" for r in tests)
    if not tests:
        status = PROFILE_UNFINISHED if own else NOT_RUN
    elif finished < len(tests):
        status = f"{finished} of {len(tests)} finished"
    else:
        status = ""
    return Point(
        steps,
        len(tests),
        finished,
        arms,
        per_seed,
        difference,
        stats.paired_p_value(x, y) if difference else math.nan,
        status,
    )


def change(low: Point, high: Point) -> tuple[stats.PairedDifference | None, float]:
    r"""``high``'s :math:`b - a` minus ``low``'s, paired by seed (the seeds
    with both arms finished at both budgets): :math:`\bar c \pm
    t_{0.975,\,n-1}\, s_c/\sqrt n` of :math:`c_s = d_{\text{high},s} -
    d_{\text{low},s}`, and its two-sided p-value; None and NaN for fewer
    than two such seeds.

    Examples:
        >>> def at(steps, d):
        ...     return Point(steps, 0, 0, {}, d, None, math.nan, "")
        >>> c, p = change(at(1000, {0: 0.0, 1: 0.01, 2: 0.02}),
        ...               at(3000, {0: -0.01, 1: -0.01, 2: 0.0, 3: 5.0}))
        >>> round(c.mean, 4), c.n, round(c.low, 4), round(c.high, 4), round(p, 4)
        (-0.0167, 3, -0.0310, -0.0023, 0.0377)
    """
    seeds = [s for s in high.per_seed if s in low.per_seed]
    if len(seeds) < 2:
        return None, math.nan
    x = {s: high.per_seed[s] for s in seeds}
    y = {s: low.per_seed[s] for s in seeds}
    return stats.paired_difference(x, y), stats.paired_p_value(x, y)


def joined_rows(path: str, others: Mapping[str, str]) -> tuple[list, list[str]]:
    """The rows of the ``runs.csv`` at ``path``, then those of each existing
    table of ``others`` (label -> path) whose run is not among them yet (a
    run's name is its identity); and the labels of the tables read."""
    rows = table.read_rows(path)
    names = {r["run"] for r in rows}
    read = []
    for label, other in others.items():
        if not os.path.isfile(other):
            continue
        extra = [r for r in table.read_rows(other) if r["run"] not in names]
        names |= {r["run"] for r in extra}
        rows += extra
        read.append(label)
    return rows, read


# --- The report -------------------------------------------------------------


def _number(value, spec: str) -> str:
    return report.DASH if value is None else format(value, spec)


def _interval(d: stats.PairedDifference | None) -> str:
    if d is None or math.isnan(d.low):
        return report.DASH
    return f"{d.mean:+.4f} [{d.low:+.4f}, {d.high:+.4f}]"


def _mean(values: Mapping[int, float]) -> str:
    return f"{statistics.fmean(values.values()):.4f}" if values else report.DASH


def budget_table(points: Sequence[Point]) -> str:
    """One row per budget: its status, each arm's rate, tokens per parameter,
    passes over the text, mean test bits/char, and b − a."""
    header = [
        "steps",
        "runs",
        "rates (a; b)",
        "tokens per parameter (a; b)",
        "passes over the text",
        "median best step (a; b)",
        "seeds",
        "test bits/char a; b",
        "b − a [95% paired t]",
        "p",
    ]
    rows = []
    for t in points:
        a, b = t.arms["a"], t.arms["b"]
        runs = t.status or f"{t.finished} finished"
        rows.append(
            [
                str(t.steps),
                runs,
                f"{_number(a.rate, 'g')}; {_number(b.rate, 'g')}",
                f"{_number(a.tokens_per_param, '.3f')}; "
                f"{_number(b.tokens_per_param, '.3f')}",
                _number(a.passes, ".2f"),
                f"{_number(a.best_step, 'g')}; {_number(b.best_step, 'g')}",
                str(len(t.per_seed)),
                f"{_mean(a.test_bpc)}; {_mean(b.test_bpc)}",
                _interval(t.difference),
                p_text(t.p),
            ]
        )
    return report.markdown_table(header, rows)


def change_table(points: Sequence[Point]) -> str:
    """The change of b − a from each budget to the next: paired by seed, or
    where the budgets share fewer than two seeds (the budgets past early
    training test seeds of their own), the difference of the two budgets'
    mean b − a with Welch's interval (:func:`lmhead.lab.stats.welch_difference`)."""
    rows, welch = [], False
    for low, high in zip(points, points[1:]):
        c, p = change(low, high)
        seeds = str(0 if c is None else c.n)
        if c is None and len(low.per_seed) > 1 and len(high.per_seed) > 1:
            c, p = stats.welch_difference(
                list(high.per_seed.values()), list(low.per_seed.values())
            )
            seeds, welch = (
                f"none ({len(low.per_seed)} and {len(high.per_seed)}, Welch)",
                True,
            )
        rows.append([f"{low.steps} → {high.steps}", seeds, _interval(c), p_text(p)])
    change_header = "change of b − a [95% " + (
        "t: paired or Welch's]" if welch else "paired t]"
    )
    header = ["steps", "seeds paired", change_header, "p"]
    return report.markdown_table(header, rows)


def plot_axis(points: Sequence[Point], title: str, path: str) -> None:
    """Left: each arm's test bits/char (mean, 95% t-interval) against its
    tokens trained per parameter; right: b − a (paired 95% t-interval) at
    the geometric mean of the two arms' tokens per parameter, a line
    spanning both; log x axes."""
    with report.panels(path, 2, (6.0, 4.5), title) as (arms_axis, axis):
        drawn = 0
        for arm in ARMS:
            xs, ys, errors, labels = [], [], [], []
            for t in points:
                own = t.arms[arm]
                values = list(own.test_bpc.values())
                if own.tokens_per_param is None or len(values) < 2:
                    continue
                mean, std, n = stats.mean_std(values)
                xs.append(own.tokens_per_param)
                ys.append(mean)
                errors.append(stats.t_critical_95(n - 1) * std / math.sqrt(n))
                labels.append(t.steps)
            drawn += len(xs)
            arms_axis.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=arm)
            for x, y, steps in zip(xs, ys, labels):
                arms_axis.annotate(f"{steps}", (x, y), fontsize=7)
        arms_axis.set(
            xscale="log" if drawn else "linear",
            xlabel="tokens trained per parameter",
            ylabel="test bits per character (mean, 95% t)",
        )
        arms_axis.legend(title="arm")
        axis.axhline(0.0, color="grey", linewidth=0.8, linestyle="--")
        shown = 0
        for t in points:
            a, b = t.arms["a"].tokens_per_param, t.arms["b"].tokens_per_param
            if t.difference is None or a is None or b is None:
                continue
            x, d = math.sqrt(a * b), t.difference
            axis.errorbar(
                [x],
                [d.mean],
                yerr=[[d.mean - d.low], [d.high - d.mean]],
                xerr=[[x - min(a, b)], [max(a, b) - x]],
                marker="o",
                capsize=3,
                color="C0",
            )
            axis.annotate(f"{t.steps} steps", (x, d.mean), fontsize=7)
            shown += 1
        if not shown:
            axis.text(0.5, 0.5, "no budget finished yet", ha="center",
                      transform=axis.transAxes)  # fmt: skip
        axis.set(
            xscale="log" if shown else "linear",
            xlabel="tokens trained per parameter (the bar spans b's to a's)",
            ylabel="b − a, test bits per character (95% paired t)",
        )


def verdicts(
    rows: Sequence[Mapping[str, Any]], hypotheses: Sequence[tuple], margin: float
) -> list[confirm.Result]:
    """The hypotheses ``(vocab, fraction, steps, x, y, prediction, from)``
    tested on the test rows of their cells at their budgets, Holm over all
    of them (``confirm.check_hypotheses``, its decision rule)."""
    cells_ = {h[:3] for h in hypotheses}
    tested = [
        r
        for r in rows
        if r["role"] == "test" and (r["vocab"], r["amount"], r["steps_cap"]) in cells_
    ]
    plain = [confirm.Hypothesis(h[0], h[1], *h[3:]) for h in hypotheses]
    return confirm.check_hypotheses(tested, plain, margin)


def write_report(
    rows: Sequence[Mapping[str, Any]],
    out_dir: str,
    cell: tuple[str, float],
    budgets: Sequence[int],
    tables: Sequence[str] = (),
    hypotheses: Sequence[tuple] = (),
    family: Sequence[Mapping[str, Any]] = (),
):
    """``out_dir/REPORT.md`` and :data:`PLOT` from ``rows``: b − a at each
    of ``budgets`` in the ``cell`` (``(vocab, fraction)``) and its change
    from budget to budget, then the profile of each of ``budgets`` that has
    tuning rows (the other tables' too), shortest budget first, its contrast
    at the best rates (``profiles.bootstrap``) and figure; ``tables`` names
    the other tables the rows came from. With ``hypotheses`` (pre-registered,
    :func:`verdicts`, tested on ``rows`` and the rows of the other cells of
    their ``family``), their verdicts and the cell's failed runs
    (``failures.failure_tables``) before the profiles. Returns
    ``(REPORT.md's text, plot paths)``."""
    os.makedirs(out_dir, exist_ok=True)
    vocab, amount = cell
    points = [point(rows, vocab, amount, steps) for steps in sorted(budgets)]
    found = sorted(
        (
            p
            for p in profiles.profiles(rows)
            if (p.vocab, p.amount) == cell
            and p.steps_cap in budgets
            and {"a", "b"} <= set(p.loss)
        ),
        key=lambda p: p.steps_cap,
    )
    label = profiles.cell_text(vocab, amount)
    title = f"{label}: b − a against tokens trained per parameter"
    path = os.path.join(out_dir, PLOT)
    plot_axis(points, title, path)
    seeds = "; ".join(
        f"{t.steps} steps: {', '.join(map(str, sorted(t.per_seed))) or report.DASH}"
        for t in points
    )
    intro = (
        f"# One compute axis: {label}\n\n"
        "Arms a (tied) and b (untied, same shape) at step budgets of "
        f"{', '.join(map(str, sorted(budgets)))}; at each budget both arms on "
        "one learning-rate profile (a shared √2 ladder, three tuning seeds, two "
        "rungs past each arm's best), the cosine ending at the budget, then the "
        "test seeds at each arm's profile-chosen rate. Written from `runs.csv`"
        + (f" and, for the other budgets, {', '.join(tables)}" if tables else "")
        + ". Tokens per parameter: the budget's steps × tokens per step / the "
        "arm's parameters (the untied arm has more, so fewer per parameter). "
        "b − a is in test bits per character over the seeds both arms "
        "finished (> 0: the tied arm better), with its 95% paired t-interval; "
        "the change from one budget to the next is the paired difference of "
        "those differences by seed, with its own"
        + (
            " (where two budgets' test seeds differ, the difference of their "
            "mean b − a with Welch's interval). No interval of these two "
            "tables is adjusted for multiplicity: they are exploratory. The "
            "hypotheses named before the runs are tested below, Holm over "
            "their family. "
            if hypotheses
            else ". No interval here is adjusted for multiplicity: the compute "
            "axis is exploratory, not one of the confirmatory hypotheses. "
        )
        + f"Test seeds: {seeds or report.DASH}."
    )
    sections = [
        intro,
        "## b − a at each budget",
        budget_table(points),
        "## The change from budget to budget",
        change_table(points),
        f"![{title}]({PLOT})",
    ]
    plots = [path]
    if hypotheses:
        own = [r for r in rows if (r["vocab"], r["amount"]) == cell]
        sections += [
            "## The hypotheses named before the runs\n\n"
            + "; ".join(
                f"{profiles.cell_text(h[0], h[1], h[2])}: {h[3]} − {h[4]} "
                + ("> 0" if h[5] > 0 else "< 0" if h[5] < 0 else "≈ 0")
                for h in hypotheses
            )
            + ". Each arm at the rate its profile chose clear of failed runs "
            "(`study.choose_rate`); the decision rule is the confirmatory one.",
            confirm.results_table(
                verdicts(failures.unique_rows([rows, family]), hypotheses, 0.0), 0.0
            ),
            "## Failed runs of this cell (tuning · test runs)",
            failures.failure_tables(own),
        ]
    if found:
        sections += [
            "## The profiles: b − a at the best rates (validation, tuning seeds)",
            profiles.contrast_table(
                [(p, profiles.bootstrap(p, "b", "a")) for p in found], budget=True
            ),
        ]
    for profile in found:
        text, figure = profiles.cell_section(profile, out_dir, budget=True)
        sections.append(text)
        plots.append(figure)
    text, _ = report.write_markdown(out_dir, sections)
    return text, plots


def report_from_csv(
    path: str,
    out_dir: str,
    *,
    cell: tuple[str, float],
    budgets: Sequence[int],
    others: Mapping[str, str] | None = None,
    hypotheses: Sequence[tuple] = (),
    family: Sequence[str] = (),
):
    """:func:`write_report` of the rows of the ``runs.csv`` at ``path`` and
    of the existing tables of ``others`` (label -> path; :func:`joined_rows`),
    with ``hypotheses`` tested on those rows and the existing tables of
    ``family`` (paths)."""
    rows, read = joined_rows(path, others or {})
    kin = [r for p in family if os.path.exists(p) for r in table.read_rows(p)]
    return write_report(rows, out_dir, cell, budgets, read, hypotheses, kin)
