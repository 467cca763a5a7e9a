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
back, keeps each cell's rate (``studies/tying/study.py`` has the
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
the grid instead of two; ``profiles``, the learning-rate profiles of arms
a, b and c in four cells on three tuning seeds, with the subset cell's fixed
budget (``docs/tying_study/README.md``, "Learning-rate profiles");
``confirm``, their test stage: the profiled cells' arms a, b and c on the
16 confirmatory seeds at each arm's profile-chosen rate, tested against
:data:`HYPOTHESES` ("Confirmatory hypotheses, fixed before the runs");
``mechanism``, arm b of BPE 512 on 0.3% at table learning-rate multipliers
0.5, 2 and 4, each on a profile of its own ("The mechanism test");
``compute``, the compute axis: BPE 2048 on all of the text, arms a and b at
3000 steps, profiled one rung lower, then the confirmatory seeds at each
arm's profile-chosen rate, its report joining the 1000-step confirmatory
runs ("One compute axis"); ``past_2048`` and ``past_char``, past early
training: the compute axis's design for BPE 2048 at 10,000 steps and
characters at 3000, each arm's rate chosen clear of failed runs, tested on
16 fresh seeds against :data:`PAST_HYPOTHESES` ("Past early training:
fixed before the runs"); ``width_128``, ``width_256`` and ``width_512``,
the GPU recipe's width axis: BPE 2048 on all of the text, arms a and b at
that d_model, about 20 tokens per parameter, profiled and tested as
``past_2048`` is, on 16 fresh seeds ("The width axis"); ``tiny``,
``profiles_tiny``, ``confirm_tiny``, ``mechanism_tiny``, ``compute_tiny``,
``past_tiny`` and ``width_tiny``, for tests), then comma-separated
``key=value`` (``+`` separates list items)::

    stage=test      tune | test (test lists the tuning runs too)
    char=true       include the character vocabulary
    bpe=...         BPE sizes, e.g. bpe=512+8192
    amounts=...     training fractions, e.g. amounts=0.01+1.0
    arms=a+b+c+d+e  which arms
    seeds=8         test seeds first_seed .. first_seed+seeds-1
    first_seed=0    (the profiles' test stage: among study.CONFIRM_SEEDS,
                    study.PAST_SEEDS or study.WIDTH_SEEDS)
    tuning_seeds=100+101  the seeds that choose rates (never test seeds)
    tune=true       false: no tuning stage, every cell at its centre's rate
    ladder=-1+0+1   the grid's ladder indices around each centre
    extend=2        rungs tried past an end of the grid, at most
    profile=false   true: PROFILE_CELLS only, the arms of a cell on one
                    shared ladder (PROFILE_CENTRES) that grows to ``margin``
                    rungs past every arm's best on both sides
    margin=1        see profile (a per-arm ladder: past an end while best)
    multipliers=    table learning-rate multipliers of arm b, each an arm on
                    a ladder of its own, e.g. multipliers=0.5+2+4
    choice=best     how a profile chooses its rate: best (lowest mean
                    validation loss) or clear (the same among the rungs where
                    no tuning run fails, nor at the rung above:
                    study.choose_rate)
    centre_shift=0  rungs the profiled cells' first rungs move from
                    PROFILE_CENTRES (compute: -1)
    budgets=        the compute axis: the step budgets of the one profiled
                    cell that its report compares (full_steps among them),
                    e.g. budgets=1000+3000; the other budgets' test runs come
                    from COMPUTE_TABLES
    subset_eval_every=0, subset_patience=-1  the subsets' own cadence and
                    patience (0 and -1: the shared ones)
    secondary_bpe=2048+8192  the BPE sizes of arms d and e (none: characters
                    never have a d, and e there is cut for time)
    d_model=0       the arms' width, the base's layers with an MLP of
                    4 x d_model (0: the base config's model)
    tokens_per_param=0  the one profiled cell's step budget (full_steps and
                    budgets) is the one that trains its arms a and b about
                    this many tokens per parameter (budget_steps; 0: none)
    subset_steps, full_steps, eval_every, eval_batches (validation batches
                    of evenly spaced windows), patience, ablation (true | false)
"""

import dataclasses
import functools
import math
import os

from lmhead.lab import sweeps
from lmhead.lm import configuration, data
from studies.tying import shapes, study

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
        ladder=(-1, 0, 1),
        tuning_seeds=study.TUNING_SEEDS,
        profile=False,
        margin=1,
        subset_eval_every=0,
        subset_patience=-1,
        first_seed=0,
        multipliers=(),
        centre_shift=0,
        budgets=(),
        choice="best",
        d_model=0,
        tokens_per_param=0.0,
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
        ladder=(0,),
        tuning_seeds=study.TUNING_SEEDS,
        profile=False,
        margin=1,
        subset_eval_every=0,
        subset_patience=-1,
        first_seed=0,
        multipliers=(),
        centre_shift=0,
        budgets=(),
        choice="best",
        d_model=0,
        tokens_per_param=0.0,
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
        ladder=(-1, 0, 1),
        tuning_seeds=study.TUNING_SEEDS,
        profile=False,
        margin=1,
        subset_eval_every=0,
        subset_patience=-1,
        first_seed=0,
        multipliers=(),
        centre_shift=0,
        budgets=(),
        choice="best",
        d_model=0,
        tokens_per_param=0.0,
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
# The learning-rate profiles (docs/tying_study/README.md, "Learning-rate
# profiles"): arms a, b and c of PROFILE_CELLS on one shared ladder per cell,
# three tuning seeds a rung, grown until it holds two rungs past every arm's
# best on both sides. The subset cell trains a fixed budget: the cosine ends
# at 300 steps, evaluated every 25, patience off.
PRESETS["profiles"] = dict(
    PRESETS["full"],
    stage="tune",
    bpe=(512, 2048, 8192),
    amounts=(0.003, 1.0),
    arms=("a", "b", "c"),
    extend=8,
    ablation=False,
    secondary_bpe=(),
    ladder=(-2, -1, 0, 1, 2, 3),
    tuning_seeds=study.PROFILE_SEEDS,
    profile=True,
    margin=2,
    subset_steps=300,
    subset_eval_every=25,
    subset_patience=0,
)
PRESETS["profiles_tiny"] = dict(
    PRESETS["tiny"],
    stage="tune",
    arms=("a", "b", "c"),
    extend=2,
    ablation=False,
    secondary_bpe=(),
    ladder=(0, 1),
    tuning_seeds=study.PROFILE_SEEDS,
    profile=True,
    margin=1,
    subset_steps=40,
    subset_eval_every=5,
    subset_patience=0,
)
# The confirmatory runs (docs/tying_study/README.md, "Confirmatory
# hypotheses, fixed before the runs"): the profiles' test stage, arms a, b
# and c of each profiled cell on the 16 confirmatory seeds at each arm's
# profile-chosen rate, with the profiles' budgets and cadences.
PRESETS["confirm"] = dict(
    PRESETS["profiles"], stage="test", seeds=16, first_seed=study.CONFIRM_SEEDS[0]
)
PRESETS["confirm_tiny"] = dict(
    PRESETS["profiles_tiny"], stage="test", seeds=2, first_seed=study.CONFIRM_SEEDS[0]
)
# The mechanism test (README, "The mechanism test"): BPE 512 on 0.3%, arm b
# again with the tables' learning rate at k times the rate, each k on a
# profile of its own beside the cell's arms a and b (same rungs and seeds).
PRESETS["mechanism"] = dict(
    PRESETS["profiles"],
    char=False,
    bpe=(512,),
    amounts=(0.003,),
    arms=("a", "b"),
    multipliers=(0.5, 2.0, 4.0),
)
PRESETS["mechanism_tiny"] = dict(
    PRESETS["profiles_tiny"],
    char=False,
    amounts=(0.2,),
    arms=("a", "b"),
    multipliers=(0.5, 2.0),
)
# The compute axis (README, "One compute axis"): BPE 2048 on all of the
# text, arms a and b at a 3000-step budget that the cosine ends at, every run
# annealed (patience off), evaluated every 100 steps, profiled as the
# profiles are but with the first rungs one rung lower (longer runs want
# lower peak rates), then the confirmatory seeds at each arm's chosen rate,
# so that b - a pairs by seed with the confirm preset's 1000-step runs.
PRESETS["compute"] = dict(
    PRESETS["profiles"],
    stage="test",
    char=False,
    bpe=(2048,),
    amounts=(1.0,),
    arms=("a", "b"),
    full_steps=3000,
    patience=0,
    centre_shift=-1,
    budgets=(1000, 3000),
    seeds=16,
    first_seed=study.CONFIRM_SEEDS[0],
)
PRESETS["compute_tiny"] = dict(
    PRESETS["profiles_tiny"],
    stage="test",
    bpe=(),
    amounts=(1.0,),
    arms=("a", "b"),
    full_steps=60,
    patience=0,
    centre_shift=-1,
    budgets=(30, 60),
    seeds=2,
    first_seed=study.CONFIRM_SEEDS[0],
)
# Past early training (README, "Past early training: fixed before the
# runs"): the compute axis's design at longer budgets, BPE 2048 on all of the
# text at 10,000 steps (first rungs two below the 1000-step profile's) and
# characters at 3000 (one below), each arm's rate chosen clear of failed
# runs, then 16 fresh seeds per arm tested against PAST_HYPOTHESES. The
# 10,000-step runs evaluate every 200 steps, which costs a twentieth of the
# training where every 100 would cost a tenth.
PRESETS["past_2048"] = dict(
    PRESETS["compute"],
    full_steps=10000,
    centre_shift=-2,
    budgets=(1000, 3000, 10000),
    eval_every=200,
    choice="clear",
    first_seed=study.PAST_SEEDS[0],
)
PRESETS["past_char"] = dict(
    PRESETS["compute"],
    char=True,
    bpe=(),
    choice="clear",
    first_seed=study.PAST_SEEDS[0],
)
PRESETS["past_tiny"] = dict(
    PRESETS["compute_tiny"], choice="clear", first_seed=study.PAST_SEEDS[0]
)
# The width axis (README, "The width axis"), the GPU recipe's: BPE 2048 on
# all of the text, arms a and b at d_model 128, 256 and 512 (the base's 4
# layers, an MLP of 4 x d_model), each width a budget of about 20 tokens per
# parameter (budget_steps), profiled and tested as past_2048 is, on 16 fresh
# seeds of its own. The first rungs (centre_shift) move one rung down per
# tripling of the budget past past_2048's 10,000 steps and one per doubling
# of the width, a guess that the ladder corrects (up to 8 rungs past them).
WIDTH_SHIFTS = {128: -3, 256: -5, 512: -7}
PRESETS.update(
    {
        f"width_{width}": dict(
            PRESETS["compute"],
            d_model=width,
            tokens_per_param=20.0,
            centre_shift=shift,
            eval_every=200,
            choice="clear",
            first_seed=study.WIDTH_SEEDS[0],
        )
        for width, shift in WIDTH_SHIFTS.items()
    }
)
PRESETS["width_tiny"] = dict(
    PRESETS["compute_tiny"],
    d_model=16,
    tokens_per_param=1.0,
    choice="clear",
    first_seed=study.WIDTH_SEEDS[0],
)
# The tables whose test runs of the compute axis's cell at other budgets its
# report joins (each where it exists; paths from the repository's root): the
# confirmatory runs (1000 steps) and the CPU's compute axis (3000 steps, for
# the GPU recipe's 10,000-step report).
COMPUTE_TABLES = (
    "docs/tying_study/confirm/runs.csv",
    "docs/tying_study/compute/runs.csv",
)
# The committed tables of the cells past early training, whose hypotheses
# are one family.
PAST_TABLES = (
    "docs/tying_study/past_char/runs.csv",
    "docs/tying_study/past_2048/runs.csv",
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The profiled (vocabulary, fraction) cells of each base, cheapest first so
# that whole cells finish early: BPE 512 on 0.3% is where v2's "tied better"
# was mostly the arms' rates (issue 49), and its runs are cheap.
PROFILE_CELLS = {
    "nanogpt": ((512, 0.003), (None, 1.0), (2048, 1.0), (8192, 1.0)),
    "tiny": ((300, 0.2), (None, 1.0)),
}
# Ladder indices of each profiled cell's first rungs' centre: the ladder
# (-2 .. 3 around it) covers two rungs past v2's and the eight-rung check's
# best rates of arms a, b and c at 100%, and v2's rates at BPE 512 on 0.3%.
PROFILE_CENTRES = {512: 0, None: 4, 2048: 3, 8192: 4, 300: 2}
# The confirmatory hypotheses, fixed before the confirmatory runs
# (docs/tying_study/README.md, "Confirmatory hypotheses, fixed before the
# runs"), one per primary contrast of each profiled cell: (vocabulary as
# runs.csv writes it, fraction, x, y, prediction of x - y in test bits/char:
# +1 tied better, -1 untied better, 0 no difference within EQUIVALENCE_MARGIN;
# the v2 figure it comes from). Holm's family is these eight.
# fmt: off
HYPOTHESES = {
    "nanogpt": (
        ("char", 1.0, "b", "a", +1,
         "v2 +0.0563, Bonferroni [+0.0052, +0.1074], Holm p 0.022"),
        ("char", 1.0, "c", "a", +1,
         "v2 +0.0295, Bonferroni [+0.0137, +0.0454], Holm p 0.001"),
        ("2048", 1.0, "b", "a", -1,
         "eight rungs -0.0099, 95% [-0.0200, +0.0001], p 0.051"),
        ("2048", 1.0, "c", "a", 0,
         "eight rungs +0.0001, 95% [-0.0087, +0.0090], p 0.97"),
        ("8192", 1.0, "b", "a", 0,
         "eight rungs +0.0001, 95% [-0.0098, +0.0101], p 0.98"),
        ("8192", 1.0, "c", "a", +1,
         "eight rungs +0.0123, 95% [-0.0015, +0.0261], p 0.073"),
        ("512", 0.003, "b", "a", +1,
         "v2 +0.0418, Bonferroni [+0.0132, +0.0704], Holm p 0.004"),
        ("512", 0.003, "c", "a", +1,
         "v2 +0.0442, Bonferroni [+0.0050, +0.0833], Holm p 0.020"),
    ),
    # The tiny base's, for tests: each kind of prediction.
    "tiny": (
        ("300", 0.2, "b", "a", +1, "none (a test)"),
        ("300", 0.2, "c", "a", 0, "none (a test)"),
        ("char", 1.0, "b", "a", -1, "none (a test)"),
        ("char", 1.0, "c", "a", 0, "none (a test)"),
    ),
}
# The hypotheses past early training, fixed before their runs (README, "Past
# early training: fixed before the runs"), as HYPOTHESES has them plus the
# step budget: (vocabulary, fraction, steps, x, y, prediction, from). Holm's
# family is these two.
PAST_HYPOTHESES = {
    "nanogpt": (
        ("2048", 1.0, 10000, "b", "a", -1,
         "confirmed -0.0216 at 1000 steps; -0.0153 [-0.0202, -0.0105] at 3000"),
        ("char", 1.0, 3000, "b", "a", +1,
         "confirmed +0.0361 at 1000 steps, Bonferroni [+0.0183, +0.0539]"),
    ),
    "tiny": (
        ("char", 1.0, 60, "b", "a", +1, "none (a test)"),
    ),
}
# fmt: on
# The equivalence margin in test bits/char: the smallest published tying
# effect, Press & Wolf's 1.8% of per-word perplexity, on the study's scale
# (literature.equivalence_margin; v2's equivalence tests used it).
EQUIVALENCE_MARGIN = 0.0049
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
# The data every run reads. The committed runs (docs/tying_study,
# docs/compare) had no end-of-text token; restoring and resuming them needs
# the same data.
DATA = {
    "data.end_of_text": False,
    "data.split": "works",
    "data.tokenizer_fraction": 1.0,
    **HOLDOUT,
}
ABLATION_CELL = {"nanogpt": (2048, 0.03), "tiny": (300, 0.2)}


def parse(arg: str | None) -> dict:
    """The preset's values with the ``key=value`` items of ``arg`` applied;
    with ``tokens_per_param``, ``full_steps`` and ``budgets`` are the one
    budget it gives (:func:`budget_steps`)."""
    first, _, rest = (arg or "").partition(",")
    if first and "=" not in first:
        if first not in PRESETS:
            raise ValueError(
                f"Unknown preset {first!r}; the presets are {', '.join(PRESETS)}."
            )
        args = sweeps.parse_arg(rest, PRESETS[first])
    else:
        args = sweeps.parse_arg(arg, PRESETS["full"])
    if args["tokens_per_param"]:
        steps = budget_steps(args)
        args.update(full_steps=steps, budgets=(steps,))
    return args


def base_model(args: dict) -> tuple[shapes.Shape, shapes.Architecture]:
    """The tied arm's shape and the architecture of a parsed argument: the
    base config's (:data:`BASE_MODELS`), or with ``d_model`` its layers at
    that width with an MLP of 4 x ``d_model``.

    Raises:
        ValueError: ``d_model`` not a multiple of the attention heads.
    """
    shape, arch = BASE_MODELS[args["base"]]
    width = args["d_model"]
    if not width:
        return shape, arch
    if width % arch.num_heads:
        raise ValueError(
            f"d_model={width} is not a multiple of the {arch.num_heads} "
            "attention heads."
        )
    return shapes.Shape(True, width, shape.num_layers, 4 * width), arch


def budget_steps(args: dict) -> int:
    r"""The step budget that trains the one profiled cell's arms a and b
    about ``tokens_per_param`` (:math:`k`) tokens per parameter: with
    :math:`P_a` and :math:`P_b` their parameters and :math:`N` the tokens of
    a step (the base config's batch x block),
    :math:`T = k \sqrt{P_a P_b} / N`, the geometric mean's (a trains a
    little more than :math:`k` per parameter, b a little less), rounded to a
    multiple of ``eval_every``, at least one.

    Raises:
        ValueError: not one profiled cell.
    """
    pairs = profile_pairs(args) if args["profile"] else ()
    if len(pairs) != 1:
        raise ValueError(
            f"tokens_per_param={args['tokens_per_param']:g}: the budget is one "
            f"profiled cell's (profile=true); these arguments give {len(pairs)}."
        )
    ((vocab, _),) = pairs
    size = vocab_size(args["base"], {**DATA, **study.vocabulary_overrides(vocab)})
    shape, arch = base_model(args)
    a, b = (
        shapes.count_params(size, dataclasses.replace(shape, tied=tied), arch)
        for tied in (True, False)
    )
    config = configuration.load_config(args["base"])
    tokens = config.train.batch_size * config.data.block_size
    every = args["eval_every"]
    steps = args["tokens_per_param"] * math.sqrt(a * b) / tokens
    return every * max(1, round(steps / every))


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
    if args["budgets"]:
        compute_cell(args)
    if "e" in args["arms"] and not args["tune"]:
        raise ValueError(
            "Arm e unties at a step the tuning runs give: write tune=true."
        )
    vocabularies = ((None,) if args["char"] else ()) + tuple(args["bpe"])
    pairs, centres, fractions = None, CENTRES, args["amounts"]
    if args["profile"]:
        centres = {v: c + args["centre_shift"] for v, c in PROFILE_CENTRES.items()}
        pairs = profile_pairs(args)
        fractions = tuple(f for f in fractions if any(f == p for _, p in pairs))
    amounts = tuple(amount(args, f) for f in fractions)
    every = cadence(args, amounts)
    test_seeds = tuple(range(args["first_seed"], args["first_seed"] + args["seeds"]))
    if args["profile"] and args["stage"] == "test":
        named = {
            "confirmatory": study.CONFIRM_SEEDS,
            "past early training": study.PAST_SEEDS,
            "width axis": study.WIDTH_SEEDS,
        }
        if not any(set(test_seeds) <= set(seeds) for seeds in named.values()):
            raise ValueError(
                f"The profiles' test seeds {test_seeds} are not among the seeds "
                "named before the runs: "
                + "; ".join(f"{use} seeds {seeds}" for use, seeds in named.items())
                + "."
            )
    shared = {
        **DATA,
        "train.test_eval": True,
        **cadence_overrides(every),
        "train.eval_batches": args["eval_batches"],
        "train.eval_train_batches": EVAL_TRAIN_BATCHES,
        # A diverging rate ends with a NaN loss, which is never chosen,
        # instead of failing the stage.
        "train.stop_on_nonfinite": False,
        "sample.num_samples": 0,
    }
    base_shape, arch = base_model(args)
    return study.Design(
        base=args["base"],
        shared=shared,
        vocabularies=vocabularies,
        amounts=amounts,
        arms=tuple(args["arms"]),
        centres={v: centres[v] for v in vocabularies},
        test_seeds=test_seeds,
        tuning_seeds=tuple(args["tuning_seeds"]),
        grid=tuple(args["ladder"]) if args["tune"] else (0,),
        tune=args["tune"],
        extend_edges=args["extend"],
        shared_ladder=args["profile"],
        margin=args["margin"],
        table_multipliers=tuple(float(k) for k in args["multipliers"]),
        pairs=pairs,
        choice=args["choice"],
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


def profile_pairs(args: dict) -> tuple:
    """The profiled (vocabulary, fraction) cells of a parsed argument: those
    of ``PROFILE_CELLS`` among its vocabularies and amounts."""
    vocabularies = ((None,) if args["char"] else ()) + tuple(args["bpe"])
    return tuple(
        (v, f)
        for v, f in PROFILE_CELLS[args["base"]]
        if v in vocabularies and f in args["amounts"]
    )


def compute_cell(args: dict) -> tuple[str, float]:
    """The compute axis's cell, ``(vocabulary as runs.csv writes it,
    fraction)``, of a parsed argument with ``budgets``.

    Raises:
        ValueError: not one profiled cell, or ``full_steps`` not a budget.
    """
    pairs = profile_pairs(args) if args["profile"] else ()
    if len(pairs) != 1:
        raise ValueError(
            f"budgets={'+'.join(map(str, args['budgets']))}: the compute axis is "
            f"one profiled cell (profile=true), not {len(pairs)}."
        )
    if args["full_steps"] not in budgets(args):
        raise ValueError(
            f"full_steps={args['full_steps']} is not among budgets="
            f"{'+'.join(map(str, budgets(args)))}: the sweep's budget is one of "
            "the report's."
        )
    vocab, fraction = pairs[0]
    return study.vocabulary_label(vocab), fraction


def budgets(args: dict) -> tuple[int, ...]:
    """The step budgets of the compute axis, ascending."""
    return tuple(sorted(int(b) for b in args["budgets"]))


def amount(args: dict, fraction: float) -> study.Amount:
    """The data amount ``fraction`` of a parsed argument: the full split
    ``full_steps``, a subset ``subset_steps``, with ``subset_eval_every`` and
    ``subset_patience`` when set (0 and -1: the shared cadence and patience)."""
    if fraction >= 1.0:
        return study.Amount(fraction, args["full_steps"])
    return study.Amount(
        fraction,
        args["subset_steps"],
        eval_every=args["subset_eval_every"] or None,
        patience=None if args["subset_patience"] < 0 else args["subset_patience"],
    )


def cadence(args: dict, amounts) -> int:
    """The evaluation interval that ``amounts`` share (their own, else
    ``eval_every``); ``eval_every`` when they differ, for a report (a sweep
    refuses them: :func:`get_sweep`)."""
    own = {a.eval_every or args["eval_every"] for a in amounts}
    return own.pop() if len(own) == 1 else args["eval_every"]


def cadence_overrides(every: int) -> dict:
    """The shared overrides of an evaluation interval ``every``."""
    return {
        "train.eval_every": every,
        "train.log_every": every,
        "train.checkpoint_every": 5 * every,
    }


def get_sweep(arg=None, workdir=None):
    """The runs to train: the grid without ``workdir``; else the plan so far
    (``study.read_plan``), for the profiles' test stage (the confirmatory
    runs) its test runs only, of the cells whose profile has finished. The
    runs' amounts must share an evaluation interval, which the shared
    overrides take."""
    design, args = get_study(arg), parse(arg)
    stage = args["stage"]
    if not design.tune:
        runs = design.test_runs(study.choose_learning_rates(design, {}), {})
    elif workdir is None:
        if stage == "test":
            raise ValueError(
                "stage=test reads the tuning runs: it needs the sweep directory."
            )
        runs = design.tuning_runs()  # the grid; its extensions need its results
    elif design.shared_ladder and stage == "test":
        plan = study.read_plan(design, workdir, strict=False)
        runs = [p for p in plan if p.role != "tune"]
        if not runs:
            cells = ", ".join(
                f"{study.vocabulary_label(g[0].vocab)} on {g[0].amount.fraction:g}"
                for g in design.ladders()
            )
            raise ValueError(
                f"No profile of these cells has finished in {workdir} ({cells}): "
                "nothing to test yet (the report lists them as profile "
                "unfinished). Finish the profiles (stage=tune), or restore "
                "them (--restore_from=docs/tying_study/profiles/runs.csv"
                + (", the compute axis's: compute/runs.csv" if args["budgets"] else "")
                + ")."
            )
    else:
        runs = list(study.read_plan(design, workdir, test=stage == "test"))
    if not runs:
        return design.base, [], design.shared
    amounts = dict.fromkeys(r.cell.amount for r in runs)
    every = {a: a.eval_every or design.shared["train.eval_every"] for a in amounts}
    if len(set(every.values())) > 1:
        raise ValueError(
            "The amounts evaluate at different intervals "
            f"({', '.join(f'{a.fraction}: every {e}' for a, e in every.items())}), "
            "which runs share: sweep each amount on its own (amounts=...) into "
            "the same directory."
        )
    shared = {**design.shared, **cadence_overrides(set(every.values()).pop())}
    return design.base, [design.overrides(r) for r in runs], shared


def restore_runs(csv_path, workdir):
    """Recreates in ``workdir`` the finished runs of a committed ``runs.csv``
    that it lacks (``results.restore_runs``), so that ``make study`` on a
    fresh machine resumes where ``docs/tying_study/runs.csv`` stands."""
    from studies.tying import results

    return results.restore_runs(csv_path, workdir)


def write_report(arg, sweep_dir, out_dir):
    """``runs.csv``, REPORT.md and the plots of ``sweep_dir`` into ``out_dir``
    (``studies/tying/results.py``): ``(the answer to print, plot
    paths)``, the answer being ``analysis.answer``'s sentence and table, or
    for a design of shared ladders its REPORT.md: the compute axis's
    (budgets, ``compute.py``), the confirmatory tests' (stage=test,
    ``confirm.py``), the mechanism test's (table multipliers,
    ``mechanism.py``), else the profiles' (the tuning stage's runs,
    ``profiles.py``)."""
    from studies.tying import analysis, results, table  # the report's only

    design = get_study(arg)
    if design.shared_ladder:
        test = parse(arg)["stage"] == "test"
        return results.write_report(
            design, sweep_dir, out_dir, test=test, from_csv=report_from_csv(arg)
        )
    _, plots = results.write_report(design, sweep_dir, out_dir)
    rows = table.read_rows(os.path.join(out_dir, results.RUNS_CSV))
    return analysis.answer(rows), plots


def report_from_csv(arg):
    """The function ``(runs.csv's path, out_dir) -> (REPORT.md's text, plot
    paths)`` that writes the report of a design of shared ladders from its
    table alone (:func:`write_report` says which)."""
    from studies.tying import compute, confirm, mechanism, profiles

    args = parse(arg)
    if args["budgets"]:
        cell = compute_cell(args)
        past = [
            h
            for h in PAST_HYPOTHESES[args["base"]]
            if h[:3] == (*cell, args["full_steps"])
        ]
        return functools.partial(
            compute.report_from_csv,
            cell=cell,
            budgets=budgets(args),
            others={f"`{p}`": os.path.join(ROOT, p) for p in COMPUTE_TABLES},
            # Past early training: its hypotheses, Holm over the whole family,
            # whose other cells' runs are in their own committed tables.
            hypotheses=PAST_HYPOTHESES[args["base"]] if past else (),
            family=[os.path.join(ROOT, p) for p in PAST_TABLES] if past else (),
        )
    if args["stage"] == "test":
        hypotheses = [confirm.Hypothesis(*h) for h in HYPOTHESES[args["base"]]]
        return functools.partial(
            confirm.report_from_csv,
            hypotheses=hypotheses,
            margin=EQUIVALENCE_MARGIN,
        )
    if args["multipliers"]:
        return mechanism.report_from_csv
    return profiles.report_from_csv
