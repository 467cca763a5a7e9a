"""The answers of ``/v1/completions``: a request's choices, texts and
log-probs from its decoded rows (:func:`request_result`), the echoed
prompt's log-probs (:func:`prompt_log_probs`), each row's key
(:func:`key_recipe`, :func:`derive_keys`), and OpenAI's response objects
(:func:`completion_body`, :func:`stream_chunk`). Log-probs are the model's
own (the raw ``log_softmax``, before temperature, penalties and
truncation), as an evaluation harness expects.
"""

import functools
import math
import time
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import decoding
from lmhead.lm import scoring
from lmhead.serve import chat
from lmhead.serve.requests import MAX_LOGPROBS, CompletionRequest

FINISH_REASONS = {
    decoding.FINISHED_LENGTH: "length",
    decoding.FINISHED_EOS: "stop",
    decoding.FINISHED_STOP: "stop",
    decoding.FINISHED_BAD_LOGITS: "stop",  # the row cannot go on
}


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
    """The top ``k`` log-probs at each position of ``tokens [1, L]``, and
    each next token's log-prob and rank (1: the likeliest; ties count
    with it)."""
    log_probs = jax.nn.log_softmax(logits_fn(params, tokens).astype(np.float32))
    values, top = jax.lax.top_k(log_probs, k)
    chosen = jnp.take_along_axis(log_probs[:, :-1], tokens[:, 1:, None], axis=-1)
    ranks = 1 + jnp.sum(log_probs[:, :-1] > chosen, axis=-1)
    return values, top, chosen[..., 0], ranks


def _prompt_pass(engine: Any, ids: np.ndarray):
    """:func:`_prompt_top` of the prompt padded to the context (causal: the
    padding changes nothing before it): one program for every prompt."""
    padded = np.zeros([1, engine.model.max_len], np.int32)
    padded[0, : len(ids)] = ids
    return jax.device_get(
        _prompt_top(
            scoring.ModelLogits(engine.model), engine.params, padded, top_width(engine)
        )
    )


def top_width(engine: Any) -> int:
    """How many top log-probs a decoding batch computes: the most a request
    may ask, or every token of a smaller vocabulary (a request's
    ``logprobs`` reads its first ones)."""
    return min(MAX_LOGPROBS, engine.model.vocab_size)


def prompt_log_probs(engine: Any, ids: np.ndarray, k: int) -> tuple[list, list]:
    """The echoed prompt's ``token_logprobs`` (the scorer's,
    :func:`lmhead.lm.scoring.strided_log_probs`; None first: nothing
    predicts it) and ``top_logprobs`` (``k`` most likely ``{token text:
    log-prob}`` at each position, None first; ``k`` past the vocabulary
    gives every token), from one forward pass of the prompt padded to the
    context (causal: the padding changes nothing before it) that takes the
    top :func:`top_width` whatever ``k``, one program for every request."""
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
    values, tokens, _, _ = _prompt_pass(engine, ids)
    values, tokens = values[..., :k], tokens[..., :k]
    tops = [
        _top_map(engine.tokenizer, tokens[0, j], values[0, j])
        for j in range(len(ids) - 1)
    ]
    return chosen, [None] + tops


def vllm_prompt_logprobs(engine: Any, ids: np.ndarray, k: int) -> list:
    """vLLM's ``prompt_logprobs`` of a prompt: None for its first token
    (nothing predicts it), then for each next token ``{token id:
    {"logprob", "rank", "decoded_token"}}`` of the ``k`` likeliest and that
    token (JSON makes the ids strings), from :func:`_prompt_pass`."""
    values, tokens, chosen, ranks = _prompt_pass(engine, ids)
    text = lambda token: token_text(engine.tokenizer, token)
    out: list = [None]
    for j, token in enumerate(ids[1:]):
        entry = {
            top: {"logprob": json_float(value), "rank": rank + 1, "decoded_token": text(top)}
            for rank, (top, value) in enumerate(
                zip(tokens[0, j, :k].tolist(), values[0, j, :k].tolist())
            )
        }  # fmt: skip
        entry[int(token)] = {
            "logprob": json_float(chosen[0, j]),
            "rank": int(ranks[0, j]),
            "decoded_token": text(token),
        }
        out.append(entry)
    return out


def _top_map(tokenizer: Any, tokens, values) -> dict[str, float]:
    top = {}
    for token, value in zip(tokens, values):
        top.setdefault(token_text(tokenizer, token), float(value))
    return top


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
    engine: Any, request: CompletionRequest
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`derive_keys` needs for the request's rows ``p n + s``
    (``int32 [R]`` each): the batch's number (the engine's next), the seeds
    (-1: none) and the folds. A seeded request's row ``p n + s`` draws from
    ``fold_in(key(seed), p n + s)`` whatever its batch, the others from the
    batch's key folded with the row.

    Examples:
        >>> from lmhead.lm import data
        >>> from lmhead.serve import requests as r
        >>> class Engine: _batch_index = iter([5])
        >>> request = r.parse_completion({"model": "m", "prompt": "a", "n": 2,
        ...     "seed": 7}, data.CharTokenizer("a"), r.Buckets((2,), (4,), (4,)),
        ...     r.Limits(), "m")
        >>> [a.tolist() for a in key_recipe(Engine, request)]
        [[5, 5], [7, 7], [0, 1]]
    """
    rows = request.rows
    seed = -1 if request.seed is None else request.seed
    return (
        np.full([rows], next(engine._batch_index), np.int32),
        np.full([rows], seed, np.int32),
        np.arange(rows, dtype=np.int32),
    )


def eos_id(engine: Any, request: CompletionRequest) -> int | None:
    """The EOS id that cuts a row's text: the tokenizer's, or None with
    ``ignore_eos``.

    Examples:
        >>> from lmhead.lm import data
        >>> from lmhead.serve import requests as r
        >>> class Engine: tokenizer = data.CharTokenizer("ab", "<|endoftext|>")
        >>> body = {"model": "m", "prompt": "a", "ignore_eos": True}
        >>> buckets = r.Buckets((1,), (8,), (8,))
        >>> request = r.parse_completion(body, Engine.tokenizer, buckets, r.Limits(), "m")
        >>> eos_id(Engine, request), Engine.tokenizer.eos_id
        (None, 2)
    """
    return None if request.ignore_eos else getattr(engine.tokenizer, "eos_id", None)


def _text(engine: Any, request: CompletionRequest, ids) -> str:
    return decoding.detokenize(
        np.asarray(ids, np.int32), engine.tokenizer, eos_id=eos_id(engine, request)
    )


def completion_text(engine: Any, request: CompletionRequest, ids, done: bool) -> str:
    """The completion's text. A row that ended is cut at the stop string its
    last token completed (the decode step ended it there; of the strings
    ending after the text of the tokens before ``min_tokens``, the first,
    :func:`lmhead.decoding.trim_at_stop`), or kept through it with
    ``include_stop_str_in_output``; while the row runs, without the
    characters that may still turn out part of a stop string or of a
    character.

    Examples:
        >>> from lmhead.lm import data
        >>> from lmhead.serve import requests as r
        >>> class Engine: tokenizer = data.CharTokenizer("abc")
        >>> request = r.parse_completion({"model": "m", "prompt": "a",
        ...     "stop": ["bc"]}, Engine.tokenizer, r.Buckets((1,), (8,), (8,)),
        ...     r.Limits(), "m")
        >>> ids = [0, 1, 0, 1, 2]  # "ababc": the step ended the row at "c"
        >>> completion_text(Engine, request, ids, done=False), completion_text(
        ...     Engine, request, ids, done=True)
        ('abab', 'aba')
    """
    text = _text(engine, request, ids)
    if not request.stop:
        return text if done else text.rstrip("\ufffd")
    if done:
        return decoding.trim_at_stop(
            text,
            request.stop,
            after=_stop_search_start(engine, request, ids),
            include_stop=request.include_stop_str,
        )
    hold = max(len(s) for s in request.stop) - 1
    return text[: max(len(text) - hold, 0)].rstrip("\ufffd")


def _stop_search_start(engine: Any, request: CompletionRequest, ids) -> int:
    """The characters of the text of the tokens before ``min_tokens``, whose
    stop strings did not end the row."""
    before = ids[: max(request.min_tokens - 1, 0)]
    return len(_text(engine, request, before)) if len(before) else 0


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


def _entries(request, generated, row, length) -> list:
    """``(token id, log-prob, [(top id, log-prob)])`` of a row's tokens."""
    k = request.logprobs
    return [
        (
            generated.tokens[row, j],
            json_float(generated.log_probs[row, j]),
            list(zip(generated.top_tokens[row, j, :k], generated.top_log_probs[row, j, :k])),
        )
        for j in range(length)
    ]  # fmt: skip


def stop_reason(engine: Any, request: CompletionRequest, ids, reason: int) -> Any:
    """vLLM's ``stop_reason``: the stop token id or the stop string that
    ended a choice; None where EOS, the length or its constraint ended it."""
    if reason != decoding.FINISHED_STOP or not len(ids):
        return None
    if int(ids[-1]) in request.stop_token_ids:
        return int(ids[-1])
    if not request.stop:
        return None
    text = _text(engine, request, ids)
    found = decoding.find_stop(
        text, request.stop, _stop_search_start(engine, request, ids)
    )
    return None if found is None else text[found[0] : found[1]]


def _choice(engine, request, p, s, generated, row, prompt_scores) -> tuple[dict, int]:
    """One choice (completions' shape, or chat's logprobs with
    ``request.chat``) and its count of generated tokens."""
    tokenizer = engine.tokenizer
    ids, entries, finish, reason = np.zeros([0], np.int32), [], "length", None
    if generated is not None:
        length = int(generated.lengths[row])
        ids = generated.tokens[row, :length]
        reason = int(generated.finish_reasons[row])
        finish = FINISH_REASONS[reason]
        if request.logprobs is not None:
            entries = _entries(request, generated, row, length)
    text = completion_text(engine, request, ids, done=True)
    offset = len(request.prompt_texts[p])
    if request.echo:
        text, offset = request.prompt_texts[p] + text, 0
    block = None
    if request.logprobs is not None and request.chat:
        name = lambda token: token_text(tokenizer, token)
        block = chat.chat_logprobs(
            [
                (name(t), lp, [(name(i), float(v)) for i, v in top])
                for t, lp, top in entries
            ]
        )
    elif request.logprobs is not None:
        maps = [
            (t, lp, _top_map(tokenizer, [i for i, _ in top], [v for _, v in top]))
            for t, lp, top in entries
        ]
        if request.echo:
            chosen, tops = prompt_scores[p]
            maps = list(zip(request.prompt_ids[p], chosen, tops)) + maps
        block = _logprobs_block(tokenizer, maps, offset)
    choice = {
        "text": text,
        "index": p * request.n + s,
        "finish_reason": finish,
        "stop_reason": None
        if reason is None
        else stop_reason(engine, request, ids, reason),
        "logprobs": block,
    }
    if request.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(
            engine, request.prompt_ids[p], request.prompt_logprobs
        )
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


def new_id() -> str:
    """A completion's ``id``.

    Examples:
        >>> new_id().startswith("cmpl-")
        True
    """
    return f"cmpl-{uuid.uuid4().hex}"


def usage(result: dict) -> dict:
    """OpenAI's ``usage`` of a :func:`request_result`.

    Examples:
        >>> usage({"prompt_tokens": 4, "completion_tokens": 6, "choices": []})
        {'prompt_tokens': 4, 'completion_tokens': 6, 'total_tokens': 10}
    """
    prompt, completion = result["prompt_tokens"], result["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_body(request: CompletionRequest, result: dict, id_: str) -> dict:
    """The ``text_completion`` object of a finished request."""
    body = stream_chunk(request, id_, result["choices"])
    return {**body, "usage": usage(result)}


def stream_chunk(
    request: CompletionRequest, id_: str, choices: list[dict], usage_: Any = None
) -> dict:
    """One server-sent ``text_completion`` chunk (``usage`` null except in
    the last chunk, when ``stream_options.include_usage`` asks for it)."""
    chunk = {
        "id": id_,
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": choices,
    }
    if request.include_usage:
        chunk["usage"] = usage_
    return chunk
