"""Tests for lmhead/serve/web.py (and experiments/serve.py's flags): the
HTTP service over real HTTP on 127.0.0.1, on the tiny run of conftest.py:
the guard (token, body cap), unreadable bodies, the full queue (503) and
the metrics. A timeout's 504 and load are tests/serve/test_continuous.py's.
"""

import concurrent.futures
import json
import threading

import pytest

from lmhead.serve import web
from tests import run_experiment
from tests.serve.gates import all_cancelled, gate_decoding, wait_until

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


COMPLETIONS = "/v1/completions"
BAD_RAW = [
    (COMPLETIONS, b'{"model": "lmhead", "prompt": "K', 400, "body"),
    (COMPLETIONS, b'{"model": "lmhead", "prompt": "K", "temperature": NaN}', 400, "temperature"),
    (COMPLETIONS, b"\xff\xfe", 400, "body"),
    (COMPLETIONS, b'{"model": "lmhead", "prompt": "\\ud800"}', 400, "prompt"),
    (COMPLETIONS, b"[" * 60_000, 400, "body"),
    (COMPLETIONS, b'{"seed": ' + b"9" * 5000 + b"}", 400, "body"),
    (COMPLETIONS, b'{"model": "lmhead", "prompt": "K", "max_tokens": 1e400}', 400, "max_tokens"),
    (COMPLETIONS, b"x" * 70_000, 413, "body"),
    ("/tokenize", b'{"prompt": 3}', 400, "prompt"),
    ("/detokenize", b'{"tokens": [-1]}', 400, "tokens"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,param", BAD_RAW)
def test_bad_request_names_the_param(url, path, body, status, param):
    response = httpx.post(
        url + path,
        content=body,
        timeout=60,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_a_form_encoded_body_is_read_as_json(url):
    # curl -d sends application/x-www-form-urlencoded; the docs' examples too.
    body = json.dumps({"model": MODEL, "prompt": "K", "max_tokens": 2})
    for content_type in ("application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        response = httpx.post(
            url + "/v1/completions", content=body, headers=headers, timeout=60
        )
        assert response.status_code == 200, response.text


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


def test_full_queue_answers_503(engine, monkeypatch):
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


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_and_health(url):
    names = (
        'lmhead_requests_total{endpoint="/v1/completions",status="200"}',
        'lmhead_request_latency_seconds_count{endpoint="/v1/completions"}',
        "lmhead_generated_tokens_total",
        "lmhead_time_to_first_token_seconds_count",
    )
    before = httpx.get(url + "/metrics").text
    body = {"prompt": ["K", "O"], "max_tokens": 3, "n": 2, "ignore_eos": True}
    answer = post(url, body)
    assert answer.json()["usage"]["completion_tokens"] == 2 * 2 * 3

    def deltas():
        text = httpx.get(url + "/metrics").text
        return [metric(text, name) - metric(before, name) for name in names]

    # The guard counts a request once its answer is sent: wait for it.
    wait_until(lambda: deltas() == [1, 1, 2 * 2 * 3, 1])
    text = httpx.get(url + "/metrics").text
    assert metric(text, "process_resident_memory_bytes") > 0
    assert "lmhead_queue_depth 0.0" in text
    assert httpx.get(url + "/healthz").json() == {"status": "ok", "queue_depth": 0}


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--host=0.0.0.0"],
            "not a loopback address: give a bearer token (--token_file)",
        ),
        (["--timeout_s=0"], "--timeout_s must be > 0."),
        # tmp_path holds no run: the flag is refused before anything loads.
        (
            ["--batch_sizes=1,4", "--slots=2"],
            "slots must be at least the largest batch size 4",
        ),
    ],
)
def test_serve_refuses_bad_flags_before_loading(tmp_path, flags, message):
    result = run_experiment("serve.py", f"--workdir={tmp_path}", *flags)
    assert result.returncode != 0 and message in result.stderr
