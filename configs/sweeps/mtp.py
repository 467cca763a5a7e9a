r"""Sweep file: does multi-token prediction change the next-token head here?

The tying study's arm a (tied head, 4 blocks of width 128, MLP 512) at BPE
2048 on all of the training text for 1000 steps, at the rate its cell chose
(:data:`RECIPE`), trained plain (``model.mtp_heads`` 0) and with MTP heads
(the sequential design, ``loss.mtp_weight`` :math:`\lambda` = 0.3): ``k`` =
1 and 3 depths reading out through the main head's unembedding, and ``k`` = 3
with an unembedding of their own. Each arm is an ensemble program of 8
seeds, paired by seed (the trunk and the main head start equal: the depths'
parameters are added, lmhead/lm/mtp.py)::

    python experiments/sweep.py --sweep=configs/sweeps/mtp.py \
        --workdir=runs/mtp --ensemble=8 --noreport
    python experiments/report.py --workdir=runs/mtp \
        --sweep=configs/sweeps/mtp.py --out=docs/mtp

The report (:func:`write_report`) writes ``runs.csv``, one row per run, and
REPORT.md from it alone (:func:`report_text`): each arm's test bits per
character of the main head, each arm - plain paired by seed and own - shared
with their 95% t-intervals, and each depth's accuracy (the greedy acceptance
rate it estimates) over the training batches of the last 100 steps, with
its t-interval over seeds.

Arguments (comma-separated ``key=value``)::

    base=nanogpt            nanogpt (RECIPE) or tiny (tests: BPE 300)
    vocab_size=2048         BPE vocabulary
    steps=1000              training steps (the cosine ends there)
    seeds=8                 seeds 0 .. seeds-1
    mtp_weight=0.3          lambda of every arm with MTP heads
"""

import math
import os

import ml_collections

from lmhead.lab import report, stats, sweeps, workdirs
from lmhead.lm import configuration
from lmhead.lm import model as model_lib

DEFAULTS = dict(base="nanogpt", vocab_size=2048, steps=1000, seeds=8, mtp_weight=0.3)
# The tying study's cell of arm a at BPE 2048 on all of the text, 1000 steps
# (configs/sweeps/tying_study.py; its rate 0.002 in docs/tying_study/runs.csv),
# validated every 100 steps, without patience or samples.
RECIPE = {
    "data.end_of_text": False,
    "data.split": "works",
    "data.tokenizer": "bpe",
    "data.tokenizer_fraction": 1.0,
    "data.holdout_fraction": 0.1,
    "data.holdout_chunk": 512,
    "data.train_fraction": 1.0,
    "model.tied": True,
    "model.d_model": 128,
    "model.num_layers": 4,
    "model.mlp_dim": 512,
    "optim.lr": 0.002,
    "optim.min_lr": 0.0002,
    "train.eval_every": 100,
    "train.log_every": 50,
    "train.eval_batches": 32,
    "sample.num_samples": 0,
}
# The arms: (name, overrides).
ARMS = (
    ("plain", {}),
    ("k=1 shared", {"model.mtp_heads": 1}),
    ("k=3 shared", {"model.mtp_heads": 3}),
    ("k=3 own", {"model.mtp_heads": 3, "model.mtp_unembedding": "own"}),
)
# Depth accuracies are the training records' of the last this many steps.
LAST_STEPS = 100
MAX_DEPTHS = 3
COLUMNS = (
    "run",
    "arm",
    "seed",
    "mtp_heads",
    "mtp_unembedding",
    "params",
    "flops_per_token",
    "steps_run",
    "val_bpc",
    "test_bpc",
    *(f"depth{i}_accuracy" for i in range(1, MAX_DEPTHS + 1)),
    "ms_per_step",
    "cpu_ms_per_step",
    "ensemble",
)


def get_sweep(arg=None):
    args = sweeps.parse_arg(arg, DEFAULTS)
    steps = args["steps"]
    shared = {
        "train.steps": steps,
        "train.checkpoint_every": min(100, steps),
        "loss.mtp_weight": float(args["mtp_weight"]),
        "train.test_eval": True,
    }
    if args["base"] == "tiny":
        base = f"tiny,bpe={args['vocab_size']}"
        shared |= {
            "data.split": "works",
            "train.eval_every": steps,
            "sample.num_samples": 0,
        }
    elif args["base"] == "nanogpt":
        base = "nanogpt"
        shared |= {**RECIPE, "data.vocab_size": args["vocab_size"]}
    else:
        raise ValueError(f"base={args['base']!r}: write base=nanogpt or base=tiny.")
    return (
        base,
        sweeps.product(
            sweeps.sweep("train.seed", list(range(args["seeds"]))),
            [overrides for _, overrides in ARMS],
        ),
        shared,
    )


def arm_of(flat: dict) -> str:
    """The name of the arm a run's flat config belongs to."""
    heads = flat.get("model.mtp_heads", 0)
    if not heads:
        return "plain"
    return f"k={heads} {flat.get('model.mtp_unembedding', 'shared')}"


def depth_accuracy(run: workdirs.Run, depth: int) -> float:
    """Mean ``train/depth{depth}_accuracy`` of the records of the last
    :data:`LAST_STEPS` steps (NaN without that depth)."""
    last = max((r["step"] for r in run.metrics), default=0)
    values = [
        r[f"train/depth{depth}_accuracy"]
        for r in run.metrics
        if r["step"] > last - LAST_STEPS and f"train/depth{depth}_accuracy" in r
    ]
    return sum(values) / len(values) if values else math.nan


def rows_of(sweep_dir: str) -> list[dict]:
    """One :data:`COLUMNS` row per finished run of ``sweep_dir``."""
    rows = []
    for run in workdirs.read_sweep(sweep_dir):
        if run.status != "finished":
            continue
        summary, flat = run.summary, configuration.flatten(run.config)
        model = configuration.make_model(
            ml_collections.ConfigDict(run.config), summary["vocab_size"]
        )
        rows.append(
            {
                "run": run.name,
                "arm": arm_of(flat),
                "seed": flat["train.seed"],
                "mtp_heads": flat.get("model.mtp_heads", 0),
                "mtp_unembedding": flat.get("model.mtp_unembedding", "shared"),
                "params": summary["num_params"],
                "flops_per_token": model_lib.training_flops_per_token(model),
                "steps_run": summary["steps_run"],
                "val_bpc": f"{summary['final']['eval/bits_per_char']:.6f}",
                "test_bpc": f"{summary['test']['bits_per_char']:.6f}",
                **{
                    f"depth{i}_accuracy": _number(depth_accuracy(run, i))
                    for i in range(1, MAX_DEPTHS + 1)
                },
                "ms_per_step": f"{summary['ms_per_step']:.1f}",
                "cpu_ms_per_step": f"{summary['cpu_ms_per_step']:.1f}",
                "ensemble": os.path.basename(
                    (summary.get("ensemble") or {}).get("program", "")
                ),
            }
        )
    order = [name for name, _ in ARMS]
    return sorted(rows, key=lambda r: (order.index(r["arm"]), int(r["seed"])))


def _number(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.6f}"


def report_text(rows: list[dict]) -> str:
    """REPORT.md of :func:`rows_of`'s rows."""
    arms = {name: [r for r in rows if r["arm"] == name] for name, _ in ARMS}

    def by_seed(runs, key):
        return {int(r["seed"]): float(r[key]) for r in runs if r[key] != ""}

    plain = arms["plain"]
    quality = [
        [
            name,
            str(len(runs)),
            report.mean_std_text([float(r["test_bpc"]) for r in runs]),
            report.DASH
            if name == "plain"
            else report.interval_text(
                stats.paired_difference(
                    by_seed(runs, "test_bpc"), by_seed(plain, "test_bpc")
                )
            ),
            report.DASH
            if name == "plain"
            else report.interval_text(
                stats.paired_difference(
                    by_seed(runs, "val_bpc"), by_seed(plain, "val_bpc")
                )
            ),
        ]
        for name, runs in arms.items()
    ]
    own_minus_shared = [
        [
            metric,
            report.interval_text(
                stats.paired_difference(
                    by_seed(arms["k=3 own"], key), by_seed(arms["k=3 shared"], key)
                )
            ),
        ]
        for metric, key in (
            ("test bits/char", "test_bpc"),
            *(
                (f"depth {i} accuracy", f"depth{i}_accuracy")
                for i in range(1, MAX_DEPTHS + 1)
            ),
        )
    ]

    def accuracy_cell(runs, depth):
        values = list(by_seed(runs, f"depth{depth}_accuracy").values())
        mean, std, n = stats.mean_std(values)
        if n < 2:
            return report.DASH if n == 0 else f"{mean:.4f}"
        half = stats.t_critical_95(n - 1) * std / math.sqrt(n)
        return f"{mean:.4f} [{mean - half:.4f}, {mean + half:.4f}]"

    acceptance = [
        [name] + [accuracy_cell(runs, i) for i in range(1, MAX_DEPTHS + 1)]
        for name, runs in arms.items()
        if name != "plain"
    ]

    def mean_of(runs, key):
        values = [float(r[key]) for r in runs]
        return sum(values) / len(values) if values else math.nan

    shapes = [
        [
            name,
            f"{mean_of(runs, 'params'):,.0f}",
            f"{mean_of(runs, 'flops_per_token') / 1e6:.2f}",
            f"{mean_of(runs, 'ms_per_step'):.1f}",
            f"{mean_of(runs, 'cpu_ms_per_step'):.1f}",
        ]
        for name, runs in arms.items()
    ]
    return (
        "\n\n".join(
            [
                "# Multi-token prediction and the next-token head",
                "Written from `runs.csv` by `configs/sweeps/mtp.py` (the "
                "README's results). The main head's test bits per character "
                "(mean ± std over seeds), and each arm - plain paired by seed "
                "with its 95% t-interval (negative: MTP training helped the "
                "next-token head):",
                report.markdown_table(
                    ["arm", "seeds", "test bits/char", "- plain, test", "- plain, val"],
                    quality,
                ),
                "At k = 3, an unembedding of the depths' own - the main "
                "head's (shared), paired by seed:",
                report.markdown_table(["metric", "own - shared"], own_minus_shared),
                "Each depth's accuracy on the training batches of the last "
                f"{LAST_STEPS} steps (mean [95% t-interval] over seeds): how "
                "often its argmax is the token, which greedy speculative "
                "decoding accepts when the depths before it were accepted "
                "(`experiments/bench/bench_speculative.py` measures the "
                "acceptance itself):",
                report.markdown_table(
                    ["arm"] + [f"depth {i}" for i in range(1, MAX_DEPTHS + 1)],
                    acceptance,
                ),
                "Parameters, training FLOPs per token "
                "(`model.training_flops_per_token`), and a step's time (the "
                "mean over each arm's members; the arms ran two at a time "
                "beside other work, paused while benchmarks ran, so this is a "
                "record, not a comparison of speed: the benchmark times the "
                "steps side by side):",
                report.markdown_table(
                    ["arm", "params", "MFLOP/token", "ms/step", "CPU ms/step"],
                    shapes,
                ),
                "Every run:",
                report.markdown_table(
                    COLUMNS, [[str(r[c]) for c in COLUMNS] for r in rows]
                ),
            ]
        )
        + "\n"
    )


def write_report(arg, sweep_dir, out_dir):
    """``runs.csv`` of ``sweep_dir``'s finished runs and REPORT.md from it, in
    ``out_dir``; returns ``(REPORT.md's text, no plots)``."""
    del arg  # the runs' configs say what they trained
    rows = rows_of(sweep_dir)
    return report.write_runs_report(out_dir, COLUMNS, rows, report_text(rows)), []
