"""Using a trained run: loading it and continuing text with it.

Shared by ``experiments/generate.py``, ``experiments/score.py``,
``experiments/serve.py``, the training loop's samples and the notebook:
:func:`load_run` gives a run's ``(config, tokenizer, model, params)`` and
:func:`continue_text` continues a text prompt with it, window by window
(the decoders themselves, on token ids, are ``lmhead.decoding.generate`` and
``beam_search``). :func:`quantize_for_decoding` gives parameters whose head
reads a half-precision or int8 table, and :func:`time_generation` measures
time to first token and the cost of each new token. Scoring a given text is
``lmhead.lm.scoring``'s.
"""

import functools
import json
import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lmhead import _checks, decoding, quantize
from lmhead.lm import checkpoints, configuration, constraints, data, inference
from lmhead.lm import model as model_lib
from lmhead.lm import state as state_lib

SAMPLE_SEPARATOR = "\n---------------\n"


def load_run(workdir: str):
    """A trained run's ``(config, tokenizer, model, params)``, newest
    checkpoint; a run trained with ``model.attention_implementation="cudnn"``
    loads with ``"auto"``, so that it runs on any device."""
    with open(os.path.join(workdir, "config.json")) as f:
        config = ml_collections.ConfigDict(json.load(f))
    if config.model.get("attention_implementation") == "cudnn":
        # How the attention is computed belongs to the machine, not the run:
        # one trained with cuDNN's loads wherever it is read.
        config.model.attention_implementation = "auto"
    tokenizer = data.load_tokenizer(os.path.join(workdir, data.TOKENIZER_FILE))
    model = configuration.make_model(config, tokenizer.vocab_size)
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise FileNotFoundError(f"{workdir} has no checkpoints/.")
    manager = checkpoints.checkpoint_manager(workdir)
    if manager.latest_step() is None:
        raise FileNotFoundError(f"{workdir}/checkpoints holds no checkpoint.")
    state = state_lib.restore_or_init(manager, model, config, jax.random.key(0))
    manager.close()
    return config, tokenizer, model, state.params


class Continuation(NamedTuple):
    """One continuation from :func:`continuations`.

    Attributes:
        text: the prompt and its continuation, cut before the first stop
            string the continuation completes (OpenAI's rule: neither the
            stop string nor anything after it is returned), or before the
            end-of-text token that ended it.
        finish_reason: ``"stop"`` (the end-of-text token or a stop string
            ended it) or ``"length"`` (it reached ``max_new_tokens``).
        tokens: the generated ids, up to and including the one that
            completed the stop string (which may hold text past it) or the
            end-of-text token.
        top_logprobs: one list per id of ``tokens``: its step's
            ``top_logprobs`` likeliest tokens as ``(text, log-prob)`` pairs
            under the sampled (processed) distribution, likeliest first;
            empty lists when ``top_logprobs`` is 0 or with beam search.
    """

    text: str
    finish_reason: str
    tokens: list[int]
    top_logprobs: list[list[tuple[str, float]]]


class _WindowSettings(NamedTuple):
    """The static settings of one window of :func:`continuations` (the
    sampling knobs are traced: a new value does not recompile)."""

    max_new_tokens: int
    num_beams: int | None
    top_logprobs: int
    eos_id: int | None
    speculative: str | None = None
    num_speculative_tokens: int = 3


def continue_text(
    model: model_lib.DecoderLM,
    params: Any,
    tokenizer: data.Tokenizer,
    prompt: str,
    **settings: Any,
) -> list[str]:
    """``num_samples`` continuations of ``prompt``, each with the prompt:
    the texts of :func:`continuations` (same arguments).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> tokenizer = data.CharTokenizer("abc")
        >>> model = model_lib.DecoderLM(vocab_size=3, num_layers=1, num_heads=2,
        ...                             d_model=8, mlp_dim=16, max_len=8)
        >>> init = jax.jit(model.init)
        >>> params = init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        >>> texts = continue_text(model, params["params"], tokenizer, "ab",
        ...                       key=jax.random.key(1), num_samples=2,
        ...                       max_new_tokens=10)  # windows of 4 + 4 tokens
        >>> [len(text) for text in texts], {text[:2] for text in texts}
        ([12, 12], {'ab'})
    """
    return [c.text for c in continuations(model, params, tokenizer, prompt, **settings)]


def continuations(
    model: model_lib.DecoderLM,
    params: Any,
    tokenizer: data.Tokenizer,
    prompt: str,
    *,
    key: jax.Array,
    num_samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_beams: int | None = None,
    stop: str | Sequence[str] | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    top_logprobs: int = 0,
    ignore_eos: bool = False,
    constraint: constraints.Constraint | None = None,
    speculative: str | None = None,
    num_speculative_tokens: int = 3,
) -> list[Continuation]:
    """``num_samples`` :class:`Continuation` s of ``prompt``.

    The cache holds ``max_len`` positions, so the text is made window by
    window, as nanoGPT crops its context: each window is prefilled with the
    last ``C = max_len // 2`` tokens so far (at first the prompt, cropped to
    ``C`` and right-padded) and adds ``max_len - C`` tokens; the last window's
    surplus is cut off. Every window has the same shapes, so it compiles once.
    Beam search, too, runs per window and keeps the best beam.
    ``temperature=0`` is greedy; the sampling knobs are
    ``decoding.generate``'s, traced (``decoding.SamplingKnobs``), so new
    values of them compile nothing (turning one on or off does).

    Stop strings end a sample inside the compiled loop
    (``decoding.StopStrings`` on :func:`token_bytes`), each window's loop
    resumed from the bytes the sample generated before, so a string split
    across two windows ends it too; the text is cut with
    ``decoding.trim_at_stop`` (beam search only cuts the text). The
    end-of-text token (``tokenizer.eos_id``) ends a sample and a beam unless
    ``ignore_eos``; it is kept in :attr:`Continuation.tokens`, not in the
    text. No more windows run once every sample has stopped.

    Args:
        stop: a stop string or a list of them, matched in the generated text
            only (not the prompt).
        presence_penalty, frequency_penalty: OpenAI's penalties (see
            ``decoding.process_logits``) over the tokens generated in the
            window; None is off.
        top_logprobs: ``k >= 0`` alternatives per token in
            :attr:`Continuation.top_logprobs`.
        ignore_eos: go on past the end-of-text token, which then is text
            like any other (its literal ``<|endoftext|>``).
        constraint: a :class:`constraints.Constraint` every sample's
            continuation must follow (structured output), each sample with
            its own automaton (``constraints.masker_for(tokenizer)``), which
            goes on from window to window: the end-of-text token only where
            the grammar accepts, and a sample ends where its grammar can take
            nothing more; a stop string or ``max_new_tokens`` may still cut
            it short (``finish_reason`` says which). Not with ``num_beams``
            nor ``ignore_eos``.
        speculative: None, ``"mtp"`` (the run's MTP heads propose,
            ``inference.MTPProposer``) or ``"ngram"`` (prompt lookup in the
            window's text, ``decoding.NGramProposer``): speculative decoding,
            the same tokens greedily and the same distribution sampled
            (``decoding.generate``'s ``speculative``). Not with
            ``num_beams``; a constrained sample is not speculated.
        num_speculative_tokens: ``k >= 1`` proposals per model call (for
            ``"mtp"`` at most the run's ``mtp_heads``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> tokenizer = data.CharTokenizer("abc")
        >>> model = model_lib.DecoderLM(vocab_size=3, num_layers=1, num_heads=2,
        ...                             d_model=8, mlp_dim=16, max_len=8)
        >>> init = jax.jit(model.init)
        >>> params = init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        >>> out = continuations(model, params["params"], tokenizer, "ab",
        ...                     key=jax.random.key(1), num_samples=3,
        ...                     max_new_tokens=40, stop="cc", top_logprobs=2)
        >>> [("cc" in c.text[2:], c.finish_reason) for c in out]
        [(False, 'stop'), (False, 'stop'), (False, 'stop')]
        >>> len(out[0].top_logprobs) == len(out[0].tokens)
        True
    """
    if model.max_len < 2:
        raise ValueError("continue_text needs a model with max_len >= 2.")
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ValueError("prompt must encode to at least one token.")
    knobs = decoding.SamplingKnobs(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )
    knobs.check(num_samples, model.vocab_size)  # traced below: checked here
    if constraint is not None and (num_beams or ignore_eos):
        raise ValueError("constraint does not apply to num_beams nor ignore_eos.")
    proposer(model, speculative, num_speculative_tokens, num_beams)  # checked here
    masker = row_constraint = None
    if constraint is not None:  # compiled (or refused) before any decoding
        masker = constraints.masker_for(tokenizer)
        masker.compile(constraint)
    stop_strings = table = None
    if stop is not None:
        table = data.token_bytes(tokenizer)
        stop_strings = decoding.StopStrings.build(stop, table)
    context_len = model.max_len // 2
    settings = _WindowSettings(
        max_new_tokens=model.max_len - context_len,
        num_beams=num_beams,
        top_logprobs=top_logprobs,
        eos_id=None if ignore_eos else tokenizer.eos_id,
        speculative=speculative,
        num_speculative_tokens=num_speculative_tokens,
    )
    ids = [np.tile(np.asarray(prompt_ids[-context_len:], np.int32), (num_samples, 1))]
    lengths = np.full([num_samples], ids[0].shape[1], np.int32)
    rows = [_Row([], [], False) for _ in range(num_samples)]
    generated = 0
    if masker is not None:
        row_constraint = constraints.row_constraint(masker, [constraint] * num_samples)
    try:
        while generated < max_new_tokens and not all(row.stopped for row in rows):
            context = np.concatenate(ids, axis=1)[:, -context_len:]
            context = np.pad(context, [(0, 0), (0, context_len - context.shape[1])])
            key, window_key = jax.random.split(key)
            window_stop = None
            if stop_strings is not None:  # each row's loop goes on from its bytes
                generated_bytes = [
                    b"".join(table[t] for t in row.tokens) for row in rows
                ]
                window_stop = stop_strings.resumed(generated_bytes)
            window = jax.tree.map(
                np.asarray,
                _continue_window(
                    model,
                    params,
                    context,
                    lengths,
                    window_key,
                    window_stop,
                    knobs.as_arrays(),
                    settings,
                    row_constraint,
                ),
            )
            ids.append(window.tokens)
            take = min(window.tokens.shape[1], max_new_tokens - generated)
            for b, row in enumerate(rows):
                if not row.stopped:
                    rows[b] = _extend_row(row, window, b, take)
            generated += window.tokens.shape[1]
            lengths[:] = context_len
    finally:
        if row_constraint is not None:
            masker.release(np.asarray(row_constraint.ids).tolist())
    return [
        _continuation(prompt, row, tokenizer, stop, settings.eos_id) for row in rows
    ]


class _Row(NamedTuple):
    """A sample's generated ids so far, their alternatives, and whether the
    end-of-text token or a stop string has ended it."""

    tokens: list[int]
    top: list[list[tuple[int, float]]]
    stopped: bool


def _extend_row(row: _Row, window, b: int, take: int) -> _Row:
    """``row`` with window row ``b``'s first ``take`` tokens (fewer if the
    end-of-text token or a stop string ended it in the loop)."""
    count = min(int(window.lengths[b]), take)
    tokens = row.tokens + window.tokens[b, :count].tolist()
    top = row.top + [
        list(zip(window.top_tokens[b, t].tolist(), window.top_log_probs[b, t].tolist()))
        for t in range(count)
    ]
    ended = count == window.lengths[b] and window.finish_reasons[b] in (
        decoding.FINISHED_EOS,
        decoding.FINISHED_STOP,
    )
    return _Row(tokens, top, bool(ended))


def _continuation(prompt: str, row: _Row, tokenizer, stop, eos_id) -> Continuation:
    ended_by_eos = row.stopped and eos_id is not None and row.tokens[-1:] == [eos_id]
    text = tokenizer.decode(row.tokens[:-1] if ended_by_eos else row.tokens)
    if stop is not None:
        text = decoding.trim_at_stop(text, stop)
    top = [[(tokenizer.decode([i]), p) for i, p in step] for step in row.top]
    return Continuation(
        text=prompt + text,
        finish_reason="stop" if row.stopped else "length",
        tokens=row.tokens,
        top_logprobs=top,
    )


@functools.partial(jax.jit, static_argnums=(0, 7))
def _continue_window(
    model, params, context, lengths, key, stop, knobs, settings: _WindowSettings,
    constraint=None,
) -> decoding.Generation:  # fmt: skip
    """The :class:`decoding.Generation` of ``settings.max_new_tokens`` tokens
    after ``context[b, :lengths[b]]`` (beam search: its best beam, every row
    of its length up to the end-of-text token, no alternatives)."""
    speculative = proposer(
        model, settings.speculative, settings.num_speculative_tokens, None
    )
    logits, cache = inference.prefill(
        model, params, context, lengths, mtp=settings.speculative == "mtp"
    )
    step_fn = inference.make_step_fn(model)
    if settings.num_beams:
        beams = decoding.beam_search(
            step_fn,
            params,
            logits,
            cache,
            num_beams=settings.num_beams,
            max_new_tokens=settings.max_new_tokens,
            eos_id=settings.eos_id,
        )
        return decoding.beam_generation(beams, settings.eos_id)
    return decoding.generate(
        step_fn,
        params,
        logits,
        cache,
        key=key,
        max_new_tokens=settings.max_new_tokens,
        knobs=knobs,
        stop=stop,
        top_logprobs=settings.top_logprobs,
        eos_id=settings.eos_id,
        constraint=constraint,
        speculative=speculative,
        prompt_tokens=jnp.where(
            jnp.arange(context.shape[1]) < lengths[:, None], context, -1
        ),
    )


SPECULATIVE = ("mtp", "ngram")


def proposer(
    model: model_lib.DecoderLM,
    speculative: str | None,
    num_speculative_tokens: int,
    num_beams: int | None,
) -> decoding.Proposer | None:
    """The proposer of ``speculative`` (None, ``"mtp"`` or ``"ngram"``) with
    ``num_speculative_tokens`` proposals, for ``model``.

    Raises:
        ValueError: naming the flag: an unknown ``speculative``,
            ``num_speculative_tokens < 1``, more proposals than the run's MTP
            heads, ``"mtp"`` on a run without them, or speculation with beams.

    Examples:
        >>> model = model_lib.DecoderLM(vocab_size=5, max_len=8)
        >>> proposer(model, "ngram", 4, None)
        NGramProposer(num_tokens=4, max_ngram=3, min_ngram=1)
        >>> proposer(model, "mtp", 1, None)
        Traceback (most recent call last):
        ...
        ValueError: speculative='mtp' needs a run trained with MTP heads (model.mtp_heads >= 1); this one has none: use 'ngram'.
    """
    if speculative is None:
        return None
    if speculative not in SPECULATIVE:
        raise ValueError(
            f"speculative must be one of {', '.join(SPECULATIVE)} or None; got "
            f"{speculative!r}."
        )
    if num_beams:
        raise ValueError(
            "speculative does not apply to num_beams: beam search is not speculated."
        )
    _checks.check_count("num_speculative_tokens", num_speculative_tokens)
    if speculative == "ngram":
        return decoding.NGramProposer(num_speculative_tokens)
    return inference.MTPProposer(model, num_speculative_tokens)


def quantize_for_decoding(model: model_lib.DecoderLM, params: Any, dtype: str) -> Any:
    """``params`` with the head's table quantized once, for inference.

    Untied: ``head/unembedding`` is replaced by its quantized table (with
    ``head_rank``, the factor ``A: [V, r]``; the projection stays float). Tied:
    the embedding lookup keeps the float32 table and the head reads a
    quantized copy of it, stored as ``params[model.HEAD_TABLE]``. Either way
    the result is a params tree that every decoding function takes as an
    argument (one compile serves every quantized set of the same dtype);
    the loss refuses a ``QuantizedTable``.

    Args:
        model: the :class:`model.DecoderLM`.
        params: its float ``"params"``.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"int8"`` (see
            ``quantize.quantize_unembedding``).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = model_lib.DecoderLM(vocab_size=17, num_layers=1, num_heads=2,
        ...                             d_model=8, mlp_dim=16, max_len=8)
        >>> tokens = jnp.array([[1, 2, 3]])
        >>> params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
        >>> small = quantize_for_decoding(model, params, "int8")
        >>> type(small[model_lib.HEAD_TABLE]).__name__
        'QuantizedTable'
        >>> apply = jax.jit(model.apply)
        >>> full, fewer = (apply({"params": p}, tokens) for p in (params, small))
        >>> bool(jnp.abs(full - fewer).max() < 1e-3)
        True
    """
    if model.tied:
        table = quantize.quantize_unembedding(params["embed"]["embedding"], dtype)
        return {**params, model_lib.HEAD_TABLE: table}
    table = quantize.quantize_unembedding(params["head"]["unembedding"], dtype)
    return {**params, "head": {**params["head"], "unembedding": table}}


class GenerationTimings(NamedTuple):
    """Wall-clock timings of one prompt's decoding, compiled programs only.

    Attributes:
        compile_seconds: the first (compiling) prefill, step and decoding
            calls together.
        prefill_ms: the prompt's pass, which fills the cache and gives the
            first token's logits.
        first_step_ms: one decoding step after it.
        time_to_first_token_ms: ``prefill_ms + first_step_ms``.
        ms_per_token: a ``new_tokens``-token decoding loop's time divided by
            ``new_tokens`` (every row of the batch adds one token per step).
        new_tokens: tokens that loop added per row.
    """

    compile_seconds: float
    prefill_ms: float
    first_step_ms: float
    time_to_first_token_ms: float
    ms_per_token: float
    new_tokens: int


def _median_milliseconds(fn, repeats: int) -> float:
    """The median wall time of ``fn()`` in ms, its outputs waited for."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1e3 * (time.perf_counter() - start))
    return float(np.median(times))


def time_generation(
    model: model_lib.DecoderLM,
    params: Any,
    prompt: Any,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: jax.Array | None = None,
    repeats: int = 3,
    speculative: decoding.Proposer | None = None,
) -> GenerationTimings:
    """Times ``prompt``'s prefill, its first step and a decoding loop.

    Each program runs once to compile (``compile_seconds``), then
    ``repeats`` times; the medians are reported. Sampling knobs are
    ``decoding.generate``'s; with ``speculative`` (:func:`proposer`) the
    loop decodes speculatively, the prompt its history.

    Args:
        prompt: ``int [B, T]`` token ids, ``T + max_new_tokens <= max_len``.
        max_new_tokens: ``>= 1``, the loop's length.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = model_lib.DecoderLM(vocab_size=17, num_layers=1, num_heads=2,
        ...                             d_model=8, mlp_dim=16, max_len=8)
        >>> prompt = jnp.array([[1, 2, 3]])
        >>> params = jax.jit(model.init)(jax.random.key(0), prompt)["params"]
        >>> t = time_generation(model, params, prompt, max_new_tokens=4, repeats=1)
        >>> t.new_tokens, t.time_to_first_token_ms > 0, t.ms_per_token > 0
        (4, True, True)
    """
    if max_new_tokens < 1 or repeats < 1:
        raise ValueError(
            f"max_new_tokens and repeats must be >= 1; got "
            f"{max_new_tokens} and {repeats}."
        )
    key = jax.random.key(0) if key is None else key
    mtp = isinstance(speculative, inference.MTPProposer)
    logits, cache = inference.prefill(
        model, params, prompt, max_new_tokens=max_new_tokens, mtp=mtp
    )
    step_fn = inference.make_step_fn(model)
    first = jax.numpy.argmax(logits, axis=-1).astype(jax.numpy.int32)

    def run_prefill():
        return inference.prefill(model, params, prompt, mtp=mtp)

    def run_step():
        return step_fn(params, first, cache)

    def run_loop():
        return decoding.generate(
            step_fn,
            params,
            logits,
            cache,
            key=key,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            speculative=speculative,
            prompt_tokens=None if speculative is None else prompt,
        )

    start = time.perf_counter()
    for fn in (run_prefill, run_step, run_loop):
        jax.block_until_ready(fn())
    compile_seconds = time.perf_counter() - start
    prefill_ms = _median_milliseconds(run_prefill, repeats)
    first_step_ms = _median_milliseconds(run_step, repeats)
    return GenerationTimings(
        compile_seconds=compile_seconds,
        prefill_ms=prefill_ms,
        first_step_ms=first_step_ms,
        time_to_first_token_ms=prefill_ms + first_step_ms,
        ms_per_token=_median_milliseconds(run_loop, repeats) / max_new_tokens,
        new_tokens=max_new_tokens,
    )


def timing_prompt(
    model: model_lib.DecoderLM,
    tokenizer: Any,
    prompt: str,
    num_samples: int,
    max_new_tokens: int,
) -> tuple[np.ndarray, int]:
    """``(int32 [num_samples, C], n)``: ``prompt``'s ids cropped to the last
    ``C <= max_len // 2`` (the context of :func:`continue_text`'s windows), one
    row per sample, and the new tokens to time, ``min(max_new_tokens,
    max_len - C)``: one window of :func:`continue_text`."""
    ids = tokenizer.encode(prompt)[-(model.max_len // 2) :]
    if not ids:
        raise ValueError("prompt must encode to at least one token.")
    rows = np.tile(np.asarray(ids, np.int32), (num_samples, 1))
    return rows, min(max_new_tokens, model.max_len - len(ids))


def format_timings(t: GenerationTimings, batch_size: int) -> str:
    """One line of :class:`GenerationTimings` for people."""
    return (
        f"time to first token {t.time_to_first_token_ms:.2f} ms (prefill "
        f"{t.prefill_ms:.2f} ms + first step {t.first_step_ms:.2f} ms), "
        f"{t.ms_per_token:.3f} ms per new token over {t.new_tokens} tokens "
        f"at batch {batch_size}; compiling took {t.compile_seconds:.2f} s"
    )


def write_samples(config, model, params, tokenizer, key, workdir) -> None:
    """Writes ``config.sample``'s continuations to ``workdir/samples.txt`` and prints them."""
    texts = continue_text(
        model,
        params,
        tokenizer,
        config.sample.prompt,
        key=key,
        num_samples=config.sample.num_samples,
        max_new_tokens=config.sample.max_new_tokens,
        temperature=config.sample.temperature,
        top_k=config.sample.top_k,
        top_p=config.sample.top_p,
    )
    joined = SAMPLE_SEPARATOR.join(texts)
    with open(os.path.join(workdir, "samples.txt"), "w", encoding="utf-8") as f:
        f.write(joined + "\n")
    print(joined, flush=True)
