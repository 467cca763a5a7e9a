"""The runs to read narrowly, each named: the test runs best at their first
validation (their best parameters may lie before it) and the arms whose
chosen rate is at an edge of the rates their tuning tried (their best rate
may lie beyond it)."""

from collections.abc import Mapping, Sequence
from typing import Any

from lmhead.lab import report
from studies.tying import cells as cells_lib
from studies.tying.report_text import DASH, column_names, prose, seeds_text

Rows = Sequence[Mapping[str, Any]]


def first_eval_runs(rows: Rows) -> dict[tuple, list[int]]:
    """``{(vocab, amount, arm): [seeds]}`` of the finished test runs best at
    their first validation (``cells.best_at_first_eval``), in cell order.

    Examples:
        >>> run = lambda seed, best: {"role": "test", "status": "finished",
        ...     "vocab": "char", "amount": 1.0, "arm": "a", "seed": seed,
        ...     "table_lr_multiplier": 1.0, "steps_to_best": best,
        ...     "eval_every": 100}
        >>> first_eval_runs([run(0, 100), run(1, 300), run(2, 100)])
        {('char', 1.0, 'a'): [0, 2]}
    """
    found = {}
    for key, runs in cells_lib.group_runs(rows, "test").items():
        seeds = sorted(s for s, r in runs.items() if cells_lib.best_at_first_eval(r))
        if seeds:
            found[key] = seeds
    return found


def edge_arms(rows: Rows) -> list[tuple[cells_lib.Tuning, str]]:
    """Each tuned arm whose chosen rate is the lowest or highest it tried
    (``Tuning.at_edge``), with which edge: ``"lowest"`` or ``"highest"``."""
    found = []
    for tuning in cells_lib.tunings(rows):
        if tuning.at_edge:
            tried = sorted(tuning.mean_loss)
            sides = [
                side
                for side, lr in (("lowest", tried[0]), ("highest", tried[-1]))
                if tuning.is_chosen(lr)
            ]
            found.append((tuning, " and ".join(sides)))
    return found


def flags_section(rows: Rows) -> str:
    """The two lists, as tables: runs best at their first validation, arms
    at a ladder edge."""
    first = first_eval_runs(rows)
    groups = cells_lib.group_runs(rows, "test")
    edges = edge_arms(rows)
    parts = [
        "## Flags",
        prose(
            "flags_first_eval",
            first=sum(map(len, first.values())),
            runs=sum(len(r) for r in groups.values()),
        ),
    ]
    if first:
        parts.append(
            report.markdown_table(
                column_names("flags_first_eval_columns"),
                (
                    [
                        cells_lib.vocab_label(vocab),
                        cells_lib.amount_label(amount),
                        arm,
                        seeds_text(seeds),
                        f"{len(seeds)} of {len(groups[(vocab, amount, arm)])}",
                    ]
                    for (vocab, amount, arm), seeds in first.items()
                ),
            )
        )
    tuned = sum(len(t.mean_loss) > 1 for t in cells_lib.tunings(rows))
    if not tuned:
        parts.append(prose("flags_untuned"))
        return "\n\n".join(parts)
    parts.append(prose("flags_edges", edges=len(edges), tuned=tuned))
    if edges:
        parts.append(
            report.markdown_table(
                column_names("flags_edges_columns"),
                (
                    [
                        cells_lib.vocab_label(t.vocab),
                        cells_lib.amount_label(t.amount),
                        t.arm,
                        ", ".join(f"{lr:.3g}" for lr in t.chosen) or DASH,
                        side,
                        ", ".join(f"{lr:.3g}" for lr in sorted(t.mean_loss)),
                    ]
                    for t, side in edges
                ),
            )
        )
    return "\n\n".join(parts)
