"""Running OpenAI completion requests on an engine: one batch of
:class:`~lmhead.serve.openai_api.CompletionRequest` as one call of
:func:`lmhead.decoding.generate` (or :func:`lmhead.decoding.generate_stream`
when a request streams), with per-row knobs, keys, lengths and stop strings,
and the echoed prompt's log-probs from the scorer
(:func:`lmhead.lm.scoring.strided_log_probs`).

Log-probs are the model's own (``log_probs_from="model"``: the raw
``log_softmax``, before temperature, penalties and truncation), as an
evaluation harness expects.
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import decoding
from lmhead.lm import generation, scoring
from lmhead.serve import requests
from lmhead.serve.openai_api import (
    FINISH_REASONS,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    STREAM_CHUNK_STEPS,
    CompletionRequest,
)


def token_text(tokenizer: Any, token: int) -> str:
    """One token's text, as ``tokens`` and ``top_logprobs`` name it.

    Examples:
        >>> from lmhead.lm import data
        >>> token_text(data.CharTokenizer("ab"), 1)
        'b'
    """
    return tokenizer.decode([int(token)])


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prompt_top(logits_fn, params, tokens, k):
    log_probs = jax.nn.log_softmax(logits_fn(params, tokens).astype(np.float32))
    return jax.lax.top_k(log_probs, k)


def top_width(engine: Any) -> int:
    """How many top log-probs a decoding batch computes: OpenAI's most, or
    every token of a smaller vocabulary (a request's ``logprobs`` reads its
    first ones)."""
    return min(MAX_LOGPROBS, engine.model.vocab_size)


def prompt_log_probs(engine: Any, ids: np.ndarray, k: int) -> tuple[list, list]:
    """The echoed prompt's ``token_logprobs`` (the scorer's, the first one
    None: nothing predicts it) and ``top_logprobs`` (``k`` most likely
    ``{token text: log-prob}`` at each position, None first; ``k`` past the
    vocabulary gives every token, as the completion's top log-probs do).

    The top ``k`` come from one forward pass of the prompt padded to its
    bucket (causal, so the padding changes nothing before it)."""
    chosen = [None]
    if len(ids) > 1:
        chosen += [
            float(x)
            for x in scoring.strided_log_probs(
                scoring.ModelLogits(engine.model),
                engine.params,
                ids,
                window=engine.model.max_len,
                batch_size=engine.score_batch_size,
            )
        ]
    k = min(k, engine.model.vocab_size)
    if k == 0:
        return chosen, [None] + [{} for _ in ids[1:]]
    width = requests.bucket(len(ids), engine.buckets.prompt_lengths)
    padded = np.zeros([1, width], np.int32)
    padded[0, : len(ids)] = ids
    values, tokens = jax.device_get(
        _prompt_top(scoring.ModelLogits(engine.model), engine.params, padded, k)
    )
    tops = [
        _top_map(engine.tokenizer, tokens[0, j], values[0, j])
        for j in range(len(ids) - 1)
    ]
    return chosen, [None] + tops


def _top_map(tokenizer: Any, tokens, values) -> dict[str, float]:
    top = {}
    for token, value in zip(tokens, values):
        top.setdefault(token_text(tokenizer, token), float(value))
    return top


_TOKEN_BYTES: dict[int, tuple[Any, list[bytes]]] = {}


def _token_bytes(tokenizer: Any) -> list[bytes]:
    """:func:`generation.token_bytes`, made once per tokenizer."""
    held = _TOKEN_BYTES.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        held = _TOKEN_BYTES[id(tokenizer)] = (
            tokenizer,
            generation.token_bytes(tokenizer),
        )
    return held[1]


def derive_keys(
    key: jax.Array, batch_index: jax.Array, seeds: jax.Array, folds: jax.Array
) -> jax.Array:
    """Raw keys ``uint32 [R, 2]`` from :func:`key_recipe`'s arrays (``[R]``
    each): row ``r`` folds ``folds[r]`` into ``key(seeds[r])``, or, where
    ``seeds[r] < 0``, into its batch's key ``fold_in(key, batch_index[r])``
    (which it takes unfolded where ``folds[r] < 0``). Traceable, so that a
    caller may make the keys inside its own program.

    Examples:
        >>> raw = derive_keys(jax.random.key(0), np.zeros([2], np.int32),
        ...                   np.array([7, -1], np.int32), np.array([3, 1], np.int32))
        >>> bool((raw[0] == jax.random.key_data(
        ...     jax.random.fold_in(jax.random.key(7), 3))).all())
        True
    """

    def one(index, seed, fold):
        base = jax.random.fold_in(key, index)
        own = jax.random.fold_in(jax.random.key(jnp.maximum(seed, 0)), fold)
        shared = jnp.where(
            fold < 0,
            jax.random.key_data(base),
            jax.random.key_data(jax.random.fold_in(base, fold)),
        )
        return jnp.where(seed >= 0, jax.random.key_data(own), shared)

    return jax.vmap(one)(batch_index, seeds, folds)


def key_recipe(
    engine: Any, batch: list[CompletionRequest], rows: list, size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`derive_keys` needs for one batch of ``size`` rows, each
    ``int32 [size]``: the batch's number (the engine's next), the seeds
    (-1: none) and the folds. A seeded request's row ``p n + s`` draws from
    ``fold_in(key(seed), p n + s)``, whatever its batch; the others from the
    batch's key folded with the row; padding rows take the batch's key."""
    seeds = np.full([size], -1, np.int32)
    folds = np.full([size], -1, np.int32)
    for row, (r, p, s) in enumerate(rows):
        seed = batch[r].seed
        if seed is None:
            folds[row] = row
        else:
            seeds[row], folds[row] = seed, p * batch[r].n + s
    return np.full([size], next(engine._batch_index), np.int32), seeds, folds


_derive_keys = jax.jit(derive_keys)


def row_keys(
    engine: Any, batch: list[CompletionRequest], rows: list, size: int
) -> jax.Array:
    """One raw key per row, ``uint32 [size, 2]`` (a form ``generate`` takes),
    as :func:`key_recipe` describes; one compiled call, since keys made op by
    op cost a dispatch per operation. Left on the device, where ``generate``
    reads them."""
    return _derive_keys(engine._key, *key_recipe(engine, batch, rows, size))


def _batch_knobs(batch: list, rows: list, size: int) -> decoding.SamplingKnobs:
    knobs = [batch[r].knobs for r, _, _ in rows]
    if any(k.reads_counts for k in knobs):  # set in every row or in none
        knobs = [
            dataclasses.replace(
                k,
                presence_penalty=k.presence_penalty or 0.0,
                frequency_penalty=k.frequency_penalty or 0.0,
            )
            for k in knobs
        ]
    return decoding.SamplingKnobs.stack(knobs, size=size)


def _generate(engine: Any, batch: list[CompletionRequest], rows: list) -> Any:
    """The batch's :class:`decoding.Generation` (as numpy), streaming each
    chunk to the requests that have a sink."""
    logits, cache, history = engine._prefill(
        [batch[r].prompt_ids[p] for r, p, _ in rows]
    )
    size = len(logits)
    row_max = np.ones([size], np.int32)
    row_max[: len(rows)] = [batch[r].max_tokens for r, _, _ in rows]
    stops = [batch[r].stop for r, _, _ in rows] + [[]] * (size - len(rows))
    arguments = dict(
        key=row_keys(engine, batch, rows, size),
        max_new_tokens=requests.bucket(int(row_max.max()), engine.buckets.new_tokens),
        knobs=_batch_knobs(batch, rows, size),
        prompt_tokens=history,
        eos_id=engine.tokenizer.eos_id,
        row_max_new_tokens=row_max,
        stop=None
        if not any(stops)
        else decoding.StopStrings.build(
            stops,
            _token_bytes(engine.tokenizer),
            max_bytes=4 * MAX_STOP_CHARS,
            max_strings=MAX_STOPS,
        ),
        top_logprobs=top_width(engine)
        if any(r.logprobs is not None for r in batch)
        else 0,
        log_probs_from="model",
    )
    step_fn, params = engine._step_fn, engine.params
    if not any(r.sink is not None for r in batch):
        return jax.device_get(
            decoding.generate(
                step_fn, params, logits, cache, donate_state=True, **arguments
            )
        )
    chunks = []
    for chunk in decoding.generate_stream(
        step_fn, params, logits, cache, chunk_steps=STREAM_CHUNK_STEPS, **arguments
    ):
        chunks.append(jax.device_get(chunk))
        _emit(engine, batch, rows, chunks)
    last = chunks[-1]
    return last._replace(
        **{
            name: np.concatenate([getattr(c, name) for c in chunks], axis=1)
            for name in ("tokens", "log_probs", "top_tokens", "top_log_probs")
        }
    )


def completion_text(engine: Any, request: CompletionRequest, ids, done: bool) -> str:
    """The completion's text; while the row runs, without the characters
    that may still turn out part of a stop string or of a character."""
    text = decoding.detokenize(
        np.asarray(ids, np.int32), engine.tokenizer, eos_id=engine.tokenizer.eos_id
    )
    if request.stop:
        text = decoding.trim_at_stop(text, request.stop)
    if not done:
        hold = max((len(s) for s in request.stop), default=1) - 1
        text = text[: max(len(text) - hold, 0)].rstrip("\ufffd")
    return text


def _emit(engine: Any, batch: list, rows: list, chunks: list) -> None:
    """Calls each streaming request's sink with its rows' text so far."""
    steps = sum(c.tokens.shape[1] for c in chunks)
    lengths = chunks[-1].lengths
    updates = {id(r): [] for r in batch if r.sink is not None}
    for row, (r, p, s) in enumerate(rows):
        request = batch[r]
        if request.sink is None:
            continue
        length = int(lengths[row])
        ids = np.concatenate([c.tokens[row] for c in chunks])[:length]
        done = length < steps or length >= request.max_tokens
        text = completion_text(engine, request, ids, done)
        prefix = request.prompt_texts[p] if request.echo else ""
        updates[id(request)].append((p * request.n + s, prefix + text, length))
    for request in batch:
        if request.sink is not None:
            request.sink(updates[id(request)])


def _logprobs_block(tokenizer, entries: list, offset: int) -> dict:
    """OpenAI's ``logprobs`` of ``(token id, log-prob, top map)`` entries."""
    tokens = [token_text(tokenizer, t) for t, _, _ in entries]
    offsets = list(np.cumsum([offset] + [len(t) for t in tokens])[:-1].tolist())
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [top for _, _, top in entries],
        "text_offset": offsets,
    }


def _choice(engine, request, p, s, generated, row, prompt_scores) -> tuple[dict, int]:
    """One choice and its count of generated tokens."""
    tokenizer = engine.tokenizer
    ids, entries, finish = np.zeros([0], np.int32), [], "length"
    if generated is not None:
        length = int(generated.lengths[row])
        ids = generated.tokens[row, :length]
        finish = FINISH_REASONS[int(generated.finish_reasons[row])]
        if request.logprobs is not None:
            k = request.logprobs
            entries = [
                (
                    ids[j],
                    json_float(generated.log_probs[row, j]),
                    _top_map(
                        tokenizer,
                        generated.top_tokens[row, j, :k],
                        generated.top_log_probs[row, j, :k],
                    ),
                )
                for j in range(length)
            ]
    text = completion_text(engine, request, ids, done=True)
    prompt_text = request.prompt_texts[p]
    offset = len(prompt_text)
    if request.echo:
        text, offset = prompt_text + text, 0
        if request.logprobs is not None:
            chosen, tops = prompt_scores[p]
            prompt_ids = request.prompt_ids[p]
            entries = list(zip(prompt_ids, chosen, tops)) + entries
    block = (
        None
        if request.logprobs is None
        else _logprobs_block(tokenizer, entries, offset)
    )
    choice = {
        "text": text,
        "index": p * request.n + s,
        "finish_reason": finish,
        "logprobs": block,
    }
    return choice, len(ids)


def json_float(x: float) -> float | None:
    """JSON has no infinities: a non-finite value becomes null.

    Examples:
        >>> json_float(-0.5), json_float(float("-inf"))
        (-0.5, None)
    """
    return float(x) if math.isfinite(x) else None


def echo_scores(engine: Any, request: CompletionRequest) -> dict[int, tuple]:
    """:func:`prompt_log_probs` of each prompt, by prompt index, when the
    request echoes its prompts with log-probs; else ``{}``."""
    if not (request.echo and request.logprobs is not None):
        return {}
    return {
        p: prompt_log_probs(engine, ids, request.logprobs)
        for p, ids in enumerate(request.prompt_ids)
    }


def request_result(
    engine: Any,
    request: CompletionRequest,
    rows: list[tuple[int, int, int]],
    generated: Any,
    prompt_scores: dict[int, tuple],
) -> dict:
    """One request's ``{"choices", "prompt_tokens", "completion_tokens"}``.

    ``rows`` lists ``(row, p, s)``: row ``row`` of ``generated`` (a
    :class:`decoding.Generation` of numpy arrays; None when ``max_tokens``
    is 0) is sample ``s`` of prompt ``p``, in OpenAI's order."""
    choices, tokens = [], 0
    for row, p, s in rows:
        choice, count = _choice(engine, request, p, s, generated, row, prompt_scores)
        choices.append(choice)
        tokens += count
    return {
        "choices": choices,
        "prompt_tokens": sum(len(ids) for ids in request.prompt_ids),
        "completion_tokens": tokens,
    }


def run_completions(engine: Any, batch: list[CompletionRequest]) -> list[dict]:
    """Runs completion requests of one :meth:`CompletionRequest.group` as
    one batch on ``engine`` (a :class:`lmhead.serve.batching.Engine`).

    Returns, per request, :func:`request_result`: the choices in OpenAI's
    order (prompt by prompt, ``n`` each), as :func:`completion_body` sends
    them."""
    rows = [
        (r, p, s)
        for r, request in enumerate(batch)
        for p in range(len(request.prompt_ids))
        for s in range(request.n)
    ]
    generated = None if batch[0].max_tokens == 0 else _generate(engine, batch, rows)
    return [
        request_result(
            engine,
            request,
            [(row, p, s) for row, (owner, p, s) in enumerate(rows) if owner == r],
            generated,
            echo_scores(engine, request),
        )
        for r, request in enumerate(batch)
    ]


def beam_result(request: CompletionRequest, completions: list[dict]) -> dict:
    """:func:`run_completions`'s result from the engine's beam completions
    (prompt by prompt, best first; the first ``n`` of each prompt's)."""
    choices, tokens = [], 0
    for p in range(len(request.prompt_ids)):
        mine = [c for c in completions if c["prompt_index"] == p][: request.n]
        for s, c in enumerate(mine):
            prefix = request.prompt_texts[p] if request.echo else ""
            choices.append(
                {
                    "text": prefix + c["text"],
                    "index": p * request.n + s,
                    "finish_reason": "length"
                    if c["length"] >= request.max_tokens
                    else "stop",
                    "logprobs": None,
                }
            )
            tokens += c["length"]
    return {
        "choices": choices,
        "prompt_tokens": sum(len(ids) for ids in request.prompt_ids),
        "completion_tokens": tokens,
    }
