"""The OpenAI completions API: request checks and response shapes.

``POST /v1/completions`` follows OpenAI's schema (see ``docs/serving.md``):

* :func:`parse_completion` checks a body field by field and raises
  :class:`~lmhead.serve.requests.RequestError` naming the first bad field
  (OpenAI's ``param``).
* :mod:`lmhead.serve.completions` runs the requests of one group
  (:meth:`CompletionRequest.group`) as one batch.
* :func:`completion_body` and :func:`stream_chunk` shape the answers.

A beam request (the ``num_beams`` extension) runs on the engine's beam path
(:meth:`CompletionRequest.as_generate`) and has neither log-probs, stop
strings nor a stream.
"""

import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from lmhead import decoding
from lmhead.serve import requests
from lmhead.serve.requests import MAX_FLOAT_KNOB, MAX_INTEGER_KNOB, RequestError

MAX_STOPS = 4  # OpenAI's
MAX_STOP_CHARS = 32
MAX_LOGPROBS = 5  # OpenAI's
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence and frequency penalties
BIAS_RANGE = (-100.0, 100.0)  # OpenAI's logit_bias values
DEFAULT_MAX_TOKENS = 16  # OpenAI's
STREAM_CHUNK_STEPS = 4
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "num_beams")
COMPLETION_FIELDS = (
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "user",
    "best_of",
    "suffix",
    *EXTENSIONS,
)
FINISH_REASONS = {
    decoding.FINISHED_LENGTH: "length",
    decoding.FINISHED_EOS: "stop",
    decoding.FINISHED_STOP: "stop",
    decoding.FINISHED_BAD_LOGITS: "stop",  # the row cannot go on
}


@dataclasses.dataclass(eq=False)
class CompletionRequest:
    """A checked ``/v1/completions`` body.

    ``prompt_ids[i]`` encodes prompt ``i`` and ``prompt_texts[i]`` is its text
    (decoded when it came as token ids). ``sink``, set by the web layer for a
    streaming request, is called from the engine's thread with each chunk's
    list of ``(choice index, text so far, tokens so far)``.
    """

    prompt_ids: list[np.ndarray]
    prompt_texts: list[str]
    max_tokens: int
    knobs: decoding.SamplingKnobs
    n: int
    seed: int | None
    logprobs: int | None
    echo: bool
    stop: list[str]
    stream: bool
    include_usage: bool
    num_beams: int
    model: str
    sink: Callable[[list[tuple]], None] | None = None

    @property
    def rows(self) -> int:
        return len(self.prompt_ids) * (1 if self.num_beams > 1 else self.n)

    def group(self) -> tuple:
        """Requests of equal groups run as one batch: the same per-batch
        knobs, and all generating or all only scoring (``max_tokens`` 0)."""
        return ("complete", self.knobs.shared(), self.max_tokens == 0)

    def as_generate(self) -> requests.GenerateRequest:
        """The beam request for the engine's beam path."""
        return requests.GenerateRequest(
            prompt_ids=self.prompt_ids,
            max_new_tokens=self.max_tokens,
            knobs=decoding.SamplingKnobs(),
            num_beams=self.num_beams,
            num_return_sequences=self.n,
            seed=None,
            logprobs=False,
        )


def _get(body: dict, name: str, kinds: tuple, what: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise RequestError(name, f"{name} must be {what}; got {value!r}.")
    return value


def _prompts(body: dict, tokenizer: Any, max_tokens: int, limits) -> list:
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
            out.append((requests._encode(tokenizer, item, "prompt", max_tokens), item))
            continue
        if not is_ids(item):
            raise RequestError(
                "prompt", "prompt items must be strings or lists of token ids."
            )
        # Compared as Python ints: one past int64 must be refused, not overflow.
        if min(item) < 0 or max(item) >= tokenizer.vocab_size:
            raise RequestError(
                "prompt",
                f"prompt token ids must be in [0, {tokenizer.vocab_size}).",
            )
        if len(item) > max_tokens:
            raise RequestError(
                "prompt", f"a prompt may hold at most {max_tokens} tokens."
            )
        ids = np.asarray(item, np.int32)
        out.append((ids, decoding.detokenize(ids, tokenizer)))
    return out


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOPS
        or not all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise RequestError(
            "stop",
            f"stop must be a string or a list of at most {MAX_STOPS} strings of "
            f"1 to {MAX_STOP_CHARS} characters.",
        )
    return stop


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
        low, high = BIAS_RANGE
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= value <= high
        ):
            raise RequestError(
                "logit_bias",
                f"logit_bias values must be numbers in [{low}, {high}]; got {value!r}.",
            )
        mapping[token] = float(value)
    return decoding.logit_bias_vector(mapping, vocab_size)


def _penalty(body: dict, name: str) -> float | None:
    value = requests._number(body, name, 0.0, *PENALTY_RANGE)
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


def _sampling_knobs(body: dict, vocab_size: int) -> decoding.SamplingKnobs:
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's spelling of "off"
        body = {**body, "top_k": 0}
    return decoding.SamplingKnobs(
        temperature=requests._number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=requests._number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=requests._integer(body, "top_k", 0, 0, MAX_INTEGER_KNOB),
        min_p=requests._number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=requests._number(
            body, "repetition_penalty", 1.0, 0.0, MAX_FLOAT_KNOB, low_open=True
        ),
        presence_penalty=_penalty(body, "presence_penalty"),
        frequency_penalty=_penalty(body, "frequency_penalty"),
        logit_bias=_logit_bias(body, vocab_size),
    )


def parse_completion(
    body: Any,
    tokenizer: Any,
    buckets: requests.Buckets,
    limits: requests.Limits,
    model_name: str,
) -> CompletionRequest:
    """A checked ``/v1/completions`` body.

    ``max_tokens`` defaults to OpenAI's 16 (capped by the largest new-token
    bucket) and may be 0 only with ``echo``; ``logprobs`` is an integer in
    ``[0, 5]``; ``seed`` is an integer in ``[-2**63, 2**63)`` (taken modulo
    ``2**31``); ``n`` times the prompts fits the largest batch; ``top_k``
    ``-1`` means off.

    Raises:
        RequestError: naming the first bad field (status 404 for an unknown
            ``model``).

    Examples:
        >>> from lmhead.lm import data
        >>> tokenizer = data.CharTokenizer("abc")
        >>> buckets = requests.Buckets((1, 4), (8,), (8,), (2,))
        >>> request = parse_completion({"model": "m", "prompt": [[0, 1], "c"],
        ...     "n": 2, "stop": "a"}, tokenizer, buckets, requests.Limits(), "m")
        >>> request.prompt_texts, request.max_tokens, request.rows
        (['ab', 'c'], 8, 4)
        >>> parse_completion({"model": "m", "prompt": "a", "max_tokens": 0},
        ...     tokenizer, buckets, requests.Limits(), "m")
        Traceback (most recent call last):
        ...
        lmhead.serve.requests.RequestError: max_tokens may be 0 only with echo.
    """
    body = requests._body_object(body, COMPLETION_FIELDS)
    model = body.get("model")
    if model is None:
        raise RequestError("model", f"model is required: {model_name!r}.")
    if model != model_name:
        raise RequestError(
            "model", f"model must be {model_name!r}; got {model!r}.", status=404
        )
    prompts = _prompts(body, tokenizer, buckets.prompt_lengths[-1], limits)
    echo = _get(body, "echo", (bool,), "true or false", False)
    stream = _get(body, "stream", (bool,), "true or false", False)
    _get(body, "user", (str,), "a string")
    cap = buckets.new_tokens[-1]
    max_tokens = requests._integer(
        body, "max_tokens", min(DEFAULT_MAX_TOKENS, cap), 0, cap
    )
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens", "max_tokens may be 0 only with echo.")
    num_beams = requests._integer(
        body, "num_beams", 1, 1, max(buckets.beam_sizes, default=1)
    )
    seed = requests._integer(body, "seed", None, -(2**63), 2**63 - 1)
    request = CompletionRequest(
        prompt_ids=[ids for ids, _ in prompts],
        prompt_texts=[text for _, text in prompts],
        max_tokens=max_tokens,
        knobs=_sampling_knobs(body, tokenizer.vocab_size),
        n=requests._integer(body, "n", 1, 1, buckets.batch_sizes[-1]),
        seed=None if seed is None else seed % 2**31,
        logprobs=requests._integer(body, "logprobs", None, 0, MAX_LOGPROBS),
        echo=echo,
        stop=_stops(body),
        stream=stream,
        include_usage=_stream_options(body, stream),
        num_beams=num_beams,
        model=model,
    )
    _check_combinations(body, request, buckets)
    return request


def _check_combinations(body: dict, request: CompletionRequest, buckets) -> None:
    if body.get("suffix") is not None:
        raise RequestError("suffix", "suffix is not supported.")
    best_of = requests._integer(body, "best_of", request.n, 1, MAX_INTEGER_KNOB)
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
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logit_bias", "seed",
                 "logprobs", "stop", "stream"):  # fmt: skip
        if body.get(name) not in (None, False):
            raise RequestError(name, f"{name} does not apply to num_beams > 1.")
    if request.max_tokens not in buckets.new_tokens:
        raise RequestError(
            "max_tokens",
            f"with num_beams > 1, max_tokens must be one of {list(buckets.new_tokens)}.",
        )
    if request.n > request.num_beams:
        raise RequestError("n", "n must be at most num_beams.")


def new_id() -> str:
    """A completion's ``id``.

    Examples:
        >>> new_id().startswith("cmpl-")
        True
    """
    return f"cmpl-{uuid.uuid4().hex}"


def usage(result: dict) -> dict:
    """OpenAI's ``usage`` of a :func:`lmhead.serve.completions.run_completions`
    result.

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
    return {
        "id": id_,
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": result["choices"],
        "usage": usage(result),
    }


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
