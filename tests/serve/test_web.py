"""Tests for lmhead/serve/web.py (and experiments/serve.py): the HTTP
service over real HTTP on 127.0.0.1, on the tiny run of conftest.py.

References: the engine called directly on the same run (whose batches
tests/serve/test_batching.py compares with the decoders and the scorer).
"""

import concurrent.futures
import json
import threading
import time

import numpy as np
import pytest

from lmhead.serve import requests, web
from tests import run_experiment
from tests.serve.tiny_run import PROMPTS

httpx = pytest.importorskip("httpx")  # the serve extra
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

TOKEN = "s3cret-token"


def start(engine, **config):
    return web.BackgroundServer(web.make_app(engine, web.ServiceConfig(**config)))


@pytest.fixture(scope="module")
def url(engine):
    with start(engine) as url:
        yield url


def post(url, path, body, **kwargs):
    return httpx.post(url + path, json=body, timeout=60, **kwargs)


BAD_RAW = [
    ("/v1/generate", b'{"prompt": "K', 400, "body"),
    ("/v1/generate", b'{"prompt": "K", "temperature": NaN}', 422, "temperature"),
    ("/v1/generate", b"\xff\xfe", 400, "body"),
    ("/v1/generate", b'{"prompt": "\\ud800"}', 422, "prompt"),
    ("/v1/score", b'{"text": "ab\\ud800"}', 422, "text"),
    ("/v1/generate", b"[" * 60_000, 400, "body"),
    ("/v1/generate", b'{"seed": ' + b"9" * 5000 + b"}", 400, "body"),
    (
        "/v1/generate",
        b'{"prompt": "K", "max_new_tokens": 1e400}',
        422,
        "max_new_tokens",
    ),
    ("/v1/score", b"x" * 70_000, 413, "body"),
]


@pytest.mark.parametrize(
    "path,body,status,field",
    BAD_RAW,
)
def test_bad_request_names_the_field(url, path, body, status, field):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        url + path,
        content=content,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"]


def test_chunked_body_over_the_cap_gets_413(url):
    chunks = iter([b'{"prompt": "' + b"K" * 40_000, b"K" * 40_000 + b'"}'])
    response = httpx.post(url + "/v1/generate", content=chunks, timeout=60)
    assert response.status_code == 413
    assert response.json()["error"]["field"] == "body"


@pytest.mark.parametrize(
    "path,size", [("/v1/score", 2**20), ("/v1/generate", 5 * 2**20)]
)
def test_python_clients_get_the_413_of_a_large_body(url, path, size):
    """The body is drained before the answer, so that a client still sending
    reads the 413 rather than a reset connection."""
    import urllib.error
    import urllib.request

    body = b'{"text": "' + b"x" * size + b'"}'
    request = urllib.request.Request(url + path, data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=60)
    assert answer.value.code == 413
    assert json.loads(answer.value.read())["error"]["field"] == "body"
    response = httpx.post(url + path, content=body, timeout=60)
    assert response.status_code == 413


def test_token_is_required_except_for_healthz(engine):
    with start(engine, token=TOKEN) as url:
        body = {"prompt": "K", "max_new_tokens": 1}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": TOKEN},
            {"Authorization": f"Basic {TOKEN}"},
        ):
            response = post(url, "/v1/generate", body, headers=headers)
            assert response.status_code == 401, headers
            assert response.headers["WWW-Authenticate"] == "Bearer"
            assert response.json()["error"]["field"] == "Authorization"
        assert httpx.get(url + "/metrics").status_code == 401
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert post(url, "/v1/generate", body, headers=good).status_code == 200
        assert httpx.get(url + "/metrics", headers=good).status_code == 200
        assert httpx.get(url + "/healthz").json()["status"] == "ok"


def test_full_queue_answers_503_and_late_requests_504(engine):
    # A long batching window keeps the first request waiting in the queue.
    with start(engine, max_queue=1, window_s=1.0) as url:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, url, "/v1/generate", {"prompt": "K"})
            while httpx.get(url + "/healthz").json()["queue_depth"] < 1:
                time.sleep(0.01)
            refused = post(url, "/v1/generate", {"prompt": "O"})
            assert refused.status_code == 503
            assert refused.headers["Retry-After"] == "1"
            assert first.result().status_code == 200
    with start(engine, window_s=1.0, timeout_s=0.1) as url:
        late = post(url, "/v1/generate", {"prompt": "K"})
        assert late.status_code == 504 and "error" in late.json()


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def engine_greedy(engine, prompt):
    """Tokens and log-probs of ``prompt``'s 8 greedy tokens, alone in a batch
    (``test_greedy_equals_generate`` checks this path against ``generate``)."""
    request = requests.parse_generate(
        {"prompt": prompt, "temperature": 0, "logprobs": True},
        engine.tokenizer,
        engine.buckets,
        requests.Limits(),
    )
    completion = engine.sample([request])[0][0]
    return np.array(completion["token_ids"]), np.array(completion["log_probs"])


def load(url, engine, num_requests, num_clients):
    """``num_requests`` greedy requests from ``num_clients`` threads; each
    answer must match its own request (log-probs depend on the prompt)."""
    references = {p: engine_greedy(engine, p) for p in PROMPTS}
    bodies = [
        {
            "prompt": [PROMPTS[i % 8], PROMPTS[(i // 8) % 8]][: 1 + i % 2],
            "max_new_tokens": 1 + (i // 2) % 8,
            "temperature": 0,
            "num_return_sequences": 1 + (i // 3) % 2,
            "logprobs": True,
        }
        for i in range(num_requests)
    ]
    before = httpx.get(url + "/metrics").text
    local = threading.local()

    def send(body):
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=120)
        return local.client.post(url + "/v1/generate", json=body)

    with concurrent.futures.ThreadPoolExecutor(num_clients) as pool:
        responses = list(pool.map(send, bodies))
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        completions = response.json()["completions"]
        n, m = body["num_return_sequences"], body["max_new_tokens"]
        assert [c["prompt_index"] for c in completions] == [
            p for p in range(len(body["prompt"])) for _ in range(n)
        ]
        for c in completions:
            tokens, log_probs = references[body["prompt"][c["prompt_index"]]]
            assert c["length"] == m and c["token_ids"] == tokens[:m].tolist()
            np.testing.assert_allclose(c["log_probs"], log_probs[:m], atol=1e-4)
    after = httpx.get(url + "/metrics").text
    ok = 'lmhead_requests_total{endpoint="/v1/generate",status="200"}'
    assert metric(after, ok) - metric(before, ok) == num_requests
    tokens = sum(
        len(b["prompt"]) * b["num_return_sequences"] * b["max_new_tokens"]
        for b in bodies
    )
    assert (
        metric(after, "lmhead_generated_tokens_total")
        - metric(before, "lmhead_generated_tokens_total")
    ) == tokens
    batches = metric(after, 'lmhead_batch_rows_count{kind="sample"}') - metric(
        before, 'lmhead_batch_rows_count{kind="sample"}'
    )
    return batches


def test_load_short(url, engine):
    assert load(url, engine, num_requests=32, num_clients=8) <= 32


@pytest.mark.slow
def test_load_300_requests_16_clients(url, engine):
    batches = load(url, engine, num_requests=300, num_clients=16)
    assert batches < 300  # some requests shared a batch


def test_metrics_and_health(url):
    assert (
        post(url, "/v1/generate", {"prompt": "K", "max_new_tokens": 2}).status_code
        == 200
    )
    text = httpx.get(url + "/metrics").text
    for name in (
        'lmhead_requests_total{endpoint="/v1/generate",status="200"}',
        'lmhead_request_latency_seconds_count{endpoint="/v1/generate"}',
        "lmhead_generated_tokens_total",
        'lmhead_batch_rows_count{kind="sample"}',
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
