"""Tests for studies/tying/across_cells.py (the mixed model across
cells and the power table) and flags_text.py (the runs to read narrowly), on
the report of the synthetic rows: the model against statsmodels' formula
interface run here, the power against the noncentral t integrated by hand,
the flags against the rows; and the design's text where a table has no arm d
or no subset amount."""

import math

import numpy as np
import pandas as pd
import pytest
import statsmodels.formula.api as smf
from scipy import integrate, stats

from studies.tying import across_cells, design_text
from tests.studies.tying import synthetic_rows
from tests.studies.tying.test_analysis import (
    assert_close,
    by_seed,
    check_p,
    finished,
    numbers,
    section,
    tables,
)

# (vocab, amount) whose b − a moves by this much, for an interaction.
INTERACTION_CELL, INTERACTION = ("char", 1.0), 0.1


@pytest.fixture(scope="module")
def text(reported):
    return reported[0]


def differences_frame(rows, x, y):
    """The per-seed differences x − y of every cell, as a DataFrame."""
    found = []
    for vocab, amount in synthetic_rows.BASE_BPC:
        xs = by_seed(rows, role="test", vocab=vocab, amount=amount, arm=x)
        ys = by_seed(rows, role="test", vocab=vocab, amount=amount, arm=y)
        found += [(vocab, amount, s, xs[s] - ys[s]) for s in sorted(set(xs) & set(ys))]
    return pd.DataFrame(found, columns=["vocab", "amount", "seed", "d"])


def statsmodels_tests(frame):
    """``{test: (χ², df, p)}`` of the formula interface's MixedLM, with
    its own (alphabetical) reference level and Wald tests by term name."""
    model = smf.mixedlm("d ~ C(vocab) * np.log(amount)", frame, groups=frame["seed"])
    with np.errstate(all="ignore"):
        fit = model.fit(reml=True)
    names = list(fit.fe_params.index)
    interaction = [n for n in names if ":" in n]
    vocab = [n for n in names if n.startswith("C(vocab)")]
    amount = [n for n in names if "log(amount)" in n]
    found = {}
    for test, terms in zip(across_cells.TESTS, (interaction, vocab, amount)):
        wald = fit.wald_test(", ".join(f"{t} = 0" for t in terms), scalar=True)
        found[test] = (float(wald.statistic), len(terms), float(wald.pvalue))
    return found


def model_lines(text):
    (lines,) = tables(section(text, "## One model across cells"))
    return {line["contrast"]: line for line in lines}


def test_the_model_against_statsmodels(rows, text):
    lines = model_lines(text)
    assert set(lines) == {"b − a", "c − a"}
    for label, line in lines.items():
        frame = differences_frame(rows, *label.split(" − "))
        assert int(line["differences"]) == len(frame)
        assert (int(line["cells"]), int(line["seeds"])) == (4, 8)
        for test, (chi2, dof, p) in statsmodels_tests(frame).items():
            got_chi2, got_dof, *_ = numbers(line[f"{test}: χ² (df), p"])
            assert got_chi2 == pytest.approx(chi2, abs=0.06)
            assert got_dof == dof
            check_p(line[f"{test}: χ² (df), p"].split(", ")[-1], p)


def test_an_interaction_is_found_and_none_where_there_is_none(rows, text):
    # The synthetic arms' effects are the same in every cell: no interaction.
    plain = model_lines(text)["b − a"]["vocabulary × amount: χ² (df), p"]
    assert float(plain.split(", ")[-1]) > 0.01
    moved = [
        r | {"test_bpc": r["test_bpc"] + INTERACTION}
        if (r["vocab"], r["amount"]) == INTERACTION_CELL
        and r["arm"] == "b"
        and r["test_bpc"] is not None
        else r
        for r in rows
    ]
    frame = differences_frame(moved, "b", "a")
    points = list(frame.itertuples(index=False, name=None))
    model = across_cells.fit_cells_model("b − a", points)
    chi2, dof, p = model.tests["vocabulary × amount"]
    want = statsmodels_tests(frame)["vocabulary × amount"]
    assert (chi2, dof) == (pytest.approx(want[0], rel=1e-3), want[1])
    assert p < 1e-4 and p == pytest.approx(want[2], rel=1e-2)


def test_the_model_is_not_fitted_on_one_amount(rows):
    one = [r for r in rows if r["amount"] == 1.0]
    assert across_cells.model_section(one).endswith(
        "and every vocabulary at two amounts."
    )
    points = [("char", 1.0, 0, 0.1), ("char", 1.0, 1, 0.2)]
    assert across_cells.fit_cells_model("b − a", points) is None


def power_by_integration(effect, std, n, alpha):
    """The paired t-test's power at a true mean ``effect``: the normal
    numerator integrated over the chi-square of the spread."""
    dof, shift = n - 1, effect * math.sqrt(n) / std
    critical = stats.t.ppf(1 - alpha / 2, dof)

    def found(v):
        scale = math.sqrt(v / dof)
        rejected = stats.norm.sf(critical * scale - shift)
        rejected += stats.norm.cdf(-critical * scale - shift)
        return rejected * stats.chi2.pdf(v, dof)

    return integrate.quad(found, 0, np.inf, limit=200)[0]


def test_the_power_table_against_the_noncentral_t_by_hand(rows, text):
    (lines,) = tables(section(text, "## Power"))
    assert "family of 8 (α = 0.05/8;" in text  # 4 cells x 2 contrasts
    assert len(lines) == 8  # 4 cells x b − a, c − a
    for line in lines:
        vocab = "char" if line["vocabulary"] == "characters" else "2048"
        amount = float(line["amount"].rstrip("%")) / 100
        x, y = line["contrast"].split(" − ")
        xs = by_seed(rows, role="test", vocab=vocab, amount=amount, arm=x)
        ys = by_seed(rows, role="test", vocab=vocab, amount=amount, arm=y)
        d = np.array([xs[s] - ys[s] for s in sorted(set(xs) & set(ys))])
        std = d.std(ddof=1)
        assert int(line["n"]) == len(d)
        assert_close(float(line["sd of differences"]), std)
        for column, alpha in (
            ("detectable at α = 0.05", 0.05),
            ("detectable, Bonferroni", 0.05 / 8),
        ):
            effect = float(line[column])
            # Printed to 4 decimals: the power crosses 80% within that step.
            low = power_by_integration(effect - 5e-5, std, len(d), alpha)
            high = power_by_integration(effect + 5e-5, std, len(d), alpha)
            assert low <= 0.8 <= high


def test_the_runs_best_at_their_first_validation_are_flagged(rows, text):
    flags = section(text, "## Flags")
    first, edges = tables(flags)
    vocab, amount, arm = synthetic_rows.FIRST_EVAL
    seeds = sorted(
        r["seed"]
        for r in finished(rows, role="test", vocab=vocab, amount=amount, arm=arm)
        if r["steps_to_best"] == r["eval_every"]
    )
    assert first == [
        {
            "vocabulary": "characters",
            "amount": "1%",
            "arm": arm,
            "seeds": "0..7",
            "runs": f"{len(seeds)} of 8",
        }
    ]
    tested = len(finished(rows, role="test"))
    assert f"; {len(seeds)} runs of {tested}." in flags


def test_the_arms_at_a_ladder_edge_are_flagged(rows, text):
    _, edges = tables(section(text, "## Flags"))
    want = set()
    for vocab, amount in synthetic_rows.BASE_BPC:
        for arm in synthetic_rows.arms_of(vocab):
            tried = sorted(
                {
                    r["lr"]
                    for r in finished(
                        rows, role="tune", vocab=vocab, amount=amount, arm=arm
                    )
                }
            )
            (chosen,) = {
                r["lr"]
                for r in finished(
                    rows, role="test", vocab=vocab, amount=amount, arm=arm
                )
            }
            if chosen == tried[0] or chosen == tried[-1]:
                side = "lowest" if chosen == tried[0] else "highest"
                want.add((vocab, f"{amount:.0%}", arm, side))
    got = {
        (
            "char" if e["vocabulary"] == "characters" else e["vocabulary"][4:],
            e["amount"],
            e["arm"],
            e["edge"],
        )
        for e in edges
    }
    assert got == want and want


def test_a_table_without_arm_d_or_subsets_says_neither(rows):
    checked = [
        r for r in rows if r["amount"] == 1.0 and r["arm"] in "abc"
    ]  # like the edges check: some arms, all of the text
    design = design_text.design_section(checked)
    assert "No arm d" not in design
    assert "subset amount" not in design
    assert design.endswith("The whole split is budget-limited by design.")
    # Where another vocabulary has arm d, the one without it is named.
    assert "No arm d at characters" in design_text.design_section(rows)
