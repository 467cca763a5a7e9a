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
(``contrast_plots.py``); :func:`answer` is the short summary that
``make compare`` prints. The numbers come from ``cells.py``.

Every value is test bits per character, paired by seed within a cell,
unless a column says otherwise; a difference x - y < 0 means x is better.
"""

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmhead.lab import report, stats
from lmhead.studies.tying import cells as cells_lib
from lmhead.studies.tying import contrast_plots, table
from lmhead.studies.tying.cells import PRIMARY, SECONDARY, Contrast

DASH = report.DASH
ALPHA = 0.05
Rows = Sequence[Mapping[str, Any]]


def p_text(p: float) -> str:
    """A p-value with 4 decimals, ``<0.0001`` below that, a dash for NaN.

    Examples:
        >>> p_text(0.01234), p_text(3e-6), p_text(float("nan"))
        ('0.0123', '<0.0001', '—')
    """
    if math.isnan(p):
        return DASH
    return "<0.0001" if p < 1e-4 else f"{p:.4f}"


def _equal_spread_text(p: float) -> str:
    """The test of one spread in every cell, or nothing without one.

    Examples:
        >>> _equal_spread_text(3e-6), _equal_spread_text(float("nan"))
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


def _mean_text(values: Sequence[float], decimals: int = 4) -> str:
    mean, _, n = stats.mean_std(list(values))
    return DASH if n == 0 else f"{mean:,.{decimals}f}"


def _significant_text(values: Sequence[float]) -> str:
    """The mean to 3 significant digits.

    Examples:
        >>> _significant_text([0.0123, 0.0125]), _significant_text([4.48, 4.5])
        ('0.0124', '4.49')
    """
    mean, _, n = stats.mean_std(list(values))
    return DASH if n == 0 else f"{mean:.3g}"


def _geometric_mean_text(values: Sequence[float], decimals: int = 2) -> str:
    """Examples:
    >>> _geometric_mean_text([100.0, 400.0]), _geometric_mean_text([])
    ('200.00', '—')
    """
    values = list(values)
    if not values:
        return DASH
    mean = math.exp(sum(math.log(v) for v in values) / len(values))
    return f"{mean:,.{decimals}f}"


def _spread_text(values: Sequence[float], decimals: int = 4) -> str:
    """``mean ± std (n)``."""
    values = list(values)
    if not values:
        return DASH
    return f"{report.mean_std_text(values, decimals)} ({len(values)})"


def _places_text(
    places: dict[float, tuple[float, int]], blocked: tuple[float, float, float]
) -> str:
    """``"0: +0.0120 (4); 0.5: +0.0080 (4); blocked +0.0100 [..]"``, or a
    dash for one place."""
    if len(places) < 2:
        return DASH
    means = "; ".join(f"{o:g}: {m:+.4f} ({n})" for o, (m, n) in places.items())
    return f"{means}; blocked {blocked[0]:+.4f} {pair_text(*blocked[1:])}"


def _range_text(values: Sequence[float]) -> str:
    """``"from min to max"`` of the finite values (a cell's spread), or a dash."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return DASH
    return f"from {min(finite):.4f} to {max(finite):.4f}"


# --- The design, as the rows show it -----------------------------------------


def _untie_text(steps: dict[float, int]) -> str:
    """Arm e's untie step in each amount's cell.

    Examples:
        >>> _untie_text({0.003: 67, 1.0: 667}), _untie_text({})
        ('67 at 0.3%, 667 at 100%', '—')
    """
    return (
        ", ".join(
            f"{_int_text(step)} at {cells_lib.amount_label(amount)}"
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
        [
            "vocabulary",
            "tokens",
            "arm",
            "d_model",
            "layers",
            "MLP",
            "params",
            "FLOPs/token",
            "head share",
            "untie step",
        ],  # fmt: skip
        (
            [
                cells_lib.vocab_label(vocab),
                _int_text(row["vocab_size"]),
                f"{arm} ({cells_lib.ARM_NAMES.get(arm, arm)})",
                _int_text(row["d_model"]),
                _int_text(row["num_layers"]),
                _int_text(row["mlp_dim"]),
                _int_text(row["params"]),
                _int_text(row["flops_per_token"]),
                DASH if row["head_share"] is None else f"{row['head_share']:.1%}",
                _untie_text(untie.get((vocab, arm), {})),
            ]
            for (vocab, arm), row in shapes.items()
        ),
    )
    no_d = [
        cells_lib.vocab_label(v)
        for v in cells_lib.vocabularies(tested)
        if (v, "d") not in shapes
    ]
    lines = [
        "## Design",
        "Shapes of the test runs (head share: the [V, D] unembedding's share "
        "of the parameters; a tied table counts once). FLOPs per token are "
        "training FLOPs (`shapes.flops_per_token`).",
        arms,
        amounts_table(rows),
    ]
    if no_d:
        lines.append(
            f"No arm d at {', '.join(no_d)}: the design adds whole blocks only "
            "where the saved V·D pays for at least one."
        )
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
        return "No run has finished yet, so none has reached its step cap."
    counts, over = [], []
    for amount in cells_lib.amounts(finished):
        of = [r for r in finished if r["amount"] == amount]
        reached = sum(bool(r["reached_cap"]) for r in of)
        label = cells_lib.amount_label(amount)
        counts.append(f"{label} {reached} of {len(of)} ({reached / len(of):.0%})")
        if amount < 1.0 and reached > SUBSET_CAP_LIMIT * len(of):
            over.append(label)
    text = (
        "Runs that reached their step cap, by amount (finished runs of every "
        f"role): {', '.join(counts)}. At most {SUBSET_CAP_LIMIT:.0%} of a "
        "subset amount's runs may"
    )
    if len(over) == 1:
        text += f": {over[0]} is over that bound, so its numbers are partly "
    elif over:
        text += f": {', '.join(over)} are over that bound, so their numbers are partly "
    if over:
        text += "those of a fixed budget."
    else:
        text += ", and none is over it."
    if 1.0 in cells_lib.amounts(finished):
        text += " The whole split is budget-limited by design."
    return text


def _int_text(value: int | None) -> str:
    return DASH if value is None else f"{value:,}"


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
                *[_seeds_text(seeds[role]) for role in table.ROLES],
            ]
        )
    return report.markdown_table(
        [
            "amount",
            "offsets",
            "training chars (at offset)",
            "step cap",
            "tuning seeds",
            "test seeds",
            "ablation seeds",
        ],  # fmt: skip
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


def _seeds_text(seeds: Sequence[int]) -> str:
    if not seeds:
        return DASH
    if seeds == list(range(seeds[0], seeds[0] + len(seeds))) and len(seeds) > 2:
        return f"{seeds[0]}..{seeds[-1]}"
    return ", ".join(map(str, seeds))


def tuning_section(rows: Rows) -> str:
    """Each cell's chosen rate and the mean tuning validation loss per rate;
    without tuning runs, the one rate every cell trained at."""
    if not any(row["role"] == "tune" for row in rows):
        rates = sorted({row["lr"] for row in rows if row["lr"] is not None})
        return (
            "## Learning rates\n\nNo tuning stage: every run trained at "
            f"{', '.join(f'{lr:.3g}' for lr in rates) or DASH}, chosen before "
            "the runs, not on their results."
        )
    lines, tunings = [], cells_lib.tunings(rows)
    noise = cells_lib.selection_noise(tunings)
    for tuning in tunings:
        rates = ", ".join(
            ("**{}: {:.4f}**" if lr in tuning.chosen else "{}: {:.4f}").format(
                f"{lr:.3g}", loss
            )
            + ("" if n == len(tuning.seeds) else f" ({n} seeds)")
            for lr, (loss, n) in sorted(tuning.mean_loss.items())
        )
        chosen = ", ".join(f"{lr:.3g}" for lr in tuning.chosen) or DASH
        if not tuning.mean_loss:
            note = " (not tuned: arm a's)" if tuning.chosen else ""
        elif tuning.best in tuning.chosen or not tuning.chosen:
            note = ""
        else:
            note = " (≠ best)"
        if tuning.at_edge:
            note += " (edge of the rates tried)"
        lines.append(
            [
                cells_lib.vocab_label(tuning.vocab),
                cells_lib.amount_label(tuning.amount),
                tuning.arm,
                chosen + note,
                _seeds_text(list(tuning.seeds)),
                _margin_text(noise, tuning),
                rates or DASH,
            ]
        )
    return "\n\n".join(
        [
            "## Learning rates",
            "Mean validation loss (nats/token) of the tuning seeds at each rate "
            "tried; the test runs' rate in bold. The tuning seeds are never "
            "test seeds. A chosen rate at the edge of the rates tried may not "
            "be the arm's best: the contrasts of that cell can favour the "
            "other arm. Margin: the next best rate's validation bits/char "
            "minus the chosen one's, paired by tuning seed and averaged.",
            report.markdown_table(
                [
                    "vocabulary",
                    "amount",
                    "arm",
                    "chosen lr",
                    "tuning seeds",
                    "margin (next lr)",
                    "mean tuning val loss by rate",
                ],  # fmt: skip
                lines,
            ),
            selection_noise_text(noise),
        ]
    )


def _margin_text(noise: cells_lib.SelectionNoise, tuning: cells_lib.Tuning) -> str:
    found = noise.margins.get((tuning.vocab, tuning.amount, tuning.arm))
    if found is None:
        return DASH
    return f"{found.margin:+.4f} ({found.following:.3g})"


def selection_noise_text(noise: cells_lib.SelectionNoise) -> str:
    """The margins set against the seeds' noise: the spread pooled within
    each vocabulary, and the arms whose chosen rate is within one or two
    standard errors of the next."""
    if not noise.margins:
        return "No arm has a chosen rate with another rate tuned on the same seeds yet."
    seeds = min(len(found.seeds) for found in noise.margins.values())
    within = {
        bound: [
            f"{cells_lib.cell_label(key[:2])} {key[2]}"
            for key, found in noise.margins.items()
            if found.margin < bound * noise.standard_error(key[0], len(found.seeds))
        ]
        for bound in (1, 2)
    }
    spreads = "; ".join(
        f"{cells_lib.vocab_label(vocab)} {pooled.std:.4f} ({pooled.dof} degrees "
        f"of freedom; a margin's standard error {noise.standard_error(vocab, seeds):.4f})"
        for vocab, pooled in noise.pooled.items()
    )
    ties = (
        f": {'; '.join(within[1])}. The tuning cannot tell those arms' chosen "
        "rate from the next: either may be the better by up to about two "
        "standard errors, and a contrast of such an arm carries that much "
        "uncertainty from the choice of rate beyond its seeds' interval"
        if within[1]
        else ""
    )
    return (
        f"Selection noise: over the {len(noise.margins)} arms whose chosen rate "
        "was tuned, the standard deviation of the paired differences behind "
        "the margins, pooled over each vocabulary's arms (pooled, so it "
        f"assumes one spread for the arms of a vocabulary), and the standard "
        f"error of a margin over {seeds} seeds: {spreads}. "
        f"{len(within[2])} of the {len(noise.margins)} margins are below two "
        f"standard errors of their vocabulary and {len(within[1])} below "
        f"one{ties}. The validation windows' own noise in the margins is in "
        "`rate_noise.md` (`experiments/tying_rate_noise.py`)."
    )


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
                _spread_text(cells_lib.column(values, "test_bpc")),
                _mean_text(cells_lib.column(values, "val_bpc")),
                _mean_text(cells_lib.column(values, "gap_bpc")),
                _mean_text(cells_lib.column(values, "steps_to_best"), 0),
                f"{reached} of {len(values)}",
                _significant_text(cells_lib.column(values, "tokens_per_param")),
                _significant_text(
                    [
                        t
                        for t in map(cells_lib.trained_tokens_per_param, values)
                        if t is not None
                    ]
                ),
                _geometric_mean_text(cells_lib.column(values, "test_word_ppl")),
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
            _places_text(
                cells_lib.place_means(groups, c), cells_lib.blocked_by_place(groups, c)
            ),
        ]
        for c in family.contrasts
    ]
    pooled = "; ".join(
        f"{label}: {p.std:.4f} ({p.dof} degrees of freedom; the cells' own "
        f"{_range_text([c.difference.std for c in family.contrasts if c.label == label])}"
        f"{_equal_spread_text(p.equal_spread_p)})"
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


def family_counts(contrasts: Sequence[Contrast]) -> str:
    """``k of n cells`` per primary contrast, beside the Holm correction, and
    of those the budget-limited ones and, where rates were tuned, the ones
    whose worse arm's rate is at the edge of the rates tried."""
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
    return "Corrected for the family: " + "; ".join(parts) + "."


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
            _spread_text(cells_lib.column(runs.values(), "test_bpc")),
            _mean_text(cells_lib.column(runs.values(), "val_bpc")),
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


# --- The report and the answer ------------------------------------------------


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
        secondary_section(rows),
        ablation_section(rows),
        literature or "",
        totals_section(rows),
    ]
    text, _ = report.write_markdown(out_dir, [s.strip() for s in sections if s])
    return text, plot_paths


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
            lines.append([*prefix, name, _spread_text(values), "", ""])
        for c in family.contrasts:
            if (c.vocab, c.amount) == cell:
                difference = f"{c.difference.mean:+.4f} {pair_text(*c.simultaneous)}"
                lines.append(
                    [*prefix, c.label, difference, p_text(c.holm_p), meaning(c)]
                )
    header = ["cell"] * (len(cells) > 1) + [
        "arm or contrast",
        "test bits/char (n), or difference [simultaneous 95%]",
        "Holm p",
        "what it means",
    ]
    note = (
        f"Simultaneous: Bonferroni intervals over the family of "
        f"{family.size} primary contrasts (more conservative than "
        "Holm's p); lower bits/char is better."
    )
    return "\n\n".join(
        [answer_sentence(family.contrasts), report.markdown_table(header, lines), note]
    )


def meaning(contrast: Contrast) -> str:
    """What a primary contrast says at the family's corrected level (Holm p
    below :data:`ALPHA`); lower bits/char is better. Named beside it: runs
    at their step cap, and the arms whose rate at the edge of the rates
    tried could change the verdict (the worse arm of a difference found,
    either arm of one not found), since their best rate may lie beyond.

    Examples:
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
        counts = family_counts(contrasts).removeprefix("Corrected for the family: ")
        return (
            f"Over {len(cells)} cells, corrected for the family of primary "
            f"contrasts: {counts}"
        )
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
