"""The tying study's report: its section "Learning rates", each cell's
chosen rate and the mean tuning validation loss per rate, and the margins
of the choices set against the tuning seeds' noise."""

from collections.abc import Mapping, Sequence
from typing import Any

from lmhead.lab import report
from studies.tying import cells as cells_lib
from studies.tying.report_text import DASH, column_names, prose, seeds_text

Rows = Sequence[Mapping[str, Any]]


def tuning_section(rows: Rows) -> str:
    """Each cell's chosen rate and the mean tuning validation loss per rate;
    without tuning runs, the one rate every cell trained at."""
    if not any(row["role"] == "tune" for row in rows):
        rates = sorted({row["lr"] for row in rows if row["lr"] is not None})
        rates = ", ".join(f"{lr:.3g}" for lr in rates) or DASH
        return f"## Learning rates\n\n{prose('tuning_untuned', rates=rates)}"
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
                seeds_text(list(tuning.seeds)),
                _margin_text(noise, tuning),
                rates or DASH,
            ]
        )
    return "\n\n".join(
        [
            "## Learning rates",
            prose("tuning"),
            report.markdown_table(column_names("tuning_columns"), lines),
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
        return prose("selection_none")
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
    ties = prose("selection_ties", arms="; ".join(within[1])) if within[1] else ""
    return prose(
        "selection_noise",
        arms=len(noise.margins),
        seeds=seeds,
        spreads=spreads,
        two=len(within[2]),
        one=len(within[1]),
        ties=ties,
    )
