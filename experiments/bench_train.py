r"""Training speed: steps/s, tokens/s, compile time and model FLOP utilisation.

    python experiments/bench_train.py                      # nanogpt, char and BPE
    python experiments/bench_train.py --config=nanogpt,untied --steps=200
    python experiments/bench_train.py --loss_impl=materialized --loss_impl=fused

Utilisation is the model's FLOP rate over the rate of a large float32 matmul
timed in the same process, so both numbers see the same (possibly shared)
machine. Model FLOPs per token, as in PaLM (Chowdhery et al., 2022, App. B):
``6 N + 6 L T D`` for the forward and backward passes, with ``N`` the
parameters that take part in matmuls (not the embedding lookup; the
unembedding always) and ``6 L T D`` the attention scores and mixing with a
causal mask (half of ``12 L T D``). XLA's own count of the compiled step
(optimizer and elementwise work included) is printed beside it, and so is
the process's CPU time per step (all threads), which other processes on a
shared machine do not inflate.
"""

import importlib.util
import os
import time

import jax
import jax.numpy as jnp
from absl import app
from absl import flags

from lmhead import config_checks
from lmhead import data
from lmhead import train

flags.DEFINE_multi_string("config", ["nanogpt,tied", "nanogpt,tied,bpe=2048"],
                          "configs/default.py arguments; one benchmark each.")
flags.DEFINE_multi_string("loss_impl", [], "config.loss.loss_impl values to "
                          "compare; none: the config's own.")
flags.DEFINE_integer("steps", 100, "Timed steps (after 10 warm-up steps).",
                     lower_bound=1)
flags.DEFINE_integer("matmul_size", 2048, "Side of the timed square matmul.")
WARMUP_STEPS = 10
CONFIG_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "configs", "default.py")


def get_config(arg: str):
    spec = importlib.util.spec_from_file_location("default_config", CONFIG_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def matmul_flops_per_sec(size: int, repeats: int = 10) -> float:
    """float32 FLOP/s of a jitted ``[size, size] @ [size, size]``, best of runs."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    matmul = jax.jit(jnp.dot)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def model_flops_per_token(config, vocab_size: int) -> float:
    """``6 N + 6 L T D`` with N the matmul parameters (see the module doc)."""
    m, T = config.model, config.data.block_size
    per_block = 4 * m.d_model**2 + 2 * m.d_model * m.mlp_dim
    matmul_params = m.num_layers * per_block + vocab_size * m.d_model
    return 6 * matmul_params + 6 * m.num_layers * T * m.d_model


def bench(arg: str, loss_impl: str | None, steps: int, peak: float) -> None:
    config = get_config(arg)
    if loss_impl:
        config.loss.loss_impl = loss_impl
    config_checks.validate_config(config)
    dataset = data.load_dataset(config.data)
    model = train.make_model(config, dataset.vocab_size)
    init_key, dropout_key = jax.random.split(jax.random.key(0))
    state = jax.jit(lambda k: train.create_train_state(model, config, k))(init_key)
    batches = [data.train_batch(dataset.train_tokens, seed=0, step=s,
                                batch_size=config.train.batch_size,
                                block_size=config.data.block_size)
               for s in range(WARMUP_STEPS + steps)]
    train_fn, _, compile_seconds = train.compile_steps(
        model, config, state, batches[0], dropout_key)
    for batch in batches[:WARMUP_STEPS]:
        state, metrics = train_fn(state, batch, dropout_key)
    jax.block_until_ready(metrics)
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch in batches[WARMUP_STEPS:]:
        state, metrics = train_fn(state, batch, dropout_key)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - start) / steps
    cpu_seconds = (time.process_time() - cpu_start) / steps
    tokens = config.train.batch_size * config.data.block_size
    flops = model_flops_per_token(config, dataset.vocab_size) * tokens
    xla_flops = (train_fn.cost_analysis() or {}).get("flops", float("nan"))
    name = f"{arg} {config.loss.loss_impl}"
    print(f"{name:36s} V={dataset.vocab_size:<5d} compile {compile_seconds:5.2f} s  "
          f"{1 / seconds:6.1f} steps/s  {1e3 * seconds:6.2f} ms/step "
          f"(CPU time {1e3 * cpu_seconds:6.2f} ms)  "
          f"{tokens / seconds:9,.0f} tokens/s  model {flops / seconds / 1e9:6.2f} "
          f"GFLOP/s = {100 * flops / seconds / peak:5.1f}% MFU  "
          f"(XLA count {xla_flops / seconds / 1e9:6.2f} GFLOP/s)", flush=True)


def main(argv):
    del argv
    peak = matmul_flops_per_sec(flags.FLAGS.matmul_size)
    print(f"{jax.devices()[0].device_kind}: float32 matmul "
          f"{flags.FLAGS.matmul_size}^3 at {peak / 1e9:.1f} GFLOP/s", flush=True)
    for arg in flags.FLAGS.config:
        for loss_impl in flags.FLAGS.loss_impl or [None]:
            bench(arg, loss_impl, flags.FLAGS.steps, peak)


if __name__ == "__main__":
    app.run(main)
