"""The tying study's report as text: its fixed paragraphs and table columns
(:func:`prose`, read from ``prose.toml`` beside this module), and the
numbers as text: p-values, intervals, means and spreads, counts and seed
lists, each with a dash for what is not measured."""

import importlib.resources
import math
import tomllib
from collections.abc import Sequence

from lmhead.lab import report, stats

DASH = report.DASH
PROSE = tomllib.loads(
    importlib.resources.files(__package__).joinpath("prose.toml").read_text("utf-8")
)


def prose(key: str, **fields) -> str:
    """The paragraph ``key`` of ``prose.toml`` with its ``{fields}`` filled.

    Examples:
        >>> prose("results_capped", runs="BPE 512 at 3% a 2")[-20:]
        ': BPE 512 at 3% a 2.'
    """
    return PROSE[key].format(**fields)


def column_names(key: str, **fields) -> list[str]:
    """The table columns ``key`` of ``prose.toml``, their ``{fields}`` filled.

    Examples:
        >>> column_names("power_columns", alpha=0.05)[-2]
        'detectable at α = 0.05'
    """
    return [name.format(**fields) for name in PROSE[key]]


def p_text(p: float) -> str:
    """A p-value with 4 decimals, ``<0.0001`` below that, a dash for NaN.

    Examples:
        >>> p_text(0.01234), p_text(3e-6), p_text(float("nan"))
        ('0.0123', '<0.0001', '—')
    """
    if math.isnan(p):
        return DASH
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


def equal_spread_text(p: float) -> str:
    """The test of one spread in every cell, or nothing without one.

    Examples:
        >>> equal_spread_text(3e-6), equal_spread_text(float("nan"))
        ('; one spread in every cell: Brown-Forsythe p < 0.0001', '')
    """
    if math.isnan(p):
        return ""
    p = "< 0.0001" if p < 1e-4 else f"= {p:.4f}"
    return f"; one spread in every cell: Brown-Forsythe p {p}"


def pair_text(low: float, high: float) -> str:
    """``"[low, high]"`` with signs, a dash for NaN.

    Examples:
        >>> pair_text(-0.01, 0.02), pair_text(float("nan"), 1.0)
        ('[-0.0100, +0.0200]', '—')
    """
    if math.isnan(low) or math.isnan(high):
        return DASH
    return f"[{low:+.4f}, {high:+.4f}]"


def mean_text(values: Sequence[float], decimals: int = 4) -> str:
    mean, _, n = stats.mean_std(list(values))
    return DASH if n == 0 else f"{mean:,.{decimals}f}"


def significant_text(values: Sequence[float]) -> str:
    """The mean to 3 significant digits.

    Examples:
        >>> significant_text([0.0123, 0.0125]), significant_text([4.48, 4.5])
        ('0.0124', '4.49')
    """
    mean, _, n = stats.mean_std(list(values))
    return DASH if n == 0 else f"{mean:.3g}"


def geometric_mean_text(values: Sequence[float], decimals: int = 2) -> str:
    """Examples:
    >>> geometric_mean_text([100.0, 400.0]), geometric_mean_text([])
    ('200.00', '—')
    """
    values = list(values)
    if not values:
        return DASH
    mean = math.exp(sum(math.log(v) for v in values) / len(values))
    return f"{mean:,.{decimals}f}"


def spread_text(values: Sequence[float], decimals: int = 4) -> str:
    """``mean ± std (n)``."""
    values = list(values)
    if not values:
        return DASH
    return f"{report.mean_std_text(values, decimals)} ({len(values)})"


def places_text(
    places: dict[float, tuple[float, int]], blocked: tuple[float, float, float]
) -> str:
    """``"0: +0.0120 (4); 0.5: +0.0080 (4); blocked +0.0100 [..]"``, or a
    dash for one place."""
    if len(places) < 2:
        return DASH
    means = "; ".join(f"{o:g}: {m:+.4f} ({n})" for o, (m, n) in places.items())
    return f"{means}; blocked {blocked[0]:+.4f} {pair_text(*blocked[1:])}"


def range_text(values: Sequence[float]) -> str:
    """``"from min to max"`` of the finite values (a cell's spread), or a dash."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return DASH
    return f"from {min(finite):.4f} to {max(finite):.4f}"


def int_text(value: int | None) -> str:
    return DASH if value is None else f"{value:,}"


def seeds_text(seeds: Sequence[int]) -> str:
    if not seeds:
        return DASH
    if seeds == list(range(seeds[0], seeds[0] + len(seeds))) and len(seeds) > 2:
        return f"{seeds[0]}..{seeds[-1]}"
    return ", ".join(map(str, seeds))
