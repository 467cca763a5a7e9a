"""The sweep report behind ``experiments/report.py``: a sweep file's own
report when it defines ``write_report`` (the tying study's), else the
generic tied-vs-untied one (:func:`write_report`: ``REPORT.md`` and three
plots, ``docs/sweeps.md``); and the pieces every report is made of
(:func:`mean_std_text`, :func:`interval_text`, :func:`markdown_table`,
:func:`panels`, :func:`write_markdown`).
"""

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt
import numpy as np

from lmhead.lab import stats, sweeps, workdirs
from lmhead.lm import configuration, data

DASH = "—"
REPORT_FILE = "REPORT.md"
# (key in the final metrics, column title, decimals)
METRICS = (
    ("loss", "val loss (nats/token)", 4),
    ("perplexity", "perplexity", 2),
    ("bits_per_char", "bits/char", 4),
    ("accuracy", "accuracy", 4),
    ("ece", "calibration error (ECE)", 4),
    ("tokens_per_sec", "tokens/s", 0),
)
# Overrides shown in their own columns; any other varying key goes to "other".
DESCRIBED_KEYS = ("model.tied", "data.tokenizer", "data.vocab_size", "model.d_model")


# --- What every report is made of -------------------------------------------------


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


def write_sweep_report(
    sweep_dir: str, out_dir: str | None = None, spec: str | None = None
) -> tuple[str, str, list[str]]:
    """Writes the report of ``sweep_dir``.

    The sweep file is ``spec`` (``path.py[:arg]``), else the one
    ``sweep.json`` names. One that defines ``write_report(arg, sweep_dir,
    out_dir)`` (a study's) writes its own report into ``out_dir`` (default:
    the sweep directory); any other sweep gets :func:`write_report`'s, in the
    sweep directory, beside the runs' logs that it links.

    Returns:
        ``(text, report path, plot paths)``: the text to print (the study's
        answer, the generic report's settings table).
    """
    spec = spec or workdirs.read_sweep_record(sweep_dir).get("sweep")
    if spec is not None:
        path, arg = sweeps.split_spec(spec)
        module = configuration.load_module(path)
        if hasattr(module, "write_report"):
            out_dir = out_dir or sweep_dir
            text, plots = module.write_report(arg, sweep_dir, out_dir)
            return text, os.path.join(out_dir, REPORT_FILE), plots
    return write_report(sweep_dir)


# --- The generic report: tied vs untied over seeds ---------------------------------


def vocab_size_of(run: workdirs.Run) -> int | None:
    """The tokenizer's vocabulary size: from the summary, the saved tokenizer, or the config."""
    if run.summary and "vocab_size" in run.summary:
        return run.summary["vocab_size"]
    path = os.path.join(run.workdir, data.TOKENIZER_FILE)
    if os.path.exists(path):
        return data.load_tokenizer(path).vocab_size
    return configuration.flatten(run.config).get("data.vocab_size")


def is_tied(run: workdirs.Run) -> bool:
    """The run's ``model.tied``: its override, else its config (default tied)."""
    if "model.tied" in run.overrides:
        return bool(run.overrides["model.tied"])
    return bool(configuration.flatten(run.config).get("model.tied", True))


def describe_setting(runs: list[workdirs.Run]) -> dict:
    """Head, vocabulary, width, parameters and other overrides of one setting."""
    overrides = runs[0].overrides
    configured = next((r for r in runs if r.config), runs[0])
    values = {**configuration.flatten(configured.config), **overrides}
    tokenizer = values.get("data.tokenizer", "char")
    vocab_size = (
        vocab_size_of(configured)
        if configured.config
        else values.get("data.vocab_size")
    )
    if tokenizer == "char":
        vocabulary = f"char ({vocab_size})" if vocab_size else "char"
    else:
        vocabulary = f"{tokenizer} {vocab_size or values.get('data.vocab_size')}"
    finished = [r for r in runs if r.status == "finished"]
    params = {workdirs.final_metrics(r).get("num_params") for r in finished} - {None}
    other = ", ".join(
        f"{k.rsplit('.', 1)[-1]}={v}"
        for k, v in overrides.items()
        if k not in DESCRIBED_KEYS and not workdirs.is_seed_key(k)
    )
    return dict(
        head="tied" if is_tied(configured) else "untied",
        vocabulary=vocabulary,
        vocab_size=vocab_size,
        d_model=values.get("model.d_model"),
        params=params.pop() if len(params) == 1 else None,
        other=other,
    )


def settings_table(groups: list[list[workdirs.Run]]) -> str:
    """The markdown table, one row per setting."""
    descriptions = [describe_setting(g) for g in groups]
    show_other = any(d["other"] for d in descriptions)
    header = [
        "head",
        "vocabulary",
        "d_model",
        *(["other"] if show_other else []),
        "parameters",
        *(title for _, title, _ in METRICS),
        "n",
        "not finished",
    ]
    rows = []
    for group, d in zip(groups, descriptions):
        finished = [workdirs.final_metrics(r) for r in group if r.status == "finished"]
        cells = [
            d["head"],
            d["vocabulary"],
            str(d["d_model"]),
            *([d["other"] or DASH] if show_other else []),
            f"{d['params']:,}" if d["params"] else DASH,
        ]
        for key, _, decimals in METRICS:
            values = [m[key] for m in finished if key in m]
            cells.append(mean_std_text(values, decimals, thousands=True))
        cells += [str(len(finished)), str(len(group) - len(finished))]
        rows.append(cells)
    return markdown_table(header, rows)


def compared_settings(runs: list[workdirs.Run]) -> list[tuple[dict, list, list]]:
    """``(description, tied runs, untied runs)`` per setting other than the head."""
    compared = []
    for group in workdirs.group_runs(runs, drop=["model.tied"]):
        tied = [r for r in group if is_tied(r)]
        untied = [r for r in group if not is_tied(r)]
        if tied and untied:
            compared.append((describe_setting(group), tied, untied))
    return compared


def paired_by_seed(
    x: list[workdirs.Run], y: list[workdirs.Run], key: str
) -> stats.PairedDifference:
    """``x - y`` of the final metric ``key`` of the finished runs that have
    it, paired by :func:`workdirs.seed_of`."""

    def by_seed(runs):
        finished = [r for r in runs if r.status == "finished"]
        finals = {workdirs.seed_of(r): workdirs.final_metrics(r) for r in finished}
        return {seed: m[key] for seed, m in finals.items() if m.get(key) is not None}

    return stats.paired_difference(by_seed(x), by_seed(y))


def verdict(difference: stats.PairedDifference, label: str) -> str:
    """A plain sentence on whether untied - tied differs from zero."""
    if difference.n < 2:
        return (
            f"{label}: {difference.n} seed pair(s) finished; an interval needs "
            "at least 2."
        )
    interval = (
        f"untied - tied = {difference.mean:+.4f} nats/token, 95% interval "
        f"[{difference.low:+.4f}, {difference.high:+.4f}] over "
        f"{difference.n} seed pairs"
    )
    if not difference.excludes_zero:
        return f"{label}: {interval}; not distinguishable from zero."
    better = "tied" if difference.mean > 0 else "untied"
    return (
        f"{label}: {interval}; the interval excludes zero: the {better} head "
        "reaches the lower validation loss."
    )


def differences_section(runs: list[workdirs.Run]) -> str:
    """The untied - tied table and sentences, per vocabulary (and width)."""
    header = [
        "vocabulary",
        "d_model",
        "untied - tied, val loss (nats/token)",
        "95% interval, val loss",
        "untied - tied, bits/char",
        "95% interval, bits/char",
        "seed pairs",
    ]
    rows, sentences = [], []
    for d, tied, untied in compared_settings(runs):
        label = f"{d['vocabulary']}, d_model {d['d_model']}" + (
            f", {d['other']}" if d["other"] else ""
        )
        cells = [
            d["vocabulary"] + (f" ({d['other']})" if d["other"] else ""),
            str(d["d_model"]),
        ]
        loss, bits = (
            paired_by_seed(untied, tied, key) for key in ("loss", "bits_per_char")
        )
        for diff in (loss, bits):
            cells.append(
                f"{diff.mean:+.4f} ± {diff.std:.4f}"
                if diff.n >= 2
                else (f"{diff.mean:+.4f}" if diff.n else DASH)
            )
            cells.append(
                f"[{diff.low:+.4f}, {diff.high:+.4f}]" if diff.n >= 2 else DASH
            )
        rows.append(cells + [str(loss.n)])
        sentences.append("- " + verdict(loss, label))
    if not sentences:
        return "No setting has both tied and untied runs to compare."
    return "\n".join([markdown_table(header, rows), ""] + sentences)


def not_finished_section(runs: list[workdirs.Run]) -> str:
    """The runs left out of the means, with their status, exit code, last
    evaluation and log."""
    missing = [r for r in runs if r.status != "finished"]
    if not missing:
        return "Every run finished."
    lines = [f"{len(missing)} of {len(runs)} runs are not in the means above:"]
    for run in missing:
        exit_code = (
            f", exit code {run.returncode}" if run.returncode is not None else ""
        )
        evals = workdirs.curve(run)[0]
        reached = f", last evaluation at step {evals[-1]}" if evals else ""
        log = os.path.join(run.name, workdirs.LOG_FILE)  # beside REPORT.md
        exists = os.path.exists(os.path.join(run.workdir, workdirs.LOG_FILE))
        log_note = f", log `{log}`" if exists else ""
        lines.append(f"- `{run.name}`: {run.status}{exit_code}{reached}{log_note}")
    return "\n".join(lines)


def mean_curve(runs: list[workdirs.Run]):
    """Validation loss over seeds at the steps every curve has: steps, mean, std, n.

    The finished runs' curves, as in the table; an unfinished run's shorter
    curve would cut the others short (its curve is used only if none finished).
    """
    finished = [r for r in runs if r.status == "finished"]
    curves = [dict(zip(*workdirs.curve(r))) for r in finished or runs]
    curves = [c for c in curves if c]
    if not curves:
        return [], [], [], 0
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    summaries = [stats.mean_std([c[s] for c in curves]) for s in steps]
    return (
        steps,
        [m for m, _, _ in summaries],
        [0.0 if n < 2 else sd for _, sd, n in summaries],
        len(curves),
    )


def plot_loss_curves(runs: list[workdirs.Run], path: str) -> None:
    """``loss_curves.png``: validation loss, tied vs untied, mean and ±1 std
    over seeds, a panel per compared setting."""
    compared = compared_settings(runs)
    title = "Validation loss: mean over seeds, band ±1 std"
    with panels(path, max(len(compared), 1), (5, 4), title) as axes:
        for axis, (d, tied, untied) in zip(axes, compared):
            for head, head_runs in (("tied", tied), ("untied", untied)):
                steps, mean, std, n = mean_curve(head_runs)
                mean, std = np.asarray(mean), np.asarray(std)
                axis.plot(steps, mean, label=f"{head} (n={n})")
                axis.fill_between(steps, mean - std, mean + std, alpha=0.25)
            axis.set(
                title=f"{d['vocabulary']}, d_model {d['d_model']} {d['other']}",
                xlabel="step",
                ylabel="validation loss (nats/token)",
            )
            axis.legend()


def plot_finals(
    groups: list[list[workdirs.Run]], x_key: str, x_label: str, path: str
) -> None:
    """Final loss and bits/char against ``x_key`` of :func:`describe_setting`,
    per head and width.

    Against the vocabulary size the points of a series are joined by lines;
    against the parameter count they stand alone, labelled by vocabulary.
    """
    series = {}
    for group in groups:
        d = describe_setting(group)
        finals = [workdirs.final_metrics(r) for r in group if r.status == "finished"]
        if finals and d[x_key]:
            label = f"{d['head']}, d_model {d['d_model']} {d['other']}".strip()
            series.setdefault(label, []).append((d[x_key], finals, d["vocabulary"]))
    title = "Final validation loss: mean over seeds, bars ±1 std"
    with panels(path, 2, (5.5, 4), title) as axes:
        for axis, (key, metric_title, _) in zip(axes, (METRICS[0], METRICS[2])):
            for label, points in series.items():
                points.sort(key=lambda p: p[0])
                summaries = [
                    stats.mean_std([f[key] for f in finals if key in f])
                    for _, finals, _ in points
                ]
                xs, means = [x for x, _, _ in points], [m for m, _, _ in summaries]
                axis.errorbar(
                    xs,
                    means,
                    yerr=[0.0 if n < 2 else s for _, s, n in summaries],
                    marker="o",
                    capsize=3,
                    label=label,
                    linestyle="-" if x_key == "vocab_size" else "none",
                )
                if x_key != "vocab_size":
                    for x, mean, (_, _, vocabulary) in zip(xs, means, points):
                        axis.annotate(
                            vocabulary,
                            (x, mean),
                            textcoords="offset points",
                            xytext=(5, 5),
                            fontsize=8,
                        )
            axis.set(xscale="log", xlabel=x_label, ylabel=f"final {metric_title}")
            axis.legend()


def command_lines(sweep_dir: str) -> list[str]:
    """The command that made the runs and the machine, from ``sweep.json``."""
    sweep = workdirs.read_sweep_record(sweep_dir)
    return [
        f"Command: `{sweep['command']}`"
        if "command" in sweep
        else "Runs found in the directory (no sweep.json).",
        *([f"Machine: {sweep['machine']}"] if "machine" in sweep else []),
    ]


def write_report(sweep_dir: str) -> tuple[str, str, list[str]]:
    """Writes the generic REPORT.md and plots into ``sweep_dir``; returns
    (the settings table, the report's path, the plots' paths)."""
    runs = workdirs.read_sweep(sweep_dir)
    if not runs:
        raise FileNotFoundError(
            f"No runs in {sweep_dir}: no sweep.json and no "
            "subdirectory with a config.json."
        )
    groups = workdirs.group_runs(runs)
    plots = [
        os.path.join(sweep_dir, name)
        for name in ("loss_curves.png", "loss_vs_vocab.png", "loss_vs_params.png")
    ]
    plot_loss_curves(runs, plots[0])
    plot_finals(groups, "vocab_size", "vocabulary size", plots[1])
    plot_finals(groups, "params", "parameters", plots[2])
    table = settings_table(groups)
    seconds, written = workdirs.wall_seconds(runs), time.strftime("%Y-%m-%d %H:%M")
    costs = [
        f"{len(runs)} runs; the finished ones took {seconds / 60:.1f} min in "
        "all (their wall_seconds, an ensemble program's counted once)."
    ]
    _, report_path = write_markdown(
        sweep_dir,
        [
            f"# Tied vs untied head: {os.path.basename(os.path.abspath(sweep_dir))}",
            "  \n".join(  # two spaces break a markdown line
                [*command_lines(sweep_dir), *costs, f"Report written {written}."]
            ),
            "Final validation metrics: mean ± sample standard deviation (n - 1) over "
            "seeds; n = finished runs. Loss is per token, so compare vocabularies by "
            "bits per character.",
            table,
            "## Untied - tied, paired by seed",
            differences_section(runs),
            "The interval is mean ± t(0.975, n - 1) · s / √n over the per-seed "
            "differences (Student's t quantile from scipy.stats).",
            "## Runs not finished",
            not_finished_section(runs),
            "## Plots",
            *(f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots),
        ],
    )
    return table, report_path, plots
