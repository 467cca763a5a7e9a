r"""Decoding speed: the KV cache against recomputing the prefix.

    python experiments/bench_decode.py     # the README tables
    python experiments/bench_decode.py --config=configs/default.py:tiny --quick

The model is ``--config``'s, by default ``configs/default.py``'s (4 layers, 4
heads, d_model 128, max_len = block_size = 64), with V = 84, the Shakespeare
characters, and random weights: speed does not depend on them, and without EOS every decoder
runs all its steps.

Table 1, tokens/s: greedy, top-p sampling (p = 0.9, T = 0.8) and 4-beam
search at batch 1 and 32, from a prompt of ``--prompt_len`` tokens to the end
of the context (``max_len - prompt_len`` new tokens), each decoder one jitted
``lax.while_loop``. Tokens/s is ``B * N`` over the median wall time of the
loop (the prefill excluded; a beam search does ``num_beams`` times the model
work for the same count). Two ``step_fn``\ s:

* cache: ``model.make_step_fn``, one new position through the model;
* recompute: the whole ``[B, max_len]`` token buffer through the model at
  every step, reading the logits at the new position (static shapes force
  the full context: that is what a loop without a cache pays).

Table 2, time per token at sequence length T: one cached step at cache
index T against one forward pass over the T + 1 tokens (a recompute that
only pays for the prefix, each length compiled on its own). With the cache
the time must stay flat in T.

Cached and recompute runs alternate, so that both see the same load on a
shared machine. On a shared 2-core CPU (jax 0.10.2, ``--repeats=3``, about
70 s) the cache gave 8-16x the tokens/s of recomputing (greedy at batch 1:
10149 against 1072), and per token 0.36-0.40 ms at every length against
0.31 ms at T = 8 growing to 1.01 ms at T = 63 for the recompute.
"""

import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from ml_collections import config_flags

from lmhead import decoding
from lmhead import model as model_lib
from lmhead import train

config_flags.DEFINE_config_file("config", "configs/default.py",
                                "A configs/*.py file[:args]; its model is timed.")
flags.DEFINE_bool("quick", False, "Batch sizes 1 and 4, three lengths, 2 repeats.")
flags.DEFINE_integer("vocab_size", 84, "V (84: Shakespeare's characters).")
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens before decoding.")
flags.DEFINE_list("batch_sizes", ["1", "32"], "Batch sizes of table 1.")
flags.DEFINE_list("lengths", ["8", "16", "32", "63"], "Sequence lengths of table 2.")
flags.DEFINE_integer("repeats", 5, "Timed runs per measurement (median).",
                     lower_bound=1)
FLAGS = flags.FLAGS


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def make_recompute_step_fn(model: model_lib.DecoderLM, params):
    """``step_fn`` whose state is the token buffer ``[B, max_len]`` and lengths."""
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))

    def step_fn(tokens, state):
        rows = jnp.arange(tokens.shape[0])
        buffer = state["tokens"].at[rows, state["length"]].set(tokens)
        logits = forward(buffer)[rows, state["length"]]
        return logits, {"tokens": buffer, "length": state["length"] + 1}

    return forward, step_fn


def decoders(max_new_tokens: int) -> dict[str, Callable]:
    key = jax.random.key(0)
    return {
        "greedy": lambda step_fn, logits, state: decoding.generate(
            step_fn, logits, state, key=key, max_new_tokens=max_new_tokens,
            temperature=0.0),
        "top-p 0.9": lambda step_fn, logits, state: decoding.generate(
            step_fn, logits, state, key=key, max_new_tokens=max_new_tokens,
            temperature=0.8, top_p=0.9),
        "beam 4": lambda step_fn, logits, state: decoding.beam_search(
            step_fn, logits, state, num_beams=4, max_new_tokens=max_new_tokens,
            eos_id=None),
    }


def tokens_per_second(model, params, batch: int, prompt_len: int,
                      repeats: int) -> dict[str, tuple[float, float]]:
    """{decoder: (cache tokens/s, recompute tokens/s)} at one batch size."""
    max_new_tokens = model.max_len - prompt_len
    prompt = jax.random.randint(jax.random.key(batch), (batch, prompt_len), 0,
                                model.vocab_size)
    cache_logits, cache = model_lib.prefill(model, params, prompt,
                                            max_new_tokens=max_new_tokens)
    cached = model_lib.make_step_fn(model, params)
    forward, recompute = make_recompute_step_fn(model, params)
    buffer = jnp.zeros((batch, model.max_len), jnp.int32).at[:, :prompt_len].set(prompt)
    recompute_logits = forward(buffer)[:, prompt_len - 1]
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    runs = {"cache": lambda decode: decode(cached, cache_logits, cache),
            "recompute": lambda decode: decode(
                recompute, recompute_logits, {"tokens": buffer, "length": lengths})}
    rates = {}
    for name, decode in decoders(max_new_tokens).items():
        for run in runs.values():  # compile
            jax.block_until_ready(run(decode))
        times = {kind: [] for kind in runs}
        for _ in range(repeats):
            for kind, run in runs.items():
                times[kind].append(median_seconds(lambda: run(decode), 1))
        rates[name] = tuple(batch * max_new_tokens / float(np.median(times[kind]))
                            for kind in runs)
        print(f"  batch {batch} {name}: cache {rates[name][0]:.0f} tokens/s, "
              f"recompute {rates[name][1]:.0f} tokens/s", flush=True)
    return rates


def seconds_per_token(model, params, length: int, repeats: int,
                      calls: int = 20) -> tuple[float, float]:
    """(cached step at cache index ``length``, forward over ``length + 1``)."""
    prompt = jax.random.randint(jax.random.key(length), (1, length + 1), 0,
                                model.vocab_size)
    _, cache = model_lib.prefill(model, params, prompt[:, :length])
    step_fn = model_lib.make_step_fn(model, params)
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens)[:, -1])
    runs = {"cache": lambda: step_fn(prompt[:, length], cache)[0],
            "recompute": lambda: forward(prompt)}
    for run in runs.values():
        jax.block_until_ready(run())
    times = {kind: [] for kind in runs}
    for _ in range(repeats):
        for kind, run in runs.items():
            times[kind].append(median_seconds(run, calls))
    return tuple(float(np.median(times[kind])) for kind in runs)


def main(argv):
    del argv
    model = train.make_model(FLAGS.config, FLAGS.vocab_size)
    prompt_len = min(FLAGS.prompt_len, model.max_len // 2)
    lengths = [n for n in map(int, FLAGS.lengths) if n < model.max_len]
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    repeats = FLAGS.repeats
    if FLAGS.quick:
        lengths, batch_sizes, repeats = [4, 8, model.max_len - 1], [1, 4], 2
    params = jax.jit(model.init)(jax.random.key(0),
                                 jnp.zeros((1, model.max_len), jnp.int32))["params"]
    print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, jax "
          f"{jax.__version__}; {model.num_layers} layers, d_model {model.d_model}, "
          f"max_len {model.max_len}, V {model.vocab_size}; prompt {prompt_len}, "
          f"{model.max_len - prompt_len} new tokens", flush=True)

    rows = {}
    for batch in batch_sizes:
        rows[batch] = tokens_per_second(model, params, batch, prompt_len, repeats)
    per_token = {n: seconds_per_token(model, params, n, repeats) for n in lengths}

    print("\n| decoder | batch | cache tokens/s | recompute tokens/s | speed-up |")
    print("|---|---|---|---|---|")
    for batch, rates in rows.items():
        for name, (cached, recomputed) in rates.items():
            print(f"| {name} | {batch} | {cached:.0f} | {recomputed:.0f} | "
                  f"{cached / recomputed:.1f}x |")
    print("\n| sequence length | cache ms/token | recompute ms/token |")
    print("|---|---|---|")
    for n, (cached, recomputed) in per_token.items():
        print(f"| {n} | {1e3 * cached:.2f} | {1e3 * recomputed:.2f} |")


if __name__ == "__main__":
    app.run(main)
