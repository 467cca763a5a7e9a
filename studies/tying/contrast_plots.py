"""The report's plots of the primary contrasts (``cells.primary_family``):
each contrast with its 95% t-interval against the data amount, one line per
vocabulary (:data:`AMOUNT_PLOT`), and against the tied model's head share,
one line per data amount (:data:`HEAD_SHARE_PLOT`). A contrast with runs at
their step cap (budget-limited, not early-stopped) is a hollow marker that
no line joins to the others; one with an arm whose rate is at an edge of
the rates its tuning tried (``Contrast.edge``) is framed by a square. Every
contrast is at the rates of the table's own tuning, which the title says, so
that a cell tuned again elsewhere is not read from this figure."""

import math
import os
from collections.abc import Callable

import matplotlib.ticker

from lmhead.lab import report
from studies.tying import cells as cells_lib

AMOUNT_PLOT = "contrast_vs_amount.png"
HEAD_SHARE_PLOT = "contrast_vs_head_share.png"
_TITLE = (
    "Primary contrasts at the rates this table's tuning chose, mean over "
    "seeds; bars: 95% t-interval\nhollow: runs at their step cap; square: an "
    "arm's rate at an edge of the rates tried (its best may lie beyond)"
)
_Y_LABEL = "Δ test bits/char (paired by seed)"


def plot_contrasts(family: cells_lib.Family, out_dir: str) -> list[str]:
    """Writes both plots into ``out_dir``; returns their paths."""
    paths = [os.path.join(out_dir, AMOUNT_PLOT), os.path.join(out_dir, HEAD_SHARE_PLOT)]
    _plot(
        family,
        paths[0],
        line_of=lambda c: c.vocab,
        x_of=lambda c: c.amount,
        lines=cells_lib.vocabularies([{"vocab": c.vocab} for c in family.contrasts]),
        line_label=cells_lib.vocab_label,
        x_label="data amount (share of the training split)",
        tick_label=cells_lib.amount_label,
    )
    vocab_of = {share: vocab for vocab, share in family.head_shares.items()}
    _plot(
        family,
        paths[1],
        line_of=lambda c: c.amount,
        x_of=lambda c: family.head_shares.get(c.vocab, math.nan),
        lines=sorted({c.amount for c in family.contrasts}),
        line_label=cells_lib.amount_label,
        x_label="head share of the tied model's parameters (its vocabulary)",
        tick_label=lambda x: f"{x:.1%}\n{cells_lib.vocab_label(vocab_of[x])}",
    )
    return paths


def _plot(
    family: cells_lib.Family,
    path: str,
    *,
    line_of: Callable,
    x_of: Callable,
    lines: list,
    line_label: Callable,
    x_label: str,
    tick_label: Callable,
) -> None:
    labels = list(dict.fromkeys(f"{x} − {y}" for x, y in cells_lib.PRIMARY))
    ticks = sorted({x_of(c) for c in family.contrasts if not math.isnan(x_of(c))})
    with report.panels(path, len(labels), (6, 4.2), _TITLE) as axes:
        for axis, label in zip(axes, labels):
            for index, line in enumerate(lines):
                points = sorted(
                    (x_of(c), c.difference, bool(c.capped), bool(c.edge))
                    for c in family.contrasts
                    if c.label == label and line_of(c) == line and c.difference.n
                    and not math.isnan(x_of(c))
                )  # fmt: skip
                # Lines side by side, so that their bars do not overlap.
                shift = 1.0 + 0.03 * (index - (len(lines) - 1) / 2)
                color = None
                for capped in (False, True):
                    these = [(x, d) for x, d, at_cap, _ in points if at_cap == capped]
                    if not these:
                        continue
                    drawn = axis.errorbar(
                        [x * shift for x, _ in these],
                        [d.mean for _, d in these],
                        yerr=[
                            [0.0 if d.n < 2 else d.mean - d.low for _, d in these],
                            [0.0 if d.n < 2 else d.high - d.mean for _, d in these],
                        ],
                        marker="o",
                        capsize=3,
                        color=color,
                        linestyle="none" if capped else "-",
                        markerfacecolor="none" if capped else None,
                        label=None if color else line_label(line),
                    )
                    color = drawn.lines[0].get_color()
                edges = [(x, d) for x, d, _, at_edge in points if at_edge]
                if edges:
                    axis.scatter(
                        [x * shift for x, _ in edges],
                        [d.mean for _, d in edges],
                        marker="s",
                        s=120,
                        facecolors="none",
                        edgecolors=color,
                    )
            axis.axhline(0.0, color="gray", linewidth=0.8)
            axis.set(xscale="log", title=label, xlabel=x_label, ylabel=_Y_LABEL)
            # One tick per measured x, instead of log-scale decades.
            axis.set_xticks(ticks, [tick_label(x) for x in ticks])
            axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            if axis.get_legend_handles_labels()[0]:
                axis.legend()
