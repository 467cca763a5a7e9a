r"""Speculative decoding against plain decoding, and the cost of MTP training.

    python experiments/bench/bench_speculative.py --mtp_runs=runs/char_k3,runs/bpe_k3 \
        --gpt2                      # docs/decoding.md's tables
    python experiments/bench/bench_speculative.py --quick   # random tiny models: seconds
    python experiments/bench/bench_speculative.py --gpt2 --only_gpt2 \
        --batch_sizes=1 --new_tokens=64   # the GPU check: GPT-2 small, n-gram

For each model (each run of ``--mtp_runs``, trained with MTP heads; with
``--gpt2`` a GPT-2-small-layout model with random weights; with
``--quick`` tiny random models), each prompt (a plain passage, and a
repetitive one: a passage given twice, whose continuation a copy predicts),
each batch size of ``--batch_sizes`` and each decoder (greedy, temperature
1): plain ``decoding.generate`` and speculative with each proposer (the
run's MTP heads with ``k`` = its ``mtp_heads``, n-gram lookup with
``--num_speculative_tokens``), timed side by side (``timing.alternate``):
tokens/s, the ratio, the mean tokens per model call, each depth's
acceptance, and for greedy whether the tokens equal plain greedy's. With
transformers installed, Hugging Face's prompt lookup
(``prompt_lookup_num_tokens``) on the GPT-2 model's weights is the peer of
the n-gram rows (greedy, batch 1: its speed-up over its own plain greedy).
Then, for the first MTP run: the service's decode slots (in process, no
HTTP) with 1, 4 and 16 clients sending greedy requests, speculation on and
off; a training step at its ``mtp_heads`` against 0 (side by side); and
the compiled temporary memory of the MTP loss at N = 8192, D = 512, V =
32768, k = 3, fused against materialized. docs/decoding.md has the results.
"""

import concurrent.futures
import functools
import time

import bench_decode  # experiments/bench/bench_decode.py: its flags and transformers' GPT-2
import jax
import jax.numpy as jnp
import numpy as np
import timing  # experiments/bench/timing.py, beside this file
from absl import app, flags, logging

from lmhead import decoding, fused, head, losses
from lmhead.lm import data, generation, inference, state, train
from lmhead.lm import model as model_lib
from lmhead.serve import continuous, engine, requests

flags.DEFINE_list("mtp_runs", [], "Workdirs of runs trained with MTP heads.")
flags.DEFINE_bool("gpt2", False, "A GPT-2-small-layout model with random weights.")
flags.DEFINE_bool("only_gpt2", False, "Only the GPT-2 model's rows (the GPU check).")
flags.DEFINE_integer(
    "num_speculative_tokens", 4, "k of the n-gram rows.", lower_bound=1
)
flags.DEFINE_integer("requests", 32, "Requests per service row.", lower_bound=1)
FLAGS = flags.FLAGS
DECODERS = {"greedy": dict(temperature=0.0), "T=1": dict(temperature=1.0)}
GPT2_SMALL = dict(num_layers=12, num_heads=12, d_model=768, mlp_dim=3072, max_len=1024)


def random_models() -> list[tuple[str, model_lib.DecoderLM, dict, None]]:
    """Random models: a tiny one with MTP heads (``--quick``), GPT-2 small's
    layout (``--gpt2``)."""
    models = []
    if FLAGS.quick:
        tiny = model_lib.DecoderLM(
            vocab_size=50, num_layers=2, num_heads=2, d_model=32, mlp_dim=64,
            max_len=96, mtp_heads=2,
        )  # fmt: skip
        models.append(("tiny, random", tiny))
    if FLAGS.gpt2:
        shape = GPT2_SMALL if not FLAGS.quick else dict(GPT2_SMALL, num_layers=2)
        gpt2 = model_lib.DecoderLM(vocab_size=50257, **shape)
        models.append(("GPT-2 small layout, random", gpt2))
    out = []
    for name, model in models:
        tokens = jnp.zeros((1, 8), jnp.int32)
        params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
        out.append((name, model, params, None))
    return out


def prompts(model, tokenizer, batch: int) -> dict[str, np.ndarray]:
    """``{"plain": [B, P], "repetitive": [B, P]}`` prompts of ``P =
    --prompt_len`` tokens: passages of the run's text (validation split), or
    random tokens; the repetitive one a passage of ``P / 2`` given twice."""
    length, rng = FLAGS.prompt_len, np.random.default_rng(batch)
    if tokenizer is None:
        source = rng.integers(0, model.vocab_size, 100 * length).astype(np.int32)
    else:
        source = tokenizer.encode_array(data.load_text("")[-200_000:])
    starts = rng.integers(0, len(source) - length, batch)
    plain = np.stack([source[s : s + length] for s in starts])
    half = plain[:, : length - length // 2]
    repetitive = np.concatenate([half, half], axis=1)[:, :length]
    return {"plain": plain, "repetitive": repetitive}


def proposers(model) -> dict[str, decoding.Proposer]:
    found = {"ngram": decoding.NGramProposer(FLAGS.num_speculative_tokens)}
    if model.mtp_heads:
        found = {"mtp": inference.MTPProposer(model, model.mtp_heads), **found}
    return found


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def decode(step_fn, params, logits, new, proposer, cache, prompt, key, temperature):
    """``generate`` of ``new`` tokens with ``proposer`` (None: plain), its
    cache donated; every row runs to ``new`` tokens (no end-of-text)."""
    return decoding.generate(
        step_fn, params, logits, cache, key=key, max_new_tokens=new,
        temperature=temperature, speculative=proposer, prompt_tokens=prompt,
        donate_state=True,
    )  # fmt: skip


def model_rows(name, model, params, tokenizer) -> list[tuple]:
    """The table's rows of one model: each prompt, batch size, decoder and
    proposer against plain decoding."""
    rows, step_fn = [], inference.make_step_fn(model)
    new = min(FLAGS.new_tokens, model.max_len - FLAGS.prompt_len)
    for batch in map(int, FLAGS.batch_sizes):
        for kind, prompt in prompts(model, tokenizer, batch).items():
            for decoder, knobs in DECODERS.items():
                runs, setups, results = {}, {}, {}
                for label, proposer in [("plain", None), *proposers(model).items()]:
                    mtp = label == "mtp"
                    filled = inference.prefill(model, params, prompt, mtp=mtp)
                    fresh = lambda filled=filled: (jax.tree.map(jnp.copy, filled[1]),)
                    run = functools.partial(
                        decode, step_fn, params, filled[0], new, proposer,
                        prompt=prompt, key=jax.random.key(1), temperature=knobs["temperature"],
                    )  # fmt: skip
                    runs[label], setups[label] = run, fresh
                    results[label] = jax.device_get(run(*fresh()))
                seconds = bench_decode.alternate(runs, setups, FLAGS.repeats)
                for label in runs:
                    if label == "plain":
                        continue
                    stats = results[label].speculation
                    same = ""
                    if decoder == "greedy":
                        equal = np.array_equal(
                            results[label].tokens, results["plain"].tokens
                        )
                        same = "yes" if equal else "NO"
                    acceptance = " ".join(
                        f"{a / max(t, 1):.2f}"
                        for a, t in zip(stats.accepted, stats.tested, strict=True)
                    )
                    tokens = batch * new
                    rows.append(
                        (
                            name, kind, batch, decoder, label,
                            f"{tokens / seconds['plain']:,.0f}",
                            f"{tokens / seconds[label]:,.0f}",
                            f"{seconds['plain'] / seconds[label]:.2f}x",
                            f"{results[label].lengths.sum() / stats.calls.sum():.2f}",
                            acceptance, same,
                        )
                    )  # fmt: skip
                    print("  " + " | ".join(map(str, rows[-1])), flush=True)
    return rows


HEADER = (
    "model", "prompt", "batch", "decoder", "proposer", "plain tokens/s",
    "speculative tokens/s", "ratio", "tokens per call", "acceptance by depth",
    "same tokens",
)  # fmt: skip


def hf_prompt_lookup(model, params) -> list[tuple]:
    """Hugging Face's prompt lookup on the GPT-2 model's weights, greedy,
    batch 1, each prompt: its speed-up over its own plain greedy, beside
    lmhead's n-gram speed-up measured in the same rounds."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed: no Hugging Face prompt-lookup rows.")
        return []
    hf = bench_decode.hf_model(model, params)
    new, k = (
        min(FLAGS.new_tokens, model.max_len - FLAGS.prompt_len),
        FLAGS.num_speculative_tokens,
    )
    step_fn, rows = inference.make_step_fn(model), []
    for kind, prompt in prompts(model, None, 1).items():

        def hf_run(lookup, prompt=prompt):
            import torch

            ids = torch.from_numpy(np.asarray(prompt, np.int64))
            options = dict(prompt_lookup_num_tokens=k) if lookup else {}
            with torch.inference_mode():
                out = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, pad_token_id=0, **options,
                )  # fmt: skip
            return out[:, prompt.shape[1] :].numpy()

        logits, cache = inference.prefill(model, params, prompt)
        fresh = lambda cache=cache: (jax.tree.map(jnp.copy, cache),)
        lm = lambda proposer, logits=logits, prompt=prompt: functools.partial(
            decode, step_fn, params, logits, new, proposer, prompt=prompt,
            key=jax.random.key(0), temperature=0.0,
        )  # fmt: skip
        runs = {
            "lmhead plain": lm(None),
            "lmhead ngram": lm(decoding.NGramProposer(k)),
            "hf plain": lambda: hf_run(False),
            "hf lookup": lambda: hf_run(True),
        }
        setups = {
            "lmhead plain": fresh,
            "lmhead ngram": fresh,
            "hf plain": tuple,
            "hf lookup": tuple,
        }
        same = np.array_equal(
            hf_run(True), np.asarray(runs["lmhead ngram"](*fresh()).tokens)
        )
        seconds = bench_decode.alternate(runs, setups, FLAGS.repeats)
        ours = seconds["lmhead plain"] / seconds["lmhead ngram"]
        theirs = seconds["hf plain"] / seconds["hf lookup"]
        rows.append(
            (kind, f"{new / seconds['hf plain']:,.0f}", f"{new / seconds['hf lookup']:,.0f}",
             f"{theirs:.2f}x", f"{ours:.2f}x", f"{ours / theirs:.2f}",
             "yes" if same else "NO")
        )  # fmt: skip
    return rows


def service_rows(workdir: str) -> list[tuple]:
    """The run's decode slots in process: ``--requests`` greedy requests of
    ``--new_tokens`` tokens from 1, 4 and 16 clients, speculation off and on."""
    _, tokenizer, model, params = generation.load_run(workdir)
    new = min(FLAGS.new_tokens, model.max_len - 16)
    buckets = requests.Buckets(
        batch_sizes=(1, 16), prompt_lengths=(16,), new_tokens=(new,), beam_sizes=()
    )
    served = engine.Engine(model, params, tokenizer, buckets)
    text = data.load_text("")[-5000:]
    rows, rates = [], {}
    for clients in (1, 4, 16):
        for speculative in (None, *proposers(model)):
            slots = continuous.SlotBatcher(
                served, slots=16, max_queue=FLAGS.requests, speculative=speculative,
                num_speculative_tokens=(
                    model.mtp_heads if speculative == "mtp" else FLAGS.num_speculative_tokens
                ),
            )  # fmt: skip
            slots.warm_up()
            try:
                rates[clients, speculative] = _serve(slots, served, text, clients, new)
            finally:
                slots.stop()
        for speculative in proposers(model):
            plain = rates[clients, None]
            rows.append(
                (clients, speculative, f"{plain:,.0f}",
                 f"{rates[clients, speculative]:,.0f}",
                 f"{rates[clients, speculative] / plain:.2f}x")
            )  # fmt: skip
    return rows


def _serve(slots, served, text, clients: int, new: int) -> float:
    """Tokens/s of ``--requests`` greedy requests from ``clients`` threads."""
    body = lambda i: requests.parse_completion(
        {"model": "m", "prompt": text[37 * i : 37 * i + 12], "max_tokens": new,
         "temperature": 0, "ignore_eos": True},
        served.tokenizer, served.buckets, requests.Limits(), "m",
        context=served.model.max_len,
    )  # fmt: skip

    def client(indices):
        return sum(
            slots.submit(body(i)).result(timeout=600)["completion_tokens"]
            for i in indices
        )

    chunks = [range(c, FLAGS.requests, clients) for c in range(clients)]
    client(range(2))  # the first requests of a batcher run slower
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client, chunks))
    return tokens / (time.perf_counter() - start)


def training_rows(workdir: str) -> list[tuple]:
    """A training step of the run's config at its ``mtp_heads`` and at 0,
    side by side (its batch, random tokens), and the ratio of their
    training FLOPs per token (``lmhead.lm.model.training_flops_per_token``): the
    ratio the step's time would have if it ran at one rate."""
    config, tokenizer, model, _ = generation.load_run(workdir)
    programs, flops = {}, {}
    for heads in (0, model.mtp_heads):
        variant = model.clone(mtp_heads=heads)
        train_state = state.create_train_state(variant, config, jax.random.key(0))
        step = jax.jit(
            functools.partial(
                train.train_step, model=variant,
                loss_kwargs=train.loss_keywords(config.loss),
                learning_rate_fn=state.learning_rate_schedule(config),
                microbatches=config.train.microbatches,
            )
        )  # fmt: skip
        shape = (config.train.batch_size, config.data.block_size)
        tokens = jax.random.randint(jax.random.key(1), shape, 0, model.vocab_size)
        batch = {"inputs": tokens, "labels": tokens}
        jax.block_until_ready(step(train_state, batch, jax.random.key(2)))
        programs[f"k={heads}"] = functools.partial(
            step, train_state, batch, jax.random.key(2)
        )
        flops[f"k={heads}"] = model_lib.training_flops_per_token(variant)
    seconds = timing.alternate(programs, None, 5 * FLAGS.repeats)
    plain = float(seconds["k=0"][0])
    return [
        (
            name,
            f"{1e3 * float(t[0]):.1f}",
            f"{float(t[0]) / plain:.2f}x",
            f"{flops[name] / flops['k=0']:.2f}x",
        )
        for name, t in seconds.items()
    ]


def memory_row(n=8192, d=512, v=32768, k=3) -> tuple:
    """The MTP loss's compiled temporary memory (value and gradients), fused
    and materialized, as tests/lm/test_mtp.py compiles it."""
    hs = jax.ShapeDtypeStruct((k + 1, 1, n, d), jnp.float32)
    w = jax.ShapeDtypeStruct((v, d), jnp.float32)
    labels = jax.ShapeDtypeStruct((1, n), jnp.int32)

    def loss(loss_fn, hs, w, labels):
        scales = jnp.concatenate([jnp.ones(1), jnp.full(k, 0.3 / k)])
        stacked, weights = losses.depth_targets(
            labels, None, tuple(range(k + 1)), scales
        )
        return loss_fn(hs, w, stacked, weights=weights, reduction="sum",
                       grouped_metrics=True)  # fmt: skip

    def materialized(h, w, labels, **options):
        return losses.cross_entropy(head.unembed(h, w), labels, **options)

    temp = {}
    for name, fn in (
        ("fused", fused.fused_cross_entropy),
        ("materialized", materialized),
    ):
        step = jax.jit(
            jax.value_and_grad(functools.partial(loss, fn), (0, 1), has_aux=True)
        )
        temp[name] = (
            step.lower(hs, w, labels).compile().memory_analysis().temp_size_in_bytes
        )
    return (
        f"N={n}, D={d}, V={v}, k={k}", f"{temp['fused'] / 2**20:,.0f}",
        f"{temp['materialized'] / 2**20:,.0f}",
        f"{temp['materialized'] / temp['fused']:.1f}x",
    )  # fmt: skip


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    print(timing.machine(), flush=True)
    if FLAGS.quick:
        FLAGS.batch_sizes, FLAGS.new_tokens, FLAGS.repeats = ["1", "4"], 16, 2
    models = []
    for workdir in [] if FLAGS.only_gpt2 else FLAGS.mtp_runs:
        _, tokenizer, model, params = generation.load_run(workdir)
        models.append((workdir, model, params, tokenizer))
    models += random_models()
    if not models:
        raise app.UsageError("Give --mtp_runs, --gpt2 or --quick.")
    rate = timing.Matmul(FLAGS.matmul_size).rate()
    print(f"float32 matmul {rate / 1e9:.0f} GFLOP/s; prompt {FLAGS.prompt_len} tokens, "
          f"{FLAGS.new_tokens} new tokens per row", flush=True)  # fmt: skip
    rows = [row for model in models for row in model_rows(*model)]
    print("\n" + timing.table(HEADER, rows))
    gpt2 = [m for m in models if m[0].startswith("GPT-2")]
    if gpt2:
        hf = hf_prompt_lookup(*gpt2[0][1:3])
        if hf:
            print("\nHugging Face prompt lookup on the same weights, greedy, batch 1:")
            print(timing.table(
                ("prompt", "hf plain tokens/s", "hf lookup tokens/s", "hf speed-up",
                 "lmhead ngram speed-up", "lmhead / hf", "same tokens"), hf))  # fmt: skip
    if FLAGS.only_gpt2 or not FLAGS.mtp_runs:
        return
    first = FLAGS.mtp_runs[0]
    print(f"\nThe service's decode slots ({first}, in process), greedy:")
    print(timing.table(
        ("clients", "proposer", "plain tokens/s", "speculative tokens/s", "ratio"),
        service_rows(first)))  # fmt: skip
    print(f"\nA training step ({first}'s config), side by side:")
    print(
        timing.table(
            ("MTP heads", "ms/step", "vs k=0", "FLOPs per token vs k=0"),
            training_rows(first),
        )
    )
    print("\nThe MTP loss's compiled temporary memory (MiB):")
    print(timing.table(("shape", "fused", "materialized", "ratio"), [memory_row()]))


if __name__ == "__main__":
    app.run(main)
