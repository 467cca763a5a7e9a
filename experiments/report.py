r"""Writes a sweep's REPORT.md and plots: tied vs untied, over seeds.

    python experiments/report.py --workdir=runs/tying_study --out=docs/tying_study

A sweep whose file defines ``get_study`` (``configs/sweeps/tying_study.py``)
gets the study's report (``lmhead/studies/tying/report.py``) in ``--out``; the sweep
file is the one ``sweep.json`` names, or ``--sweep`` for runs launched from
``--dry_run`` commands. Any other sweep gets the report below, in the sweep
directory.

Reads every run's ``config.json``, ``metrics.jsonl`` and ``summary.json``
(see :func:`lmhead.lab.sweeps.read_sweep`) and writes into the sweep directory:

* ``REPORT.md``: one table row per setting (head, vocabulary, width) with
  each final validation metric as mean ± sample std over seeds and n; the
  paired difference untied - tied with a 95% t-interval per vocabulary, and
  a sentence on whether it is distinguishable from zero; the runs that did not
  finish, with their status, instead of dropping them.
* ``loss_curves.png``: validation loss against step, tied vs untied, mean
  and a ±1 std band over seeds, one panel per vocabulary.
* ``loss_vs_vocab.png`` and ``loss_vs_params.png``: final validation loss
  (nats per token, and bits per character, the one comparable across
  tokenizers) against vocabulary size and against parameter count.

Prints the table and the paths at the end.
"""

import os
import time

import matplotlib
from absl import app, flags

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt

from lmhead.lab import stats as stats_lib
from lmhead.lab import sweeps
from lmhead.lm import configuration, data
from lmhead.studies.tying import report as study_report

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
DASH = "—"

_WORKDIR = flags.DEFINE_string("workdir", None, "Sweep directory.", required=True)
_SWEEP = flags.DEFINE_string(
    "sweep",
    None,
    "Sweep file and argument (path.py[:arg]); default: the one in "
    "the sweep directory's sweep.json.",
)
_OUT = flags.DEFINE_string(
    "out", None, "Where a study's report goes; default: the sweep directory."
)


def vocab_size_of(run: sweeps.Run) -> int | None:
    """The tokenizer's vocabulary size: from the summary, the saved tokenizer, or the config."""
    if run.summary and "vocab_size" in run.summary:
        return run.summary["vocab_size"]
    path = os.path.join(run.workdir, data.TOKENIZER_FILE)
    if os.path.exists(path):
        return data.load_tokenizer(path).vocab_size
    return sweeps.flatten(run.config).get("data.vocab_size")


def is_tied(run: sweeps.Run) -> bool:
    """The run's ``model.tied``: its override, else its config (default tied)."""
    if "model.tied" in run.overrides:
        return bool(run.overrides["model.tied"])
    return bool(sweeps.flatten(run.config).get("model.tied", True))


def describe(runs: list[sweeps.Run]) -> dict:
    """Head, vocabulary, width, parameters and other overrides of one setting."""
    overrides = runs[0].overrides
    configured = next((r for r in runs if r.config), runs[0])
    values = {**sweeps.flatten(configured.config), **overrides}
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
    params = {sweeps.final_metrics(r).get("num_params") for r in finished} - {None}
    other = ", ".join(
        f"{k.rsplit('.', 1)[-1]}={v}"
        for k, v in overrides.items()
        if k not in DESCRIBED_KEYS and not sweeps.is_seed_key(k)
    )
    return dict(
        head="tied" if is_tied(configured) else "untied",
        vocabulary=vocabulary,
        vocab_size=vocab_size,
        d_model=values.get("model.d_model"),
        params=params.pop() if len(params) == 1 else None,
        other=other,
    )


def format_mean_std(values: list[float], decimals: int) -> str:
    """``"mean ± std"``; one value alone; a dash for none."""
    mean, std, n = stats_lib.mean_std(values)
    if n == 0:
        return DASH
    if n == 1:
        return f"{mean:,.{decimals}f}"
    return f"{mean:,.{decimals}f} ± {std:,.{decimals}f}"


def settings_table(groups: list[list[sweeps.Run]]) -> str:
    """The markdown table, one row per setting."""
    descriptions = [describe(g) for g in groups]
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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group, d in zip(groups, descriptions):
        finished = [sweeps.final_metrics(r) for r in group if r.status == "finished"]
        cells = [
            d["head"],
            d["vocabulary"],
            str(d["d_model"]),
            *([d["other"] or DASH] if show_other else []),
            f"{d['params']:,}" if d["params"] else DASH,
        ]
        for key, _, decimals in METRICS:
            cells.append(
                format_mean_std([m[key] for m in finished if key in m], decimals)
            )
        cells += [str(len(finished)), str(len(group) - len(finished))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compared_settings(runs: list[sweeps.Run]) -> list[tuple[dict, list, list]]:
    """``(description, tied runs, untied runs)`` per setting other than the head."""
    compared = []
    for group in sweeps.group_runs(runs, drop=["model.tied"]):
        tied = [r for r in group if is_tied(r)]
        untied = [r for r in group if not is_tied(r)]
        if tied and untied:
            compared.append((describe(group), tied, untied))
    return compared


def by_seed(runs: list[sweeps.Run], key: str) -> dict:
    return {
        sweeps.seed_of(r): sweeps.final_metrics(r)[key]
        for r in runs
        if r.status == "finished" and key in sweeps.final_metrics(r)
    }


def verdict(difference: stats_lib.PairedDifference, label: str) -> str:
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


def differences_section(runs: list[sweeps.Run]) -> str:
    """The untied - tied table and sentences, per vocabulary (and width)."""
    lines = [
        "| vocabulary | d_model | untied - tied, val loss (nats/token) | 95% interval,"
        " val loss | untied - tied, bits/char | 95% interval, bits/char | seed pairs |",
        "|---|---|---|---|---|---|---|",
    ]
    sentences = []
    for d, tied, untied in compared_settings(runs):
        label = f"{d['vocabulary']}, d_model {d['d_model']}" + (
            f", {d['other']}" if d["other"] else ""
        )
        cells = [
            d["vocabulary"] + (f" ({d['other']})" if d["other"] else ""),
            str(d["d_model"]),
        ]
        loss, bits = (
            stats_lib.paired_difference(by_seed(untied, key), by_seed(tied, key))
            for key in ("loss", "bits_per_char")
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
        lines.append("| " + " | ".join(cells + [str(loss.n)]) + " |")
        sentences.append("- " + verdict(loss, label))
    if not sentences:
        return "No setting has both tied and untied runs to compare."
    return "\n".join(lines + [""] + sentences)


def not_finished_section(runs: list[sweeps.Run]) -> str:
    missing = [r for r in runs if r.status != "finished"]
    if not missing:
        return "Every run finished."
    lines = [f"{len(missing)} of {len(runs)} runs are not in the means above:"]
    for run in missing:
        exit_code = (
            f", exit code {run.returncode}" if run.returncode is not None else ""
        )
        evals = sweeps.eval_curve(run)[0]
        reached = f", last evaluation at step {evals[-1]}" if evals else ""
        log = os.path.join(run.name, sweeps.LOG_FILE)  # beside REPORT.md
        exists = os.path.exists(os.path.join(run.workdir, sweeps.LOG_FILE))
        log_note = f", log `{log}`" if exists else ""
        lines.append(f"- `{run.name}`: {run.status}{exit_code}{reached}{log_note}")
    return "\n".join(lines)


def mean_curve(runs: list[sweeps.Run]):
    """Validation loss over seeds at the steps every curve has: steps, mean, std, n.

    The finished runs' curves, as in the table; an unfinished run's shorter
    curve would cut the others short (its curve is used only if none finished).
    """
    finished = [r for r in runs if r.status == "finished"]
    curves = [dict(zip(*sweeps.eval_curve(r))) for r in finished or runs]
    curves = [c for c in curves if c]
    if not curves:
        return [], [], [], 0
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    stats = [stats_lib.mean_std([c[s] for c in curves]) for s in steps]
    return (
        steps,
        [m for m, _, _ in stats],
        [0.0 if n < 2 else sd for _, sd, n in stats],
        len(curves),
    )


def plot_curves(runs: list[sweeps.Run], path: str) -> None:
    compared = compared_settings(runs)
    figure, axes = plt.subplots(
        1, max(len(compared), 1), squeeze=False, figsize=(5 * max(len(compared), 1), 4)
    )
    for axis, (d, tied, untied) in zip(axes[0], compared):
        for head, head_runs in (("tied", tied), ("untied", untied)):
            steps, mean, std, n = mean_curve(head_runs)
            axis.plot(steps, mean, label=f"{head} (n={n})")
            axis.fill_between(
                steps,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                alpha=0.25,
            )
        axis.set(
            title=f"{d['vocabulary']}, d_model {d['d_model']} {d['other']}",
            xlabel="step",
            ylabel="validation loss (nats/token)",
        )
        axis.legend()
    figure.suptitle("Validation loss: mean over seeds, band ±1 std")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_finals(
    groups: list[list[sweeps.Run]], x_key: str, x_label: str, path: str
) -> None:
    """Final loss and bits/char against ``x_key`` of ``describe``, per head and width.

    Against the vocabulary size the points of a series are joined by lines;
    against the parameter count they stand alone, labelled by vocabulary.
    """
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    series = {}
    for group in groups:
        d = describe(group)
        finals = [sweeps.final_metrics(r) for r in group if r.status == "finished"]
        if finals and d[x_key]:
            label = f"{d['head']}, d_model {d['d_model']} {d['other']}".strip()
            series.setdefault(label, []).append((d[x_key], finals, d["vocabulary"]))
    for axis, (key, title, _) in zip(axes, (METRICS[0], METRICS[2])):
        for label, points in series.items():
            points.sort(key=lambda p: p[0])
            stats = [
                stats_lib.mean_std([f[key] for f in finals if key in f])
                for _, finals, _ in points
            ]
            xs, means = [x for x, _, _ in points], [m for m, _, _ in stats]
            axis.errorbar(
                xs,
                means,
                yerr=[0.0 if n < 2 else s for _, s, n in stats],
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
        axis.set(xscale="log", xlabel=x_label, ylabel=f"final {title}")
        axis.legend()
    figure.suptitle("Final validation loss: mean over seeds, bars ±1 std")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def provenance(sweep_dir: str, runs: list[sweeps.Run]) -> str:
    """Which command made the runs, where, and how long they trained."""
    sweep = sweeps.read_sweep_record(sweep_dir)
    seconds = sum((r.summary or {}).get("wall_seconds", 0.0) for r in runs)
    lines = [
        f"Command: `{sweep['command']}`"
        if "command" in sweep
        else "Runs found in the directory (no sweep.json).",
        *([f"Machine: {sweep['machine']}"] if "machine" in sweep else []),
        f"{len(runs)} runs; the finished ones took {seconds / 60:.1f} min in "
        f"all (their wall_seconds). Report written "
        f"{time.strftime('%Y-%m-%d %H:%M')}.",
    ]
    return "  \n".join(lines)


def write_report(sweep_dir: str) -> tuple[str, str, list[str]]:
    """Writes REPORT.md and the plots; returns (table, report path, plot paths)."""
    runs = sweeps.read_sweep(sweep_dir)
    if not runs:
        raise FileNotFoundError(
            f"No runs in {sweep_dir}: no sweep.json and no "
            "subdirectory with a config.json."
        )
    groups = sweeps.group_runs(runs)
    plots = [
        os.path.join(sweep_dir, name)
        for name in ("loss_curves.png", "loss_vs_vocab.png", "loss_vs_params.png")
    ]
    plot_curves(runs, plots[0])
    plot_finals(groups, "vocab_size", "vocabulary size", plots[1])
    plot_finals(groups, "params", "parameters", plots[2])
    table = settings_table(groups)
    report = "\n\n".join(
        [
            f"# Tied vs untied head: {os.path.basename(os.path.abspath(sweep_dir))}",
            provenance(sweep_dir, runs),
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
        ]
    )
    report_path = os.path.join(sweep_dir, "REPORT.md")
    with open(report_path, "w", encoding="utf-8") as f:
        f.write(report + "\n")
    return table, report_path, plots


def study_design(sweep_dir: str, spec: str | None):
    """The sweep file's ``get_study(arg)``, or ``None`` for an ordinary sweep."""
    if spec is None:
        spec = sweeps.read_sweep_record(sweep_dir).get("sweep")
    if spec is None:
        return None
    file, arg = sweeps.split_spec(spec)
    module = configuration.load_module(file)
    return module.get_study(arg) if hasattr(module, "get_study") else None


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    design = study_design(_WORKDIR.value, _SWEEP.value)
    if design is not None:
        out = _OUT.value or _WORKDIR.value
        text, plots = study_report.write_report(design, _WORKDIR.value, out)
        print(text)
        print(f"Report: {os.path.join(out, 'REPORT.md')}")
        for path in plots:
            print(f"Plot:   {path}")
        return
    table, report_path, plots = write_report(_WORKDIR.value)
    print(table)
    print(f"\nReport: {report_path}")
    for path in plots:
        print(f"Plot:   {path}")


if __name__ == "__main__":
    app.run(main)
