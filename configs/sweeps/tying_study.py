r"""Sweep file of the tying study: does tying the head help, and when?
``make study`` runs it with ``experiments/sweep.py`` (``lmhead/lab/sweeps.py``
is the API it uses).

Two stages in one sweep directory, then the report (``make study`` runs all
three; each skips what is done, so rerunning it resumes)::

    python experiments/sweep.py --sweep=configs/sweeps/tying_study.py:stage=tune \
        --workdir=runs/tying_study --noreport
    python experiments/sweep.py --sweep=configs/sweeps/tying_study.py \
        --workdir=runs/tying_study --noreport
    python experiments/report.py --workdir=runs/tying_study --out=docs/tying_study

The first stage trains every cell (regime x vocabulary x arm) at each
learning rate of the grid with the first seed, and, for a cell whose best
rate so far is at an end of the rates it tried, the next rate outward
(``extend``; the sweep runner plans again whenever a run ends, until the
plan stops growing); the second reads those runs back, keeps each cell's
rate with the lowest validation loss (``lmhead/studies/tying/study.py``), and
adds the other seeds at it (the tuning run at the chosen rate is seed 0). On a
cluster, run each stage's ``--dry_run`` commands in turn, the first stage's
until it prints none (the second stage refuses to plan before the first has
finished), then the report. :func:`write_report` is the report
``experiments/report.py`` writes for this sweep
(``lmhead/studies/tying/report.py``).

Design (``lmhead/studies/tying/shapes.py`` solves the matched shapes and
counts them):

* Model: nanoGPT's CPU example (``configs/default.py:nanogpt``): d_model
  128, 4 blocks, 4 heads, MLP 512, block 64, batch 12, no biases, AdamW,
  100 warmup steps, cosine to lr/10.
* Vocabulary: characters (84) and byte-level BPE 512, 1024, 2048, 8192
  (trained on the training text used). The tied table's share of the tied
  model's parameters runs from 1.3% to 57%.
* Arms: (a) tied; (b) untied, same shape; (c) untied and *narrower*, with
  (a)'s parameter count: d_model the multiple of 4 nearest in count at MLP
  ratio 4, then mlp_dim solved; (d) tied and *deeper*, with (b)'s count:
  whole blocks, then every block's MLP widened by the remainder. The shapes
  are solved at the size each regime's tokenizer reaches (``vocab_size``
  below): BPE 8192 trained on one play stops at 6,911 tokens. Counts match
  to within 0.1% (the tests check 2% against the model's own init, with the
  tokenizer a run trains).
* Regimes: ``fixed``: 1000 steps (768k tokens) on the whole training split,
  last parameters tested. ``limited``: the first 3% of the training split
  (about one play), early stopping with patience 3 evaluations (at most 1000
  steps), the best evaluation's parameters tested; the report gives the steps
  to the best and how many runs stopped before the cap.
* Splits: ``data.split=works``, whole works for train / validation / test.
  Validation (8 fixed batches every 100 steps, and 8 training batches for
  the train - validation gap) chooses the learning rate and the stopping
  step; the numbers are bits per character on the whole test split.
* Tuning: learning rates 5e-4, 1e-3, 2e-3 per cell on seed 0, and up to two
  doublings past 2e-3 (or halvings below 5e-4) for a cell whose best rate is
  at the end of those tried; seeds 0, 1, 2 at the chosen rate. 5
  vocabularies x 4 arms x 2 regimes = 40 cells; 3 to 5 + 2 runs per cell,
  200 runs plus the extensions.

Budget: sized for a 2-core CPU (the estimate is in the README's tying study
section, what the runs took in ``docs/tying_study/README.md``). The grid
trains 100 x 1000 steps in the fixed regime and at most 100 x 1000 in the
limited one. Estimate = sum over runs of steps x seconds per step of the
run's shape (plus the periodic evaluations) + a fixed cost per run
(start-up, compilation, BPE training, the whole test split). Seconds per step: a few timed steps of each of the 20 shapes (as
``experiments/bench/bench_train.py`` does), taking the process's CPU time
per step on a loaded machine as the wall time, which gives no credit for
the second core: a conservative estimate, which early stopping in the
limited regime only shortens. The edge extensions come on top: a run each
for every cell whose best rate is past the grid (at most two per cell: the
walk goes one way).
Cut to fit: one width (d_model 128) and depth; five vocabularies; the
minimum of 3 learning rates and 3 seeds, with the tuning run reused as seed
0; 8-batch validation subsets; 1000 steps in the fixed regime (short of
convergence on the whole text: it compares the arms at an equal, modest
budget); one play of text and a 1000-step cap in the limited regime.
``make compare`` (the ``small`` preset, 9 runs of at most 600 steps) is
budgeted the same way. The report states the measured total.

Arguments: an optional preset first (``full``, the default; ``small``,
``make compare``'s version: BPE 2048, arms a, b, c, the limited regime
only, one learning rate, 3 seeds; ``tiny``, for tests), then
comma-separated ``key=value`` (``+`` separates list items)::

    stage=seeds     tune | seeds (seeds lists the tuning runs too)
    char=true       include the character vocabulary
    bpe=...         BPE sizes, e.g. bpe=512+8192
    arms=a+b+c+d    which arms
    regimes=fixed+limited
    lrs=...         learning rates tried per cell (the grid)
    extend=2        rates tried past an end of the grid, at most, while a
                    cell's best is at that end (0: the grid alone)
    seeds=3         seeds 0 .. seeds-1
    fixed_steps, limited_steps, limited_fraction, patience, eval_every
"""

from lmhead.lab import sweeps
from lmhead.lm import configuration, data
from lmhead.studies.tying import report, shapes, study

PRESETS = {
    "full": dict(
        base="nanogpt",
        stage="seeds",
        char=True,
        bpe=(512, 1024, 2048, 8192),
        arms=("a", "b", "c", "d"),
        regimes=("fixed", "limited"),
        lrs=(5e-4, 1e-3, 2e-3),
        extend=2,
        seeds=3,
        fixed_steps=1000,
        limited_steps=1000,
        limited_fraction=0.03,
        patience=3,
        eval_every=100,
    ),
    "small": dict(
        base="nanogpt",
        stage="seeds",
        char=False,
        bpe=(2048,),
        arms=("a", "b", "c"),
        regimes=("limited",),
        lrs=(1e-3,),
        extend=0,
        seeds=3,
        fixed_steps=600,
        limited_steps=600,
        limited_fraction=0.03,
        patience=3,
        eval_every=50,
    ),
    "tiny": dict(
        base="tiny",
        stage="seeds",
        char=True,
        bpe=(300,),
        arms=("a", "b", "c", "d"),
        regimes=("fixed", "limited"),
        lrs=(1e-3, 3e-3),
        extend=0,
        seeds=2,
        fixed_steps=20,
        limited_steps=40,
        limited_fraction=0.5,
        patience=2,
        eval_every=10,
    ),
}
# The model each preset's base config argument gives (configs/default.py).
BASE_MODELS = {
    "nanogpt": (
        shapes.Shape(True, 128, 4, 512),
        shapes.Architecture(4, 64, use_bias=False),
    ),
    "tiny": (shapes.Shape(True, 32, 1, 64), shapes.Architecture(2, 16, use_bias=True)),
}
EVAL_BATCHES = 8


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
    config = configuration.load_config(base)
    for key, value in overrides.items():
        if key.startswith("data."):
            config.data[key.removeprefix("data.")] = value
    return data.tokenizer_vocab_size(config.data)


def get_study(arg=None) -> study.Design:
    args = parse(arg)
    if args["stage"] not in ("tune", "seeds"):
        raise ValueError(f"stage={args['stage']!r}: write stage=tune or stage=seeds.")
    regimes = {
        "fixed": study.Regime("fixed", 1.0, args["fixed_steps"], 0),
        "limited": study.Regime(
            "limited", args["limited_fraction"], args["limited_steps"], args["patience"]
        ),
    }
    unknown = set(args["regimes"]) - set(regimes) or set(args["arms"]) - set(
        shapes.ARMS
    )
    if unknown:
        raise ValueError(
            f"Unknown regime or arm {sorted(unknown)}; regimes: fixed, "
            f"limited; arms: {', '.join(shapes.ARMS)}."
        )
    every = args["eval_every"]
    shared = {
        "data.split": "works",
        "train.test_eval": True,
        "train.eval_every": every,
        "train.log_every": every,
        "train.checkpoint_every": 5 * every,
        "train.eval_batches": EVAL_BATCHES,
        "train.eval_train_batches": EVAL_BATCHES,
        # A diverging rate ends with a NaN loss, which is never chosen,
        # instead of failing the stage.
        "train.stop_on_nonfinite": False,
        "sample.num_samples": 0,
    }
    base_shape, arch = BASE_MODELS[args["base"]]
    chosen_regimes = tuple(regimes[r] for r in args["regimes"])
    vocabularies = ((None,) if args["char"] else ()) + tuple(args["bpe"])
    return study.Design(
        base=args["base"],
        shared=shared,
        regimes=chosen_regimes,
        vocabularies=vocabularies,
        arms=tuple(args["arms"]),
        learning_rates=tuple(args["lrs"]),
        seeds=tuple(range(args["seeds"])),
        base_shape=base_shape,
        arch=arch,
        extend_edges=args["extend"],
        vocab_sizes={
            (regime.name, vocab): vocab_size(
                args["base"],
                {**shared, **regime.overrides(), **study.vocabulary_overrides(vocab)},
            )
            for regime in chosen_regimes
            for vocab in vocabularies
        },
    )


def get_sweep(arg=None, workdir=None):
    design = get_study(arg)
    if workdir is None:
        if parse(arg)["stage"] == "seeds":
            raise ValueError(
                "stage=seeds reads the tuning runs: it needs the sweep directory."
            )
        runs = design.tuning_runs()  # the grid; its extensions need its results
    else:
        tuning = study.read_tuning(design, workdir)
        runs = list(tuning)
        if parse(arg)["stage"] == "seeds":
            runs += design.seed_runs(study.choose_learning_rates(tuning))
    return design.base, [r.overrides(design.min_lr_ratio) for r in runs], design.shared


def write_report(arg, sweep_dir, out_dir):
    """The study's report of ``sweep_dir`` into ``out_dir``
    (``lmhead/studies/tying/report.py``): ``(text, plot paths)``."""
    return report.write_report(get_study(arg), sweep_dir, out_dir)
