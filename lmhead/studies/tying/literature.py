"""The tying study against published results: the published numbers
(:data:`LITERATURE`), what each source predicts for the study's paired
comparisons (:data:`PREDICTIONS`), and what the study found
(:func:`literature_numbers`, :func:`signs_text`,
:func:`literature_reference`), for the report (``report.py`` here).
"""

import math

from lmhead.lab import report, stats
from lmhead.studies.tying import study
from lmhead.studies.tying.results import (
    CellResult,
    cell_values,
    head_share,
    paired,
    tied_result,
)

# Published tied-vs-untied results, as the relative change of test perplexity
# from untied to tied (negative: tying helps). Word-level perplexities, so they
# compare with ours in sign and rough size only.
LITERATURE = (
    ("Press & Wolf 2017, PTB small (head ≈ 43% of the untied model)", 114.5, 112.4),
    ("Press & Wolf 2017, PTB large", 78.4, 74.3),
    ("Inan et al. 2017, small", 87.3, 85.1),
    ("Inan et al. 2017, medium", 77.7, 73.9),
    ("Inan et al. 2017, large", 72.6, 69.0),
)
# What other published results predict for this study's comparisons:
# (source and setting, its result, the prediction here, and the paired
# differences (x arm, y arm, run value) that test it).
PREDICTIONS = (
    (
        "Press & Wolf 2017; Inan et al. 2017 (PTB, LSTMs, 10k words)",
        "tying lowers test perplexity 2-5% (above) and raises training perplexity",
        "b − a > 0 on test, training a − b > 0, most where the head's share is "
        "largest; the `limited` regime",
        (("b", "a", "test"), ("a", "b", "train")),
    ),
    (
        "MobileLLM (Liu et al. 2024, 125M)",
        "sharing the embedding costs 0.2 points of accuracy; spending the saved "
        "parameters on depth recovers it",
        "d − b ≤ 0: tied and deeper matches or beats untied at equal parameters",
        (("d", "b", "test"),),
    ),
    (
        "Chung et al. 2021 (rethinking embedding coupling)",
        "decoupled input and output embeddings of equal size are about neutral",
        "c − a ≈ 0 at equal parameters",
        (("c", "a", "test"),),
    ),
    (
        "modded-nanogpt (124M, abundant data)",
        "untied 3.2755 vs tied 3.2776 validation loss",
        "b − a slightly < 0 in the `fixed` regime, where data is not the limit",
        (("b", "a", "test"),),
    ),
)
# The study's counterparts of the published claims beside a − b: (label,
# x arm, y arm, run value).
COUNTERPARTS = (
    ("training bits/char a − b", "a", "b", "train"),
    ("untied matched to a, c − a", "c", "a", "test"),
    ("tied deeper matched to b, d − b", "d", "b", "test"),
)


def literature_numbers(results: list[CellResult], design: study.Design) -> list[str]:
    """Lines with the study's counterpart of each published claim, one per
    vocabulary of one regime's ``results``: tied − untied in bits/char and as
    the change of test perplexity per token, then :data:`COUNTERPARTS`."""
    lines = []
    for vocab in design.vocabularies:
        tied_minus_untied = paired(results, vocab, "a", "b")
        if not tied_minus_untied or tied_minus_untied.n == 0:
            continue
        tied = tied_result(results, vocab)
        chars_per_token = stats.mean_std(
            list(cell_values(tied, "chars_per_token").values())
        )[0]
        change = 2 ** (tied_minus_untied.mean * chars_per_token) - 1
        parts = [
            f"{study.vocabulary_label(vocab)} (head {head_share(tied):.1%} of a): "
            f"tied − untied (a − b) {report.interval_text(tied_minus_untied)} bits/char"
            + (
                ""
                if math.isnan(change)
                else f", test perplexity per token {change:+.2%} untied → tied"
            )
        ]
        for label, x_arm, y_arm, key in COUNTERPARTS:
            difference = paired(results, vocab, x_arm, y_arm, key=key)
            if difference and difference.n:
                parts.append(f"{label} {report.interval_text(difference)}")
        lines.append("- " + "; ".join(parts) + ".")
    return lines


def signs_text(
    results: list[CellResult], design: study.Design, x_arm: str, y_arm: str, key: str
) -> str:
    """Over the vocabularies of one regime's ``results``: at how many the
    paired ``x - y`` of ``key`` is above zero, and at how many its 95%
    interval lies above or below zero (vocabularies with fewer than two seed
    pairs, or a non-finite difference, are left out).

    Examples:
        >>> from lmhead.lab import workdirs
        >>> from lmhead.studies.tying import shapes
        >>> regime = study.Regime("fixed", 1.0, 100, 0)
        >>> def result(arm, losses):
        ...     cell = study.Cell(regime, None, arm, shapes.Shape(arm == "a", 8, 1, 16), 84)
        ...     runs = {s: workdirs.Run("r", "r", {}, {}, [], {"test": {
        ...         "bits_per_char": v}}, "finished") for s, v in enumerate(losses)}
        ...     return CellResult(cell, 1e-3, {}, runs, 1000)
        >>> design = study.Design("tiny", {}, (regime,), (None,), ("a", "b"), (1e-3,),
        ...                       (0, 1, 2))
        >>> signs_text([result("a", [2.0, 2.1, 2.2]), result("b", [2.1, 2.2, 2.3])],
        ...            design, "b", "a", "test")
        '> 0 at 1 of 1 (interval above 0 at 1, below at 0)'
        >>> signs_text([result("a", [2.0]), result("b", [2.1])], design, "b", "a", "test")
        'no seed pairs yet'
    """
    if len({r.cell.regime for r in results}) > 1:
        raise ValueError("signs_text takes one regime's results.")
    differences = [
        d
        for d in (
            paired(results, vocab, x_arm, y_arm, key) for vocab in design.vocabularies
        )
        if d and d.n >= 2 and math.isfinite(d.mean)
    ]
    if not differences:
        return "no seed pairs yet"
    positive = sum(d.mean > 0 for d in differences)
    above = sum(d.low > 0 for d in differences)
    below = sum(d.high < 0 for d in differences)
    return (
        f"> 0 at {positive} of {len(differences)} (interval above 0 at {above}, "
        f"below at {below})"
    )


def literature_reference(
    by_regime: dict[str, list[CellResult]], design: study.Design
) -> str:
    """The published perplexities, then what each source predicts here and
    what this study found: per regime, the sign of each paired difference
    that tests the prediction, counted over vocabularies."""
    lines = [
        f"- {name}: {untied} → {tied} ({tied / untied - 1:+.1%})"
        for name, untied, tied in LITERATURE
    ]
    lines += [
        "",
        "What they predict for this study's comparisons, and what it found "
        "(over the vocabularies: how many paired differences are above zero, "
        "and how many 95% intervals lie wholly above or below it):",
        "",
    ]
    rows = []
    for source, result, prediction, checks in PREDICTIONS:
        found = "<br>".join(
            f"`{regime}` {'training ' if key == 'train' else ''}{x} − {y}: "
            + signs_text(results, design, x, y, key)
            for regime, results in by_regime.items()
            for x, y, key in checks
            if any(r.cell.arm == x for r in results)
            and any(r.cell.arm == y for r in results)
        )
        rows.append([source, result, prediction, found or report.DASH])
    table = report.markdown_table(
        ["source", "its result", "prediction here", "found here"], rows
    )
    return "\n".join(lines + [table])
