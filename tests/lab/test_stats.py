"""Tests for lmhead/lab/stats.py: the t quantile against scipy, the paired
interval against a known t-test, mean and std against numpy."""

import math

import numpy as np
import pytest
from scipy import stats

from lmhead.lab import stats as stats_lib


def test_t_critical_values_match_scipy():
    for dof in range(1, 201):
        assert stats_lib.t_critical_95(dof) == pytest.approx(
            stats.t.ppf(0.975, dof), abs=2e-6
        ), dof
    with pytest.raises(ValueError, match="dof"):
        stats_lib.t_critical_95(0)
    with pytest.raises(TypeError, match="dof"):
        stats_lib.t_critical_95(2.0)


def test_paired_interval_matches_a_known_t_test():
    # R: t.test(c(1, 2, 3, 4)) gives the 95% interval 0.4457397 .. 4.5542603.
    difference = stats_lib.paired_difference(
        {s: s + 1.0 for s in range(4)}, {s: 0.0 for s in range(4)}
    )
    assert difference.low == pytest.approx(0.4457397, abs=1e-6)
    assert difference.high == pytest.approx(4.5542603, abs=1e-6)
    assert difference.excludes_zero
    single = stats_lib.paired_difference({0: 1.0, 1: 2.0}, {0: 0.5})
    assert single.n == 1 and math.isnan(single.low) and not single.excludes_zero


def test_mean_std_matches_numpy():
    values = [0.3, 1.7, 2.2, 5.0]
    mean, std, n = stats_lib.mean_std(values)
    assert (mean, n) == (pytest.approx(np.mean(values)), 4)
    assert std == pytest.approx(np.std(values, ddof=1))
    assert math.isnan(stats_lib.mean_std([1.0])[1])
