r"""Decoding speed by batch, cache capacity and decoder, optionally against transformers.

    python experiments/bench/bench_decode.py                  # docs/decoding.md's table
    python experiments/bench/bench_decode.py --new_tokens=200 --max_lens=256,1024 --compare_hf
    python experiments/bench/bench_decode.py --quick --compare_hf   # a check that it runs

The model is ``--config``'s (by default ``configs/default.py``: 4 layers, 4
heads, d_model 128) in the GPT-2 layout (learned positions, biases, exact
GELU, LayerNorm epsilon 1e-5), with V = 84, the Shakespeare characters, and
random weights: speed does not depend on them, and with no EOS every decoder
runs all its steps. Its ``max_len`` is set to each of ``--max_lens``.

Each row decodes ``--new_tokens`` tokens (fewer if the cache cannot hold
them) after a ``--prompt_len``-token prompt: greedy, top-p sampling (p = 0.9,
T = 0.8) and 4-beam search, each one jitted ``lax.while_loop`` given the
parameters as an argument; greedy and top-p take the prefilled cache with
``donate_state=True``, as a caller does right after a prefill, so that they
update it in place instead of first copying all ``max_len`` slots of it.
Tokens/s is ``B * N`` over the median wall time (``timing.call_seconds``;
the prefill excluded, and the fresh copy of its cache that each timed run
gets; a beam search does 4 times the model work for the same count),
ms/step the same time over ``N``. With the same ``N`` at every
``max_len`` the filled length is the same, so the last column, ms/step over
that of the smallest ``max_len`` of the row, shows what the cache's capacity
costs: a step should cost what the cache holds, not its size.

After the table come rows of ratios measured in the same run, at
``--knobs_batch`` rows and ``--knobs_max_len``, each timed in alternation
with plain greedy (donated cache, one key), which it is divided by:

* "new knobs": greedy with every new option on at once: token stop
  sequences, text stop strings, per-row ``row_max_new_tokens`` (some rows
  stop early, the longest runs all ``N`` steps), one PRNG key per row,
  per-row presence, frequency and repetition penalties, and
  ``top_logprobs=5``. The stop sequences and strings are ones the random
  model never completes, so every step runs.
* "stream k": ``generate_stream`` with ``chunk_steps=k`` for each of
  ``--chunk_steps``, each chunk's tokens fetched to the host as a server
  sending them would, against one call whose tokens are fetched once.
* "whole-batch loop" (when the rows are split over several devices): plain
  greedy with the loop over the whole batch, its step on the split rows
  left to XLA, as a batch with a ``processor`` hook runs, against the loop
  per device (``lmhead/decoding/split.py``) that plain greedy gets: what
  that loop pays for.

``--compare_hf`` (needs torch and transformers, which the library never
imports) copies the same weights into a ``transformers`` ``GPT2LMHeadModel``,
checks that both give the same greedy tokens, and times its ``generate()``
(dynamic cache, no EOS) in alternation with lmhead's, so that both see the
same load; the ratio is lmhead's tokens/s over transformers'. The results
and the machine they were measured on are in ``docs/decoding.md``.
"""

import dataclasses
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags
from ml_collections import config_flags

from lmhead import decoding
from lmhead.lm import configuration, sharding
from lmhead.lm import model as model_lib

config_flags.DEFINE_config_file(
    "config", "configs/default.py", "A configs/*.py file[:args]; its model is timed."
)
flags.DEFINE_bool(
    "quick",
    False,
    "Batch 1 and 4, max_len 64 and 128, 8 new tokens, "
    "2 repeats: checks that the script runs.",
)
flags.DEFINE_bool(
    "compare_hf", False, "Also time transformers' GPT-2 with the same weights."
)
flags.DEFINE_integer("vocab_size", 84, "V (84: Shakespeare's characters).")
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens before decoding.")
flags.DEFINE_integer(
    "new_tokens", 48, "Tokens decoded per row (at most max_len - prompt_len)."
)
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Batch sizes.")
flags.DEFINE_list("max_lens", ["64", "256", "1024"], "Cache capacities.")
flags.DEFINE_list("decoders", ["greedy", "top-p", "beam 4"], "Decoders to time.")
flags.DEFINE_integer(
    "repeats", 5, "Timed runs per measurement (median).", lower_bound=1
)
flags.DEFINE_integer("matmul_size", 1024, "Side of the timed square float32 matmul.")
flags.DEFINE_bool(
    "cpu_time",
    False,
    "Time by the process's CPU time (all threads) "
    "instead of wall time: steadier on a shared machine.",
)
flags.DEFINE_integer("knobs_batch", 32, "Batch of the new-knobs and streaming rows.")
flags.DEFINE_integer(
    "knobs_max_len", 256, "Cache capacity of the new-knobs and streaming rows."
)
flags.DEFINE_list("chunk_steps", ["1", "4", "16"], "Streaming chunk sizes k.")
flags.DEFINE_integer(
    "cpu_devices",
    None,
    "Devices of the CPU backend; default: one per CPU this process may use. "
    "A batch's rows are split over as many as divide it "
    "(model.make_step_fn's mesh); 1 keeps every row on one device.",
    lower_bound=1,
)
FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class WholeBatchLoop:
    """A rows-split ``step_fn`` without ``per_device``: ``generate`` then
    runs its loop over the whole batch, as with a ``processor`` hook."""

    step_fn: model_lib.DecodeStep

    @property
    def mesh(self):
        return self.step_fn.mesh

    def __call__(self, params, tokens, cache):
        return self.step_fn(params, tokens, cache)


def chosen_clock() -> Callable[[], float]:
    """CPU time of this process with ``--cpu_time``, else wall time."""
    return time.process_time if FLAGS.cpu_time else time.perf_counter


def lmhead_decoder(name: str, model, max_new_tokens: int, batch: int):
    """``decode(params, logits, cache) -> tokens [B, N]``, one compiled loop,
    the ``batch`` rows split over the devices that divide them."""
    step_fn = model_lib.make_step_fn(model, model_lib.rows_mesh(batch))
    key = jax.random.key(0)
    if name == "greedy":
        return lambda params, logits, cache: decoding.generate(
            step_fn,
            params,
            logits,
            cache,
            key=key,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            donate_state=True,
        )[0]
    if name == "top-p":
        return lambda params, logits, cache: decoding.generate(
            step_fn,
            params,
            logits,
            cache,
            key=key,
            max_new_tokens=max_new_tokens,
            temperature=0.8,
            top_p=0.9,
            donate_state=True,
        )[0]
    return lambda params, logits, cache: decoding.beam_search(
        step_fn,
        params,
        logits,
        cache,
        num_beams=int(name.split()[-1]),
        max_new_tokens=max_new_tokens,
        eos_id=None,
    )[0][:, 0]


def hf_model(model, params):
    """transformers' GPT2LMHeadModel with ``params`` copied in (GPT-2 layout)."""
    import torch
    import transformers

    config = transformers.GPT2Config(
        vocab_size=model.vocab_size,
        n_positions=model.max_len,
        n_embd=model.d_model,
        n_layer=model.num_layers,
        n_head=model.num_heads,
        n_inner=model.mlp_dim,
        activation_function="gelu",
        layer_norm_epsilon=model_lib.LAYER_NORM_EPSILON,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=model.tied,
        bos_token_id=0,
        eos_token_id=None,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    tensor = lambda x: torch.from_numpy(np.array(x, np.float32))
    state = {
        "transformer.wte.weight": params["embed"]["embedding"],
        "transformer.wpe.weight": params["position_embedding"],
        "transformer.ln_f.weight": params["final_norm"]["scale"],
        "transformer.ln_f.bias": params["final_norm"]["bias"],
        "lm_head.weight": (
            params["embed"]["embedding"]
            if model.tied
            else params["head"]["unembedding"]
        ),
    }
    names = {
        "ln_1": "attention_norm",
        "ln_2": "mlp_norm",
        "attn.c_attn": "attention/qkv",
        "attn.c_proj": "attention/out",
        "mlp.c_fc": "mlp_in",
        "mlp.c_proj": "mlp_out",
    }
    for i in range(model.num_layers):
        for hf_name, name in names.items():
            layer = params[f"blocks_{i}"]
            for part in name.split("/"):
                layer = layer[part]
            weight = (
                layer["scale"] if "ln" in hf_name else layer["kernel"]
            )  # Conv1D: [in, out]
            state[f"transformer.h.{i}.{hf_name}.weight"] = weight
            state[f"transformer.h.{i}.{hf_name}.bias"] = layer["bias"]
    missing, unexpected = hf.load_state_dict(
        {k: tensor(v) for k, v in state.items()}, strict=False
    )
    if unexpected or [k for k in missing if not k.endswith("attn.bias")]:
        raise RuntimeError(f"weights do not match: {missing}, {unexpected}")
    return hf


def hf_decoder(name: str, hf, max_new_tokens: int):
    import torch

    settings = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
        use_cache=True,
    )
    if name == "greedy":
        settings.update(do_sample=False, num_beams=1)
    elif name == "top-p":
        settings.update(do_sample=True, temperature=0.8, top_p=0.9, top_k=0)
    else:
        settings.update(do_sample=False, num_beams=int(name.split()[-1]))

    def decode(prompt):
        with torch.inference_mode():
            ids = torch.from_numpy(np.asarray(prompt, np.int64))
            return hf.generate(ids, attention_mask=torch.ones_like(ids), **settings)[
                :, prompt.shape[1] :
            ].numpy()

    return decode


def alternate(runs: dict, setups: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each of ``runs`` (``run(*setups[kind]())``, the
    setup untimed), timed in alternation after one call that compiles and
    warms up, so that all see the same load."""
    for kind, run in runs.items():
        jax.block_until_ready(run(*setups[kind]()))
    times = {kind: [] for kind in runs}
    for _ in range(repeats):
        for kind, run in runs.items():
            times[kind].append(
                timing.call_seconds(run, setup=setups[kind], clock=chosen_clock())
            )
    return {kind: float(np.median(t)) for kind, t in times.items()}


def bench_model(max_len: int) -> model_lib.DecoderLM:
    """``--config``'s model in the GPT-2 layout, V = ``--vocab_size``."""
    return configuration.make_model(FLAGS.config, FLAGS.vocab_size).clone(
        max_len=max_len,
        positions="learned",
        use_bias=True,
        head_bias=False,
        head_scale=None,
        logits_softcap=None,
        dtype=jnp.float32,
    )


def bench_max_len(max_len: int, batch_sizes, decoders, repeats: int) -> list[dict]:
    """Rows ``{decoder, batch, max_len, new, lmhead, hf}`` (seconds) at one capacity."""
    model = bench_model(max_len)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, max_len), jnp.int32))[
        "params"
    ]
    new = min(FLAGS.new_tokens, max_len - FLAGS.prompt_len)
    hf = hf_model(model, params) if FLAGS.compare_hf else None
    rows = []
    for batch in batch_sizes:
        prompt = jax.random.randint(
            jax.random.key(batch), (batch, FLAGS.prompt_len), 0, model.vocab_size
        )
        logits, cache = model_lib.prefill(
            model, params, prompt, max_new_tokens=new, mesh=model_lib.rows_mesh(batch)
        )
        for name in decoders:
            decode = lmhead_decoder(name, model, new, batch)
            # A fresh copy of the prefilled cache per run, untimed: greedy and
            # top-p take it donated, as after a prefill, so they need not copy it.
            fresh = lambda: (jax.tree.map(jnp.copy, cache),)
            runs = {"lmhead": lambda cache: decode(params, logits, cache)}
            if hf is not None:
                runs["hf"] = lambda d=hf_decoder(name, hf, new): d(np.asarray(prompt))  # noqa: B008
                if name == "greedy" and not np.array_equal(
                    runs["lmhead"](*fresh()), runs["hf"]()
                ):
                    raise RuntimeError(f"greedy tokens differ at batch {batch}")
            seconds = alternate(runs, {"lmhead": fresh, "hf": tuple}, repeats)
            row = dict(decoder=name, batch=batch, max_len=max_len, new=new, **seconds)
            rows.append(row)
            versus = (
                f", transformers {1e3 * row['hf'] / new:.2f} ms/step"
                if "hf" in row
                else ""
            )
            print(
                f"  {name}, batch {batch}, max_len {max_len}: "
                f"{1e3 * row['lmhead'] / new:.2f} ms/step{versus}",
                flush=True,
            )
    return rows


def new_knob_settings(batch: int, new: int, vocab_size: int) -> dict:
    """``generate`` keywords that turn every new option on (module docstring)."""
    rng = np.random.default_rng(0)
    limits = rng.integers(max(1, new // 2), new + 1, batch)
    limits[0] = new  # the loop runs all N steps
    # Ids outside what random weights complete in N steps: 4-token stops of
    # the highest ids, and text stop strings of bytes no token holds.
    stop_ids = [[vocab_size - 1 - i] * 4 for i in range(4)]
    table = [bytes([33 + v % 90]) for v in range(vocab_size)]
    texts = decoding.StopStrings.build(["\x7f\x7f", "\x7e\x7f\x7e"], table)
    return dict(
        temperature=0.0,
        key=jax.random.split(jax.random.key(0), batch),
        row_max_new_tokens=jnp.asarray(limits, jnp.int32),
        stop_sequences=stop_ids,
        stop=texts,
        presence_penalty=jnp.full([batch], 0.5),
        frequency_penalty=jnp.full([batch], 0.25),
        repetition_penalty=jnp.full([batch], 1.1),
        top_logprobs=5,
    )


def bench_knobs_and_streaming(repeats: int) -> list[tuple[str, float, float]]:
    """``(name, ms/step, ratio to plain greedy)`` for the new-knobs and
    streaming rows, each timed in alternation with plain greedy."""
    model = bench_model(FLAGS.knobs_max_len)
    params = jax.jit(model.init)(
        jax.random.key(0), jnp.zeros((1, FLAGS.knobs_max_len), jnp.int32)
    )["params"]
    batch = FLAGS.knobs_batch
    new = min(FLAGS.new_tokens, FLAGS.knobs_max_len - FLAGS.prompt_len)
    prompt = jax.random.randint(
        jax.random.key(batch), (batch, FLAGS.prompt_len), 0, model.vocab_size
    )
    mesh = model_lib.rows_mesh(batch)
    logits, cache = model_lib.prefill(
        model, params, prompt, max_new_tokens=new, mesh=mesh
    )
    step_fn = model_lib.make_step_fn(model, mesh)
    common = dict(max_new_tokens=new, donate_state=True)
    knobs = new_knob_settings(batch, new, model.vocab_size)

    def greedy(step_fn):
        def run(cache):
            return np.asarray(
                decoding.generate(
                    step_fn, params, logits, cache, key=jax.random.key(0),
                    temperature=0.0, **common,
                ).tokens
            )  # fmt: skip

        return run

    plain = greedy(step_fn)

    def all_knobs(cache):
        out = decoding.generate(
            step_fn, params, logits, cache, prompt_tokens=prompt, **knobs, **common
        )
        if int(out.lengths[0]) != new:
            raise RuntimeError("a stop fired: the new-knobs row must run every step")
        return np.asarray(out.tokens)

    def stream(k):
        def run(cache):
            chunks = decoding.generate_stream(
                step_fn, params, logits, cache, chunk_steps=k,
                key=jax.random.key(0), temperature=0.0, **common,
            )  # fmt: skip
            return np.concatenate([np.asarray(c.tokens) for c in chunks], axis=1)

        return run

    fresh = lambda: (jax.tree.map(jnp.copy, cache),)
    variants = {"new knobs": all_knobs}
    variants.update({f"stream k={k}": stream(int(k)) for k in FLAGS.chunk_steps})
    if mesh is not None:
        variants["whole-batch loop"] = greedy(WholeBatchLoop(step_fn))
    results = []
    for name, variant in variants.items():
        if name.startswith("stream") and not np.array_equal(
            variant(*fresh()), plain(*fresh())
        ):
            raise RuntimeError(f"{name}: the chunks differ from one call")
        seconds = alternate(
            {"plain": plain, name: variant}, {"plain": fresh, name: fresh}, repeats
        )
        step = 1e3 * seconds[name] / new
        results.append((name, step, seconds[name] / seconds["plain"]))
        print(
            f"  {name}, batch {batch}, max_len {FLAGS.knobs_max_len}: {step:.2f} "
            f"ms/step, plain greedy {1e3 * seconds['plain'] / new:.2f} ms/step",
            flush=True,
        )
    return results


def print_table(rows: list[dict]) -> None:
    hf = "hf" in rows[0]
    print(
        "\n| decoder | batch | max_len | new tokens | tokens/s | ms/step | "
        "ms/step vs smallest max_len |"
        + (" transformers tokens/s | lmhead / transformers |" if hf else "")
    )
    print("|---" * (9 if hf else 7) + "|")
    smallest = {}
    for row in sorted(rows, key=lambda r: (r["decoder"], r["batch"], r["max_len"])):
        step = row["lmhead"] / row["new"]
        base = smallest.setdefault((row["decoder"], row["batch"], row["new"]), step)
        rate = lambda seconds: row["batch"] * row["new"] / seconds
        line = (
            f"| {row['decoder']} | {row['batch']} | {row['max_len']} | {row['new']} | "
            f"{rate(row['lmhead']):.0f} | {1e3 * step:.2f} | {step / base:.2f}x |"
        )
        if hf:
            line += f" {rate(row['hf']):.0f} | {row['hf'] / row['lmhead']:.2f}x |"
        print(line)


def main(argv):
    del argv
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    max_lens = [int(n) for n in FLAGS.max_lens]
    repeats = FLAGS.repeats
    if FLAGS.quick:
        batch_sizes, max_lens, repeats = [1, 4], [64, 128], 2
        FLAGS.new_tokens, FLAGS.knobs_batch, FLAGS.knobs_max_len = 8, 4, 64
    # Before the first array: the CPU client reads it when it starts.
    jax.config.update(
        "jax_num_cpu_devices", FLAGS.cpu_devices or sharding.available_cpus()
    )
    rate = timing.matmul_rate(FLAGS.matmul_size, repeats, clock=chosen_clock())
    print(
        f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, "
        f"{len(jax.local_devices())} devices, jax {jax.__version__}; "
        f"float32 matmul {rate / 1e9:.0f} GFLOP/s; prompt {FLAGS.prompt_len}, "
        f"{FLAGS.new_tokens} new tokens; "
        f"{'CPU' if FLAGS.cpu_time else 'wall'} time",
        flush=True,
    )
    rows = [
        row
        for max_len in max_lens
        for row in bench_max_len(max_len, batch_sizes, FLAGS.decoders, repeats)
    ]
    print_table(rows)
    knob_rows = bench_knobs_and_streaming(repeats)
    print("\n| greedy with | batch | max_len | ms/step | vs plain greedy |")
    print("|---" * 5 + "|")
    for name, step, ratio in knob_rows:
        print(
            f"| {name} | {FLAGS.knobs_batch} | {FLAGS.knobs_max_len} | "
            f"{step:.2f} | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    app.run(main)
