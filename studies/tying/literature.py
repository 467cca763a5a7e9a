"""The tying study against published results: the published numbers, read
from ``literature.toml`` beside this module (:data:`PTB_PAIRS`,
:data:`CLAIMS`, each with its source, setting and metric, as
``docs/tying_study/literature_sources.md`` records them), and
:func:`literature_text`, the report's section "Against published results"
from ``runs.csv``'s rows alone: per claim, paired differences of two arms
per cell (:func:`compare`) and a verdict per cell (:func:`verdict`).
"""

import dataclasses
import importlib.resources
import math
import statistics
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from lmhead.lab import report, stats
from studies.tying import cells as cells_lib
from studies.tying.cells import ALPHA
from studies.tying.report_text import prose

DATA_FILE = "literature.toml"
DASH = report.DASH
ARMS = prose("literature_arms")
COLUMN_NAMES = {"test_bpc": "test bits/char", "train_bpc": "training bits/char"}
PER_WORD = prose("per_word")


@dataclasses.dataclass(frozen=True)
class PerplexityPair:
    """One published pair of per-word perplexities on PTB, untied and tied:
    test (``untied``, ``tied``) and training (None: not reported), with
    ``train_note`` naming the model where training numbers are quoted."""

    source: str
    model: str
    where: str
    untied: float
    tied: float
    train_untied: float | None = None
    train_tied: float | None = None
    train_note: str | None = None

    @property
    def change(self) -> float:
        """Test perplexity's change untied -> tied, ``tied / untied - 1``.

        Examples:
            >>> round(PerplexityPair("s", "m", "w", 100.0, 95.0).change, 6)
            -0.05
        """
        return self.tied / self.untied - 1


class Contrast(NamedTuple):
    """``x - y`` of ``column``, paired by seed within a cell; ``predicted``
    is the claim's sign of it: +1, -1, or 0 for about zero."""

    x: str
    y: str
    column: str
    predicted: int


class Claim(NamedTuple):
    """A published claim (``title``, ``published`` numbers, ``source`` read,
    ``setting``), the ``contrasts`` testing it here, and ``not_comparable``:
    why its direction cannot carry over here (then it is "cannot tell")."""

    title: str
    published: str
    source: str
    setting: str
    contrasts: tuple[Contrast, ...]
    not_comparable: str | None = None


def _ptb_text(pairs: Sequence[PerplexityPair], ptb: str) -> tuple[str, str]:
    """A PTB claim's published numbers and source, from its ``pairs``: the
    test perplexities (``ptb="test"``) or the training ones (``"train"``)."""
    if ptb == "test":
        published = "per-word test perplexity on PTB, untied -> tied: " + "; ".join(
            f"{p.source} {p.model}: {p.untied} -> {p.tied} ({p.change:+.1%})"
            for p in pairs
        )
    elif ptb == "train":
        pairs = [p for p in pairs if p.train_untied is not None]
        published = "training perplexity untied -> tied: " + "; ".join(
            f"{p.train_untied} -> {p.train_tied} ({p.train_note})" for p in pairs
        )
    else:
        raise ValueError(f"{DATA_FILE}: ptb must be 'test' or 'train', got {ptb!r}.")
    return published, "; ".join(dict.fromkeys(p.where for p in pairs))


def load(text: str) -> tuple[tuple[PerplexityPair, ...], tuple[Claim, ...]]:
    """The PTB pairs and the claims of a ``literature.toml`` text.

    Examples:
        >>> pairs, claims = load('''
        ... [[ptb_pairs]]
        ... source = "S"
        ... model = "m"
        ... where = "Table 1"
        ... untied = 100.0
        ... tied = 95.0
        ... [[claims]]
        ... title = "T"
        ... ptb = "test"
        ... setting = "PTB; {per_word}"
        ... contrasts = [["b", "a", "test_bpc", 1]]
        ... ''')
        >>> claims[0].published, claims[0].source, claims[0].contrasts
        ('per-word test perplexity on PTB, untied -> tied: S m: 100.0 -> 95.0 (-5.0%)', 'Table 1', (Contrast(x='b', y='a', column='test_bpc', predicted=1),))
    """
    data = tomllib.loads(text)
    pairs = tuple(PerplexityPair(**pair) for pair in data["ptb_pairs"])
    claims = []
    for claim in data["claims"]:
        claim = dict(claim)
        if "ptb" in claim:
            claim["published"], claim["source"] = _ptb_text(pairs, claim.pop("ptb"))
        claim["setting"] = claim["setting"].format(per_word=PER_WORD)
        claim["contrasts"] = tuple(Contrast(*c) for c in claim["contrasts"])
        claims.append(Claim(**claim))
    return pairs, tuple(claims)


PTB_PAIRS, CLAIMS = load(
    importlib.resources.files(__package__).joinpath(DATA_FILE).read_text("utf-8")
)

# "About zero" is shown only by an equivalence test against a margin: the
# smallest change that the tying studies above publish as tying's effect,
# |ln(tied / untied)| of per-word perplexity, on each cell's bits/char scale
# (:func:`equivalence_margin`).
EQUIVALENCE_PAIR = min(PTB_PAIRS, key=lambda p: abs(math.log(p.tied / p.untied)))
EQUIVALENCE_LOG_PPL = abs(math.log(EQUIVALENCE_PAIR.tied / EQUIVALENCE_PAIR.untied))


def compare(
    rows: Sequence[Mapping[str, Any]], x: str, y: str, column: str
) -> list[cells_lib.Contrast]:
    """``x - y`` of ``column`` per cell with both arms, over the finished test
    runs paired by seed (:func:`~studies.tying.cells.paired_contrasts`), with the paired
    t-test's p-value Holm-adjusted: over the study's primary family
    (:func:`~studies.tying.cells.primary_family`) for a primary
    contrast of test bits/char, the same p as the report's primary section;
    otherwise over these cells alone (exploratory); in cell order.

    Examples:
        >>> rows = [dict(role="test", status="finished", run=f"{arm}{s}",
        ...              vocab="char", amount=1.0, arm=arm, seed=s,
        ...              table_lr_multiplier=None,
        ...              test_bpc=2.0 + s + (0.1 + 0.01 * s) * (arm == "b"))
        ...         for arm in "ab" for s in range(3)]
        >>> (cell,) = compare(rows, "b", "a", "test_bpc")
        >>> round(cell.difference.mean, 6), cell.difference.n
        (0.11, 3)
        >>> # The family: b - a and c - a of the one cell, c - a untested.
        >>> cell.holm_p == min(1.0, 2 * cell.p)
        True
    """
    if is_primary(x, y, column):
        return _primary_cells(cells_lib.primary_family(rows), x, y)
    groups = cells_lib.group_runs(rows, "test")
    found = [
        c
        for c in cells_lib.paired_contrasts(groups, [(x, y)], metric=column)
        if c.difference.n
    ]
    adjusted = stats.holm_adjusted([c.p for c in found])
    return [dataclasses.replace(c, holm_p=p) for c, p in zip(found, adjusted)]


def _primary_cells(family: cells_lib.Family, x: str, y: str) -> list:
    """The cells of the primary contrast ``x - y`` that have pairs."""
    return [
        c
        for c in family.contrasts
        if (c.minuend, c.subtrahend) == (x, y) and c.difference.n
    ]


def is_primary(x: str, y: str, column: str) -> bool:
    """Whether ``x - y`` of ``column`` is one of the study's primary
    contrasts (named before the runs), rather than exploratory."""
    return (x, y) in cells_lib.PRIMARY and column == "test_bpc"


def word_ppl_change(
    rows: Sequence[Mapping[str, Any]], vocab: str, amount: float
) -> tuple[float, float, float]:
    r"""``(change, low, high)``: per-word test perplexity's relative change
    from the untied arm b to the tied arm a in one cell, paired by seed, and
    its 95% interval, :math:`e^{\bar d} - 1` for :math:`d_s = \ln P_{a,s} -
    \ln P_{b,s}` (the ends likewise; NaN for fewer than 2 pairs).

    Examples:
        >>> rows = [dict(role="test", status="finished", run=f"{arm}{s}",
        ...              vocab="char", amount=1.0, arm=arm, seed=s,
        ...              table_lr_multiplier=None,
        ...              test_word_ppl=(100.0 if arm == "b" else 95.0) * (1 + s))
        ...         for arm in "ab" for s in range(3)]
        >>> [round(v, 6) for v in word_ppl_change(rows, "char", 1.0)]
        [-0.05, -0.05, -0.05]
    """
    groups = cells_lib.group_runs(rows, "test")
    logs = [
        {
            s: math.log(v)
            for s, v in cells_lib.by_seed(
                groups.get((vocab, amount, arm), {}), "test_word_ppl"
            ).items()
        }
        for arm in "ab"
    ]
    d = stats.paired_difference(*logs)
    return math.expm1(d.mean), math.expm1(d.low), math.expm1(d.high)


def equivalence_margin(
    rows: Sequence[Mapping[str, Any]], vocab: str, amount: float
) -> float:
    r"""The equivalence margin of one cell in bits/char: the log ratio
    :data:`EQUIVALENCE_LOG_PPL` of per-word perplexities,
    :math:`\delta_w = |\ln(P_t / P_u)|`, on this cell's scale,
    :math:`\delta = \delta_w / (\ln 2 \cdot C / W)`, where :math:`C / W` is
    the test text's characters per word (``test_chars / test_words``, the
    median over the cell's finished test runs); NaN without such runs. Why
    this margin: ``docs/tying_study/README.md``, "Against published results".

    Examples:
        >>> rows = [dict(role="test", status="finished", vocab="char", amount=1.0,
        ...              arm=arm, seed=0, run=arm, table_lr_multiplier=None,
        ...              test_chars=5500, test_words=1000) for arm in "ab"]
        >>> round(equivalence_margin(rows, "char", 1.0), 6)  # 0.018511 / (ln 2 * 5.5)
        0.004856
    """
    return _margin(cells_lib.group_runs(rows, "test"), vocab, amount)


def _margin(groups: Mapping[tuple, Mapping[int, Any]], vocab: str, amount: float):
    """:func:`equivalence_margin` from the finished test runs grouped by
    :func:`~studies.tying.cells.group_runs`."""
    per_word = [
        r["test_chars"] / r["test_words"]
        for (v, a, _), runs in groups.items()
        if (v, a) == (vocab, amount)
        for r in runs.values()
        if r.get("test_chars") and r.get("test_words")
    ]
    if not per_word:
        return math.nan
    return EQUIVALENCE_LOG_PPL / (math.log(2) * statistics.median(per_word))


class Equivalence(NamedTuple):
    """One cell's equivalence test: its ``margin`` in bits/char, the two
    one-sided tests' ``p`` and that p Holm-adjusted over the cells tested
    together (``holm_p``); NaN where no test could be made."""

    margin: float
    p: float
    holm_p: float


def equivalence_tests(
    rows: Sequence[Mapping[str, Any]], cells: Sequence[cells_lib.Contrast]
) -> list[Equivalence]:
    """Per cell, :func:`equivalence_margin` and the two one-sided tests
    (:func:`~lmhead.lab.stats.equivalence_p_value`) that the cell's
    difference lies inside it, Holm-adjusted over ``cells``.

    Examples:
        >>> def cell(vocab, differences):
        ...     d = stats.paired_difference(dict(enumerate(differences)),
        ...                                 dict.fromkeys(range(4), 0.0))
        ...     return cells_lib.Contrast(vocab, 1.0, "b", "a", "b − a", d, 1.0)
        >>> rows = [dict(role="test", status="finished", vocab=v, amount=1.0,
        ...              arm="a", seed=0, run=v, table_lr_multiplier=None,
        ...              test_chars=5500, test_words=1000) for v in ("char", "512")]
        >>> small = cell("char", [1e-4, -1e-4, 2e-4, 0.0])
        >>> wide = cell("512", [0.01, -0.01, 0.02, 0.0])
        >>> [(round(t.margin, 4), t.holm_p < 0.05) for t in equivalence_tests(rows, [small, wide])]
        [(0.0049, True), (0.0049, False)]
    """
    groups = cells_lib.group_runs(rows, "test")
    margins = [_margin(groups, c.vocab, c.amount) for c in cells]
    raw = [
        stats.equivalence_p_value(c.difference, m) if m > 0 else math.nan
        for c, m in zip(cells, margins)
    ]
    return [
        Equivalence(m, p, holm)
        for m, p, holm in zip(margins, raw, stats.holm_adjusted(raw))
    ]


def verdict(
    cell: cells_lib.Contrast, predicted: int, equivalence: Equivalence | None = None
) -> str:
    """``"agrees"`` or ``"disagrees"`` with a predicted sign of the
    difference (+1, -1) where ``cell.holm_p < ALPHA``; else ``"cannot
    tell"``.

    A prediction of about zero (0) agrees where the ``equivalence`` test's
    Holm p is below ``ALPHA`` (a difference not found is not one shown to be
    small); it disagrees where the difference is significant and its
    interval (the family's simultaneous one for a primary contrast) lies
    wholly outside the margin. Without a margin, any significant difference
    disagrees.

    Examples:
        >>> d = stats.PairedDifference(-0.02, 0.01, 8, -0.03, -0.01)
        >>> c = cells_lib.Contrast("char", 1.0, "b", "a", "b − a", d, 0.0)
        >>> [verdict(dataclasses.replace(c, holm_p=p), sign)
        ...  for p, sign in ((0.01, +1), (0.2, +1), (0.01, 0), (0.2, 0))]
        ['disagrees', 'cannot tell', 'disagrees', 'cannot tell']
        >>> significant = dataclasses.replace(c, holm_p=0.01)
        >>> [verdict(significant, 0, Equivalence(m, 0.5, 0.5)) for m in (0.005, 0.02)]
        ['disagrees', 'cannot tell']
        >>> verdict(significant, 0, Equivalence(0.05, 0.001, 0.01))
        'agrees'
    """
    if predicted not in (-1, 0, 1):
        raise ValueError(f"predicted must be -1, 0 or 1, got {predicted!r}.")
    significant = cell.holm_p < ALPHA  # NaN: no test could be made
    if predicted != 0:
        if not significant:
            return "cannot tell"
        return (
            "agrees" if (cell.difference.mean > 0) == (predicted > 0) else "disagrees"
        )
    if equivalence is None or not equivalence.margin > 0:
        return "disagrees" if significant else "cannot tell"
    if equivalence.holm_p < ALPHA:
        return "agrees"
    low, high = cell.simultaneous
    if not (math.isfinite(low) and math.isfinite(high)):
        low, high = cell.difference.low, cell.difference.high
    outside = low > equivalence.margin or high < -equivalence.margin
    return "disagrees" if significant and outside else "cannot tell"


def literature_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """The report's section "Against published results" (Markdown): each of
    :data:`CLAIMS` with its numbers and source, then its counterparts in ``rows``
    (``runs.csv``'s test rows): a table per contrast, and a verdict.

    Examples:
        >>> text = literature_text([])
        >>> text.splitlines()[0], text.count("no cell has both arms")
        ('## Against published results', 10)
    """
    lines = ["## Against published results", "", _INTRO, ""]
    shown: dict[Contrast, int] = {}
    family = cells_lib.primary_family(rows)  # the primary contrasts' Holm p
    for number, claim in enumerate(CLAIMS, start=1):
        lines.append(_CLAIM.format(number, *claim[:4]))
        for contrast in claim.contrasts:
            lines += _contrast_lines(rows, family, claim, contrast, number, shown)
    return "\n".join(lines).rstrip() + "\n"


_CLAIM = "### {}. {}\n\n- Published: {}.\n- Source: {}.\n- Setting: {}.\n"
_INTRO = prose("literature_intro", arms=ARMS, alpha=ALPHA, per_word=PER_WORD)


def _contrast_lines(rows, family, claim, contrast, number, shown) -> list[str]:
    x, y, column, predicted = contrast
    label = f"**{x} - {y}** ({COLUMN_NAMES.get(column, column)})"
    primary = is_primary(x, y, column)
    cells = _primary_cells(family, x, y) if primary else compare(rows, x, y, column)
    if not cells:
        return [f"{label}: no cell has both arms with test runs yet.", ""]
    key = contrast._replace(predicted=0)
    if key in shown:
        lines = [f"{label}: the table of point {shown[key]}."]
    else:
        shown[key] = number
        lines = [f"{label}:", "", _table(rows, cells, f"{x} - {y}", key == _WORD_PPL)]
    sign = {1: "> 0", -1: "< 0", 0: "about 0"}[predicted]
    reason = claim.not_comparable
    # A primary contrast is corrected over the study's family, of this size.
    size = family.size if primary else None
    equivalence = equivalence_tests(rows, cells) if predicted == 0 else None
    if equivalence and not reason:
        lines += [
            "",
            _equivalence_text(len(cells)),
            "",
            _equivalence_table(cells, equivalence),
        ]
    summary = (
        f"**cannot tell**: {reason}."
        if reason
        else _summary(cells, predicted, size, equivalence)
    )
    return lines + ["", f"Verdict ({x} - {y} {sign} predicted): {summary}", ""]


def _equivalence_text(cells: int) -> str:
    pair = EQUIVALENCE_PAIR
    return prose(
        "literature_equivalence",
        cells=cells,
        best=ALPHA / cells,
        tied=pair.tied,
        untied=pair.untied,
        log_ppl=EQUIVALENCE_LOG_PPL,
        source=pair.source,
        model=pair.model,
    )


def _equivalence_table(cells, equivalence) -> str:
    header = ["vocabulary", "amount", "margin (bits/char)", "TOST p", "(Holm)"]
    body = [
        [*_label(c), DASH if math.isnan(t.margin) else f"±{t.margin:.4f}", _p(t.p),
         _p(t.holm_p)]
        for c, t in zip(cells, equivalence)
    ]  # fmt: skip
    return report.markdown_table(header, body)


_WORD_PPL = Contrast("b", "a", "test_bpc", 0)  # shown with per-word perplexity


def _table(rows, cells, name, with_word_ppl) -> str:
    header = ["vocabulary", "amount", "pairs", f"{name} [95%]", "p (Holm)"]
    body = [
        [
            *_label(c),
            str(c.difference.n),
            report.interval_text(c.difference),
            _p(c.holm_p),
        ]
        for c in cells
    ]
    if not with_word_ppl:
        return report.markdown_table(header, body)
    changes = [word_ppl_change(rows, c.vocab, c.amount) for c in cells]
    for line, (change, low, high) in zip(body, changes):
        ends = "" if math.isnan(low) else f" [{low:+.2%}, {high:+.2%}]"
        line.append(DASH if math.isnan(change) else f"{change:+.2%}{ends}")
    means = [m for m, *_ in changes if math.isfinite(m)]
    here = f"{min(means):+.1%} to {max(means):+.1%}" if means else "unmeasured"
    published = sorted(p.change for p in PTB_PAIRS)
    return (
        report.markdown_table(header + ["per-word ppl b -> a [95%]"], body)
        + "\n\nSize: the published per-word changes untied -> tied run from "
        f"{published[0]:+.1%} to {published[-1]:+.1%}; this study's cells, {here}."
    )


def _p(p: float) -> str:
    """A p-value to 3 significant digits, a dash for NaN (no test)."""
    return DASH if math.isnan(p) else f"{p:.3g}"


def _summary(cells, predicted, family: int | None, equivalence=None) -> str:
    """The verdict over a contrast's cells: a primary contrast (``family``:
    the size of the study's primary family) agrees or disagrees at the
    family's corrected level; an exploratory one (``family`` None) only
    leans toward or against the claim. ``equivalence``: each cell's
    :class:`Equivalence`, for a prediction of about zero."""
    tests = equivalence or [None] * len(cells)
    verdicts = [verdict(c, predicted, t) for c, t in zip(cells, tests)]
    names = {"agrees": "agrees", "disagrees": "disagrees", "cannot tell": "cannot tell"}
    if family is None:
        names.update(agrees="leans toward", disagrees="leans against")
    parts = []
    for v in ("agrees", "disagrees", "cannot tell"):
        at = [" ".join(_label(c)) for c, w in zip(cells, verdicts) if w == v]
        named = f" ({', '.join(at)})" if at and v != "cannot tell" else ""
        parts.append(f"{names[v]} at {len(at)}{named}")
    agree, disagree = "agrees" in verdicts, "disagrees" in verdicts
    words = ("cannot tell", names["disagrees"], names["agrees"], "differs by cell")
    word, note = words[2 * agree + disagree], ""
    told = sum(v != "cannot tell" for v in verdicts)
    if told and told < len(cells):  # a verdict from some of the cells only
        word += f" where it can tell ({told} of {len(cells)} cells)"
    if predicted == 0 and not disagree and not agree:
        widths = [c.difference.high - c.difference.low for c in cells]
        widest = max((w for w in widths if math.isfinite(w)), default=math.nan)
        margins = sorted({round(t.margin, 4) for t in tests if t and t.margin > 0})
        within = (
            f"±{margins[0]:.4f}" if len(margins) == 1
            else f"±{margins[0]:.4f} to ±{margins[-1]:.4f}" if margins
            else "a margin"
        )  # fmt: skip
        note = (
            f": no cell is shown inside {within} bits/char, nor outside it "
            f"(95% intervals up to {widest:.4f} wide)"
        )
    n = len(cells)
    corrected = (
        f"exploratory: Holm over these {n} cells only"
        if family is None
        else f"Holm over the study's {family} primary contrasts"
    )
    if equivalence:
        corrected += f"; equivalence: Holm over these {n} cell{'s' * (n != 1)}"
    return f"**{word}**{note}; cells: {', '.join(parts)}, of {n} ({corrected})."


def _label(cell: cells_lib.Contrast) -> tuple[str, str]:
    return cells_lib.vocab_label(cell.vocab), cells_lib.amount_label(cell.amount)
