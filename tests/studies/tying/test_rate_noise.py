"""Tests for studies/tying/rate_noise.py's arithmetic against numpy,
and its keeping of earlier readings (tests/experiments/test_tying_rate_noise.py
runs it on trained runs)."""

import numpy as np
import pytest

from studies.tying import rate_noise
from tests.studies.tying import synthetic_rows


def test_window_margin_averages_the_seeds_window_by_window():
    rng = np.random.default_rng(0)
    chosen = [rng.normal(size=50) for _ in range(3)]
    following = [c + 0.1 + rng.normal(size=50) * 0.2 for c in chosen]
    mean, error = rate_noise.window_margin(chosen, following)
    d = np.mean(following, 0) - np.mean(chosen, 0)
    assert mean == pytest.approx(d.mean())
    assert error == pytest.approx(np.std(d, ddof=1) / np.sqrt(50))


@pytest.mark.parametrize(
    "chosen, following",
    [
        ([np.zeros(5)], [np.zeros(4)]),
        ([np.zeros(5)], [np.zeros(5), np.zeros(5)]),
        ([np.zeros(1)], [np.zeros(1)]),
        ([], []),
    ],
)
def test_window_margin_refuses_mismatched_windows(chosen, following):
    with pytest.raises(ValueError, match=r"\[W\]"):
        rate_noise.window_margin(chosen, following)


def test_an_earlier_reading_stands_only_where_it_read_more_seeds(tmp_path):
    rows = synthetic_rows.synthetic_rows()
    fresh = rate_noise.rate_noise(str(tmp_path), rows)  # no run on this machine
    assert fresh and all(e["seeds"] == [] and e["window_error"] is None for e in fresh)
    first, second = fresh[0], fresh[1]
    earlier = {
        first["key"]: {**first, "seeds": [100], "window_margin": 0.1, "window_error": 0.01},
        # Another pair of rates than the one chosen now: not this arm's reading.
        second["key"]: {**second, "next_lr": -1.0, "seeds": [100], "window_error": 0.2},
    }  # fmt: skip
    found = {e["key"]: e for e in rate_noise.rate_noise(str(tmp_path), rows, earlier)}
    assert found[first["key"]]["seeds"] == [100]
    assert found[first["key"]]["window_error"] == 0.01
    assert found[second["key"]]["window_error"] is None
