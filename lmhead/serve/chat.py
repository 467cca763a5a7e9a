"""Chat: a chat's messages rendered into one prompt by the run's template
(:class:`ChatTemplate`), and the answers of ``/v1/chat/completions`` in chat's
shapes (:func:`chat_body`, :func:`chat_chunk`, :func:`chat_logprobs`).

The template is the run's ``tokenizer_config.json``'s ``chat_template`` (an
imported checkpoint's, which ``lmhead.lm.gpt2_import`` copies into the run),
rendered with jinja2 as transformers renders it (a sandbox, ``trim_blocks``
and ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``tojson``,
``strftime_now``) with ``messages``, ``add_generation_prompt``, ``bos_token``
and ``eos_token``; a run trained here has none and gets
:data:`DEFAULT_TEMPLATE`, speakers' names as in a play. jinja2 (the ``serve``
extra) is imported where used.
"""

import dataclasses
import datetime
import json
import os
import time
import uuid
from typing import Any

from lmhead.serve.requests import CompletionRequest, RequestError

TEMPLATE_FILE = "tokenizer_config.json"
# Each message as a speaker's line of a play, the assistant's name opening its
# turn: the form a model trained on plays continues.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


def _token_text(token: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or
    an ``AddedToken``'s ``{"content": ...}``."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A run's chat template and the special tokens it may use.

    Examples:
        >>> template = ChatTemplate(DEFAULT_TEMPLATE)
        >>> template.render([{"role": "user", "content": "Who is there?"}])
        'USER:\\nWho is there?\\n\\nASSISTANT:\\n'
    """

    source: str
    bos_token: str | None = None
    eos_token: str | None = None

    @classmethod
    def of_run(cls, workdir: str, tokenizer: Any) -> "ChatTemplate":
        """``workdir``'s :data:`TEMPLATE_FILE` template (its ``"default"``
        one when it names several), or :data:`DEFAULT_TEMPLATE` with the
        tokenizer's end-of-text token."""
        eos = getattr(tokenizer, "eos_token", None)
        path = os.path.join(workdir, TEMPLATE_FILE)
        if not os.path.isfile(path):
            return cls(DEFAULT_TEMPLATE, None, eos)
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name", "template"}]: the default one
            named = {t.get("name"): t.get("template") for t in source}
            source = named.get("default")
        if not isinstance(source, str):
            return cls(DEFAULT_TEMPLATE, None, eos)
        return cls(
            source,
            _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")) or eos,
        )

    def render(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt of ``messages`` (``{"role", "content"}``).

        Raises:
            RequestError: naming ``messages``, where the template refuses
                them (its ``raise_exception``) or cannot be rendered.
        """
        import jinja2

        try:
            return _compiled(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as error:
            raise RequestError("messages", f"the chat template: {error}") from None


_TEMPLATES: dict[str, Any] = {}


def _compiled(source: str) -> Any:
    """The template of ``source`` in transformers' environment, made once."""
    if source not in _TEMPLATES:
        import jinja2
        from jinja2 import ext, sandbox

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(
            value, ensure_ascii=False, indent=None, separators=None, sort_keys=False
        ):
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent,
                separators=separators, sort_keys=sort_keys,
            )  # fmt: skip

        def strftime_now(format):
            return datetime.datetime.now().strftime(format)

        environment = sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
        )
        environment.filters["tojson"] = tojson
        environment.globals.update(
            raise_exception=raise_exception, strftime_now=strftime_now
        )
        _TEMPLATES[source] = environment.from_string(source)
    return _TEMPLATES[source]


def new_id() -> str:
    """A chat completion's ``id``.

    Examples:
        >>> new_id().startswith("chatcmpl-")
        True
    """
    return f"chatcmpl-{uuid.uuid4().hex}"


def _entry(text: str, log_prob: float | None) -> dict:
    return {"token": text, "logprob": log_prob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[tuple[str, float | None, list]]) -> dict:
    """Chat's ``logprobs`` of ``(token text, log-prob, [(text, log-prob)]
    top)`` entries: ``{"content": [{token, logprob, bytes, top_logprobs}]}``.

    Examples:
        >>> chat_logprobs([("a", -0.5, [("a", -0.5)])])["content"][0]["bytes"]
        [97]
    """
    return {
        "content": [
            {**_entry(text, log_prob), "top_logprobs": [_entry(*t) for t in top]}
            for text, log_prob, top in entries
        ]
    }


def chat_choice(choice: dict) -> dict:
    """A completion choice (``completions.request_result``'s) in chat's shape."""
    return {
        "index": choice["index"],
        "message": {"role": "assistant", "content": choice["text"]},
        "logprobs": choice["logprobs"],
        "finish_reason": choice["finish_reason"],
        "stop_reason": choice["stop_reason"],
    }


def chat_body(request: CompletionRequest, result: dict, id_: str, usage: dict) -> dict:
    """The ``chat.completion`` object of a finished request."""
    return {
        "id": id_,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [chat_choice(choice) for choice in result["choices"]],
        "usage": usage,
    }


def chat_chunk(
    request: CompletionRequest, id_: str, choices: list[dict], usage: Any = None
) -> dict:
    """One ``chat.completion.chunk`` of completion-shaped ``choices`` (their
    ``text`` the delta; a choice's first chunk names the role), ``usage`` as
    :func:`lmhead.serve.completions.stream_chunk` gives it."""
    chunk = {
        "id": id_,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": request.model,
        "choices": [
            {
                "index": c["index"],
                "delta": {**({"role": "assistant"} if c.get("first") else {}),
                          **({"content": c["text"]} if c["text"] or c.get("first") else {})},
                "logprobs": c.get("logprobs"),
                "finish_reason": c.get("finish_reason"),
                **({"stop_reason": c["stop_reason"]} if "stop_reason" in c else {}),
            }
            for c in choices
        ],
    }  # fmt: skip
    if request.include_usage:
        chunk["usage"] = usage
    return chunk
