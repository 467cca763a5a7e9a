"""The HTTP service: OpenAI's ``POST /v1/completions`` and ``POST
/v1/chat/completions`` over continuous batching (:mod:`lmhead.serve.continuous`),
``GET /v1/models``, vLLM's tokenizer routes, ``/healthz``, Prometheus
``/metrics`` and ``/openapi.json`` (the request bodies' pydantic models,
:mod:`lmhead.serve.protocol`), behind a bearer token and a body-size cap;
errors in OpenAI's shape (:func:`error_body`), naming the field. The routes,
statuses and metrics are listed in ``docs/serving.md``.
FastAPI, uvicorn and prometheus-client (the ``serve`` extra) are imported
where used, so that the rest of ``lmhead`` needs none of them.
"""

import asyncio
import contextlib
import dataclasses
import hmac
import json
import socket
import threading
import time
from typing import Any

import numpy as np

from lmhead import decoding
from lmhead.serve import chat, completions, continuous, protocol, requests
from lmhead.serve.engine import Engine
from lmhead.serve.requests import RequestError

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/openapi.json",
    "/tokenizer_info",
    "/tokenize",
    "/detokenize",
)
ENDPOINTS = (*ROUTES, "/healthz", "/metrics")
OPEN_ENDPOINTS = ("/healthz",)
ERROR_TYPES = {
    401: "authentication_error",
    503: "server_overloaded",
    504: "timeout",
}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
RETRY_AFTER_SECONDS = 1
# A body over the cap is read and dropped up to this many bytes before the
# 413 goes out: a client that is still sending when the server answers and
# closes (Python's urllib, httpx, requests, openai) sees a reset connection
# instead of the answer. Past it, the server answers and closes at once.
DRAIN_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """How the service guards itself.

    Attributes:
        token: the bearer token every endpoint but ``/healthz`` requires;
            None: no token (loopback only, see :func:`requests.check_exposure`).
        max_body_bytes: larger bodies get 413 before they are read whole.
        max_queue: requests that may wait; more get 503.
        timeout_s: a request not answered by then gets 504 (and a running
            one is cancelled).
        limits: the caps of :class:`requests.Limits`.
        model_name: the ``model`` of the routes.
        slots: the batcher's decode slots; None: the largest batch size.
        steps_per_call: its decoding steps per compiled call.
        speculative, num_speculative_tokens: the batcher's speculative
            decoding (None, ``"mtp"`` or ``"ngram"``) and its proposals per step.
    """

    token: str | None = None
    max_body_bytes: int = 65536
    max_queue: int = 64
    timeout_s: float = 30.0
    limits: requests.Limits = requests.Limits()
    model_name: str = "lmhead"
    slots: int | None = None
    steps_per_call: int = continuous.DEFAULT_STEPS_PER_CALL
    speculative: str | None = None
    num_speculative_tokens: int = 3


def read_token(path: str) -> str:
    """The token in ``path``, without surrounding whitespace."""
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"{path} holds no token.")
    return token


class Metrics:
    """The Prometheus metrics of one service, in a registry of their own."""

    def __init__(self):
        import prometheus_client as prom

        self._prom = prom
        self.registry = registry = prom.CollectorRegistry()
        prom.ProcessCollector(registry=registry)  # memory, CPU, open files

        def metric(kind, name, text, *labels, **options):
            return getattr(prom, kind)(name, text, labels, registry=registry, **options)

        self.requests = metric(
            "Counter",
            "lmhead_requests",
            "HTTP requests by endpoint and status.",
            "endpoint",
            "status",
        )
        self.latency = metric(
            "Histogram",
            "lmhead_request_latency_seconds",
            "Time to answer a request.",
            "endpoint",
            buckets=LATENCY_BUCKETS,
        )
        self.tokens = metric(
            "Counter", "lmhead_generated_tokens", "Tokens returned by /v1/completions."
        )
        self.queue_depth = metric(
            "Gauge",
            "lmhead_queue_depth",
            "Requests waiting for decode slots (or to run whole).",
        )
        self.active_slots = metric(
            "Gauge", "lmhead_active_slots", "Decode slots holding a running sequence."
        )
        self.cancelled = metric(
            "Counter",
            "lmhead_cancelled_sequences",
            "Running sequences cancelled (client gone or timed out) that left "
            "their slots.",
        )
        self.first_token = metric(
            "Histogram",
            "lmhead_time_to_first_token_seconds",
            "From a completion's arrival to its first tokens.",
            buckets=LATENCY_BUCKETS,
        )
        self.inter_token = metric(
            "Histogram",
            "lmhead_inter_token_seconds",
            "Gap between deliveries of a completion's tokens, per token.",
            buckets=TOKEN_GAP_BUCKETS,
        )

    def text(self) -> bytes:
        return self._prom.generate_latest(self.registry)


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


def _error(status: int, param: str | None, message: str, headers=None):
    from fastapi import responses

    return responses.JSONResponse(
        error_body(status, param, message), status_code=status, headers=headers
    )


class _Guard:
    """ASGI middleware: counts and times every request, checks the token,
    and reads a POST body only up to ``max_body_bytes``."""

    def __init__(self, app, *, config: ServiceConfig, metrics: Metrics):
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        try:
            refusal = self._refusal(scope)
            if refusal is None and scope["method"] == "POST":
                receive, refusal = await self._read_body(scope, receive)
                scope = _as_json(scope)
            if refusal is not None:
                return await refusal(scope, receive, send_and_record)
            return await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    def _refusal(self, scope):
        if self.config.token is None or scope["path"] in OPEN_ENDPOINTS:
            return None
        headers = dict(scope["headers"])
        scheme, _, given = (
            headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        )
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.config.token.encode()
        ):
            return None
        return _error(
            401,
            "Authorization",
            "a valid bearer token is required.",
            {"WWW-Authenticate": "Bearer"},
        )

    async def _read_body(self, scope, receive):
        cap = self.config.max_body_bytes
        too_large = _error(413, "body", f"the body must be at most {cap} bytes.")
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > cap:
            if declared.isdigit() and int(declared) <= DRAIN_BYTES:
                await _drain(receive, 0)
            return receive, too_large
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > cap:
                if more:
                    await _drain(receive, size)
                return receive, too_large
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay, None


def _as_json(scope: dict) -> dict:
    """``scope`` with its body declared JSON: every POST route reads JSON,
    and ``curl -d`` (form-encoded by default) is read as it always was."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


async def _drain(receive, size: int) -> None:
    """Reads and drops the rest of a body, up to :data:`DRAIN_BYTES` in all
    (``size`` read already)."""
    while size <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def make_app(engine: Engine, config: ServiceConfig = ServiceConfig()):
    """The service's ASGI app over ``engine`` (warmed up already): a
    :class:`continuous.SlotBatcher` (compiled here), which stops when the
    app shuts down."""
    import fastapi

    metrics = Metrics()
    slots = continuous.SlotBatcher(
        engine,
        slots=config.slots,
        max_queue=config.max_queue,
        steps_per_call=config.steps_per_call,
        limits=config.limits,
        speculative=config.speculative,
        num_speculative_tokens=config.num_speculative_tokens,
        events=continuous.SlotEvents(
            first_token=metrics.first_token.observe,
            inter_token=metrics.inter_token.observe,
            cancelled=metrics.cancelled.inc,
        ),
    )
    slots.warm_up()
    metrics.active_slots.set_function(slots.active)
    metrics.queue_depth.set_function(slots.depth)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        slots.stop()

    app = fastapi.FastAPI(
        title="lmhead",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(_Guard, config=config, metrics=metrics)
    _add_error_handlers(app, config)
    limits = config.limits
    models = protocol.body_models(
        limits.max_prompts, limits.max_stops, limits.max_stop_chars
    )
    run_settings = dict(
        tokenizer=engine.tokenizer,
        buckets=engine.buckets,
        limits=limits,
        model_name=config.model_name,
        context=engine.model.max_len,
        masker=slots.masker,
    )

    async def answer(parsed: requests.CompletionRequest, id_: str, whole, chunk):
        """The answer of a checked request: ``whole(result)`` once it ends,
        or, streaming, its chunks (``chunk(choices, usage=None)``)."""
        from fastapi import responses
        from starlette import background

        if parsed.stream:
            future, updates = _submit_stream(parsed, slots.submit)
            events = _events(
                parsed, future, updates, slots.cancel, metrics.tokens.inc,
                config.timeout_s, chunk,
            )  # fmt: skip
            return responses.StreamingResponse(
                events,
                media_type="text/event-stream",
                # Also when the client leaves before the body starts.
                background=background.BackgroundTask(slots.cancel, future),
            )
        future = slots.submit(parsed)
        try:
            result = await asyncio.wait_for(
                asyncio.wrap_future(future), config.timeout_s
            )
        finally:  # a request nobody waits for any more is cancelled
            slots.cancel(future)
        metrics.tokens.inc(result["completion_tokens"])
        return whole(result)

    @app.post("/v1/completions")
    async def create_completion(body: models.completion):
        parsed = requests.completion_request(body, **run_settings)
        id_ = completions.new_id()
        return await answer(
            parsed,
            id_,
            lambda result: completions.completion_body(parsed, result, id_),
            lambda choices, usage=None: completions.stream_chunk(
                parsed, id_, choices, usage
            ),
        )

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: models.chat):
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        prompt = engine.chat_template.render(messages, body.add_generation_prompt)
        parsed = requests.chat_request(body, prompt, **run_settings)
        id_ = chat.new_id()
        return await answer(
            parsed,
            id_,
            lambda result: chat.chat_body(
                parsed, result, id_, completions.usage(result)
            ),
            lambda choices, usage=None: chat.chat_chunk(parsed, id_, choices, usage),
        )

    _add_info_routes(app, engine, config.model_name)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "queue_depth": slots.depth()}

    @app.get("/metrics")
    async def prometheus_metrics():
        return fastapi.Response(metrics.text(), media_type="text/plain; version=0.0.4")

    return app


def _add_info_routes(app: Any, engine: Engine, model_name: str) -> None:
    """``/v1/models`` and the tokenizer routes."""

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
        # The end-of-text token (<|endoftext|> in new runs, GPT-2's in an
        # imported one; None in a run made without it), as vLLM names it.
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": getattr(tokenizer, "eos_token", None),
            "eos_token_id": tokenizer.eos_id,
            "vocab_size": tokenizer.vocab_size,
            "model_max_length": engine.model.max_len,
        }

    @app.post("/tokenize")
    async def tokenize(body: protocol.TokenizeBody):
        prompt = body.prompt
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
    async def detokenize(body: protocol.DetokenizeBody):
        tokens = body.tokens
        if not all(t < tokenizer.vocab_size for t in tokens):
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


def _add_error_handlers(app, config: ServiceConfig) -> None:
    """A bad field: 4xx naming it; an unknown route or method: 404 or 405;
    a full queue: 503; too late: 504; any other error: 500, all in OpenAI's
    error shape (the server logs a 500)."""
    from fastapi import exceptions as fastapi_exceptions
    from starlette import exceptions

    async def refuse_request(request, error: RequestError):
        return _error(error.status, error.field, error.message)

    async def refuse_full(request, error: requests.QueueFull):
        return _error(
            503,
            None,
            f"the queue is full ({error}); retry later.",
            {"Retry-After": str(RETRY_AFTER_SECONDS)},
        )

    async def refuse_late(request, error: TimeoutError):
        return _error(504, None, f"no answer within {config.timeout_s} s.")

    async def refuse_route(request, error):
        if error.status_code == 400:  # FastAPI could not read the body
            return _error(400, "body", f"the body is not JSON: {error.detail}.")
        message = f"Invalid URL ({request.method} {request.url.path}): {error.detail}."
        return _error(error.status_code, None, message)

    async def refuse_body(request, error: fastapi_exceptions.RequestValidationError):
        errors = error.errors()
        param = protocol.error_param(tuple(errors[0]["loc"]))
        same = [e for e in errors if protocol.error_param(tuple(e["loc"])) == param]
        message = "; ".join(protocol.error_message(e) for e in same[:3])
        return _error(400, param, message)

    async def fail(request, error: Exception):
        return _error(500, None, f"the request failed: {error}")

    app.add_exception_handler(exceptions.HTTPException, refuse_route)
    app.add_exception_handler(fastapi_exceptions.RequestValidationError, refuse_body)
    app.add_exception_handler(RequestError, refuse_request)
    app.add_exception_handler(requests.QueueFull, refuse_full)
    app.add_exception_handler(TimeoutError, refuse_late)
    app.add_exception_handler(Exception, fail)


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (``port=0``: a free port)."""
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections wait in the backlog until uvicorn accepts
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(app, host: str, port: int) -> None:
    """Serves ``app`` until SIGINT or SIGTERM; prints ``serving on URL`` once
    it listens (``port=0`` picks a free port)."""
    import uvicorn

    sock = _listen(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    print(f"serving on {_url(sock)}", flush=True)
    server.run(sockets=[sock])


class BackgroundServer:
    """Runs ``app`` with uvicorn in a thread on ``host`` and a free port; a
    context manager that gives the base URL once it listens."""

    def __init__(self, app, host: str = "127.0.0.1"):
        import uvicorn

        self._socket = _listen(host, 0)
        self.url = _url(self._socket)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> str:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped while starting.")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc_info):
        self._server.should_exit = True
        self._thread.join()
        self._socket.close()


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _submit_stream(parsed, submit) -> tuple[Any, asyncio.Queue]:
    """Queues a streaming request (raising as :func:`submit` does, before
    any byte of the response is sent) with a sink that hands its updates
    to the event loop: ``(future, updates)``."""
    loop, updates = asyncio.get_running_loop(), asyncio.Queue()
    parsed.sink = lambda found: loop.call_soon_threadsafe(updates.put_nowait, found)
    return submit(parsed), updates


async def _events(parsed, future, queue, cancel, on_tokens, timeout_s, chunk):
    """The server-sent events of a streaming request, each ``chunk(choices,
    usage=None)`` (completions' or chat's shape): text deltas as the
    engine's chunks arrive, each choice's last chunk with its
    ``finish_reason``, ``stop_reason`` and its whole ``logprobs``, the usage
    chunk when asked, and ``[DONE]``; past ``timeout_s``, an error (504) in
    band. A chat choice's first chunk names its role (``first``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    sent: dict[int, str] = {}

    def delta(index, text, **fields):
        first = {"first": True} if parsed.chat and index not in sent else {}
        return {"text": text, "index": index, "logprobs": None,
                "finish_reason": None, **fields, **first}  # fmt: skip

    def deltas(updates):
        choices = []
        for index, text, _ in updates:
            done = sent.get(index, "")
            if len(text) > len(done) and text.startswith(done):
                choices.append(delta(index, text[len(done) :]))
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
                yield _sse(chunk(choices))
        while not queue.empty():
            choices = deltas(queue.get_nowait())
            if choices:
                yield _sse(chunk(choices))
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
            fields = {k: v for k, v in choice.items() if k not in ("text", "index")}
            yield _sse(chunk([delta(choice["index"], rest, **fields)]))
        if parsed.include_usage:
            yield _sse(chunk([], completions.usage(result)))
        yield "data: [DONE]\n\n"
    finally:  # the client left, or the stream ended: a no-op once it ran
        cancel(future)
