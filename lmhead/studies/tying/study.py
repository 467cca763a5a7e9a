"""The tying study's design: the grid of regimes x vocabularies x arms
(:class:`Design`), and the learning-rate choice that links its two stages.
The arms and their shapes, solved for matched parameter counts, are in
``shapes.py`` here.

The study runs in two stages in one sweep directory: a tuning stage (every
arm at several learning rates, seed 0), then the seeds stage, which reads the
tuning runs back (:func:`choose_learning_rates`), keeps each cell's best rate
on validation and adds seeds at it. The tuning run at the chosen rate is the
seeds stage's seed 0, so no run is repeated.

A grid whose best rate is at one of its ends has not bracketed the optimum.
With ``Design.extend_edges = n``, the tuning stage then tries the next rate
outward (twice the highest, or half the lowest), up to ``n`` times per cell,
as the results come in (:meth:`Design.tuning_runs`,
:func:`read_tuning`); a cell still best at an end after that is reported as
such.
"""

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lmhead.lab import sweeps, workdirs
from lmhead.studies.tying import shapes

# Distinct characters of the embedded corpus: the character vocabulary.
CHAR_VOCAB_SIZE = 84
# A grid's end extends by this factor: twice the highest rate, half the lowest.
EDGE_FACTOR = 2.0


# --- The grid ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Regime:
    """How much text a run trains on and when it stops.

    ``patience = 0``: a fixed number of steps, the last parameters tested;
    ``patience > 0``: early stopping on validation, the best ones tested.
    """

    name: str
    train_fraction: float
    steps: int
    patience: int

    def overrides(self) -> dict[str, Any]:
        return {
            "data.train_fraction": self.train_fraction,
            "train.steps": self.steps,
            "train.patience": self.patience,
        }


def vocabulary_overrides(vocab_size: int | None) -> dict[str, Any]:
    """``None``: characters; else byte-level BPE with ``vocab_size`` tokens.

    Examples:
        >>> vocabulary_overrides(None), vocabulary_overrides(512)
        ({'data.tokenizer': 'char'}, {'data.tokenizer': 'bpe', 'data.vocab_size': 512})
    """
    if vocab_size is None:
        return {"data.tokenizer": "char"}
    return {"data.tokenizer": "bpe", "data.vocab_size": vocab_size}


def vocabulary_label(vocab_size: int | None) -> str:
    return f"char ({CHAR_VOCAB_SIZE})" if vocab_size is None else f"BPE {vocab_size}"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One regime x vocabulary x arm: the unit that gets a learning rate and seeds."""

    regime: Regime
    vocab: int | None  # None: characters
    arm: str
    shape: shapes.Shape
    # The tokens the regime's tokenizer has, which the shape is matched at:
    # ``vocab`` or fewer (BPE on a short text runs out of pairs to merge).
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """A cell trained at one learning rate and seed."""

    cell: Cell
    lr: float
    seed: int

    def overrides(self, min_lr_ratio: float) -> dict[str, Any]:
        """The run's overrides, always in the same order (its name depends on it)."""
        return {
            **self.cell.regime.overrides(),
            **vocabulary_overrides(self.cell.vocab),
            **self.cell.shape.overrides(),
            "optim.lr": self.lr,
            "optim.min_lr": round(self.lr * min_lr_ratio, 12),
            "train.seed": self.seed,
        }


@dataclasses.dataclass(frozen=True)
class Design:
    """The study: ``base`` config argument and ``shared`` overrides for every run,
    and the axes. The first seed is the tuning seed."""

    base: str
    shared: dict[str, Any]
    regimes: tuple[Regime, ...]
    vocabularies: tuple[int | None, ...]
    arms: tuple[str, ...]
    learning_rates: tuple[float, ...]
    seeds: tuple[int, ...]
    base_shape: shapes.Shape = shapes.Shape(True, 128, 4, 512)
    arch: shapes.Architecture = shapes.Architecture()
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    extend_edges: int = 0  # rates tried past an end of the grid, at most
    # (regime name, vocabulary) -> the tokens its tokenizer has, which the
    # arms are matched at (data.tokenizer_vocab_size); absent: as many as asked.
    vocab_sizes: Mapping[tuple[str, int | None], int] = dataclasses.field(
        default_factory=dict
    )

    def vocab_size(self, regime: Regime, vocab: int | None) -> int:
        """The tokens of ``vocab``'s tokenizer in ``regime``."""
        asked = CHAR_VOCAB_SIZE if vocab is None else vocab
        return self.vocab_sizes.get((regime.name, vocab), asked)

    def cells(self) -> list[Cell]:
        cells = []
        for regime in self.regimes:
            for vocab in self.vocabularies:
                size = self.vocab_size(regime, vocab)
                solved = shapes.arm_shapes(size, self.base_shape, self.arch)
                cells += [
                    Cell(regime, vocab, arm, solved[arm], size) for arm in self.arms
                ]
        return cells

    def tuning_runs(
        self, results: Mapping[PlannedRun, workdirs.Run] | None = None
    ) -> list[PlannedRun]:
        """Every cell at every rate of the grid, first seed (rates in the outer
        loop, so that an interrupted stage has every cell at one rate); then,
        given the ``results`` read back so far, each cell's edge extensions
        (:func:`extend_rates`), in cell order."""
        grid = [
            PlannedRun(cell, lr, self.seeds[0])
            for lr in self.learning_rates
            for cell in self.cells()
        ]
        if not results or self.extend_edges == 0:
            return grid
        extensions = []
        for cell in self.cells():
            losses = {
                p.lr: (
                    validation_loss(r, cell.regime) if r.status == "finished" else None
                )
                for p, r in results.items()
                if p.cell == cell and p.seed == self.seeds[0]
            }
            extensions += [
                PlannedRun(cell, lr, self.seeds[0])
                for lr in extend_rates(losses, self.learning_rates, self.extend_edges)
            ]
        return grid + extensions

    def seed_runs(self, chosen: dict[Cell, float]) -> list[PlannedRun]:
        """The other seeds of every cell at its chosen rate."""
        return [
            PlannedRun(cell, chosen[cell], seed)
            for seed in self.seeds[1:]
            for cell in self.cells()
        ]

    def names(self, runs: Sequence[PlannedRun]) -> list[str]:
        """Run directory names, as ``experiments/sweep.py`` gives them."""
        return sweeps.run_names([r.overrides(self.min_lr_ratio) for r in runs])


def read_runs(
    design: Design,
    runs: Sequence[PlannedRun],
    sweep_dir: str,
    known: Mapping[PlannedRun, workdirs.Run] | None = None,
) -> dict[PlannedRun, workdirs.Run]:
    """Each planned run's directory in ``sweep_dir``, read back, in the order
    of ``runs``; a run in ``known`` (read before) is kept as it is."""
    known = known or {}
    return {
        planned: known[planned]
        if planned in known
        else workdirs.read_run(
            os.path.join(sweep_dir, name), planned.overrides(design.min_lr_ratio)
        )
        for planned, name in zip(runs, design.names(runs))
    }


def extend_rates(
    losses: Mapping[float, float | None], grid: Sequence[float], extend_edges: int
) -> list[float]:
    """The rates past the grid's ends that a cell's tuning tries, given the
    validation ``losses`` of its runs so far (``None``: not finished).

    Walking outward from the grid: while every rate tried has finished and the
    highest rate's loss is below every other's, the next is ``EDGE_FACTOR``
    times it; the lowest rate's, the next is that divided by ``EDGE_FACTOR``;
    at most ``extend_edges`` in all (the walk goes one way: once past an end,
    the other end cannot become the best). The walk stops at a rate not yet
    finished (it is returned: the run to wait for). A diverged run's loss is
    ``inf``; a tie is no reason to extend; a grid of one rate is a choice,
    not a search, and never extends.

    Examples:
        >>> grid = (1e-3, 2e-3)
        >>> extend_rates({1e-3: 2.0, 2e-3: 1.9}, grid, 2)   # best at the top
        [0.004]
        >>> extend_rates({1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.8}, grid, 2)
        [0.004, 0.008]
        >>> extend_rates({1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.8, 8e-3: 1.7}, grid, 2)
        [0.004, 0.008]
        >>> extend_rates({1e-3: 1.8, 2e-3: 1.9}, grid, 2)   # best at the bottom
        [0.0005]
        >>> extend_rates({1e-3: 2.0, 2e-3: None}, grid, 2)  # still running
        []
        >>> extend_rates({1e-3: 1.8, 2e-3: 1.8}, grid, 2)   # a tie
        []
        >>> extend_rates({1e-3: 1.9, 2e-3: 1.8, 4e-3: float("inf")}, grid, 2)
        [0.004]
    """
    if len(grid) < 2:
        return []
    tried, added = sorted(grid), []
    while (
        not any(losses.get(lr) is None for lr in tried)
        and sum(not min(grid) <= lr <= max(grid) for lr in tried) < extend_edges
    ):

        def strictly_best(end):
            return all(losses[end] < losses[lr] for lr in tried if lr != end)

        if strictly_best(tried[-1]):
            rate = tried[-1] * EDGE_FACTOR  # exact: a power of two
        elif strictly_best(tried[0]):
            rate = tried[0] / EDGE_FACTOR
        else:
            break
        added.append(rate)
        tried = sorted(tried + [rate])
    return added


# --- Reading results -------------------------------------------------------------


def read_tuning(design: Design, sweep_dir: str) -> dict[PlannedRun, workdirs.Run]:
    """The tuning stage's runs as planned so far, read back from ``sweep_dir``:
    the grid, then the edge extensions its results call for, re-read until
    the plan stops growing (at most ``extend_edges`` + 1 rounds, each reading
    only the runs the last one added)."""
    planned, runs = design.tuning_runs(), None
    while True:
        runs = read_runs(design, planned, sweep_dir, known=runs)
        grown = design.tuning_runs(runs)
        if grown == planned:
            return runs
        planned = grown


def validation_metrics(run: workdirs.Run, regime: Regime) -> dict[str, float]:
    """The validation metrics (``eval/...``) of the parameters the test split
    evaluates: the best evaluation's under early stopping, else the last."""
    summary = run.summary or {}
    if regime.patience and "best" in summary:
        return summary["best"]
    return summary.get("final", {})


def validation_loss(run: workdirs.Run, regime: Regime) -> float:
    """``eval/loss`` of the tested parameters; ``inf`` for a run that did not
    finish or diverged (a NaN loss), so it is never chosen."""
    loss = validation_metrics(run, regime).get("eval/loss")
    return loss if loss is not None and math.isfinite(loss) else math.inf


def choose_learning_rates(
    tuning: dict[PlannedRun, workdirs.Run], *, strict: bool = True
) -> dict[Cell, float]:
    """Each cell's learning rate with the lowest validation loss (ties: the
    first rate of the grid) among its tuning runs.

    Args:
        tuning: the tuning runs, read back (:func:`read_runs`).
        strict: raise when a tuning run has not finished; otherwise leave out
            the cells that have unfinished ones.

    Raises:
        ValueError: (strict) tuning runs not finished, named; or a cell whose
            every run diverged.

    Examples:
        >>> cell = Cell(Regime("fixed", 1.0, 100, 0), None, "a", shapes.Shape(True, 8, 1, 16), 84)
        >>> def run(loss):
        ...     return workdirs.Run("r", "r", {}, {}, [], {"final": {"eval/loss": loss}},
        ...                       "finished")
        >>> choose_learning_rates({PlannedRun(cell, 1e-3, 0): run(2.0),
        ...                        PlannedRun(cell, 2e-3, 0): run(1.9),
        ...                        PlannedRun(cell, 4e-3, 0): run(float("nan"))})[cell]
        0.002
    """
    unfinished = [run.name for run in tuning.values() if run.status != "finished"]
    if unfinished and strict:
        raise ValueError(
            f"{len(unfinished)} of {len(tuning)} tuning runs have not finished (e.g. "
            f"{unfinished[0]}); run the tuning stage (stage=tune) to the end before "
            "the seeds stage."
        )
    by_cell: dict[Cell, list[tuple[float, float, str]]] = {}
    for planned, run in tuning.items():
        by_cell.setdefault(planned.cell, []).append(
            (validation_loss(run, planned.cell.regime), planned.lr, run.status)
        )
    chosen = {}
    for cell, results in by_cell.items():
        if any(status != "finished" for _, _, status in results):
            continue
        loss, lr, _ = min(results, key=lambda r: r[0])  # min keeps the first of ties
        if math.isinf(loss):
            raise ValueError(
                f"Every tuning run of {cell} diverged or has no "
                "validation loss; try lower learning rates."
            )
        chosen[cell] = lr
    return chosen
