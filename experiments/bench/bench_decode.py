r"""Decoding speed by batch, cache capacity and decoder, optionally against transformers.

    python experiments/bench/bench_decode.py                  # docs/decoding.md's table
    python experiments/bench/bench_decode.py --new_tokens=200 --max_lens=256,1024 --compare_hf
    python experiments/bench/bench_decode.py --quick --compare_hf   # batch 1 and 4, max_len 64 and 128, 8 new tokens, 2 repeats

Greedy, top-p and 4-beam decoding of ``--config``'s model (GPT-2 layout,
random weights) by batch and ``max_len``, then greedy with every request
option, streamed, and with the whole batch's loop, each against plain
greedy; ``--compare_hf`` times ``transformers``' GPT-2 with the same weights.
``docs/benchmarks.md`` says what each row times and how.
"""

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags
from ml_collections import config_flags

from lmhead import decoding
from lmhead.lm import configuration, gpt2_import, inference, sharding
from lmhead.lm import model as model_lib

config_flags.DEFINE_config_file(
    "config", "configs/default.py", "A configs/*.py file[:args]; its model is timed."
)
timing.cli.quick_flag()
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
timing.cli.matmul_size_flag(1024)
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
    "(inference.make_step_fn's mesh); 1 keeps every row on one device.",
    lower_bound=1,
)
FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class WholeBatchLoop:
    """A rows-split ``step_fn`` without ``per_device``: ``generate`` then
    runs its loop over the whole batch, as with a ``processor`` hook."""

    step_fn: inference.DecodeStep

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
    step_fn = inference.make_step_fn(model, inference.rows_mesh(batch))
    if name.startswith("beam"):
        return lambda params, logits, cache: decoding.beam_search(
            step_fn, params, logits, cache, num_beams=int(name.split()[-1]),
            max_new_tokens=max_new_tokens, eos_id=None,
        )[0][:, 0]  # fmt: skip
    knobs = (
        dict(temperature=0.0) if name == "greedy" else dict(temperature=0.8, top_p=0.9)
    )
    return lambda params, logits, cache: decoding.generate(
        step_fn, params, logits, cache, key=jax.random.key(0),
        max_new_tokens=max_new_tokens, donate_state=True, **knobs,
    )[0]  # fmt: skip


def hf_weights(model, params) -> dict[str, np.ndarray]:
    """``params`` under ``GPT2LMHeadModel``'s names: ``gpt2_import``'s
    names and paths, read the other way (GPT-2 layout)."""
    gpt2 = gpt2_import.GPT2Config(
        model.vocab_size, model.max_len, model.d_model, model.num_layers,
        model.num_heads, model.mlp_dim, "gelu", model.tied, None, (),
    )  # fmt: skip
    weights = {
        name if name.startswith("lm_head") else f"transformer.{name}": np.array(
            functools.reduce(lambda node, key: node[key], path, params), np.float32
        )
        for name, path in gpt2_import.weight_paths(gpt2).items()
    }
    weights.setdefault("lm_head.weight", weights["transformer.wte.weight"])
    return weights


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
    state = {k: torch.from_numpy(v) for k, v in hf_weights(model, params).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
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
    setup untimed; ``timing.alternate``), after one call that compiles."""
    for kind, run in runs.items():
        jax.block_until_ready(run(*setups[kind]()))
    times = timing.alternate(runs, None, repeats, setups=setups, clock=chosen_clock())
    return {kind: float(t) for kind, t in times.items()}


def bench_model(max_len: int) -> tuple[model_lib.DecoderLM, dict]:
    """``--config``'s model in the GPT-2 layout, V = ``--vocab_size``, and
    its random parameters."""
    model = configuration.make_model(FLAGS.config, FLAGS.vocab_size).clone(
        max_len=max_len,
        positions="learned",
        use_bias=True,
        head_bias=False,
        head_scale=None,
        logits_softcap=None,
        dtype=jnp.float32,
    )
    tokens = jnp.zeros((1, max_len), jnp.int32)
    return model, jax.jit(model.init)(jax.random.key(0), tokens)["params"]


def prefilled(model, params, batch: int, new: int) -> tuple:
    """``(prompt, logits, cache)``: a random ``--prompt_len``-token prompt of
    ``batch`` rows prefilled for ``new`` tokens, the rows split as decoding
    splits them."""
    shape = (batch, FLAGS.prompt_len)
    prompt = jax.random.randint(jax.random.key(batch), shape, 0, model.vocab_size)
    mesh = inference.rows_mesh(batch)
    return prompt, *inference.prefill(
        model, params, prompt, max_new_tokens=new, mesh=mesh
    )


def bench_max_len(max_len: int, batch_sizes, decoders, repeats: int) -> list[dict]:
    """Rows ``{decoder, batch, max_len, new, lmhead, hf}`` (seconds) at one capacity."""
    model, params = bench_model(max_len)
    new = min(FLAGS.new_tokens, max_len - FLAGS.prompt_len)
    hf = hf_model(model, params) if FLAGS.compare_hf else None
    rows = []
    for batch in batch_sizes:
        prompt, logits, cache = prefilled(model, params, batch, new)
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
    model, params = bench_model(FLAGS.knobs_max_len)
    batch = FLAGS.knobs_batch
    new = min(FLAGS.new_tokens, FLAGS.knobs_max_len - FLAGS.prompt_len)
    prompt, logits, cache = prefilled(model, params, batch, new)
    mesh = inference.rows_mesh(batch)
    step_fn = inference.make_step_fn(model, mesh)
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
    header = ["decoder", "batch", "max_len", "new tokens", "tokens/s", "ms/step"]
    header += ["ms/step vs smallest max_len"]
    header += ["transformers tokens/s", "lmhead / transformers"] * hf
    lines, smallest = [], {}
    for row in sorted(rows, key=lambda r: (r["decoder"], r["batch"], r["max_len"])):
        step = row["lmhead"] / row["new"]
        base = smallest.setdefault((row["decoder"], row["batch"], row["new"]), step)
        rate = lambda seconds: f"{row['batch'] * row['new'] / seconds:.0f}"
        line = [row[k] for k in ("decoder", "batch", "max_len", "new")]
        line += [rate(row["lmhead"]), f"{1e3 * step:.2f}", f"{step / base:.2f}x"]
        if hf:
            line += [rate(row["hf"]), f"{row['hf'] / row['lmhead']:.2f}x"]
        lines.append(line)
    print("\n" + timing.table(header, lines))


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
    rate = timing.Matmul(FLAGS.matmul_size).rate(repeats, clock=chosen_clock())
    print(
        f"{timing.machine()}; "
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
    header = ["greedy with", "batch", "max_len", "ms/step", "vs plain greedy"]
    knobs = (FLAGS.knobs_batch, FLAGS.knobs_max_len)
    rows = [(name, *knobs, f"{step:.2f}", f"{ratio:.2f}x") for name, step, ratio in
            bench_knobs_and_streaming(repeats)]  # fmt: skip
    print("\n" + timing.table(header, rows))


if __name__ == "__main__":
    app.run(main)
