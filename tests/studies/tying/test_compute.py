"""Tests of the compute axis (configs/sweeps/tying_study.py:compute and
studies/tying/compute.py): b - a at each budget and its change from
budget to budget against scipy and a hand computation on synthetic tables,
a budget without runs said as such, the report written again from its
runs.csv (and the other budgets' table), and the plan: the tiny preset's
dry listing, its test stage at the profile's best rates on the
confirmatory seeds, and the nanogpt preset's first rungs and budget."""

import math
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from lmhead.lab import stats as stats_lib
from lmhead.lab import sweeps
from studies.tying import compute, confirm, study, table
from tests import ROOT
from tests.studies.tying.committed import assert_regenerates
from tests.studies.tying.sweep_file import STUDY, run_sweep, study_module

SEEDS = study.CONFIRM_SEEDS
PARAMS = {"a": 1_152_000, "b": 1_414_144}
CELL = ("2048", 1.0)


def row(arm, steps, seed, bpc, role="test", status="finished", lr=2e-3):
    return dict.fromkeys(table.COLUMNS) | {
        "role": role,
        "vocab": "2048",
        "amount": 1.0,
        "arm": arm,
        "seed": seed,
        "lr": lr,
        "table_lr_multiplier": 1.0,
        "steps_cap": steps,
        "steps_to_best": steps,
        "params": PARAMS[arm],
        "step_tokens": 768,
        "train_tokens": 2_000_000,
        "test_bpc": bpc,
        "val_loss": bpc,
        "val_bpc": bpc,
        "eval_every": 100,
        "status": status,
        "run": f"{arm},{steps},{seed},{role},{lr}",
    }


def synthetic():
    """Arm a and b's test bits/char at 1000 and 3000 steps on the 16
    confirmatory seeds (b − a a seed's own term plus a budget's), and the
    per-seed differences."""
    rng = np.random.default_rng(7)
    a = {1000: 2.2 + 0.03 * rng.standard_normal(16)}
    a[3000] = a[1000] - 0.2 + 0.01 * rng.standard_normal(16)
    shared = 0.01 * rng.standard_normal(16)
    d = {
        1000: -0.010 + shared + 0.004 * rng.standard_normal(16),
        3000: +0.004 + shared + 0.004 * rng.standard_normal(16),
    }
    rows = []
    for steps in (1000, 3000):
        rows += [row("a", steps, s, float(v)) for s, v in zip(SEEDS, a[steps])]
        rows += [
            row("b", steps, s, float(v + x), lr=1.41e-3)
            for s, v, x in zip(SEEDS, a[steps], d[steps])
        ]
    return rows, d


def t_interval(values):
    n = len(values)
    half = scipy_stats.t.ppf(0.975, n - 1) * np.std(values, ddof=1) / math.sqrt(n)
    return values.mean() - half, values.mean() + half


def test_b_minus_a_and_its_change_against_a_hand_computation():
    rows, d = synthetic()
    low, high = (compute.point(rows, *CELL, steps) for steps in (1000, 3000))
    for t, steps in ((low, 1000), (high, 3000)):
        assert t.status == "" and (t.planned, t.finished) == (32, 32)
        assert t.difference.n == 16
        assert t.difference.mean == pytest.approx(d[steps].mean())
        assert (t.difference.low, t.difference.high) == pytest.approx(
            t_interval(d[steps])
        )
        b = np.array(
            [r["test_bpc"] for r in rows if (r["arm"], r["steps_cap"]) == ("b", steps)]
        )
        a = np.array(
            [r["test_bpc"] for r in rows if (r["arm"], r["steps_cap"]) == ("a", steps)]
        )
        assert t.p == pytest.approx(scipy_stats.ttest_rel(b, a).pvalue, rel=1e-6)
        for arm in "ab":
            own = t.arms[arm]
            assert own.tokens_per_param == pytest.approx(steps * 768 / PARAMS[arm])
            assert own.passes == pytest.approx(steps * 768 / 2_000_000)
            assert own.best_step == steps
        assert (t.arms["a"].rate, t.arms["b"].rate) == (2e-3, 1.41e-3)
    change, p = compute.change(low, high)
    by_hand = d[3000] - d[1000]
    assert change.n == 16 and change.mean == pytest.approx(by_hand.mean())
    assert (change.low, change.high) == pytest.approx(t_interval(by_hand))
    assert p == pytest.approx(scipy_stats.ttest_rel(d[3000], d[1000]).pvalue)
    # The seed's shared term cancels in the change: pairing narrows it.
    unpaired = math.sqrt(np.var(d[3000], ddof=1) / 16 + np.var(d[1000], ddof=1) / 16)
    assert change.high - change.low < 2 * 1.96 * unpaired
    # Paired by seed: a seed missing at one budget leaves the change.
    missing = [r for r in rows if (r["steps_cap"], r["seed"]) != (1000, SEEDS[0])]
    fewer, _ = compute.change(compute.point(missing, *CELL, 1000), high)
    assert fewer.n == 15
    assert fewer.mean == pytest.approx(by_hand[1:].mean())


def test_a_budget_without_runs_and_one_under_way_are_said():
    rows, _ = synthetic()
    assert compute.point(rows, *CELL, 10_000).status == compute.NOT_RUN
    tuning = [row("a", 10_000, 100, 2.0, role="tune", status="running")]
    assert compute.point(rows + tuning, *CELL, 10_000).status == (
        compute.PROFILE_UNFINISHED
    )
    running = [
        r | {"status": "running", "test_bpc": None}
        if (r["steps_cap"], r["arm"], r["seed"]) == (3000, "b", SEEDS[-1])
        else r
        for r in rows
    ]
    t = compute.point(running, *CELL, 3000)
    assert t.status == "31 of 32 finished" and t.difference.n == 15
    # Another cell's or a table multiplier's runs are not the cell's.
    other = [r | {"vocab": "8192"} for r in rows] + [
        r | {"table_lr_multiplier": 2.0} for r in rows
    ]
    assert compute.point(other, *CELL, 3000).status == compute.NOT_RUN


def test_the_report_regenerates_from_its_csv_and_the_other_budgets_table(tmp_path):
    """The 3000-step runs (with their profile's tuning rows) in runs.csv,
    the 1000-step ones in another table: the report joins them once each,
    says 10,000 steps are not yet run, and is the same written again from
    the two tables, figures included, byte for byte."""
    rows, d = synthetic()
    own = [r for r in rows if r["steps_cap"] == 3000]
    for arm, best in (("a", 2e-3), ("b", 1.41e-3)):
        for lr in (1e-3, 1.41e-3, 2e-3):
            own += [
                row(arm, 3000, s, 2.0 + (lr != best) * 0.01, role="tune", lr=lr)
                for s in (100, 101, 102)
            ]
    path, other = str(tmp_path / "runs.csv"), str(tmp_path / "confirm.csv")
    table.write_rows(path, own)
    # The other table repeats a 3000-step run (joined once) and holds the
    # 1000-step profile, whose section comes first.
    profile = [
        row(arm, 1000, s, 2.2 + (lr != 2e-3) * 0.01, role="tune", lr=lr)
        for arm in "ab"
        for lr in (1.41e-3, 2e-3, 2.83e-3)
        for s in (100, 101, 102)
    ]
    earlier = [r for r in rows if r["steps_cap"] == 1000]
    table.write_rows(other, earlier + profile + own[:1])
    kwargs = dict(cell=CELL, budgets=(1000, 3000, 10_000))
    others = {"`confirm`": other, "`absent`": str(tmp_path / "absent.csv")}
    text, plots = compute.report_from_csv(
        path, str(tmp_path / "one"), others=others, **kwargs
    )
    again, plots_again = compute.report_from_csv(
        path, str(tmp_path / "two"), others=others, **kwargs
    )
    assert again == text and open(tmp_path / "one" / "REPORT.md").read() == text
    assert [os.path.basename(p) for p in plots] == [
        "compute_axis.png",
        "profile_2048_1_1000steps.png",
        "profile_2048_1_3000steps.png",
    ]
    for one, two in zip(plots, plots_again):
        assert open(one, "rb").read() == open(two, "rb").read()
    assert "for the other budgets, `confirm`." in text and "`absent`" not in text
    assert f"| 10000 | {compute.NOT_RUN} |" in text
    assert "| 3000 | 32 finished | 0.002; 0.00141 |" in text
    change = d[3000] - d[1000]
    low, high = t_interval(change)
    assert (
        f"| 1000 → 3000 | 16 | {change.mean():+.4f} [{low:+.4f}, {high:+.4f}]" in text
    )
    assert "## BPE 2048 on 100% of the text, 3000 steps" in text
    # Without the other table: 1000 steps not yet run, no change.
    alone, _ = compute.report_from_csv(path, str(tmp_path / "three"), **kwargs)
    assert f"| 1000 | {compute.NOT_RUN} |" in alone
    assert "| 1000 → 3000 | 0 | — | — |" in alone


def test_the_compute_preset_is_the_cell_at_3000_steps_one_rung_lower():
    module = study_module()
    design = module.get_study("compute")
    profiles = module.get_study("profiles,bpe=2048,char=false,amounts=1.0")
    (ladder,) = design.ladders()
    assert [(c.vocab, c.amount.fraction, c.arm) for c in ladder] == [
        (2048, 1.0, "a"),
        (2048, 1.0, "b"),
    ]
    assert ladder[0].amount.steps == 3000 and design.margin == 2
    assert design.tuning_seeds == study.PROFILE_SEEDS and design.test_seeds == SEEDS
    runs = design.tuning_runs()
    first = sorted({p.lr for p in profiles.tuning_runs()})
    rates = sorted({p.lr for p in runs})
    assert len(runs) == 2 * 6 * 3
    assert rates == [study.ladder_rate(study._ladder_index(r) - 1) for r in first]
    for o in map(design.overrides, runs):
        assert o["train.steps"] == 3000 and o["train.patience"] == 0
    _, _, shared = module.get_sweep("compute,stage=tune")
    assert shared["train.eval_every"] == 100 and shared["train.test_eval"] is True
    # Its runs are new: the step budget is in every name.
    names = set(design.names(runs))
    for path in ("runs.csv", "edges/runs.csv", "profiles/runs.csv"):
        committed = {
            r["run"] for r in table.read_rows(f"{ROOT}/docs/tying_study/{path}")
        }
        assert names.isdisjoint(committed)
    with pytest.raises(ValueError, match="not among budgets"):
        module.get_study("compute,budgets=1000")
    with pytest.raises(ValueError, match="one profiled cell"):
        module.get_study("compute,char=true")
    with pytest.raises(ValueError, match="fraction twice"):
        study.Design(
            "tiny",
            {},
            (None,),
            (study.Amount(1.0, 1000), study.Amount(1.0, 3000)),
            ("a",),
            {None: 0},
            (0,),
        )


def test_the_tiny_preset_lists_its_profile_then_its_test_runs(tmp_path):
    """The tiny preset's dry listing is its profile's first rungs (arms a and
    b, the two rungs one below profiles_tiny's, three tuning seeds, 60 steps,
    patience off); with its ladder grown and finished (restored from
    synthetic tables), the sweep lists each arm's two confirmatory seeds at
    its best rate."""
    spec = f"{STUDY}:compute_tiny"
    command = [
        sys.executable,
        os.path.join(ROOT, "experiments", "sweep.py"),
        f"--sweep={spec},stage=tune",
        f"--workdir={tmp_path / 'dry'}",
        "--dry_run",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    listed = subprocess.run(
        command, check=True, cwd=ROOT, env=env, capture_output=True, text=True
    )
    commands = [shlex.split(line) for line in listed.stdout.splitlines()]
    assert len(commands) == 2 * 2 * 3
    flags = [
        dict(a.removeprefix("--config.").split("=", 1) for a in c[3:]) for c in commands
    ]
    assert {f["train.steps"] for f in flags} == {"60"}
    assert {f["train.patience"] for f in flags} == {"0"}
    assert {f["data.tokenizer"] for f in flags} == {"char"}
    assert {f["model.tied"] for f in flags} == {"True", "False"}
    assert {f["train.seed"] for f in flags} == {"100", "101", "102"}
    assert {float(f["optim.lr"]) for f in flags} == {
        study.ladder_rate(3),
        study.ladder_rate(4),
    }
    module = study_module()
    design = module.get_study("compute_tiny")
    best = {"a": 2, "b": 4}
    workdir = str(tmp_path / "runs")
    for round_ in range(6):
        read = study.read_tuning(design, workdir)
        todo = [(p, r) for p, r in read.items() if r.status != "finished"]
        if not todo:
            break
        rows = [
            row(p.cell.arm, 60, p.seed, None, role="tune", lr=p.lr)
            | {
                "vocab": "char",
                "eval_every": None,
                "step_tokens": None,
                "val_loss": 2.0
                + 0.01 * (study._ladder_index(p.lr) - best[p.cell.arm]) ** 2,
                "run": r.name,
            }
            for p, r in todo
        ]
        restored = str(tmp_path / f"profile{round_}.csv")
        table.write_rows(restored, rows)
        sweeps.restore_runs(spec, restored, workdir)
    _, overrides, shared = module.get_sweep("compute_tiny", workdir)
    assert len(overrides) == 2 * 2
    assert {o["train.seed"] for o in overrides} == set(SEEDS[:2])
    assert {(o["model.tied"], o["optim.lr"]) for o in overrides} == {
        (True, study.ladder_rate(2)),
        (False, study.ladder_rate(4)),
    }
    assert {o["train.steps"] for o in overrides} == {60}
    assert shared["train.test_eval"] is True


@pytest.mark.slow
def test_the_tiny_compute_axis_runs_end_to_end(tmp_path):
    """compute_tiny's profile and test runs trained by the sweep command,
    then the report through the sweep file: its 60-step point from the two
    confirmatory seeds, its 30-step one not yet run, and the same report
    written again from its runs.csv."""
    for arg in ("compute_tiny,stage=tune", "compute_tiny"):
        run_sweep(tmp_path, arg)
    module = study_module()
    out = tmp_path / "report"
    text, plots = module.write_report("compute_tiny", str(tmp_path), str(out))
    rows = table.read_rows(str(out / "runs.csv"))
    tested = [r for r in rows if r["role"] == "test"]
    assert len(tested) == 4 and all(r["status"] == "finished" for r in tested)
    assert {r["steps_run"] for r in rows} == {60}
    (point,) = [compute.point(rows, "char", 1.0, 60)]
    assert point.status == "" and point.difference.n == 2
    assert f"| 30 | {compute.NOT_RUN} |" in text and "| 60 | 4 finished |" in text
    assert [os.path.basename(p) for p in plots] == [
        "compute_axis.png",
        "profile_char_1_60steps.png",
    ]
    again, _ = module.report_from_csv("compute_tiny")(
        str(out / "runs.csv"), str(tmp_path / "again")
    )
    assert again == text


def test_the_committed_compute_report_is_what_its_tables_give_today(tmp_path):
    """docs/tying_study/compute: REPORT.md and its figures, byte for byte,
    from the runs.csv beside them and the confirmatory table, as the sweep
    file's ``report_from_csv("compute")`` joins them."""
    write = study_module().report_from_csv("compute")
    assert "compute_axis.png" in assert_regenerates("compute", write, tmp_path)


def test_past_early_training_tests_its_family_and_welch_across_seeds(tmp_path):
    """Past early training: the 3000-step test runs on fresh seeds (300-315)
    against 1000-step runs on the confirmatory ones: their change is Welch's
    difference of the two budgets' mean b − a; the family's hypotheses (this
    cell's and another cell's, whose runs are in its own table) are tested
    together, Holm over both, as confirm.check_hypotheses tests them."""
    rows, d = synthetic()
    fresh = [
        r | {"seed": r["seed"] + 100, "run": r["run"] + "'"}
        for r in rows
        if r["steps_cap"] == 3000
    ]
    earlier = [r for r in rows if r["steps_cap"] == 1000]
    other = [
        r | {"vocab": "char", "run": r["run"] + "c", "test_bpc": r["test_bpc"] - 0.1}
        for r in fresh
    ]
    path, kin = str(tmp_path / "runs.csv"), str(tmp_path / "other.csv")
    table.write_rows(path, fresh)
    table.write_rows(kin, other)
    hypotheses = (
        ("2048", 1.0, 3000, "b", "a", +1, "a test"),
        ("char", 1.0, 3000, "b", "a", -1, "a test"),
    )
    confirm_csv = str(tmp_path / "confirm.csv")
    table.write_rows(confirm_csv, earlier)
    text, _ = compute.report_from_csv(
        path,
        str(tmp_path / "out"),
        cell=CELL,
        budgets=(1000, 3000),
        others={"`confirm`": confirm_csv},
        hypotheses=hypotheses,
        family=[kin, str(tmp_path / "absent.csv")],
    )
    change, p = stats_lib.welch_difference(d[3000], d[1000])
    assert f"| 1000 → 3000 | none (16 and 16, Welch) | {change.mean:+.4f}" in text
    expected = confirm.check_hypotheses(
        fresh + other,
        [confirm.Hypothesis(h[0], h[1], *h[3:]) for h in hypotheses],
        0.0,
    )
    assert [r.verdict for r in compute.verdicts(fresh + other, hypotheses, 0.0)] == [
        r.verdict for r in expected
    ]
    assert confirm.results_table(expected, 0.0) in text
    assert "## Failed runs of this cell" in text
