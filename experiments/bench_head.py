r"""Fused vs materialized linear + cross-entropy: time and compiled memory.

    python experiments/bench_head.py            # the table in the README
    python experiments/bench_head.py --quick    # small shapes, a few seconds
    python experiments/bench_head.py --shapes=8192,512,32768

For each ``(N, D, V)`` it compiles ``jax.value_and_grad`` (w.r.t. ``h`` and
``w``) of ``fused.fused_cross_entropy`` and of ``losses.cross_entropy(
head.unembed(h, w), labels)``, reads XLA's ``temp_size_in_bytes`` of each
compiled program, and times them in alternation with a square float32 matmul
(median of ``--repeats`` rounds after one warm-up; fewer rounds when a run
is long), so that all three see the same load on a shared machine. A
program that needs more than ``--memory_fraction`` of the available memory
is compiled but not run. The effective rate counts the ``6 N D V`` FLOPs of
the three matmuls of the materialized path (logits, ``dh``, ``dw``).
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

flags.DEFINE_list("shapes", None, "N,D,V triples, e.g. "
                  "'8192,512,32768;4096,256,8192'; default: the README table.")
flags.DEFINE_bool("quick", False, "Small shapes and two repeats.")
flags.DEFINE_integer("repeats", 5, "Timed runs per program (median), fewer "
                     "when one run takes more than --seconds_per_program / "
                     "repeats.", lower_bound=1)
flags.DEFINE_float("seconds_per_program", 60.0, "Time budget of the timed "
                   "runs of one program at one shape (at least one run).")
flags.DEFINE_integer("chunk_size", None, "fused chunk_size (default: auto).")
flags.DEFINE_integer("vocab_chunk_size", None, "fused vocab_chunk_size.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "dtype of h and w.")
flags.DEFINE_integer("matmul_size", 4096, "Side of the timed square matmul.")
flags.DEFINE_float("memory_fraction", 0.6, "Fraction of the available memory "
                   "a program may use to be run (the machine may be shared).")
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


def make_matmul(size: int):
    """``(fn, args, flops)`` of a jitted float32 ``[size, size] @ [size, size]``."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    matmul = jax.jit(jnp.dot).lower(a, a).compile()
    jax.block_until_ready(matmul(a, a))
    return matmul, (a, a), 2.0 * size**3


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


def bench_shape(n: int, d: int, v: int, steps, matmul, dtype, repeats: int,
                seconds: float, memory_fraction: float) -> dict:
    """Compiled memory and median times of each program at one shape.

    ``matmul`` is ``(fn, args, flops)``: a reference timed in the same rounds.
    """
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
    row["available"] = available_bytes()
    runnable = [name for name in compiled if row[name + "_total"] <=
                memory_fraction * row["available"]]
    warmup = max([median_seconds(compiled[name], (h, w, labels), 1)
                  for name in runnable], default=seconds)
    runs = int(np.clip(seconds // warmup, 1, repeats))
    times = {name: [] for name in runnable + ["matmul"]}
    for _ in range(runs):  # alternate, so all see the same load
        for name in runnable:
            times[name].append(median_seconds(compiled[name], (h, w, labels), 1))
        times["matmul"].append(median_seconds(matmul[0], matmul[1], 1))
    row["matmul_rate"] = matmul[2] / float(np.median(times["matmul"]))
    for name in compiled:
        row[name + "_time"] = (float(np.median(times[name])) if name in times
                               else None)
    row["runs"] = runs
    return row


def format_ratio(ratio: float) -> str:
    return f"1/{1 / ratio:.0f}" if ratio < 0.5 else f"{ratio:.2f}"


def format_bytes(size: float) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"


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

    cells = [f"{n}", f"{d}", f"{v}", time_cell(row, "fused"),
             time_cell(row, "materialized"),
             "-" if None in (fused_time, mat_time)
             else f"{fused_time / mat_time:.2f}",
             format_bytes(row["fused_temp"]),
             format_bytes(row["materialized_temp"]),
             format_ratio(row["fused_temp"] / row["materialized_temp"]),
             rate(fused_time), rate(mat_time),
             f"{row['matmul_rate'] / 1e9:.0f}",
             "-" if fused_time is None
             else f"{flops / fused_time / row['matmul_rate']:.0%}",
             f"{row['runs']}"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| N | D | V | fused s | materialized s | time ratio | fused temp | "
          "materialized temp | memory ratio | fused GFLOP/s | materialized "
          "GFLOP/s | matmul GFLOP/s | fused / matmul | runs |\n|" +
          "---|" * 14)


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
    matmul = make_matmul(512 if FLAGS.quick else FLAGS.matmul_size)
    steps = make_steps(FLAGS.chunk_size, FLAGS.vocab_chunk_size)
    print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, "
          f"{available_bytes() / GIB:.1f} GiB available, {FLAGS.dtype}, "
          f"jax {jax.__version__}; matmul: float32, side "
          f"{matmul[1][0].shape[0]}, timed between the runs of each shape.\n")
    print(HEADER, flush=True)
    for n, d, v in parse_shapes(specs):
        print(format_row(bench_shape(
            n, d, v, steps, matmul, jnp.dtype(FLAGS.dtype), repeats,
            FLAGS.seconds_per_program, FLAGS.memory_fraction)), flush=True)


if __name__ == "__main__":
    app.run(main)
