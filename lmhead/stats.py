"""Statistics over seeds: mean and spread, and paired differences with a
Student's t 95% interval, for comparing runs that differ in one setting.

:func:`mean_std` summarises one metric over seeds; :func:`paired_difference`
compares two settings seed by seed, which removes the variation the seed
causes in both (the data order and the initialisation).
"""

import dataclasses
import math
from typing import Any, Sequence

# Student's t quantile t(0.975; dof) for dof = 1..30 (two-sided 95%), to six
# decimals; larger dof use the expansion in `t_critical_95`, whose error there
# is below 1e-7.
T_CRITICAL_95 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912,
                 2.364624, 2.306004, 2.262157, 2.228139, 2.200985, 2.178813,
                 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922,
                 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
                 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)
Z_975 = 1.959963985  # the standard normal's 0.975 quantile


def t_critical_95(dof: int) -> float:
    r"""Student's t critical value for a two-sided 95% interval.

    A table (:data:`T_CRITICAL_95`) for ``dof <= 30``; beyond, the
    Cornish-Fisher expansion of the t quantile around the normal one
    (Abramowitz & Stegun 26.7.5), with :math:`z = 1.95996` and
    :math:`\nu` = ``dof``:

    .. math::
        t \approx z + \frac{z^3 + z}{4\nu} + \frac{5z^5 + 16z^3 + 3z}{96\nu^2}
          + \frac{3z^7 + 19z^5 + 17z^3 - 15z}{384\nu^3}
          + \frac{79z^9 + 776z^7 + 1482z^5 - 1920z^3 - 945z}{92160\nu^4}

    References:
        Abramowitz & Stegun, Handbook of Mathematical Functions, 26.7.5.

    Examples:
        >>> t_critical_95(2), round(t_critical_95(60), 6)
        (4.302653, 2.000298)
    """
    if not isinstance(dof, int) or dof < 1:
        raise ValueError(f"dof must be an integer >= 1; got {dof!r}.")
    if dof <= len(T_CRITICAL_95):
        return T_CRITICAL_95[dof - 1]
    z = Z_975
    terms = ((z**3 + z) / 4,
             (5 * z**5 + 16 * z**3 + 3 * z) / 96,
             (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
             (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return z + sum(term / dof**power for power, term in enumerate(terms, start=1))


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
