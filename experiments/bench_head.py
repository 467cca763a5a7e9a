r"""Fused vs materialized linear + cross-entropy: time and compiled memory.

    python experiments/bench_head.py            # the table in the README
    python experiments/bench_head.py --quick    # small shapes, a few seconds
    python experiments/bench_head.py --shapes=8192,512,32768

For each ``(N, D, V)`` it compiles ``jax.value_and_grad`` (w.r.t. ``h`` and
``w``) of ``fused.fused_cross_entropy`` and of ``losses.cross_entropy(
head.unembed(h, w), labels)``, reads XLA's ``temp_size_in_bytes`` of each
compiled program, and times the two alternately (median of ``--repeats``
runs after one warm-up), so that both see the same load on a shared machine.
A shape whose materialized program needs more memory than is available is
compiled but not run. The effective rate counts the ``6 N D V`` FLOPs of the
three matmuls (logits, ``dh``, ``dw``); the reference rate is a large float32
matmul timed in the same run.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from lmhead import fused
from lmhead import head
from lmhead import losses

DEFAULT_SHAPES = [
    "8192,512,32768",  # the shape of the targets
    *(f"{n},{d},{v}" for n in (4096, 16384) for d in (256, 1024)
      for v in (8192, 32768, 131072)),
    "16384,256,262144",  # logits alone need 16 GiB: the materialized path
]                        # does not fit in 24 GiB, the fused one does
QUICK_SHAPES = ["512,64,1024", "1000,96,3000"]

flags.DEFINE_list("shapes", None, "N,D,V triples separated by ';' or given "
                  "as repeated N,D,V lists; default: the README table.")
flags.DEFINE_bool("quick", False, "Small shapes and two repeats.")
flags.DEFINE_integer("repeats", 3, "Timed runs per program (median).",
                     lower_bound=1)
flags.DEFINE_integer("chunk_size", None, "fused chunk_size (default: auto).")
flags.DEFINE_integer("vocab_chunk_size", None, "fused vocab_chunk_size.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "dtype of h and w.")
flags.DEFINE_integer("matmul_size", 4096, "Side of the timed square matmul.")
flags.DEFINE_float("memory_fraction", 0.8, "Fraction of the available memory "
                   "a program may use to be run.")
FLAGS = flags.FLAGS

GIB = 2.0**30


def available_bytes() -> float:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def median_seconds(fn, args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def matmul_flops_per_sec(size: int, repeats: int) -> float:
    """FLOP/s of a jitted float32 ``[size, size] @ [size, size]`` (median)."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    matmul = jax.jit(jnp.dot)
    jax.block_until_ready(matmul(a, a))
    return 2 * size**3 / median_seconds(matmul, (a, a), repeats)


def make_steps(chunk_size, vocab_chunk_size):
    def materialized(h, w, labels):
        return losses.cross_entropy(head.unembed(h, w), labels)

    def fused_loss(h, w, labels):
        return fused.fused_cross_entropy(h, w, labels, chunk_size=chunk_size,
                                         vocab_chunk_size=vocab_chunk_size)

    return {name: jax.jit(jax.value_and_grad(loss, argnums=(0, 1),
                                             has_aux=True))
            for name, loss in (("fused", fused_loss),
                               ("materialized", materialized))}


def bench_shape(n: int, d: int, v: int, steps, dtype, repeats: int,
                memory_fraction: float) -> dict:
    keys = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(keys[0], (n, d), dtype)
    w = (0.02 * jax.random.normal(keys[1], (v, d))).astype(dtype)
    labels = jax.random.randint(keys[2], (n,), 0, v)
    row = {"shape": (n, d, v)}
    compiled = {}
    for name, step in steps.items():
        compiled[name] = step.lower(h, w, labels).compile()
        stats = compiled[name].memory_analysis()
        row[name + "_temp"] = stats.temp_size_in_bytes
        row[name + "_total"] = (stats.temp_size_in_bytes +
                                stats.argument_size_in_bytes +
                                stats.output_size_in_bytes)
    runnable = [name for name in compiled if row[name + "_total"] <=
                memory_fraction * available_bytes()]
    for name in runnable:  # warm-up
        jax.block_until_ready(compiled[name](h, w, labels))
    times = {name: [] for name in runnable}
    for _ in range(repeats):  # alternate, so both see the same load
        for name in runnable:
            times[name].append(median_seconds(compiled[name], (h, w, labels), 1))
    for name in compiled:
        row[name + "_time"] = (float(np.median(times[name])) if name in times
                               else None)
    return row


def format_row(row: dict, matmul_rate: float) -> str:
    n, d, v = row["shape"]
    flops = 6.0 * n * d * v
    fused_time, mat_time = row["fused_time"], row["materialized_time"]
    mat_temp = row["materialized_temp"] / GIB
    cells = [f"{n}", f"{d}", f"{v}", f"{fused_time:.3f}"]
    if mat_time is None:
        cells += [f"does not fit (needs {row['materialized_total'] / GIB:.1f}"
                  " GiB)", "-"]
    else:
        cells += [f"{mat_time:.3f}", f"{fused_time / mat_time:.2f}"]
    cells += [f"{row['fused_temp'] / 2**20:.1f} MiB", f"{mat_temp:.2f} GiB",
              f"1/{row['materialized_temp'] / max(row['fused_temp'], 1):.0f}",
              f"{flops / fused_time / 1e9:.0f}",
              "-" if mat_time is None else f"{flops / mat_time / 1e9:.0f}",
              f"{flops / fused_time / matmul_rate:.0%}"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| N | D | V | fused s | materialized s | time ratio | fused temp | "
          "materialized temp | memory ratio | fused GFLOP/s | materialized "
          "GFLOP/s | fused / matmul |\n|" + "---|" * 12)


def parse_shapes(specs: list[str]) -> list[tuple[int, int, int]]:
    triples = ",".join(specs).replace(";", ",").split(",")
    if len(triples) % 3:
        raise app.UsageError(f"--shapes needs N,D,V triples; got {specs}.")
    numbers = [int(x) for x in triples]
    return [tuple(numbers[i:i + 3]) for i in range(0, len(numbers), 3)]


def main(argv):
    del argv
    specs = FLAGS.shapes or (QUICK_SHAPES if FLAGS.quick else DEFAULT_SHAPES)
    repeats = 2 if FLAGS.quick else FLAGS.repeats
    matmul_size = 512 if FLAGS.quick else FLAGS.matmul_size
    dtype = jnp.dtype(FLAGS.dtype)
    steps = make_steps(FLAGS.chunk_size, FLAGS.vocab_chunk_size)
    print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, "
          f"{available_bytes() / GIB:.1f} GiB available, {dtype.name}, "
          f"jax {jax.__version__}", flush=True)
    rates = [matmul_flops_per_sec(matmul_size, repeats)]
    print(f"matmul {matmul_size}^3 float32: {rates[0] / 1e9:.0f} GFLOP/s",
          flush=True)
    rows = []
    for n, d, v in parse_shapes(specs):
        rows.append(bench_shape(n, d, v, steps, dtype, repeats,
                                FLAGS.memory_fraction))
        print(format_row(rows[-1], rates[0]), flush=True)
    rates.append(matmul_flops_per_sec(matmul_size, repeats))
    matmul_rate = float(np.median(rates))
    print(f"\nmatmul {matmul_size}^3 float32: {rates[-1] / 1e9:.0f} GFLOP/s at "
          f"the end; {matmul_rate / 1e9:.0f} GFLOP/s used below.\n")
    print(HEADER)
    for row in rows:
        print(format_row(row, matmul_rate))


if __name__ == "__main__":
    app.run(main)
