r"""Sweep file: training with the fused loss's gradient filtering against the
exact gradient, on all of the text at a vocabulary where filtering skips
tiles (docs/fused_loss.md, "Training with it").

The tying study's arm a (tied head, 4 blocks of width 128, MLP 512) at BPE
32768 on the whole training split, as ``experiments/bench/bench_filter.py``
trains it (:data:`RECIPE`), each seed exact (``loss.filter_eps`` unset) and
filtered (``loss.filter_eps`` 2^-12, bfloat16's ``"auto"``; float32's
``"auto"``, 2^-28, skips no tile of a trained model) with each
``loss.filter_target`` of ``targets``: both ``dh`` and ``dw`` (the
default), or ``dh`` only, Cut Cross-Entropy's variant for pretraining. Each
arm is an ensemble program of 8 members::

    python experiments/sweep.py --sweep=configs/sweeps/filter_training.py \
        --workdir=runs/filter_training --ensemble=8 --noreport
    python experiments/report.py --workdir=runs/filter_training \
        --sweep=configs/sweeps/filter_training.py --out=docs/filter_training

The report (:func:`write_report`) writes ``runs.csv``, one row per run, and
REPORT.md from it alone (:func:`report_text`): each seed's test and
validation bits per character, and each filtered arm - exact paired by
seed with its 95% t-interval.

Arguments (comma-separated ``key=value``)::

    base=nanogpt            nanogpt (RECIPE) or tiny (tests: BPE 300)
    vocab_size=32768        BPE vocabulary
    steps=400               training steps (the cosine ends there)
    seeds=8                 seeds 0 .. seeds-1
    filter_eps=0.000244140625  the filtered arms' loss.filter_eps
    targets=both+dh         their loss.filter_target, one arm each
"""

import os

from lmhead.lab import report, stats, sweeps, workdirs
from lmhead.lm.configuration import flatten

DEFAULTS = dict(
    base="nanogpt",
    vocab_size=32768,
    steps=400,
    seeds=8,
    filter_eps=2.0**-12,
    targets=("both", "dh"),
)
# The tying study's test run of arm a at BPE 8192 on all of the text
# (configs/sweeps/tying_study.py; its cell chose the rate 0.000707 in
# docs/tying_study/runs.csv), validated every 100 steps, with no samples;
# the vocabulary and the steps are the sweep's arguments.
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
    "optim.lr": 0.000707,
    "optim.min_lr": 7.07e-05,
    "train.seed": 0,
    "train.eval_every": 100,
    "train.log_every": 50,
    "train.eval_batches": 32,
    "train.test_eval": False,
    "sample.num_samples": 0,
}
COLUMNS = (
    "run",
    "seed",
    "filter_eps",
    "filter_target",
    "steps_run",
    "val_bpc",
    "test_bpc",
    "ms_per_step",
    "cpu_ms_per_step",
    "ensemble",
)


def get_sweep(arg=None):
    args = sweeps.parse_arg(arg, DEFAULTS)
    steps = args["steps"]
    shared = {"train.steps": steps, "train.checkpoint_every": min(100, steps)}
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
        del shared["train.seed"]
    else:
        raise ValueError(f"base={args['base']!r}: write base=nanogpt or base=tiny.")
    shared["train.test_eval"] = True
    # "both" is the default target, left out of its runs' names.
    arms = [{}] + [
        {"loss.filter_eps": float(args["filter_eps"])}
        | ({} if target == "both" else {"loss.filter_target": target})
        for target in args["targets"]
    ]
    return (
        base,
        sweeps.product(sweeps.sweep("train.seed", list(range(args["seeds"]))), arms),
        shared,
    )


def rows_of(sweep_dir: str) -> list[dict]:
    """One :data:`COLUMNS` row per finished run of ``sweep_dir``."""
    rows = []
    for run in workdirs.read_sweep(sweep_dir):
        if run.status != "finished":
            continue
        summary, flat = run.summary, flatten(run.config)
        rows.append(
            {
                "run": run.name,
                "seed": flat["train.seed"],
                "filter_eps": flat.get("loss.filter_eps") or "",
                "filter_target": flat["loss.filter_target"]
                if flat.get("loss.filter_eps")
                else "",
                "steps_run": summary["steps_run"],
                "val_bpc": f"{summary['final']['eval/bits_per_char']:.6f}",
                "test_bpc": f"{summary['test']['bits_per_char']:.6f}",
                "ms_per_step": f"{summary['ms_per_step']:.1f}",
                "cpu_ms_per_step": f"{summary['cpu_ms_per_step']:.1f}",
                "ensemble": os.path.basename(
                    (summary.get("ensemble") or {}).get("program", "")
                ),
            }
        )
    return sorted(
        rows, key=lambda r: (r["filter_eps"] != "", r["filter_target"], int(r["seed"]))
    )


def report_text(rows: list[dict]) -> str:
    """REPORT.md of :func:`rows_of`'s rows: every run, and each filtered arm
    (a ``filter_target``) - exact, test and validation bits per character
    paired by seed."""
    exact = [r for r in rows if not r["filter_eps"]]
    targets = sorted({r["filter_target"] for r in rows if r["filter_eps"]})
    arms = {
        t: [r for r in rows if r["filter_eps"] and r["filter_target"] == t]
        for t in targets
    }

    def by_seed(runs, key):
        return {int(r["seed"]): float(r[key]) for r in runs}

    def mean_of(runs, key):
        return sum(float(r[key]) for r in runs) / len(runs) if runs else float("nan")

    differences = [
        [
            f"{name}, filter_target {target}",
            report.interval_text(
                stats.paired_difference(by_seed(runs, key), by_seed(exact, key))
            ),
            str(len(set(by_seed(runs, key)) & set(by_seed(exact, key)))),
        ]
        for target, runs in arms.items()
        for name, key in (("test bits/char", "test_bpc"), ("val bits/char", "val_bpc"))
    ]
    time = [
        [key, f"{mean_of(exact, key):.1f}"]
        + [
            f"{mean_of(runs, key):.1f} ({mean_of(runs, key) / mean_of(exact, key):.2f}x)"
            for runs in arms.values()
        ]
        for key in ("ms_per_step", "cpu_ms_per_step")
    ]
    return (
        "\n\n".join(
            [
                "# Training with gradient filtering against the exact gradient",
                "Written from `runs.csv` by `configs/sweeps/filter_training.py` "
                '(docs/fused_loss.md, "Training with it"). Each filtered arm - '
                "exact, paired by seed, with its 95% t-interval:",
                report.markdown_table(
                    ["metric", "filtered - exact", "seed pairs"], differences
                ),
                "A step's time, the mean over each arm's members (an ensemble "
                "program's step trains all its members). The arms ran one "
                "after the other, beside whatever else the machine ran, so "
                "this is a record, not a comparison of speed: "
                "`experiments/bench/bench_filter.py` times the two losses "
                "side by side.",
                report.markdown_table(
                    ["", "exact"] + [f"filtered, {t}" for t in arms], time
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
