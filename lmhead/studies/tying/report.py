"""The tying study's report: tables, paired differences, plots, and the
comparison with published results, built on the sweep report writer
(``lmhead/lab/report.py``: the mean ± std text, the tables, provenance, the
figures, ``REPORT.md``).

:func:`write_report` reads a study's sweep directory through its design
(:func:`lmhead.studies.tying.results.collect`: the tuning runs, each cell's
chosen learning rate, and the runs of every seed at it) and writes
``REPORT.md``, ``delta_vs_head_share.png`` and ``curves_<regime>.png`` into
an output directory (``docs/tying_study`` for ``make study``). The sweep
file ``configs/sweeps/tying_study.py`` hands its directory here, so
``experiments/report.py`` writes this report for it.

Every number is on the *test* split in bits per character unless a column
says otherwise; validation chose the learning rate and the stopping step.
Means are over seeds with the sample standard deviation; paired differences
are taken seed by seed with a 95% Student t interval (``lmhead/lab/stats.py``).

It is one module, over 400 lines, because it is the report's sections in
the order the report prints them: its tables, plots and totals are each
used once, by :func:`write_report`.
"""

import math
import os

import matplotlib.ticker

from lmhead.lab import report, workdirs
from lmhead.lm import data
from lmhead.studies.tying import literature, shapes, study
from lmhead.studies.tying.results import (
    CellResult,
    cell_values,
    collect,
    head_share,
    paired,
    parameters,
    tied_result,
)

DASH = report.DASH
# (label, minuend arm, subtrahend arm): the paired comparisons, x - y.
COMPARISONS = (("b − a", "b", "a"), ("c − a", "c", "a"), ("d − b", "d", "b"))


# --- Tables ---------------------------------------------------------------------


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
    rows = []
    for r in results:
        shape = r.cell.shape
        finished = r.finished()
        cells = [
            study.vocabulary_label(r.cell.vocab),
            f"{r.cell.arm}: {shapes.ARMS[r.cell.arm]}",
            f"{shape.d_model} × {shape.num_layers}, {shape.mlp_dim}",
            f"{parameters(r):,}",
            f"{head_share(r):.1%}",
            lr_text(r),
            report.mean_std_text(cell_values(r, "test").values()),
            str(len(finished)),
            report.mean_std_text(cell_values(r, "val").values()),
            report.mean_std_text(cell_values(r, "gap").values()),
        ]
        if limited:
            early = cell_values(r, "stopped_early").values()
            cells += [
                report.mean_std_text(cell_values(r, "steps_to_best").values(), 0),
                f"{sum(map(bool, early))} of {len(early)}",
            ]
        cells.append(str(len(design.seeds) - len(finished)))
        rows.append(cells)
    return report.markdown_table(header, rows)


def match_text(results: list[CellResult]) -> str:
    """How closely one regime's matched arms (c with a, d with b) agree in
    parameters (:func:`~lmhead.studies.tying.results.parameters`: the runs'
    own count, else the design's), and each pair outside
    ``shapes.MATCH_TOLERANCE``, whose difference is not at matched size;
    ``""`` when the regime has no matched pair.

    Examples:
        >>> regime = study.Regime("fixed", 1.0, 100, 0)
        >>> def result(arm, count):
        ...     cell = study.Cell(regime, 512, arm, shapes.Shape(arm in "ad", 8, 1, 16), 512)
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
            if abs(off) > shapes.MATCH_TOLERANCE:
                outside.append(
                    f"- {study.vocabulary_label(vocab)}: {x} has {arms[x]:,} parameters, "
                    f"{y} {arms[y]:,} ({off:+.1%}), outside the design's "
                    f"{shapes.MATCH_TOLERANCE:.0%}: the {x} − {y} comparison is not at "
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
    the chosen rate; else the run's status (``workdirs.Run``) or "diverged".

    Examples:
        >>> regime = study.Regime("fixed", 1.0, 100, 0)
        >>> cell = study.Cell(regime, None, "a", shapes.Shape(True, 8, 1, 16), 84)
        >>> def run(status, bits=None):
        ...     summary = {"final": {"eval/loss": 1.0, "eval/bits_per_char": bits}}
        ...     return workdirs.Run("r", "r", {}, {}, [], summary, status)
        >>> result = CellResult(cell, 1e-3, {1e-3: run("finished", 1.5),
        ...                                  2e-3: run("finished", 1.75),
        ...                                  4e-3: run("unfinished")}, {}, 0)
        >>> [tuning_text(result, lr) for lr in (1e-3, 2e-3, 4e-3, 8e-3)]
        ['**1.5000**', '1.7500', 'unfinished', '—']
        >>> import dataclasses
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
    rows = [
        [
            study.vocabulary_label(r.cell.vocab),
            f"{r.cell.arm}: {shapes.ARMS[r.cell.arm]}",
            *(tuning_text(r, lr) for lr in rates),
        ]
        for r in results
    ]
    return report.markdown_table(header, rows)


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
    rows = []
    for vocab in design.vocabularies:
        tied = tied_result(results, vocab)
        cells = [
            study.vocabulary_label(vocab),
            f"{head_share(tied):.1%}" if tied else DASH,
        ]
        for _, x_arm, y_arm in COMPARISONS:
            difference = paired(results, vocab, x_arm, y_arm)
            cells.append(report.interval_text(difference) if difference else DASH)
        train = paired(results, vocab, "a", "b", key="train")
        base = paired(results, vocab, "b", "a")
        cells += [
            report.interval_text(train) if train else DASH,
            str(base.n) if base else DASH,
        ]
        rows.append(cells)
    return report.markdown_table(header, rows)


# --- Plots ----------------------------------------------------------------------


def plot_deltas(
    by_regime: dict[str, list[CellResult]], design: study.Design, path: str
) -> None:
    """Paired test bits/char differences against the tied model's head share,
    with 95% intervals; one panel per regime."""
    title = "Arm differences, mean over seeds, bars: 95% t-interval"
    with report.panels(path, len(by_regime), (6, 4.2), title) as axes:
        for axis, (regime, results) in zip(axes, by_regime.items()):
            shares = {}  # tick -> its vocabulary's label
            for offset, (label, x_arm, y_arm) in zip((0.94, 1.0, 1.06), COMPARISONS):
                points = []
                for vocab in design.vocabularies:
                    tied = tied_result(results, vocab)
                    difference = paired(results, vocab, x_arm, y_arm)
                    if tied and difference and difference.n:
                        points.append((head_share(tied) * offset, difference))
                        shares[head_share(tied)] = (
                            "char" if vocab is None else str(vocab)
                        )
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


def plot_training_curves(
    results: list[CellResult], design: study.Design, path: str
) -> None:
    """Validation (solid) and training-subset (dashed) bits/char of each arm's
    first seed at its chosen rate, at the smallest and largest vocabulary."""
    vocabularies = sorted(
        {design.vocabularies[0], design.vocabularies[-1]}, key=design.vocabularies.index
    )
    with report.panels(path, len(vocabularies), (5.5, 4)) as axes:
        for axis, vocab in zip(axes, vocabularies):
            for result in (r for r in results if r.cell.vocab == vocab):
                run = result.runs.get(design.seeds[0])
                if run is None:
                    continue
                for key, fmt in (
                    ("eval/bits_per_char", "-"),
                    ("train_eval/bits_per_char", "--"),
                ):
                    steps, values = workdirs.curve(run, key)
                    if steps:
                        kind = "val" if key.startswith("eval") else "train"
                        report.plot_curve(
                            axis,
                            steps,
                            values,
                            fmt,
                            color=f"C{'abcd'.index(result.cell.arm)}",
                            label=f"{result.cell.arm} {kind}",
                        )
            axis.set(
                title=f"{results[0].cell.regime.name}, {study.vocabulary_label(vocab)}",
                xlabel="step",
                ylabel="bits/char",
            )
            axis.legend(fontsize=7)


# --- Provenance and splits --------------------------------------------------------


def busy_hours(runs: list[workdirs.Run]) -> tuple[float, int]:
    """Hours the machine spent on ``runs``, overlapping runs counted once: the
    union of the intervals the sweep runner recorded (an ensemble program's
    members share its interval), plus the ``wall_seconds`` of runs without
    one (they ran one at a time; an ensemble program's counted once,
    :func:`lmhead.lab.workdirs.wall_seconds`); and how many runs had an
    interval. Either covers a run's last process only: a
    run resumed after an interruption loses its earlier processes' time.

    Examples:
        >>> def run(interval=None, seconds=0.0):
        ...     return workdirs.Run("r", "r", {}, {}, [], {"wall_seconds": seconds},
        ...                         "finished", 0, interval)
        >>> busy_hours([run((0, 3600)), run((1800, 5400)), run((7200, 9000)),
        ...             run(seconds=1800)])
        (2.5, 3)
    """
    seconds, reached = 0.0, -math.inf
    for started, ended in sorted(r.interval for r in runs if r.interval):
        seconds += max(0.0, ended - max(started, reached))
        reached = max(reached, ended)
    seconds += workdirs.wall_seconds([r for r in runs if not r.interval])
    return seconds / 3600, sum(bool(r.interval) for r in runs)


def steps_trained(summary: dict) -> int:
    """The training steps a finished run took (``summary.json``)."""
    return summary.get("steps_run", summary.get("steps", 0))


def sweep_lines(sweep_dir: str) -> list[str]:
    """The sweep file and the machine, from ``sweep.json``."""
    sweep = workdirs.read_sweep_record(sweep_dir)
    if "sweep" not in sweep:
        return []
    return [f"Sweep: `{sweep['sweep']}`; machine: {sweep.get('machine', '?')}"]


def measured_totals(runs: list[workdirs.Run]) -> str:
    """What the finished ``runs`` (the study's, both stages) took: training
    steps, wall time, the machine's time with overlaps counted once, and the
    training steps alone at each run's median step time."""
    finished_runs = [r for r in runs if r.status == "finished"]
    finished = [r.summary for r in finished_runs]
    hours = workdirs.wall_seconds(finished_runs) / 3600
    busy, intervals = busy_hours(finished_runs)
    steps = sum(map(steps_trained, finished))
    # A median step time ignores a run's pauses (a suspended or preempted
    # process) and load spikes, which its wall_seconds count in full.
    timed = [s for s in finished if "step_ms_p50" in s]
    step_hours = sum(steps_trained(s) * s["step_ms_p50"] for s in timed) / 3.6e6
    return (
        f"{len(finished)} of {len(runs)} runs planned so far finished (both stages); "
        f"measured: {steps:,} training steps, {hours:.2f} h of wall time in all "
        "(the runs' wall_seconds, which count any time a run was paused or "
        "slowed by other work, an ensemble program's once), "
        f"{busy:.2f} h of the machine's time with "
        f"overlapping runs counted once ({intervals} runs timed by the sweep "
        "runner's start and end, the others by their wall_seconds); the "
        "training steps alone, at each run's median "
        f"step time, summed over runs, {step_hours:.2f} h ({len(timed)} runs timed; evaluation "
        "and compilation not included)."
    )


def other_runs_text(sweep_dir: str, runs: list[workdirs.Run]) -> str:
    """The finished runs in ``sweep_dir`` outside ``runs``, the plan read so
    far (a shape or rate the design no longer asks for, or a seed run whose
    cell's tuning is not finished again): their count and cost, which the
    totals leave out; ``""`` when there are none."""
    planned = {r.name for r in runs}
    others = [
        workdirs.read_run(os.path.join(sweep_dir, name))
        for name in sorted(os.listdir(sweep_dir))
        if name not in planned and os.path.isdir(os.path.join(sweep_dir, name))
    ]
    finished_runs = [r for r in others if r.status == "finished"]
    finished = [r.summary for r in finished_runs]
    if not finished:
        return ""
    hours = workdirs.wall_seconds(finished_runs) / 3600
    return (
        f"Not in the plan: {len(finished)} more finished runs in the sweep "
        f"directory (shapes or rates the design no longer asks for), "
        f"{sum(map(steps_trained, finished)):,} training steps and {hours:.2f} h of "
        "wall time, not counted above."
    )


def splits_text(design: study.Design, runs: list[workdirs.Run]) -> str:
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
        f"target shares; `lmhead/lm/data/corpus.py`), of {total:,} characters:",
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


# --- The report -----------------------------------------------------------------


def regime_text(regime: study.Regime) -> str:
    """What a regime trains on, when it stops and which parameters it tests.

    Examples:
        >>> regime_text(study.Regime("fixed", 1.0, 1000, 0))
        '1000 steps on 100% of the training split, last parameters tested'
    """
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


def regime_sections(
    regime: study.Regime, results: list[CellResult], design: study.Design, plot: str
) -> list[str]:
    """The sections of one regime, with its curves plotted to ``plot``."""
    plot_training_curves(results, design, plot)
    return [
        f"## Regime `{regime.name}`: {regime_text(regime)}",
        cell_table(results, design),
        *filter(None, [match_text(results)]),
        "Paired by seed, test bits/char, 95% t-interval "
        "(mean ± t(0.975, n − 1) · s / √n):",
        differences_table(results, design),
        "Numbers for the comparison with published results:",
        "\n".join(literature.literature_numbers(results, design)) or DASH,
        "Learning-rate tuning, seed 0: validation bits/char of the "
        "parameters that would be tested, at each rate (**bold**: "
        "the chosen rate, the lowest validation loss):",
        tuning_table(results),
        f"![curves]({os.path.basename(plot)})",
    ]


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
    costs = [measured_totals(runs), *filter(None, [other_runs_text(sweep_dir, runs)])]
    sections = [
        "# The tying study",
        report.provenance(sweep_lines(sweep_dir), costs),
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
        plots.append(os.path.join(out_dir, f"curves_{name}.png"))
        sections += regime_sections(regime, results_, design, plots[-1])
    sections += [
        "## Published results (untied → tied test perplexity)",
        literature.literature_reference(by_regime, design),
        "## Δ against the head's share",
        f"![delta]({os.path.basename(plots[0])})",
    ]
    text, _ = report.write_markdown(out_dir, sections)
    return text, plots
