"""Tests of the learning-rate profiles (configs/sweeps/tying_study.py:
profiles): the shared ladder that grows to two rungs past every arm's best
(synthetic tuning tables, an edge optimum and a diverged top rung among
them), the cells, seeds and fixed budget of the preset, the committed runs
it reuses by name, and the seeds used so far."""

import csv
import json
import math
import os

import pytest

from lmhead.lab import sweeps
from studies.tying import profiles as profiles_report
from studies.tying import study, table
from tests import ROOT
from tests.studies.tying.sweep_file import STUDY, run_sweep, study_module

COMMITTED = [
    os.path.join(ROOT, "docs", "tying_study", "runs.csv"),
    os.path.join(ROOT, "docs", "tying_study", "edges", "runs.csv"),
]
INF = math.inf


def rung(k):
    return study.ladder_rate(k)


def curve(losses_by_index):
    return {rung(k): loss for k, loss in losses_by_index.items()}


def walk(curves_at, grid, extend, margin):
    """The ladder (rung indices) grown round by round, each round's new
    rungs finished with the losses ``curves_at`` gives (one function of the
    rung index per arm)."""
    tried = list(grid)
    while True:
        curves = [{rung(k): f(k) for k in tried} for f in curves_at]
        added = study.extend_rates(curves, [rung(k) for k in grid], extend, margin)
        new = [k for k in map(study._ladder_index, added) if k not in tried]
        if not new:
            return sorted(tried)
        tried += new


@pytest.mark.parametrize(
    "bests, grid, expected",
    [
        # Both bests inside with two rungs to spare: nothing to add.
        ((2, 3), range(0, 6), list(range(0, 6))),
        # b's best at the top edge: two rungs above it.
        ((2, 5), range(0, 6), list(range(0, 8))),
        # a's best at the bottom edge, c's one below the top.
        ((0, 2, 4), range(0, 6), list(range(-2, 7))),
        # A best that keeps moving up as the ladder grows (a's loss falls
        # with the rate to rung 9): the walk follows it.
        ((9, 1), range(0, 6), list(range(-1, 12))),
    ],
)
def test_the_shared_ladder_reaches_two_rungs_past_every_arms_best(
    bests, grid, expected
):
    arms = [lambda k, b=b: 2.0 + 0.01 * (k - b) ** 2 for b in bests]
    ladder = walk(arms, list(grid), extend=16, margin=2)
    assert ladder == expected
    for b in bests:
        assert {b - 2, b + 2} <= set(ladder)


def test_a_diverged_top_rung_closes_the_ladder_above():
    """Arm a is best at rung 4 and every arm diverged from rung 5 on (a NaN
    run is worse than any finite one): the ladder takes rungs 5 and 6, two
    past a's best, in one round, and nothing above the diverged top; it
    still grows below b's best (rung 1)."""

    def a(k):
        return INF if k >= 5 else 2.0 - 0.01 * k

    def b(k):
        return INF if k >= 5 else 2.0 + 0.01 * (k - 1) ** 2

    assert walk([a, b], [0, 1, 2, 3, 4], extend=16, margin=2) == list(range(-1, 7))
    grid = [rung(k) for k in range(5)]
    done = [curve({k: f(k) for k in range(-1, 7)}) for f in (a, b)]
    added = study.extend_rates(done, grid, 16, margin=2)
    assert added == [rung(5), rung(-1), rung(6)]  # nearest first, then none


def test_an_unfinished_rung_waits_and_the_cap_holds():
    grid = [rung(k) for k in range(3)]
    rising = curve({0: 1.0, 1: 2.0, 2: 3.0})
    assert study.extend_rates([rising, {**rising, rung(2): None}], grid, 8, 2) == []
    assert study.extend_rates([rising], grid, 1, margin=2) == [rung(-1)]
    assert study.extend_rates([rising], grid, 8, margin=2) == [rung(-1), rung(-2)]


@pytest.fixture(scope="module")
def profiles():
    return study_module().get_study("profiles")


def test_the_profiles_cells_seeds_and_budgets(profiles):
    design = profiles
    assert design.shared_ladder and design.margin == 2
    assert design.tuning_seeds == (100, 101, 102) == study.PROFILE_SEEDS
    ladders = design.ladders()
    assert [(g[0].vocab, g[0].amount.fraction) for g in ladders] == [
        (512, 0.003),
        (None, 1.0),
        (2048, 1.0),
        (8192, 1.0),
    ]
    assert all([c.arm for c in g] == ["a", "b", "c"] for g in ladders)
    runs = design.tuning_runs()
    assert len(runs) == 4 * 6 * 3 * 3
    for ladder in ladders:
        rates = {arm: {p.lr for p in runs if p.cell.arm == arm} for arm in "abc"}
        assert rates["a"] == rates["b"] == rates["c"]
        rates = {p.lr for p in runs if p.cell in ladder}
        assert len(rates) == 6
    subset = ladders[0][0].amount
    assert (subset.steps, subset.patience, subset.eval_every) == (300, 0, 25)
    full = ladders[1][0].amount
    assert (full.steps, full.patience, full.eval_every) == (1000, None, None)
    # The cheap cell's runs come first.
    assert {p.cell.amount.fraction for p in runs[: 6 * 3 * 3]} == {0.003}
    module = study_module()
    with pytest.raises(ValueError, match="different intervals"):
        module.get_sweep("profiles")
    _, overrides, shared = module.get_sweep("profiles,amounts=0.003")
    assert shared["train.eval_every"] == shared["train.log_every"] == 25
    assert {o["train.patience"] for o in overrides} == {0}
    assert {o["train.steps"] for o in overrides} == {300}
    _, overrides, shared = module.get_sweep("profiles,amounts=1.0")
    assert shared["train.eval_every"] == 100
    assert {o["train.patience"] for o in overrides} == {3}


def test_the_profiles_reuse_the_committed_tuning_runs_by_name(profiles, tmp_path):
    """A profile run at a rate and seed that v2 or the eight-rung check ran,
    with the same overrides, has the committed run's name: restored from the
    tables, it counts as finished and is not trained again."""
    committed = {}
    for path in COMMITTED:
        with open(path, newline="") as f:
            committed.update({row["run"]: row for row in csv.DictReader(f)})
    design = profiles
    runs = [p for p in design.tuning_runs() if p.cell.amount.fraction == 1.0]
    names = design.names(runs)
    reused = [(p, n) for p, n in zip(runs, names) if n in committed]
    assert {p.seed for p, _ in reused} == {100, 101}
    for planned, name in reused:
        row = committed[name]
        assert row["role"] == "tune" and float(row["lr"]) == planned.lr
        assert row["arm"] == planned.cell.arm and int(row["seed"]) == planned.seed
    # Seeds 100 and 101 of the 100% cells that v2 and the check ran at these
    # rungs: 68 of the 108.
    assert len(reused) == 68
    spec = f"{STUDY}:profiles,amounts=1.0"
    for path in COMMITTED:
        sweeps.restore_runs(spec, path, str(tmp_path))
    read = study.read_tuning(design, str(tmp_path))
    finished = {r.name for r in read.values() if r.status == "finished"}
    assert finished == {n for _, n in reused}


def test_no_test_seed_is_a_tuning_seed_and_new_seeds_are_checked(profiles):
    used = study.SEEDS_USED
    tuning = set(used["tuning (v2)"]) | set(used["tuning (profiles)"])
    assert tuning.isdisjoint(used["test (v2)"])
    assert set(profiles.tuning_seeds).isdisjoint(profiles.test_seeds)
    assert study.new_seeds([8, 9]) == (8, 9)
    for seed, use in ((7, "test"), (101, "tuning"), (102, "tuning")):
        with pytest.raises(ValueError, match=rf"seeds \[{seed}\] .* {use}"):
            study.new_seeds([seed, 300])
    with pytest.raises(ValueError, match="overlap"):
        study_module().get_study("profiles,tuning_seeds=7+100")


@pytest.mark.slow
def test_the_tiny_profiles_run_end_to_end(tmp_path):
    """The tiny profiles (BPE 300 on 20%, arms a, b, c, a two-rung ladder on
    three tuning seeds) trained by the sweep command, then read back: every
    planned run finished, and the ladder holds a rung past each arm's best."""
    arg = "profiles_tiny,char=false"
    run_sweep(tmp_path, arg)
    design = study_module().get_study(arg)
    read = study.read_tuning(design, str(tmp_path))
    assert read and all(r.status == "finished" for r in read.values())
    chosen = study.choose_learning_rates(design, read)
    ladder = sorted({p.lr for p in read})
    for lr in chosen.values():
        assert ladder[0] < lr < ladder[-1] or len(ladder) == 2 + design.extend_edges
    summary = json.loads(
        open(os.path.join(next(iter(read.values())).workdir, "summary.json")).read()
    )
    assert summary["steps_run"] == 40
    # The report command's profiles mode: runs.csv of the tuning runs, and
    # the report that this runs.csv alone gives again.
    out = tmp_path / "report"
    text, plots = study_module().write_report(arg, str(tmp_path), str(out))
    rows = table.read_rows(str(out / "runs.csv"))
    assert len(rows) == len(read) and {r["role"] for r in rows} == {"tune"}
    assert {r["eval_every"] for r in rows} == {5}
    # Every profiled cell's curves in one figure, and the cell's own.
    assert [os.path.basename(p) for p in plots] == [
        "profiles.png",
        "profile_300_0.2.png",
    ]
    assert "b − a" in text and "c − a" in text
    again, _ = profiles_report.report_from_csv(
        str(out / "runs.csv"), str(tmp_path / "again")
    )
    assert again == text
