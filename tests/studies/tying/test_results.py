"""Tests for lmhead/studies/tying/results.py: the synthetic study's runs
(synthetic_study.py here) read back by cell, with the known chosen rates
and values."""

import math

import pytest

from lmhead.studies.tying import results
from tests.studies.tying.synthetic_study import (
    STUDY_CHARS_PER_TOKEN,
    STUDY_CHOSEN_LR,
    STUDY_UNFINISHED,
    study_seeds,
    study_values,
)


@pytest.fixture(scope="module")
def collected(study_dir):
    design, runs = study_dir
    return design, *results.collect(design, str(runs))


def test_collect_reads_every_cell_at_its_chosen_rate(collected):
    design, cells, runs = collected
    assert [r.cell for r in cells] == design.cells()
    assert len(runs) == len(design.tuning_runs()) + 2 * len(design.cells())
    for result in cells:
        assert result.lr == STUDY_CHOSEN_LR[result.cell.arm]
        assert sorted(result.tuning) == sorted(design.learning_rates)
        assert sorted(result.runs) == list(design.seeds)
        # Seed 0 at the chosen rate is the tuning run there.
        assert result.runs[0] is result.tuning[result.lr]
        assert sorted(result.finished()) == study_seeds(result.cell)


def test_cell_values_are_the_known_values_of_the_finished_seeds(collected):
    _, cells, _ = collected
    for result in cells:
        seeds = study_seeds(result.cell)
        for column, key in enumerate(("test", "val", "train")):
            assert results.cell_values(result, key) == pytest.approx(
                {s: study_values(result.cell, s)[column] for s in seeds}
            )
        assert results.cell_values(result, "chars_per_token") == pytest.approx(
            {s: STUDY_CHARS_PER_TOKEN[result.cell.vocab] for s in seeds}
        )
        assert results.parameters(result) == result.design_params


def test_paired_differences_pair_the_seeds_both_arms_finished(collected):
    design, cells, _ = collected
    regime, vocab, arm, seed = STUDY_UNFINISHED
    in_regime = [r for r in cells if r.cell.regime.name == regime]
    difference = results.paired(in_regime, vocab, arm, "b")
    by_arm = {r.cell.arm: r.cell for r in in_regime if r.cell.vocab == vocab}
    expected = [
        study_values(by_arm[arm], s)[0] - study_values(by_arm["b"], s)[0]
        for s in design.seeds
        if s != seed
    ]
    assert difference.n == len(expected) == 2
    assert difference.mean == pytest.approx(sum(expected) / 2)
    assert results.paired(in_regime, vocab, arm, "e") is None
    tied = results.tied_result(in_regime, vocab)
    assert tied.cell.arm == "a" and tied.cell.vocab == vocab
    share = results.head_share(tied)
    assert share == pytest.approx(
        tied.cell.vocab_size * tied.cell.shape.d_model / tied.design_params
    )
    assert not math.isnan(share)
