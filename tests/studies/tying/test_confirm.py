"""Tests of the confirmatory tests (studies/tying/confirm.py and the
sweep file's confirm preset): each verdict of each kind of hypothesis on
synthetic per-seed tables against scipy and Holm written out here, the
report written again from its runs.csv alone, the confirmatory seeds (new,
never tuning seeds), and the plan: only cells whose profile has finished,
each arm at its profile's best rate."""

import math
import os

import numpy as np
import pytest
from scipy import stats as scipy_stats

from lmhead.lab import sweeps
from studies.tying import confirm, study, table
from tests import ROOT
from tests.studies.tying.committed import assert_regenerates
from tests.studies.tying.sweep_file import STUDY, run_sweep, study_module
from tests.studies.tying.synthetic_rows import holm_by_hand

MARGIN = 0.0049
SEEDS = study.CONFIRM_SEEDS
# (vocab, amount, x, prediction, mean of x - a, spread of x - a, verdict).
CASES = (
    ("char", 1.0, "b", +1, 0.030, 0.010, confirm.CONFIRMED),
    ("char", 1.0, "c", +1, -0.030, 0.010, confirm.REFUTED),
    ("2048", 1.0, "b", -1, 0.001, 0.020, confirm.NOT_TOLD),
    ("2048", 1.0, "c", 0, 0.000, 0.002, confirm.CONFIRMED),
    ("512", 0.003, "b", 0, 0.050, 0.005, confirm.REFUTED),
    ("512", 0.003, "c", 0, 0.006, 0.010, confirm.NOT_TOLD),
)


def differences(mean, spread, index):
    """16 per-seed differences with exactly this mean and sample spread."""
    noise = np.random.default_rng(index).standard_normal(len(SEEDS))
    noise = (noise - noise.mean()) / noise.std(ddof=1)
    return mean + spread * noise


def row(vocab, amount, arm, seed, bpc, role="test", status="finished", lr=1e-3):
    return dict.fromkeys(table.COLUMNS) | {
        "role": role,
        "vocab": vocab,
        "amount": amount,
        "arm": arm,
        "seed": seed,
        "lr": lr,
        "table_lr_multiplier": 1.0,
        "test_bpc": bpc,
        "status": status,
        "run": f"{vocab},{amount},{arm},{seed},{role}",
    }


def synthetic():
    """The rows of CASES (arm a at 2.0 + a per-seed term, x at a + the
    difference) and the hypotheses, one per case."""
    rows, hypotheses, per_case = [], [], []
    base = 2.0 + 0.05 * np.random.default_rng(99).standard_normal(len(SEEDS))
    for index, (vocab, amount, arm, sign, mean, spread, _) in enumerate(CASES):
        d = differences(mean, spread, index)
        per_case.append(d)
        if not any(r["vocab"] == vocab and r["arm"] == "a" for r in rows):
            rows += [row(vocab, amount, "a", s, float(v)) for s, v in zip(SEEDS, base)]
        rows += [
            row(vocab, amount, arm, s, float(a + x), lr=2e-3)
            for s, a, x in zip(SEEDS, base, d)
        ]
        hypotheses.append(confirm.Hypothesis(vocab, amount, arm, "a", sign, "here"))
    return rows, hypotheses, per_case


def test_each_verdict_against_scipy_and_holm_by_hand():
    rows, hypotheses, per_case = synthetic()
    results = confirm.check_hypotheses(rows, hypotheses, MARGIN)
    own, two_sided = [], []
    for (_, _, _, sign, *_), d in zip(CASES, per_case):
        zero = np.zeros_like(d)
        if sign:
            side = "greater" if sign > 0 else "less"
            own.append(scipy_stats.ttest_rel(d, zero, alternative=side).pvalue)
        else:  # TOST: both one-sided tests at the margin, the larger p
            above = scipy_stats.ttest_1samp(d, -MARGIN, alternative="greater").pvalue
            below = scipy_stats.ttest_1samp(d, MARGIN, alternative="less").pvalue
            own.append(max(above, below))
        two_sided.append(scipy_stats.ttest_rel(d, zero).pvalue)
    own_holm, two_holm = holm_by_hand(own), holm_by_hand(two_sided)
    m = len(CASES)
    for case, result, d, p, holm, p2, holm2 in zip(
        CASES, results, per_case, own, own_holm, two_sided, two_holm
    ):
        c = result.contrast
        assert c.difference.n == 16 and c.difference.mean == pytest.approx(d.mean())
        assert result.p == pytest.approx(p, rel=1e-6)
        assert result.holm_p == pytest.approx(holm, rel=1e-6)
        assert c.p == pytest.approx(p2, rel=1e-6)
        assert c.holm_p == pytest.approx(holm2, rel=1e-6)
        half = scipy_stats.t.ppf(1 - 0.025 / m, 15) * d.std(ddof=1) / 4
        assert c.simultaneous == pytest.approx((d.mean() - half, d.mean() + half))
        assert result.verdict == case[-1], case
        assert result.rates == (2e-3, 1e-3)
    # The rules, read off the numbers: confirmed by the hypothesis's own
    # test, refuted by the two-sided one (and, for equivalence, an interval
    # wholly outside the margin).
    assert own_holm[0] < 0.05 and own_holm[3] < 0.05
    assert two_holm[1] < 0.05 and per_case[1].mean() < 0
    assert two_holm[4] < 0.05 and results[4].contrast.simultaneous[0] > MARGIN
    assert own_holm[2] >= 0.05 and two_holm[2] >= 0.05
    assert own_holm[5] >= 0.05 and results[5].contrast.simultaneous[0] < MARGIN


def test_an_equivalence_not_confirmed_and_not_outside_the_margin_is_not_refuted():
    """A significant difference whose interval still reaches into the margin
    does not refute "no difference": it is not told apart."""
    d = differences(0.006, 0.004, 7)
    rows = [row("char", 1.0, "a", s, 2.0) for s in SEEDS]
    rows += [row("char", 1.0, "b", s, 2.0 + float(x)) for s, x in zip(SEEDS, d)]
    h = confirm.Hypothesis("char", 1.0, "b", "a", 0, "here")
    (result,) = confirm.check_hypotheses(rows, [h], MARGIN)
    assert result.contrast.holm_p < 0.05
    assert result.contrast.simultaneous[0] < MARGIN < result.contrast.simultaneous[1]
    assert result.verdict == confirm.NOT_TOLD


def test_untested_hypotheses_count_in_holm_and_say_why():
    rows, hypotheses, _ = synthetic()
    alone = confirm.check_hypotheses(rows, hypotheses, MARGIN)
    pending = [*rows, row("8192", 1.0, "a", 100, None, role="tune", status="missing")]
    pending += [row("8192", 1.0, "b", 200, None, status="missing")]
    more = [
        *hypotheses,
        confirm.Hypothesis("8192", 1.0, "b", "a", 0, "here"),
        confirm.Hypothesis("8192", 1.0, "c", "a", +1, "here"),
    ]
    results = confirm.check_hypotheses(pending, more, MARGIN)
    assert [r.verdict for r in results[-2:]] == [
        "runs unfinished (0 of 1)",
        confirm.PROFILE_UNFINISHED,
    ]
    # Eight in the family: each tested p is adjusted by at least as much.
    for a, b in zip(alone, results):
        assert b.holm_p >= a.holm_p and math.isnan(results[-1].holm_p)
    # A cell with a run not finished: its numbers so far, no verdict, and
    # in Holm it counts as untested (so the others' adjusted p as for NaN).
    partial = [
        r | {"status": "running"}
        if (r["vocab"], r["arm"], r["seed"]) == ("char", "b", SEEDS[-1])
        else r
        for r in rows
    ]
    results = confirm.check_hypotheses(partial, hypotheses, MARGIN)
    assert results[0].verdict == "runs unfinished (31 of 32)"
    assert results[0].contrast.difference.n == 15 and math.isnan(results[0].holm_p)
    raw = [r.p for r in alone]
    expected = holm_by_hand(np.array([np.inf] + raw[1:]))[1:]  # last, never rejects
    assert [r.holm_p for r in results[1:]] == pytest.approx(expected)


def test_the_report_regenerates_from_its_runs_csv_alone(tmp_path):
    rows, hypotheses, _ = synthetic()
    path = str(tmp_path / "runs.csv")
    table.write_rows(path, rows)
    text, plots = confirm.report_from_csv(
        path, str(tmp_path / "one"), hypotheses, MARGIN
    )
    again, _ = confirm.report_from_csv(path, str(tmp_path / "two"), hypotheses, MARGIN)
    assert again == text and plots == []
    assert open(tmp_path / "one" / "REPORT.md").read() == text
    assert "2 confirmed, 2 refuted, 2 not told apart, of 6." in text
    assert text.count("**confirmed**") == 2 and text.count("**refuted**") == 2


def test_the_confirmatory_seeds_are_new_and_no_test_seed_tunes():
    used = {k: v for k, v in study.SEEDS_USED.items() if k != "test (confirmatory)"}
    assert study.SEEDS_USED["test (confirmatory)"] == SEEDS == tuple(range(200, 216))
    assert all(set(SEEDS).isdisjoint(seeds) for seeds in used.values())
    design = study_module().get_study("confirm")
    assert design.test_seeds == SEEDS and design.tuning_seeds == study.PROFILE_SEEDS
    assert set(design.test_seeds).isdisjoint(design.tuning_seeds)
    with pytest.raises(ValueError, match="confirmatory seeds"):
        study_module().get_study("confirm,first_seed=0")
    with pytest.raises(ValueError, match="used already"):
        study.new_seeds(SEEDS[:1])


def test_the_hypotheses_are_the_profiled_cells_contrasts():
    module = study_module()
    hypotheses = [confirm.Hypothesis(*h) for h in module.HYPOTHESES["nanogpt"]]
    cells = {(study.vocabulary_label(v), f) for v, f in module.PROFILE_CELLS["nanogpt"]}
    assert {(h.vocab, h.amount) for h in hypotheses} == cells
    assert sorted(h.label for h in hypotheses) == ["b − a"] * 4 + ["c − a"] * 4
    assert {h.predicted for h in hypotheses} == {-1, 0, 1}
    assert module.EQUIVALENCE_MARGIN == MARGIN


def test_the_plan_takes_finished_profiles_only_at_their_best_rates(tmp_path):
    """The tiny confirm preset on a directory whose subset profile has
    finished (restored from synthetic tables as its ladder grows, arm a best
    at rung 3, b and c at rung 2) and whose 100% profile has not: the sweep
    lists that cell's arms at their best rates on the confirmatory seeds,
    none of the 100% cell's, and the cell is planned only once its ladder
    has stopped growing."""
    module = study_module()
    design = module.get_study("confirm_tiny,amounts=0.2")
    best = {"a": 3, "b": 2, "c": 2}
    workdir, spec = str(tmp_path / "runs"), f"{STUDY}:confirm_tiny"
    for round_ in range(4):
        read = study.read_tuning(design, workdir)
        todo = [(p, r) for p, r in read.items() if r.status != "finished"]
        if not todo:
            break
        with pytest.raises(ValueError, match="No profile"):  # a ladder growing
            module.get_sweep("confirm_tiny", workdir)
        rows = [
            row("300", 0.2, p.cell.arm, p.seed, None, role="tune", lr=p.lr)
            | {
                "val_loss": 2.0
                + 0.01 * (study._ladder_index(p.lr) - best[p.cell.arm]) ** 2,
                "run": r.name,
                "steps_cap": 40,
            }
            for p, r in todo
        ]
        path = str(tmp_path / f"profile{round_}.csv")
        table.write_rows(path, rows)
        sweeps.restore_runs(spec, path, workdir)
    assert round_ == 2  # the grid, then one rung each side
    _, overrides, shared = module.get_sweep("confirm_tiny", workdir)
    seeds = study.CONFIRM_SEEDS[:2]
    assert len(overrides) == 3 * len(seeds)
    assert {o["data.train_fraction"] for o in overrides} == {0.2}
    assert {o["train.seed"] for o in overrides} == set(seeds)
    rates = {}
    for o in overrides:
        arm = "a" if o["model.tied"] else ("b" if o["model.mlp_dim"] == 64 else "c")
        rates.setdefault(arm, set()).add(o["optim.lr"])
    assert rates == {arm: {study.ladder_rate(k)} for arm, k in best.items()}
    assert shared["train.eval_every"] == 5 and shared["train.test_eval"] is True
    with pytest.raises(ValueError, match="No profile of these cells has finished"):
        module.get_sweep("confirm_tiny,amounts=1.0", workdir)


def test_the_committed_subset_profile_plans_its_48_runs(tmp_path):
    """A directory holding the committed profiles: the confirm sweep of the
    subset (amounts=0.003) lists the BPE 512 on 0.3% cell's 48 runs, arm a
    at 0.000707 and b and c at 0.0005 (the profile's bests), on the 16
    confirmatory seeds."""
    committed = os.path.join(ROOT, "docs", "tying_study", "profiles", "runs.csv")
    sweeps.restore_runs(f"{STUDY}:confirm", committed, str(tmp_path))
    _, overrides, shared = study_module().get_sweep(
        "confirm,amounts=0.003", str(tmp_path)
    )
    assert len(overrides) == 48
    rates = {}
    for o in overrides:
        rates.setdefault((o["model.tied"], o["model.d_model"]), set()).add(
            o["optim.lr"]
        )
        assert o["train.steps"] == 300 and o["train.patience"] == 0
    assert rates == {
        (True, 128): {0.000707},
        (False, 128): {0.0005},
        (False, 124): {0.0005},
    }
    assert sorted({o["train.seed"] for o in overrides}) == list(SEEDS)
    assert shared["train.eval_every"] == 25 and shared["train.test_eval"] is True


@pytest.mark.slow
def test_the_tiny_confirmation_runs_end_to_end(tmp_path):
    """The tiny profile of BPE 300 on 20% trained, then the confirm_tiny
    sweep on the same directory: each arm's two confirmatory seeds at its
    profile's best rate, test-evaluated, and the report (the 100% cell's
    profile never run: unfinished) written again from its runs.csv alone."""
    module = study_module()
    for arg in ("profiles_tiny,char=false", "confirm_tiny,char=false"):
        run_sweep(tmp_path, arg)
    out = tmp_path / "report"
    text, _ = module.write_report("confirm_tiny", str(tmp_path), str(out))
    rows = table.read_rows(str(out / "runs.csv"))
    tested = [r for r in rows if r["role"] == "test"]
    assert len(tested) == 6 and all(r["status"] == "finished" for r in tested)
    assert all(r["test_bpc"] is not None for r in tested)
    design = module.get_study("confirm_tiny,char=false")
    chosen = study.choose_learning_rates(
        design, study.read_tuning(design, str(tmp_path))
    )
    assert {(r["arm"], r["lr"]) for r in tested} == {
        (cell.arm, lr) for cell, lr in chosen.items()
    }
    assert text.count(confirm.PROFILE_UNFINISHED) == 2
    again, _ = module.report_from_csv("confirm_tiny")(
        str(out / "runs.csv"), str(tmp_path / "again")
    )
    assert again == text


def test_the_committed_confirmatory_report_is_what_its_csv_gives_today(tmp_path):
    """docs/tying_study/confirm/REPORT.md, byte for byte, from the committed
    runs.csv beside it and the sweep file's hypotheses and margin (the
    sweep file's ``report_from_csv("confirm")``)."""
    write = study_module().report_from_csv("confirm")
    assert assert_regenerates("confirm", write, tmp_path) == []
