r"""Gradient filtering of the fused cross-entropy on trained models' hidden states.

    python experiments/bench/bench_filter.py --workdir=/tmp/filter/bpe8192 \
        --vocab_size=8192 --train_steps=400
    python experiments/bench/bench_filter.py --workdir=/tmp/filter/bpe8192 \
        --workdir=runs/compare/<run>            # runs trained before
    python experiments/bench/bench_filter.py --quick --workdir=/tmp/f --vocab_size=300  # tiny config, 128 tokens, 1 round

Random ``h`` and ``w`` give a flat softmax where nothing can be skipped; a
trained model's softmax puts almost no mass on most of a large vocabulary.
For each ``--workdir`` (a run of ``experiments/train.py``; one without a
checkpoint is trained first by :func:`recipe`, the tying study's arm a at
BPE ``--vocab_size`` on all of the training text), the run's hidden states
and table on ``--tokens`` tokens of its validation text (evenly spaced
windows of its block size) go through ``jax.value_and_grad`` w.r.t. ``h``
and ``w`` of the materialized cross-entropy, the exact fused one and the
fused one at each ``--filter_eps``, each in the table's row order and in
each ``--vocab_order`` (``frequency``: the run's training tokens counted,
``fused.frequency_order``; ``mean_logit``: computed in the loss), at the
engine's default vocabulary blocks and at each of ``--block_rows``, timed
in alternating rounds (``timing.alternate``; wall and CPU time). Each row has the fraction
``f`` of tiles skipped in its order (``head_tables.skipped_fraction``, from
the softmax apart from the sweep), the bound ``1/3 + 2/3 (1 - f)`` of the
time against exact, the times' ratios to the exact fused loss in the
table's order at the same blocks and to the materialized loss (wall
time), the CPU time and its ratio to that exact loss's, and the
relative error (Frobenius) of ``dh`` and ``dw`` against that exact
gradient. docs/fused_loss.md has the results ("Measured on trained models",
"Vocabulary sorting").
"""

import contextlib
import itertools
import json
import os

import head_tables  # experiments/bench/head_tables.py, beside this file
import jax
import jax.numpy as jnp
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags

from lmhead import _sweep_options, _vocab_order, fused, head, losses
from lmhead.lm import configuration, data, generation, loop, train
from lmhead.lm import model as model_lib

timing.cli.workdir_flag(repeatable=True)  # each run is measured
flags.DEFINE_integer(
    "vocab_size", None, "BPE size of the runs this benchmark trains.", lower_bound=256
)
flags.DEFINE_integer(
    "train_steps",
    1000,
    "Steps of the runs it trains (the study's cap: 1000).",
    lower_bound=1,
)
flags.DEFINE_integer("tokens", 8192, "Validation tokens measured.", lower_bound=1)
flags.DEFINE_list(
    "filter_eps",
    ["0.000244140625", "auto"],
    "filter_eps values (numbers or auto); 2^-12 is bfloat16's auto.",
)
flags.DEFINE_list(
    "block_rows", ["256"], "Vocabulary rows per block besides the engine's default."
)
flags.DEFINE_list(
    "vocab_order",
    ["frequency", "mean_logit"],
    "Row orders besides the table's own: frequency (the run's training "
    "tokens, most frequent first) and mean_logit (computed in the loss).",
)
flags.DEFINE_integer("rounds", 3, "Alternating timing rounds.", lower_bound=1)
timing.cli.quick_flag()
FLAGS = flags.FLAGS

# The run this benchmark trains: the recipe of configs/sweeps/filter_training.py
# (the tying study's arm a on all of the text), whose exact seed 0 it is.
SWEEP_FILE = os.path.join(
    os.path.dirname(__file__), "..", "..", "configs", "sweeps", "filter_training.py"
)
HEADER = (
    "run",
    "V",
    "N",
    "D",
    "chunk",
    "block rows",
    "filter_eps",
    "order",
    "tiles skipped",
    "bound",
    "s",
    "x exact",
    "x materialized",
    "cpu s",
    "cpu x exact",
    "dh rel. error",
    "dw rel. error",
)


def recipe(vocab_size: int, steps: int, quick: bool = False):
    """The config of a run this benchmark trains (``RECIPE`` of
    :data:`SWEEP_FILE`, without a test evaluation and with one checkpoint at
    the end; ``quick``: the tiny config at BPE ``vocab_size``, for tests)."""
    if quick:
        config = configuration.load_config(f"tiny,bpe={vocab_size}")
        overrides = {"train.test_eval": False, "sample.num_samples": 0}
    else:
        config = configuration.load_config("nanogpt")
        recipe = configuration.load_module(SWEEP_FILE).RECIPE
        overrides = {**recipe, "data.vocab_size": vocab_size}
    overrides |= {"train.steps": steps, "train.checkpoint_every": steps}
    for name, value in overrides.items():
        section, key = name.split(".")
        config[section][key] = value
    configuration.validate_config(config)
    return config


def validation_batch(workdir: str, tokens: int):
    """``(h [N, D], w [V, D], labels [N], val bits/char)`` of a trained run:
    its newest checkpoint's hidden states on evenly spaced windows of its
    validation text, each position labelled with the next token."""
    config, _, model, params = generation.load_run(workdir)
    if model.head_rank is not None or model.head_bias or model.head_scale:
        raise ValueError(
            f"{workdir}: a factorized, biased or scaled head is not measured here."
        )
    dataset = data.load_dataset(config.data, workdir)
    val = dataset.val_tokens
    block = model.max_len
    count = max(1, tokens // block)
    starts = np.linspace(0, len(val) - block - 1, count).astype(int)
    windows = jnp.asarray(val[starts[:, None] + np.arange(block + 1)], jnp.int32)
    h = model.apply(
        {"params": params}, windows[:, :-1], method=model_lib.DecoderLM.hidden
    )
    w = params["embed"]["embedding"] if model.tied else params["head"]["unembedding"]
    with open(os.path.join(workdir, loop.SUMMARY_FILE)) as f:
        best = json.load(f)["best"]
    counts = np.bincount(dataset.train_tokens, minlength=w.shape[0])
    return (
        h.reshape(-1, h.shape[-1]),
        jnp.asarray(w, h.dtype),
        windows[:, 1:].reshape(-1),
        best.get("eval/bits_per_char"),
        model.logits_softcap,
        counts,
    )


@contextlib.contextmanager
def vocab_block_rows(rows: int | None):
    """The fused sweep's vocabulary rows per block on this platform, for the
    programs traced inside (None: the engine's default)."""
    table = _sweep_options.VOCAB_BLOCK_ROWS
    platform = jax.default_backend()
    key = platform if platform in table else "cpu"
    default = table[key]
    table[key] = default if rows is None else rows
    try:
        yield
    finally:
        table[key] = default


def programs(h, w, labels, softcap, eps_values, block_rows, orders):
    """``{name: compiled value_and_grad}``: "materialized", and for each block
    size ``(rows, eps, order)``: ``eps`` None (exact) or each value, ``order``
    None (the table's) or each of ``orders`` (``{name: order [V] or
    "mean_logit"}``)."""

    def compiled(loss):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return step.lower(h, w).compile()

    out = {
        "materialized": compiled(
            lambda h, w: losses.cross_entropy(
                head.unembed(h, w, softcap=softcap), labels
            )[0]
        )
    }
    for rows in block_rows:
        with vocab_block_rows(rows):
            for eps in [None, *eps_values]:
                for name in [None, *orders]:
                    out[rows, eps, name] = compiled(
                        lambda h, w, eps=eps, name=name: fused.fused_cross_entropy(
                            h,
                            w,
                            labels,
                            softcap=softcap,
                            filter_eps=eps,
                            vocab_order=None if name is None else orders[name],
                        )[0]
                    )
    return out


def rows_of_run(name, workdir, eps_values, block_rows, tokens, rounds, order_names):
    """The table's rows of one run, and a line on how trained it is."""
    h, w, labels, val_bpc, softcap, counts = validation_batch(workdir, tokens)
    (n, d), v = h.shape, w.shape[0]
    orders = {
        "frequency": _vocab_order.frequency_order(counts),
        "mean_logit": "mean_logit",
    }
    orders = {k: orders[k] for k in order_names}
    compiled = programs(h, w, labels, softcap, eps_values, block_rows, orders)
    median = timing.alternate(
        compiled,
        None,
        rounds,
        setups={key: lambda: (h, w) for key in compiled},
        clock=timing.wall_and_cpu,
    )
    out = []
    for rows in block_rows:
        chunk, rows_used, _ = _with_rows(rows, n, v)
        exact = compiled[rows, None, None](h, w)[1]
        for eps, order in itertools.product([None, *eps_values], [None, *orders]):
            value = (
                None
                if eps is None
                else _sweep_options.SweepOptions(filter_eps=eps).gradient_options(
                    h.dtype
                )["filter_eps"]
            )
            f = 0.0
            if eps is not None:
                perm = orders.get(order)
                if isinstance(perm, str):
                    perm = _vocab_order.mean_logit_order(h, w)
                perm = np.arange(v) if perm is None else np.asarray(perm)
                inverse = np.argsort(perm)
                f = float(
                    head_tables.skipped_fraction(
                        h,
                        w[perm],
                        inverse[np.asarray(labels)],
                        chunk=chunk,
                        rows=rows_used,
                        eps=value,
                    )
                )
            grads = compiled[rows, eps, order](h, w)[1]
            error = [
                float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))
                for g, e in zip(grads, exact)
            ]
            seconds, cpu = median[rows, eps, order]
            out.append(
                (
                    name,
                    v,
                    n,
                    d,
                    chunk,
                    rows_used,
                    "exact" if eps is None else f"{eps} ({value:.3g})",
                    order or "table",
                    f"{f:.1%}",
                    f"{1 / 3 + 2 / 3 * (1 - f):.2f}",
                    f"{seconds:.3g}",
                    f"{seconds / median[rows, None, None][0]:.2f}",
                    f"{seconds / median['materialized'][0]:.2f}",
                    f"{cpu:.3g}",
                    f"{cpu / median[rows, None, None][1]:.2f}",
                    f"{error[0]:.1e}",
                    f"{error[1]:.1e}",
                )
            )
    trained = f"{name}: V = {v}, validation bits/char {val_bpc}, {workdir}"
    return out, trained


def _with_rows(rows, n, v):
    with vocab_block_rows(rows):
        return _sweep_options.block_sizes(n, v, None, None)


def main(argv):
    del argv
    tokens, rounds = (128, 1) if FLAGS.quick else (FLAGS.tokens, FLAGS.rounds)
    eps_values = [x if x == "auto" else float(x) for x in FLAGS.filter_eps]
    block_rows = [None, *(int(r) for r in FLAGS.block_rows)]
    print(f"{timing.machine()}; {rounds} rounds, medians", flush=True)
    table, trained = [], []
    for workdir in FLAGS.workdir:
        if not os.path.isfile(os.path.join(workdir, loop.SUMMARY_FILE)):
            if FLAGS.vocab_size is None:
                raise app.UsageError(f"{workdir} is not a finished run: --vocab_size.")
            config = recipe(FLAGS.vocab_size, FLAGS.train_steps, FLAGS.quick)
            train.train_and_evaluate(config, workdir)
        name = os.path.basename(os.path.normpath(workdir))
        out, line = rows_of_run(
            name, workdir, eps_values, block_rows, tokens, rounds, FLAGS.vocab_order
        )
        table += out
        trained.append(line)
    print("\n".join(trained))
    print(timing.table(HEADER, table))


if __name__ == "__main__":
    app.run(main)
