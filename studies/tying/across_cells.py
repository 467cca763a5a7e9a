r"""The primary contrasts read across cells instead of cell by cell: one mixed
model of the per-seed differences over vocabulary and amount, with its
interaction tests (:func:`fit_cells_model`, :func:`model_section`), and the
smallest difference each cell's test could find at the seeds run
(:func:`power_section`).

The model, for one contrast x − y (``cells.PRIMARY``), of the difference
:math:`d_{vas}` of vocabulary v, amount a and seed s:

.. math::
    d_{vas} = \beta_0 + \beta_v + (\gamma_0 + \gamma_v)\log a + u_s
              + \varepsilon_{vas},
    \quad u_s \sim N(0, \sigma_u^2),\ \varepsilon \sim N(0, \sigma^2),

a fixed effect and a slope in the log amount per vocabulary and a random
intercept per seed, fitted by REML (``statsmodels.MixedLM``), with Wald
χ² tests of the interaction (:math:`\gamma_v = 0`), the vocabulary
(:math:`\beta_v = \gamma_v = 0`) and the amount
(:math:`\gamma_0 = \gamma_v = 0`).
"""

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import statsmodels.api as sm
from scipy import stats as scipy_stats
from statsmodels.tools import sm_exceptions

from lmhead.lab import report
from lmhead.lab import stats as stats_lib
from studies.tying import cells as cells_lib
from studies.tying.cells import PRIMARY
from studies.tying.report_text import column_names, p_text, prose, range_text

Rows = Sequence[Mapping[str, Any]]
# The power and level of the table of smallest detectable differences.
POWER = 0.8
ALPHA = cells_lib.ALPHA
TESTS = ("vocabulary × amount", "vocabulary", "amount")


@dataclasses.dataclass(frozen=True)
class CellsModel:
    r"""One contrast's mixed model across cells.

    Attributes:
        label: the contrast (``"b − a"``).
        n, cells, seeds: differences, cells and seeds it was fitted on.
        seed_var, residual_var: :math:`\sigma_u^2` and :math:`\sigma^2`.
        tests: ``{name: (χ², degrees of freedom, p)}`` for :data:`TESTS`.
    """

    label: str
    n: int
    cells: int
    seeds: int
    seed_var: float
    residual_var: float
    tests: dict[str, tuple[float, int, float]]


def differences(rows: Rows) -> dict[str, list[tuple[str, float, int, float]]]:
    """``{label: [(vocab, amount, seed, x − y)]}`` of every primary contrast
    with paired test runs, in cell and seed order.

    Examples:
        >>> run = lambda arm, bpc: {"role": "test", "status": "finished",
        ...     "vocab": "char", "amount": 1.0, "arm": arm, "seed": 0,
        ...     "table_lr_multiplier": 1.0, "test_bpc": bpc}
        >>> differences([run("a", 2.0), run("b", 2.5)])
        {'b − a': [('char', 1.0, 0, 0.5)]}
    """
    groups = cells_lib.group_runs(rows, "test")
    found = {}
    for c in cells_lib.paired_contrasts(groups, PRIMARY):
        x = cells_lib.by_seed(groups[(c.vocab, c.amount, c.minuend)])
        y = cells_lib.by_seed(groups[(c.vocab, c.amount, c.subtrahend)])
        found.setdefault(c.label, []).extend(
            (c.vocab, c.amount, s, x[s] - y[s]) for s in sorted(x.keys() & y.keys())
        )
    return found


def design_matrix(
    points: Sequence[tuple[str, float, int, float]],
) -> tuple[np.ndarray, dict[str, list[int]]]:
    """The fixed effects' ``[n, 2V]`` matrix of ``points`` (intercept, V − 1
    vocabulary indicators, log amount, V − 1 indicators x log amount; the
    first vocabulary in ``cells.vocab_order`` is the reference) and the
    columns each of :data:`TESTS` sets to zero.

    Examples:
        >>> exog, columns = design_matrix(
        ...     [("char", 1.0, 0, 0.1), ("512", 0.01, 0, 0.2)])
        >>> exog.shape, columns["vocabulary × amount"]
        ((2, 4), [3])
    """
    vocabs = sorted({p[0] for p in points}, key=cells_lib.vocab_order)
    log_amount = np.log([p[1] for p in points])
    indicators = np.array([[p[0] == v for v in vocabs[1:]] for p in points], float)
    indicators = indicators.reshape(len(points), len(vocabs) - 1)
    exog = np.column_stack(
        [np.ones(len(points)), indicators, log_amount, indicators * log_amount[:, None]]
    )
    k = len(vocabs) - 1
    vocab, slope, interaction = range(1, k + 1), [k + 1], range(k + 2, 2 * k + 2)
    columns = {
        TESTS[0]: list(interaction),
        TESTS[1]: [*vocab, *interaction],
        TESTS[2]: [*slope, *interaction],
    }
    return exog, columns


def fit_cells_model(
    label: str, points: Sequence[tuple[str, float, int, float]]
) -> CellsModel | None:
    """The mixed model of ``points`` (``(vocab, amount, seed, difference)``),
    or None where it cannot be fitted: fewer than two vocabularies, amounts
    or seeds, or fixed effects the cells do not identify (a vocabulary at
    one amount only).

    Examples:
        >>> import numpy as np
        >>> rng = np.random.default_rng(0)
        >>> points = [(v, a, s, 0.01 * (v == "512") * np.log(a)
        ...            + 0.001 * rng.normal())
        ...           for v in ("char", "512") for a in (0.01, 1.0)
        ...           for s in range(4)]
        >>> model = fit_cells_model("b − a", points)
        >>> model.tests["vocabulary × amount"][2] < 1e-4
        True
        >>> fit_cells_model("b − a", points[:4]) is None  # one vocabulary
        True
    """
    vocabs = {p[0] for p in points}
    amounts, seeds = {p[1] for p in points}, {p[2] for p in points}
    if min(len(vocabs), len(amounts), len(seeds)) < 2:
        return None
    exog, columns = design_matrix(points)
    if np.linalg.matrix_rank(exog) < exog.shape[1]:
        return None
    endog = np.array([p[3] for p in points])
    groups = np.array([p[2] for p in points])
    with warnings.catch_warnings():
        # The seed's variance may be estimated at 0, its boundary: the fit
        # is then that of the fixed effects alone, which is what it reports.
        warnings.simplefilter("ignore", sm_exceptions.ConvergenceWarning)
        fit = sm.MixedLM(endog, exog, groups).fit(reml=True)
    beta = np.asarray(fit.fe_params)
    covariance = np.asarray(fit.cov_params())[: len(beta), : len(beta)]
    tests = {}
    for name, index in columns.items():
        b = beta[index]
        chi2 = float(b @ np.linalg.solve(covariance[np.ix_(index, index)], b))
        tests[name] = (chi2, len(index), float(scipy_stats.chi2.sf(chi2, len(index))))
    return CellsModel(
        label,
        len(points),
        len({(p[0], p[1]) for p in points}),
        len(seeds),
        float(np.asarray(fit.cov_re).item()),
        float(fit.scale),
        tests,
    )


def model_section(rows: Rows) -> str:
    """The mixed model of each primary contrast and its Wald tests."""
    head = "## One model across cells"
    models = [fit_cells_model(k, v) for k, v in differences(rows).items()]
    models = [m for m in models if m is not None]
    if not models:
        return f"{head}\n\n{prose('model_unfitted')}"
    lines = [
        [
            m.label,
            str(m.n),
            str(m.cells),
            str(m.seeds),
            f"{math.sqrt(m.seed_var):.4f}",
            f"{math.sqrt(m.residual_var):.4f}",
            *(
                f"{m.tests[t][0]:.1f} ({m.tests[t][1]}), {p_text(m.tests[t][2])}"
                for t in TESTS
            ),
        ]
        for m in models
    ]
    return "\n\n".join(
        [
            head,
            prose("model"),
            report.markdown_table(
                column_names("model_columns") + [f"{t}: χ² (df), p" for t in TESTS],
                lines,
            ),
        ]
    )


def power_section(rows: Rows) -> str:
    """The smallest detectable difference of each primary contrast at the
    seeds run (``stats.minimum_detectable_difference``)."""
    family = cells_lib.primary_family(rows)
    contrasts = [c for c in family.contrasts if c.difference.n >= 2]
    if not contrasts:
        return ""
    alpha = ALPHA / family.size
    lines, corrected = [], []
    for c in contrasts:
        d = c.difference
        plain = stats_lib.minimum_detectable_difference(d.std, d.n, ALPHA, POWER)
        bonferroni = stats_lib.minimum_detectable_difference(d.std, d.n, alpha, POWER)
        corrected.append(bonferroni)
        lines.append(
            [
                cells_lib.vocab_label(c.vocab),
                cells_lib.amount_label(c.amount),
                c.label,
                str(d.n),
                f"{d.std:.4f}",
                f"{plain:.4f}",
                f"{bonferroni:.4f}",
            ]
        )
    finite = sorted(x for x in corrected if math.isfinite(x))
    median = float(np.median(finite)) if finite else math.nan
    return "\n\n".join(
        [
            "## Power",
            prose(
                "power",
                power=POWER,
                alpha=ALPHA,
                size=family.size,
                median=median,
                range=range_text(finite),
            ),
            report.markdown_table(column_names("power_columns", alpha=ALPHA), lines),
        ]
    )
