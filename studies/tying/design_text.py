"""The tying study's report: its section "Design", the design as the rows
of ``runs.csv`` show it (vocabularies, amounts, offsets, seeds, each arm's
shape, arm e's untie step) and the runs that reached their step cap."""

from collections.abc import Mapping, Sequence
from typing import Any

from lmhead.lab import report
from studies.tying import cells as cells_lib
from studies.tying import table
from studies.tying.report_text import (
    DASH,
    column_names,
    int_text,
    prose,
    seeds_text,
)

Rows = Sequence[Mapping[str, Any]]


def _untie_text(steps: dict[float, int]) -> str:
    """Arm e's untie step in each amount's cell.

    Examples:
        >>> _untie_text({0.003: 67, 1.0: 667}), _untie_text({})
        ('67 at 0.3%, 667 at 100%', '—')
    """
    return (
        ", ".join(
            f"{int_text(step)} at {cells_lib.amount_label(amount)}"
            for amount, step in sorted(steps.items())
        )
        or DASH
    )


def design_section(rows: Rows) -> str:
    """The vocabularies, amounts, offsets, seeds and each arm's shape."""
    tested = [r for r in rows if r["role"] == "test"]
    shapes, untie = {}, {}
    for row in sorted(tested, key=cells_lib.row_order):
        shapes.setdefault((row["vocab"], row["arm"]), row)
        if row["untie_step"] is not None:  # arm e's, which depends on the cell
            steps = untie.setdefault((row["vocab"], row["arm"]), {})
            steps.setdefault(row["amount"], row["untie_step"])
    arms = report.markdown_table(
        column_names("design_columns"),
        (
            [
                cells_lib.vocab_label(vocab),
                int_text(row["vocab_size"]),
                f"{arm} ({cells_lib.ARM_NAMES.get(arm, arm)})",
                int_text(row["d_model"]),
                int_text(row["num_layers"]),
                int_text(row["mlp_dim"]),
                int_text(row["params"]),
                int_text(row["flops_per_token"]),
                DASH if row["head_share"] is None else f"{row['head_share']:.1%}",
                _untie_text(untie.get((vocab, arm), {})),
            ]
            for (vocab, arm), row in shapes.items()
        ),
    )
    # Where no vocabulary has arm d, these runs did not include it (a check
    # of some arms only): the design's reason would not apply.
    with_d = any(arm == "d" for _, arm in shapes)
    no_d = [
        cells_lib.vocab_label(v)
        for v in cells_lib.vocabularies(tested)
        if with_d and (v, "d") not in shapes
    ]
    lines = [
        "## Design",
        prose("design"),
        arms,
        amounts_table(rows),
    ]
    if no_d:
        lines.append(prose("design_no_d", vocabs=", ".join(no_d)))
    lines.append(cap_counts(rows))
    return "\n\n".join(lines)


# The most runs of a subset amount that may reach their step cap (the study's
# issue: at the smaller amounts the cap must leave room to early-stop).
SUBSET_CAP_LIMIT = 0.1


def cap_counts(rows: Rows) -> str:
    """How many finished runs (every role) reached their step cap, by amount,
    against the design's bound: at most :data:`SUBSET_CAP_LIMIT` of a subset
    amount's runs; the whole split (amount 1) is budget-limited on purpose.

    Examples:
        >>> run = lambda amount, cap: {"status": "finished", "amount": amount,
        ...                            "reached_cap": cap}
        >>> print(cap_counts([run(0.01, False), run(0.01, True), run(1.0, True)]))
        Runs that reached their step cap, by amount (finished runs of every role): 1% 1 of 2 (50%), 100% 1 of 1 (100%). At most 10% of a subset amount's runs may: 1% is over that bound, so its numbers are partly those of a fixed budget. The whole split is budget-limited by design.
    """
    finished = [r for r in rows if r["status"] == "finished"]
    if not finished:
        return prose("cap_none")
    counts, over = [], []
    for amount in cells_lib.amounts(finished):
        of = [r for r in finished if r["amount"] == amount]
        reached = sum(bool(r["reached_cap"]) for r in of)
        label = cells_lib.amount_label(amount)
        counts.append(f"{label} {reached} of {len(of)} ({reached / len(of):.0%})")
        if amount < 1.0 and reached > SUBSET_CAP_LIMIT * len(of):
            over.append(label)
    sentences = [prose("cap_counts", counts=", ".join(counts))]
    if any(amount < 1.0 for amount in cells_lib.amounts(finished)):
        bound = ("cap_bound_none", "cap_bound_one", "cap_bound_some")[min(len(over), 2)]
        sentences.append(prose(bound, limit=SUBSET_CAP_LIMIT, over=", ".join(over)))
    if 1.0 in cells_lib.amounts(finished):
        sentences.append(prose("cap_whole"))
    return " ".join(sentences)


def amounts_table(rows: Rows) -> str:
    """One line per data amount: offsets, training characters, step cap and
    the seeds of each role."""
    lines = []
    for amount in cells_lib.amounts(rows):
        of = [r for r in rows if r["amount"] == amount]
        offsets = sorted({r["offset"] for r in of})
        seeds = {
            role: sorted({r["seed"] for r in of if r["role"] == role})
            for role in table.ROLES
        }
        lines.append(
            [
                cells_lib.amount_label(amount),
                ", ".join(f"{o:g}" for o in offsets),
                _chars_by_offset(of, offsets),
                ", ".join(
                    f"{s:,}" for s in sorted({r["steps_cap"] for r in of} - {None})
                ),
                *[seeds_text(seeds[role]) for role in table.ROLES],
            ]
        )
    return report.markdown_table(
        column_names("amounts_columns"),
        lines,
    )


def _chars_by_offset(rows: Rows, offsets: Sequence[float]) -> str:
    """The training characters at each offset, named by offset where there
    are several.

    Examples:
        >>> rows = [dict(offset=0.5, train_chars=36074),
        ...         dict(offset=0.0, train_chars=36586)]
        >>> _chars_by_offset(rows, [0.0, 0.5]), _chars_by_offset(rows[:1], [0.5])
        ('36,586 at 0, 36,074 at 0.5', '36,074')
    """
    parts = []
    for offset in offsets:
        chars = sorted({r["train_chars"] for r in rows if r["offset"] == offset})
        text = ", ".join(f"{c:,}" for c in chars if c is not None)
        if text:
            parts.append(f"{text} at {offset:g}" if len(offsets) > 1 else text)
    return ", ".join(parts) or DASH
