"""Using a trained run: loading it, generating text, scoring a text.

Shared by ``experiments/generate.py``, ``experiments/score.py``, the
training loop's samples and the notebook: :func:`load_run` gives a run's
``(config, tokenizer, model, params)``, :func:`generate_text` continues a
prompt with it, and :func:`score_text` scores a given text.
:func:`quantize_for_decoding` gives parameters whose head reads a
half-precision or int8 table, and :func:`time_generation` measures time to
first token and the cost of each new token.

A text longer than the model's context is scored with a sliding window
(the strided method of the ``transformers`` perplexity guide): windows of
``L`` tokens start every ``stride`` tokens, and each window scores only the
tokens that no earlier window scored, so every token is scored once, with
at least ``L - stride + 1`` tokens of context once the first window is
past. The first token of a text has no context and is not scored (the
tokenizers have no beginning-of-text token).
"""

import dataclasses
import functools
import json
import math
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import ml_collections
import numpy as np

from lmhead import checkpoints
from lmhead import data
from lmhead import decoding
from lmhead import head
from lmhead import model as model_lib
from lmhead import quantize
from lmhead import train

SAMPLE_SEPARATOR = "\n---------------\n"


def load_run(workdir: str):
    """A trained run's ``(config, tokenizer, model, params)``, newest checkpoint."""
    with open(os.path.join(workdir, "config.json")) as f:
        config = ml_collections.ConfigDict(json.load(f))
    tokenizer = data.load_tokenizer(os.path.join(workdir, data.TOKENIZER_FILE))
    model = train.make_model(config, tokenizer.vocab_size)
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise FileNotFoundError(f"{workdir} has no checkpoints/.")
    manager = checkpoints.checkpoint_manager(workdir)
    if manager.latest_step() is None:
        raise FileNotFoundError(f"{workdir}/checkpoints holds no checkpoint.")
    state = train.restore_or_init(manager, model, config, jax.random.key(0))
    manager.close()
    return config, tokenizer, model, state.params


def generate_text(model: model_lib.DecoderLM, params: Any, tokenizer: data.Tokenizer,
                  prompt: str, *, key: jax.Array, num_samples: int,
                  max_new_tokens: int, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None,
                  num_beams: int | None = None) -> list[str]:
    """``num_samples`` continuations of ``prompt``, each with the prompt.

    The cache holds ``max_len`` positions, so the text is made window by
    window, as nanoGPT crops its context: each window is prefilled with the
    last ``C = max_len // 2`` tokens so far (at first the prompt, cropped to
    ``C`` and right-padded) and adds ``max_len - C`` tokens; the last window's
    surplus is cut off. Every window has the same shapes, so it compiles once.
    Beam search, too, runs per window and keeps the best beam.
    ``temperature=0`` is greedy.
    """
    if model.max_len < 2:
        raise ValueError("generate_text needs a model with max_len >= 2.")
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise ValueError("prompt must encode to at least one token.")
    context_len = model.max_len // 2
    ids = [np.tile(np.asarray(prompt_ids[-context_len:], np.int32), (num_samples, 1))]
    lengths = np.full([num_samples], ids[0].shape[1], np.int32)
    generated = 0
    while generated < max_new_tokens:
        context = np.concatenate(ids, axis=1)[:, -context_len:]
        context = np.pad(context, [(0, 0), (0, context_len - context.shape[1])])
        key, window_key = jax.random.split(key)
        ids.append(np.asarray(_continue(
            model, params, context, lengths, window_key,
            max_new_tokens=model.max_len - context_len, temperature=temperature,
            top_k=top_k, top_p=top_p, num_beams=num_beams)))
        generated += ids[-1].shape[1]
        lengths[:] = context_len
    new_ids = np.concatenate(ids[1:], axis=1)[:, :max_new_tokens]
    return [prompt + tokenizer.decode(row) for row in new_ids]


@functools.partial(jax.jit, static_argnums=0, static_argnames=(
    "max_new_tokens", "temperature", "top_k", "top_p", "num_beams"))
def _continue(model, params, context, lengths, key, *, max_new_tokens,
               temperature, top_k, top_p, num_beams):
    """``[B, max_new_tokens]`` tokens after ``context[b, :lengths[b]]``."""
    logits, cache = model_lib.prefill(model, params, context, lengths)
    step_fn = model_lib.make_step_fn(model)
    if num_beams:
        tokens, _, _ = decoding.beam_search(
            step_fn, params, logits, cache, num_beams=num_beams,
            max_new_tokens=max_new_tokens, eos_id=None)
        return tokens[:, 0]
    tokens, _, _ = decoding.generate(
        step_fn, params, logits, cache, key=key, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p)
    return tokens


def quantize_for_decoding(model: model_lib.DecoderLM, params: Any,
                          dtype: str) -> Any:
    """``params`` with the head's table quantized once, for inference.

    Untied: ``head/unembedding`` is replaced by its quantized table. Tied:
    the embedding lookup keeps the float32 table and the head reads a
    quantized copy of it, stored as ``params[model.HEAD_TABLE]``. Either way
    the result is a params tree like any other: ``prefill``, the step
    function, ``generate``, ``beam_search``, ``generate_text`` and
    ``model.apply`` take it as an argument (one compile serves every
    quantized set of the same dtype), while the loss refuses a
    ``QuantizedTable``.

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
        >>> params = model.init(jax.random.key(0), tokens)["params"]
        >>> small = quantize_for_decoding(model, params, "int8")
        >>> type(small[model_lib.HEAD_TABLE]).__name__
        'QuantizedTable'
        >>> full, fewer = (model.apply({"params": p}, tokens) for p in (params, small))
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


def _milliseconds(fn, repeats: int) -> float:
    """The median wall time of ``fn()`` in ms, its outputs waited for."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1e3 * (time.perf_counter() - start))
    return float(np.median(times))


def time_generation(model: model_lib.DecoderLM, params: Any, prompt: Any, *,
                    max_new_tokens: int, temperature: float = 1.0,
                    top_k: int | None = None, top_p: float | None = None,
                    key: jax.Array | None = None,
                    repeats: int = 3) -> GenerationTimings:
    """Times ``prompt``'s prefill, its first step and a decoding loop.

    Each program runs once to compile (``compile_seconds``), then
    ``repeats`` times; the medians are reported. Sampling knobs are
    ``decoding.generate``'s.

    Args:
        prompt: ``int [B, T]`` token ids, ``T + max_new_tokens <= max_len``.
        max_new_tokens: ``>= 1``, the loop's length.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = model_lib.DecoderLM(vocab_size=17, num_layers=1, num_heads=2,
        ...                             d_model=8, mlp_dim=16, max_len=8)
        >>> prompt = jnp.array([[1, 2, 3]])
        >>> params = model.init(jax.random.key(0), prompt)["params"]
        >>> t = time_generation(model, params, prompt, max_new_tokens=4, repeats=1)
        >>> t.new_tokens, t.time_to_first_token_ms > 0, t.ms_per_token > 0
        (4, True, True)
    """
    if max_new_tokens < 1 or repeats < 1:
        raise ValueError(f"max_new_tokens and repeats must be >= 1; got "
                         f"{max_new_tokens} and {repeats}.")
    key = jax.random.key(0) if key is None else key
    logits, cache = model_lib.prefill(model, params, prompt,
                                      max_new_tokens=max_new_tokens)
    step_fn = model_lib.make_step_fn(model)
    first = jax.numpy.argmax(logits, axis=-1).astype(jax.numpy.int32)

    def run_prefill():
        return model_lib.prefill(model, params, prompt)

    def run_step():
        return step_fn(params, first, cache)

    def run_loop():
        return decoding.generate(step_fn, params, logits, cache, key=key,
                                 max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, top_p=top_p)

    start = time.perf_counter()
    for fn in (run_prefill, run_step, run_loop):
        jax.block_until_ready(fn())
    compile_seconds = time.perf_counter() - start
    prefill_ms = _milliseconds(run_prefill, repeats)
    first_step_ms = _milliseconds(run_step, repeats)
    return GenerationTimings(
        compile_seconds=compile_seconds, prefill_ms=prefill_ms,
        first_step_ms=first_step_ms,
        time_to_first_token_ms=prefill_ms + first_step_ms,
        ms_per_token=_milliseconds(run_loop, repeats) / max_new_tokens,
        new_tokens=max_new_tokens)


def timing_prompt(model: model_lib.DecoderLM, tokenizer: Any, prompt: str,
                  num_samples: int, max_new_tokens: int) -> tuple[np.ndarray, int]:
    """``(int32 [num_samples, C], n)``: ``prompt``'s ids cropped to the last
    ``C <= max_len // 2`` (the context of :func:`generate_text`'s windows), one
    row per sample, and the new tokens to time, ``min(max_new_tokens,
    max_len - C)``: one window of :func:`generate_text`."""
    ids = tokenizer.encode(prompt)[-(model.max_len // 2):]
    if not ids:
        raise ValueError("prompt must encode to at least one token.")
    rows = np.tile(np.asarray(ids, np.int32), (num_samples, 1))
    return rows, min(max_new_tokens, model.max_len - len(ids))


def format_timings(t: GenerationTimings, batch_size: int) -> str:
    """One line of :class:`GenerationTimings` for people."""
    return (f"time to first token {t.time_to_first_token_ms:.2f} ms (prefill "
            f"{t.prefill_ms:.2f} ms + first step {t.first_step_ms:.2f} ms), "
            f"{t.ms_per_token:.3f} ms per new token over {t.new_tokens} tokens "
            f"at batch {batch_size}; compiling took {t.compile_seconds:.2f} s")


def write_samples(config, model, params, tokenizer, key, workdir) -> None:
    """Writes ``config.sample``'s continuations to ``workdir/samples.txt`` and prints them."""
    texts = generate_text(
        model, params, tokenizer, config.sample.prompt, key=key,
        num_samples=config.sample.num_samples,
        max_new_tokens=config.sample.max_new_tokens,
        temperature=config.sample.temperature, top_k=config.sample.top_k,
        top_p=config.sample.top_p)
    joined = SAMPLE_SEPARATOR.join(texts)
    with open(os.path.join(workdir, "samples.txt"), "w", encoding="utf-8") as f:
        f.write(joined + "\n")
    print(joined, flush=True)


# --- Scoring a text ---------------------------------------------------------

# logits_fn(params, tokens int32[B, L]) -> float[B, L, V], causal: position t
# sees tokens[:, :t + 1] only.
LogitsFn = Callable[[Any, jax.Array], jax.Array]


class ModelLogits(NamedTuple):
    """The ``logits_fn`` of a :class:`model.DecoderLM` (hashable, so that
    equal models share one compiled scorer)."""
    model: model_lib.DecoderLM

    def __call__(self, params: Any, tokens: jax.Array) -> jax.Array:
        return self.model.apply({"params": params}, tokens)


@functools.partial(jax.jit, static_argnums=0)
def _window_log_probs(logits_fn, params, inputs, targets, weights):
    return head.token_log_probs(logits_fn(params, inputs), targets, weights)


def window_starts(num_tokens: int, window: int, stride: int) -> np.ndarray:
    """Start of each window: ``0, stride, 2 stride, ...`` until one reaches
    the last token (as a target: ``start + window >= num_tokens - 1``).

    Examples:
        >>> window_starts(10, 4, 2)
        array([0, 2, 4, 6])
        >>> window_starts(5, 4, 2)  # fits: one window
        array([0])
    """
    count = 1 + max(0, math.ceil((num_tokens - 1 - window) / stride))
    return np.arange(count) * stride


def strided_log_probs(logits_fn: LogitsFn, params: Any,
                      tokens: np.ndarray, *, window: int,
                      stride: int | None = None,
                      batch_size: int = 8) -> np.ndarray:
    r"""``float32 [N - 1]``: :math:`\log p(y_j \mid y_{c_j:j})` for ``j = 1..N-1``.

    Window ``k`` feeds ``tokens[s_k : s_k + L]`` (``s_k = k * stride``) and
    scores the targets ``tokens[s_k + 1 : s_k + L + 1]`` that the previous
    window did not: all ``L`` of them in window 0, the last ``stride`` in the
    others. So token ``j`` is predicted from ``c_j = s_k`` on, where ``k`` is
    the first window that reaches it. When the text fits one window
    (``N - 1 <= L``) every token sees the whole text before it: the result is
    exact. Windows go ``batch_size`` at a time through one program compiled
    per ``(logits_fn, batch_size, L)`` with ``params`` as an argument; the last
    batch is padded with zero-weight windows.

    Args:
        logits_fn: ``logits_fn(params, int32[B, L]) -> [B, L, V]``, causal
            (hashable: it is a static argument of the compiled program).
        params: its parameters.
        tokens: ``int [N]``, ``N >= 2``, ids in ``[0, V)``.
        window: ``L``, the model's context (``max_len``).
        stride: in ``[1, L]``; smaller gives more context and costs more
            windows. None: ``max(1, L // 2)``.
        batch_size: windows per call; the logits of a call take
            ``batch_size * L * V`` floats.

    Returns:
        The log-probabilities of ``tokens[1:]``, in order.

    Raises:
        ValueError: for fewer than 2 tokens, a stride outside ``[1, L]``, or
            a score that is not finite (an id outside the vocabulary).

    Examples:
        >>> import jax.numpy as jnp
        >>> table = jnp.log(jnp.array([[0.5, 0.5], [0.9, 0.1]]))
        >>> bigram = lambda params, tokens: params[tokens]  # a Markov chain
        >>> scores = strided_log_probs(bigram, table, np.array([0, 1, 0, 0, 1]),
        ...                            window=2, stride=1)
        >>> np.round(np.exp(scores), 4)  # p(1|0), p(0|1), p(0|0), p(1|0)
        array([0.5, 0.9, 0.5, 0.5], dtype=float32)
    """
    tokens = np.asarray(tokens)
    if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim != 1:
        raise ValueError(f"tokens must be an int array [N]; got {tokens.dtype} "
                         f"{tokens.shape}.")
    if tokens.shape[0] < 2:
        raise ValueError("tokens must hold at least 2 tokens (the first is only "
                         f"context); got {tokens.shape[0]}.")
    stride = max(1, window // 2) if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}]; got {stride}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
    inputs, targets, weights = _windows(tokens, window, stride)
    padding = -len(inputs) % batch_size
    inputs, targets, weights = (np.pad(x, [(0, padding), (0, 0)])
                                for x in (inputs, targets, weights))
    scores = [np.asarray(_window_log_probs(
        logits_fn, params, inputs[i:i + batch_size], targets[i:i + batch_size],
        weights[i:i + batch_size])) for i in range(0, len(inputs), batch_size)]
    scores = np.concatenate(scores)[weights > 0]
    if not np.all(np.isfinite(scores)):
        raise ValueError(
            f"{np.sum(~np.isfinite(scores))} token scores are not finite: are "
            "the token ids in the model's vocabulary and the parameters finite?")
    return scores


def _windows(tokens: np.ndarray, window: int, stride: int):
    """``(inputs, targets, weights)``, each ``[K, L]``: window ``k``'s inputs,
    their next tokens, and 1 where the target is scored in this window."""
    starts = window_starts(len(tokens), window, stride)
    padded = np.pad(tokens.astype(np.int32), (0, starts[-1] + window + 1 - len(tokens)))
    index = starts[:, None] + np.arange(window)  # input positions
    target = index + 1
    first_new = np.where(starts == 0, 1, starts + window - stride + 1)
    scored = (target >= first_new[:, None]) & (target < len(tokens))
    return padded[index], padded[target], scored.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class TextScore:
    """A text's score: the log-probability of each token after the first.

    Attributes:
        name: where the text came from (a file name, say).
        token_texts: ``[N - 1]`` the scored tokens, as text.
        log_probs: ``float [N - 1]`` their log-probabilities in nats.
        num_characters: characters of the scored tokens (the text less its
            first token).
    """
    name: str
    token_texts: list[str]
    log_probs: np.ndarray
    num_characters: int

    def summary(self) -> dict[str, Any]:
        r"""Totals: ``nats`` :math:`= -\sum_j \log p_j`, ``bits_per_character``
        ``= nats / (\ln 2 \cdot chars)``, ``perplexity_per_token`` ``=
        exp(nats / tokens)``, ``perplexity_per_character`` ``= exp(nats /
        chars)``, and the counts."""
        nats = -float(np.sum(self.log_probs, dtype=np.float64))
        tokens, chars = len(self.log_probs), self.num_characters
        return {"name": self.name, "tokens": tokens, "characters": chars,
                "nats": nats, "nats_per_token": nats / tokens,
                "bits_per_character": nats / math.log(2.0) / chars,
                "perplexity_per_token": math.exp(nats / tokens),
                "perplexity_per_character": math.exp(nats / chars)}


def score_text(model: model_lib.DecoderLM, params: Any, tokenizer: Any,
               text: str, *, name: str = "text", stride: int | None = None,
               batch_size: int = 8) -> TextScore:
    """Scores ``text`` under a :class:`model.DecoderLM` with
    :func:`strided_log_probs` (window ``model.max_len``).

    Raises:
        ValueError: for an empty text, one with characters outside a
            character vocabulary, or one that encodes to fewer than 2 tokens.
    """
    if not text:
        raise ValueError(f"{name}: the text is empty; nothing to score.")
    try:
        ids = tokenizer.encode_array(text)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from error
    if len(ids) < 2:
        raise ValueError(f"{name}: the text must encode to at least 2 tokens "
                         f"(the first is only context); got {len(ids)}.")
    log_probs = strided_log_probs(ModelLogits(model), params, ids,
                                  window=model.max_len, stride=stride,
                                  batch_size=batch_size)
    pieces = [tokenizer.decode([i]) for i in ids]
    return TextScore(name=name, token_texts=pieces[1:], log_probs=log_probs,
                     num_characters=max(1, len(text) - len(pieces[0])))


def read_texts(paths: list[str], texts: list[str]) -> list[tuple[str, str]]:
    """``(name, text)`` of each UTF-8 file (named by its path) and each text
    (named ``text1``, ``text2``, ...), in that order.

    Raises:
        FileNotFoundError: for a path that is not a file.
        ValueError: for a file that is not UTF-8.
    """
    sources = []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path!r}: no such file.")
        try:
            with open(path, encoding="utf-8") as f:
                sources.append((path, f.read()))
        except UnicodeDecodeError as error:
            raise ValueError(f"{path!r} is not UTF-8 text: {error}") from error
    return sources + [(f"text{i + 1}", text) for i, text in enumerate(texts)]


def format_score(score: TextScore) -> str:
    """One line of :meth:`TextScore.summary` for people."""
    s = score.summary()
    return (f"{s['name']}: {s['nats']:.2f} nats over {s['tokens']} tokens "
            f"({s['characters']} characters): {s['nats_per_token']:.4f} "
            f"nats/token, {s['bits_per_character']:.4f} bits/char, perplexity "
            f"{s['perplexity_per_token']:.3f}/token "
            f"{s['perplexity_per_character']:.3f}/char")


def format_json(scores: list[TextScore]) -> str:
    """The summaries as a JSON list."""
    return json.dumps([s.summary() for s in scores], indent=1)


_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def write_token_table(path: str, scores: list[TextScore]) -> None:
    """A TSV of ``name, token, log_prob`` per scored token; in the token's
    text, backslash, tab, newline and carriage return are written ``\\\\``,
    ``\\t``, ``\\n``, ``\\r``, so that each stays in its cell."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("name\ttoken\tlog_prob\n")
        for score in scores:
            for token, log_prob in zip(score.token_texts, score.log_probs):
                f.write(f"{score.name}\t{token.translate(_ESCAPES)}\t"
                        f"{log_prob:.6f}\n")
