"""The HTTP service, over real HTTP on 127.0.0.1, on a tiny run trained here.

References: the decoders and the scorer called directly on the same run.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from configs import default
from lmhead import decoding
from lmhead.lm import generation, scoring, train
from lmhead.lm import model as model_lib
from lmhead.serve import batching, requests, web
from tests import ROOT

httpx = pytest.importorskip("httpx")  # the serve extra
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

BUCKETS = requests.Buckets(
    batch_sizes=(1, 4), prompt_lengths=(8,), new_tokens=(8,), beam_sizes=(2,)
)
PROMPTS = ["KING", "What", "Lord", "ROMEO:", "To be", "O", "He", "And so"]
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """``(model, params, tokenizer)`` of a tiny run, 10 steps."""
    config = default.get_config("tiny")
    config.update_from_flattened_dict(
        {
            "data.path": corpus,
            "train.steps": 10,
            "train.eval_every": 10,
            "train.checkpoint_every": 10,
            "train.eval_batches": 1,
            "optim.warmup_steps": 2,
            "sample.num_samples": 0,
        }
    )
    workdir = str(tmp_path_factory.mktemp("serve") / "run")
    train.train_and_evaluate(config, workdir)
    _, tokenizer, model, params = generation.load_run(workdir)
    return model, params, tokenizer


@pytest.fixture(scope="module")
def engine(run):
    engine = batching.Engine(*run, BUCKETS)
    engine.warm_up()
    return engine


def start(engine, **config):
    return web.BackgroundServer(web.make_app(engine, web.ServiceConfig(**config)))


@pytest.fixture(scope="module")
def url(engine):
    with start(engine) as url:
        yield url


def post(url, path, body, **kwargs):
    return httpx.post(url + path, json=body, timeout=60, **kwargs)


def direct_greedy(run, prompt, max_new_tokens):
    model, params, tokenizer = run
    logits, cache = model_lib.prefill(
        model, params, tokenizer.encode_array(prompt)[None]
    )
    tokens, log_probs, _ = decoding.generate(
        model_lib.make_step_fn(model),
        params,
        logits,
        cache,
        key=jax.random.key(0),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
    )
    return np.asarray(tokens[0]), np.asarray(log_probs[0])


def test_greedy_equals_generate(run, url):
    response = post(
        url,
        "/v1/generate",
        {
            "prompt": PROMPTS[:3],
            "temperature": 0,
            "max_new_tokens": 6,
            "logprobs": True,
        },
    )
    assert response.status_code == 200, response.text
    completions = response.json()["completions"]
    assert [c["prompt_index"] for c in completions] == [0, 1, 2]
    for prompt, completion in zip(PROMPTS, completions):
        tokens, log_probs = direct_greedy(run, prompt, 6)
        assert completion["token_ids"] == tokens.tolist()
        assert completion["length"] == 6
        assert completion["text"] == run[2].decode(tokens)
        np.testing.assert_allclose(completion["log_probs"], log_probs, atol=1e-5)


def test_beam_equals_beam_search(run, url):
    model, params, tokenizer = run
    response = post(
        url,
        "/v1/generate",
        {
            "prompt": ["KING", "Lord"],
            "num_beams": 2,
            "num_return_sequences": 2,
            "max_new_tokens": 8,
        },
    )
    assert response.status_code == 200, response.text
    completions = response.json()["completions"]
    assert [c["prompt_index"] for c in completions] == [0, 0, 1, 1]
    for p, prompt in enumerate(["KING", "Lord"]):
        logits, cache = model_lib.prefill(
            model, params, tokenizer.encode_array(prompt)[None]
        )
        tokens, scores, _ = decoding.beam_search(
            model_lib.make_step_fn(model),
            params,
            logits,
            cache,
            num_beams=2,
            max_new_tokens=8,
            eos_id=None,
            num_return_sequences=2,
        )
        for k in range(2):
            assert completions[2 * p + k]["token_ids"] == tokens[0, k].tolist()
            assert completions[2 * p + k]["score"] == pytest.approx(
                float(scores[0, k]), abs=1e-4
            )


def test_seed_is_reproducible_and_equals_generate(run, url):
    model, params, tokenizer = run
    body = {
        "prompt": "KING",
        "temperature": 0.9,
        "top_k": 20,
        "seed": 7,
        "max_new_tokens": 8,
        "num_return_sequences": 4,
    }  # a whole bucket
    first, second = (post(url, "/v1/generate", body).json() for _ in range(2))
    assert first == second
    logits, cache = model_lib.prefill(
        model, params, tokenizer.encode_array("KING")[None]
    )
    tokens, _, _ = decoding.generate(
        model_lib.make_step_fn(model),
        params,
        logits,
        cache,
        key=jax.random.key(7),
        max_new_tokens=8,
        temperature=0.9,
        top_k=20,
        num_samples=4,
    )
    assert [c["token_ids"] for c in first["completions"]] == tokens.tolist()


def test_score_equals_score_text(run, url):
    text = "To be, or not to be, that is the question"  # longer than max_len: windows
    response = post(url, "/v1/score", {"text": text, "stride": 4})
    assert response.status_code == 200, response.text
    got = response.json()
    expected = scoring.score_text(*run, text, stride=4)
    np.testing.assert_allclose(got["log_probs"], expected.log_probs, atol=1e-5)
    assert got["token_texts"] == expected.token_texts
    summary = expected.summary()
    assert got["nats"] == pytest.approx(summary["nats"], rel=1e-5)
    assert got["bits_per_character"] == pytest.approx(
        summary["bits_per_character"], rel=1e-5
    )


def test_requests_compile_nothing_after_warm_up(url):
    compiles = []
    counting = threading.Event()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _seconds, **kw: (
            counting.is_set()
            and event == "/jax/core/compile/backend_compile_duration"
            and compiles.append(event)
        )
    )
    counting.set()
    try:
        for body in (
            {"prompt": "K", "max_new_tokens": 1},
            {
                "prompt": PROMPTS[:3],
                "max_new_tokens": 3,
                "top_p": 0.9,
                "min_p": 0.1,
                "repetition_penalty": 1.3,
                "logprobs": True,
            },
            {"prompt": "My lord", "num_beams": 2, "max_new_tokens": 8},
            {"prompt": "KING", "seed": 3, "num_return_sequences": 4},
        ):
            assert post(url, "/v1/generate", body).status_code == 200
        assert post(url, "/v1/score", {"text": "KING RICHARD " * 5}).status_code == 200
    finally:
        counting.clear()
    assert compiles == []


BAD_GENERATE = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": "x" * 9}, "prompt"),
    ({"prompt": "KING\u20ac"}, "prompt"),
    ({"prompt": "K", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "K", "max_new_tokens": 9}, "max_new_tokens"),
    ({"prompt": "K", "max_new_tokens": "5"}, "max_new_tokens"),
    ({"prompt": "K", "max_new_tokens": 2.5}, "max_new_tokens"),
    ({"prompt": "K", "temperature": -1}, "temperature"),
    ({"prompt": "K", "temperature": "hot"}, "temperature"),
    ({"prompt": "K", "temperature": True}, "temperature"),
    ({"prompt": "K", "top_k": -1}, "top_k"),
    ({"prompt": "K", "top_k": 1.5}, "top_k"),
    ({"prompt": "K", "top_p": 0}, "top_p"),
    ({"prompt": "K", "top_p": 1.5}, "top_p"),
    ({"prompt": "K", "min_p": 2}, "min_p"),
    ({"prompt": "K", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "K", "num_beams": 0}, "num_beams"),
    ({"prompt": "K", "num_beams": 3}, "num_beams"),
    ({"prompt": "K", "num_beams": 2, "temperature": 0.5}, "temperature"),
    ({"prompt": "K", "num_beams": 2, "seed": 1}, "seed"),
    ({"prompt": "K", "num_beams": 2, "logprobs": True}, "logprobs"),
    ({"prompt": "K", "num_beams": 2, "max_new_tokens": 5}, "max_new_tokens"),
    (
        {"prompt": "K", "num_beams": 2, "num_return_sequences": 3},
        "num_return_sequences",
    ),
    ({"prompt": ["K"] * 5, "num_beams": 2}, "prompt"),
    ({"prompt": "K", "num_return_sequences": 5}, "num_return_sequences"),
    ({"prompt": ["K", "O"], "num_return_sequences": 3}, "num_return_sequences"),
    ({"prompt": "K", "seed": -1}, "seed"),
    ({"prompt": "K", "seed": 2**40}, "seed"),
    ({"prompt": "K", "logprobs": "yes"}, "logprobs"),
    ({"prompt": "K", "stream": True}, "stream"),
    ([{"prompt": "K"}], "body"),
]
BAD_SCORE = [
    ({"text": ""}, "text"),
    ({"text": "a" * 4097}, "text"),
    ({"text": 5}, "text"),
    ({"text": "KING\u20ac"}, "text"),
    ({"text": "KING", "stride": 0}, "stride"),
    ({"text": "KING", "stride": 17}, "stride"),
    ({"txt": "KING"}, "txt"),
]
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
    [("/v1/generate", body, 422, field) for body, field in BAD_GENERATE]
    + [("/v1/score", body, 422, field) for body, field in BAD_SCORE]
    + [(path, body, status, field) for path, body, status, field in BAD_RAW],
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
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "experiments", "serve.py"),
            f"--workdir={tmp_path}",
            "--host=0.0.0.0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "not a loopback address: give a bearer token (--token_file)" in result.stderr
