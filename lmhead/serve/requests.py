"""Serving a trained run: request checks and shape buckets.

The web layer (``lmhead/serve/web.py``) turns HTTP into the requests below,
and ``lmhead/serve/batching.py`` runs them; none of it needs a web framework:

* :func:`parse_generate` / :func:`parse_score` check a JSON body field by
  field and raise :class:`RequestError` naming the first bad field.
* :class:`Buckets` bounds the shapes: a batch of ``R`` rows runs as the
  smallest batch size ``>= R``, a prompt of ``P`` tokens as the smallest
  prompt length ``>= P``, and ``N`` new tokens as the smallest count
  ``>= N``. :meth:`lmhead.serve.batching.Engine.warm_up` compiles the
  window batcher's programs at start-up and the slot batcher's warm-up its
  own; a request of a kind neither warmed up (``/v1/generate``, beam search,
  echo only, under continuous batching) compiles its shape once, at first
  use.
* :class:`lmhead.serve.batching.Engine` runs a batch of requests;
  :class:`lmhead.serve.batching.Batcher` queues them (at most ``max_queue``) for one worker thread: jobs that
  arrive within ``window_s`` of the oldest waiting one, and can share a
  program, run as one batch of at most ``max(batch_sizes)`` rows with
  per-row sampling knobs.

Which jobs share a batch: sampled and greedy rows do (the per-row knobs of
:class:`~lmhead.decoding.knobs.SamplingKnobs`, temperature, top-k, top-p,
min-p and the repetition penalty, differ between rows; the static ones
are one value per batch, so their values split batches; a sampled row is
truncated to its own ``max_new_tokens``, which does not change its tokens);
beam search runs per ``(num_beams, max_new_tokens)``, because a shorter beam
search is not a prefix of a longer one; a request with a ``seed`` that
samples runs in a batch of its own, keyed by that seed, so that it is
reproducible (``generate`` draws every row from one key, so a row's draw
depends on its batch); a score runs alone.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from lmhead import _checks
from lmhead.decoding import knobs as knobs_lib
from lmhead.decoding.knobs import SamplingKnobs

MAX_SEED = 2**31 - 1
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class RequestError(ValueError):
    """A request that cannot be served as sent: ``field`` names the culprit."""

    def __init__(self, field: str, message: str, status: int = 422):
        super().__init__(message)
        self.field, self.message, self.status = field, message, status


class QueueFull(RuntimeError):
    """The batcher holds ``max_queue`` jobs already."""


def check_exposure(host: str, token: str | None) -> None:
    """Refuses to listen beyond this machine without a bearer token.

    Examples:
        >>> check_exposure("127.0.0.1", None)
        >>> check_exposure("0.0.0.0", None)
        Traceback (most recent call last):
        ...
        ValueError: host '0.0.0.0' is not a loopback address: give a bearer token (--token_file).
    """
    if host not in LOOPBACK_HOSTS and not token:
        raise ValueError(
            f"host {host!r} is not a loopback address: give a bearer "
            "token (--token_file)."
        )


def bucket(value: int, sizes: tuple[int, ...]) -> int:
    """The smallest of ``sizes`` (ascending) that is ``>= value``.

    Examples:
        >>> bucket(3, (1, 2, 4, 8)), bucket(4, (1, 2, 4, 8))
        (4, 4)
    """
    for size in sizes:
        if size >= value:
            return size
    raise ValueError(f"{value} exceeds the largest bucket {sizes[-1]}.")


def powers_of_two(limit: int) -> tuple[int, ...]:
    """``1, 2, 4, ...`` up to ``limit``, and ``limit`` itself.

    Examples:
        >>> powers_of_two(12)
        (1, 2, 4, 8, 12)
    """
    return tuple(
        sorted({2**i for i in range(limit.bit_length()) if 2**i <= limit} | {limit})
    )


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The shapes compiled at start-up, hence the limits of a request.

    Attributes:
        batch_sizes: rows per batch (ascending); the largest caps a batch
            and the rows of one request (prompts times sequences).
        prompt_lengths: prompt tokens; the largest caps a prompt.
        new_tokens: new-token counts; the largest caps ``max_new_tokens``,
            and beam search runs exactly these counts.
        beam_sizes: the allowed ``num_beams`` above 1 (may be empty).
    """

    batch_sizes: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    new_tokens: tuple[int, ...]
    beam_sizes: tuple[int, ...] = ()

    def check(self, max_len: int) -> None:
        """Every size is a positive integer and a prompt plus its new tokens
        fits the model's context ``max_len``."""
        for name in ("batch_sizes", "prompt_lengths", "new_tokens", "beam_sizes"):
            sizes = getattr(self, name)
            for size in sizes:
                _checks.check_count(f"every entry of {name}", size)
            if list(sizes) != sorted(set(sizes)):
                raise ValueError(
                    f"{name} must be distinct integers in ascending order; got {sizes}."
                )
            if not sizes and name != "beam_sizes":
                raise ValueError(f"{name} must not be empty.")
        if 1 in self.beam_sizes:
            raise ValueError("beam_sizes lists sizes above 1 (1 is sampling).")
        if self.prompt_lengths[-1] + self.new_tokens[-1] > max_len:
            raise ValueError(
                f"the longest prompt {self.prompt_lengths[-1]} + the most new "
                f"tokens {self.new_tokens[-1]} exceed the model's max_len {max_len}."
            )


@dataclasses.dataclass(frozen=True)
class Limits:
    """Caps a request must respect besides the buckets."""

    max_prompts: int = 16
    max_score_chars: int = 4096


@dataclasses.dataclass
class GenerateRequest:
    """A checked ``/v1/generate`` body. ``prompt_ids[i]`` encodes prompt ``i``."""

    prompt_ids: list[np.ndarray]
    max_new_tokens: int
    knobs: SamplingKnobs
    num_beams: int
    num_return_sequences: int
    seed: int | None
    logprobs: bool

    @property
    def rows(self) -> int:
        """Rows of a batch this request takes."""
        if self.num_beams > 1:
            return len(self.prompt_ids)
        return len(self.prompt_ids) * self.num_return_sequences


@dataclasses.dataclass
class ScoreRequest:
    """A checked ``/v1/score`` body."""

    text: str
    stride: int | None


# The knobs of SamplingKnobs a request may set (scalars, one per request).
SERVED_KNOBS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
GENERATE_FIELDS = (
    "prompt",
    "max_new_tokens",
    *SERVED_KNOBS,
    "num_beams",
    "num_return_sequences",
    "seed",
    "logprobs",
)
SAMPLING_FIELDS = (*SERVED_KNOBS, "seed")
# A request's upper bound on a knob that has none: the largest int32, and a
# float cap that keeps a value finite through the loop's float32 arithmetic.
MAX_INTEGER_KNOB = 2**31 - 1
MAX_FLOAT_KNOB = 1e6


def _body_object(body: Any, fields: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise RequestError("body", "the body must be a JSON object.")
    for name in body:
        if name not in fields:
            raise RequestError(
                name, f"unknown field {name!r}; the fields are {', '.join(fields)}."
            )
    return body


def _integer(
    body: dict, name: str, default: int | None, low: int, high: int
) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"{name} must be an integer; got {value!r}.")
    if not low <= value <= high:
        raise RequestError(name, f"{name} must be in [{low}, {high}]; got {value}.")
    return value


def _number(
    body: dict,
    name: str,
    default: float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(name, f"{name} must be a number; got {value!r}.")
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range
        number = math.inf if value > 0 else -math.inf
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low or number > high:
        bracket = "(" if low_open else "["
        raise RequestError(
            name, f"{name} must be in {bracket}{low}, {high}]; got {number:g}."
        )
    return number


def _knob(body: dict, name: str) -> float | int:
    """The value of a served knob, its neutral value when absent, checked
    against the knob's range (capped where it has no upper bound)."""
    default, bounds = knobs_lib.neutral_value(name), knobs_lib.knob_range(name)
    if knobs_lib.is_integer_knob(name):
        high = MAX_INTEGER_KNOB if bounds["high"] is None else bounds["high"]
        return _integer(body, name, default, bounds["low"], high)
    high = MAX_FLOAT_KNOB if bounds["high"] is None else bounds["high"]
    return _number(
        body, name, default, bounds["low"], high, low_open=bounds["low_open"]
    )


def _encode(tokenizer: Any, text: Any, field: str, max_tokens: int) -> np.ndarray:
    if not isinstance(text, str) or not text:
        raise RequestError(field, f"{field} must hold non-empty strings.")
    try:
        ids = np.asarray(tokenizer.encode_array(text), np.int32)
    except (ValueError, TypeError) as error:  # e.g. a lone surrogate
        raise RequestError(field, f"{field}: {error}") from None
    if not 1 <= len(ids) <= max_tokens:
        raise RequestError(
            field,
            f"{field}: a prompt must encode to 1 to "
            f"{max_tokens} tokens; got {len(ids)}.",
        )
    return ids


def parse_generate(
    body: Any, tokenizer: Any, buckets: Buckets, limits: Limits
) -> GenerateRequest:
    """A checked ``/v1/generate`` body (``prompt``: one string or a list).

    The knobs of ``SERVED_KNOBS`` take the ranges of
    :class:`~lmhead.decoding.knobs.SamplingKnobs` (capped at
    ``MAX_INTEGER_KNOB`` and ``MAX_FLOAT_KNOB`` where they have no upper
    bound); an absent knob is neutral: ``temperature`` 1, ``top_k`` 0,
    ``top_p`` 1, ``min_p`` 0, ``repetition_penalty`` 1. ``max_new_tokens``
    defaults to its cap. Beam search (``num_beams > 1``) takes none of the sampling knobs
    nor ``seed``, and its ``max_new_tokens`` must be a bucket.

    Raises:
        RequestError: naming the first field that is missing, of the wrong
            type, out of range, or not allowed with the others.

    Examples:
        >>> from lmhead.lm import data
        >>> tokenizer = data.CharTokenizer("abc")
        >>> buckets = Buckets((1, 4), (8,), (8,), (2,))
        >>> request = parse_generate({"prompt": ["ab", "c"], "top_k": 2},
        ...                          tokenizer, buckets, Limits())
        >>> request.prompt_ids, request.max_new_tokens, request.rows
        ([array([0, 1], dtype=int32), array([2], dtype=int32)], 8, 2)
        >>> parse_generate({"prompt": "ab", "num_beams": 2, "top_k": 2},
        ...                tokenizer, buckets, Limits())
        Traceback (most recent call last):
        ...
        lmhead.serve.requests.RequestError: top_k does not apply to beam search (num_beams > 1).
    """
    body = _body_object(body, GENERATE_FIELDS)
    prompts = body.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= limits.max_prompts:
        raise RequestError(
            "prompt",
            f"prompt must be a string or a list of 1 to {limits.max_prompts} strings.",
        )
    ids = [_encode(tokenizer, p, "prompt", buckets.prompt_lengths[-1]) for p in prompts]
    max_new = buckets.new_tokens[-1]
    num_beams = _integer(body, "num_beams", 1, 1, max(buckets.beam_sizes, default=1))
    if num_beams > 1 and num_beams not in buckets.beam_sizes:
        raise RequestError(
            "num_beams",
            "num_beams must be 1 or one of "
            f"{list(buckets.beam_sizes)}; got {num_beams}.",
        )
    max_new_tokens = _integer(body, "max_new_tokens", max_new, 1, max_new)
    request = GenerateRequest(
        prompt_ids=ids,
        max_new_tokens=max_new_tokens,
        knobs=SamplingKnobs(**{name: _knob(body, name) for name in SERVED_KNOBS}),
        num_beams=num_beams,
        num_return_sequences=1,
        seed=_integer(body, "seed", None, 0, MAX_SEED),
        logprobs=False if body.get("logprobs") is None else body["logprobs"],
    )
    if not isinstance(request.logprobs, bool):
        raise RequestError("logprobs", "logprobs must be true or false.")
    if num_beams > 1:
        _check_beam_request(body, request, buckets)
    most = num_beams if num_beams > 1 else buckets.batch_sizes[-1] // len(ids)
    request.num_return_sequences = _integer(
        body, "num_return_sequences", 1, 1, max(most, 1)
    )
    if request.rows > buckets.batch_sizes[-1]:
        raise RequestError(
            "prompt",
            f"a request may hold at most "
            f"{buckets.batch_sizes[-1]} prompts (times "
            "num_return_sequences when sampling).",
        )
    if request.knobs.temperature == 0:
        request.seed = None  # greedy: nothing is drawn
    return request


def _check_beam_request(body: dict, request: GenerateRequest, buckets: Buckets) -> None:
    for name in SAMPLING_FIELDS:
        if body.get(name) is not None:
            raise RequestError(
                name, f"{name} does not apply to beam search (num_beams > 1)."
            )
    if request.logprobs:
        raise RequestError(
            "logprobs",
            "logprobs is not available with beam "
            "search (num_beams > 1); each sequence has a score.",
        )
    if request.max_new_tokens not in buckets.new_tokens:
        raise RequestError(
            "max_new_tokens",
            "with beam search, max_new_tokens "
            f"must be one of {list(buckets.new_tokens)}; got "
            f"{request.max_new_tokens}.",
        )


def parse_score(body: Any, max_len: int, limits: Limits) -> ScoreRequest:
    """A checked ``/v1/score`` body: ``text``, optional ``stride`` in ``[1, max_len]``."""
    body = _body_object(body, ("text", "stride"))
    text = body.get("text")
    if not isinstance(text, str) or not 2 <= len(text) <= limits.max_score_chars:
        raise RequestError(
            "text",
            f"text must be a string of 2 to {limits.max_score_chars} characters.",
        )
    return ScoreRequest(text=text, stride=_integer(body, "stride", None, 1, max_len))
