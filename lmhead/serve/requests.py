"""The service's requests: :func:`parse_completion` checks a
``/v1/completions`` body field by field (OpenAI's schema and vLLM's
extensions and context rule, ``docs/serving.md``) and raises
:class:`RequestError` naming the first bad field (OpenAI's ``param``);
:class:`Buckets` are the shapes compiled at start-up, :class:`Limits` the
other caps of a request.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from lmhead import _checks, decoding
from lmhead.decoding import knobs as knobs_lib

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class RequestError(ValueError):
    """A request that cannot be served as sent: ``field`` names the culprit
    (OpenAI's ``param``), ``status`` is the HTTP status of the answer."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(message)
        self.field, self.message, self.status = field, message, status


class QueueFull(RuntimeError):
    """The batcher holds ``max_queue`` waiting requests already."""


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


def powers_of_two(limit: int, smallest: int = 1) -> tuple[int, ...]:
    """``smallest, 2 smallest, 4 smallest, ...`` (powers of 2) up to
    ``limit``, and ``limit`` itself.

    Examples:
        >>> powers_of_two(12), powers_of_two(12, smallest=8)
        ((1, 2, 4, 8, 12), (8, 12))
    """
    sizes = {2**i for i in range(limit.bit_length()) if smallest <= 2**i <= limit}
    return tuple(sorted(sizes | {limit}))


# The shortest prompt bucket: a shorter prompt costs a prefill about as
# much, and each bucket is two more programs to compile at start-up.
SHORTEST_PROMPT_BUCKET = 8


def prompt_buckets(max_len: int) -> tuple[int, ...]:
    """The default prompt lengths: powers of 2 from 8 up to the whole
    context ``max_len``, and ``max_len`` itself.

    Examples:
        >>> prompt_buckets(16), prompt_buckets(100), prompt_buckets(4)
        ((8, 16), (8, 16, 32, 64, 100), (4,))
    """
    return powers_of_two(max_len, min(SHORTEST_PROMPT_BUCKET, max_len))


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
        """Every size is a positive integer, and no prompt length and no
        new-token count exceeds the model's context ``max_len`` (a request's
        prompt plus its new tokens is checked against it when it comes)."""
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
        for name in ("prompt_lengths", "new_tokens"):
            if getattr(self, name)[-1] > max_len:
                raise ValueError(
                    f"{name} must be at most the model's max_len {max_len}; got "
                    f"{getattr(self, name)[-1]}."
                )


@dataclasses.dataclass(frozen=True)
class Limits:
    """Caps a request must respect besides the buckets and the context.

    Attributes:
        max_prompts: prompts per request.
        max_stops: stop strings per request, and ``stop_token_ids`` too.
        max_stop_chars: characters of one stop string.
        cap_max_tokens: a ``max_tokens`` past the context is cut to the
            room the prompt leaves instead of refused (for harnesses that
            send one fixed count, as lm-evaluation-harness's 256 new tokens,
            to a model of a shorter context); a prompt past the context is
            refused either way.
    """

    max_prompts: int = 16
    max_stops: int = 16
    max_stop_chars: int = 64
    cap_max_tokens: bool = False

    @property
    def max_stop_bytes(self) -> int:
        """The UTF-8 bytes of the longest stop string a request may send (at
        most 4 a character): the width of the decode slots' stop table.

        Examples:
            >>> Limits(max_stop_chars=8).max_stop_bytes
            32
        """
        return 4 * self.max_stop_chars


# A request's upper bound on a count: the largest int32.
MAX_INTEGER_KNOB = 2**31 - 1
# The service's policy on top of the knobs' own ranges (lmhead.decoding.knobs,
# which checks every value): OpenAI's ranges for its knobs, and a cap that
# keeps a repetition penalty finite through the loop's float32 arithmetic.
KNOB_POLICY = {
    "temperature": (0.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "logit_bias": (-100.0, 100.0),
    "repetition_penalty": (0.0, 1e6),
}


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


def _knob(body: dict, name: str, default: Any = None) -> Any:
    """The knob ``name`` of the body, ``default`` when absent: a JSON number
    (an integer for an integer knob) in the knob's range
    (:func:`lmhead.decoding.knobs.check_knob`, within :data:`KNOB_POLICY`)."""
    value = body.get(name)
    if value is None:
        return default
    integer = np.issubdtype(knobs_lib.knob_spec(name)["dtype"], np.integer)
    kinds, what = ((int,), "an integer") if integer else ((int, float), "a number")
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise RequestError(name, f"{name} must be {what}; got {value!r}.")
    if not integer:
        try:
            value = float(value)
        except OverflowError:  # an integer past float's range
            value = math.inf if value > 0 else -math.inf
    try:
        knobs_lib.check_knob(name, value, within=KNOB_POLICY.get(name))
    except ValueError as error:
        raise RequestError(name, str(error)) from None
    return value


def _encode(tokenizer: Any, text: Any, field: str) -> np.ndarray:
    if not isinstance(text, str) or not text:
        raise RequestError(field, f"{field} must hold non-empty strings.")
    try:
        ids = np.asarray(tokenizer.encode_array(text), np.int32)
    except (ValueError, TypeError) as error:  # e.g. a lone surrogate
        raise RequestError(field, f"{field}: {error}") from None
    if len(ids) == 0:
        raise RequestError(field, f"{field}: a prompt must encode to 1 token or more.")
    return ids


def context_error(context: int, prompt: int, new: int | None = None) -> RequestError:
    """vLLM's refusal of a request past the model's context, naming ``prompt``:
    a prompt of ``prompt`` tokens alone, or with ``new`` tokens to make.

    Examples:
        >>> context_error(16, 12, 8).message  # doctest: +NORMALIZE_WHITESPACE
        "This model's maximum context length is 16 tokens. However, you
        requested 20 tokens (12 in the messages, 8 in the completion). Please
        reduce the length of the messages or completion."
    """
    head = f"This model's maximum context length is {context} tokens. "
    if new is None:
        return RequestError(
            "prompt",
            head + f"However, your request has {prompt} input tokens. Please "
            "reduce the length of the input messages.",
        )
    return RequestError(
        "prompt",
        head + f"However, you requested {prompt + new} tokens ({prompt} in the "
        f"messages, {new} in the completion). Please reduce the length of the "
        "messages or completion.",
    )


MAX_LOGPROBS = 20  # vLLM's default max_logprobs
DEFAULT_MAX_TOKENS = 16  # OpenAI's
# OpenAI's fields, then vLLM's extensions and num_beams.
COMPLETION_FIELDS = tuple(
    """model prompt max_tokens temperature top_p n stream stream_options
    logprobs echo stop presence_penalty frequency_penalty logit_bias seed user
    best_of suffix top_k min_p repetition_penalty num_beams stop_token_ids
    ignore_eos include_stop_str_in_output min_tokens""".split()
)


@dataclasses.dataclass(eq=False)
class CompletionRequest:
    """A checked ``/v1/completions`` body.

    ``prompt_ids[i]`` encodes prompt ``i`` and ``prompt_texts[i]`` is its text
    (decoded when it came as token ids). ``prompt_max_tokens[i]`` is the most
    tokens prompt ``i`` may make (``max_tokens``, or the room it leaves in
    the context), ``max_tokens`` the largest of them. ``knobs.stop_tokens``
    marks the ``stop_token_ids`` and EOS (unless ``ignore_eos``), and
    ``knobs.min_new_tokens`` is ``min_tokens``. ``sink``, set by the web
    layer for a streaming request, is called from the batcher's thread with
    each chunk's list of ``(choice index, text so far, tokens so far)``.
    """

    prompt_ids: list[np.ndarray]
    prompt_texts: list[str]
    max_tokens: int
    prompt_max_tokens: list[int]
    knobs: decoding.SamplingKnobs
    n: int
    seed: int | None
    logprobs: int | None
    echo: bool
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    include_stop_str: bool
    min_tokens: int
    stream: bool
    include_usage: bool
    num_beams: int
    model: str
    sink: Callable[[list[tuple]], None] | None = None

    @property
    def rows(self) -> int:
        return len(self.prompt_ids) * (1 if self.num_beams > 1 else self.n)


def _get(body: dict, name: str, kinds: tuple, what: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise RequestError(name, f"{name} must be {what}; got {value!r}.")
    return value


def _prompts(body: dict, tokenizer: Any, limits) -> list:
    """``[(ids, text)]`` of OpenAI's four prompt forms."""
    prompt = body.get("prompt")

    def is_ids(value):
        return (
            isinstance(value, list)
            and value
            and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        )

    if isinstance(prompt, str) or is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not 1 <= len(prompt) <= limits.max_prompts:
        raise RequestError(
            "prompt",
            "prompt must be a string, a list of token ids, or a list of 1 to "
            f"{limits.max_prompts} of either.",
        )
    out = []
    for item in prompt:
        if isinstance(item, str):
            out.append((_encode(tokenizer, item, "prompt"), item))
            continue
        if not is_ids(item):
            raise RequestError(
                "prompt",
                "prompt items must be non-empty strings or non-empty lists of "
                "token ids.",
            )
        # Compared as Python ints: one past int64 must be refused, not overflow.
        if min(item) < 0 or max(item) >= tokenizer.vocab_size:
            raise RequestError(
                "prompt",
                f"prompt token ids must be in [0, {tokenizer.vocab_size}).",
            )
        ids = np.asarray(item, np.int32)
        out.append((ids, decoding.detokenize(ids, tokenizer)))
    return out


def _short_list(value: Any, name: str, most: int, valid, what: str) -> list:
    """``value`` (None: ``[]``), a list of at most ``most`` items each
    ``valid``; else the :class:`RequestError` that says it must be ``what``."""
    value = [] if value is None else value
    if not isinstance(value, list) or len(value) > most or not all(map(valid, value)):
        raise RequestError(name, f"{name} must be {what}.")
    return value


def _stops(body: dict, limits: Limits) -> list[str]:
    stop, most, chars = body.get("stop"), limits.max_stops, limits.max_stop_chars
    return _short_list(
        [stop] if isinstance(stop, str) else stop,
        "stop",
        most,
        lambda s: isinstance(s, str) and 1 <= len(s) <= chars,
        f"a string or a list of at most {most} strings of 1 to {chars} characters",
    )


def _stop_token_ids(body: dict, vocab_size: int, limits: Limits) -> list[int]:
    most = limits.max_stops
    return _short_list(
        body.get("stop_token_ids"),
        "stop_token_ids",
        most,
        lambda i: (
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
        ),
        f"a list of at most {most} token ids in [0, {vocab_size})",
    )


def _logit_bias(body: dict, vocab_size: int) -> np.ndarray | None:
    bias = body.get("logit_bias")
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise RequestError("logit_bias", "logit_bias must map token ids to numbers.")
    mapping = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(
                "logit_bias", f"logit_bias keys must be token ids; got {key!r}."
            ) from None
        if not 0 <= token < vocab_size:
            raise RequestError(
                "logit_bias", f"logit_bias ids must be in [0, {vocab_size}); got {key}."
            )
        mapping[token] = _knob({"logit_bias": value}, "logit_bias")
    return decoding.logit_bias_vector(mapping, vocab_size)


def _penalty(body: dict, name: str) -> float | None:
    value = _knob(body, name, 0.0)
    return None if value == 0 else value  # off keeps the warmed-up program


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options", "stream_options needs stream: true.")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(
            "stream_options", "stream_options may hold include_usage only."
        )
    return _get(options, "include_usage", (bool,), "true or false", False)


def _sampling_knobs(body: dict, vocab_size: int, stops: list[int], min_tokens: int):
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's spelling of "off"
        body = {**body, "top_k": 0}
    neutral = lambda name: _knob(body, name, knobs_lib.neutral_value(name))
    return decoding.SamplingKnobs(
        temperature=neutral("temperature"),
        top_p=neutral("top_p"),
        top_k=neutral("top_k"),
        min_p=neutral("min_p"),
        repetition_penalty=neutral("repetition_penalty"),
        presence_penalty=_penalty(body, "presence_penalty"),
        frequency_penalty=_penalty(body, "frequency_penalty"),
        logit_bias=_logit_bias(body, vocab_size),
        min_new_tokens=min_tokens,
        stop_tokens=decoding.stop_token_mask(stops, vocab_size) if stops else None,
    )


def parse_completion(
    body: Any,
    tokenizer: Any,
    buckets: Buckets,
    limits: Limits,
    model_name: str,
    *,
    context: int | None = None,
) -> CompletionRequest:
    """A checked ``/v1/completions`` body.

    A prompt of ``P`` tokens needs ``P + max_tokens <= context`` (vLLM's
    rule; with ``echo`` and ``max_tokens`` 0 or 1, ``P <= context``), and
    ``P`` at most the longest prompt bucket; ``max_tokens`` defaults to
    OpenAI's 16 cut to the room the prompts leave, and may be 0 only with
    ``echo``; ``logprobs`` is an integer in ``[0, 20]``; ``seed`` is an
    integer in ``[-2**63, 2**63)`` (taken modulo ``2**31``); ``n`` times the
    prompts fits the largest batch; ``top_k`` ``-1`` means off; the stops,
    ``stop_token_ids`` and ``min_tokens`` as :class:`CompletionRequest` says.
    EOS is ``getattr(tokenizer, "eos_id", None)``.

    Args:
        body: the JSON body.
        tokenizer, buckets, limits, model_name: the service's.
        context: the model's context ``max_len``; default the longest
            prompt bucket.

    Raises:
        RequestError: naming the first bad field (status 404 for an unknown
            ``model``).

    Examples:
        >>> from lmhead.lm import data
        >>> tokenizer = data.CharTokenizer("abc")
        >>> buckets = Buckets((1, 4), (8,), (8,), (2,))
        >>> request = parse_completion({"model": "m", "prompt": [[0, 1], "c"],
        ...     "n": 2, "stop": "a"}, tokenizer, buckets, Limits(), "m")
        >>> request.prompt_texts, request.prompt_max_tokens, request.rows
        (['ab', 'c'], [6, 7], 4)
        >>> parse_completion({"model": "m", "prompt": "a", "max_tokens": 0},
        ...     tokenizer, buckets, Limits(), "m")
        Traceback (most recent call last):
        ...
        lmhead.serve.requests.RequestError: max_tokens may be 0 only with echo.
    """
    body = _body_object(body, COMPLETION_FIELDS)
    model = body.get("model")
    if model is None:
        raise RequestError("model", f"model is required: {model_name!r}.")
    if model != model_name:
        raise RequestError(
            "model", f"model must be {model_name!r}; got {model!r}.", status=404
        )
    context = buckets.prompt_lengths[-1] if context is None else context
    prompts = _prompts(body, tokenizer, limits)
    echo = _get(body, "echo", (bool,), "true or false", False)
    stream = _get(body, "stream", (bool,), "true or false", False)
    _get(body, "user", (str,), "a string")
    each = _max_tokens(body, [len(ids) for ids, _ in prompts], echo, context,
                       buckets.prompt_lengths[-1], limits)  # fmt: skip
    max_tokens = max(each)
    num_beams = _integer(body, "num_beams", 1, 1, max(buckets.beam_sizes, default=1))
    seed = _integer(body, "seed", None, -(2**63), 2**63 - 1)
    min_tokens = _integer(body, "min_tokens", 0, 0, max_tokens)
    ignore_eos = _get(body, "ignore_eos", (bool,), "true or false", False)
    stop_token_ids = _stop_token_ids(body, tokenizer.vocab_size, limits)
    eos = getattr(tokenizer, "eos_id", None)
    ends = stop_token_ids + ([] if eos is None or ignore_eos else [eos])
    request = CompletionRequest(
        prompt_ids=[ids for ids, _ in prompts],
        prompt_texts=[text for _, text in prompts],
        max_tokens=max_tokens,
        prompt_max_tokens=each,
        knobs=_sampling_knobs(body, tokenizer.vocab_size, ends, min_tokens),
        n=_integer(body, "n", 1, 1, buckets.batch_sizes[-1]),
        seed=None if seed is None else seed % 2**31,
        logprobs=_integer(body, "logprobs", None, 0, MAX_LOGPROBS),
        echo=echo,
        stop=_stops(body, limits),
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        include_stop_str=_get(
            body, "include_stop_str_in_output", (bool,), "true or false", False
        ),
        min_tokens=min_tokens,
        stream=stream,
        include_usage=_stream_options(body, stream),
        num_beams=num_beams,
        model=model,
    )
    _check_combinations(body, request, buckets)
    return request


def _max_tokens(
    body: dict, lengths: list[int], echo: bool, context: int, longest: int, limits
) -> list[int]:
    """Each prompt's ``max_tokens``, checked against the context (the
    prompts' ``lengths``) and the longest prompt bucket: the one asked, or
    OpenAI's 16 when none is, cut to the room a prompt leaves when none is
    asked or ``limits.cap_max_tokens``."""
    for length in lengths:
        if length > context:
            raise context_error(context, length)
        if length > longest:
            raise RequestError(
                "prompt", f"a prompt may hold at most {longest} tokens; got {length}."
            )
    given = body.get("max_tokens") is not None
    asked = _integer(body, "max_tokens", DEFAULT_MAX_TOKENS, 0, MAX_INTEGER_KNOB)
    if asked == 0 and not echo:
        raise RequestError("max_tokens", "max_tokens may be 0 only with echo.")
    each = []
    for length in lengths:
        room = context - length
        if asked <= room or (echo and asked <= 1):
            each.append(asked)
        elif room > 0 and (limits.cap_max_tokens or not given):
            each.append(room)
        elif echo and not given:
            each.append(1)  # the whole context is a prompt to score
        else:
            raise context_error(context, length, asked if given else 1)
    return each


def _check_combinations(body: dict, request: CompletionRequest, buckets) -> None:
    if body.get("suffix") is not None:
        raise RequestError("suffix", "suffix is not supported.")
    best_of = _integer(body, "best_of", request.n, 1, MAX_INTEGER_KNOB)
    if best_of != request.n:
        raise RequestError("best_of", "best_of must equal n when given.")
    if request.rows > buckets.batch_sizes[-1]:
        raise RequestError(
            "n",
            f"the prompts times n must be at most {buckets.batch_sizes[-1]}.",
        )
    if request.num_beams == 1:
        return
    if request.num_beams not in buckets.beam_sizes:
        raise RequestError(
            "num_beams",
            f"num_beams must be 1 or one of {list(buckets.beam_sizes)}.",
        )
    knobs = [name for name in knobs_lib.TRACED_KNOBS if name in COMPLETION_FIELDS]
    for name in knobs + ["seed", "logprobs", "stop", "stream", "stop_token_ids",
                         "min_tokens", "include_stop_str_in_output"]:  # fmt: skip
        if body.get(name) not in (None, False):
            raise RequestError(name, f"{name} does not apply to num_beams > 1.")
    if len(set(request.prompt_max_tokens)) > 1:
        raise RequestError(
            "max_tokens",
            "with num_beams > 1, max_tokens must fit every prompt's context.",
        )
    if request.max_tokens not in buckets.new_tokens:
        raise RequestError(
            "max_tokens",
            f"with num_beams > 1, max_tokens must be one of {list(buckets.new_tokens)}.",
        )
    if request.n > request.num_beams:
        raise RequestError("n", "n must be at most num_beams.")
