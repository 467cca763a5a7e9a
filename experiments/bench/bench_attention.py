r"""Causal attention over a sequence: the model's, in each implementation
that runs here, against ``jax.nn.dot_product_attention``'s XLA one.

    python experiments/bench/bench_attention.py                  # GPT-2 small's shape
    python experiments/bench/bench_attention.py --batch_size=1   # a CPU's size
    python experiments/bench/bench_attention.py --quick          # B 1, T 64, H 2, Dh 64, 2 rounds

At ``--batch_size`` x ``--seq_len`` x ``--num_heads`` x ``--head_dim``, in
each of ``--dtypes``, the value and the gradient w.r.t. the query, key and
value of ``sum(attention(q, k, v) * c)`` (a fixed random ``c``: what a
training step computes), timed in alternating rounds with the machine's
square matmul (``timing.alternate``, wall time):

- ``xla``: ``attention.causal_attention(implementation="xla")``, the
  softmax written out, the model's default off a GPU;
- ``jax xla``: ``jax.nn.dot_product_attention(implementation="xla")``,
  the same arrangement in JAX's code;
- ``cudnn``: ``attention.causal_attention(implementation="cudnn")``, cuDNN's
  flash attention, where it runs: a GPU, bfloat16 or float16, a head size
  that is a multiple of 8 up to 128.

Each row gives the milliseconds per call, the ratio to ``xla`` in the same
dtype, and the largest difference of the output from it.
docs/benchmarks.md has the results ("Attention").
"""

import time

import jax
import jax.numpy as jnp
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags

from lmhead.lm import attention

flags.DEFINE_integer("batch_size", 8, "Sequences.", lower_bound=1)
flags.DEFINE_integer("seq_len", 1024, "Positions per sequence.", lower_bound=1)
flags.DEFINE_integer("num_heads", 12, "Attention heads.", lower_bound=1)
flags.DEFINE_integer("head_dim", 64, "Size of a head.", lower_bound=1)
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Compute dtypes.")
flags.DEFINE_integer("rounds", 5, "Timed rounds (median).", lower_bound=1)
timing.cli.quick_flag()
timing.cli.matmul_size_flag(2048)
FLAGS = flags.FLAGS


def value_and_grad(fn):
    """The jitted value and gradient of ``sum(fn(q, k, v) * c)`` w.r.t.
    ``q, k, v``, computed in float32."""

    def objective(query, key, value, cotangent):
        out = fn(query, key, value).astype(jnp.float32)
        return jnp.sum(out * cotangent)

    return jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2)))


def implementations(dtype) -> dict:
    """``{name: attention function}`` of the ones that run here in ``dtype``."""
    found = {}
    for name in ("xla", "cudnn"):
        try:
            attention.pick_implementation(name, dtype, FLAGS.head_dim)
        except ValueError:
            continue
        found[name] = lambda q, k, v, name=name: attention.causal_attention(
            q, k, v, name
        )
    found["jax xla"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="xla"
    )
    return found


def bench(dtype, matmul) -> list[tuple]:
    shape = (FLAGS.batch_size, FLAGS.seq_len, FLAGS.num_heads, FLAGS.head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    query, key, value = (jax.random.normal(k, shape, dtype) for k in keys[:3])
    cotangent = jax.random.normal(keys[3], shape, jnp.float32)
    args = (query, key, value, cotangent)
    found = implementations(dtype)
    programs = {
        name: value_and_grad(fn).lower(*args).compile() for name, fn in found.items()
    }
    outputs = {
        name: jax.jit(fn)(query, key, value).astype(jnp.float32)
        for name, fn in found.items()
    }
    times = timing.alternate(
        {name: lambda p=p: p(*args) for name, p in programs.items()},
        matmul,
        FLAGS.rounds,
        clock=time.perf_counter,
    )
    base = times["xla"]
    return [
        (
            jnp.dtype(dtype).name,
            name,
            f"{1e3 * times[name]:.2f}",
            f"{times[name] / base:.2f}x",
            f"{float(jnp.abs(outputs[name] - outputs['xla']).max()):.1e}",
        )
        for name in programs
    ]


def main(argv):
    timing.cli.start(argv)
    if FLAGS.quick:
        FLAGS.batch_size, FLAGS.seq_len, FLAGS.num_heads = 1, 64, 2
        FLAGS.rounds, FLAGS.matmul_size = 2, 128
    matmul = timing.Matmul(FLAGS.matmul_size)
    rate = matmul.rate()
    print(
        f"{timing.machine()}; float32 matmul {rate / 1e9:.0f} GFLOP/s; "
        f"B {FLAGS.batch_size}, T {FLAGS.seq_len}, H {FLAGS.num_heads}, "
        f"Dh {FLAGS.head_dim}; value and gradient, wall time",
        flush=True,
    )
    rows = [row for name in FLAGS.dtypes for row in bench(jnp.dtype(name), matmul)]
    header = ["dtype", "attention", "ms/call", "vs xla", "max |out diff|"]
    print(timing.table(header, rows))


if __name__ == "__main__":
    app.run(main)
