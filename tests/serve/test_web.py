"""Tests for lmhead/serve/web.py (and experiments/serve.py): the HTTP
service over real HTTP on 127.0.0.1, on the tiny run of conftest.py: the
guard (token, body cap), the refusals (503, 504), the metrics, and load.

References: ``decoding.generate`` on the same run (tiny_run.direct_greedy).
"""

import concurrent.futures
import json
import threading

import numpy as np
import pytest

from lmhead.serve import web
from tests import run_experiment
from tests.serve.gates import all_cancelled, gate_decoding, wait_until
from tests.serve.tiny_run import PROMPTS, direct_greedy, text_of

httpx = pytest.importorskip("httpx")  # the serve extra
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

TOKEN = "s3cret-token"
MODEL = "lmhead"


def start(engine, **config):
    return web.BackgroundServer(web.make_app(engine, web.ServiceConfig(**config)))


@pytest.fixture(scope="module")
def url(engine):
    with start(engine) as url:
        yield url


def post(url, body, **kwargs):
    return httpx.post(
        url + "/v1/completions", json={"model": MODEL, **body}, timeout=60, **kwargs
    )


BAD_RAW = [
    (b'{"model": "lmhead", "prompt": "K', 400, "body"),
    (b'{"model": "lmhead", "prompt": "K", "temperature": NaN}', 400, "temperature"),
    (b"\xff\xfe", 400, "body"),
    (b'{"model": "lmhead", "prompt": "\\ud800"}', 400, "prompt"),
    (b"[" * 60_000, 400, "body"),
    (b'{"seed": ' + b"9" * 5000 + b"}", 400, "body"),
    (b'{"model": "lmhead", "prompt": "K", "max_tokens": 1e400}', 400, "max_tokens"),
    (b"x" * 70_000, 413, "body"),
]


@pytest.mark.parametrize("body,status,param", BAD_RAW)
def test_bad_request_names_the_param(url, body, status, param):
    response = httpx.post(
        url + "/v1/completions",
        content=body,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_chunked_body_over_the_cap_gets_413(url):
    chunks = iter([b'{"prompt": "' + b"K" * 40_000, b"K" * 40_000 + b'"}'])
    response = httpx.post(url + "/v1/completions", content=chunks, timeout=60)
    assert response.status_code == 413
    assert response.json()["error"]["param"] == "body"


@pytest.mark.parametrize("size", [2**20, 5 * 2**20])
def test_python_clients_get_the_413_of_a_large_body(url, size):
    """The body is drained before the answer, so that a client still sending
    reads the 413 rather than a reset connection."""
    import urllib.error
    import urllib.request

    path = url + "/v1/completions"
    body = b'{"prompt": "' + b"x" * size + b'"}'
    request = urllib.request.Request(path, data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=60)
    assert answer.value.code == 413
    assert json.loads(answer.value.read())["error"]["param"] == "body"
    assert httpx.post(path, content=body, timeout=60).status_code == 413


def test_token_is_required_except_for_healthz(engine):
    with start(engine, token=TOKEN) as url:
        body = {"prompt": "K", "max_tokens": 1}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": TOKEN},
            {"Authorization": f"Basic {TOKEN}"},
        ):
            response = post(url, body, headers=headers)
            assert response.status_code == 401, headers
            assert response.headers["WWW-Authenticate"] == "Bearer"
            error = response.json()["error"]
            assert error["param"] == "Authorization"
            assert error["type"] == "authentication_error"
        assert httpx.get(url + "/metrics").status_code == 401
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert post(url, body, headers=good).status_code == 200
        assert httpx.get(url + "/metrics", headers=good).status_code == 200
        assert httpx.get(url + "/healthz").json()["status"] == "ok"


def test_full_queue_answers_503_and_late_requests_504(engine, monkeypatch):
    # No decoding call runs until the test releases it, a request is
    # cancelled, or the batcher stops: the first request holds every slot,
    # the second waits in the queue, and neither can finish first, however
    # fast the machine (and their timeout is not what ends them).
    released = threading.Event()
    gate_decoding(monkeypatch, lambda slots: released.is_set() or all_cancelled(slots))
    with start(engine, max_queue=1, timeout_s=3600) as url:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, url, {"prompt": "K", "n": 4})
            metrics = lambda: httpx.get(url + "/metrics").text
            wait_until(lambda: metric(metrics(), "lmhead_active_slots") == 4)
            second = pool.submit(post, url, {"prompt": "O"})
            wait_until(lambda: httpx.get(url + "/healthz").json()["queue_depth"] == 1)
            refused = post(url, {"prompt": "L"})
            assert refused.status_code == 503
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["type"] == "server_overloaded"
            released.set()
            assert first.result().status_code == 200
            assert second.result().status_code == 200
    released.clear()
    with start(engine, timeout_s=0.05) as url:
        late = post(url, {"prompt": "K"})
        assert late.status_code == 504, late.text
        assert late.json()["error"]["type"] == "timeout"


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def load(url, run, num_requests, num_clients):
    """``num_requests`` greedy requests from ``num_clients`` threads; each
    answer must match its own request (log-probs depend on the prompt)."""
    references = {p: direct_greedy(run, p, 8) for p in PROMPTS}
    bodies = [
        {
            "model": MODEL,
            "prompt": [PROMPTS[i % 8], PROMPTS[(i // 8) % 8]][: 1 + i % 2],
            "max_tokens": 1 + (i // 2) % 8,
            "temperature": 0,
            "n": 1 + (i // 3) % 2,
            "logprobs": 0,
        }
        for i in range(num_requests)
    ]
    before = httpx.get(url + "/metrics").text
    local = threading.local()

    def send(body):
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=120)
        return local.client.post(url + "/v1/completions", json=body)

    with concurrent.futures.ThreadPoolExecutor(num_clients) as pool:
        responses = list(pool.map(send, bodies))
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        n, m = body["n"], body["max_tokens"]
        assert [c["index"] for c in choices] == list(range(len(body["prompt"]) * n))
        for c in choices:
            tokens, log_probs = references[body["prompt"][c["index"] // n]]
            assert c["text"] == text_of(run, tokens[:m])
            np.testing.assert_allclose(
                c["logprobs"]["token_logprobs"], log_probs[:m], atol=1e-4
            )
    after = httpx.get(url + "/metrics").text
    ok = 'lmhead_requests_total{endpoint="/v1/completions",status="200"}'
    assert metric(after, ok) - metric(before, ok) == num_requests
    tokens = sum(len(b["prompt"]) * b["n"] * b["max_tokens"] for b in bodies)
    assert (
        metric(after, "lmhead_generated_tokens_total")
        - metric(before, "lmhead_generated_tokens_total")
    ) == tokens


def test_load_short(url, run):
    load(url, run, num_requests=32, num_clients=8)


@pytest.mark.slow
def test_load_300_requests_16_clients(url, run):
    load(url, run, num_requests=300, num_clients=16)


def test_metrics_and_health(url):
    assert post(url, {"prompt": "K", "max_tokens": 2}).status_code == 200
    text = httpx.get(url + "/metrics").text
    for name in (
        'lmhead_requests_total{endpoint="/v1/completions",status="200"}',
        'lmhead_request_latency_seconds_count{endpoint="/v1/completions"}',
        "lmhead_generated_tokens_total",
        "lmhead_time_to_first_token_seconds_count",
        "process_resident_memory_bytes",
    ):
        assert metric(text, name) > 0, name
    assert "lmhead_queue_depth 0.0" in text
    assert httpx.get(url + "/healthz").json() == {"status": "ok", "queue_depth": 0}


def test_serve_refuses_other_addresses_without_a_token(tmp_path):
    result = run_experiment(
        "serve.py",
        f"--workdir={tmp_path}",
        "--host=0.0.0.0",
    )
    assert result.returncode != 0
    assert "not a loopback address: give a bearer token (--token_file)" in result.stderr


def test_serve_refuses_a_timeout_of_zero(tmp_path):
    result = run_experiment("serve.py", f"--workdir={tmp_path}", "--timeout_s=0")
    assert result.returncode != 0
    assert "--timeout_s must be > 0." in result.stderr


def test_serve_refuses_fewer_slots_than_the_largest_batch_before_loading(tmp_path):
    # tmp_path holds no run: the flag is refused before anything loads.
    result = run_experiment(
        "serve.py", f"--workdir={tmp_path}", "--batch_sizes=1,4", "--slots=2"
    )
    assert result.returncode != 0
    assert "slots must be at least the largest batch size 4" in result.stderr
