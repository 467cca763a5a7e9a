"""The tying study's design: the grid of vocabularies x data amounts x arms
(:class:`Design`), the seeds and data locations of its runs, and the
learning-rate choice that links its two stages, ``tune`` (a ladder of
rates, :func:`ladder_rate`, :func:`extend_rates`, on :data:`TUNING_SEEDS`)
and ``test`` (every cell's test seeds at its rate,
:func:`choose_learning_rates`; arm e's :func:`untie_step`). A ladder is
each tuned arm's own, or with ``Design.shared_ladder`` one for the arms of a
vocabulary and amount (the learning-rate profiles). The stages are
described in ``docs/tying_study/README.md`` ("The design", "Learning-rate
profiles").
"""

import dataclasses
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from lmhead.lab import sweeps, workdirs
from lmhead.lm import configuration
from studies.tying import shapes

# Distinct characters of the embedded corpus: the character vocabulary.
CHAR_VOCAB_SIZE = 84
# Seeds that choose learning rates; the test seeds are 0, 1, ... and never these.
TUNING_SEEDS = (100, 101)
# The profiles' tuning seeds: the study's two and a third.
PROFILE_SEEDS = (100, 101, 102)
# Every seed a committed or planned run of the study uses, by what it was
# for: a new set of seeds (the confirmatory ones) must be disjoint from all.
SEEDS_USED = {
    "test (v2)": tuple(range(8)),
    "tuning (v2)": TUNING_SEEDS,
    "tuning (profiles)": PROFILE_SEEDS,
}
# Where a data subset starts, as a fraction of the training split (by seed).
SUBSET_OFFSETS = (0.0, 0.5)
# Arm e unties at this fraction of the tied arm's training (modded-nanogpt's
# record of PR 178 unties at two thirds of its schedule).
UNTIE_FRACTION = 2 / 3
# The arms whose learning rates are tuned; the others take arm a's.
TUNED_ARMS = ("a", "b", "c")
# A run fails (:func:`failures`) when its training bits/char at its tested
# evaluation is more than this above the median of its group: the runs of one
# cell, rate and role (docs/tying_study/README.md, "Past early training").
FAILURE_BPC = 0.06
# How the test stage's rate is chosen from a profile (:func:`choose_rate`):
# "best", the lowest mean validation loss; "clear", the lowest at a rung
# where no tuning run fails, nor at the rung above.
CHOICES = ("best", "clear")
# The summary key of a run restored from a committed table: its row.
RESTORED = "restored_row"


def ladder_rate(index: int) -> float:
    """The learning rate ``index`` steps of :math:`\\sqrt 2` from 1e-3, to
    three significant digits (so that run names stay short and equal rates
    are equal floats).

    Examples:
        >>> [ladder_rate(k) for k in (-4, -1, 0, 1, 4)]
        [0.00025, 0.000707, 0.001, 0.00141, 0.004]
    """
    return float(f"{1e-3 * 2 ** (index / 2):.3g}")


def vocabulary_overrides(vocab: int | None) -> dict[str, Any]:
    """``None``: characters; else byte-level BPE with ``vocab`` tokens.

    Examples:
        >>> vocabulary_overrides(None), vocabulary_overrides(512)
        ({'data.tokenizer': 'char'}, {'data.tokenizer': 'bpe', 'data.vocab_size': 512})
    """
    if vocab is None:
        return {"data.tokenizer": "char"}
    return {"data.tokenizer": "bpe", "data.vocab_size": vocab}


def vocabulary_label(vocab: int | None) -> str:
    return "char" if vocab is None else str(vocab)


def new_seeds(seeds: Sequence[int]) -> tuple[int, ...]:
    """``seeds``, checked to be none of :data:`SEEDS_USED`.

    Raises:
        ValueError: a seed used before, named with what it was used for.

    Examples:
        >>> new_seeds(range(500, 503))
        (500, 501, 502)
        >>> new_seeds(range(414, 418))
        Traceback (most recent call last):
        ...
        ValueError: seeds [414, 415] are used already, as test (width axis) seeds.
    """
    for use, used in SEEDS_USED.items():
        again = sorted(set(seeds) & set(used))
        if again:
            raise ValueError(f"seeds {again} are used already, as {use} seeds.")
    return tuple(seeds)


# The confirmatory test seeds of the profiled cells, new when they were named
# (docs/tying_study/README.md, "Confirmatory hypotheses, fixed before the runs").
CONFIRM_SEEDS = new_seeds(range(200, 216))
SEEDS_USED["test (confirmatory)"] = CONFIRM_SEEDS
# The test seeds of the cells past early training, new when they were named
# (docs/tying_study/README.md, "Past early training: fixed before the runs").
PAST_SEEDS = new_seeds(range(300, 316))
SEEDS_USED["test (past early training)"] = PAST_SEEDS
# The test seeds of the width axis, one set for its three widths, new when
# they were named (docs/tying_study/README.md, "The width axis").
WIDTH_SEEDS = new_seeds(range(400, 416))
SEEDS_USED["test (width axis)"] = WIDTH_SEEDS


@dataclasses.dataclass(frozen=True)
class Amount:
    """A data amount: ``fraction`` of the training split, at most ``steps``
    (two budgets of one fraction are two amounts, and so two cells, whose
    runs' names differ by ``train.steps``);
    ``patience``, when set, replaces the design's for its runs (a fixed
    budget: patience 0, the cosine ending at ``steps``), and ``eval_every``
    the shared evaluation interval (a run's name does not hold it: a sweep
    trains amounts of one interval)."""

    fraction: float
    steps: int
    eval_every: int | None = None
    patience: int | None = None

    @property
    def offsets(self) -> tuple[float, ...]:
        return SUBSET_OFFSETS if self.fraction < 1.0 else (0.0,)

    def offset(self, seed: int) -> float:
        """Where seed ``seed``'s subset starts."""
        return self.offsets[seed % len(self.offsets)]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One vocabulary x data amount x arm: the unit that gets a rate and seeds;
    ``table_lr``, the tables' learning-rate multiplier its runs train with
    (an arm of its own: the mechanism test's arm b at k)."""

    vocab: int | None  # None: characters
    amount: Amount
    arm: str
    shape: shapes.Shape
    vocab_size: int  # the tokens the vocabulary's tokenizer has
    table_lr: float = 1.0


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """A cell at one learning rate and seed; ``role`` is ``tune``, ``test``
    or ``ablation``; ``untie_step`` for arm e, ``table_lr`` the ablation's
    multiplier (1: none)."""

    cell: Cell
    lr: float
    seed: int
    role: str = "test"
    untie_step: int | None = None
    table_lr: float = 1.0

    def overrides(self, min_lr_ratio: float, patience: int) -> dict[str, Any]:
        """The run's overrides, always in the same order (its name depends on it)."""
        amount = self.cell.amount
        extra = {}
        if self.untie_step is not None:
            extra["model.untie_step"] = self.untie_step
        if self.table_lr != 1.0:
            extra["optim.table_lr_multiplier"] = self.table_lr
        return {
            "data.train_fraction": amount.fraction,
            "data.train_offset": amount.offset(self.seed),
            "train.steps": amount.steps,
            "train.patience": patience if amount.patience is None else amount.patience,
            **vocabulary_overrides(self.cell.vocab),
            **self.cell.shape.overrides(),
            **extra,
            "optim.lr": self.lr,
            "optim.min_lr": round(self.lr * min_lr_ratio, 12),
            "train.seed": self.seed,
        }


@dataclasses.dataclass(frozen=True)
class Design:
    """The study: ``base`` config argument, ``shared`` overrides for every
    run, and the axes. ``centres`` maps a vocabulary to the ladder index of
    its tuning grid's middle rate; ``grid`` is the indices around it."""

    base: str
    shared: dict[str, Any]
    vocabularies: tuple[int | None, ...]
    amounts: tuple[Amount, ...]
    arms: tuple[str, ...]
    centres: Mapping[int | None, int]
    test_seeds: tuple[int, ...]
    tuning_seeds: tuple[int, ...] = TUNING_SEEDS
    grid: tuple[int, ...] = (-1, 0, 1)
    # False: no tuning stage; every cell trains at its centre's rate.
    tune: bool = True
    extend_edges: int = 2
    # True: the tuned arms of a vocabulary and amount share one ladder, which
    # grows until it holds ``margin`` rungs past every arm's best on both
    # sides (extend_rates); False: each arm's own, with margin 1.
    shared_ladder: bool = False
    margin: int = 1
    # How a tuned cell's rate is chosen (CHOICES, choose_rate).
    choice: str = "best"
    # The (vocabulary, fraction) pairs that have cells, in this order (None:
    # every vocabulary x amount).
    pairs: tuple[tuple[int | None, float], ...] | None = None
    patience: int = 3
    # The table learning-rate ablation: (vocabulary, fraction) and multipliers.
    ablation_cell: tuple[int | None, float] | None = None
    ablation_multipliers: tuple[float, ...] = (3.0, 10.0)
    # Arm b again at each of these table learning-rate multipliers, each on a
    # ladder of its own (the mechanism test; tuned like the arms).
    table_multipliers: tuple[float, ...] = ()
    # The vocabularies of the secondary arms d and e (None: every one).
    secondary_vocabularies: tuple[int | None, ...] | None = None
    base_shape: shapes.Shape = shapes.Shape(True, 128, 4, 512)
    arch: shapes.Architecture = shapes.Architecture()
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    # vocabulary -> the tokens its tokenizer has; absent: as many as asked.
    vocab_sizes: Mapping[int | None, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.choice not in CHOICES:
            raise ValueError(
                f"choice={self.choice!r}: the rate choices are {', '.join(CHOICES)}."
            )
        fractions = [a.fraction for a in self.amounts]
        if len(set(fractions)) < len(fractions):
            raise ValueError(
                f"amounts {self.amounts} have a fraction twice: a design's cells "
                "name an amount by its fraction, so each step budget of one "
                "fraction is a design (a sweep) of its own."
            )
        if set(self.tuning_seeds) & set(self.test_seeds):
            raise ValueError(
                f"Tuning seeds {self.tuning_seeds} and test seeds "
                f"{self.test_seeds} overlap: a tuning run is never a test run."
            )

    def vocab_size(self, vocab: int | None) -> int:
        asked = CHAR_VOCAB_SIZE if vocab is None else vocab
        return self.vocab_sizes.get(vocab, asked)

    def cells(self, arms: Sequence[str] | None = None) -> list[Cell]:
        """Every vocabulary x amount x arm (``arms``: these only), in that
        order (or ``pairs`` x arm); no arm d where it does not exist
        (``shapes.deeper_tied``), and arms d and e only at
        ``secondary_vocabularies``; then arm b at each of
        ``table_multipliers``."""
        cells = []
        for vocab, amount in self._pairs():
            size = self.vocab_size(vocab)
            solved = shapes.arm_shapes(size, self.base_shape, self.arch)
            cells += [
                Cell(vocab, amount, arm, solved[arm], size)
                for arm in self.arms
                if arm in solved
                and (arms is None or arm in arms)
                and (arm in TUNED_ARMS or self._secondary(vocab))
            ]
            cells += [
                Cell(vocab, amount, "b", solved["b"], size, table_lr=k)
                for k in self.table_multipliers
                if "b" in self.arms and (arms is None or "b" in arms)
            ]
        return cells

    def _pairs(self) -> list[tuple[int | None, Amount]]:
        if self.pairs is None:
            return [(v, a) for v in self.vocabularies for a in self.amounts]
        amounts = {a.fraction: a for a in self.amounts}
        return [(vocab, amounts[fraction]) for vocab, fraction in self.pairs]

    def _secondary(self, vocab: int | None) -> bool:
        return (
            self.secondary_vocabularies is None or vocab in self.secondary_vocabularies
        )

    def rates(self, cell: Cell) -> list[float]:
        """The grid's rates of ``cell``, low to high."""
        return [ladder_rate(self.centres[cell.vocab] + k) for k in self.grid]

    def ladders(self) -> list[list[Cell]]:
        """The tuned cells, grouped by the ladder they share: one cell each,
        or with ``shared_ladder`` the arms of each vocabulary and amount (a
        table multiplier's arm on a ladder of its own)."""
        cells = self.cells(TUNED_ARMS)
        if not self.shared_ladder:
            return [[cell] for cell in cells]
        groups: dict[tuple, list[Cell]] = {}
        for cell in cells:
            key = (cell.vocab, cell.amount, cell.table_lr)
            groups.setdefault(key, []).append(cell)
        return list(groups.values())

    def tuning_runs(
        self, results: Mapping[PlannedRun, workdirs.Run] | None = None
    ) -> list[PlannedRun]:
        """The tuned arms' cells at every rate of their ladders on every
        tuning seed: the grid, then, given the ``results`` read back so far,
        the rungs each ladder grows by (:func:`extend_rates`). Per-arm
        ladders go rate by rate over the cells (an interrupted stage has
        every cell at one rate); shared ones ladder by ladder (a cell's
        profile finishes before the next one's starts). None without a
        tuning stage."""
        if not self.tune:
            return []
        ladders = self.ladders()
        order = [(ladder, i) for i in range(len(self.grid)) for ladder in ladders]
        if self.shared_ladder:
            order = [(ladder, i) for ladder in ladders for i in range(len(self.grid))]
        runs = [
            PlannedRun(cell, self.rates(cell)[i], seed, "tune", table_lr=cell.table_lr)
            for ladder, i in order
            for cell in ladder
            for seed in self.tuning_seeds
        ]
        if not results or self.extend_edges == 0:
            return runs
        for ladder in ladders:
            own = [{p: r for p, r in results.items() if p.cell == c} for c in ladder]
            curves = [mean_losses(runs, self.tuning_seeds) for runs in own]
            failed = None
            if self.choice == "clear":
                failed = [failed_rates(runs, self.tuning_seeds) for runs in own]
            grid = self.rates(ladder[0])
            added = extend_rates(curves, grid, self.extend_edges, self.margin, failed)
            runs += [
                PlannedRun(cell, lr, seed, "tune", table_lr=cell.table_lr)
                for lr in added
                for cell in ladder
                for seed in self.tuning_seeds
            ]
        return runs

    def test_runs(
        self,
        chosen: Mapping[Cell, float],
        tuning: Mapping[PlannedRun, workdirs.Run],
    ) -> list[PlannedRun]:
        """The test seeds of every cell at its rate (arms d and e at arm a's
        of their vocabulary and amount), the primary arms first; then the
        ablation's runs. A cell without a rate in ``chosen`` (its tuning not
        finished) has none yet."""

        runs = [
            PlannedRun(cell, chosen[cell], seed, table_lr=cell.table_lr)
            for cell in self.cells(TUNED_ARMS)
            if cell in chosen
            for seed in self.test_seeds
        ]
        for cell in self.cells(("d", "e")):
            tied = self.tied_cell(cell)
            if tied not in chosen:
                continue
            untie = untie_step(tuning, tied, chosen[tied]) if cell.arm == "e" else None
            runs += [
                PlannedRun(cell, chosen[tied], seed, untie_step=untie)
                for seed in self.test_seeds
            ]
        return runs + self.ablation_runs(chosen)

    def ablation_runs(self, chosen: Mapping[Cell, float]) -> list[PlannedRun]:
        """Arms a and b of the ablation's cell at each table multiplier."""
        if self.ablation_cell is None:
            return []
        vocab, fraction = self.ablation_cell
        return [
            PlannedRun(cell, chosen[cell], seed, "ablation", table_lr=multiplier)
            for multiplier in self.ablation_multipliers
            for cell in self.cells(("a", "b"))
            if cell.vocab == vocab and cell.amount.fraction == fraction
            if cell in chosen and cell.table_lr == 1.0
            for seed in self.test_seeds
        ]

    def tied_cell(self, cell: Cell) -> Cell:
        """Arm a's cell of ``cell``'s vocabulary and amount."""
        return dataclasses.replace(
            cell, arm="a", shape=dataclasses.replace(self.base_shape, tied=True)
        )

    def overrides(self, run: PlannedRun) -> dict[str, Any]:
        return run.overrides(self.min_lr_ratio, self.patience)

    def names(self, runs: Sequence[PlannedRun]) -> list[str]:
        """Run directory names, as ``experiments/sweep.py`` gives them."""
        return sweeps.run_names([self.overrides(r) for r in runs])


def extend_rates(
    curves: Sequence[Mapping[float, float | None]],
    grid: Sequence[float],
    extend_edges: int,
    margin: int = 1,
    failed: Sequence[Mapping[float, bool]] | None = None,
) -> list[float]:
    """The rungs past the grid's ends that a ladder tries, given each arm's
    (mean) validation losses by rate so far (``curves``, one per arm that
    shares the ladder; ``None`` or absent: not finished), in the order added.

    An arm's best rung is its lowest loss (ties: the lower rate; a diverged
    rung's loss is ``inf``). While every rung tried has finished for every
    arm, the ladder grows by the rungs (:func:`ladder_rate`) that bring it to
    ``margin`` rungs past every arm's best on both sides, nearest first, at
    most ``extend_edges`` past the grid in all; not above a top rung, nor
    below a bottom one, where every arm diverged. It stops at rungs not yet
    finished (returned: the runs to wait for). A grid of one rate is a
    choice, not a search, and never extends. With one arm and ``margin=1``
    this is a walk past an end while the best is there. With ``failed``
    (each arm's rungs at which a tuning run failed, :func:`failed_rates`),
    the ladder also holds ``margin`` rungs past each arm's clear choice
    (:func:`choose_rate`), or, while no rung is clear, the rung below.

    Examples:
        >>> grid = (0.000707, 0.001, 0.00141)
        >>> extend_rates([{0.000707: 2.0, 0.001: 1.95, 0.00141: 1.9}], grid, 2)
        [0.002]
        >>> extend_rates([{0.000707: 2.0, 0.001: 1.95, 0.00141: 1.9, 0.002: 1.8}], grid, 2)
        [0.002, 0.00283]
        >>> extend_rates([{0.000707: 1.8, 0.001: 1.9, 0.00141: 2.0}], grid, 2)
        [0.0005]
        >>> extend_rates([{0.000707: 2.0, 0.001: 1.9, 0.00141: None}], grid, 2)
        []
        >>> extend_rates([{0.000707: 1.9, 0.001: 1.8, 0.00141: 1.9}], grid, 2)
        []

        Two arms sharing the ladder, two rungs past each one's best:

        >>> extend_rates([{0.000707: 2.0, 0.001: 1.9, 0.00141: 2.1},
        ...               {0.000707: 2.0, 0.001: 2.1, 0.00141: 1.9}], grid, 8, margin=2)
        [0.002, 0.0005, 0.00283]

        The best rung's neighbour above failed, so the clear choice is one
        rung lower, and the ladder grows to two rungs below that:

        >>> extend_rates([{0.000707: 2.0, 0.001: 1.9, 0.00141: 1.8, 0.002: 1.9,
        ...                0.00283: 2.0}], (0.000707, 0.001, 0.00141, 0.002, 0.00283),
        ...              8, margin=2, failed=[{0.000707: False, 0.001: False,
        ...              0.00141: False, 0.002: True, 0.00283: True}])
        [0.0005]
    """
    if len(grid) < 2:
        return []
    low, high = min(grid), max(grid)
    tried, added = sorted(grid), []
    flags = failed or [{}] * len(curves)
    while not any(
        curve.get(lr) is None or (failed and flag.get(lr) is None)
        for curve, flag in zip(curves, flags)
        for lr in tried
    ):
        indices = [_ladder_index(lr) for lr in tried]
        wanted = set()
        for i, curve in enumerate(curves):
            best = min(tried, key=lambda lr: (curve[lr], lr))
            if math.isinf(curve[best]):
                continue  # every rung diverged: choose_learning_rates says so
            centres = {_ladder_index(best)}
            if failed is not None:
                clear = _clear_rates({lr: curve[lr] for lr in tried}, failed[i])
                centres.add(_ladder_index(clear[0]) if clear else indices[0] - 1)
            for centre in centres:
                wanted |= set(range(centre - margin, centre + margin + 1))

        def diverged(lr):
            return all(math.isinf(curve[lr]) for curve in curves)

        above = [k for k in sorted(wanted) if k > indices[-1]]
        below = [k for k in sorted(wanted, reverse=True) if k < indices[0]]
        if diverged(tried[-1]):
            above = []
        if diverged(tried[0]):
            below = []
        rungs = sorted(above + below, key=lambda k: min(abs(k - i) for i in indices))
        room = extend_edges - sum(not low <= lr <= high for lr in tried)
        rungs = [ladder_rate(k) for k in rungs[: max(room, 0)]]
        if not rungs:
            break
        added += rungs
        tried = sorted(tried + rungs)
    return added


def _ladder_index(rate: float) -> int:
    return round(2 * math.log2(rate / 1e-3))


def failures(train_bpc: Sequence[float | None]) -> list[bool]:
    """Which runs of a group (one cell, rate and role) fail: those whose
    training bits/char at the tested evaluation is missing, not finite, or
    more than :data:`FAILURE_BPC` above the median of the group's finite
    values. A loss spike that the run does not recover from shows so; seed
    noise does not (docs/tying_study/README.md, "Past early training").
    The seeds of a data subset each train on their own part of the text, so
    their training bits/char do not compare: the rule is for cells on all
    of it.

    Examples:
        >>> failures([2.30, 2.31, 2.38, None, float("nan")])
        [False, False, True, True, True]
    """
    finite = [v for v in train_bpc if v is not None and math.isfinite(v)]
    centre = statistics.median(finite) if finite else math.nan
    return [
        v is None or not math.isfinite(v) or not v <= centre + FAILURE_BPC
        for v in train_bpc
    ]


def _clear_rates(
    losses: Mapping[float, float], failed: Mapping[float, bool]
) -> list[float]:
    """The rungs of ``losses`` clear of failures (no failed run at the rung
    nor at the ladder's next rung up, which must have been tried), best
    first (ties: the lower rate)."""
    clear = [
        lr
        for lr in sorted(losses)
        if not failed[lr]
        and failed.get(ladder_rate(_ladder_index(lr) + 1)) is False
        and math.isfinite(losses[lr])
    ]
    return sorted(clear, key=lambda lr: losses[lr])


def choose_rate(
    losses: Mapping[float, float], failed: Mapping[float, bool], choice: str
) -> float | None:
    """A profile's chosen rate from its mean validation loss by rate
    (``losses``) and whether a tuning run failed at each (``failed``,
    :func:`failures`): with ``choice="best"`` the lowest loss (ties: the
    lower rate; ``failed`` is not read); with ``"clear"`` the lowest loss
    among the rungs where no tuning run failed, nor at the next rung up, one
    rung of margin below any rate seen to fail. None: no rung qualifies.

    Examples:
        >>> losses = {0.001: 2.0, 0.00141: 1.9, 0.002: 1.8, 0.00283: 1.85, 0.004: 3}
        >>> failed = {0.001: False, 0.00141: False, 0.002: False, 0.00283: True,
        ...           0.004: True}
        >>> choose_rate(losses, failed, "best"), choose_rate(losses, failed, "clear")
        (0.002, 0.00141)
    """
    if choice == "best":
        lr = min(sorted(losses), key=lambda r: losses[r])
        return None if math.isinf(losses[lr]) else lr
    clear = _clear_rates(losses, failed)
    return clear[0] if clear else None


# --- Reading results -------------------------------------------------------------


def data_config(base: str, overrides: Mapping[str, Any]):
    """The ``data`` section of ``configs/default.py:base`` with the
    ``data.*`` items of ``overrides`` applied (the others are ignored), as
    the run with those overrides reads its data."""
    config = configuration.load_config(base)
    for key, value in overrides.items():
        if key.startswith("data."):
            config.data[key.removeprefix("data.")] = value
    return config.data


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
        else workdirs.read_run(os.path.join(sweep_dir, name), design.overrides(planned))
        for planned, name in zip(runs, design.names(runs))
    }


def read_tuning(design: Design, sweep_dir: str) -> dict[PlannedRun, workdirs.Run]:
    """The tuning stage's runs as planned so far, read back from ``sweep_dir``:
    the grid, then the edge extensions its results call for, re-read until
    the plan stops growing."""
    planned, runs = design.tuning_runs(), None
    while True:
        runs = read_runs(design, planned, sweep_dir, known=runs)
        grown = design.tuning_runs(runs)
        if grown == planned:
            return runs
        planned = grown


def read_plan(
    design: Design, sweep_dir: str, *, test: bool = True, strict: bool = True
) -> dict[PlannedRun, workdirs.Run]:
    """Every run the design plans so far, read back from ``sweep_dir``: the
    tuning stage's (:func:`read_tuning`), then with ``test`` the test stage's
    at each cell's chosen rate (:func:`choose_learning_rates`; ``strict``
    False plans them only for the cells whose tuning has finished)."""
    tuning = read_tuning(design, sweep_dir)
    if not test:
        return tuning
    chosen = choose_learning_rates(design, tuning, strict=strict)
    return {**tuning, **read_runs(design, design.test_runs(chosen, tuning), sweep_dir)}


def validation_loss(run: workdirs.Run) -> float:
    """``eval/loss`` of the best evaluation (the tested parameters); ``inf``
    for a run that did not finish or diverged, so that it is never chosen."""
    summary = run.summary or {}
    loss = (summary.get("best") or summary.get("final") or {}).get("eval/loss")
    return loss if loss is not None and math.isfinite(loss) else math.inf


def mean_losses(
    runs: Mapping[PlannedRun, workdirs.Run], seeds: Sequence[int]
) -> dict[float, float | None]:
    """One cell's mean validation loss per rate over ``seeds`` (``None``
    while a seed's run has not finished; ``inf`` when one diverged).

    Examples:
        >>> cell = Cell(None, Amount(0.5, 100), "a", shapes.Shape(True, 8, 1, 16), 84)
        >>> def run(loss, status="finished"):
        ...     return workdirs.Run("r", "r", {}, {}, [], {"best": {"eval/loss": loss}},
        ...                         status)
        >>> mean_losses({PlannedRun(cell, 1e-3, 100): run(2.0),
        ...              PlannedRun(cell, 1e-3, 101): run(1.0),
        ...              PlannedRun(cell, 2e-3, 100): run(1.0),
        ...              PlannedRun(cell, 2e-3, 101): run(1.0, "unfinished")}, (100, 101))
        {0.001: 1.5, 0.002: None}
    """
    by_rate: dict[float, list[workdirs.Run | None]] = {}
    for planned, run in runs.items():
        if planned.seed in seeds:
            by_rate.setdefault(planned.lr, []).append(run)
    return {
        lr: None
        if len(found) < len(seeds) or any(r.status != "finished" for r in found)
        else statistics.fmean(validation_loss(r) for r in found)
        for lr, found in by_rate.items()
    }


def train_bpc(run: workdirs.Run) -> float | None:
    """Training bits/char at the run's tested (best) evaluation, as
    ``runs.csv``'s ``train_bpc`` gives it, for a run restored from a table
    too; None without one."""
    summary = run.summary or {}
    if RESTORED in summary:
        return summary[RESTORED].get("train_bpc")
    return (summary.get("train_at_best") or {}).get("train_eval/bits_per_char")


def failed_rates(
    runs: Mapping[PlannedRun, workdirs.Run], seeds: Sequence[int]
) -> dict[float, bool | None]:
    """One cell's rates, each with whether a run of ``seeds`` there failed
    (:func:`failures` over the rate's runs of those seeds); ``None`` while
    one has not finished (as :func:`mean_losses` has it)."""
    by_rate: dict[float, list[workdirs.Run]] = {}
    for planned, run in runs.items():
        if planned.seed in seeds:
            by_rate.setdefault(planned.lr, []).append(run)
    return {
        lr: None
        if len(found) < len(seeds) or any(r.status != "finished" for r in found)
        else any(failures([train_bpc(r) for r in found]))
        for lr, found in by_rate.items()
    }


def choose_learning_rates(
    design: Design, tuning: Mapping[PlannedRun, workdirs.Run], *, strict: bool = True
) -> dict[Cell, float]:
    """Each tuned cell's rate by the design's ``choice`` (:func:`choose_rate`:
    the lowest mean validation loss over the tuning seeds, ties the lower
    rate, at a rung clear of failures with ``"clear"``); without a tuning
    stage, the grid's rate. A cell whose ladder has a rung not finished, for
    it or (a shared ladder) for another arm on it, has none: its profile is
    unfinished.

    Raises:
        ValueError: (``strict``) tuning runs not finished, named; a cell whose
            every rate diverged, or (``"clear"``) none of whose rungs is clear.
    """
    if not design.tune:
        return {cell: design.rates(cell)[0] for cell in design.cells(TUNED_ARMS)}
    unfinished = [run.name for run in tuning.values() if run.status != "finished"]
    if unfinished and strict:
        raise ValueError(
            f"{len(unfinished)} of {len(tuning)} tuning runs have not finished (e.g. "
            f"{unfinished[0]}); run the tuning stage (stage=tune) to the end before "
            "the test stage."
        )
    chosen = {}
    for cell in design.cells(TUNED_ARMS):
        own = {p: r for p, r in tuning.items() if p.cell == cell}
        losses = mean_losses(own, design.tuning_seeds)
        failed = failed_rates(own, design.tuning_seeds)
        if not losses or any(loss is None for loss in losses.values()):
            continue
        lr = choose_rate(losses, failed, design.choice)
        if lr is None:
            raise ValueError(
                f"Every tuning rate of {cell} diverged; try lower learning rates."
                if design.choice == "best"
                else f"No tuning rate of {cell} is clear of failed runs (at it "
                "and the rung above); try lower learning rates."
            )
        chosen[cell] = lr
    ladders = design.ladders()
    return {
        cell: lr
        for cell, lr in chosen.items()
        if all(c in chosen for ladder in ladders if cell in ladder for c in ladder)
    }


def best_step(run: workdirs.Run) -> int | None:
    """The step of a finished run's best evaluation (its tested parameters)."""
    return (run.summary or {}).get("best_step")


def untie_step(
    tuning: Mapping[PlannedRun, workdirs.Run], tied: Cell, rate: float
) -> int:
    """Arm e's untie step in ``tied``'s vocabulary and amount:
    :data:`UNTIE_FRACTION` of the median best step of the tied arm's tuning
    runs at ``rate``, rounded, at least 1.

    Raises:
        ValueError: none of those runs has a best step.
    """
    steps = [
        best_step(run)
        for planned, run in tuning.items()
        if planned.cell == tied and planned.lr == rate
    ]
    steps = [s for s in steps if s is not None]
    if not steps:
        raise ValueError(f"No finished tuning run of {tied} at lr={rate}.")
    return max(1, round(UNTIE_FRACTION * statistics.median(steps)))
