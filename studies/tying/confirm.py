r"""The confirmatory tests of the tying study (``configs/sweeps/tying_study.py:
confirm``): each hypothesis named before the runs (the sweep file's
``HYPOTHESES``) tested on the fresh test seeds of its cell, and the report
written from the rows of its ``runs.csv`` alone (:func:`report_from_csv`).

For a contrast :math:`x - y` of :math:`n` paired seeds with mean
:math:`\bar d` and spread :math:`s_d`, a directional hypothesis (sign
:math:`\sigma = \pm 1`) has the one-sided p-value
:math:`P(T_{n-1} \ge \sigma \bar d \sqrt n / s_d)`, an equivalence
hypothesis the two one-sided tests' at the margin
(``stats.equivalence_p_value``); the family's p-values are Holm-adjusted
together (``stats.holm_adjusted``), and so, for refutation, are their
two-sided paired t-tests. :func:`verdict` gives the decision rule;
``docs/tying_study/README.md`` ("Confirmatory hypotheses, fixed before the
runs") states it and the hypotheses.
"""

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from lmhead.lab import report, stats
from studies.tying import cells, literature, table
from studies.tying.report_text import p_text

CONFIRMED, REFUTED, NOT_TOLD = "confirmed", "refuted", "not told apart"
PROFILE_UNFINISHED = "profile unfinished"


class Hypothesis(NamedTuple):
    """A prediction of ``minuend - subtrahend`` in test bits/char in one cell
    (``vocab`` as ``runs.csv`` writes it, ``amount`` the fraction):
    ``predicted`` +1 (tied better, > 0), -1 (untied better, < 0) or 0 (no
    difference within the margin); ``source`` the figure it comes from."""

    vocab: str
    amount: float
    minuend: str
    subtrahend: str
    predicted: int
    source: str

    @property
    def label(self) -> str:
        return f"{self.minuend} − {self.subtrahend}"


@dataclasses.dataclass(frozen=True)
class Result:
    """One hypothesis tested: the ``contrast`` (its two-sided p Holm-adjusted
    over the family as ``holm_p``, its Bonferroni interval over the family
    as ``simultaneous``), the hypothesis's own p-value (one-sided or TOST)
    raw and Holm-adjusted, the runs planned and finished, and the verdict
    (or why there is none yet)."""

    hypothesis: Hypothesis
    contrast: cells.Contrast | None
    p: float
    holm_p: float
    planned: int
    finished: int
    verdict: str
    rates: tuple[float | None, float | None] = (None, None)


def verdict(
    hypothesis: Hypothesis,
    contrast: cells.Contrast,
    holm_p: float,
    margin: float,
    tost_p: float = math.nan,
) -> str:
    """The decision rule: a directional hypothesis is :data:`CONFIRMED`
    where its Holm-adjusted one-sided p (``holm_p``) is below ``ALPHA``,
    :data:`REFUTED` where the two-sided test (``contrast.holm_p``) is
    significant with the other sign; an equivalence hypothesis (predicted 0)
    is confirmed where its Holm-adjusted TOST p (``holm_p``; ``tost_p`` the
    raw one) is below ``ALPHA``, refuted where the two-sided test is
    significant and the whole interval (``contrast.simultaneous``) lies
    outside ``margin``; else :data:`NOT_TOLD`
    (``literature.verdict`` for the refutation and the equivalence).

    Examples:
        >>> h = Hypothesis("char", 1.0, "b", "a", +1, "")
        >>> d = stats.PairedDifference(-0.02, 0.01, 16, -0.03, -0.01)
        >>> c = cells.Contrast("char", 1.0, "b", "a", "b − a", d, 0.0, holm_p=0.001,
        ...                    simultaneous=(-0.03, -0.01))
        >>> verdict(h, c, 1.0, 0.0049), verdict(h._replace(predicted=-1), c, 0.001, 0.0049)
        ('refuted', 'confirmed')
        >>> verdict(h._replace(predicted=0), c, 1.0, 0.0049)
        'refuted'
    """
    if hypothesis.predicted != 0:
        if holm_p < cells.ALPHA:
            return CONFIRMED
        found = literature.verdict(contrast, hypothesis.predicted)
        return REFUTED if found == "disagrees" else NOT_TOLD
    equivalence = literature.Equivalence(margin, tost_p, holm_p)
    found = literature.verdict(contrast, 0, equivalence)
    return {"agrees": CONFIRMED, "disagrees": REFUTED}.get(found, NOT_TOLD)


def _cell_rows(rows, h: Hypothesis, role: str) -> list[Mapping[str, Any]]:
    return [
        r
        for r in rows
        if r["role"] == role
        and r["vocab"] == h.vocab
        and r["amount"] == h.amount
        and r["arm"] in (h.minuend, h.subtrahend)
        and (r["table_lr_multiplier"] or 1.0) == 1.0
    ]


def _rate(rows, arm: str) -> float | None:
    rates = {r["lr"] for r in rows if r["arm"] == arm}
    return rates.pop() if len(rates) == 1 else None


def check_hypotheses(
    rows: Sequence[Mapping[str, Any]],
    hypotheses: Sequence[Hypothesis],
    margin: float,
) -> list[Result]:
    """Each of ``hypotheses`` tested on the finished test runs of ``rows``
    (``runs.csv``'s), Holm over all of them. A hypothesis is tested once
    every planned test run of both arms has finished; before, its numbers so
    far are given without a verdict or adjusted p-values (it counts in Holm
    as untested), and a cell without test rows is :data:`PROFILE_UNFINISHED`
    (its rates are not chosen yet)."""
    groups = cells.group_runs(rows, "test")
    size = len(hypotheses)
    found = []
    for h in hypotheses:
        key = (h.vocab, h.amount)
        if (*key, h.minuend) in groups and (*key, h.subtrahend) in groups:
            plain = cells.contrast(
                key,
                groups[(*key, h.minuend)],
                groups[(*key, h.subtrahend)],
                (h.minuend, h.subtrahend),
            )
            plain = dataclasses.replace(
                plain,
                simultaneous=stats.simultaneous_interval(plain.difference, size),
            )
        else:
            plain = None
        found.append(plain)
    raw = [
        math.nan
        if c is None
        else stats.one_sided_p_value(c.difference, h.predicted)
        if h.predicted
        else stats.equivalence_p_value(c.difference, margin)
        for h, c in zip(hypotheses, found)
    ]
    tested = [_cell_rows(rows, h, "test") for h in hypotheses]
    done = [[r for r in t if r["status"] == cells.FINISHED] for t in tested]
    # Holm takes a hypothesis whose runs have not all finished as untested
    # (NaN: counted in the family, never rejected), not at its interim value.
    complete = [bool(t) and len(d) == len(t) for t, d in zip(tested, done)]
    own_holm = stats.holm_adjusted(
        [p if ok else math.nan for p, ok in zip(raw, complete)]
    )
    two_sided = stats.holm_adjusted(
        [c.p if ok and c is not None else math.nan for c, ok in zip(found, complete)]
    )
    results = []
    for i, (h, c, p) in enumerate(zip(hypotheses, found, raw)):
        if c is not None:
            c = dataclasses.replace(c, holm_p=two_sided[i])
        if not tested[i]:
            outcome = PROFILE_UNFINISHED
        elif not complete[i]:
            outcome = f"runs unfinished ({len(done[i])} of {len(tested[i])})"
        else:
            outcome = verdict(h, c, own_holm[i], margin, p)
        rates = (_rate(tested[i], h.minuend), _rate(tested[i], h.subtrahend))
        results.append(
            Result(h, c, p, own_holm[i], len(tested[i]), len(done[i]), outcome, rates)
        )
    return results


# --- The report -------------------------------------------------------------

_PREDICTION = {+1: "> 0, tied better", -1: "< 0, untied better"}


def results_table(results: Sequence[Result], margin: float) -> str:
    header = [
        "cell",
        "contrast",
        "prediction",
        "from",
        "rates (x; y)",
        "seeds",
        "Δ test bits/char",
        f"Bonferroni 95% interval (over {len(results)})",
        "p (one-sided or TOST) → Holm",
        "two-sided p → Holm",
        "verdict",
    ]
    rows = []
    for r in results:
        h, c = r.hypothesis, r.contrast
        prediction = _PREDICTION.get(h.predicted, f"no difference (±{margin:g})")
        if c is None:
            numbers = [report.DASH] * 5
        else:
            low, high = c.simultaneous
            numbers = [
                str(c.difference.n),
                f"{c.difference.mean:+.4f}",
                report.DASH if math.isnan(low) else f"[{low:+.4f}, {high:+.4f}]",
                f"{p_text(r.p)} → {p_text(r.holm_p)}",
            ]
            numbers.append(f"{p_text(c.p)} → {p_text(c.holm_p)}")
        rates = "; ".join(report.DASH if x is None else f"{x:g}" for x in r.rates)
        rows.append(
            [
                cells.cell_label((h.vocab, h.amount)),
                h.label,
                prediction,
                h.source,
                rates,
                *numbers,
                f"**{r.verdict}**",
            ]
        )
    return report.markdown_table(header, rows)


def write_report(
    rows: Sequence[Mapping[str, Any]],
    out_dir: str,
    hypotheses: Sequence[Hypothesis],
    margin: float,
):
    """``out_dir/REPORT.md`` from ``rows``: the hypotheses' table with the
    verdicts, and the count of each verdict. Returns ``(its text, [])``."""
    os.makedirs(out_dir, exist_ok=True)
    results = check_hypotheses(rows, hypotheses, margin)
    seeds = sorted({r["seed"] for r in rows if r["role"] == "test"})
    counts = {
        v: sum(r.verdict == v for r in results) for v in (CONFIRMED, REFUTED, NOT_TOLD)
    }
    pending = len(results) - sum(counts.values())
    intro = (
        "# Confirmatory tests\n\n"
        "The hypotheses were named before these runs "
        '(`docs/tying_study/README.md`, "Confirmatory hypotheses, fixed before '
        'the runs"; `HYPOTHESES` in `configs/sweeps/tying_study.py`); this is '
        "written from `runs.csv` alone. Test bits per character on the whole test "
        "split, x − y > 0: the tied arm a better. Each arm at the rate its "
        "learning-rate profile chose (the lowest mean validation loss over the "
        "tuning seeds), on the test seeds "
        f"{', '.join(map(str, seeds)) or report.DASH}. "
        f"Family: the {len(results)} hypotheses, Holm over them; the equivalence "
        f"margin ±{margin:g} bits/char. A directional hypothesis is confirmed by "
        "its Holm-adjusted one-sided paired t-test, refuted by a significant "
        "two-sided one (Holm) of the other sign; an equivalence hypothesis is "
        "confirmed by the two one-sided tests at the margin (Holm), refuted by a "
        "significant two-sided test whose Bonferroni interval lies wholly "
        "outside the margin; anything else is not told apart. A cell whose "
        "profile has not finished has no test runs yet."
    )
    summary = (
        f"{counts[CONFIRMED]} confirmed, {counts[REFUTED]} refuted, "
        f"{counts[NOT_TOLD]} not told apart"
        + (f", {pending} without a verdict yet" if pending else "")
        + f", of {len(results)}."
    )
    text, _ = report.write_markdown(
        out_dir, [intro, summary, results_table(results, margin)]
    )
    return text, []


def report_from_csv(
    path: str, out_dir: str, hypotheses: Sequence[Hypothesis], margin: float
):
    """:func:`write_report` of the rows of the ``runs.csv`` at ``path``."""
    return write_report(table.read_rows(path), out_dir, hypotheses, margin)
