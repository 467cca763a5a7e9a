"""The rows of ``runs.csv`` grouped by cell, and the numbers the report
prints (``analysis.py``): each cell's runs by arm and seed
(:func:`group_runs`), paired contrasts (:func:`paired_contrasts`), the
primary family with its Holm-adjusted p-values and pooled spread
(:func:`primary_family`), the learning-rate tuning (:func:`tunings`), the
table learning-rate ablation (:func:`ablation_groups`) and the measured
totals (:func:`measured_totals`).

A cell is ``(vocab, amount)``: one vocabulary (``"char"`` or a BPE size) at
one data amount. Only finished runs count; a value of None (not measured)
leaves its run out of that value's numbers.
"""

import collections
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from lmhead.lab import stats

Row = Mapping[str, Any]
Cell = tuple[str, float]
# (minuend, subtrahend) arms of the contrasts x - y, named before the runs.
PRIMARY = (("b", "a"), ("c", "a"))
SECONDARY = (("d", "a"), ("e", "b"), ("e", "a"))
ARM_NAMES = {
    "a": "tied",
    "b": "untied",
    "c": "untied, a's parameters",
    "d": "tied, deeper",
    "e": "tied, then untied",
}
CONTRAST_NAMES = {
    "b − a": "untying the head at the same shape",
    "c − a": "untying it at the tied model's parameter count",
}
FINISHED = "finished"
# The level at which a (Holm-adjusted) p-value counts as a difference found.
ALPHA = 0.05


def vocab_order(vocab: str) -> tuple:
    """Characters first, then BPE by size.

    Examples:
        >>> sorted(["8192", "char", "512"], key=vocab_order)
        ['char', '512', '8192']
    """
    if vocab == "char":
        return (0, 0, "")
    return (1, int(vocab), "") if vocab.isdigit() else (2, 0, vocab)


def vocab_label(vocab: str) -> str:
    """``"characters"`` or ``"BPE <size>"``.

    Examples:
        >>> vocab_label("char"), vocab_label("2048")
        ('characters', 'BPE 2048')
    """
    return "characters" if vocab == "char" else f"BPE {vocab}"


def amount_label(amount: float) -> str:
    """A data amount as a percentage of the training split.

    Examples:
        >>> amount_label(0.003), amount_label(0.1), amount_label(1.0)
        ('0.3%', '10%', '100%')
    """
    return f"{round(amount * 100, 6):g}%"


def cell_order(cell: Cell) -> tuple:
    return (vocab_order(cell[0]), cell[1])


def cell_label(cell: Cell) -> str:
    """Examples:
    >>> cell_label(("512", 0.03))
    'BPE 512 at 3%'
    """
    return f"{vocab_label(cell[0])} at {amount_label(cell[1])}"


def row_order(row: Row) -> tuple:
    """Cell, arm, multiplier, seed: the order of every table."""
    return (
        cell_order((row["vocab"], row["amount"])),
        row["arm"],
        row["table_lr_multiplier"] or 1.0,
        row["seed"],
    )


def vocabularies(rows: Iterable[Row]) -> list[str]:
    return sorted({r["vocab"] for r in rows}, key=vocab_order)


def amounts(rows: Iterable[Row]) -> list[float]:
    return sorted({r["amount"] for r in rows})


def column(runs: Iterable[Row], key: str) -> list:
    """The measured (not None) values of ``key`` over ``runs``."""
    return [r[key] for r in runs if r[key] is not None]


def group_runs(rows: Iterable[Row], role: str) -> dict[tuple, dict[int, Row]]:
    """The finished runs of ``role``, ``{(vocab, amount, arm): {seed: row}}``,
    in cell and arm order.

    Raises:
        ValueError: two finished runs of one cell, arm and seed (and
            multiplier), which no pairing could tell apart.
    """
    groups: dict[tuple, dict[int, Row]] = {}
    for row in sorted(rows, key=row_order):
        if row["role"] != role or row["status"] != FINISHED:
            continue
        key = (row["vocab"], row["amount"], row["arm"])
        if role == "ablation":
            key += (row["table_lr_multiplier"],)
        runs = groups.setdefault(key, {})
        if row["seed"] in runs:
            raise ValueError(
                f"rows: runs {runs[row['seed']]['run']!r} and {row['run']!r} are "
                f"both {role} runs of {key} at seed {row['seed']}."
            )
        runs[row["seed"]] = row
    return groups


@dataclasses.dataclass(frozen=True)
class Contrast:
    """The paired difference ``minuend - subtrahend`` of one cell.

    Attributes:
        vocab, amount: the cell.
        minuend, subtrahend: the arms (x and y of x - y).
        label: what the report calls it (``"b − a"``).
        difference: the paired difference over the shared seeds.
        p: the paired t-test's two-sided p-value.
        holm_p: Holm-adjusted over the primary family (NaN outside it).
        pooled: the 95% interval with the family's pooled spread.
        simultaneous: the family's Bonferroni 95% interval.
        capped: runs of the pairs (both arms) that reached their step cap.
        first_eval: runs of the pairs best at their first validation
            (:func:`best_at_first_eval`).
        edge: the contrast's arms whose test rate is the lowest or highest
            rate their tuning tried (:attr:`Tuning.at_edge`); None where the
            rows have no tuning stage.
    """

    vocab: str
    amount: float
    minuend: str
    subtrahend: str
    label: str
    difference: stats.PairedDifference
    p: float
    holm_p: float = math.nan
    pooled: tuple[float, float] = (math.nan, math.nan)
    simultaneous: tuple[float, float] = (math.nan, math.nan)
    capped: int = 0
    first_eval: int = 0
    edge: tuple[str, ...] | None = None


def by_seed(runs: Mapping[int, Row], metric: str = "test_bpc") -> dict[int, float]:
    """``{seed: metric}`` over the runs that measured it (a non-finite value,
    a run that diverged, counts as not measured)."""
    return {
        s: r[metric]
        for s, r in runs.items()
        if r[metric] is not None and math.isfinite(r[metric])
    }


def contrast(
    cell: Cell,
    x: Mapping[int, Row],
    y: Mapping[int, Row],
    arms: tuple[str, str],
    label: str | None = None,
    metric: str = "test_bpc",
) -> Contrast:
    """The contrast of the runs ``x`` minus ``y`` (``{seed: row}``), paired by seed."""
    x_values, y_values = by_seed(x, metric), by_seed(y, metric)
    shared = x_values.keys() & y_values.keys()
    return Contrast(
        cell[0],
        cell[1],
        *arms,
        label or f"{arms[0]} − {arms[1]}",
        stats.paired_difference(x_values, y_values),
        stats.paired_p_value(x_values, y_values),
        capped=sum(bool(runs[s].get("reached_cap")) for runs in (x, y) for s in shared),
        first_eval=sum(best_at_first_eval(runs[s]) for runs in (x, y) for s in shared),
    )


def trained_tokens_per_param(row: Mapping[str, Any]) -> float | None:
    """The tokens that trained a run's tested parameters per parameter,
    ``steps_to_best * step_tokens / params`` (None where one is missing).

    Examples:
        >>> trained_tokens_per_param(
        ...     {"steps_to_best": 300, "step_tokens": 2048, "params": 614_400})
        1.0
        >>> trained_tokens_per_param({"steps_to_best": 300, "step_tokens": None,
        ...                           "params": 614_400}) is None
        True
    """
    steps, tokens, params = (
        row.get(k) for k in ("steps_to_best", "step_tokens", "params")
    )
    if steps is None or tokens is None or not params:
        return None
    return steps * tokens / params


def best_at_first_eval(row: Row) -> bool:
    """Whether the run's best validation was its first (``steps_to_best ==
    eval_every``): its best parameters may lie before it.

    Examples:
        >>> best_at_first_eval({"steps_to_best": 100, "eval_every": 100})
        True
        >>> best_at_first_eval({"steps_to_best": 200, "eval_every": 100})
        False
        >>> best_at_first_eval({"steps_to_best": 100, "eval_every": None})
        False
    """
    every, best = row.get("eval_every"), row.get("steps_to_best")
    return every is not None and best == every


def paired_contrasts(
    groups: Mapping[tuple, Mapping[int, Row]],
    pairs: Sequence[tuple[str, str]],
    metric: str = "test_bpc",
) -> list[Contrast]:
    """Each of ``pairs`` in every cell of ``groups`` (:func:`group_runs`'s)
    that has runs of both arms, in cell order, of ``metric``."""
    cells = sorted({key[:2] for key in groups}, key=cell_order)
    return [
        contrast(cell, groups[(*cell, x)], groups[(*cell, y)], (x, y), metric=metric)
        for cell in cells
        for x, y in pairs
        if (*cell, x) in groups and (*cell, y) in groups
    ]


@dataclasses.dataclass(frozen=True)
class Family:
    """The primary contrasts of every cell, corrected together.

    Attributes:
        contrasts: every cell x :data:`PRIMARY` that has paired test runs,
            with Holm p, pooled and simultaneous intervals.
        pooled: each contrast label's pooled spread over the cells.
        head_shares: ``{vocab: head share}`` of the tied arm a.
        size: the family's size ``m``: every cell of the design (every cell
            with tuning or test runs of these arms) x :data:`PRIMARY`, as named
            before the runs. Holm and Bonferroni correct for all ``m``, the
            contrasts without test runs yet included (as untested).
    """

    contrasts: list[Contrast]
    pooled: dict[str, stats.PooledStd]
    head_shares: dict[str, float]
    size: int


def primary_family(rows: Sequence[Row]) -> Family:
    """:data:`PRIMARY` in every cell, Holm-adjusted over all of them (the
    design's, :attr:`Family.size`, not only those measured so far), with
    each contrast's spread pooled over the cells (``stats.pooled_std``)."""
    groups = group_runs(rows, "test")
    plain = paired_contrasts(groups, PRIMARY)
    arms = {arm for pair in PRIMARY for arm in pair}
    design = {
        (r["vocab"], r["amount"])
        for r in rows
        if r["role"] in ("tune", "test") and r["arm"] in arms
    }
    size = max(len(design) * len(PRIMARY), len(plain))
    pooled = {}
    for label in dict.fromkeys(c.label for c in plain):
        pooled[label] = stats.pooled_std(
            [_differences(groups, c) for c in plain if c.label == label]
        )
    # An untested contrast enters Holm's count as NaN, which never rejects.
    untested = [math.nan] * (size - len(plain))
    holm = stats.holm_adjusted([c.p for c in plain] + untested)
    tuned = any(r["role"] == "tune" for r in rows)  # no tuning stage: no edges
    edges = (
        {(t.vocab, t.amount, t.arm) for t in tunings(rows) if t.at_edge}
        if tuned
        else set()
    )
    contrasts = [
        dataclasses.replace(
            c,
            holm_p=adjusted,
            pooled=pooled[c.label].interval(c.difference.mean, c.difference.n),
            simultaneous=stats.simultaneous_interval(c.difference, size),
            edge=tuple(
                arm
                for arm in (c.minuend, c.subtrahend)
                if (c.vocab, c.amount, arm) in edges
            )
            if tuned
            else None,
        )
        for c, adjusted in zip(plain, holm)
    ]
    shares = {}
    for (vocab, _, arm), runs in groups.items():
        for row in runs.values():
            if arm == "a" and row.get("head_share") is not None:
                shares.setdefault(vocab, row["head_share"])
    return Family(contrasts, pooled, shares, size)


def place_means(
    groups: Mapping[tuple, Mapping[int, Row]], c: Contrast
) -> dict[float, tuple[float, int]]:
    """``{offset: (mean difference, pairs)}``: a contrast's paired
    differences by the place in the training plays its subset was drawn
    from (``offset``), so that the choice of plays shows as a source of
    variance; one place where every run reads the same text.

    Examples:
        >>> d = stats.paired_difference({}, {})
        >>> run = lambda seed, bpc: dict(offset=seed % 2 / 2, test_bpc=bpc)
        >>> groups = {("char", 0.01, arm): {s: run(s, s + (arm == "b") * (s + 1))
        ...                                 for s in range(4)} for arm in "ab"}
        >>> place_means(groups, Contrast("char", 0.01, "b", "a", "b − a", d, 1.0))
        {0.0: (2.0, 2), 0.5: (3.0, 2)}
    """
    return {
        offset: (math.fsum(d) / len(d), len(d))
        for offset, d in _by_place(groups, c).items()
    }


def blocked_by_place(
    groups: Mapping[tuple, Mapping[int, Row]], c: Contrast
) -> tuple[float, float, float]:
    """``(mean, low, high)``: the contrast with each pair's subset place as a
    block (``stats.blocked_mean``): the mean of the places' means, with a
    95% t-interval on the spread within places (``n - places`` degrees of
    freedom). NaN where the runs have one place only."""
    places = _by_place(groups, c)
    if len(places) < 2:
        return math.nan, math.nan, math.nan
    return stats.blocked_mean(list(places.values()))


def _by_place(groups: Mapping[tuple, Mapping[int, Row]], c: Contrast) -> dict:
    """``{offset: [paired differences]}``, in offset order."""
    x = groups[(c.vocab, c.amount, c.minuend)]
    y = groups[(c.vocab, c.amount, c.subtrahend)]
    xs, ys = by_seed(x), by_seed(y)
    places: dict[float, list[float]] = {}
    for seed in sorted(xs.keys() & ys.keys()):
        places.setdefault(x[seed]["offset"], []).append(xs[seed] - ys[seed])
    return dict(sorted(places.items()))


def _differences(groups: Mapping[tuple, Mapping[int, Row]], c: Contrast) -> list:
    x = by_seed(groups[(c.vocab, c.amount, c.minuend)])
    y = by_seed(groups[(c.vocab, c.amount, c.subtrahend)])
    return [x[s] - y[s] for s in x if s in y]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """A cell's arm: its tuning losses and the rate its test runs use.

    Attributes:
        vocab, amount, arm: the cell's arm.
        losses: ``{lr: {seed: validation loss}}`` (nats/token, what chose
            the rate) of its finished tuning runs; ``inf`` where not finite.
        bits: the same runs' validation bits/char, ``{lr: {seed: bpc}}``.
        seeds: the tuning seeds.
        chosen: the test runs' rates (one, once the tuning is done).
    """

    vocab: str
    amount: float
    arm: str
    losses: dict[float, dict[int, float]]
    bits: dict[float, dict[int, float]]
    seeds: tuple[int, ...]
    chosen: tuple[float, ...]

    @property
    def mean_loss(self) -> dict[float, tuple[float, int]]:
        """``{lr: (mean validation loss, tuning runs)}``."""
        return {
            lr: (sum(by_seed.values()) / len(by_seed), len(by_seed))
            for lr, by_seed in self.losses.items()
        }

    @property
    def best(self) -> float | None:
        """The rate of the lowest mean tuning loss."""
        means = self.mean_loss
        return min(means, key=lambda lr: means[lr][0]) if means else None

    @property
    def at_edge(self) -> bool:
        """Whether a chosen rate is the lowest or highest of two or more
        rates tried: the arm's best may lie beyond (an untuned arm, which
        takes arm a's rate, is never at an edge of its own)."""
        tried = sorted(self.mean_loss)
        return len(tried) > 1 and bool(set(self.chosen) & {tried[0], tried[-1]})

    def is_chosen(self, lr: float) -> bool:
        return any(math.isclose(lr, c, rel_tol=1e-9) for c in self.chosen)


def _finite_or_inf(value: float) -> float:
    # As the sweep reads a diverged run's loss: never the best.
    return value if math.isfinite(value) else math.inf


def tunings(rows: Sequence[Row]) -> list[Tuning]:
    """Every cell's arm with tuning or test runs, in cell and arm order."""
    values = {
        name: collections.defaultdict(lambda: collections.defaultdict(dict))
        for name in ("val_loss", "val_bpc")
    }
    seeds, chosen = collections.defaultdict(set), collections.defaultdict(set)
    for row in rows:
        key = (row["vocab"], row["amount"], row["arm"])
        if row["role"] == "tune" and row["status"] == FINISHED:
            seeds[key].add(row["seed"])
            for name, found in values.items():
                if row[name] is not None:
                    found[key][row["lr"]][row["seed"]] = _finite_or_inf(row[name])
        elif row["role"] == "test":
            chosen[key].add(row["lr"])
    losses, bits = values["val_loss"], values["val_bpc"]
    keys = sorted(set(losses) | set(chosen), key=lambda k: (cell_order(k[:2]), k[2]))
    return [
        Tuning(
            *key,
            dict(sorted(losses[key].items())),
            dict(sorted(bits[key].items())),
            tuple(sorted(seeds[key])),
            tuple(sorted(chosen[key])),
        )
        for key in keys
    ]


class Margin(NamedTuple):
    """A tuned arm's chosen rate against the next best one (by mean tuning
    loss): ``margin`` is the mean over ``seeds``, the tuning seeds, of the
    next rate's validation bits/char minus the chosen rate's, paired by
    seed."""

    chosen: float
    following: float
    margin: float
    seeds: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SelectionNoise:
    """How far each tuned arm's chosen rate is from the next best rate, set
    against the seeds' noise in that distance, in validation bits/char.

    Attributes:
        margins: ``{(vocab, amount, arm): Margin}``.
        pooled: ``{vocab: PooledStd}``, the standard deviation of the paired
            differences behind the margins pooled over each vocabulary's
            arms (:func:`~lmhead.lab.stats.pooled_std`).
    """

    margins: dict[tuple, Margin]
    pooled: dict[str, stats.PooledStd]

    def standard_error(self, vocab: str, seeds: int) -> float:
        """A margin's standard error over ``seeds`` seeds of a ``vocab`` arm:
        ``pooled[vocab].std / sqrt(seeds)``."""
        return self.pooled[vocab].std / math.sqrt(seeds)


def selection_noise(tunings: Sequence[Tuning]) -> SelectionNoise:
    """The margin of each arm whose chosen rate was tuned (two rates or more,
    with the same two or more seeds and finite bits/char as the chosen), and
    the pooled spread.

    Examples:
        >>> bits = {0.001: {100: 2.0, 101: 2.2}, 0.002: {100: 1.9, 101: 2.0},
        ...         0.004: {100: 2.1, 101: 2.3}}
        >>> tuned = Tuning("char", 0.01, "a", bits, bits, (100, 101), (0.002,))
        >>> noise = selection_noise([tuned])
        >>> found = noise.margins[("char", 0.01, "a")]
        >>> found.following, round(found.margin, 4)  # 0.001 against 0.002: +0.1, +0.2
        (0.001, 0.15)
        >>> round(noise.pooled["char"].std, 4), noise.pooled["char"].dof
        (0.0707, 1)
    """
    margins, differences = {}, collections.defaultdict(list)
    for tuning in tunings:
        chosen = [lr for lr in tuning.losses if tuning.is_chosen(lr)]
        if len(chosen) != 1:
            continue
        chosen = chosen[0]
        mine = tuning.bits.get(chosen, {})
        usable = {
            lr
            for lr, by_seed in tuning.bits.items()
            if by_seed.keys() == mine.keys()
            and tuning.losses[lr].keys() == mine.keys()
            and all(map(math.isfinite, by_seed.values()))
        }
        means = {lr: m for lr, (m, _) in tuning.mean_loss.items() if lr in usable}
        if chosen not in means or len(means) < 2 or len(mine) < 2:
            continue
        following = min((lr for lr in means if lr != chosen), key=means.get)
        seeds = tuple(sorted(mine))
        paired = [tuning.bits[following][s] - mine[s] for s in seeds]
        margins[(tuning.vocab, tuning.amount, tuning.arm)] = Margin(
            chosen, following, sum(paired) / len(paired), seeds
        )
        differences[tuning.vocab].append(paired)
    return SelectionNoise(
        margins,
        {
            vocab: stats.pooled_std(differences[vocab])
            for vocab in sorted(differences, key=vocab_order)
        },
    )


@dataclasses.dataclass(frozen=True)
class Ablation:
    """The table learning-rate ablation.

    Attributes:
        groups: ``{(vocab, amount, arm, multiplier): {seed: row}}``.
        contrasts: each multiplier against 1 within an arm, and b - a at
            each multiplier (unadjusted).
        borrowed: the cells' arms whose multiplier 1 is their test runs.
    """

    groups: dict[tuple, dict[int, Row]]
    contrasts: list[Contrast]
    borrowed: list[str]


def ablation_groups(rows: Sequence[Row]) -> Ablation:
    """The ablation's runs by cell, arm and multiplier; an arm without
    ablation runs at multiplier 1 takes its cell's test runs there."""
    groups = group_runs(rows, "ablation")
    tested = group_runs(rows, "test")
    borrowed = []
    for vocab, amount, arm in sorted({k[:3] for k in groups}):
        if (vocab, amount, arm, 1.0) not in groups and (vocab, amount, arm) in tested:
            groups[(vocab, amount, arm, 1.0)] = tested[(vocab, amount, arm)]
            borrowed.append(f"{cell_label((vocab, amount))} {arm}")
    groups = dict(
        sorted(groups.items(), key=lambda i: (cell_order(i[0][:2]), *i[0][2:]))
    )
    contrasts = []
    for (vocab, amount, arm, m), runs in groups.items():
        cell = (vocab, amount)
        if m != 1.0 and (*cell, arm, 1.0) in groups:
            label = f"{cell_label(cell)}, {arm}: m = {m:g} − m = 1"
            contrasts.append(
                contrast(cell, runs, groups[(*cell, arm, 1.0)], (arm, arm), label)
            )
    for (vocab, amount, arm, m), runs in groups.items():
        if arm == "b" and (vocab, amount, "a", m) in groups:
            label = f"{cell_label((vocab, amount))}, m = {m:g}: b − a"
            contrasts.append(
                contrast(
                    (vocab, amount),
                    runs,
                    groups[(vocab, amount, "a", m)],
                    ("b", "a"),
                    label,
                )
            )
    return Ablation(groups, contrasts, borrowed)


@dataclasses.dataclass(frozen=True)
class Totals:
    """What the rows' runs took.

    Attributes:
        runs: rows.
        runs_by_role, runs_by_status: their counts.
        steps: training steps run, summed.
        wall_seconds: the runs trained alone summed, plus each ensemble
            program once (its members' largest: each reports the program's).
        programs: the ensemble programs.
    """

    runs: int
    runs_by_role: dict[str, int]
    runs_by_status: dict[str, int]
    steps: int
    wall_seconds: float
    programs: int


def measured_totals(rows: Sequence[Row]) -> Totals:
    """The rows' counts, steps and wall time.

    Examples:
        >>> def row(seconds, program=None):
        ...     return {"role": "test", "status": "finished", "steps_run": 10,
        ...             "wall_seconds": seconds, "ensemble": program}
        >>> totals = measured_totals([row(10.0), row(30.0, "p"), row(31.0, "p")])
        >>> totals.wall_seconds, totals.steps, totals.programs
        (41.0, 30, 1)
    """
    single, programs = 0.0, {}
    for row in rows:
        seconds = row["wall_seconds"] or 0.0
        if row["ensemble"] is None:
            single += seconds
        else:
            programs[row["ensemble"]] = max(programs.get(row["ensemble"], 0.0), seconds)
    roles = collections.Counter(r["role"] for r in rows)
    return Totals(
        len(rows),
        {role: roles[role] for role in ("tune", "test", "ablation") if roles[role]},
        dict(sorted(collections.Counter(r["status"] for r in rows).items())),
        sum(r["steps_run"] or 0 for r in rows),
        single + sum(programs.values()),
        len(programs),
    )
