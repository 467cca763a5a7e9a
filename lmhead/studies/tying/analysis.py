"""The tying study's report from the rows of ``runs.csv`` alone
(``table.read_rows``'s list of dicts): no run directory is read, so anyone
with the committed CSV regenerates it, or re-pairs arms, re-chooses rates
and applies another analysis.

A *cell* is one vocabulary at one data amount (``train_fraction``); its
arms a..e are compared within it, paired by seed. The *primary* contrasts,
named before the runs, are :data:`PRIMARY` (b - a and c - a) in every cell:
one family, whose p-values are Holm-adjusted together, with a spread of the
paired differences pooled over the cells beside each cell's own. Every
other comparison (:data:`SECONDARY`, the table learning-rate ablation) is
unadjusted and labelled exploratory.

:func:`write_report` writes ``REPORT.md`` and the plots
(``contrast_plots.py``); this module holds the sections of the results and
the contrasts, and each other concern has a module of its own: the answer
that opens the report and that ``make compare`` prints (``answer.py``), the
design (``design_text.py``), the learning rates (``tuning_text.py``), the
model across cells and the power (``across_cells.py``), the runs to read
narrowly (``flags_text.py``), the numbers as text (``report_text.py``). The numbers come from ``cells.py``.

Every value is test bits per character, paired by seed within a cell,
unless a column says otherwise; a difference x - y < 0 means x is better.
"""

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmhead.lab import report
from lmhead.studies.tying import cells as cells_lib
from lmhead.studies.tying import contrast_plots, table
from lmhead.studies.tying.across_cells import model_section, power_section
from lmhead.studies.tying.answer import answer, family_counts
from lmhead.studies.tying.cells import PRIMARY, SECONDARY, Contrast
from lmhead.studies.tying.design_text import design_section
from lmhead.studies.tying.flags_text import flags_section
from lmhead.studies.tying.report_text import (
    DASH,
    equal_spread_text,
    geometric_mean_text,
    mean_text,
    p_text,
    pair_text,
    places_text,
    range_text,
    significant_text,
    spread_text,
)
from lmhead.studies.tying.tuning_text import tuning_section

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
        "Test bits/char: mean ± sample std (runs) over the test seeds; the other "
        "columns are means over the same runs. Held-out gap: bits/char on "
        "held-out windows of the training plays minus on training windows, "
        "at the tested step. Steps to best: the step of the lowest validation "
        "loss, whose parameters were tested. Word perplexity: exp(test nats / "
        "words of the test text, `len(text.split())`), its geometric mean over "
        "the runs (the mean of a log-scale quantity). Data tokens/param: the "
        "training text's tokens per parameter, the size of the data and not "
        "of the training (a run on a subset passes over it many times). "
        "Trained tokens/param: the tokens that trained the tested parameters "
        "(steps to best x tokens per step) per parameter; Chinchilla's "
        "compute-optimal ratio is about 20.",
        report.markdown_table(
            [
                "vocabulary",
                "amount",
                "arm",
                "lr",
                "test bits/char",
                "val bits/char",
                "held-out gap",
                "steps to best",
                "reached cap",
                "data tokens/param",
                "trained tokens/param",
                "word ppl",
            ],  # fmt: skip
            lines,
        ),
    ]
    if capped:
        text.append(
            "Runs that reached the step cap are budget-limited, not "
            "early-stopped: their numbers are those of a fixed budget (cell, "
            f"arm, runs): {'; '.join(capped)}."
        )
    if untrained:
        text.append(
            "Runs never better than their initial parameters (best step 0: "
            "the loss diverged before the first evaluation), so tested "
            f"untrained, and in their pairs as such: {'; '.join(untrained)}."
        )
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
        f"One family of {family.size} contrasts (every cell of the design x "
        f"{len(PRIMARY)}), named in the sweep file before the runs; "
        f"{len(family.contrasts)} have paired test runs so far, and the "
        "corrections count all of them. Mean "
        "[95% t-interval] of the per-seed differences, the paired t-test's "
        "two-sided p, and Holm's step-down adjusted p over the whole family. "
        "Pooled (unadjusted, an estimate stated as such): the cell's mean "
        "± t · s_p / √n with the standard deviation "
        "s_p of that contrast's differences pooled over all cells, "
        "√(Σ(n_i − 1)s_i² / Σ(n_i − 1)), which assumes the spread is the "
        "same in every cell (tested below the table: where that test's p is "
        "small, the pooled intervals are too wide for some cells and too "
        "narrow for others); no conclusion here rests on it. Simultaneous: "
        "Bonferroni intervals that hold "
        "together for the whole family at 95%; Bonferroni is more "
        "conservative than Holm, so such an interval may include 0 where "
        "the Holm-adjusted p is below 0.05. At cap: the pairs' runs that "
        "reached their step cap, budget-limited rather than early-stopped. "
        "Best at first validation: the pairs' runs whose best validation was "
        "their first, so that their best parameters may lie earlier and the "
        "contrast measures how fast the arms overfit as much as how good they "
        "get. Rate at edge: the arms whose test rate is the lowest or highest "
        "rate their tuning tried (see Learning rates), so that their best "
        "rate may lie beyond and the contrast may favour the other arm. "
        "By place: the mean difference (pairs) at each place in the "
        "training plays that a subset was drawn from (`data.train_offset`, "
        "by seed), and the contrast blocked by place: the mean of the "
        "places' means with a 95% t-interval on the spread within places "
        "(n − 2 degrees of freedom; unadjusted). With two places, the "
        "intervals speak for these two draws of plays, not for plays in "
        "general.",
        report.markdown_table(
            [
                "vocabulary",
                "amount",
                "contrast",
                "n",
                "mean [95% t]",
                "p",
                "Holm p",
                "pooled 95%",
                "simultaneous 95%",
                "at cap",
                "best at first validation",
                "rate at edge",
                "by place",
            ],  # fmt: skip
            lines,
        ),
        f"Pooled standard deviations of the differences: {pooled}.",
        family_counts(family.contrasts),
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
    return (
        f"Without the {len(rows) - len(kept)} test runs never better than their "
        "initial parameters (named under the results by cell): "
        + counts.removeprefix("Corrected for the family: ")
    )


def secondary_section(rows: Rows) -> str:
    """:data:`SECONDARY` in every cell that has both arms, unadjusted."""
    contrasts = cells_lib.paired_contrasts(
        cells_lib.group_runs(rows, "test"), SECONDARY
    )
    text = [
        "## Secondary contrasts (exploratory)",
        "Unadjusted: each interval and p-value stands alone, with no "
        "correction for the number of comparisons; read them as leads, not "
        "findings. A cell without arm d has no d − a.",
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
        "`optim.table_lr_multiplier` m: the embedding table (and an untied "
        "head's kernel) train at lr · m. Unadjusted, like the secondary "
        "contrasts."
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
            f"{totals.runs} runs ({by_role}; {by_status}); "
            f"{totals.steps:,} training steps; "
            f"{totals.wall_seconds:,.0f} s = {totals.wall_seconds / 3600:.2f} h of "
            f"wall time, summed over the runs trained alone and the ensemble "
            f"programs ({totals.programs}), each program counted once. Each "
            "time is that of the process that finished the run: a resumed "
            "run's earlier processes, and runs lost with a machine and trained "
            "again, are not counted, so the total is a lower bound.",
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
        f"Written from `runs.csv` alone ({len(rows)} rows). Test bits per "
        "character unless a column says otherwise; differences are paired by "
        "seed within a cell (one vocabulary at one data amount), and x − y < 0 "
        "means x is better.",
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
