"""Statistics over seeds for comparing runs that differ in one setting:
:func:`mean_std`, the paired difference and its t-test
(:func:`paired_difference`, :func:`paired_p_value`, :func:`blocked_mean`),
and for a family of comparisons :func:`holm_adjusted`,
:func:`simultaneous_interval`, :func:`equivalence_p_value`,
:func:`pooled_std` and :func:`minimum_detectable_difference`
(``docs/sweeps.md``).
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import optimize as scipy_optimize
from scipy import stats as scipy_stats
from statsmodels.stats import power as power_lib

from lmhead import _checks


def t_critical_95(dof: int) -> float:
    r"""Student's t critical value for a two-sided 95% interval: the 0.975
    quantile of the t distribution with ``dof`` degrees of freedom
    (``scipy.stats.t.ppf``).

    Raises:
        TypeError: ``dof`` is not an integer.
        ValueError: ``dof < 1``.

    Examples:
        >>> round(t_critical_95(2), 6), round(t_critical_95(60), 6)
        (4.302653, 2.000298)
    """
    _checks.check_count("dof", dof)
    return float(scipy_stats.t.ppf(0.975, dof))


def mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    r"""``(mean, sample std, n)``; the std divides by :math:`n - 1` (NaN for n < 2).

    Examples:
        >>> mean_std([1.0, 2.0, 4.0])
        (2.333, 1.528, 3)
        >>> mean_std([])
        (nan, nan, 0)
    """
    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, n
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance), n


@dataclasses.dataclass(frozen=True)
class PairedDifference:
    """``x - y`` over seeds both have, with a two-sided 95% t-interval.

    Attributes:
        mean: mean of the per-seed differences.
        std: their sample standard deviation.
        n: number of pairs.
        low, high: ``mean -+ t(0.975; n-1) * std / sqrt(n)`` (NaN for n < 2).
    """

    mean: float
    std: float
    n: int
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies entirely on one side of zero."""
        return self.n >= 2 and (self.low > 0 or self.high < 0)


def paired_difference(x: dict[Any, float], y: dict[Any, float]) -> PairedDifference:
    r"""The paired difference ``x[s] - y[s]`` over the seeds ``s`` in both.

    .. math::
        \bar d \pm t_{0.975,\,n-1}\, s_d / \sqrt{n}

    Examples:
        >>> d = paired_difference({0: 2.0, 1: 3.0, 2: 4.0, 3: 5.0},
        ...                       {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 9.0})
        >>> d.mean, d.n, round(d.low, 4), round(d.high, 4), d.excludes_zero
        (2.5, 4, 0.4457, 4.5543, True)
    """
    seeds = [s for s in x if s in y]
    mean, std, n = mean_std([x[s] - y[s] for s in seeds])
    if n < 2:
        return PairedDifference(mean, std, n, math.nan, math.nan)
    half_width = t_critical_95(n - 1) * std / math.sqrt(n)
    return PairedDifference(mean, std, n, mean - half_width, mean + half_width)


def paired_p_value(x: dict[Any, float], y: dict[Any, float]) -> float:
    r"""The two-sided p-value of the paired t-test of ``x[s] - y[s]`` over the
    seeds ``s`` in both (``scipy.stats.ttest_rel``): with the differences'
    mean :math:`\bar d`, std :math:`s_d` and count :math:`n`,

    .. math::
        p = 2\,P\left(T_{n-1} > |\bar d| \sqrt{n} / s_d\right).

    NaN for fewer than 2 pairs or differences that are all equal.

    Examples:
        >>> round(paired_p_value({0: 2.0, 1: 3.0, 2: 4.0, 3: 5.0},
        ...                      {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}), 6)
        0.030466
        >>> paired_p_value({0: 1.0}, {0: 0.0})
        nan
    """
    seeds = [s for s in x if s in y]
    differences = [x[s] - y[s] for s in seeds]
    if len(differences) < 2 or len(set(differences)) == 1:
        return math.nan
    return float(
        scipy_stats.ttest_rel([x[s] for s in seeds], [y[s] for s in seeds]).pvalue
    )


def welch_difference(
    x: Sequence[float], y: Sequence[float]
) -> tuple[PairedDifference, float]:
    r"""``mean(x) - mean(y)`` of two independent samples, with Welch's
    95% interval and two-sided p-value (``scipy.stats.ttest_ind`` with
    ``equal_var=False``): with :math:`v = s_x^2/n_x + s_y^2/n_y` and the
    Welch-Satterthwaite degrees of freedom :math:`\nu`,

    .. math::
        \bar x - \bar y \pm t_{0.975,\,\nu} \sqrt{v}.

    The result's ``std`` is :math:`\sqrt v` (the difference's standard
    error) and ``n`` the two samples' sizes summed; NaN with fewer than two
    values in either.

    Examples:
        >>> d, p = welch_difference([1.0, 2.0, 3.0], [0.0, 0.5, 1.0, 1.5])
        >>> d.mean, round(d.low, 4), round(d.high, 4), round(p, 4)
        (1.25, -0.7712, 3.2712, 0.1485)
    """
    x, y = list(x), list(y)
    if len(x) < 2 or len(y) < 2:
        return PairedDifference(math.nan, math.nan, len(x) + len(y), *[math.nan] * 2), (
            math.nan
        )
    test = scipy_stats.ttest_ind(x, y, equal_var=False)
    low, high = test.confidence_interval(0.95)
    mean = sum(x) / len(x) - sum(y) / len(y)
    error = math.sqrt(scipy_stats.tvar(x) / len(x) + scipy_stats.tvar(y) / len(y))
    return (
        PairedDifference(mean, error, len(x) + len(y), float(low), float(high)),
        float(test.pvalue),
    )


def blocked_mean(blocks: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    r"""The mean of ``k`` blocks' means, with a two-sided 95% t-interval from
    the spread within blocks: for block means :math:`\bar d_j` of
    :math:`n_j` values (:math:`n = \sum n_j`),

    .. math::
        \hat\mu = \frac1k \sum_j \bar d_j, \qquad
        s^2 = \frac{\sum_j \sum_i (d_{ij} - \bar d_j)^2}{n - k}, \qquad
        \hat\mu \pm t_{0.975,\,n-k}\, \frac{s}{k} \sqrt{\sum_j 1/n_j},

    the intercept of least squares on effect-coded block indicators: a paired
    difference with each seed's block (where its data came from) taken out of
    the noise, on :math:`n - k` degrees of freedom. ``(mean, low, high)``;
    the ends are NaN unless :math:`n > k` and every block holds a value.

    Examples:
        >>> [round(v, 4) for v in blocked_mean([[1.0, 2.0], [4.0, 5.0]])]
        [3.0, 1.4788, 4.5212]
    """
    blocks = [list(b) for b in blocks]
    k, n = len(blocks), sum(len(b) for b in blocks)
    if not k or any(not b for b in blocks):
        return math.nan, math.nan, math.nan
    means = [math.fsum(b) / len(b) for b in blocks]
    mean = math.fsum(means) / k
    if n <= k:
        return mean, math.nan, math.nan
    within = math.fsum((v - m) ** 2 for b, m in zip(blocks, means) for v in b)
    scale = (
        math.sqrt(within / (n - k))
        / k
        * math.sqrt(math.fsum(1 / len(b) for b in blocks))
    )
    half = t_critical_95(n - k) * scale
    return mean, mean - half, mean + half


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    r"""Holm's (1979) step-down adjusted p-values of a family of ``m`` tests,
    in the order given: with the p-values sorted,
    :math:`p_{(1)} \le \dots \le p_{(m)}`,

    .. math::
        \tilde p_{(i)} = \min\Big(1,\ \max_{j \le i}\, (m - j + 1)\, p_{(j)}\Big).

    Rejecting where :math:`\tilde p \le \alpha` keeps the chance of any
    false rejection in the family at most :math:`\alpha`. A NaN (a test that
    could not be made) still counts in :math:`m`, since the family was named
    before the data, sorts last, and stays NaN. It equals statsmodels'
    ``multipletests(method="holm")`` (a test checks it), which is not called
    here: it runs a full garbage collection on every call, a fifth of a
    second in a process that holds JAX, and a report adjusts a dozen
    families.

    Raises:
        ValueError: a p-value outside [0, 1].

    Examples:
        >>> holm_adjusted([0.01, 0.04, 0.03, 0.005])
        [0.03, 0.06, 0.06, 0.02]
        >>> holm_adjusted([0.5, float("nan")])
        [1.0, nan]
    """
    values = [float(p) for p in p_values]
    bad = [p for p in values if not (math.isnan(p) or 0.0 <= p <= 1.0)]
    if bad:
        raise ValueError(f"p_values must lie in [0, 1] (or be NaN), got {bad}.")
    m = len(values)
    # numpy's sort puts a NaN last, where the running maximum over the sorted
    # values reaches no other test.
    order = np.argsort(values, kind="stable")
    sorted_p = np.asarray(values)[order]
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(
        1.0, np.maximum.accumulate(sorted_p * np.arange(m, 0, -1))
    )
    return [float(p) for p in adjusted]


@dataclasses.dataclass(frozen=True)
class PooledStd:
    r"""One standard deviation of paired differences pooled over cells.

    Attributes:
        std: :math:`s_p = \sqrt{\sum_i (n_i - 1) s_i^2 / \sum_i (n_i - 1)}`
            (NaN when no cell has 2 pairs).
        dof: its degrees of freedom, :math:`\sum_i (n_i - 1)`.
        equal_spread_p: the p-value of the Brown-Forsythe test (Levene's,
            centred on each cell's median) that every cell has the same
            variance, the assumption of :math:`s_p`, over the cells of 3 or
            more differences (in a cell of 2 both lie equally far from their
            median, so it has no spread to test); NaN with fewer than two
            such cells.
    """

    std: float
    dof: int
    equal_spread_p: float = math.nan

    def interval(self, mean: float, n: int) -> tuple[float, float]:
        r"""A cell's 95% interval with the pooled spread:
        :math:`\bar d \pm t_{0.975,\,\mathrm{dof}}\, s_p / \sqrt{n}`, for a
        cell of ``n`` pairs with mean difference ``mean`` (NaN without a
        pooled spread or pairs)."""
        if self.dof < 1 or n < 1:
            return math.nan, math.nan
        half_width = t_critical_95(self.dof) * self.std / math.sqrt(n)
        return mean - half_width, mean + half_width


def pooled_std(cells: Sequence[Sequence[float]]) -> PooledStd:
    r"""The pooled standard deviation of paired differences over cells: each
    cell :math:`i` has :math:`n_i` differences with sample variance
    :math:`s_i^2`, and

    .. math::
        s_p = \sqrt{\frac{\sum_i (n_i - 1)\, s_i^2}{\sum_i (n_i - 1)}}

    with :math:`\sum_i (n_i - 1)` degrees of freedom. It assumes every cell
    has the same variance; a cell of fewer than 2 differences adds nothing.

    Args:
        cells: one sequence of paired differences per cell.

    Examples:
        >>> pooled = pooled_std([[1.0, 2.0, 3.0], [0.0, 4.0]])
        >>> round(pooled.std**2, 6), pooled.dof  # (2 * 1 + 1 * 8) / 3
        (3.333333, 3)
        >>> [round(v, 4) for v in pooled.interval(2.0, 3)]
        [-1.3546, 5.3546]
        >>> pooled.equal_spread_p  # cells of 3 or more differences: one
        nan
        >>> round(pooled_std([[1.0, 2.0, 3.0], [0.0, 4.0, 5.0]]).equal_spread_p, 4)
        0.4676
    """
    dof, squares, tested = 0, 0.0, []
    for values in cells:
        values = list(values)
        mean, std, n = mean_std(values)
        if n >= 2:
            dof += n - 1
            squares += (n - 1) * std**2
            if n >= 3:
                tested.append(values)
    equal_spread_p = (
        float(scipy_stats.levene(*tested, center="median").pvalue)
        if len(tested) >= 2
        else math.nan
    )
    return PooledStd(math.sqrt(squares / dof) if dof else math.nan, dof, equal_spread_p)


def simultaneous_interval(
    difference: PairedDifference, family_size: int
) -> tuple[float, float]:
    r"""The Bonferroni interval of ``difference`` in a family of
    ``family_size`` = :math:`m` contrasts: all :math:`m` such intervals hold
    together with probability at least 95%,

    .. math::
        \bar d \pm t_{1 - 0.025/m,\,n-1}\, s_d / \sqrt{n}.

    It excludes zero only where the contrast's Holm-adjusted p-value is
    below 0.05 (Holm rejects at least what Bonferroni does). NaN for n < 2.

    Raises:
        ValueError: ``family_size < 1``.

    Examples:
        >>> d = paired_difference({0: 2.0, 1: 3.0, 2: 4.0, 3: 5.0},
        ...                       {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
        >>> [round(v, 4) for v in simultaneous_interval(d, 1)] == [
        ...     round(d.low, 4), round(d.high, 4)]
        True
        >>> [round(v, 4) for v in simultaneous_interval(d, 2)]
        [-0.1959, 5.1959]
    """
    _checks.check_count("family_size", family_size)
    if difference.n < 2:
        return math.nan, math.nan
    quantile = float(scipy_stats.t.ppf(1 - 0.025 / family_size, difference.n - 1))
    half_width = quantile * difference.std / math.sqrt(difference.n)
    return difference.mean - half_width, difference.mean + half_width


def one_sided_p_value(difference: PairedDifference, sign: int) -> float:
    r"""The paired t-test's p-value for a mean difference of sign ``sign``:
    :math:`P(T_{n-1} \ge \sigma \bar d \sqrt n / s_d)`; NaN for fewer than
    2 pairs or no spread.

    Examples:
        >>> d = paired_difference({0: 2.0, 1: 3.0, 2: 4.0, 3: 5.0},
        ...                       {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
        >>> round(one_sided_p_value(d, +1), 6), round(one_sided_p_value(d, -1), 6)
        (0.015233, 0.984767)
    """
    if sign not in (-1, 1):
        raise ValueError(f"sign must be -1 or 1, got {sign!r}.")
    if difference.n < 2 or not difference.std > 0:
        return math.nan
    t = sign * difference.mean * math.sqrt(difference.n) / difference.std
    return float(scipy_stats.t.sf(t, difference.n - 1))


def equivalence_p_value(difference: PairedDifference, margin: float) -> float:
    r"""The p-value of Schuirmann's (1987) two one-sided tests (TOST) that
    the mean paired difference lies inside ``(-margin, margin)``: with
    :math:`\bar d`, :math:`s_d` and :math:`n` of ``difference`` and
    :math:`\mathrm{se} = s_d / \sqrt{n}`,

    .. math::
        p = \max\Big(P\big(T_{n-1} \ge (\bar d + \delta) / \mathrm{se}\big),\
                     P\big(T_{n-1} \le (\bar d - \delta) / \mathrm{se}\big)\Big).

    Below :math:`\alpha`, the difference is shown to be smaller than the
    margin in size (equivalently, the :math:`1 - 2\alpha` interval lies
    inside it); a test that only fails to find a difference shows nothing of
    the kind. NaN for fewer than 2 pairs or a zero spread. On the pairs
    themselves this is statsmodels' ``ttost_paired(x, y, -margin, margin)``;
    it is written here on the summary, which is all a
    :class:`PairedDifference` holds (statsmodels has no public TOST from one).

    Raises:
        ValueError: ``margin`` is not a finite positive number.

    Examples:
        >>> d = paired_difference({0: 0.1, 1: -0.1, 2: 0.2, 3: 0.0},
        ...                       {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0})
        >>> round(equivalence_p_value(d, 0.5), 4), round(equivalence_p_value(d, 0.1), 4)
        (0.003, 0.2475)
    """
    if isinstance(margin, bool) or not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"margin must be a finite positive number, got {margin!r}.")
    if difference.n < 2 or not difference.std > 0:
        return math.nan
    error = difference.std / math.sqrt(difference.n)
    dof = difference.n - 1
    above = scipy_stats.t.sf((difference.mean + margin) / error, dof)
    below = scipy_stats.t.cdf((difference.mean - margin) / error, dof)
    return float(max(above, below))


def minimum_detectable_difference(
    std: float, n: int, alpha: float = 0.05, power: float = 0.8
) -> float:
    r"""The smallest true mean paired difference that a two-sided paired
    t-test at level ``alpha`` finds with probability ``power``, for ``n``
    pairs whose differences have standard deviation ``std``: the
    :math:`\delta` that solves

    .. math::
        P\big(|T'_{n-1}(\lambda)| > t_{1-\alpha/2,\,n-1}\big) = \text{power},
        \qquad \lambda = \delta \sqrt{n} / s_d,

    with :math:`T'` the noncentral t distribution (Cohen 1988, ch. 2), the
    power of statsmodels' ``TTestPower`` summed over the two tails. A
    Bonferroni correction over a family of m tests is ``alpha / m``. NaN
    for fewer than 2 pairs or a spread that is not a positive number.

    Raises:
        ValueError: ``alpha`` or ``power`` outside (0, 1).

    Examples:
        >>> round(minimum_detectable_difference(1.0, 8), 3)
        1.156
        >>> round(minimum_detectable_difference(1.0, 8, alpha=0.05 / 32), 4)
        2.1938
    """
    for name, value in (("alpha", alpha), ("power", power)):
        if isinstance(value, bool) or not 0 < value < 1:
            raise ValueError(f"{name} must lie in (0, 1), got {value!r}.")
    if n < 2 or not (math.isfinite(std) and std > 0):
        return math.nan
    tests = power_lib.TTestPower()

    def shortfall(effect: float) -> float:
        # Each tail at alpha / 2: statsmodels' two-sided power is NaN where
        # the far tail's mass, negligible there, comes back NaN, and so is its
        # solve_power's answer off.
        near = tests.power(effect, n, alpha / 2, alternative="larger")
        far = tests.power(effect, n, alpha / 2, alternative="smaller")
        return near + (far if math.isfinite(far) else 0.0) - power

    upper = 1.0
    while shortfall(upper) < 0:  # power grows with the effect: bracket it
        upper *= 2
    effect = scipy_optimize.brentq(shortfall, 0.0, upper, xtol=1e-12)
    return float(effect * std)
