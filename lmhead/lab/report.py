"""The sweep report behind ``experiments/report.py``: the sweep file's own,
written by its ``write_report`` (the tying study's, the filter study's;
``docs/sweeps.md``), and the pieces every report is made of
(:func:`mean_std_text`, :func:`interval_text`, :func:`markdown_table`,
:func:`panels`, :func:`write_markdown`).
"""

import contextlib
import csv
import os
from collections.abc import Iterable, Iterator, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt

from lmhead.lab import stats, sweeps, workdirs
from lmhead.lm import configuration

DASH = "—"
REPORT_FILE = "REPORT.md"
RUNS_CSV = "runs.csv"


def mean_std_text(
    values: Iterable[float], decimals: int = 4, *, thousands: bool = False
) -> str:
    """``"mean ± std"`` (the sample std, over seeds); one value alone; a dash
    for none. ``thousands``: with thousands separators.

    Examples:
        >>> mean_std_text([1.0, 2.0, 3.0]), mean_std_text([2.5], 1), mean_std_text([])
        ('2.0000 ± 1.0000', '2.5', '—')
        >>> mean_std_text([15000.0, 17000.0], 0, thousands=True)
        '16,000 ± 1,414'
    """
    mean, std, n = stats.mean_std(list(values))
    if n == 0:
        return DASH
    spec = f"{',' if thousands else ''}.{decimals}f"
    return f"{mean:{spec}}" if n == 1 else f"{mean:{spec}} ± {std:{spec}}"


def interval_text(difference: stats.PairedDifference) -> str:
    """``"+mean [low, high]"`` of a paired difference and its 95% interval;
    the mean alone for one pair, a dash for none.

    Examples:
        >>> interval_text(stats.paired_difference({0: 2.0, 1: 3.0, 2: 4.0},
        ...                                       {0: 1.0, 1: 1.0, 2: 1.0}))
        '+2.0000 [-0.4841, +4.4841]'
    """
    if difference.n == 0:
        return DASH
    if difference.n == 1:
        return f"{difference.mean:+.4f}"
    return f"{difference.mean:+.4f} [{difference.low:+.4f}, {difference.high:+.4f}]"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table of ``header`` and the ``rows`` of cells.

    Examples:
        >>> print(markdown_table(["head", "n"], [["tied", "3"], ["untied", "2"]]))
        | head | n |
        |---|---|
        | tied | 3 |
        | untied | 2 |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


@contextlib.contextmanager
def panels(
    path: str,
    count: int,
    size: tuple[float, float],
    title: str | None = None,
    columns: int | None = None,
) -> Iterator[list]:
    """A figure of ``count`` axes, each ``size`` inches (width, height), in
    rows of ``columns`` (default: all side by side), saved to ``path`` (PNG,
    120 dpi) when the block ends; a last row's empty places are left blank."""
    columns = columns or count
    rows = -(-count // columns)
    figure, axes = plt.subplots(
        rows, columns, squeeze=False, figsize=(size[0] * columns, size[1] * rows)
    )
    try:
        flat = [axis for row in axes for axis in row]
        for blank in flat[count:]:
            blank.set_visible(False)
        yield flat[:count]
        if title:
            figure.suptitle(title)
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)


def write_markdown(out_dir: str, sections: Sequence[str]) -> tuple[str, str]:
    """Writes ``sections``, a blank line apart, to ``out_dir/REPORT.md``;
    returns the text and the path."""
    text = "\n\n".join(sections) + "\n"
    path = os.path.join(out_dir, REPORT_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text, path


def write_runs_report(
    out_dir: str, columns: Sequence[str], rows: Sequence[dict], text: str
) -> str:
    """Writes ``rows`` (dicts keyed by ``columns``) to ``out_dir/runs.csv``
    and ``text`` to ``out_dir/REPORT.md``, the report a sweep file writes
    from its runs' table alone; returns the text as written."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, RUNS_CSV), "w", newline="") as f:
        writer = csv.DictWriter(f, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return write_markdown(out_dir, [text.rstrip("\n")])[0]


def write_sweep_report(
    sweep_dir: str, out_dir: str | None = None, spec: str | None = None
) -> tuple[str, str, list[str]]:
    """Writes the report of ``sweep_dir``: the sweep file's
    ``write_report(arg, sweep_dir, out_dir)``, into ``out_dir`` (default: the
    sweep directory).

    The sweep file is ``spec`` (``path.py[:arg]``), else the one
    ``sweep.json`` names.

    Returns:
        ``(text, report path, plot paths)``: the text to print (a study's
        answer).

    Raises:
        ValueError: no sweep file is named, or it defines no ``write_report``.
    """
    spec = spec or workdirs.read_sweep_record(sweep_dir).get("sweep")
    if spec is None:
        raise ValueError(
            f"{sweep_dir} has no sweep.json naming its sweep file: give --sweep."
        )
    if not sweeps.has_report(spec):
        raise ValueError(
            f"{sweeps.split_spec(spec)[0]} defines no write_report(arg, "
            "sweep_dir, out_dir), so its sweep has no report; its runs read back "
            'with lmhead.lab.workdirs.read_sweep (docs/sweeps.md, "Reports").'
        )
    path, arg = sweeps.split_spec(spec)
    out_dir = out_dir or sweep_dir
    text, plots = configuration.load_module(path).write_report(arg, sweep_dir, out_dir)
    return text, os.path.join(out_dir, REPORT_FILE), plots
