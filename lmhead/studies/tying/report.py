"""The tying study's report: tables, paired differences, plots, and the numbers
a comparison with published results needs.

:func:`collect` reads a study's sweep directory through its design
(``lmhead/studies/tying/study.py``): the tuning runs, each cell's chosen learning rate, and
the runs of every seed at it. :func:`write_report` writes ``REPORT.md``,
``delta_vs_head_share.png`` and ``curves_<regime>.png`` into an output
directory (``docs/tying_study`` for ``make study``).

Every number is on the *test* split in bits per character unless a column
says otherwise; validation chose the learning rate and the stopping step.
Means are over seeds with the sample standard deviation; paired differences
are taken seed by seed with a 95% Student t interval (``lmhead/lab/stats.py``).
"""

import dataclasses
import math
import os
import time

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt

from lmhead.lab import stats, sweeps
from lmhead.lm import data
from lmhead.studies.tying import study

DASH = "—"
# (label, minuend arm, subtrahend arm): the paired comparisons, x - y.
COMPARISONS = (("b − a", "b", "a"), ("c − a", "c", "a"), ("d − b", "d", "b"))
# Published tied-vs-untied results, as the relative change of test perplexity
# from untied to tied (negative: tying helps). Word-level perplexities, so they
# compare with ours in sign and rough size only.
LITERATURE = (
    ("Press & Wolf 2017, PTB small (head ≈ 43% of the untied model)", 114.5, 112.4),
    ("Press & Wolf 2017, PTB large", 78.4, 74.3),
    ("Inan et al. 2017, small", 87.3, 85.1),
    ("Inan et al. 2017, medium", 77.7, 73.9),
    ("Inan et al. 2017, large", 72.6, 69.0),
)


@dataclasses.dataclass
class CellResult:
    """A cell's chosen rate, its tuning runs and its runs at the chosen rate.

    Attributes:
        cell: the regime x vocabulary x arm.
        lr: the chosen learning rate (``None`` while its tuning is unfinished).
        tuning: the tuning run (seed 0) at each tried rate.
        runs: seed -> run at ``lr``.
        design_params: the parameter count the design solved for.
    """

    cell: study.Cell
    lr: float | None
    tuning: dict[float, sweeps.Run]
    runs: dict[int, sweeps.Run]
    design_params: int

    def finished(self) -> dict[int, sweeps.Run]:
        return {s: r for s, r in self.runs.items() if r.status == "finished"}


def collect(
    design: study.Design, sweep_dir: str
) -> tuple[list[CellResult], list[sweeps.Run]]:
    """Every cell of ``design`` with its runs read from ``sweep_dir``, and
    every planned run of both stages (those planned so far)."""
    tuning = study.read_tuning(design, sweep_dir)
    chosen = study.choose_learning_rates(tuning, strict=False)
    seed_plan = design.seed_runs({c: chosen.get(c, math.nan) for c in design.cells()})
    seed_plan = [p for p in seed_plan if p.cell in chosen]
    runs = study.read_runs(design, list(tuning) + seed_plan, sweep_dir, known=tuning)
    results = []
    for cell in design.cells():
        lr = chosen.get(cell)
        results.append(
            CellResult(
                cell,
                lr,
                {p.lr: r for p, r in tuning.items() if p.cell == cell},
                {p.seed: r for p, r in runs.items() if p.cell == cell and p.lr == lr},
                study.count_params(cell.vocab_size, cell.shape, design.arch),
            )
        )
    return results, list(runs.values())


# --- Values read from one run ---------------------------------------------------


def evaluated_step(run: sweeps.Run, regime: study.Regime) -> int | None:
    """The step whose parameters the test split evaluated."""
    summary = run.summary or {}
    if regime.patience and "best_step" in summary:
        return summary["best_step"]
    return summary.get("steps_run", summary.get("steps"))


def metrics_at(run: sweeps.Run, step: int | None) -> dict[str, float]:
    """Every ``metrics.jsonl`` value logged at ``step``, merged."""
    merged = {}
    for record in run.metrics:
        if record.get("step") == step:
            merged.update(record)
    return merged


def run_values(run: sweeps.Run, regime: study.Regime) -> dict[str, float]:
    """Test and validation bits/char, training bits/char at the tested step,
    steps to best, and parameters of a finished run."""
    summary = run.summary or {}
    validation = study.validation_metrics(run, regime)
    step = evaluated_step(run, regime)
    train = summary.get("train_at_best") if regime.patience else None
    train = train or metrics_at(run, step)
    values = {
        "test": summary.get("test", {}).get("bits_per_char"),
        "val": validation.get("eval/bits_per_char"),
        "train": train.get("train_eval/bits_per_char"),
        "steps_to_best": summary.get("best_step"),
        "stopped_early": summary.get("stopped_early"),
        "num_params": summary.get("num_params"),
        "vocab_size": summary.get("vocab_size"),
        "wall_seconds": summary.get("wall_seconds", 0.0),
    }
    test = summary.get("test", {})
    if test.get("num_tokens"):
        values["chars_per_token"] = test["num_chars"] / test["num_tokens"]
    if values["train"] is not None and values["val"] is not None:
        values["gap"] = values["train"] - values["val"]
    return values


def by_seed(result: CellResult, key: str) -> dict[int, float]:
    """``key`` of :func:`run_values` for each finished seed that has it."""
    values = {
        s: run_values(r, result.cell.regime).get(key)
        for s, r in result.finished().items()
    }
    return {s: v for s, v in values.items() if v is not None}


def parameters(result: CellResult) -> int:
    """The runs' parameter count (the design's before any run finished)."""
    counts = set(by_seed(result, "num_params").values())
    return counts.pop() if len(counts) == 1 else result.design_params


def head_share(result: CellResult) -> float:
    vocab_size = next(
        iter(by_seed(result, "vocab_size").values()), result.cell.vocab_size
    )
    return study.head_share(vocab_size, result.cell.shape.d_model, parameters(result))


# --- Tables ---------------------------------------------------------------------


def mean_std_text(values, decimals: int = 4) -> str:
    """``"mean ± std"``; one value alone; a dash for none.

    Examples:
        >>> mean_std_text([1.0, 2.0, 3.0]), mean_std_text([2.5], 1), mean_std_text([])
        ('2.0000 ± 1.0000', '2.5', '—')
    """
    mean, std, n = stats.mean_std(list(values))
    if n == 0:
        return DASH
    return (
        f"{mean:.{decimals}f}"
        if n == 1
        else f"{mean:.{decimals}f} ± {std:.{decimals}f}"
    )


def interval_text(difference: stats.PairedDifference) -> str:
    """``"+mean [low, high]"``, the mean alone for one pair, a dash for none.

    Examples:
        >>> interval_text(stats.paired_difference({0: 2.0, 1: 3.0, 2: 4.0},
        ...                                       {0: 1.0, 1: 1.0, 2: 1.0}))
        '+2.0000 [-0.4841, +4.4841]'
    """
    if difference.n == 0:
        return DASH
    if difference.n == 1:
        return f"{difference.mean:+.4f}"
    return f"{difference.mean:+.4f} [{difference.low:+.4f}, {difference.high:+.4f}]"


def lr_text(result: CellResult) -> str:
    """The chosen rate; "(edge)" when it is the highest or lowest of three or
    more that the cell tried (its optimum may lie past them)."""
    if result.lr is None:
        return "tuning unfinished"
    rates = result.tuning
    edge = len(rates) > 2 and result.lr in (min(rates), max(rates))
    return f"{result.lr:g}" + (" (edge)" if edge else "")


def cell_table(results: list[CellResult], design: study.Design) -> str:
    """One row per vocabulary x arm of one regime."""
    limited = bool(results[0].cell.regime.patience)
    header = [
        "vocabulary",
        "arm",
        "d_model × layers, MLP",
        "parameters",
        "head share",
        "lr",
        "test bits/char",
        "n",
        "val bits/char",
        "train − val bits/char",
        *(["steps to best", "stopped early"] if limited else []),
        "not finished",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        shape = r.cell.shape
        finished = r.finished()
        cells = [
            study.vocabulary_label(r.cell.vocab),
            f"{r.cell.arm}: {study.ARMS[r.cell.arm]}",
            f"{shape.d_model} × {shape.num_layers}, {shape.mlp_dim}",
            f"{parameters(r):,}",
            f"{head_share(r):.1%}",
            lr_text(r),
            mean_std_text(by_seed(r, "test").values()),
            str(len(finished)),
            mean_std_text(by_seed(r, "val").values()),
            mean_std_text(by_seed(r, "gap").values()),
        ]
        if limited:
            early = by_seed(r, "stopped_early").values()
            cells += [
                mean_std_text(by_seed(r, "steps_to_best").values(), 0),
                f"{sum(map(bool, early))} of {len(early)}",
            ]
        cells.append(str(len(design.seeds) - len(finished)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def match_text(results: list[CellResult]) -> str:
    """How closely one regime's matched arms (c with a, d with b) agree in
    parameters (:func:`parameters`: the runs' own count, else the design's),
    and each pair outside ``study.MATCH_TOLERANCE``, whose difference is not
    at matched size; ``""`` when the regime has no matched pair.

    Examples:
        >>> regime = study.Regime("fixed", 1.0, 100, 0)
        >>> def result(arm, count):
        ...     cell = study.Cell(regime, 512, arm, study.Shape(arm in "ad", 8, 1, 16), 512)
        ...     return CellResult(cell, None, {}, {}, count)
        >>> print(match_text([result("a", 1000), result("b", 1500),
        ...                   result("c", 1005), result("d", 1400)]))
        Parameter counts (the runs' own, else the design's): c is within 0.50% of a, d within 6.67% of b.
        - BPE 512: d has 1,400 parameters, b 1,500 (-6.7%), outside the design's 2%: the d − b comparison is not at matched size.
    """
    worst, outside = {}, []
    for vocab in dict.fromkeys(r.cell.vocab for r in results):
        arms = {r.cell.arm: parameters(r) for r in results if r.cell.vocab == vocab}
        for x, y in (("c", "a"), ("d", "b")):
            if x not in arms or y not in arms:
                continue
            off = (arms[x] - arms[y]) / arms[y]
            worst[x, y] = max(worst.get((x, y), 0.0), abs(off))
            if abs(off) > study.MATCH_TOLERANCE:
                outside.append(
                    f"- {study.vocabulary_label(vocab)}: {x} has {arms[x]:,} parameters, "
                    f"{y} {arms[y]:,} ({off:+.1%}), outside the design's "
                    f"{study.MATCH_TOLERANCE:.0%}: the {x} − {y} comparison is not at "
                    "matched size."
                )
    if not worst:
        return ""
    return "\n".join(
        [
            "Parameter counts (the runs' own, else the design's): "
            + ", ".join(
                f"{x} {'is ' if i == 0 else ''}within {off:.2%} of {y}"
                for i, ((x, y), off) in enumerate(worst.items())
            )
            + ".",
            *outside,
        ]
    )


def tuning_text(result: CellResult, lr: float) -> str:
    """Validation bits/char of ``result``'s tuning run at ``lr``, in bold at
    the chosen rate; else the run's status (``sweeps.Run``) or "diverged".

    Examples:
        >>> regime = study.Regime("fixed", 1.0, 100, 0)
        >>> cell = study.Cell(regime, None, "a", study.Shape(True, 8, 1, 16), 84)
        >>> def run(status, bits=None):
        ...     summary = {"final": {"eval/loss": 1.0, "eval/bits_per_char": bits}}
        ...     return sweeps.Run("r", "r", {}, {}, [], summary, status)
        >>> result = CellResult(cell, 1e-3, {1e-3: run("finished", 1.5),
        ...                                  2e-3: run("finished", 1.75),
        ...                                  4e-3: run("unfinished")}, {}, 0)
        >>> [tuning_text(result, lr) for lr in (1e-3, 2e-3, 4e-3, 8e-3)]
        ['**1.5000**', '1.7500', 'unfinished', '—']
        >>> lr_text(result), lr_text(dataclasses.replace(result, lr=2e-3))
        ('0.001 (edge)', '0.002')
    """
    run = result.tuning.get(lr)
    if run is None:
        return DASH  # the cell did not try this rate
    if run.status != "finished":
        return run.status
    if math.isinf(study.validation_loss(run, result.cell.regime)):
        return "diverged"
    bits = study.validation_metrics(run, result.cell.regime).get("eval/bits_per_char")
    if bits is None:
        return DASH
    text = f"{bits:.4f}"
    return f"**{text}**" if lr == result.lr else text


def tuning_table(results: list[CellResult]) -> str:
    """One row per vocabulary x arm: validation bits/char at each learning rate
    that any cell tried (a dash where this one did not)."""
    rates = sorted({lr for r in results for lr in r.tuning})
    header = ["vocabulary", "arm", *(f"lr {lr:g}" for lr in rates)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        cells = [
            study.vocabulary_label(r.cell.vocab),
            f"{r.cell.arm}: {study.ARMS[r.cell.arm]}",
            *(tuning_text(r, lr) for lr in rates),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired(
    results: list[CellResult], vocab, x_arm: str, y_arm: str, key: str = "test"
) -> stats.PairedDifference | None:
    """``x_arm - y_arm`` of ``key`` at one vocabulary, paired by seed; ``None``
    when the regime lacks one of the arms."""
    arms = {r.cell.arm: r for r in results if r.cell.vocab == vocab}
    if x_arm not in arms or y_arm not in arms:
        return None
    return stats.paired_difference(by_seed(arms[x_arm], key), by_seed(arms[y_arm], key))


def differences_table(results: list[CellResult], design: study.Design) -> str:
    """Paired test bits/char differences per vocabulary, and the training
    bits/char difference a - b (tying as a regularizer fits training text worse)."""
    header = [
        "vocabulary",
        "head share of a",
        *(f"{label} [95% interval]" for label, _, _ in COMPARISONS),
        "training a − b [95% interval]",
        "seed pairs (b − a)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for vocab in design.vocabularies:
        tied = next(
            (r for r in results if r.cell.vocab == vocab and r.cell.arm == "a"), None
        )
        cells = [
            study.vocabulary_label(vocab),
            f"{head_share(tied):.1%}" if tied else DASH,
        ]
        for _, x_arm, y_arm in COMPARISONS:
            difference = paired(results, vocab, x_arm, y_arm)
            cells.append(interval_text(difference) if difference else DASH)
        train = paired(results, vocab, "a", "b", key="train")
        base = paired(results, vocab, "b", "a")
        cells += [
            interval_text(train) if train else DASH,
            str(base.n) if base else DASH,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def literature_numbers(results: list[CellResult], design: study.Design) -> list[str]:
    """Lines with the study's counterpart of each published claim."""
    lines = []
    for vocab in design.vocabularies:
        tied_minus_untied = paired(results, vocab, "a", "b")
        if not tied_minus_untied or tied_minus_untied.n == 0:
            continue
        tied = next(r for r in results if r.cell.vocab == vocab and r.cell.arm == "a")
        chars_per_token = stats.mean_std(
            list(by_seed(tied, "chars_per_token").values())
        )[0]
        change = 2 ** (tied_minus_untied.mean * chars_per_token) - 1
        parts = [
            f"{study.vocabulary_label(vocab)} (head {head_share(tied):.1%} of a): "
            f"tied − untied (a − b) {interval_text(tied_minus_untied)} bits/char"
            + (
                ""
                if math.isnan(change)
                else f", test perplexity per token {change:+.2%} untied → tied"
            )
        ]
        for label, x_arm, y_arm, claim in (
            (
                "training bits/char a − b",
                "a",
                "b",
                "train",
            ),
            ("untied matched to a, c − a", "c", "a", "test"),
            ("tied deeper matched to b, d − b", "d", "b", "test"),
        ):
            difference = paired(results, vocab, x_arm, y_arm, key=claim)
            if difference and difference.n:
                parts.append(f"{label} {interval_text(difference)}")
        lines.append("- " + "; ".join(parts) + ".")
    return lines


# What other published results predict for this study's comparisons:
# (source and setting, its result, the prediction here, and the paired
# differences (x arm, y arm, run value) that test it).
PREDICTIONS = (
    (
        "Press & Wolf 2017; Inan et al. 2017 (PTB, LSTMs, 10k words)",
        "tying lowers test perplexity 2-5% (above) and raises training perplexity",
        "b − a > 0 on test, training a − b > 0, most where the head's share is "
        "largest; the `limited` regime",
        (("b", "a", "test"), ("a", "b", "train")),
    ),
    (
        "MobileLLM (Liu et al. 2024, 125M)",
        "sharing the embedding costs 0.2 points of accuracy; spending the saved "
        "parameters on depth recovers it",
        "d − b ≤ 0: tied and deeper matches or beats untied at equal parameters",
        (("d", "b", "test"),),
    ),
    (
        "Chung et al. 2021 (rethinking embedding coupling)",
        "decoupled input and output embeddings of equal size are about neutral",
        "c − a ≈ 0 at equal parameters",
        (("c", "a", "test"),),
    ),
    (
        "modded-nanogpt (124M, abundant data)",
        "untied 3.2755 vs tied 3.2776 validation loss",
        "b − a slightly < 0 in the `fixed` regime, where data is not the limit",
        (("b", "a", "test"),),
    ),
)


def signs_text(
    results: list[CellResult], design: study.Design, x_arm: str, y_arm: str, key: str
) -> str:
    """Over the vocabularies of one regime's ``results``: at how many the
    paired ``x - y`` of ``key`` is above zero, and at how many its 95%
    interval lies above or below zero (vocabularies with fewer than two seed
    pairs, or a non-finite difference, are left out).

    Examples:
        >>> regime = study.Regime("fixed", 1.0, 100, 0)
        >>> def result(arm, losses):
        ...     cell = study.Cell(regime, None, arm, study.Shape(arm == "a", 8, 1, 16), 84)
        ...     runs = {s: sweeps.Run("r", "r", {}, {}, [], {"test": {
        ...         "bits_per_char": v}}, "finished") for s, v in enumerate(losses)}
        ...     return CellResult(cell, 1e-3, {}, runs, 1000)
        >>> design = study.Design("tiny", {}, (regime,), (None,), ("a", "b"), (1e-3,),
        ...                       (0, 1, 2))
        >>> signs_text([result("a", [2.0, 2.1, 2.2]), result("b", [2.1, 2.2, 2.3])],
        ...            design, "b", "a", "test")
        '> 0 at 1 of 1 (interval above 0 at 1, below at 0)'
        >>> signs_text([result("a", [2.0]), result("b", [2.1])], design, "b", "a", "test")
        'no seed pairs yet'
    """
    if len({r.cell.regime for r in results}) > 1:
        raise ValueError("signs_text takes one regime's results.")
    differences = [
        d
        for d in (
            paired(results, vocab, x_arm, y_arm, key) for vocab in design.vocabularies
        )
        if d and d.n >= 2 and math.isfinite(d.mean)
    ]
    if not differences:
        return "no seed pairs yet"
    positive = sum(d.mean > 0 for d in differences)
    above = sum(d.low > 0 for d in differences)
    below = sum(d.high < 0 for d in differences)
    return (
        f"> 0 at {positive} of {len(differences)} (interval above 0 at {above}, "
        f"below at {below})"
    )


def literature_reference(
    by_regime: dict[str, list[CellResult]], design: study.Design
) -> str:
    """The published perplexities, then what each source predicts here and
    what this study found: per regime, the sign of each paired difference
    that tests the prediction, counted over vocabularies."""
    lines = [
        f"- {name}: {untied} → {tied} ({tied / untied - 1:+.1%})"
        for name, untied, tied in LITERATURE
    ]
    lines += [
        "",
        "What they predict for this study's comparisons, and what it found "
        "(over the vocabularies: how many paired differences are above zero, "
        "and how many 95% intervals lie wholly above or below it):",
        "",
        "| source | its result | prediction here | found here |",
        "|---|---|---|---|",
    ]
    for source, result, prediction, checks in PREDICTIONS:
        found = "<br>".join(
            f"`{regime}` {'training ' if key == 'train' else ''}{x} − {y}: "
            + signs_text(results, design, x, y, key)
            for regime, results in by_regime.items()
            for x, y, key in checks
            if any(r.cell.arm == x for r in results)
            and any(r.cell.arm == y for r in results)
        )
        lines.append(f"| {source} | {result} | {prediction} | {found or DASH} |")
    return "\n".join(lines)


# --- Plots ----------------------------------------------------------------------


def plot_deltas(
    by_regime: dict[str, list[CellResult]], design: study.Design, path: str
) -> None:
    """Paired test bits/char differences against the tied model's head share,
    with 95% intervals; one panel per regime."""
    figure, axes = plt.subplots(
        1, len(by_regime), squeeze=False, figsize=(6 * len(by_regime), 4.2)
    )
    for axis, (regime, results) in zip(axes[0], by_regime.items()):
        shares = {}  # tick -> its vocabulary's label
        for offset, (label, x_arm, y_arm) in zip((0.94, 1.0, 1.06), COMPARISONS):
            points = []
            for vocab in design.vocabularies:
                tied = next(
                    (r for r in results if r.cell.vocab == vocab and r.cell.arm == "a"),
                    None,
                )
                difference = paired(results, vocab, x_arm, y_arm)
                if tied and difference and difference.n:
                    points.append((head_share(tied) * offset, difference))
                    shares[head_share(tied)] = "char" if vocab is None else str(vocab)
            if not points:
                continue
            errors = [
                [0.0 if d.n < 2 else d.mean - d.low for _, d in points],
                [0.0 if d.n < 2 else d.high - d.mean for _, d in points],
            ]
            axis.errorbar(
                [x for x, _ in points],
                [d.mean for _, d in points],
                yerr=errors,
                marker="o",
                capsize=3,
                label=label,
            )
        axis.axhline(0.0, color="gray", linewidth=0.8)
        axis.set(
            xscale="log",
            title=regime,
            xlabel="head share of the tied model's parameters (vocabulary: "
            "characters or BPE size)",
            ylabel="Δ test bits/char (paired by seed)",
        )
        # One tick per vocabulary, at its share, instead of log-scale decades.
        axis.set_xticks(
            list(shares), [f"{share:.1%}\n{name}" for share, name in shares.items()]
        )
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.legend()
    figure.suptitle("Arm differences, mean over seeds, bars: 95% t-interval")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_curves(results: list[CellResult], design: study.Design, path: str) -> None:
    """Validation (solid) and training-subset (dashed) bits/char of each arm's
    first seed at its chosen rate, at the smallest and largest vocabulary."""
    vocabularies = sorted(
        {design.vocabularies[0], design.vocabularies[-1]}, key=design.vocabularies.index
    )
    figure, axes = plt.subplots(
        1, len(vocabularies), squeeze=False, figsize=(5.5 * len(vocabularies), 4)
    )
    for axis, vocab in zip(axes[0], vocabularies):
        for result in (r for r in results if r.cell.vocab == vocab):
            run = result.runs.get(design.seeds[0])
            if run is None:
                continue
            for key, style in (
                ("eval/bits_per_char", "-"),
                ("train_eval/bits_per_char", "--"),
            ):
                steps, values = _curve(run, key)
                if steps:
                    axis.plot(
                        steps,
                        values,
                        style,
                        color=f"C{'abcd'.index(result.cell.arm)}",
                        label=f"{result.cell.arm} {'val' if key.startswith('eval') else 'train'}",
                    )
        axis.set(
            title=f"{results[0].cell.regime.name}, {study.vocabulary_label(vocab)}",
            xlabel="step",
            ylabel="bits/char",
        )
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _curve(run: sweeps.Run, key: str) -> tuple[list[int], list[float]]:
    points = [(m["step"], m[key]) for m in run.metrics if key in m]
    return [s for s, _ in points], [v for _, v in points]


# --- The report -----------------------------------------------------------------


def busy_hours(runs: list[sweeps.Run]) -> tuple[float, int]:
    """Hours the machine spent on ``runs``, overlapping runs counted once: the
    union of the intervals the sweep runner recorded, plus the
    ``wall_seconds`` of runs without one (they ran one at a time); and how
    many runs had an interval. Either covers a run's last process only: a
    run resumed after an interruption loses its earlier processes' time.

    Examples:
        >>> def run(interval=None, seconds=0.0):
        ...     return sweeps.Run("r", "r", {}, {}, [], {"wall_seconds": seconds},
        ...                       "finished", 0, interval)
        >>> busy_hours([run((0, 3600)), run((1800, 5400)), run((7200, 9000)),
        ...             run(seconds=1800)])
        (2.5, 3)
    """
    seconds, reached = 0.0, -math.inf
    for started, ended in sorted(r.interval for r in runs if r.interval):
        seconds += max(0.0, ended - max(started, reached))
        reached = max(reached, ended)
    seconds += sum(
        (r.summary or {}).get("wall_seconds", 0.0) for r in runs if not r.interval
    )
    return seconds / 3600, sum(bool(r.interval) for r in runs)


def provenance(sweep_dir: str, runs: list[sweeps.Run]) -> str:
    """Command, machine, and the measured totals of the study's ``runs``."""
    sweep = sweeps.read_sweep_record(sweep_dir)
    finished_runs = [r for r in runs if r.status == "finished"]
    finished = [r.summary for r in finished_runs]
    hours = sum(s.get("wall_seconds", 0.0) for s in finished) / 3600
    busy, intervals = busy_hours(finished_runs)
    steps = sum(map(_steps, finished))
    # A median step time ignores a run's pauses (a suspended or preempted
    # process) and load spikes, which its wall_seconds count in full.
    timed = [s for s in finished if "step_ms_p50" in s]
    step_hours = sum(_steps(s) * s["step_ms_p50"] for s in timed) / 3.6e6
    return "  \n".join(
        [
            *(
                [f"Sweep: `{sweep['sweep']}`; machine: {sweep.get('machine', '?')}"]
                if "sweep" in sweep
                else []
            ),
            f"{len(finished)} of {len(runs)} runs planned so far finished (both stages); "
            f"measured: {steps:,} training steps, {hours:.2f} h of wall time in all "
            "(the runs' wall_seconds, which count any time a run was paused or "
            f"slowed by other work), {busy:.2f} h of the machine's time with "
            f"overlapping runs counted once ({intervals} runs timed by the sweep "
            "runner's start and end, the others by their wall_seconds); the "
            "training steps alone, at each run's median "
            f"step time, summed over runs, {step_hours:.2f} h ({len(timed)} runs timed; evaluation "
            "and compilation not included).",
            *([outside] if (outside := other_runs_text(sweep_dir, runs)) else []),
            f"Report written {time.strftime('%Y-%m-%d %H:%M')}.",
        ]
    )


def _steps(summary: dict) -> int:
    """The training steps a finished run took."""
    return summary.get("steps_run", summary.get("steps", 0))


def other_runs_text(sweep_dir: str, runs: list[sweeps.Run]) -> str:
    """The finished runs in ``sweep_dir`` outside ``runs``, the plan read so
    far (a shape or rate the design no longer asks for, or a seed run whose
    cell's tuning is not finished again): their count and cost, which the
    totals leave out; ``""`` when there are none."""
    planned = {r.name for r in runs}
    others = [
        sweeps.read_run(os.path.join(sweep_dir, name))
        for name in sorted(os.listdir(sweep_dir))
        if name not in planned and os.path.isdir(os.path.join(sweep_dir, name))
    ]
    finished = [r.summary for r in others if r.status == "finished"]
    if not finished:
        return ""
    hours = sum(s.get("wall_seconds", 0.0) for s in finished) / 3600
    return (
        f"Not in the plan: {len(finished)} more finished runs in the sweep "
        f"directory (shapes or rates the design no longer asks for), "
        f"{sum(map(_steps, finished)):,} training steps and {hours:.2f} h of "
        "wall time, not counted above."
    )


def splits_text(design: study.Design, runs: list[sweeps.Run]) -> str:
    """Which text each split holds, from the runs' data config: the works and
    their share of the corpus's characters for ``data.split="works"`` on the
    embedded corpus; the config's fractions otherwise."""
    config = next((r.config["data"] for r in runs if "data" in r.config), None)
    if config is None:
        return "Splits: no run has written its config yet."
    if config.get("split") != "works" or config.get("path"):
        return (
            f"Splits: `data.split={config.get('split')!r}`, validation "
            f"{config.get('val_fraction', 0):.0%} and test "
            f"{config.get('test_fraction', 0):.0%} of the characters."
        )
    fractions = (
        f"validation {config['val_fraction']:.0%}, "
        f"test {config['test_fraction']:.0%} of the characters"
    )
    works = data.shakespeare_works()
    names = data.assign_works(works, config["val_fraction"], config["test_fraction"])
    total = sum(map(len, works.values()))
    size = {split: sum(len(works[n]) for n in names[split]) for split in names}
    limited = [r for r in design.regimes if r.train_fraction < 1]
    lines = [
        f'Splits (`data.split="works"`: whole works, {fractions} as the '
        f"target shares; `lmhead/lm/data.py`), of {total:,} characters:",
        *(
            f"- {title}: {', '.join(names[split])} ({size[split] / total:.1%})"
            for title, split in (("test", "test"), ("validation", "val"))
        ),
        f"- training: the other {len(names['train'])} works "
        f"({size['train'] / total:.1%})"
        + "".join(
            f"; regime `{r.name}` trains on their first "
            f"{r.train_fraction:.0%} ({int(size['train'] * r.train_fraction):,}"
            " characters)"
            for r in limited
        ),
    ]
    return "\n".join(lines)


def write_report(
    design: study.Design, sweep_dir: str, out_dir: str
) -> tuple[str, list[str]]:
    """Writes ``REPORT.md`` and the plots into ``out_dir``; returns the
    report's text and the plot paths."""
    results, runs = collect(design, sweep_dir)
    by_regime = {
        regime.name: [r for r in results if r.cell.regime == regime]
        for regime in design.regimes
    }
    os.makedirs(out_dir, exist_ok=True)
    plots = [os.path.join(out_dir, "delta_vs_head_share.png")]
    plot_deltas(by_regime, design, plots[0])
    sections = [
        "# The tying study",
        provenance(sweep_dir, runs),
        splits_text(design, runs),
        f"Test split, bits per character: mean ± sample std over seeds "
        f"{', '.join(map(str, design.seeds))} at each cell's learning rate "
        f"(seed {design.seeds[0]}'s run there is its tuning run; the rate is "
        'chosen on validation; "edge": the best rate '
        "is the highest or lowest the cell tried, after "
        f"{design.extend_edges} rate(s) past each end of the grid at most). "
        "Head share: the [V, D] unembedding's "
        "share of the arm's parameters (a tied table counts). "
        "train − val: training-subset minus validation bits/char at the "
        "tested step.",
    ]
    for (name, results_), regime in zip(by_regime.items(), design.regimes):
        plot = os.path.join(out_dir, f"curves_{name}.png")
        plot_curves(results_, design, plot)
        plots.append(plot)
        sections += [
            f"## Regime `{name}`: {_describe(regime)}",
            cell_table(results_, design),
            *filter(None, [match_text(results_)]),
            "Paired by seed, test bits/char, 95% t-interval "
            "(mean ± t(0.975, n − 1) · s / √n):",
            differences_table(results_, design),
            "Numbers for the comparison with published results:",
            "\n".join(literature_numbers(results_, design)) or DASH,
            "Learning-rate tuning, seed 0: validation bits/char of the "
            "parameters that would be tested, at each rate (**bold**: "
            "the chosen rate, the lowest validation loss):",
            tuning_table(results_),
            f"![curves]({os.path.basename(plot)})",
        ]
    sections += [
        "## Published results (untied → tied test perplexity)",
        literature_reference(by_regime, design),
        "## Δ against the head's share",
        f"![delta]({os.path.basename(plots[0])})",
    ]
    text = "\n\n".join(sections) + "\n"
    with open(os.path.join(out_dir, "REPORT.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text, plots


def _describe(regime: study.Regime) -> str:
    if regime.patience:
        return (
            f"the first {regime.train_fraction:.0%} of the training split, early "
            f"stopping (patience {regime.patience} evaluations, at most "
            f"{regime.steps} steps), best checkpoint tested"
        )
    return (
        f"{regime.steps} steps on {regime.train_fraction:.0%} of the training "
        "split, last parameters tested"
    )
