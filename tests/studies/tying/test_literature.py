"""Tests for lmhead/studies/tying/literature.py: the signs of the paired
differences that test each published prediction, counted from the known
values of the synthetic study (conftest.py here)."""

import numpy as np
from scipy import stats

from tests.lab.markdown import table_rows
from tests.studies.tying.synthetic_study import study_seeds, study_values


def test_study_counts_the_signs_that_test_each_prediction(study_report):
    """ "found here": per regime and comparison, how many vocabularies have a
    positive paired mean and an interval wholly above or below zero, from the
    known values (the unfinished seed drops out of its pairs)."""
    design, _, markdown, _ = study_report
    predictions = table_rows(markdown.split("What they predict")[1], "source")
    column = {"test": 0, "train": 2}

    def found(regime, x_arm, y_arm, key):
        positive = above = below = 0
        for vocab in design.vocabularies:
            cells = {
                c.arm: c
                for c in design.cells()
                if c.regime == regime and c.vocab == vocab
            }
            seeds = sorted(
                set(study_seeds(cells[x_arm])) & set(study_seeds(cells[y_arm]))
            )
            diffs = np.array(
                [
                    study_values(cells[x_arm], s)[column[key]]
                    - study_values(cells[y_arm], s)[column[key]]
                    for s in seeds
                ]
            )
            half = (
                stats.t.ppf(0.975, len(diffs) - 1)
                * diffs.std(ddof=1)
                / np.sqrt(len(diffs))
            )
            positive += diffs.mean() > 0
            above += diffs.mean() - half > 0
            below += diffs.mean() + half < 0
        prefix = "training " if key == "train" else ""
        return (
            f"`{regime.name}` {prefix}{x_arm} − {y_arm}: > 0 at {positive} of "
            f"{len(design.vocabularies)} (interval above 0 at {above}, below at {below})"
        )

    checks = [
        (("b", "a", "test"), ("a", "b", "train")),
        (("d", "b", "test"),),
        (("c", "a", "test"),),
        (("b", "a", "test"),),
    ]
    for row, comparisons in zip(predictions, checks):
        assert row["found here"] == "<br>".join(
            found(regime, *c) for regime in design.regimes for c in comparisons
        )
    # The known values: c − a's interval lies above zero; d − b is negative,
    # its interval spanning zero over 3 seeds, but not over the 2 seeds of the
    # cell with an unfinished run (its two differences are equal).
    assert (
        predictions[2]["found here"].count(
            "c − a: > 0 at 2 of 2 (interval above 0 at 2, below at 0)"
        )
        == 2
    )
    assert predictions[1]["found here"] == (
        "`fixed` d − b: > 0 at 0 of 2 (interval above 0 at 0, below at 0)<br>"
        "`limited` d − b: > 0 at 0 of 2 (interval above 0 at 0, below at 1)"
    )
