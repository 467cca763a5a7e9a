"""The OpenAI-compatible routes of the HTTP service (``lmhead/serve/web.py``
mounts them): ``POST /v1/completions`` (JSON, or server-sent events with
``stream``), ``GET /v1/models``, and vLLM's tokenizer routes
``GET /tokenizer_info``, ``POST /tokenize`` and ``POST /detokenize``.

Errors on these routes take OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}`` (:func:`error_body`); a request that breaks a field's
rules is a 400 naming it in ``param``.
"""

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from lmhead import decoding
from lmhead.serve import completions, openai_api, requests
from lmhead.serve.requests import RequestError

ROUTES = (
    "/v1/completions",
    "/v1/models",
    "/tokenizer_info",
    "/tokenize",
    "/detokenize",
)
ERROR_TYPES = {
    401: "authentication_error",
    503: "server_overloaded",
    504: "timeout",
}


def error_body(status: int, param: str | None, message: str) -> dict:
    """OpenAI's error object (``type`` ``invalid_request_error`` for a 4xx
    not listed in :data:`ERROR_TYPES`).

    Examples:
        >>> error_body(400, "n", "n must be an integer.")["error"]["type"]
        'invalid_request_error'
    """
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "")
    return {
        "error": {
            "message": message,
            "type": kind or "server_error",
            "param": param,
            "code": "model_not_found" if param == "model" and status == 404 else None,
        }
    }


def openai_status(status: int) -> int:
    """OpenAI answers a bad field with 400 where lmhead's routes say 422.

    Examples:
        >>> openai_status(422), openai_status(413)
        (400, 413)
    """
    return 400 if status == 422 else status


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def add_routes(
    app: Any,
    engine: Any,
    *,
    model_name: str,
    limits: requests.Limits,
    read_json: Callable[[Any], Awaitable[Any]],
    submit: Callable[[Any], Any],
    cancel: Callable[[Any], None],
    run: Callable[[Any], Awaitable[Any]],
    on_tokens: Callable[[int], None],
    timeout_s: float,
) -> None:
    """Adds the routes to the FastAPI ``app``.

    ``submit(request)`` queues a request and gives its future; ``cancel``
    drops one whose client left; ``run`` awaits one within the service's
    timeout, ``timeout_s``, which a stream keeps too; ``on_tokens`` counts
    generated tokens for the metrics."""
    import fastapi
    from fastapi import responses
    from starlette import background

    tokenizer = engine.tokenizer

    @app.post("/v1/completions")
    async def create_completion(request: fastapi.Request):
        parsed = openai_api.parse_completion(
            await read_json(request), tokenizer, engine.buckets, limits, model_name
        )
        id_ = openai_api.new_id()
        if parsed.stream:
            future, updates = _submit_stream(parsed, submit)
            return responses.StreamingResponse(
                _events(parsed, id_, future, updates, cancel, on_tokens, timeout_s),
                media_type="text/event-stream",
                # Also when the client leaves before the body starts.
                background=background.BackgroundTask(cancel, future),
            )
        if parsed.num_beams > 1:
            result = completions.beam_result(parsed, await run(parsed.as_generate()))
        else:
            result = await run(parsed)
        on_tokens(result["completion_tokens"])
        return openai_api.completion_body(parsed, result, id_)

    _add_info_routes(app, engine, model_name, read_json)


def _add_info_routes(app: Any, engine: Any, model_name: str, read_json) -> None:
    """``/v1/models`` and the tokenizer routes."""
    import fastapi

    tokenizer = engine.tokenizer

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "lmhead",
                    "max_model_len": engine.model.max_len,
                }
            ],
        }

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        eos = tokenizer.eos_id
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": None if eos is None else tokenizer.decode([eos]),
            "eos_token_id": eos,
            "vocab_size": tokenizer.vocab_size,
            "model_max_length": engine.model.max_len,
        }

    @app.post("/tokenize")
    async def tokenize(request: fastapi.Request):
        body = requests._body_object(
            await read_json(request), ("model", "prompt", "add_special_tokens")
        )
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("prompt", "prompt must be a string.")
        openai_api._get(body, "add_special_tokens", (bool,), "true or false")
        try:
            tokens = (
                np.asarray(tokenizer.encode_array(prompt)).tolist() if prompt else []
            )
        except (ValueError, TypeError, KeyError) as error:
            raise RequestError("prompt", f"prompt: {error}") from None
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": engine.model.max_len,
        }

    @app.post("/detokenize")
    async def detokenize(request: fastapi.Request):
        body = requests._body_object(await read_json(request), ("model", "tokens"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int)
            and not isinstance(t, bool)
            and 0 <= t < tokenizer.vocab_size
            for t in tokens
        ):
            raise RequestError(
                "tokens",
                f"tokens must be a list of token ids in [0, {tokenizer.vocab_size}).",
            )
        text = (
            decoding.detokenize(np.asarray(tokens, np.int32), tokenizer)
            if tokens
            else ""
        )
        return {"prompt": text}


def _submit_stream(parsed, submit) -> tuple[Any, asyncio.Queue]:
    """Queues a streaming request (raising as :func:`submit` does, before
    any byte of the response is sent) with a sink that hands its updates
    to the event loop: ``(future, updates)``."""
    loop, updates = asyncio.get_running_loop(), asyncio.Queue()
    parsed.sink = lambda found: loop.call_soon_threadsafe(updates.put_nowait, found)
    return submit(parsed), updates


async def _events(parsed, id_: str, future, queue, cancel, on_tokens, timeout_s):
    """The server-sent events of a streaming request: text deltas as the
    engine's chunks arrive, each choice's last chunk with its
    ``finish_reason`` and its whole ``logprobs``, the usage chunk when
    asked, and ``[DONE]``; past ``timeout_s``, an error (504) in band."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    sent: dict[int, str] = {}

    def deltas(updates):
        choices = []
        for index, text, _ in updates:
            done = sent.get(index, "")
            if len(text) > len(done) and text.startswith(done):
                choices.append(
                    {
                        "text": text[len(done) :],
                        "index": index,
                        "logprobs": None,
                        "finish_reason": None,
                    }  # fmt: skip
                )
                sent[index] = text
        return choices

    try:
        waiting = asyncio.ensure_future(asyncio.wrap_future(future))
        while True:
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait(
                {getter, waiting},
                timeout=max(deadline - loop.time(), 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not getter.done():
                getter.cancel()
                if not waiting.done():  # past the deadline
                    yield _sse(
                        error_body(504, None, f"no answer within {timeout_s} s.")
                    )
                    yield "data: [DONE]\n\n"
                    return
                break
            choices = deltas(getter.result())
            if choices:
                yield _sse(openai_api.stream_chunk(parsed, id_, choices))
        while not queue.empty():
            choices = deltas(queue.get_nowait())
            if choices:
                yield _sse(openai_api.stream_chunk(parsed, id_, choices))
        try:
            result = waiting.result()
        except Exception as error:  # the stream has begun: report it in band
            yield _sse(error_body(500, None, f"the request failed: {error}"))
            yield "data: [DONE]\n\n"
            return
        on_tokens(result["completion_tokens"])
        for choice in result["choices"]:
            done = sent.get(choice["index"], "")
            rest = (
                choice["text"][len(done) :] if choice["text"].startswith(done) else ""
            )
            yield _sse(openai_api.stream_chunk(parsed, id_, [dict(choice, text=rest)]))
        if parsed.include_usage:
            yield _sse(
                openai_api.stream_chunk(parsed, id_, [], openai_api.usage(result))
            )
        yield "data: [DONE]\n\n"
    finally:  # the client left, or the stream ended: a no-op once it ran
        cancel(future)
