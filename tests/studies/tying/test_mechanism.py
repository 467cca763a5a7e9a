"""Tests of the mechanism test (configs/sweeps/tying_study.py:mechanism and
studies/tying/mechanism.py): arm b at each table multiplier k on a
ladder of its own beside the profiled cell's arms a and b, whose committed
runs it reuses by name; whether a k closes b - a on synthetic tables; and
the report written again from its runs.csv alone."""

import os

import numpy as np
import pytest

from lmhead.lab import sweeps
from studies.tying import mechanism, profiles, study, table
from tests import ROOT
from tests.studies.tying.committed import assert_regenerates
from tests.studies.tying.sweep_file import STUDY, study_module

PROFILES_CSV = os.path.join(ROOT, "docs", "tying_study", "profiles", "runs.csv")
R1, R2, R3 = 0.0005, 0.000707, 0.001
SEEDS = (100, 101, 102)


def test_each_multiplier_is_an_arm_b_on_a_ladder_of_its_own():
    design = study_module().get_study("mechanism")
    assert design.shared_ladder and design.margin == 2
    assert design.tuning_seeds == study.PROFILE_SEEDS
    ladders = design.ladders()
    assert [[(c.arm, c.table_lr) for c in g] for g in ladders] == [
        [("a", 1.0), ("b", 1.0)],
        [("b", 0.5)],
        [("b", 2.0)],
        [("b", 4.0)],
    ]
    assert {(c.vocab, c.amount.fraction) for g in ladders for c in g} == {(512, 0.003)}
    runs = design.tuning_runs()
    rates = {k: {p.lr for p in runs if p.cell.table_lr == k} for k in (1, 0.5, 2, 4)}
    assert all(r == rates[1] and len(r) == 6 for r in rates.values())
    for planned, o in zip(runs, map(design.overrides, runs)):
        k = o.get("optim.table_lr_multiplier", 1.0)
        assert k == planned.cell.table_lr == planned.table_lr
        assert o["train.steps"] == 300 and o["train.patience"] == 0


def test_a_multipliers_ladder_grows_past_its_own_best_only():
    """b×2 is best at the top of the first rungs, a and b inside: only b×2's
    ladder grows (two rungs above), a's and b's not."""
    design = study_module().get_study("mechanism,multipliers=2")
    grid = design.tuning_runs()
    top = max(p.lr for p in grid)

    def run(planned):
        index = study._ladder_index(planned.lr)
        best = 3 if planned.cell.table_lr == 2.0 else 0
        return study.workdirs.Run(
            "r",
            "r",
            {},
            {},
            [],
            {"best": {"eval/loss": 2.0 + 0.01 * (index - best) ** 2}},
            "finished",
        )

    grown = design.tuning_runs({p: run(p) for p in grid})
    added = grown[len(grid) :]
    assert {p.cell.table_lr for p in added} == {2.0}
    assert sorted({p.lr for p in added}) == [study.ladder_rate(4), study.ladder_rate(5)]
    assert all(p.lr > top for p in added)


def test_the_committed_profile_runs_are_reused_and_only_the_ks_are_planned(tmp_path):
    """Restored from the committed profile, arms a and b of the cell are
    finished under their names: the sweep lists them (done) and the 54
    runs of the three ks' first rungs, nothing else."""
    spec = f"{STUDY}:mechanism"
    restored = sweeps.restore_runs(spec, PROFILES_CSV, str(tmp_path))
    assert sum(name.startswith("train_fraction=0.003,") for name in restored) == 72
    module = study_module()
    _, overrides, shared = module.get_sweep("mechanism", str(tmp_path))
    design = module.get_study("mechanism")
    committed = {r["run"] for r in table.read_rows(PROFILES_CSV)}
    names = sweeps.run_names(overrides)
    fresh = [o for o, n in zip(overrides, names) if n not in committed]
    reused = [o for o, n in zip(overrides, names) if n in committed]
    assert len(reused) == 2 * 8 * 3  # arms a and b, eight rungs, three seeds
    assert all("optim.table_lr_multiplier" not in o for o in reused)
    ks = sorted(o["optim.table_lr_multiplier"] for o in fresh)
    assert ks == [0.5] * 18 + [2.0] * 18 + [4.0] * 18
    read = study.read_tuning(design, str(tmp_path))
    assert sum(r.status == "finished" for r in read.values()) == 48
    assert shared["train.eval_every"] == 25


def row(arm, k, lr, seed, bpc):
    return dict.fromkeys(table.COLUMNS) | {
        "role": "tune",
        "vocab": "512",
        "amount": 0.003,
        "arm": arm,
        "table_lr_multiplier": k,
        "lr": lr,
        "seed": seed,
        "val_loss": bpc,
        "val_bpc": bpc,
        "status": "finished",
        "eval_every": 25,
        "steps_to_best": 200,
        "steps_cap": 300,
        "run": f"{arm}{k}{lr}{seed}",
    }


def synthetic():
    """Arm a best at R2; b worse than a by 0.04-0.06 on every seed (best at
    R1); b×2 within ±0.01 of a per seed (best at R2); b×0.5 like b."""
    rows = []
    for i, seed in enumerate(SEEDS):
        curve = {R1: 2.02, R2: 2.0, R3: 2.03}
        rows += [row("a", 1.0, lr, seed, v) for lr, v in curve.items()]
        gap = (0.05, 0.06, 0.04)[i]
        rows += [
            row("b", 1.0, lr, seed, v + gap - (lr == R1) * 0.03)
            for lr, v in curve.items()
        ]
        rows += [row("b", 0.5, lr, seed, v + gap) for lr, v in curve.items()]
        near = (0.01, -0.01, 0.0)[i]
        rows += [row("b", 2.0, lr, seed, v + near) for lr, v in curve.items()]
    return rows


def test_a_k_that_closes_b_minus_a_by_hand(tmp_path):
    rows = synthetic()
    (profile,) = profiles.profiles(rows)
    assert profile.arms == ["a", "b", "b×0.5", "b×2"]
    assert mechanism.multipliers(rows) == [(0.5, "b×0.5"), (2.0, "b×2")]
    baseline = profiles.bootstrap(profile, "b", "a")
    at_2 = profiles.bootstrap(profile, "b×2", "a")
    at_half = profiles.bootstrap(profile, "b×0.5", "a")
    # Every resample picks the same bests (a, b×2, b×0.5 at R2, b at R1), so
    # the 27 contrasts are the resampled means of the per-seed differences.
    per_seed = {"b": (0.04, 0.05, 0.03), "b×2": (0.01, -0.01, 0.0)}
    for b, arm in ((baseline, "b"), (at_2, "b×2")):
        means = [
            np.mean([per_seed[arm][SEEDS.index(s)] for s in draw])
            for draw in profiles.resamples(SEEDS)
        ]
        low, high = np.percentile(means, [2.5, 97.5])
        assert (b.low, b.high) == pytest.approx((low, high))
        assert b.difference == pytest.approx(np.mean(per_seed[arm]))
    assert baseline.best == R1 and at_2.best == R2
    assert baseline.low > 0 and at_2.low < 0 < at_2.high and at_half.low > 0
    assert mechanism.closes(baseline, at_2) and not mechanism.closes(baseline, at_half)
    path = str(tmp_path / "runs.csv")
    table.write_rows(path, rows)
    text, plots = mechanism.report_from_csv(path, str(tmp_path / "one"))
    again, _ = mechanism.report_from_csv(path, str(tmp_path / "two"))
    assert again == text and len(plots) == 1 and os.path.isfile(plots[0])
    assert "k = 2 closes b − a" in text
    assert "| 0.5 | b×0.5 − a |" in text and text.count("| no |") == 1


def test_no_gap_and_no_closing_are_said(tmp_path):
    rows = [r for r in synthetic() if r["table_lr_multiplier"] != 2.0]
    text, _ = mechanism.write_report(rows, str(tmp_path / "one"))
    assert "No k closes b − a" in text
    # b within ±0.01 of a per seed: nothing to close.
    level = [r for r in rows if r["arm"] == "a" or r["table_lr_multiplier"] != 1.0]
    for r in [r for r in rows if r["arm"] == "a"]:
        near = (0.01, -0.01, 0.0)[SEEDS.index(r["seed"])]
        level.append(row("b", 1.0, r["lr"], r["seed"], r["val_bpc"] + near))
    text, _ = mechanism.write_report(level, str(tmp_path / "two"))
    assert "holds 0 already" in text


def test_a_k_whose_profile_is_unfinished_is_said_and_left_out(tmp_path):
    """b×2's runs not finished (no loss yet): it is listed as profile
    unfinished, and the answer waits for it instead of saying no k closes."""
    rows = [
        r | {"status": "missing", "val_loss": None, "val_bpc": None}
        if r["table_lr_multiplier"] == 2.0
        else r
        for r in synthetic()
    ]
    text, _ = mechanism.write_report(rows, str(tmp_path))
    assert "| 2 | b×2 − a | — | — | — | — | profile unfinished |" in text
    assert "No finished k closes b − a so far (k = 2: profile unfinished)." in text


def test_the_committed_mechanism_report_is_what_its_csv_gives_today(tmp_path):
    """docs/tying_study/mechanism: REPORT.md and its figure, byte for byte,
    from the runs.csv beside them."""
    plots = assert_regenerates("mechanism", mechanism.report_from_csv, tmp_path)
    assert plots == ["profile_512_0.003.png"]
