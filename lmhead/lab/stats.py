"""Statistics over seeds: mean and spread, and paired differences with a
Student's t 95% interval, for comparing runs that differ in one setting.

:func:`mean_std` summarises one metric over seeds; :func:`paired_difference`
compares two settings seed by seed, which removes the variation the seed
causes in both (the data order and the initialisation).
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from scipy import stats as scipy_stats

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
