"""Tests for lmhead/lab/stats.py: the paired interval against a known t-test
(the t quantile's values are its doctest's, from a t table), mean and std
against numpy, Holm by hand, Holm and the detectable difference against
their values before they called statsmodels, the pooled, blocked,
simultaneous and equivalence tests against scipy (the last against
statsmodels' TOST too), the detectable difference against the normal limit
and a simulation, and the refusals."""

import math

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats import multitest, weightstats

from lmhead.lab import stats as stats_lib
from tests.errors import bad_input_test

# A paired difference of two pairs, for the refusals below.
TWO_PAIRS = stats_lib.paired_difference({0: 1.0, 1: 2.0}, {0: 0.0, 1: 0.0})
BAD_INPUTS = [
    ("dof 0", lambda: stats_lib.t_critical_95(0), ValueError, "dof"),
    ("dof a float", lambda: stats_lib.t_critical_95(2.0), TypeError, "dof"),
    ("p-value past 1", lambda: stats_lib.holm_adjusted([0.5, 1.5]), ValueError, "p_values"),
    ("family of none", lambda: stats_lib.simultaneous_interval(TWO_PAIRS, 0), ValueError, "family_size"),
    *(
        (f"margin {m}", lambda m=m: stats_lib.equivalence_p_value(TWO_PAIRS, m), ValueError, "margin")
        for m in (0.0, -0.1, math.nan, math.inf, True)
    ),
    ("alpha 0", lambda: stats_lib.minimum_detectable_difference(1.0, 8, alpha=0.0), ValueError, "alpha"),
    ("alpha True", lambda: stats_lib.minimum_detectable_difference(1.0, 8, alpha=True), ValueError, "alpha"),
    ("power 1", lambda: stats_lib.minimum_detectable_difference(1.0, 8, power=1.0), ValueError, "power"),
]  # fmt: skip
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


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


def holm_by_hand(p_values):
    """Holm's procedure written out: the i-th smallest p times (m - i),
    made monotone from the smallest up, capped at 1."""
    m = len(p_values)
    order = np.argsort(p_values)
    adjusted = np.empty(m)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, (m - rank) * p_values[index])
        adjusted[index] = min(running, 1.0)
    return adjusted


def test_holm_matches_a_hand_computation():
    # Sorted: 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06),
    # 0.04 (x1 = 0.04, raised to 0.06 to stay monotone).
    assert stats_lib.holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx(
        [0.03, 0.06, 0.06, 0.02]
    )
    assert stats_lib.holm_adjusted([0.3, 0.6, 0.9]) == pytest.approx([0.9, 1.0, 1.0])
    assert stats_lib.holm_adjusted([]) == []
    p_values = np.random.default_rng(0).uniform(0, 0.2, size=16)
    adjusted = stats_lib.holm_adjusted(p_values)
    np.testing.assert_allclose(adjusted, holm_by_hand(p_values), rtol=1e-12)
    ranked = np.asarray(adjusted)[np.argsort(p_values)]
    assert np.all(np.diff(ranked) >= 0) and np.all(ranked <= 1.0)
    assert np.all(np.asarray(adjusted) >= p_values)


nan = math.nan
# holm_adjusted's values at commit 1d7a624 (its step-down, which statsmodels'
# multipletests also gives): p-values in, adjusted p-values out.
HOLM_BEFORE = [
    ([0.01, 0.04, 0.03, 0.005], [0.03, 0.06, 0.06, 0.02]),
    ([0.5, nan], [1.0, nan]),
    ([0.02, nan, 0.01], [0.04, nan, 0.03]),
    ([], []),
    ([nan], [nan]),
    ([nan, nan, 0.2], [nan, nan, 0.6000000000000001]),
    ([0.01, 0.01, 0.02], [0.03, 0.03, 0.03]),
    ([0.3, 0.6, 0.9], [0.8999999999999999, 1.0, 1.0]),
    ([0.0, 1.0], [0.0, 1.0]),
    ([0.25, 0.25, 0.25, 0.25], [1.0, 1.0, 1.0, 1.0]),
    (
        [0.011, 0.047, 0.0003, nan, 0.2, 0.049, nan, 0.6],
        [0.077, 0.28200000000000003, 0.0024, nan, 0.8, 0.28200000000000003, nan, 1.0],
    ),
    (
        list(np.random.default_rng(0).uniform(0, 0.2, size=16)),
        [1.0, 0.5935307702805147, 0.10653116223410619, 0.04958290658558728,
         1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.008763200544473904,
         1.0, 0.0940396108553002, 1.0, 0.4215734894461416],
    ),
]  # fmt: skip
# minimum_detectable_difference's before it called statsmodels (its own
# noncentral t power at commit 1d7a624): (std, n, alpha, power) -> difference.
DETECTABLE_BEFORE = [
    ((1.0, 8, 0.05, 0.8), 1.1560346779947352),
    ((1.0, 8, 0.05 / 32, 0.8), 2.193774344584696),
    ((0.02, 8, 0.05 / 32, 0.8), 0.04387548689169392),
    ((0.3, 20000, 0.01, 0.8), 0.007250108676365104),
    ((0.01, 2, 0.05, 0.8), 0.11549888435882315),
    ((1.0, 3, 0.001, 0.95), 31.60290012095314),
    ((0.0089, 16, 0.05, 0.8), 0.006670244236170638),
    ((0.0089, 16, 0.05 / 8, 0.8), 0.009109593502480636),
    ((0.0123, 16, 0.05 / 24, 0.8), 0.014340984803191981),
    ((0.05, 4, 0.05 / 12, 0.9), 0.29109069864743353),
    ((2.5, 64, 0.05, 0.5), 0.6219476922072493),
    ((0.004, 6, 0.05 / 6, 0.8), 0.008789214921622643),
    ((0.0, 8, 0.05, 0.8), nan),
    ((nan, 8, 0.05, 0.8), nan),
    ((1.0, 1, 0.05, 0.8), nan),
    ((math.inf, 8, 0.05, 0.8), nan),
]


@pytest.mark.parametrize("p_values, before", HOLM_BEFORE)
def test_holm_gives_the_values_it_gave_before_and_statsmodels_gives(p_values, before):
    adjusted = stats_lib.holm_adjusted(p_values)
    assert all(type(p) is float for p in adjusted)  # prints as before
    np.testing.assert_array_equal(adjusted, before)  # bitwise, NaN where NaN
    if p_values:
        reference = multitest.multipletests(p_values, method="holm")[1]
        np.testing.assert_array_equal(adjusted, reference)


@pytest.mark.parametrize("args, before", DETECTABLE_BEFORE)
def test_detectable_difference_gives_the_values_it_gave_before_statsmodels(
    args, before
):
    got = stats_lib.minimum_detectable_difference(*args)
    np.testing.assert_allclose(got, before, rtol=1e-12, atol=0)


def test_holm_keeps_an_untestable_contrast_in_the_family():
    adjusted = stats_lib.holm_adjusted([0.02, math.nan, 0.01])
    assert adjusted[0] == pytest.approx(0.04) and adjusted[2] == pytest.approx(0.03)
    assert math.isnan(adjusted[1])


def test_paired_p_value_matches_scipy_and_a_hand_t():
    rng = np.random.default_rng(2)
    x, y = rng.normal(1.0, 0.5, 8), rng.normal(0.7, 0.5, 8)
    p = stats_lib.paired_p_value(dict(enumerate(x)), dict(enumerate(y)))
    assert p == pytest.approx(stats.ttest_1samp(x - y, 0.0).pvalue, rel=1e-10)
    d = x - y
    t = d.mean() / (d.std(ddof=1) / math.sqrt(8))
    assert p == pytest.approx(2 * stats.t.sf(abs(t), 7), rel=1e-10)
    # The interval excludes zero exactly when p < 0.05.
    interval = stats_lib.paired_difference(dict(enumerate(x)), dict(enumerate(y)))
    assert interval.excludes_zero == (p < 0.05)
    assert math.isnan(stats_lib.paired_p_value({0: 1.0, 1: 2.0}, {0: 0.0, 1: 1.0}))
    assert math.isnan(stats_lib.paired_p_value({0: 1.0}, {0: 0.0, 1: 1.0}))


def test_pooled_std_matches_a_hand_computation():
    rng = np.random.default_rng(3)
    cells = [rng.normal(0, 1, n) for n in (8, 5, 3)] + [[2.0]]
    pooled = stats_lib.pooled_std(cells)
    by_hand = sum((len(c) - 1) * np.var(c, ddof=1) for c in cells[:3]) / (7 + 4 + 2)
    assert pooled.dof == 13
    assert pooled.std == pytest.approx(math.sqrt(by_hand), rel=1e-12)
    # Brown-Forsythe: one-way ANOVA of the distances to each cell's median.
    distances = [np.abs(np.asarray(c) - np.median(c)) for c in cells[:3]]
    assert pooled.equal_spread_p == pytest.approx(stats.f_oneway(*distances).pvalue)
    low, high = pooled.interval(0.25, 8)
    half_width = stats.t.ppf(0.975, 13) * pooled.std / math.sqrt(8)
    assert (low, high) == (
        pytest.approx(0.25 - half_width),
        pytest.approx(0.25 + half_width),
    )
    # One cell pools to its own spread and its own t interval.
    single = stats_lib.pooled_std([cells[0]])
    own = stats_lib.paired_difference(
        dict(enumerate(cells[0])), dict.fromkeys(range(8), 0.0)
    )
    assert single.interval(own.mean, 8) == (
        pytest.approx(own.low),
        pytest.approx(own.high),
    )
    assert math.isnan(single.equal_spread_p)  # one cell: nothing to compare
    empty = stats_lib.pooled_std([[1.0]])
    assert empty.dof == 0 and math.isnan(empty.std)
    assert all(math.isnan(v) for v in empty.interval(1.0, 1))


def test_simultaneous_interval_is_bonferroni_and_agrees_with_holm():
    rng = np.random.default_rng(4)
    family = []
    for shift in (0.0, 0.3, 0.6, 1.2):
        d = rng.normal(shift, 0.5, 8)
        family.append(
            (
                d,
                stats_lib.paired_difference(
                    dict(enumerate(d)), dict.fromkeys(range(8), 0.0)
                ),
            )
        )
    holm = stats_lib.holm_adjusted(
        [stats.ttest_1samp(d, 0.0).pvalue for d, _ in family]
    )
    for (d, difference), adjusted in zip(family, holm):
        low, high = stats_lib.simultaneous_interval(difference, 4)
        half_width = stats.t.ppf(1 - 0.05 / 8, 7) * d.std(ddof=1) / math.sqrt(8)
        assert (low, high) == (
            pytest.approx(d.mean() - half_width),
            pytest.approx(d.mean() + half_width),
        )
        if low > 0 or high < 0:
            assert adjusted < 0.05
    assert all(
        math.isnan(v)
        for v in stats_lib.simultaneous_interval(
            stats_lib.paired_difference({0: 1.0}, {0: 0.0}), 4
        )
    )


@pytest.mark.parametrize("sizes", [(4, 4), (3, 5), (2, 3, 4)])
def test_blocked_mean_is_least_squares_on_effect_coded_blocks(sizes):
    """The intercept and its t-interval of d ~ 1 + blocks, effect-coded
    (each block's column +1 in it, -1 in the last block), by numpy."""
    rng = np.random.default_rng(sum(sizes))
    blocks = [list(rng.normal(0.1 * j, 1.0, n)) for j, n in enumerate(sizes)]
    d = np.concatenate(blocks)
    k, n = len(sizes), len(d)
    columns = [np.ones(n)]
    for j in range(k - 1):
        column = np.concatenate(
            [np.full(m, 1.0 if i == j else (-1.0 if i == k - 1 else 0.0))
             for i, m in enumerate(sizes)]
        )  # fmt: skip
        columns.append(column)
    x = np.stack(columns, axis=1)
    beta = np.linalg.lstsq(x, d, rcond=None)[0]
    residual = d - x @ beta
    covariance = residual @ residual / (n - k) * np.linalg.inv(x.T @ x)
    half = stats.t.ppf(0.975, n - k) * np.sqrt(covariance[0, 0])
    mean, low, high = stats_lib.blocked_mean(blocks)
    np.testing.assert_allclose(
        [mean, low, high], [beta[0], beta[0] - half, beta[0] + half], rtol=1e-10
    )
    assert mean == pytest.approx(np.mean([np.mean(b) for b in blocks]))


def test_blocked_mean_without_spread_to_estimate():
    assert math.isnan(stats_lib.blocked_mean([[1.0], [2.0]])[1])
    assert math.isnan(stats_lib.blocked_mean([[1.0, 2.0], []])[0])


@pytest.mark.parametrize("shift", [0.0, 0.04, -0.07, 0.3])
def test_equivalence_p_value_is_two_one_sided_tests(shift):
    """TOST: the larger of scipy's one-sided one-sample t-tests against the
    margin's two ends, and statsmodels' paired TOST of the pairs; below 0.05
    exactly where the 90% interval lies inside the margin."""
    rng = np.random.default_rng(7)
    differences = shift + 0.05 * rng.standard_normal(9)
    d = stats_lib.paired_difference(
        dict(enumerate(differences)), dict.fromkeys(range(9), 0.0)
    )
    margin = 0.1
    lower = stats.ttest_1samp(differences, -margin, alternative="greater").pvalue
    upper = stats.ttest_1samp(differences, margin, alternative="less").pvalue
    p = stats_lib.equivalence_p_value(d, margin)
    assert p == pytest.approx(max(lower, upper), rel=1e-10)
    ttost, *_ = weightstats.ttost_paired(differences, np.zeros(9), -margin, margin)
    assert p == pytest.approx(ttost, rel=1e-12)
    half = stats.t.ppf(0.95, 8) * differences.std(ddof=1) / 3
    inside = -margin < differences.mean() - half and differences.mean() + half < margin
    assert (p < 0.05) == inside


def test_equivalence_p_value_needs_two_pairs_and_a_spread():
    one = stats_lib.paired_difference({0: 1.0}, {0: 0.0})
    same = stats_lib.paired_difference({0: 1.0, 1: 2.0}, {0: 0.5, 1: 1.5})
    assert math.isnan(stats_lib.equivalence_p_value(one, 0.1))
    assert math.isnan(stats_lib.equivalence_p_value(same, 0.5))
    # A numpy float is a margin too.
    d = stats_lib.paired_difference(
        {0: 0.1, 1: -0.1, 2: 0.0}, dict.fromkeys(range(3), 0.0)
    )
    assert stats_lib.equivalence_p_value(d, np.float32(0.5)) < 0.05


def test_the_detectable_difference_against_the_normal_limit():
    # With many pairs the t-test is the z-test: (z_{1-α/2} + z_power) s / √n.
    n, std, alpha = 20_000, 0.3, 0.01
    want = (stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(0.8)) * std / math.sqrt(n)
    got = stats_lib.minimum_detectable_difference(std, n, alpha, 0.8)
    assert got == pytest.approx(want, rel=1e-3)
    assert math.isnan(stats_lib.minimum_detectable_difference(0.0, 8))


def test_the_detectable_difference_has_the_stated_power_by_simulation():
    # Paired t-tests of simulated differences at the returned mean: about 80%
    # reject, within three binomial standard errors of 20,000 draws.
    rng = np.random.default_rng(0)
    n, std, alpha = 8, 0.02, 0.05 / 32
    effect = stats_lib.minimum_detectable_difference(std, n, alpha, 0.8)
    draws = effect + std * rng.standard_normal((20_000, n))
    p = stats.ttest_1samp(draws, 0.0, axis=1).pvalue
    assert np.mean(p < alpha) == pytest.approx(0.8, abs=3 * math.sqrt(0.16 / 20_000))
