r"""Sweep file of the tying study: does tying the head help, and when?
``make study`` runs it with ``experiments/sweep.py`` (``lmhead/lab/sweeps.py``
is the API it uses); ``make study-gpu`` is the same design on one GPU.

Two stages in one sweep directory, then the report (``make study`` runs all
three; each skips what is done, so rerunning it resumes)::

    python experiments/sweep.py --sweep=configs/sweeps/tying_study.py:stage=tune \
        --workdir=runs/tying_study --ensemble=8 --noreport
    python experiments/sweep.py --sweep=configs/sweeps/tying_study.py \
        --workdir=runs/tying_study --ensemble=8 --noreport
    python experiments/report.py --workdir=runs/tying_study --out=docs/tying_study

The first stage tunes the learning rate of arms a, b and c in every cell
(vocabulary x data amount) on two tuning seeds; the second reads those runs
back, keeps each cell's rate (``lmhead/studies/tying/study.py`` has the
rules) and trains the test seeds at it, arms d and e, and the table
learning-rate ablation. The report is written from ``docs/tying_study/
runs.csv`` alone (:func:`write_report`), one row per run of both stages.

The design (model, vocabularies, data amounts, splits, stopping, arms,
learning rates, seeds, ablation), its budget and cuts are in
``docs/tying_study/README.md``. The primary contrasts (``cells.PRIMARY``:
b - a and c - a in every cell) are fixed here, before the runs; the report
adjusts their p-values with Holm's method over that family.

Arguments: an optional preset first (``full``, the default; ``small``,
``make compare``'s version: BPE 2048, 1% of the data, arms a, b and c, 8
seeds, one learning rate, no tuning, 16 validation batches every 50 steps;
``edges``, ``make study-edges``'s sensitivity check: the full design's
cells whose every arm chose the top of its ladder, BPE 2048 and 8192 on all
of the text, arms a, b and c, with the ladder let run up to eight rungs past
the grid instead of two; ``tiny``, for tests), then
comma-separated ``key=value`` (``+`` separates list items)::

    stage=test      tune | test (test lists the tuning runs too)
    char=true       include the character vocabulary
    bpe=...         BPE sizes, e.g. bpe=512+8192
    amounts=...     training fractions, e.g. amounts=0.01+1.0
    arms=a+b+c+d+e  which arms
    seeds=8         test seeds 0 .. seeds-1
    tune=true       false: no tuning stage, every cell at its centre's rate
    extend=2        rungs tried past an end of the grid, at most
    secondary_bpe=2048+8192  the BPE sizes of arms d and e (none: characters
                    never have a d, and e there is cut for time)
    subset_steps, full_steps, eval_every, eval_batches (validation batches
                    of evenly spaced windows), patience, ablation (true | false)
"""

import os

from lmhead.lab import sweeps
from lmhead.lm import data
from lmhead.studies.tying import shapes, study

PRESETS = {
    "full": dict(
        base="nanogpt",
        stage="test",
        char=True,
        bpe=(512, 2048, 8192),
        amounts=(0.003, 0.01, 0.03, 1.0),
        arms=("a", "b", "c", "d", "e"),
        seeds=8,
        tune=True,
        extend=2,
        subset_steps=3000,
        full_steps=1000,
        eval_every=100,
        eval_batches=32,
        patience=3,
        ablation=True,
        secondary_bpe=(2048, 8192),
    ),
    "small": dict(
        base="nanogpt",
        stage="test",
        char=False,
        bpe=(2048,),
        amounts=(0.01,),
        arms=("a", "b", "c"),
        seeds=8,
        tune=False,
        extend=0,
        subset_steps=1000,
        full_steps=1000,
        eval_every=50,
        eval_batches=16,
        patience=3,
        ablation=False,
        secondary_bpe=(),
    ),
    "tiny": dict(
        base="tiny",
        stage="test",
        char=True,
        bpe=(300,),
        amounts=(0.2, 1.0),
        arms=("a", "b", "c", "d", "e"),
        seeds=2,
        tune=True,
        extend=1,
        subset_steps=60,
        full_steps=30,
        eval_every=10,
        eval_batches=4,
        patience=2,
        ablation=True,
        secondary_bpe=(300,),
    ),
}
# Its runs that the full design has are the same runs (same names), so
# ``make study-edges`` restores them from the study's runs.csv.
PRESETS["edges"] = dict(
    PRESETS["full"],
    char=False,
    bpe=(2048, 8192),
    amounts=(1.0,),
    arms=("a", "b", "c"),
    extend=8,
    ablation=False,
    secondary_bpe=(),
)
# The model each preset's base config argument gives (configs/default.py).
BASE_MODELS = {
    "nanogpt": (
        shapes.Shape(True, 128, 4, 512),
        shapes.Architecture(4, 64, use_bias=False),
    ),
    "tiny": (shapes.Shape(True, 32, 1, 64), shapes.Architecture(2, 16, use_bias=True)),
}
# Ladder indices (study.ladder_rate) of each vocabulary's middle rate: near
# the rates the first version of this study chose for its data-limited runs.
CENTRES = {None: 4, 512: 1, 2048: -1, 8192: -4, 300: 2}
EVAL_TRAIN_BATCHES = 8
HOLDOUT = {"data.holdout_fraction": 0.1, "data.holdout_chunk": 512}
ABLATION_CELL = {"nanogpt": (2048, 0.03), "tiny": (300, 0.2)}


def parse(arg: str | None) -> dict:
    """The preset's values with the ``key=value`` items of ``arg`` applied."""
    first, _, rest = (arg or "").partition(",")
    if first and "=" not in first:
        if first not in PRESETS:
            raise ValueError(
                f"Unknown preset {first!r}; the presets are {', '.join(PRESETS)}."
            )
        return sweeps.parse_arg(rest, PRESETS[first])
    return sweeps.parse_arg(arg, PRESETS["full"])


def vocab_size(base: str, overrides: dict) -> int:
    """The tokens a run's tokenizer has (``data.tokenizer_vocab_size``, cached)
    with the ``data.*`` items of ``overrides`` on the base config."""
    return data.tokenizer_vocab_size(study.data_config(base, overrides))


def get_study(arg=None) -> study.Design:
    args = parse(arg)
    if args["stage"] not in ("tune", "test"):
        raise ValueError(f"stage={args['stage']!r}: write stage=tune or stage=test.")
    unknown = set(args["arms"]) - set(shapes.ARMS)
    if unknown:
        raise ValueError(
            f"Unknown arms {sorted(unknown)}; arms: {', '.join(shapes.ARMS)}."
        )
    if "e" in args["arms"] and not args["tune"]:
        raise ValueError(
            "Arm e unties at a step the tuning runs give: write tune=true."
        )
    every = args["eval_every"]
    shared = {
        # The committed runs (docs/tying_study, docs/compare) had no
        # end-of-text token; restoring and resuming them needs the same data.
        "data.end_of_text": False,
        "data.split": "works",
        "data.tokenizer_fraction": 1.0,
        **HOLDOUT,
        "train.test_eval": True,
        "train.eval_every": every,
        "train.log_every": every,
        "train.checkpoint_every": 5 * every,
        "train.eval_batches": args["eval_batches"],
        "train.eval_train_batches": EVAL_TRAIN_BATCHES,
        # A diverging rate ends with a NaN loss, which is never chosen,
        # instead of failing the stage.
        "train.stop_on_nonfinite": False,
        "sample.num_samples": 0,
    }
    base_shape, arch = BASE_MODELS[args["base"]]
    vocabularies = ((None,) if args["char"] else ()) + tuple(args["bpe"])
    amounts = tuple(
        study.Amount(f, args["full_steps"] if f >= 1.0 else args["subset_steps"])
        for f in args["amounts"]
    )
    return study.Design(
        base=args["base"],
        shared=shared,
        vocabularies=vocabularies,
        amounts=amounts,
        arms=tuple(args["arms"]),
        centres={v: CENTRES[v] for v in vocabularies},
        test_seeds=tuple(range(args["seeds"])),
        grid=(-1, 0, 1) if args["tune"] else (0,),
        tune=args["tune"],
        extend_edges=args["extend"],
        patience=args["patience"],
        ablation_cell=ABLATION_CELL[args["base"]] if args["ablation"] else None,
        secondary_vocabularies=tuple(int(v) for v in args["secondary_bpe"]),
        base_shape=base_shape,
        arch=arch,
        vocab_sizes={
            vocab: vocab_size(
                args["base"], {**shared, **study.vocabulary_overrides(vocab)}
            )
            for vocab in vocabularies
        },
    )


def get_sweep(arg=None, workdir=None):
    design, stage = get_study(arg), parse(arg)["stage"]
    if not design.tune:
        runs = design.test_runs(study.choose_learning_rates(design, {}), {})
    elif workdir is None:
        if stage == "test":
            raise ValueError(
                "stage=test reads the tuning runs: it needs the sweep directory."
            )
        runs = design.tuning_runs()  # the grid; its extensions need its results
    else:
        runs = list(study.read_plan(design, workdir, test=stage == "test"))
    return design.base, [design.overrides(r) for r in runs], design.shared


def restore_runs(csv_path, workdir):
    """Recreates in ``workdir`` the finished runs of a committed ``runs.csv``
    that it lacks (``results.restore_runs``), so that ``make study`` on a
    fresh machine resumes where ``docs/tying_study/runs.csv`` stands."""
    from lmhead.studies.tying import results

    return results.restore_runs(csv_path, workdir)


def write_report(arg, sweep_dir, out_dir):
    """``runs.csv``, REPORT.md and the plots of ``sweep_dir`` into ``out_dir``
    (``lmhead/studies/tying/results.py``): ``(the answer to print, plot
    paths)``, the answer being ``analysis.answer``'s sentence and table."""
    from lmhead.studies.tying import analysis, results, table  # the report's only

    _, plots = results.write_report(get_study(arg), sweep_dir, out_dir)
    rows = table.read_rows(os.path.join(out_dir, results.RUNS_CSV))
    return analysis.answer(rows), plots
