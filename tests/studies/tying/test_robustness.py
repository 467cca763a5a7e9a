"""Tests for studies/tying/robustness.py: failed runs against the rule
written out here, the verdicts without them against the confirmatory check
on hand-filtered rows, the model's interaction test against statsmodels'
formula interface, and the committed report regenerated from its tables."""

import os

import numpy as np
import pandas as pd
import pytest
import statsmodels.formula.api as smf

from studies.tying import confirm, failures, robustness, table
from tests import ROOT
from tests.studies.tying.sweep_file import study_module

TABLES = {
    name: os.path.join(ROOT, "docs", "tying_study", name, "runs.csv")
    for name in robustness.TABLES
}


@pytest.fixture(scope="module")
def committed():
    return {name: table.read_rows(path) for name, path in TABLES.items()}


def test_failed_runs_are_those_past_their_groups_median(committed):
    rows = failures.unique_rows(committed.values())
    failed = failures.failed_runs(rows)
    groups = {}
    for r in rows:
        if r["amount"] == 1.0 and r["status"] == "finished":
            key = (r["vocab"], r["steps_cap"], r["role"], r["arm"], r["lr"])
            key += (r["table_lr_multiplier"],)
            groups.setdefault(key, []).append(r)
    expected = {
        r["run"]
        for own in groups.values()
        for r in own
        if r["train_bpc"] > np.median([o["train_bpc"] for o in own]) + 0.06
    }
    assert failed == expected
    # The three test runs the review found spiked, and no other test run.
    spiked = {
        (r["vocab"], r["arm"], r["seed"])
        for r in rows
        if r["run"] in failed and r["role"] == "test"
    }
    assert spiked == {("2048", "a", 213), ("8192", "a", 206), ("8192", "a", 212)}


def test_the_verdicts_without_failed_runs_are_the_check_on_the_rest(committed):
    module = study_module()
    hypotheses = [confirm.Hypothesis(*h) for h in module.HYPOTHESES["nanogpt"]]
    rows = committed["confirm"]
    plain, kept = robustness.without_failed(rows, hypotheses, 0.0049)
    assert plain == confirm.check_hypotheses(rows, hypotheses, 0.0049)
    drop = {("2048", "a", 213), ("8192", "a", 206), ("8192", "a", 212)}
    rest = [r for r in rows if (r["vocab"], r["arm"], r["seed"]) not in drop]
    assert kept == confirm.check_hypotheses(rest, hypotheses, 0.0049)
    bpe8192_c = kept[5]
    assert bpe8192_c.contrast.difference.n == 14
    assert bpe8192_c.verdict == confirm.CONFIRMED  # exploratory; +0.0149


def test_the_interaction_test_is_statsmodels_likelihood_ratio(committed):
    runs = [r for r in committed["confirm"] if r["role"] == "test"]
    frame = pd.DataFrame(
        {
            "y": [r["test_bpc"] for r in runs],
            "arm": [r["arm"] for r in runs],
            "cell": [f"{r['vocab']}/{r['amount']}" for r in runs],
            "group": [f"{r['vocab']}/{r['amount']}/{r['seed']}" for r in runs],
        }
    )
    fits = [
        smf.mixedlm(formula, frame, groups=frame["group"]).fit(reml=False)
        for formula in ("y ~ C(arm) * C(cell)", "y ~ C(arm) + C(cell)")
    ]
    chi2, dof, p, n = robustness.fit_arms_model(committed["confirm"])
    assert (dof, n) == (6, 192)
    assert chi2 == pytest.approx(2 * (fits[0].llf - fits[1].llf), rel=1e-4)
    assert chi2 == pytest.approx(93.2, abs=0.05)  # the review's figure
    assert p < 1e-15


def test_two_of_the_profiles_six_calls_reversed(committed):
    module = study_module()
    hypotheses = [confirm.Hypothesis(*h) for h in module.HYPOTHESES["nanogpt"]]
    results = confirm.check_hypotheses(committed["confirm"], hypotheses, 0.0049)
    calls = robustness.bootstrap_calls(committed["profiles"], results)
    outcomes = {(h.vocab, h.label): outcome for h, _, _, outcome in calls}
    assert sorted(outcomes.values()).count("reversed") == 2
    assert outcomes[("8192", "b − a")] == outcomes[("512", "b − a")] == "reversed"
    assert sum(o == "no call" for o in outcomes.values()) == 2


def test_the_committed_report_is_what_its_tables_give_today(tmp_path):
    module = study_module()
    args = module.parse("compute")
    text, _ = robustness.report_from_csv(
        TABLES,
        str(tmp_path),
        [confirm.Hypothesis(*h) for h in module.HYPOTHESES["nanogpt"]],
        module.EQUIVALENCE_MARGIN,
        module.compute_cell(args),
    )
    path = os.path.join(ROOT, "docs", "tying_study", "robustness", "REPORT.md")
    with open(path, encoding="utf-8") as f:
        assert text == f.read()
