"""Scoring a given text under a trained model: the log-probability of each
token, and its totals (nats, bits per character, perplexity).

:func:`score_text` scores a text under a :class:`model.DecoderLM`;
:func:`strided_log_probs` does the work for any causal ``logits_fn``, with
sliding windows for a text longer than the context (the strided method of
the ``transformers`` perplexity guide: every token scored once). With
``prefix_eos`` the text follows the end-of-text token and its first token is
scored too. Used by ``experiments/score.py`` and the service's echoed
prompts (``lmhead.serve.completions``).
"""

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from lmhead import head
from lmhead.lm import model as model_lib

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


def strided_log_probs(
    logits_fn: LogitsFn,
    params: Any,
    tokens: np.ndarray,
    *,
    window: int,
    stride: int | None = None,
    batch_size: int = 8,
) -> np.ndarray:
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
        raise ValueError(
            f"tokens must be an int array [N]; got {tokens.dtype} {tokens.shape}."
        )
    if tokens.shape[0] < 2:
        raise ValueError(
            "tokens must hold at least 2 tokens (the first is only "
            f"context); got {tokens.shape[0]}."
        )
    stride = max(1, window // 2) if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}]; got {stride}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
    inputs, targets, weights = _windows(tokens, window, stride)
    padding = -len(inputs) % batch_size
    inputs, targets, weights = (
        np.pad(x, [(0, padding), (0, 0)]) for x in (inputs, targets, weights)
    )
    scores = [
        np.asarray(
            _window_log_probs(
                logits_fn,
                params,
                inputs[i : i + batch_size],
                targets[i : i + batch_size],
                weights[i : i + batch_size],
            )
        )
        for i in range(0, len(inputs), batch_size)
    ]
    scores = np.concatenate(scores)[weights > 0]
    if not np.all(np.isfinite(scores)):
        raise ValueError(
            f"{np.sum(~np.isfinite(scores))} token scores are not finite: are "
            "the token ids in the model's vocabulary and the parameters finite?"
        )
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
            first token, unless that is the end-of-text prefix), the
            end-of-text token counting none.
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
        return {
            "name": self.name,
            "tokens": tokens,
            "characters": chars,
            "nats": nats,
            "nats_per_token": nats / tokens,
            "bits_per_character": nats / math.log(2.0) / chars,
            "perplexity_per_token": math.exp(nats / tokens),
            "perplexity_per_character": math.exp(nats / chars),
        }


def score_text(
    model: model_lib.DecoderLM,
    params: Any,
    tokenizer: Any,
    text: str,
    *,
    name: str = "text",
    stride: int | None = None,
    batch_size: int = 8,
    prefix_eos: bool = False,
) -> TextScore:
    """Scores ``text`` under a :class:`model.DecoderLM` with
    :func:`strided_log_probs` (window ``model.max_len``).

    With ``prefix_eos``, the text's ids follow the tokenizer's end-of-text
    id, so that its first token is scored too (``token_texts`` and
    ``log_probs`` then cover the whole text).

    Raises:
        ValueError: for an empty text, one with characters outside a
            character vocabulary, one that encodes to fewer than 2 tokens
            (1 with ``prefix_eos``), or ``prefix_eos`` with a tokenizer
            without an end-of-text token.
    """
    if not text:
        raise ValueError(f"{name}: the text is empty; nothing to score.")
    try:
        ids = tokenizer.encode_array(text)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from error
    if prefix_eos:
        if getattr(tokenizer, "eos_id", None) is None:
            raise ValueError(
                f"{name}: prefix_eos needs a tokenizer with an end-of-text "
                "token; this run's has none (it was made without one)."
            )
        ids = np.concatenate([np.array([tokenizer.eos_id], ids.dtype), ids])
    if len(ids) < 2:
        raise ValueError(
            f"{name}: the text must encode to at least 2 tokens "
            f"(the first is only context); got {len(ids)}."
        )
    log_probs = strided_log_probs(
        ModelLogits(model),
        params,
        ids,
        window=model.max_len,
        stride=stride,
        batch_size=batch_size,
    )
    pieces = [tokenizer.decode([i]) for i in ids]
    first = 0 if prefix_eos else len(pieces[0])
    eos_token = getattr(tokenizer, "eos_token", None)
    ends = 0 if eos_token is None else np.sum(ids[1:] == tokenizer.eos_id)
    return TextScore(
        name=name,
        token_texts=pieces[1:],
        log_probs=log_probs,
        num_characters=max(1, len(text) - first - int(ends) * len(eos_token or "")),
    )


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
    return (
        f"{s['name']}: {s['nats']:.2f} nats over {s['tokens']} tokens "
        f"({s['characters']} characters): {s['nats_per_token']:.4f} "
        f"nats/token, {s['bits_per_character']:.4f} bits/char, perplexity "
        f"{s['perplexity_per_token']:.3f}/token "
        f"{s['perplexity_per_character']:.3f}/char"
    )


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
                f.write(f"{score.name}\t{token.translate(_ESCAPES)}\t{log_prob:.6f}\n")
