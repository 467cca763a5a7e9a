"""The tying study's design: arms with matched parameter counts, and the
learning-rate choice that links its two stages.

Four arms per vocabulary (``V`` tokens, base width ``D``):

* ``a``: tied, the base shape;
* ``b``: untied, the base shape (``V * D`` more parameters than ``a``);
* ``c``: untied, *narrower*, matched to ``a``: the ``d_model`` (a multiple of
  ``num_heads``) whose model with the base MLP ratio is nearest ``a``'s count,
  then ``mlp_dim`` solved so that the counts agree;
* ``d``: tied, *deeper*, matched to ``b``: the ``V * D`` that tying saves
  buys whole blocks of the base shape, and the rest widens every block's MLP.

Counts come from :func:`count_params`, a closed form of ``model.DecoderLM``'s
parameter tree (the tests check it against ``jax.eval_shape`` of the model's
init), so the matched shapes are solved, not typed in, at the number of
tokens the tokenizer has (``Design.vocab_sizes``): byte-level BPE trained on
a short text runs out of pairs to merge before the size asked for.

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

from lmhead.lab import sweeps

ARMS = {
    "a": "tied",
    "b": "untied, same shape",
    "c": "untied, narrower, matched to a",
    "d": "tied, deeper, matched to b",
}
# Parameter counts of matched arms may differ by at most this fraction.
MATCH_TOLERANCE = 0.02
# Distinct characters of the embedded corpus: the character vocabulary.
CHAR_VOCAB_SIZE = 84
# A grid's end extends by this factor: twice the highest rate, half the lowest.
EDGE_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model keys an arm sets (``config.model.*``)."""

    tied: bool
    d_model: int
    num_layers: int
    mlp_dim: int

    def overrides(self) -> dict[str, Any]:
        """The ``--config.model.*`` overrides, in a fixed order (for run names)."""
        return {
            "model.tied": self.tied,
            "model.d_model": self.d_model,
            "model.num_layers": self.num_layers,
            "model.mlp_dim": self.mlp_dim,
        }


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What every arm shares: ``config.model`` / ``config.data`` values."""

    num_heads: int = 4
    max_len: int = 64  # data.block_size
    positions: str = "learned"
    use_bias: bool = False
    head_bias: bool = False


def count_params(
    vocab_size: int, shape: Shape, arch: Architecture = Architecture()
) -> int:
    r"""Parameters of ``model.DecoderLM`` with ``shape`` and ``arch``.

    With :math:`V` tokens, width :math:`D`, :math:`L` blocks, MLP width
    :math:`F`, :math:`T` learned positions and :math:`\beta = 1` when the
    blocks and norms have biases (else 0):

    .. math::
        N = V D\,(2 - \text{tied}) + T D + L\,(4 D^2 + 2 D F + (2 + 2\beta) D
            + \beta(5 D + F)) + (1 + \beta) D + V\,\text{head\_bias}

    (per block: qkv :math:`3D^2`, out :math:`D^2`, the MLP :math:`2DF`, two
    LayerNorms; then the final LayerNorm.)

    Examples:
        >>> count_params(17, Shape(True, 8, 1, 16), Architecture(2, 8, use_bias=True))
        816
    """
    d, f, beta = shape.d_model, shape.mlp_dim, int(arch.use_bias)
    tables = vocab_size * d * (1 if shape.tied else 2)
    positions = arch.max_len * d if arch.positions == "learned" else 0
    block = 4 * d * d + 2 * d * f + (2 + 2 * beta) * d + beta * (5 * d + f)
    return (
        tables
        + positions
        + shape.num_layers * block
        + (1 + beta) * d
        + (vocab_size if arch.head_bias else 0)
    )


def _solve_mlp_dim(
    vocab_size: int, shape: Shape, target: int, arch: Architecture
) -> Shape:
    """``shape`` with the ``mlp_dim`` whose count is nearest ``target``
    (the count is linear in ``mlp_dim``)."""
    at_zero = count_params(vocab_size, dataclasses.replace(shape, mlp_dim=0), arch)
    per_unit = (
        count_params(vocab_size, dataclasses.replace(shape, mlp_dim=1), arch) - at_zero
    )
    mlp_dim = max(1, round((target - at_zero) / per_unit))
    return dataclasses.replace(shape, mlp_dim=mlp_dim)


def narrower_untied(
    vocab_size: int, base: Shape, target: int, arch: Architecture = Architecture()
) -> Shape:
    """Arm ``c``: untied, ``base.num_layers`` blocks, narrower, ``target`` parameters.

    ``d_model`` is the multiple of ``num_heads`` (at most ``base.d_model``)
    whose model with ``mlp_dim = d_model * base.mlp_dim / base.d_model`` has
    the count nearest ``target``; then ``mlp_dim`` is solved for ``target``.
    """
    ratio = base.mlp_dim / base.d_model
    widths = range(arch.num_heads, base.d_model + 1, arch.num_heads)

    def scaled(d):
        return Shape(False, d, base.num_layers, max(1, round(ratio * d)))

    d_model = min(
        widths, key=lambda d: abs(count_params(vocab_size, scaled(d), arch) - target)
    )
    return _check_match(
        vocab_size,
        _solve_mlp_dim(vocab_size, scaled(d_model), target, arch),
        target,
        arch,
    )


def deeper_tied(
    vocab_size: int, base: Shape, target: int, arch: Architecture = Architecture()
) -> Shape:
    """Arm ``d``: tied, ``base.d_model``, deeper, ``target`` parameters.

    Adds as many whole blocks of the base shape as fit under ``target``,
    then widens every block's MLP by the remainder.
    """
    tied = dataclasses.replace(base, tied=True)
    one_block = count_params(
        vocab_size, dataclasses.replace(tied, num_layers=2), arch
    ) - count_params(vocab_size, dataclasses.replace(tied, num_layers=1), arch)
    extra = max(0, (target - count_params(vocab_size, tied, arch)) // one_block)
    deeper = dataclasses.replace(tied, num_layers=base.num_layers + extra)
    return _check_match(
        vocab_size, _solve_mlp_dim(vocab_size, deeper, target, arch), target, arch
    )


def _check_match(vocab_size, shape, target, arch) -> Shape:
    count = count_params(vocab_size, shape, arch)
    if abs(count - target) > MATCH_TOLERANCE * target:
        raise ValueError(
            f"No shape matches {target:,} parameters within "
            f"{MATCH_TOLERANCE:.0%} at vocab_size={vocab_size}: the "
            f"nearest, {shape}, has {count:,}."
        )
    return shape


def arm_shapes(
    vocab_size: int, base: Shape, arch: Architecture = Architecture()
) -> dict[str, Shape]:
    """The four arms' shapes at ``vocab_size``, keyed ``"a"`` .. ``"d"``.

    Examples:
        >>> shapes = arm_shapes(2048, Shape(True, 128, 4, 512))
        >>> shapes["c"]
        Shape(tied=False, d_model=112, num_layers=4, mlp_dim=436)
        >>> shapes["d"]
        Shape(tied=True, d_model=128, num_layers=5, mlp_dim=563)
    """
    tied = dataclasses.replace(base, tied=True)
    untied = dataclasses.replace(base, tied=False)
    return {
        "a": tied,
        "b": untied,
        "c": narrower_untied(
            vocab_size, base, count_params(vocab_size, tied, arch), arch
        ),
        "d": deeper_tied(
            vocab_size, base, count_params(vocab_size, untied, arch), arch
        ),
    }


def head_share(vocab_size: int, d_model: int, num_params: int) -> float:
    """The ``[V, D]`` unembedding's share of a model's parameters (the tied
    table counts: it is the head's matrix too).

    Examples:
        >>> round(head_share(8192, 128, 2_000_000), 4)
        0.5243
    """
    return vocab_size * d_model / num_params


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
    shape: Shape
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
    base_shape: Shape = Shape(True, 128, 4, 512)
    arch: Architecture = Architecture()
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
                shapes = arm_shapes(size, self.base_shape, self.arch)
                cells += [
                    Cell(regime, vocab, arm, shapes[arm], size) for arm in self.arms
                ]
        return cells

    def tuning_runs(
        self, results: Mapping[PlannedRun, sweeps.Run] | None = None
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
    known: Mapping[PlannedRun, sweeps.Run] | None = None,
) -> dict[PlannedRun, sweeps.Run]:
    """Each planned run's directory in ``sweep_dir``, read back, in the order
    of ``runs``; a run in ``known`` (read before) is kept as it is."""
    known = known or {}
    return {
        planned: known[planned]
        if planned in known
        else sweeps.read_run(
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


def read_tuning(design: Design, sweep_dir: str) -> dict[PlannedRun, sweeps.Run]:
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


def validation_metrics(run: sweeps.Run, regime: Regime) -> dict[str, float]:
    """The validation metrics (``eval/...``) of the parameters the test split
    evaluates: the best evaluation's under early stopping, else the last."""
    summary = run.summary or {}
    if regime.patience and "best" in summary:
        return summary["best"]
    return summary.get("final", {})


def validation_loss(run: sweeps.Run, regime: Regime) -> float:
    """``eval/loss`` of the tested parameters; ``inf`` for a run that did not
    finish or diverged (a NaN loss), so it is never chosen."""
    loss = validation_metrics(run, regime).get("eval/loss")
    return loss if loss is not None and math.isfinite(loss) else math.inf


def choose_learning_rates(
    tuning: dict[PlannedRun, sweeps.Run], *, strict: bool = True
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
        >>> cell = Cell(Regime("fixed", 1.0, 100, 0), None, "a", Shape(True, 8, 1, 16), 84)
        >>> def run(loss):
        ...     return sweeps.Run("r", "r", {}, {}, [], {"final": {"eval/loss": loss}},
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
