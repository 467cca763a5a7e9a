"""The service's requests as the batcher runs them: :func:`completion_request`
and :func:`chat_request` turn a body that its pydantic model
(:mod:`lmhead.serve.protocol`) has checked into a :class:`CompletionRequest`,
checking what depends on the run: the prompt's tokens, the context (vLLM's
rule, ``docs/serving.md``), the buckets, the knobs' values against the
vocabulary and the constraint, compiled against it. Each refusal is a
:class:`RequestError` naming the field (OpenAI's ``param``);
:class:`Buckets` are the shapes compiled at start-up, :class:`Limits` the
other caps of a request.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pydantic

from lmhead import _checks, decoding
from lmhead.decoding import knobs as knobs_lib
from lmhead.lm import constraints
from lmhead.serve import protocol

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


def context_error(
    context: int, prompt: int, new: int | None = None, field: str = "prompt"
) -> RequestError:
    """vLLM's refusal of a request past the model's context, naming ``field``:
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
            field,
            head + f"However, your request has {prompt} input tokens. Please "
            "reduce the length of the input messages.",
        )
    return RequestError(
        field,
        head + f"However, you requested {prompt + new} tokens ({prompt} in the "
        f"messages, {new} in the completion). Please reduce the length of the "
        "messages or completion.",
    )


DEFAULT_MAX_TOKENS = 16  # OpenAI's
MAX_LOGPROBS = protocol.MAX_LOGPROBS


@dataclasses.dataclass(eq=False)
class CompletionRequest:
    """A checked completion or chat request (``chat``: answered in chat's
    shapes), as the batcher runs it.

    ``prompt_ids[i]`` encodes prompt ``i`` and ``prompt_texts[i]`` is its text
    (decoded when it came as token ids; a chat's rendered template).
    ``prompt_max_tokens[i]`` is the most tokens prompt ``i`` may make
    (``max_tokens``, or the room it leaves in the context), ``max_tokens``
    the largest of them. ``knobs.stop_tokens`` marks the ``stop_token_ids``
    and EOS (unless ``ignore_eos``), and ``knobs.min_new_tokens`` is
    ``min_tokens``. ``constraint`` is the structured output every choice
    follows (compiled already), ``prompt_logprobs`` vLLM's count of top
    log-probs per prompt token. ``sink``, set by the web layer for a
    streaming request, is called from the batcher's thread with each
    chunk's list of ``(choice index, text so far, tokens so far)``.
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
    constraint: constraints.Constraint | None = None
    prompt_logprobs: int | None = None
    chat: bool = False
    sink: Callable[[list[tuple]], None] | None = None

    @property
    def rows(self) -> int:
        return len(self.prompt_ids) * (1 if self.num_beams > 1 else self.n)


def _encode(tokenizer: Any, text: str, field: str) -> np.ndarray:
    if not text:
        raise RequestError(field, f"{field} must hold non-empty strings.")
    try:
        ids = np.asarray(tokenizer.encode_array(text), np.int32)
    except (ValueError, TypeError) as error:  # e.g. a lone surrogate
        raise RequestError(field, f"{field}: {error}") from None
    if len(ids) == 0:
        raise RequestError(field, f"{field}: a prompt must encode to 1 token or more.")
    return ids


def _prompts(prompt: Any, tokenizer: Any, limits: Limits) -> list:
    """``[(ids, text)]`` of OpenAI's four prompt forms."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not 1 <= len(prompt) <= limits.max_prompts:
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
        if not item:
            raise RequestError(
                "prompt", "prompt items must be non-empty strings or token ids."
            )
        # Compared as Python ints: one past int64 must be refused, not overflow.
        if min(item) < 0 or max(item) >= tokenizer.vocab_size:
            raise RequestError(
                "prompt", f"prompt token ids must be in [0, {tokenizer.vocab_size})."
            )
        ids = np.asarray(item, np.int32)
        out.append((ids, decoding.detokenize(ids, tokenizer)))
    return out


def _logit_bias(bias: dict | None, vocab_size: int) -> np.ndarray | None:
    if not bias:
        return None
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
        try:
            knobs_lib.check_knob(
                "logit_bias", value, within=protocol.KNOB_POLICY["logit_bias"]
            )
        except ValueError as error:
            raise RequestError("logit_bias", str(error)) from None
        mapping[token] = value
    return decoding.logit_bias_vector(mapping, vocab_size)


def _sampling_knobs(body: Any, vocab_size: int, stops: list[int], min_tokens: int):
    """The body's knobs: an absent one neutral, a zero penalty off (so that
    the warmed-up program serves it)."""
    neutral = lambda name: (
        knobs_lib.neutral_value(name)
        if getattr(body, name) is None
        else getattr(body, name)
    )
    penalty = lambda name: getattr(body, name) or None
    return decoding.SamplingKnobs(
        temperature=neutral("temperature"),
        top_p=neutral("top_p"),
        top_k=0 if body.top_k in (None, -1) else body.top_k,  # -1: vLLM's "off"
        min_p=neutral("min_p"),
        repetition_penalty=neutral("repetition_penalty"),
        presence_penalty=penalty("presence_penalty"),
        frequency_penalty=penalty("frequency_penalty"),
        logit_bias=_logit_bias(body.logit_bias, vocab_size),
        min_new_tokens=min_tokens,
        stop_tokens=decoding.stop_token_mask(stops, vocab_size) if stops else None,
    )


def _check_model(body: Any, model_name: str) -> None:
    if body.model != model_name:
        raise RequestError(
            "model", f"model must be {model_name!r}; got {body.model!r}.", status=404
        )


def _constraint(body: Any) -> tuple[constraints.Constraint | None, str | None]:
    """The structured output the body asks for and the field that asks:
    ``response_format``, ``structured_outputs`` or a ``guided_*`` field (at
    most one of them)."""
    given = []
    if body.response_format is not None and body.response_format.type != "text":
        form = body.response_format
        if form.type == "json_object":
            given.append(("response_format", constraints.Constraint.json_object()))
        else:
            schema = form.json_schema.schema_
            given.append(
                ("response_format", constraints.Constraint.json_schema(schema))
            )
    outputs = body.structured_outputs
    if outputs is not None:
        for name, make in (
            ("json_", constraints.Constraint.json_schema),
            ("regex", constraints.Constraint.regex),
            ("choice", constraints.Constraint.choice),
            ("grammar", constraints.Constraint.grammar),
        ):
            if getattr(outputs, name) is not None:
                given.append(("structured_outputs", make(getattr(outputs, name))))
        if outputs.json_object:
            given.append(("structured_outputs", constraints.Constraint.json_object()))
    for name, make in (
        ("guided_json", constraints.Constraint.json_schema),
        ("guided_regex", constraints.Constraint.regex),
        ("guided_choice", constraints.Constraint.choice),
        ("guided_grammar", constraints.Constraint.grammar),
    ):
        if getattr(body, name) is not None:
            given.append((name, make(getattr(body, name))))
    if len(given) > 1:
        raise RequestError(
            given[1][0],
            "give one structured output: response_format, structured_outputs or "
            f"a guided_* field; got {given[0][0]} and {given[1][0]}.",
        )
    return (given[0][1], given[0][0]) if given else (None, None)


def _compiled_constraint(
    body: Any, tokenizer: Any, masker: Any
) -> constraints.Constraint | None:
    """The body's constraint, compiled against the vocabulary (kept by its
    text; ``masker`` None: the tokenizer's), or the 400 that names the
    field asking for it."""
    constraint, field = _constraint(body)
    if constraint is None:
        return None
    if body.ignore_eos or getattr(body, "num_beams", 1) > 1:
        name = "ignore_eos" if body.ignore_eos else "num_beams"
        raise RequestError(name, f"{name} does not apply to structured output.")
    try:
        (masker or constraints.masker_for(tokenizer)).compile(constraint)
    except constraints.ConstraintError as error:
        raise RequestError(field, f"{field}: {error}") from None
    return constraint


def _common(body: Any, tokenizer: Any, max_tokens: int, limits: Limits) -> dict:
    """The :class:`CompletionRequest` fields completions and chat share."""
    stop_token_ids = body.stop_token_ids or []
    for token in stop_token_ids:
        if token >= tokenizer.vocab_size:
            raise RequestError(
                "stop_token_ids",
                f"stop_token_ids must be token ids in [0, {tokenizer.vocab_size}).",
            )
    if body.min_tokens > max_tokens:
        raise RequestError(
            "min_tokens", f"min_tokens must be in [0, {max_tokens}] (max_tokens)."
        )
    eos = getattr(tokenizer, "eos_id", None)
    ends = stop_token_ids + ([] if eos is None or body.ignore_eos else [eos])
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    options = body.stream_options
    return dict(
        knobs=_sampling_knobs(body, tokenizer.vocab_size, ends, body.min_tokens),
        n=body.n,
        seed=None if body.seed is None else body.seed % 2**31,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
        include_stop_str=body.include_stop_str_in_output,
        min_tokens=body.min_tokens,
        stream=body.stream,
        include_usage=options is not None and options.include_usage,
        model=body.model,
    )


def completion_request(
    body: Any,
    tokenizer: Any,
    buckets: Buckets,
    limits: Limits,
    model_name: str,
    *,
    context: int | None = None,
    masker: Any = None,
) -> CompletionRequest:
    """A ``/v1/completions`` body (its :mod:`~lmhead.serve.protocol` model,
    checked) as a :class:`CompletionRequest`.

    A prompt of ``P`` tokens needs ``P + max_tokens <= context`` (vLLM's
    rule; with ``echo`` and ``max_tokens`` 0 or 1, ``P <= context``), and
    ``P`` at most the longest prompt bucket; ``max_tokens`` defaults to
    OpenAI's 16 cut to the room the prompts leave, and may be 0 only with
    ``echo``; ``seed`` is taken modulo ``2**31``; ``n`` times the prompts
    fits the largest batch; a constraint compiles against the vocabulary
    (``masker``: the service's ``constraints.GrammarMasker``, required then).
    EOS is ``getattr(tokenizer, "eos_id", None)``.

    Raises:
        RequestError: naming the first bad field (status 404 for an unknown
            ``model``).

    Examples:
        >>> from lmhead.lm import data
        >>> tokenizer = data.CharTokenizer("abc")
        >>> buckets = Buckets((1, 4), (8,), (8,), (2,))
        >>> body = protocol.body_models(16, 16, 64).completion(
        ...     model="m", prompt=[[0, 1], "c"], n=2, stop="a")
        >>> request = completion_request(body, tokenizer, buckets, Limits(), "m")
        >>> request.prompt_texts, request.prompt_max_tokens, request.rows
        (['ab', 'c'], [6, 7], 4)
    """
    _check_model(body, model_name)
    context = buckets.prompt_lengths[-1] if context is None else context
    prompts = _prompts(body.prompt, tokenizer, limits)
    each = _max_tokens(body, [len(ids) for ids, _ in prompts], body.echo, context,
                       buckets.prompt_lengths[-1], limits)  # fmt: skip
    request = CompletionRequest(
        prompt_ids=[ids for ids, _ in prompts],
        prompt_texts=[text for _, text in prompts],
        max_tokens=max(each),
        prompt_max_tokens=each,
        logprobs=body.logprobs,
        echo=body.echo,
        num_beams=body.num_beams,
        constraint=_compiled_constraint(body, tokenizer, masker),
        prompt_logprobs=body.prompt_logprobs,
        **_common(body, tokenizer, max(each), limits),
    )
    _check_combinations(body, request, buckets)
    return request


def parse_completion(
    body: Any,
    tokenizer: Any,
    buckets: Buckets,
    limits: Limits,
    model_name: str,
    *,
    context: int | None = None,
    masker: Any = None,
) -> CompletionRequest:
    """A JSON ``/v1/completions`` body (a dict), checked by its pydantic
    model (:func:`protocol.body_models`, the route's) and then by
    :func:`completion_request`: what the route does, for a caller without
    HTTP (the tests, the benchmarks).

    Raises:
        RequestError: naming the first bad field, as the route answers it.

    Examples:
        >>> from lmhead.lm import data
        >>> parse_completion({"model": "m", "prompt": "a", "max_tokens": 0},
        ...     data.CharTokenizer("abc"), Buckets((1,), (8,), (8,)), Limits(), "m")
        Traceback (most recent call last):
        ...
        lmhead.serve.requests.RequestError: max_tokens may be 0 only with echo.
    """
    model = protocol.body_models(
        limits.max_prompts, limits.max_stops, limits.max_stop_chars
    ).completion
    try:
        checked = model.model_validate(body)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        raise RequestError(
            protocol.error_param(("body", *first["loc"])),
            protocol.error_message({**first, "loc": ("body", *first["loc"])}),
        ) from None
    return completion_request(
        checked, tokenizer, buckets, limits, model_name, context=context, masker=masker
    )


def chat_request(
    body: Any,
    prompt: str,
    tokenizer: Any,
    buckets: Buckets,
    limits: Limits,
    model_name: str,
    *,
    context: int,
    masker: Any = None,
) -> CompletionRequest:
    """A ``/v1/chat/completions`` body as a :class:`CompletionRequest` of one
    prompt, ``prompt`` (its messages rendered by the run's template,
    ``lmhead.serve.chat``); ``max_completion_tokens`` (or ``max_tokens``)
    must fit the context after it, and defaults to the room it leaves;
    ``top_logprobs`` needs ``logprobs``. Otherwise as
    :func:`completion_request`; a refusal about the prompt names
    ``messages``."""
    _check_model(body, model_name)
    ids = _encode(tokenizer, prompt, "messages")
    if len(ids) > buckets.prompt_lengths[-1] or len(ids) >= context:
        raise context_error(context, len(ids), field="messages")
    room = context - len(ids)
    asked = body.max_completion_tokens or body.max_tokens
    if asked is not None and asked > room and not limits.cap_max_tokens:
        raise context_error(context, len(ids), asked, field="messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs", "top_logprobs needs logprobs: true.")
    if body.n > buckets.batch_sizes[-1]:
        raise RequestError("n", f"n must be at most {buckets.batch_sizes[-1]}.")
    max_tokens = room if asked is None else min(asked, room)
    return CompletionRequest(
        prompt_ids=[ids],
        prompt_texts=[prompt],
        max_tokens=max_tokens,
        prompt_max_tokens=[max_tokens],
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        echo=False,
        num_beams=1,
        constraint=_compiled_constraint(body, tokenizer, masker),
        chat=True,
        **_common(body, tokenizer, max_tokens, limits),
    )


def _max_tokens(
    body: Any, lengths: list[int], echo: bool, context: int, longest: int, limits
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
    given = body.max_tokens is not None
    asked = body.max_tokens if given else DEFAULT_MAX_TOKENS
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


# The fields a beam search refuses: the sampling knobs and what it has not.
BEAM_REFUSES = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "seed", "logprobs",
    "stop", "stream", "stop_token_ids", "min_tokens",
    "include_stop_str_in_output", "prompt_logprobs",
)  # fmt: skip


def _check_combinations(body: Any, request: CompletionRequest, buckets) -> None:
    if body.suffix is not None:
        raise RequestError("suffix", "suffix is not supported.")
    if body.best_of is not None and body.best_of != request.n:
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
    for name in BEAM_REFUSES:
        if getattr(body, name) not in (None, False, 0, {}):
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
