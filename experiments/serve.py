r"""Serves a trained run over HTTP: OpenAI's completions and chat, health and metrics.

    pip install -e '.[serve]'
    python experiments/serve.py --workdir=runs/nanogpt_tied          # 127.0.0.1:8000
    python experiments/serve.py --workdir=runs/nanogpt_tied --host=0.0.0.0 \
        --token_file=secret.txt     # any other address needs a bearer token

``--speculative=mtp|ngram`` decodes the slots speculatively
(docs/decoding.md, "Speculative decoding"; docs/serving.md measures it).
Completions are batched continuously (``lmhead/serve/continuous.py``); a
request fits when its prompt plus ``max_tokens`` fits the run's context
(``echo`` with ``max_tokens`` 0 or 1 scores a prompt of the whole context).
A chat's messages become a prompt through the run's chat template
(``WORKDIR/tokenizer_config.json``'s ``chat_template``, an imported
checkpoint's; else ``lmhead.serve.chat.DEFAULT_TEMPLATE``).
The decode slots (a prefill per prompt length, a fill, the step) and the scorer
of echoed prompts are compiled before it listens, and beam search compiles a
shape on its first use. Compiled programs are kept in
``--compilation_cache`` (default ``WORKDIR/xla_cache``), so a second start of
the same run loads them. The endpoints are described in
``lmhead/serve/web.py``.
"""

import os
import time

import cli  # experiments/cli.py, beside this file
import jax
from absl import app, flags

from lmhead.lm import generation
from lmhead.serve import chat, continuous, engine, requests, web

cli.workdir_flag()
flags.DEFINE_string(
    "host", "127.0.0.1", "Address to listen on; any but loopback needs --token_file."
)
flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=0)
flags.DEFINE_string(
    "token_file",
    None,
    "File holding the bearer token that every endpoint but /healthz then requires.",
)
flags.DEFINE_list(
    "batch_sizes",
    [],
    "Batch sizes (rows) to compile, ascending; "
    "the largest caps a batch. Default: powers of 2 up to 16.",
)
flags.DEFINE_list(
    "prompt_lengths",
    [],
    "Prompt lengths (tokens) to compile; the "
    "largest caps a prompt. Default: powers of 2 from 8 up to max_len, and "
    "max_len.",
)
flags.DEFINE_list(
    "new_tokens",
    [],
    "The max_tokens values beam search may run (each compiles on its first "
    "use). Default: powers of 2 up to max_len, and max_len.",
)
flags.DEFINE_list("beam_sizes", ["2", "4"], "num_beams values above 1 to allow.")
flags.DEFINE_integer("max_prompts", 16, "Prompts per request.", lower_bound=1)
flags.DEFINE_integer(
    "max_stops",
    requests.Limits.max_stops,
    "Stop strings (and stop_token_ids) per request.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "max_stop_chars",
    requests.Limits.max_stop_chars,
    "Characters of one stop string.",
    lower_bound=1,
)
flags.DEFINE_bool(
    "cap_max_tokens",
    False,
    "Cut a max_tokens past the context to the room the prompt leaves instead "
    "of answering 400 (for harnesses that send one count to every model).",
)
flags.DEFINE_integer("max_body_bytes", 65536, "Largest request body.", lower_bound=1)
flags.DEFINE_integer(
    "max_queue", 64, "Requests that may wait; more get 503.", lower_bound=1
)
flags.DEFINE_float("timeout_s", 30.0, "A request not answered by then gets 504.")
flags.register_validator(
    "timeout_s", lambda value: value > 0, message="--timeout_s must be > 0."
)
flags.DEFINE_integer("seed", 0, "Key of the batches of requests without a seed.")
flags.DEFINE_integer(
    "slots", None, "Decode slots; default the largest batch size.", lower_bound=1
)
flags.DEFINE_integer(
    "steps_per_call",
    web.ServiceConfig.steps_per_call,
    "Decoding steps per compiled call of the slots.",
    lower_bound=1,
)
flags.DEFINE_enum(
    "speculative",
    None,
    list(generation.SPECULATIVE),
    "Speculative decoding in the decode slots: proposals from the run's MTP "
    "heads or from n-gram lookup (the same tokens greedily, the same "
    "distribution sampled).",
)
flags.DEFINE_integer(
    "num_speculative_tokens", 3, "Proposals per decoding step with --speculative."
)
flags.DEFINE_string("model_name", "lmhead", "The model name of the OpenAI routes.")
flags.DEFINE_string(
    "compilation_cache",
    None,
    "Directory of JAX's persistent compilation cache; default WORKDIR/xla_cache, "
    "'' for none.",
)


def _sizes(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in flags.FLAGS[name].value) or default
    except ValueError:
        raise app.UsageError(f"--{name} must list integers.") from None


def main(argv):
    f = cli.start(argv)
    token = web.read_token(f.token_file) if f.token_file else None
    batch_sizes = _sizes("batch_sizes", requests.powers_of_two(16))
    try:
        requests.check_exposure(f.host, token)
        continuous.slot_count(f.slots, batch_sizes)  # before loading and warm-up
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    cache = (
        os.path.join(f.workdir, "xla_cache")
        if f.compilation_cache is None
        else f.compilation_cache
    )
    if cache:  # every program, however fast it compiles: warm starts load them
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    _, tokenizer, model, params = generation.load_run(f.workdir)
    try:  # before the warm-up
        generation.proposer(model, f.speculative, f.num_speculative_tokens, None)
    except ValueError as error:
        raise app.UsageError(f"--{error}") from None
    buckets = requests.Buckets(
        batch_sizes=batch_sizes,
        prompt_lengths=_sizes("prompt_lengths", requests.prompt_buckets(model.max_len)),
        new_tokens=_sizes("new_tokens", requests.powers_of_two(model.max_len)),
        beam_sizes=_sizes("beam_sizes", ()),
    )
    served = engine.Engine(
        model,
        params,
        tokenizer,
        buckets,
        seed=f.seed,
        chat_template=chat.ChatTemplate.of_run(f.workdir, tokenizer),
    )
    start = time.perf_counter()
    served.warm_up()
    config = web.ServiceConfig(
        token=token,
        max_body_bytes=f.max_body_bytes,
        max_queue=f.max_queue,
        timeout_s=f.timeout_s,
        limits=requests.Limits(
            max_prompts=f.max_prompts,
            max_stops=f.max_stops,
            max_stop_chars=f.max_stop_chars,
            cap_max_tokens=f.cap_max_tokens,
        ),
        model_name=f.model_name,
        slots=f.slots,
        steps_per_call=f.steps_per_call,
        speculative=f.speculative,
        num_speculative_tokens=f.num_speculative_tokens,
    )
    try:
        service = web.make_app(served, config)  # compiles the decode slots
    except ValueError as error:  # a flag the batcher refuses (--steps_per_call)
        raise app.UsageError(str(error)) from None
    print(
        f"warm-up: the scorer and the decode slots in "
        f"{time.perf_counter() - start:.1f} s; buckets {buckets}",
        flush=True,
    )
    web.serve(service, f.host, f.port)


if __name__ == "__main__":
    app.run(main)
