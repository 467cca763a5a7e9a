"""Tests for lmhead/studies/tying/rate_noise.py's arithmetic against numpy
and the formula (tests/experiments/test_tying_rate_noise.py runs it on
trained runs)."""

import numpy as np
import pytest

from lmhead.studies.tying import rate_noise


def test_paired_windows_and_combine_seeds_against_numpy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    mean, error = rate_noise.paired_windows(a, b)
    assert mean == pytest.approx((b - a).mean())
    assert error == pytest.approx(np.std(b - a, ddof=1) / np.sqrt(50))
    pairs = [(0.1, 0.02), (0.3, 0.05), (-0.1, 0.01)]
    assert rate_noise.combine_seeds(pairs) == pytest.approx(
        (0.1, np.sqrt(0.02**2 + 0.05**2 + 0.01**2) / 3)
    )
    with pytest.raises(ValueError, match="same W >= 2"):
        rate_noise.paired_windows(a, b[:10])
    with pytest.raises(ValueError, match="same W >= 2"):
        rate_noise.paired_windows(a[:1], b[:1])
