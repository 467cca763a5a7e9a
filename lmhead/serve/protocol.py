"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` as
pydantic models (vLLM's ``protocol.py`` is the model): each field's type,
range and meaning, which FastAPI checks before a route runs and publishes in
``/openapi.json``. A field's first error is a 400 naming it
(:func:`error_param`). The knobs' ranges are ``lmhead.decoding.knobs``'s
(within the service's :data:`KNOB_POLICY`), checked by that module's one
check, so the messages are the knobs' own; the caps that a service sets
(``--max_prompts``, ``--max_stops``, ``--max_stop_chars``) come in through
:func:`body_models`. What depends on the run (the prompt's tokens, the
context, the batch buckets, a schema that must compile against the
vocabulary) is checked after, by ``lmhead/serve/requests.py``.
"""

import functools
import math
from typing import Annotated, Any, Literal, NamedTuple

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from lmhead.decoding import knobs as knobs_lib

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
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_INTEGER = 2**31 - 1  # a request's upper bound on a count
SEED_RANGE = (-(2**63), 2**63 - 1)
# The roles a chat message may have (OpenAI's, less tools and functions).
CHAT_ROLES = ("system", "developer", "user", "assistant")
STRICT = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
# A choice among strings: at least one, none empty.
Choices = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


def _bounds_schema(bounds: dict) -> dict:
    """JSON Schema's words for a knob's range."""
    schema = {}
    for end, word in (("low", "minimum"), ("high", "maximum")):
        value = bounds[end]
        if value is not None and math.isfinite(value):
            schema[f"exclusive{word.title()}" if bounds[f"{end}_open"] else word] = (
                value
            )
    return schema


def _knob(name: str, description: str, off: Any = None) -> Any:
    """The field of knob ``name``: an integer or a number, absent for its
    neutral value, in its range (:func:`lmhead.decoding.knobs.knob_range`
    within :data:`KNOB_POLICY`), checked by ``check_knob``; ``off``, a value
    outside the range that also means off (vLLM's ``top_k`` -1)."""
    spec = knobs_lib.knob_spec(name)
    kind = int if np.issubdtype(spec["dtype"], np.integer) else float
    policy = KNOB_POLICY.get(name)

    def check(value):
        if value is not None and value != off:
            knobs_lib.check_knob(name, value, within=policy)
        return value

    bounds = knobs_lib.knob_range(name, within=policy)
    if off is not None:
        bounds = {**bounds, "low": min(off, bounds["low"]), "low_open": False}
    return Annotated[
        kind | None,
        AfterValidator(check),
        Field(None, description=description, json_schema_extra=_bounds_schema(bounds)),
    ]


def _flag(description: str) -> Any:
    return Annotated[bool, Field(False, description=description)]


def _count(low: int, high: int, description: str, default: Any = None) -> Any:
    return Annotated[
        int | None, Field(default, ge=low, le=high, description=description)
    ]


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``."""

    model_config = STRICT
    include_usage: bool = Field(
        False, description="Add a last chunk with the usage (null in the others)."
    )


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's Structured Outputs."""

    model_config = STRICT
    name: str = Field(
        pattern=r"^[A-Za-z0-9_-]{1,64}$", description="The schema's name (unused)."
    )
    description: str | None = Field(
        None, description="What the schema is for (unused)."
    )
    schema_: dict[str, Any] = Field(
        alias="schema", description="The JSON Schema the answer must follow."
    )
    strict: bool | None = Field(
        None,
        description="OpenAI's flag; the schema is enforced either way (every "
        "keyword llguidance supports, the others refused).",
    )


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or a schema."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: no constraint; json_object: any JSON object; "
        "json_schema: the schema of json_schema."
    )
    json_schema: JsonSchemaFormat | None = Field(
        None, description="Required with type json_schema."
    )

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "json_schema is given with type json_schema, and only then."
            )
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    model_config = STRICT
    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON Schema (an object or its text)."
    )
    regex: str | None = Field(None, description="A regex the whole text matches.")
    choice: Choices | None = Field(None, description="The text is one of these.")
    grammar: str | None = Field(None, description="A Lark or GBNF grammar.")
    json_object: bool | None = Field(None, description="true: any JSON object.")

    @model_validator(mode="after")
    def _one_given(self):
        given = [
            name
            for name in ("json_", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, regex, choice, grammar and json_object."
            )
        return self


class TextPart(BaseModel):
    """A text part of a message's content (the only kind served)."""

    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a chat."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal[CHAT_ROLES] = Field(
        description="Who speaks: " + ", ".join(CHAT_ROLES)
    )
    content: str | list[TextPart] = Field(description="The text, or its text parts.")
    name: str | None = Field(None, description="The speaker's name (unused).")

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TokenizeBody(BaseModel):
    """A ``POST /tokenize`` body (vLLM's)."""

    model_config = STRICT
    model: str | None = Field(None, description="Unused.")
    prompt: str = Field(description="The text to encode.")
    add_special_tokens: bool | None = Field(None, description="Unused.")


class DetokenizeBody(BaseModel):
    """A ``POST /detokenize`` body (vLLM's)."""

    model_config = STRICT
    model: str | None = Field(None, description="Unused.")
    tokens: list[Annotated[int, Field(ge=0)]] = Field(description="Token ids.")


class BodyModels(NamedTuple):
    """The request models of one service (:func:`body_models`)."""

    completion: type[BaseModel]
    chat: type[BaseModel]


@functools.lru_cache(maxsize=16)
def body_models(max_prompts: int, max_stops: int, max_stop_chars: int) -> BodyModels:
    """The completion and chat bodies of a service whose limits are these
    (``lmhead.serve.requests.Limits``), so that ``/openapi.json`` states the
    caps the service keeps."""
    stop_string = Annotated[str, Field(min_length=1, max_length=max_stop_chars)]
    stops = f"A stop string or up to {max_stops}, each 1 to {max_stop_chars} characters"

    class SamplingFields(BaseModel):
        """The fields completions and chat share: OpenAI's, then vLLM's."""

        model_config = STRICT
        model: str = Field(description="The served model's id (GET /v1/models).")
        n: _count(1, MAX_INTEGER, "Choices per prompt; the rows must fit a batch.", 1)
        stream: _flag("Server-sent events as the choices grow.")
        stream_options: StreamOptions | None = Field(None, description="Needs stream.")
        stop: (
            stop_string
            | Annotated[list[stop_string], Field(max_length=max_stops)]
            | None
        ) = Field(None, description=stops + "; cut from the text.")
        temperature: _knob("temperature", "0: greedy.")
        top_p: _knob("top_p", "Nucleus sampling; 1: off.")
        presence_penalty: _knob("presence_penalty", "Over the generated tokens.")
        frequency_penalty: _knob("frequency_penalty", "Over the generated tokens.")
        logit_bias: dict[str, float] | None = Field(
            None,
            description="Token id (a string) to a bias in [-100, 100] added to "
            "its logit.",
        )
        seed: Annotated[
            int | None,
            Field(
                None,
                ge=SEED_RANGE[0],
                le=SEED_RANGE[1],
                description="The choices of a seeded request are the same in any "
                "batch (taken modulo 2**31).",
            ),
        ]
        user: str | None = Field(None, description="Unused.")
        top_k: _knob("top_k", "vLLM's; 0 or -1: off.", off=-1)
        min_p: _knob("min_p", "vLLM's; 0: off.")
        repetition_penalty: _knob("repetition_penalty", "vLLM's; 1: off.")
        stop_token_ids: (
            Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=max_stops)]
            | None
        ) = Field(None, description="vLLM's: token ids that end a choice.")
        ignore_eos: _flag("vLLM's: decode on past the end-of-text token.")
        include_stop_str_in_output: _flag("vLLM's: keep the stop string.")
        min_tokens: _count(0, MAX_INTEGER, "vLLM's: no EOS nor stop before.", 0)
        response_format: ResponseFormat | None = Field(
            None, description="OpenAI's structured output."
        )
        structured_outputs: StructuredOutputs | None = Field(
            None, description="vLLM's structured output."
        )
        guided_json: dict[str, Any] | str | None = Field(
            None, description="vLLM's older structured_outputs.json."
        )
        guided_regex: str | None = Field(
            None, description="vLLM's older structured_outputs.regex."
        )
        guided_choice: Choices | None = Field(
            None, description="vLLM's older structured_outputs.choice."
        )
        guided_grammar: str | None = Field(
            None, description="vLLM's older structured_outputs.grammar."
        )

        @field_validator("stream_options")
        @classmethod
        def _options_need_stream(cls, options, info):
            if options is not None and not info.data.get("stream"):
                raise ValueError("stream_options needs stream: true.")
            return options

    prompt_item = str | list[int]

    class CompletionBody(SamplingFields):
        """A ``POST /v1/completions`` body."""

        prompt: prompt_item | list[prompt_item] = Field(
            description=f"A string, token ids, or a list of 1 to {max_prompts} "
            "of either; each at most the context."
        )
        max_tokens: _count(0, MAX_INTEGER, "New tokens; 0 only with echo.")
        logprobs: _count(0, MAX_LOGPROBS, "The chosen token's log-prob and the top k.")
        echo: _flag("Return the prompt (and its log-probs) before the text.")
        best_of: _count(1, MAX_INTEGER, "Must equal n when given.")
        suffix: str | None = Field(None, description="Not supported.")
        num_beams: _count(1, MAX_INTEGER, "Beam search: 1 or one of --beam_sizes.", 1)
        prompt_logprobs: _count(
            0, MAX_LOGPROBS, "vLLM's: each prompt token's log-prob and the top k."
        )

    class ChatBody(SamplingFields):
        """A ``POST /v1/chat/completions`` body."""

        messages: list[ChatMessage] = Field(
            min_length=1, description="The chat, rendered by the run's template."
        )
        max_completion_tokens: _count(1, MAX_INTEGER, "New tokens at most.")
        max_tokens: _count(1, MAX_INTEGER, "The older name of max_completion_tokens.")
        logprobs: bool | None = Field(None, description="Each token's log-prob.")
        top_logprobs: _count(0, MAX_LOGPROBS, "The top k per token; needs logprobs.")
        add_generation_prompt: bool = Field(
            True, description="vLLM's: the template opens the assistant's turn."
        )

    return BodyModels(CompletionBody, ChatBody)


def error_param(location: tuple) -> str:
    """The field a validation error names (OpenAI's ``param``): the body's
    top-level field, or ``body`` for the body itself.

    Examples:
        >>> error_param(("body", "messages", 0, "role")), error_param(("body",))
        ('messages', 'body')
    """
    fields = [part for part in location[1:] if isinstance(part, str)]
    return fields[0] if fields else "body"


def error_message(error: dict) -> str:
    """One validation error in words: where, then what.

    Examples:
        >>> error_message({"loc": ("body", "n"), "msg": "Input should be an integer"})
        'n: Input should be an integer'
    """
    where = ".".join(str(part) for part in error["loc"][1:]) or "body"
    message = str(error.get("ctx", {}).get("error", "")) or error["msg"]
    return message if message.startswith(where) else f"{where}: {message}"
