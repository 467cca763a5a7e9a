r"""Fused vs materialized linear + cross-entropy: time and compiled memory.

    python experiments/bench/bench_head.py            # docs/fused_loss.md's table
    python experiments/bench/bench_head.py --quick    # small shapes, 2 repeats, a few seconds
    python experiments/bench/bench_head.py --shapes=8192,512,32768

For each ``(N, D, V)`` it compiles ``jax.value_and_grad`` (w.r.t. ``h`` and
``w``) of ``fused.fused_cross_entropy`` and of ``losses.cross_entropy(
head.unembed(h, w), labels)``, reads XLA's ``temp_size_in_bytes`` of each
compiled program, and times them in alternation with a square float32 matmul
(``timing.Matmul``; median of ``--repeats`` rounds after one warm-up; fewer
rounds when a run is long), so that all three see the same load on a shared
machine. A
program that needs more than ``--memory_fraction`` of the available memory
is compiled but not run. The effective rate counts the ``6 N D V`` FLOPs of
the three matmuls of the materialized path (logits, ``dh``, ``dw``).

``--zero_fraction=0.5,0.9`` and ``--entropy`` time the fused loss alone
instead (at the first of the shapes, or ``--shapes``): ``jax.value_and_grad``
with that fraction of tokens at weight 0 (random positions, skipped by
``skip_zero_weights``) against all tokens weighted, and the forward with
``entropy=True`` against without, all in alternating rounds::

    python experiments/bench/bench_head.py --zero_fraction=0.5,0.9 --entropy

``--distillation=forward_kl,jsd`` times ``distillation.fused_distillation_loss``
against ``distillation.distillation_loss`` of the materialized logits the
same way (at the first shape, or ``--shapes``), the teacher given as its
logits or, with ``--teacher=head``, as its own ``(h_t, w_t)``::

    python experiments/bench/bench_head.py --distillation=forward_kl,jsd

``--post_training=dpo,grpo`` times ``preference.fused_preference_loss``
(sigmoid DPO with a reference head) and
``policy_gradient.fused_policy_gradient_loss`` (GRPO with old and reference
log-probs given) against the same losses on the materialized logits'
log-softmax, the same way (at the first shape, or ``--shapes``), on
sequences of ``N / 16`` tokens::

    python experiments/bench/bench_head.py --post_training=dpo,grpo

``--filter_eps=auto,1e-4`` times the fused cross-entropy with each
``filter_eps`` against the exact fused and the materialized losses, with the
tiles skipped and the gradients' error, on random or (``--peaked``)
synthetic trained-like inputs; ``--dw_accumulation`` each accumulation of
``dw``, with its error against float64::

    python experiments/bench/bench_head.py --filter_eps=auto,1e-4 --peaked
    python experiments/bench/bench_head.py --dw_accumulation --dtype=bfloat16

``--preset=gemma2`` prints one table at Gemma 2 2B's head (N = 8192,
D = 2304, V = 256,000, bfloat16), the shape Cut Cross-Entropy's paper times:
the forward and forward + backward of the fused and materialized losses, and
of Liger's ``LigerFusedLinearCrossEntropyLoss`` and CCE's
``linear_cross_entropy`` when torch, a CUDA device and their packages are
there (each checked for the fused loss's value before it is timed; a peer
that cannot run is named with why). Memory is XLA's compiled temporaries for
the JAX programs and torch's peak allocation for the peers. On a GPU::

    python experiments/bench/bench_head.py --preset=gemma2

``--quantized`` measures the inference head with a smaller table instead
(``quantize.quantize_unembedding``: bfloat16, float16, int8 with per-row
scales) against float32::

    python experiments/bench/bench_head.py --quantized --workdir=runs/bpe8192
    python experiments/bench/bench_head.py --quantized --quick --workdir=RUN

For each ``V`` in ``--vocab_sizes`` and ``B`` in ``--rows`` it times
``head.unembed`` of ``[B, D] @ [V, D]^T`` (jitted, float32 ``h``) with each
table, in alternation with float32, and prints the table's bytes and both
ratios. Accuracy (top-1 agreement with float32 and the mean KL(float32 ||
quantized) of the next-token distribution) is measured on a trained run's
table and the hidden states of its validation text (``--workdir``), and,
labelled as such, on random-normal tables whose logits have std 3. The
results and the machine they were measured on are in ``docs/fused_loss.md``
and ``docs/large_vocab.md``.

The ``--quantized`` tables and the memory and byte formats that all the
tables share are in ``head_tables.py`` beside this file; this one holds the
flags and the loss tables.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags, logging
from head_tables import (  # experiments/bench/head_tables.py, beside this file
    ACCUMULATION_HEADER,
    FILTER_HEADER,
    GIB,
    POST_TRAINING,
    accumulation_rows,
    available_bytes,
    filter_rows,
    format_bytes,
    format_ratio,
    post_training_steps,
    post_training_target,
    print_quantized,
)

from lmhead import distillation, fused, head, losses

DEFAULT_SHAPES = [
    "8192,512,32768",  # the shape of the targets
    *(
        f"{n},{d},{v}"
        for n in (4096, 16384)
        for d in (256, 1024)
        for v in (8192, 32768, 131072)
    ),
    "16384,256,262144",  # logits alone need 16 GiB (N V float32): where
]  # memory is short, only the fused path runs
QUICK_SHAPES = ["512,64,1024", "1000,96,3000"]

flags.DEFINE_list(
    "shapes",
    None,
    "N,D,V triples, e.g. '8192,512,32768;4096,256,8192'; default: docs/fused_loss.md's table.",
)
timing.cli.quick_flag()
flags.DEFINE_integer(
    "repeats",
    5,
    "Timed runs per program (median), fewer "
    "when one run takes more than --seconds_per_program / "
    "repeats.",
    lower_bound=1,
)
flags.DEFINE_float(
    "seconds_per_program",
    60.0,
    "Time budget of the timed runs of one program at one shape (at least one run).",
)
flags.DEFINE_integer("chunk_size", None, "fused chunk_size (default: auto).")
flags.DEFINE_integer("vocab_chunk_size", None, "fused vocab_chunk_size.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "dtype of h and w.")
timing.cli.matmul_size_flag(4096)
flags.DEFINE_float(
    "memory_fraction",
    0.6,
    "Fraction of the available memory "
    "a program may use to be run (the machine may be shared).",
)
flags.DEFINE_bool(
    "quantized",
    False,
    "Measure half-precision and int8 unembedding tables against float32 instead.",
)
timing.cli.workdir_flag(required=False)  # --quantized: the accuracy's run
flags.DEFINE_list(
    "vocab_sizes", ["32000", "50257", "128256"], "--quantized: V of the timed tables."
)
flags.DEFINE_list("rows", ["1", "8", "32"], "--quantized: B, rows of h.")
flags.DEFINE_integer("width", 512, "--quantized: D of the timed tables.")
flags.DEFINE_integer(
    "positions",
    4096,
    "--quantized: validation positions "
    "(and random rows) on which accuracy is measured.",
)
flags.DEFINE_list(
    "zero_fraction",
    [],
    "Fractions of tokens at weight 0 (random positions), e.g. 0.5,0.9: "
    "time the fused forward + backward with each against all weighted.",
)
flags.DEFINE_bool(
    "entropy", False, "Time the fused forward with entropy=True against without."
)
flags.DEFINE_list(
    "distillation",
    [],
    "Divergences (forward_kl, reverse_kl, jsd) of the distillation loss to "
    "time instead of the cross-entropy: fused_distillation_loss against "
    "distillation_loss of the materialized logits.",
)
flags.DEFINE_enum(
    "teacher",
    "logits",
    ["logits", "head"],
    "--distillation: the teacher as its logits (an input) or as its own "
    "(h_t, w_t), D_t = D, whose logits each path computes as it computes the "
    "student's.",
)
flags.DEFINE_list(
    "post_training",
    [],
    "Post-training losses (dpo, grpo) to time instead of the cross-entropy: "
    "fused against the same loss of the materialized logits.",
)
flags.DEFINE_enum(
    "preset",
    None,
    list(PRESETS := {"gemma2": (8192, 2304, 256_000)}),
    "One table for a published shape, forward and forward + backward of "
    "the fused and materialized losses in bfloat16, beside Liger's and Cut "
    "Cross-Entropy's when torch, a CUDA device and their packages are there "
    "(gemma2: Gemma 2 2B's head, N=8192, D=2304, V=256000, as Cut "
    "Cross-Entropy's paper times it). --shapes overrides the shape.",
)
flags.DEFINE_list(
    "filter_eps",
    [],
    "filter_eps values (numbers or auto) of the fused cross-entropy to time "
    "against the exact fused and the materialized losses.",
)
flags.DEFINE_bool("peaked", False, "--filter_eps: synthetic trained-like inputs.")
flags.DEFINE_bool("dw_accumulation", False, "Time and check dw's accumulations.")
FLAGS = flags.FLAGS


def make_losses(chunk_size, vocab_chunk_size, divergence=None, teacher="logits"):
    """``{"fused": loss, "materialized": loss}``, ``loss(h, w, target) ->
    (loss, metrics)``; ``target`` is the labels, or with ``divergence`` the
    teacher (see :func:`make_target`)."""

    def materialized(h, w, target):
        if divergence is None:
            return losses.cross_entropy(head.unembed(h, w), target)
        teacher_logits = target if teacher == "logits" else head.unembed(*target)
        return distillation.distillation_loss(
            head.unembed(h, w), teacher_logits, divergence=divergence
        )

    def fused_loss(h, w, target):
        if divergence is None:
            return fused.fused_cross_entropy(
                h, w, target, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size
            )
        return distillation.fused_distillation_loss(
            h, w, target, divergence=divergence, chunk_size=chunk_size
        )

    return {"fused": fused_loss, "materialized": materialized}


def make_steps(*args, **kwargs):
    """``{"fused": step, "materialized": step}``: each of
    :func:`make_losses`' losses as a jitted ``value_and_grad`` w.r.t. ``h``
    and ``w``."""
    return {
        name: jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        for name, loss in make_losses(*args, **kwargs).items()
    }


def make_target(key, n, d, v, dtype, teacher):
    """The labels ``[n]`` (``teacher=None``), a teacher's logits ``[n, v]``
    (``"logits"``, float32, std 2) or its ``(h_t [n, d], w_t [v, d])``
    (``"head"``)."""
    if teacher is None:
        return jax.random.randint(key, (n,), 0, v)
    if teacher in ("dpo", "grpo"):
        return post_training_target(key, n, d, v, dtype, teacher)
    if teacher == "logits":
        return 2.0 * jax.random.normal(key, (n, v))
    h_key, w_key = jax.random.split(key)
    return (
        jax.random.normal(h_key, (n, d), dtype),
        (0.05 * jax.random.normal(w_key, (v, d))).astype(dtype),
    )


def bench_shape(
    n: int,
    d: int,
    v: int,
    steps,
    matmul,
    dtype,
    repeats: int,
    seconds: float,
    memory_fraction: float,
    teacher: str | None = None,
) -> dict:
    """Compiled memory and median times of each program at one shape.

    ``matmul`` (``timing.Matmul``) is a reference timed in the same rounds;
    ``teacher`` is the distillation target's form, None for the labels.
    """
    keys = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(keys[0], (n, d), dtype)
    w = (0.02 * jax.random.normal(keys[1], (v, d))).astype(dtype)
    labels = make_target(keys[2], n, d, v, dtype, teacher)
    row = {"shape": (n, d, v)}
    compiled = {}
    for name, step in steps.items():
        compiled[name] = step.lower(h, w, labels).compile()
        stats = compiled[name].memory_analysis()
        row[name + "_temp"] = stats.temp_size_in_bytes
        row[name + "_total"] = (
            stats.temp_size_in_bytes
            + stats.argument_size_in_bytes
            + stats.output_size_in_bytes
        )
    row["available"] = available_bytes()
    runnable = [
        name
        for name in compiled
        if row[name + "_total"] <= memory_fraction * row["available"]
    ]
    warmup = max(
        [timing.call_seconds(compiled[name], (h, w, labels)) for name in runnable],
        default=seconds,
    )
    runs = int(np.clip(seconds // warmup, 1, repeats))
    times = {name: [] for name in runnable + ["matmul"]}
    for _ in range(runs):  # alternate, so all see the same load
        for name in runnable:
            times[name].append(timing.call_seconds(compiled[name], (h, w, labels)))
        times["matmul"].append(matmul.seconds())
    row["matmul_rate"] = matmul.flops / float(np.median(times["matmul"]))
    for name in compiled:
        row[name + "_time"] = float(np.median(times[name])) if name in times else None
    row["runs"] = runs
    return row


def time_cell(row: dict, name: str) -> str:
    if row[name + "_time"] is not None:
        return f"{row[name + '_time']:.3g}"
    needs, free = row[name + "_total"], row["available"]
    if needs > free:
        return f"does not fit (needs {format_bytes(needs)})"
    return f"not run (needs {format_bytes(needs)} of {format_bytes(free)} free)"


def format_row(row: dict) -> str:
    n, d, v = row["shape"]
    flops = 6.0 * n * d * v
    fused_time, mat_time = row["fused_time"], row["materialized_time"]

    def rate(seconds):
        return "-" if seconds is None else f"{flops / seconds / 1e9:.0f}"

    cells = [
        f"{n}",
        f"{d}",
        f"{v}",
        time_cell(row, "fused"),
        time_cell(row, "materialized"),
        "-" if None in (fused_time, mat_time) else f"{fused_time / mat_time:.2f}",
        format_bytes(row["fused_temp"]),
        format_bytes(row["materialized_temp"]),
        format_ratio(row["fused_temp"] / row["materialized_temp"]),
        rate(fused_time),
        rate(mat_time),
        f"{row['matmul_rate'] / 1e9:.0f}",
        "-" if fused_time is None else f"{flops / fused_time / row['matmul_rate']:.0%}",
        f"{row['runs']}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| N | D | V | fused s | materialized s | time ratio | fused temp | "
    "materialized temp | memory ratio | fused GFLOP/s | materialized "
    "GFLOP/s | matmul GFLOP/s | fused / matmul | runs |\n|" + "---|" * 14
)


def parse_shapes(specs: list[str]) -> list[tuple[int, int, int]]:
    triples = ",".join(specs).replace(";", ",").split(",")
    if len(triples) % 3:
        raise app.UsageError(f"--shapes needs N,D,V triples; got {specs}.")
    numbers = [int(x) for x in triples]
    return [tuple(numbers[i : i + 3]) for i in range(0, len(numbers), 3)]


def quantized_setting(quick: bool) -> tuple[list[int], list[int], int, int]:
    """``(vocab_sizes, rows, width, positions)``: the flags, or small values
    with ``--quick`` for those not given."""
    small = dict(vocab_sizes=["4096", "8192"], rows=["1", "8"], width=64, positions=512)
    value = {
        name: small[name] if quick and not FLAGS[name].present else FLAGS[name].value
        for name in small
    }
    return (
        [int(v) for v in value["vocab_sizes"]],
        [int(b) for b in value["rows"]],
        value["width"],
        value["positions"],
    )


def run_quantized(quick: bool, repeats: int, matmul) -> None:
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs a restore at INFO
    vocab_sizes, rows, width, positions = quantized_setting(quick)
    print_quantized(vocab_sizes, rows, width, positions, FLAGS.workdir, repeats, matmul)


def zero_weights(n: int, fraction: float, seed: int = 0) -> np.ndarray:
    """``[n]`` weights: ``round(fraction * n)`` zeros at random positions."""
    weights = np.ones(n, np.float32)
    zeros = np.random.default_rng(seed).permutation(n)[: round(fraction * n)]
    weights[zeros] = 0.0
    return weights


def skip_entropy_programs(n, zero_fractions, entropy, chunk_size, vocab_chunk_size):
    """``[(label, compiled-to-be function, weights, baseline label)]``."""

    def loss(h, w, labels, weights, entropy=False):
        return fused.fused_cross_entropy(
            h,
            w,
            labels,
            weights=weights,
            entropy=entropy,
            skip_zero_weights=True,
            chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size,
        )

    train = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    base = "fused fwd+bwd, all weighted"
    programs = [(base, train, np.ones(n, np.float32), base)]
    programs += [
        (f"fused fwd+bwd, {f:.0%} weight 0", train, zero_weights(n, f), base)
        for f in zero_fractions
    ]
    if entropy:
        forward = "fused fwd"
        programs += [
            (forward, jax.jit(loss), np.ones(n, np.float32), forward),
            (
                "fused fwd + entropy",
                jax.jit(functools.partial(loss, entropy=True)),
                np.ones(n, np.float32),
                forward,
            ),
        ]
    return programs


def skip_entropy_rows(n, d, v, dtype, repeats, seconds) -> list[str]:
    """Median times of the fused loss with weight-0 tokens and with entropy,
    each against its baseline, timed in alternating rounds."""
    keys = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(keys[0], (n, d), dtype)
    w = (0.02 * jax.random.normal(keys[1], (v, d))).astype(dtype)
    labels = jax.random.randint(keys[2], (n,), 0, v)
    programs = skip_entropy_programs(
        n,
        [float(f) for f in FLAGS.zero_fraction],
        FLAGS.entropy,
        FLAGS.chunk_size,
        FLAGS.vocab_chunk_size,
    )
    calls = [(fn, (h, w, labels, jnp.asarray(wt))) for _, fn, wt, _ in programs]
    warmup = max(timing.call_seconds(fn, args) for fn, args in calls)
    runs = int(np.clip(seconds // warmup, 1, repeats))
    times = [[] for _ in calls]
    for _ in range(runs):  # alternate, so all see the same load
        for column, (fn, args) in zip(times, calls):
            column.append(timing.call_seconds(fn, args))
    median = {label: float(np.median(t)) for (label, *_), t in zip(programs, times)}
    return [
        f"| {n} | {d} | {v} | {label} | {int(np.sum(wt == 0))} | "
        f"{median[label]:.3g} | {median[label] / median[base]:.2f} | {runs} |"
        for label, _, wt, base in programs
    ]


SKIP_ENTROPY_HEADER = (
    "| N | D | V | program | weight-0 tokens | s | x baseline | runs |\n|" + "---|" * 8
)


def torch_peers(h, w, labels) -> tuple[dict, list[str]]:
    """``{name: (forward, train)}`` of the torch peers that can run here,
    each a function of no arguments returning the loss (``train`` after its
    backward pass), and a note for each peer that cannot (why)."""
    try:
        import torch
    except ImportError:
        return {}, ["Liger, CCE: torch is not installed"]
    if not torch.cuda.is_available():
        return {}, ["Liger, CCE: torch sees no CUDA device"]
    to_torch = {  # bfloat16 -> float32 is exact, so the inputs are the same
        name: torch.tensor(np.asarray(x, np.float32), device="cuda")
        for name, x in (("h", h), ("w", w))
    }
    th, tw = (to_torch[k].to(torch.bfloat16) for k in ("h", "w"))
    ty = torch.tensor(np.asarray(labels), device="cuda", dtype=torch.long)
    losses_by_peer, notes = {}, []
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        losses_by_peer["Liger"] = lambda h_, w_: liger(w_, h_, ty)
    except ImportError:
        notes.append("Liger: liger_kernel is not installed")
    try:
        from cut_cross_entropy import linear_cross_entropy

        losses_by_peer["CCE"] = lambda h_, w_: linear_cross_entropy(h_, w_, ty)
    except ImportError:
        notes.append("CCE: cut_cross_entropy is not installed")

    def programs(loss_fn):
        def forward():
            with torch.no_grad():
                loss = loss_fn(th, tw)
            torch.cuda.synchronize()
            return float(loss)

        def train():
            h_, w_ = (x.detach().requires_grad_() for x in (th, tw))
            loss = loss_fn(h_, w_)
            loss.backward()
            torch.cuda.synchronize()
            return float(loss)

        return forward, train

    return {name: programs(fn) for name, fn in losses_by_peer.items()}, notes


def torch_peak_bytes(run) -> float:
    """Peak CUDA memory allocated by torch during ``run()``, beyond what was
    allocated before it."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    return float(torch.cuda.max_memory_allocated() - before)


def run_preset(n, d, v, matmul, repeats: int) -> None:
    """Prints the preset's table: each implementation's forward and
    forward + backward time (median of ``repeats`` alternating rounds),
    memory and loss, after checking that every loss equals the fused one."""
    keys = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
    w = (0.02 * jax.random.normal(keys[1], (v, d))).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[2], (n,), 0, v)
    losses_of = make_losses(FLAGS.chunk_size, FLAGS.vocab_chunk_size)
    steps = make_steps(FLAGS.chunk_size, FLAGS.vocab_chunk_size)
    programs, memory, loss = {}, {}, {}
    for name, step in steps.items():
        forward = jax.jit(losses_of[name]).lower(h, w, labels).compile()
        train = step.lower(h, w, labels).compile()
        programs[name] = (
            lambda f=forward: jax.block_until_ready(f(h, w, labels)),
            lambda f=train: jax.block_until_ready(f(h, w, labels)),
        )
        memory[name] = train.memory_analysis().temp_size_in_bytes
        loss[name] = float(forward(h, w, labels)[0])
    peers, notes = torch_peers(h, w, labels)
    for name, (forward, train) in peers.items():
        try:
            loss[name] = forward()
            if not np.isclose(loss[name], loss["fused"], rtol=1e-2):
                notes.append(f"{name}: loss {loss[name]:.4f} != {loss['fused']:.4f}")
                continue
            memory[name] = torch_peak_bytes(train)
            programs[name] = (forward, train)
        except Exception as error:  # a peer's failure is reported, not fatal
            notes.append(f"{name}: {type(error).__name__}: {error}")
    calls = {
        f"{name} {part}": run
        for name, runs in programs.items()
        for part, run in zip(("fwd", "train"), runs)
    }
    times = timing.alternate(calls, matmul, rounds=repeats)
    print(
        "| implementation | fwd ms | fwd+bwd ms | fwd+bwd x fused | memory | loss |\n"
        + "|---|---|---|---|---|---|"
    )
    fused_train = times["fused train"][0]
    for name in programs:
        train = times[f"{name} train"][0]
        kind = "XLA temp" if name in steps else "torch peak"
        print(
            f"| {name} | {1e3 * times[f'{name} fwd'][0]:.1f} | {1e3 * train:.1f} | "
            f"{train / fused_train:.2f} | {format_bytes(memory[name])} ({kind}) | "
            f"{loss[name]:.4f} |"
        )
    print(
        f"\nmatmul {matmul.flops / times['matmul'][0] / 1e12:.1f} TFLOP/s "
        f"(float32, side {matmul.size}); {repeats} rounds."
    )
    for note in notes:
        print("not timed:", note)


def main(argv):
    del argv
    specs = FLAGS.shapes or (QUICK_SHAPES if FLAGS.quick else DEFAULT_SHAPES)
    repeats = 2 if FLAGS.quick else FLAGS.repeats
    matmul = timing.Matmul(512 if FLAGS.quick else FLAGS.matmul_size)
    steps = make_steps(FLAGS.chunk_size, FLAGS.vocab_chunk_size)
    print(
        f"{timing.machine()}, "
        f"{available_bytes() / GIB:.1f} GiB available, {FLAGS.dtype}; "
        "matmul: float32, side "
        f"{matmul.size}, timed between the runs of each shape.\n"
    )
    if FLAGS.quantized:
        run_quantized(FLAGS.quick, repeats, matmul)
        return
    if FLAGS.preset:
        shape = parse_shapes(FLAGS.shapes)[0] if FLAGS.shapes else PRESETS[FLAGS.preset]
        print(f"preset {FLAGS.preset}: N, D, V = {shape}, bfloat16\n")
        run_preset(*shape, matmul, repeats)
        return
    if FLAGS.zero_fraction or FLAGS.entropy:
        print(SKIP_ENTROPY_HEADER, flush=True)
        for n, d, v in parse_shapes(FLAGS.shapes or [specs[0]]):
            rows = skip_entropy_rows(
                n, d, v, jnp.dtype(FLAGS.dtype), repeats, FLAGS.seconds_per_program
            )
            print("\n".join(rows), flush=True)
        return
    if FLAGS.filter_eps or FLAGS.dw_accumulation:
        eps_values = [x if x == "auto" else float(x) for x in FLAGS.filter_eps]
        print(FILTER_HEADER if eps_values else ACCUMULATION_HEADER, flush=True)
        for n, d, v in parse_shapes(FLAGS.shapes or [specs[0]]):
            args = n, d, v, jnp.dtype(FLAGS.dtype)
            timed = repeats, FLAGS.seconds_per_program, FLAGS.chunk_size
            rows = (
                filter_rows(*args, eps_values, FLAGS.peaked, *timed)
                if eps_values
                else accumulation_rows(*args, *timed)
            )
            print("\n".join(rows), flush=True)
        return
    if FLAGS.distillation or FLAGS.post_training:
        specs = FLAGS.shapes or specs[:1]
    for divergence in FLAGS.post_training + FLAGS.distillation or [None]:
        if divergence in FLAGS.post_training:
            steps = post_training_steps(
                divergence, FLAGS.chunk_size, FLAGS.vocab_chunk_size
            )
            print(
                f"\nPost-training, {divergence}: {POST_TRAINING[divergence]} "
                "(GFLOP/s count the policy's 6 N D V):"
            )
        elif divergence is not None:
            steps = make_steps(
                FLAGS.chunk_size, None, divergence=divergence, teacher=FLAGS.teacher
            )
            print(
                f"\nDistillation, {divergence}, teacher as {FLAGS.teacher} "
                "(GFLOP/s count the student's 6 N D V):"
            )
        print(HEADER, flush=True)
        for n, d, v in parse_shapes(specs):
            print(
                format_row(
                    bench_shape(
                        n,
                        d,
                        v,
                        steps,
                        matmul,
                        jnp.dtype(FLAGS.dtype),
                        repeats,
                        FLAGS.seconds_per_program,
                        FLAGS.memory_fraction,
                        teacher=(
                            divergence
                            if divergence in FLAGS.post_training
                            else None
                            if divergence is None
                            else FLAGS.teacher
                        ),
                    )
                ),
                flush=True,
            )


if __name__ == "__main__":
    app.run(main)
