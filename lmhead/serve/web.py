"""The HTTP service: FastAPI routes over :mod:`lmhead.serve.requests` and
:mod:`lmhead.serve.batching`, a bearer token, a body-size cap, Prometheus metrics.

Endpoints (JSON in and out; errors are ``{"error": {"field", "message"}}``):

* ``POST /v1/generate``: ``{"prompt": str | [str], "max_new_tokens",
  "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
  "num_beams", "num_return_sequences", "seed", "logprobs"}`` ->
  ``{"completions": [{"prompt_index", "text", "token_ids", "length",
  "log_probs"?, "score"?}]}``, prompt by prompt, each prompt's sequences in
  order (best first for beam search).
* ``POST /v1/score``: ``{"text", "stride"?}`` -> the totals of
  :meth:`scoring.TextScore.summary` (``nats``, ``bits_per_character``,
  ...), ``token_texts`` and their ``log_probs``.
* ``GET /healthz`` (never needs the token) and ``GET /metrics``.
* The OpenAI-compatible routes of :mod:`lmhead.serve.openai_web`
  (``POST /v1/completions``, ``GET /v1/models``, ``GET /tokenizer_info``,
  ``POST /tokenize``, ``POST /detokenize``), whose errors take OpenAI's shape
  ``{"error": {"message", "type", "param", "code"}}`` and say 400 for a bad
  field.

Statuses: 400 unreadable JSON, 401 a missing or wrong token, 413 a body over
the cap, 422 a field out of its rules, 503 (with ``Retry-After``) a full queue,
504 a request that did not finish within its timeout.

FastAPI, uvicorn and prometheus-client are the ``serve`` extra
(``pip install -e '.[serve]'``); they are imported where used, so that the
rest of ``lmhead`` needs none of them.
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

from lmhead.serve import batching, continuous, openai_api, openai_web, requests

ENDPOINTS = ("/v1/generate", "/v1/score", "/healthz", "/metrics", *openai_web.ROUTES)
OPEN_ENDPOINTS = ("/healthz",)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
BATCHING = ("continuous", "window")
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
        max_queue: requests that may wait for a batch; more get 503.
        window_s: how long a request waits for others to batch with.
        timeout_s: a request not answered by then gets 504 (and a running
            completion is cancelled).
        limits: the caps of :class:`requests.Limits`.
        model_name: the ``model`` of the OpenAI routes.
        batching: how ``/v1/completions`` requests that generate without
            beam search are batched: ``"continuous"`` (decode slots,
            :mod:`lmhead.serve.continuous`) or ``"window"`` (the batcher of
            :mod:`lmhead.serve.batching`, which every other request uses).
        slots: the continuous batcher's decode slots; None: the largest
            batch size.
        steps_per_call: its decoding steps per compiled call.
    """

    token: str | None = None
    max_body_bytes: int = 65536
    max_queue: int = 64
    window_s: float = 0.005
    timeout_s: float = 30.0
    limits: requests.Limits = requests.Limits()
    model_name: str = "lmhead"
    batching: str = "continuous"
    slots: int | None = None
    steps_per_call: int = continuous.DEFAULT_STEPS_PER_CALL

    def __post_init__(self):
        if self.batching not in BATCHING:
            raise ValueError(
                f"batching must be one of {BATCHING}; got {self.batching!r}."
            )


def read_token(path: str) -> str:
    """The token in ``path``, without surrounding whitespace."""
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"{path} holds no token.")
    return token


class Metrics:
    """The Prometheus metrics of one service, in a registry of their own."""

    def __init__(self, batch_sizes: tuple[int, ...]):
        import prometheus_client as prom

        self._prom = prom
        self.registry = prom.CollectorRegistry()
        prom.ProcessCollector(registry=self.registry)  # memory, CPU, open files
        self.requests = prom.Counter(
            "lmhead_requests",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = prom.Histogram(
            "lmhead_request_latency_seconds",
            "Time to answer a request.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = prom.Counter(
            "lmhead_generated_tokens",
            "Tokens returned by /v1/generate and /v1/completions.",
            registry=self.registry,
        )
        self.batch_rows = prom.Histogram(
            "lmhead_batch_rows",
            "Rows (prompts times sequences) per batch run.",
            ["kind"],
            buckets=batch_sizes,
            registry=self.registry,
        )
        self.queue_depth = prom.Gauge(
            "lmhead_queue_depth",
            "Requests waiting for a batch or for decode slots.",
            registry=self.registry,
        )
        self.active_slots = prom.Gauge(
            "lmhead_active_slots",
            "Decode slots holding a running sequence (continuous batching).",
            registry=self.registry,
        )
        self.cancelled = prom.Counter(
            "lmhead_cancelled_sequences",
            "Running sequences cancelled (client gone or timed out) that left "
            "their slots.",
            registry=self.registry,
        )
        self.first_token = prom.Histogram(
            "lmhead_time_to_first_token_seconds",
            "From a completion's arrival to its first tokens (continuous batching).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = prom.Histogram(
            "lmhead_inter_token_seconds",
            "Gap between deliveries of a completion's tokens, per token "
            "(continuous batching).",
            buckets=TOKEN_GAP_BUCKETS,
            registry=self.registry,
        )

    def text(self) -> bytes:
        return self._prom.generate_latest(self.registry)


def _error(
    status: int,
    field: str | None,
    message: str,
    headers: dict[str, str] | None = None,
    path: str = "",
):
    from fastapi import responses

    unknown_v1 = path.startswith("/v1/") and path not in ENDPOINTS
    if path in openai_web.ROUTES or unknown_v1:  # OpenAI's clients call /v1/...
        status = openai_web.openai_status(status)
        body = openai_web.error_body(status, field, message)
    else:
        body = {"error": {"field": field, "message": message}}
    return responses.JSONResponse(body, status_code=status, headers=headers)


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
            scope["path"],
        )

    async def _read_body(self, scope, receive):
        cap = self.config.max_body_bytes
        too_large = _error(
            413, "body", f"the body must be at most {cap} bytes.", path=scope["path"]
        )
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


def make_app(engine: batching.Engine, config: ServiceConfig = ServiceConfig()):
    """The service's ASGI app over ``engine`` (warmed up already): a
    :class:`batching.Batcher` and, with ``config.batching == "continuous"``,
    a :class:`continuous.SlotBatcher` (compiled here), which stop when the
    app shuts down."""
    import fastapi

    metrics = Metrics(engine.buckets.batch_sizes)
    batcher = batching.Batcher(
        engine,
        max_queue=config.max_queue,
        window_s=config.window_s,
        on_batch=lambda kind, rows: metrics.batch_rows.labels(kind).observe(rows),
    )
    slots = None
    if config.batching == "continuous":
        slots = continuous.SlotBatcher(
            engine,
            slots=config.slots,
            max_queue=config.max_queue,
            steps_per_call=config.steps_per_call,
            events=continuous.SlotEvents(
                first_token=metrics.first_token.observe,
                inter_token=metrics.inter_token.observe,
                cancelled=metrics.cancelled.inc,
            ),
        )
        slots.warm_up()
        metrics.active_slots.set_function(slots.active)
    depth = lambda: batcher.depth() + (slots.depth() if slots else 0)
    metrics.queue_depth.set_function(depth)

    def submit(request: Any):
        """Queues a checked request with the batcher that runs its kind."""
        in_slots = (
            slots is not None
            and isinstance(request, openai_api.CompletionRequest)
            and request.max_tokens > 0
            and request.num_beams == 1
        )
        return (slots if in_slots else batcher).submit(request)

    def cancel(future) -> None:
        """Drops a request nobody waits for: a waiting one leaves its queue,
        a running completion frees its slots (a no-op once it ended)."""
        batcher.cancel(future)
        if slots is not None:
            slots.cancel(future)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        batcher.stop()
        if slots is not None:
            slots.stop()

    app = fastapi.FastAPI(
        title="lmhead",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(_Guard, config=config, metrics=metrics)
    _add_error_handlers(app, config)

    async def run(request: Any) -> Any:
        future = submit(request)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), config.timeout_s)
        finally:
            cancel(future)

    @app.post("/v1/generate")
    async def generate(request: fastapi.Request):
        parsed = requests.parse_generate(
            await _json(request), engine.tokenizer, engine.buckets, config.limits
        )
        completions = await run(parsed)
        metrics.tokens.inc(sum(c["length"] for c in completions))
        return {"completions": completions}

    @app.post("/v1/score")
    async def score(request: fastapi.Request):
        parsed = requests.parse_score(
            await _json(request), engine.model.max_len, config.limits
        )
        return await run(parsed)

    openai_web.add_routes(
        app,
        engine,
        model_name=config.model_name,
        limits=config.limits,
        read_json=_json,
        submit=submit,
        cancel=cancel,
        run=run,
        on_tokens=metrics.tokens.inc,
        timeout_s=config.timeout_s,
    )

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "queue_depth": depth()}

    @app.get("/metrics")
    async def prometheus_metrics():
        return fastapi.Response(metrics.text(), media_type="text/plain; version=0.0.4")

    return app


def _add_error_handlers(app, config: ServiceConfig) -> None:
    """A bad field: 4xx naming it; an unknown route or method: 404 or 405;
    a full queue: 503; too late: 504; any other error: 500, all in the
    same error shape (the server logs a 500)."""
    from starlette import exceptions

    async def refuse_request(request, error: requests.RequestError):
        return _error(error.status, error.field, error.message, path=request.url.path)

    async def refuse_full(request, error: requests.QueueFull):
        return _error(
            503,
            None,
            f"the queue is full ({error}); retry later.",
            {"Retry-After": str(RETRY_AFTER_SECONDS)},
            request.url.path,
        )

    async def refuse_late(request, error: TimeoutError):
        return _error(
            504, None, f"no answer within {config.timeout_s} s.", path=request.url.path
        )

    async def refuse_route(request, error):
        # An unknown route or method, in the error shape of its path.
        message = f"Invalid URL ({request.method} {request.url.path}): {error.detail}."
        return _error(error.status_code, None, message, path=request.url.path)

    async def fail(request, error: Exception):
        return _error(500, None, f"the request failed: {error}", path=request.url.path)

    app.add_exception_handler(exceptions.HTTPException, refuse_route)
    app.add_exception_handler(requests.RequestError, refuse_request)
    app.add_exception_handler(requests.QueueFull, refuse_full)
    app.add_exception_handler(TimeoutError, refuse_late)
    app.add_exception_handler(Exception, fail)


async def _json(request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as error:  # not JSON, not UTF-8, or a 5000-digit number
        raise requests.RequestError(
            "body", f"the body is not JSON: {error}", status=400
        ) from None
    except RecursionError:
        raise requests.RequestError(
            "body", "the body nests too deeply.", status=400
        ) from None


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
