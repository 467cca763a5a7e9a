"""The tying study's answer: the primary contrasts in one sentence and a
small table (what ``make compare`` prints and the report opens with), what
each contrast means at the family's corrected level, and the corrected
counts over the cells."""

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lmhead.lab import report
from studies.tying import cells as cells_lib
from studies.tying.cells import ALPHA, PRIMARY, Contrast
from studies.tying.report_text import (
    column_names,
    p_text,
    pair_text,
    prose,
    spread_text,
)

Rows = Sequence[Mapping[str, Any]]


def family_counts(contrasts: Sequence[Contrast]) -> str:
    """``k of n cells`` per primary contrast, beside the Holm correction, and
    of those the budget-limited ones and, where rates were tuned, the ones
    whose worse arm's rate is at the edge of the rates tried; the
    ``{counts}`` of the templates family_counts, answer_cells and
    untrained_sensitivity (prose.toml)."""
    tuned = any(c.edge is not None for c in contrasts)
    parts = []
    for x, y in PRIMARY:
        of = [c for c in contrasts if (c.minuend, c.subtrahend) == (x, y)]
        found = [c for c in of if c.holm_p < ALPHA]
        lower = sum(c.difference.mean < 0 for c in found)
        capped = sum(bool(c.capped) for c in found)
        edge = sum(bool(verdict_edges(c)) for c in found)
        first = sum(bool(c.first_eval) for c in found)
        edge_text = (
            f"; {edge} with the worse arm's rate at the edge of the rates tried"
            if tuned
            else ""
        )
        parts.append(
            f"{x} − {y}: Holm-adjusted p < {ALPHA} in {len(found)} of "
            f"{len(of)} cells ({x} lower in {lower}, higher in "
            f"{len(found) - lower}; {capped} of them with runs at their step "
            f"cap, budget-limited; {first} with runs best at their first "
            f"validation{edge_text})"
        )
    return "; ".join(parts)


def answer(rows: Rows) -> str:
    """The study's answer in one sentence and a small table: each arm's test
    bits/char, and the primary contrasts with their simultaneous 95%
    intervals, Holm-adjusted p-values and what each means; what
    ``make compare`` prints.

    Examples:
        >>> answer([])
        'No cell has paired test runs of arms b and a, or c and a, yet.'
    """
    family = cells_lib.primary_family(rows)
    if not family.contrasts:
        return "No cell has paired test runs of arms b and a, or c and a, yet."
    groups = cells_lib.group_runs(rows, "test")
    cells = sorted(
        {(c.vocab, c.amount) for c in family.contrasts}, key=cells_lib.cell_order
    )
    lines = []
    for cell in cells:
        prefix = [cells_lib.cell_label(cell)] if len(cells) > 1 else []
        for arm in dict.fromkeys(a for pair in PRIMARY for a in sorted(pair)):
            values = cells_lib.column(groups.get((*cell, arm), {}).values(), "test_bpc")
            name = f"{arm} ({cells_lib.ARM_NAMES[arm]})"
            lines.append([*prefix, name, spread_text(values), "", ""])
        for c in family.contrasts:
            if (c.vocab, c.amount) == cell:
                difference = f"{c.difference.mean:+.4f} {pair_text(*c.simultaneous)}"
                lines.append(
                    [*prefix, c.label, difference, p_text(c.holm_p), meaning(c)]
                )
    header = ["cell"] * (len(cells) > 1) + column_names("answer_columns")
    return "\n\n".join(
        [
            answer_sentence(family.contrasts),
            report.markdown_table(header, lines),
            prose("answer_note", size=family.size),
        ]
    )


def meaning(contrast: Contrast) -> str:
    """What a primary contrast says at the family's corrected level (Holm p
    below :data:`ALPHA`); lower bits/char is better. Named beside it: runs
    at their step cap, and the arms whose rate at the edge of the rates
    tried could change the verdict (the worse arm of a difference found,
    either arm of one not found), since their best rate may lie beyond.

    Examples:
        >>> from lmhead.lab import stats
        >>> d = stats.PairedDifference(-0.02, 0.01, 8, -0.03, -0.01)
        >>> meaning(Contrast("char", 0.1, "b", "a", "b − a", d, 0.001, 0.004))
        'b better than a'
        >>> meaning(Contrast("char", 0.1, "b", "a", "b − a", d, 0.001, 0.004,
        ...                  edge=("b", "a")))
        "b better than a (a's rate at the edge of the rates tried)"
        >>> meaning(Contrast("char", 0.1, "c", "a", "c − a", d, 0.03, 0.06))
        'c and a not told apart at 8 seeds'
    """
    x, y = contrast.minuend, contrast.subtrahend
    if _found(contrast):
        better, worse = (x, y) if contrast.difference.mean < 0 else (y, x)
        said = f"{better} better than {worse}"
    else:
        said = f"{x} and {y} not told apart at {contrast.difference.n} seeds"
    notes = []
    if contrast.capped:
        runs = "run" if contrast.capped == 1 else "runs"
        notes.append(f"budget-limited: {contrast.capped} {runs} at the step cap")
    if contrast.first_eval:
        runs = "run" if contrast.first_eval == 1 else "runs"
        notes.append(f"{contrast.first_eval} {runs} best at the first validation")
    edge = verdict_edges(contrast)
    if edge:
        whose = " and ".join(f"{arm}'s" for arm in edge)
        rates = "rate" if len(edge) == 1 else "rates"
        notes.append(f"{whose} {rates} at the edge of the rates tried")
    return f"{said} ({'; '.join(notes)})" if notes else said


def _found(contrast: Contrast) -> bool:
    return not math.isnan(contrast.holm_p) and contrast.holm_p < ALPHA


def verdict_edges(contrast: Contrast) -> tuple[str, ...]:
    """The contrast's arms at the edge of their rates tried whose best rate,
    if it lies beyond, could change the verdict: the worse arm of a
    difference found (Holm p below :data:`ALPHA`), either arm of one not
    found. A better arm at its edge could only do better still.

    Examples:
        >>> from lmhead.lab import stats
        >>> d = stats.PairedDifference(-0.02, 0.01, 8, -0.03, -0.01)
        >>> found = Contrast("char", 0.1, "b", "a", "b − a", d, 0.001, 0.004,
        ...                  edge=("b", "a"))
        >>> not_found = Contrast("char", 0.1, "b", "a", "b − a", d, 0.1, 0.2,
        ...                      edge=("b", "a"))
        >>> verdict_edges(found), verdict_edges(not_found)
        (('a',), ('b', 'a'))
    """
    if not _found(contrast):
        return contrast.edge or ()
    worse = contrast.subtrahend if contrast.difference.mean < 0 else contrast.minuend
    return tuple(arm for arm in contrast.edge or () if arm == worse)


def answer_sentence(contrasts: Sequence[Contrast]) -> str:
    """One sentence: in one cell, each primary contrast's effect and Holm p;
    over several, in how many cells the corrected test finds an effect."""
    cells = {(c.vocab, c.amount) for c in contrasts}
    if len(cells) > 1:
        return prose("answer_cells", cells=len(cells), counts=family_counts(contrasts))
    parts = [
        f"{cells_lib.CONTRAST_NAMES.get(c.label, c.label)} ({c.label}) changes "
        f"test bits/char by {c.difference.mean:+.4f} (Holm-adjusted p "
        f"{p_text(c.holm_p)}: {meaning(c)})"
        for c in contrasts
    ]
    seeds = max(c.difference.n for c in contrasts)
    return f"At {cells_lib.cell_label(cells.pop())}, over {seeds} seeds, " + (
        "; ".join(parts) + "."
    )
