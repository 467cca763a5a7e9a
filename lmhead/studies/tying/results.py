"""The tying study's runs read back by cell: each cell's chosen learning rate,
its tuning runs and its runs of every seed at that rate (:func:`collect`),
and the values the report tables and compares (:func:`run_values`,
:func:`cell_values`, :func:`paired`).

Every value is on the *test* split in bits per character unless its key
says otherwise (``val``, ``train``); validation chose the learning rate and
the stopping step.
"""

import dataclasses
import math

from lmhead.lab import report, stats, workdirs
from lmhead.studies.tying import shapes, study


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
    tuning: dict[float, workdirs.Run]
    runs: dict[int, workdirs.Run]
    design_params: int

    def finished(self) -> dict[int, workdirs.Run]:
        return {s: r for s, r in self.runs.items() if r.status == "finished"}


def collect(
    design: study.Design, sweep_dir: str
) -> tuple[list[CellResult], list[workdirs.Run]]:
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
                shapes.count_params(cell.vocab_size, cell.shape, design.arch),
            )
        )
    return results, list(runs.values())


# --- Values read from one run ---------------------------------------------------


def evaluated_step(run: workdirs.Run, regime: study.Regime) -> int | None:
    """The step whose parameters the test split evaluated."""
    summary = run.summary or {}
    if regime.patience and "best_step" in summary:
        return summary["best_step"]
    return summary.get("steps_run", summary.get("steps"))


def metrics_at(run: workdirs.Run, step: int | None) -> dict[str, float]:
    """Every ``metrics.jsonl`` value logged at ``step``, merged."""
    merged = {}
    for record in run.metrics:
        if record.get("step") == step:
            merged.update(record)
    return merged


def run_values(run: workdirs.Run, regime: study.Regime) -> dict[str, float]:
    """Test and validation bits/char, training bits/char at the tested step,
    steps to best, and parameters of a finished run.

    Examples:
        >>> regime = study.Regime("limited", 0.5, 100, 3)
        >>> summary = {"test": {"bits_per_char": 2.0, "num_tokens": 10, "num_chars": 25},
        ...            "best": {"eval/bits_per_char": 2.1}, "best_step": 40,
        ...            "train_at_best": {"train_eval/bits_per_char": 1.6}}
        >>> values = run_values(workdirs.Run("r", "r", {}, {}, [], summary, "finished"),
        ...                     regime)
        >>> values["test"], values["chars_per_token"], round(values["gap"], 4)
        (2.0, 2.5, -0.5)
    """
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


# --- Values of one cell ------------------------------------------------------------


def cell_values(result: CellResult, key: str) -> dict[int, float]:
    """``key`` of :func:`run_values` for each finished seed that has it."""
    return report.by_seed(
        result.finished().items(),
        key,
        lambda run: run_values(run, result.cell.regime),
    )


def parameters(result: CellResult) -> int:
    """The runs' parameter count (the design's before any run finished)."""
    counts = set(cell_values(result, "num_params").values())
    return counts.pop() if len(counts) == 1 else result.design_params


def head_share(result: CellResult) -> float:
    """The ``[V, D]`` table's share of the cell's parameters, at the
    vocabulary size its runs report (the design's before any finished)."""
    vocab_size = next(
        iter(cell_values(result, "vocab_size").values()), result.cell.vocab_size
    )
    return shapes.head_share(vocab_size, result.cell.shape.d_model, parameters(result))


def paired(
    results: list[CellResult], vocab, x_arm: str, y_arm: str, key: str = "test"
) -> stats.PairedDifference | None:
    """``x_arm - y_arm`` of ``key`` at one vocabulary, paired by seed; ``None``
    when the regime lacks one of the arms."""
    arms = {r.cell.arm: r for r in results if r.cell.vocab == vocab}
    if x_arm not in arms or y_arm not in arms:
        return None
    return stats.paired_difference(
        cell_values(arms[x_arm], key), cell_values(arms[y_arm], key)
    )


def tied_result(results: list[CellResult], vocab) -> CellResult | None:
    """The tied arm ``a``'s cell at ``vocab``, if the regime has it."""
    return next(
        (r for r in results if r.cell.vocab == vocab and r.cell.arm == "a"), None
    )
