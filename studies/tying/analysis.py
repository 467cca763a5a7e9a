"""The tying study's report from the rows of ``runs.csv`` alone
(``table.read_rows``'s list of dicts): :func:`write_report` writes
``REPORT.md`` and the plots; this module holds the results by cell, the
primary (:data:`PRIMARY`, one Holm family) and secondary contrasts, the
ablation and the totals; the other sections have modules of their own
(``docs/tying_study/README.md``, "The code").
"""

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmhead.lab import report
from studies.tying import cells as cells_lib
from studies.tying import contrast_plots, table
from studies.tying.across_cells import model_section, power_section
from studies.tying.answer import answer, family_counts
from studies.tying.cells import PRIMARY, SECONDARY, Contrast
from studies.tying.design_text import design_section
from studies.tying.flags_text import flags_section
from studies.tying.report_text import (
    DASH,
    column_names,
    equal_spread_text,
    geometric_mean_text,
    mean_text,
    p_text,
    pair_text,
    places_text,
    prose,
    range_text,
    significant_text,
    spread_text,
)
from studies.tying.tuning_text import tuning_section

Rows = Sequence[Mapping[str, Any]]


# --- Results per cell ---------------------------------------------------------


def results_section(rows: Rows) -> str:
    """Each cell's arms: test bits/char, validation, gap, steps, cap, ppl."""
    groups = cells_lib.group_runs(rows, "test")
    lines, capped, untrained = [], [], []
    for key, runs in groups.items():
        vocab, amount, arm = key
        values = list(runs.values())
        reached = sum(bool(r["reached_cap"]) for r in values)
        if reached:
            capped.append(f"{cells_lib.cell_label((vocab, amount))} {arm} {reached}")
        untrained += [r["run"] for r in values if _untrained(r)]
        lines.append(
            [
                cells_lib.vocab_label(vocab),
                cells_lib.amount_label(amount),
                arm,
                ", ".join(f"{lr:.3g}" for lr in sorted({r["lr"] for r in values})),
                spread_text(cells_lib.column(values, "test_bpc")),
                mean_text(cells_lib.column(values, "val_bpc")),
                mean_text(cells_lib.column(values, "gap_bpc")),
                mean_text(cells_lib.column(values, "steps_to_best"), 0),
                f"{reached} of {len(values)}",
                significant_text(cells_lib.column(values, "tokens_per_param")),
                significant_text(
                    [
                        t
                        for t in map(cells_lib.trained_tokens_per_param, values)
                        if t is not None
                    ]
                ),
                geometric_mean_text(cells_lib.column(values, "test_word_ppl")),
            ]
        )
    text = [
        "## Results by cell",
        prose("results"),
        report.markdown_table(column_names("results_columns"), lines),
    ]
    if capped:
        text.append(prose("results_capped", runs="; ".join(capped)))
    if untrained:
        text.append(prose("results_untrained", runs="; ".join(untrained)))
    return "\n\n".join(text)


# --- Contrasts ----------------------------------------------------------------


def _contrast_cells(contrast: Contrast) -> list[str]:
    d = contrast.difference
    return [
        cells_lib.vocab_label(contrast.vocab),
        cells_lib.amount_label(contrast.amount),
        contrast.label,
        str(d.n),
        report.interval_text(d),
        p_text(contrast.p),
    ]


def primary_section(rows: Rows) -> str:
    """The primary family: intervals, p, Holm p, pooled and simultaneous."""
    family = cells_lib.primary_family(rows)
    head = "## Primary contrasts: " + ", ".join(f"{x} − {y}" for x, y in PRIMARY)
    if not family.contrasts:
        return f"{head}\n\nNo cell has paired test runs of these arms yet."
    groups = cells_lib.group_runs(rows, "test")
    lines = [
        [
            *_contrast_cells(c),
            p_text(c.holm_p),
            pair_text(*c.pooled),
            pair_text(*c.simultaneous),
            f"{c.capped} of {2 * c.difference.n}",
            f"{c.first_eval} of {2 * c.difference.n}",
            ", ".join(c.edge or ()) or DASH,
            places_text(
                cells_lib.place_means(groups, c), cells_lib.blocked_by_place(groups, c)
            ),
        ]
        for c in family.contrasts
    ]
    pooled = "; ".join(
        f"{label}: {p.std:.4f} ({p.dof} degrees of freedom; the cells' own "
        f"{range_text([c.difference.std for c in family.contrasts if c.label == label])}"
        f"{equal_spread_text(p.equal_spread_p)})"
        for label, p in family.pooled.items()
    )
    parts = [
        head,
        prose(
            "primary",
            size=family.size,
            contrasts=len(PRIMARY),
            measured=len(family.contrasts),
        ),
        report.markdown_table(column_names("primary_columns"), lines),
        f"Pooled standard deviations of the differences: {pooled}.",
        prose("family_counts", counts=family_counts(family.contrasts)),
        untrained_sensitivity(rows),
    ]
    return "\n\n".join(part for part in parts if part)


def _untrained(row) -> bool:
    """The run was never better than its initial parameters (best step 0)."""
    return row.get("steps_to_best") == 0


def untrained_sensitivity(rows: Rows) -> str:
    """The corrected counts again without the test runs never better than
    their initial parameters (best step 0: diverged before the first
    evaluation), where there are any; else empty."""
    kept = [r for r in rows if not (r["role"] == "test" and _untrained(r))]
    if len(kept) == len(rows):
        return ""
    counts = family_counts(cells_lib.primary_family(kept).contrasts)
    return prose("untrained_sensitivity", runs=len(rows) - len(kept), counts=counts)


def secondary_section(rows: Rows) -> str:
    """:data:`SECONDARY` in every cell that has both arms, unadjusted."""
    contrasts = cells_lib.paired_contrasts(
        cells_lib.group_runs(rows, "test"), SECONDARY
    )
    text = [
        "## Secondary contrasts (exploratory)",
        prose("secondary"),
    ]
    if contrasts:
        text.append(
            report.markdown_table(
                ["vocabulary", "amount", "contrast", "n", "mean [95% t]", "p"],
                (_contrast_cells(c) for c in contrasts),
            )
        )
    return "\n\n".join(text)


def ablation_section(rows: Rows) -> str:
    """The table learning-rate multipliers: each arm x multiplier, and paired
    contrasts against multiplier 1 and between arms; unadjusted."""
    ablation = cells_lib.ablation_groups(rows)
    if not ablation.groups:
        return ""
    lines = [
        [
            cells_lib.cell_label((vocab, amount)),
            arm,
            f"{multiplier:g}",
            ", ".join(f"{lr:.3g}" for lr in sorted({r["lr"] for r in runs.values()})),
            spread_text(cells_lib.column(runs.values(), "test_bpc")),
            mean_text(cells_lib.column(runs.values(), "val_bpc")),
        ]
        for (vocab, amount, arm, multiplier), runs in ablation.groups.items()
    ]
    contrasts = [
        [c.label, str(c.difference.n), report.interval_text(c.difference), p_text(c.p)]
        for c in ablation.contrasts
    ]
    text = [
        "## Table learning-rate ablation (exploratory)",
        prose("ablation")
        + (
            f" Multiplier 1 is the cell's test runs ({', '.join(ablation.borrowed)})."
            if ablation.borrowed
            else ""
        ),
        report.markdown_table(
            ["cell", "arm", "multiplier", "lr", "test bits/char", "val bits/char"],
            lines,
        ),
    ]
    if contrasts:
        text.append(
            report.markdown_table(
                ["ablation contrast", "n", "mean [95% t]", "p"], contrasts
            )
        )
    return "\n\n".join(text)


def totals_section(rows: Rows) -> str:
    """What the runs took, as runs.csv measured it."""
    totals = cells_lib.measured_totals(rows)
    by_role = ", ".join(f"{role} {n}" for role, n in totals.runs_by_role.items())
    by_status = ", ".join(f"{s} {n}" for s, n in totals.runs_by_status.items())
    return "\n\n".join(
        [
            "## Measured totals",
            prose(
                "totals",
                runs=totals.runs,
                by_role=by_role,
                by_status=by_status,
                steps=totals.steps,
                seconds=totals.wall_seconds,
                hours=totals.wall_seconds / 3600,
                programs=totals.programs,
            ),
        ]
    )


# --- The report ---------------------------------------------------------------


def write_report(
    rows: Rows,
    out_dir: str,
    literature: Callable[[Rows], str] | str | None = None,
) -> tuple[str, list[str]]:
    """Writes ``out_dir/REPORT.md`` and the plots from ``rows`` alone; returns
    the markdown text and the plot paths. ``literature``: the comparison with
    published results (markdown with its own heading, or a function of the
    rows that returns it), placed after the contrasts.

    Raises:
        ValueError, TypeError: a row that ``table.check_row`` refuses.
    """
    for index, row in enumerate(rows):
        table.check_row(row, index)
    os.makedirs(out_dir, exist_ok=True)
    plot_paths = contrast_plots.plot_contrasts(cells_lib.primary_family(rows), out_dir)
    if callable(literature):
        literature = literature(rows)
    sections = [
        "# The tying study",
        prose("report_intro", rows=len(rows)),
        answer(rows),
        design_section(rows),
        tuning_section(rows),
        results_section(rows),
        primary_section(rows),
        "\n\n".join(
            f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plot_paths
        ),
        model_section(rows),
        power_section(rows),
        flags_section(rows),
        secondary_section(rows),
        ablation_section(rows),
        literature or "",
        totals_section(rows),
    ]
    text, _ = report.write_markdown(out_dir, [s.strip() for s in sections if s])
    return text, plot_paths
