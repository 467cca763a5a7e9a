"""Tests for continuous batching (lmhead/serve/continuous.py): the slot
batcher on its own, and the real uvicorn service with the ``openai`` client.

References: ``decoding.generate`` on the same run (greedy texts), the same
request alone in the slots (its answer does not depend on its company), and
the requests' own bookkeeping (every request answered once, every slot
freed). The answers themselves are checked against the decoders in
tests/serve/test_openai_api.py.
"""

import concurrent.futures
import json
import random
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import data
from lmhead.lm import model as model_lib
from lmhead.serve import continuous, requests, web
from lmhead.serve import engine as engine_lib
from tests.serve.gates import all_cancelled, gate_decoding, wait_until
from tests.serve.tiny_run import PROMPTS, reference, text_of

MODEL = "lmhead"
LONG = 128  # tokens of a request that runs long enough to be cut short


@pytest.fixture(scope="module")
def long_engine():
    """An untrained model with room for long completions, over a vocabulary
    smaller than the most log-probs a request may ask (no warm-up: the
    tests compile what they run)."""
    tokenizer = data.CharTokenizer("abcdeghot ")
    model = model_lib.DecoderLM(
        vocab_size=tokenizer.vocab_size, num_layers=1, num_heads=2, d_model=16,
        mlp_dim=32, max_len=LONG + 8,
    )  # fmt: skip
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))[
        "params"
    ]
    buckets = requests.Buckets(
        batch_sizes=(1, 4), prompt_lengths=(8,), new_tokens=(LONG,), beam_sizes=()
    )
    return engine_lib.Engine(model, params, tokenizer, buckets)


def parse(engine, **body):
    return requests.parse_completion(
        {"model": MODEL, **body}, engine.tokenizer, engine.buckets,
        requests.Limits(), MODEL, context=engine.model.max_len,
    )  # fmt: skip


def assert_same(got, want, path="result"):
    """Equal JSON values, floats (log-probs) to 1e-5: a batch of another
    shape rounds differently."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-5), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for j, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{path}[{j}]")
    else:
        assert got == want, path


def test_short_requests_pass_a_long_one_and_answers_equal_each_alone(
    long_engine, monkeypatch
):
    """Per-row stops, keys, lengths, penalties and log-probs: a request's
    choices do not depend on the requests decoding beside it."""
    # The long request decodes only while another request waits or runs (or
    # once released): the short ones take far fewer than its LONG steps, so
    # it cannot finish first, however fast the machine.
    released = threading.Event()
    long = parse(long_engine, prompt="the", max_tokens=LONG, temperature=0)
    gate_decoding(
        monkeypatch,
        lambda slots: (
            released.is_set()
            or slots._waiting
            or any(job.request is not long for job in slots._running())
        ),
    )
    slots = continuous.SlotBatcher(long_engine, max_queue=8, steps_per_call=1)
    try:
        short = [
            parse(long_engine, max_tokens=8, **body)
            for body in (
                {"prompt": "a", "temperature": 0, "stop": "e", "logprobs": 2},
                {"prompt": "be", "n": 2, "seed": 3, "presence_penalty": 0.5,
                 "logit_bias": {"1": 3}},
                {"prompt": "cat", "temperature": 0, "repetition_penalty": 3.0},
            )
        ]  # fmt: skip
        seeded = parse(long_engine, prompt="dog", max_tokens=6, n=2, seed=3)
        held = slots.submit(long)
        wait_until(lambda: slots.active() == 1)
        answers = [slots.submit(r) for r in [*short, seeded]]
        results = [a.result(timeout=60) for a in answers]
        assert not held.done()  # the short ones did not wait for it
        released.set()
        together = held.result(timeout=120)
        wait_until(lambda: slots.active() == 0)
        for request, result in zip([long, *short, seeded], [together, *results]):
            assert_same(result, slots.submit(request).result(timeout=120))
        plain = parse(long_engine, prompt="cat", max_tokens=8, temperature=0)
        plain = slots.submit(plain).result(timeout=120)
        # The penalty acts.
        assert plain["choices"][0]["text"] != results[2]["choices"][0]["text"]
    finally:
        slots.stop()


def test_cancel_frees_the_slots_of_a_running_request(long_engine, monkeypatch):
    gate_decoding(monkeypatch, all_cancelled)  # no request finishes by itself
    cancelled = []
    slots = continuous.SlotBatcher(
        long_engine, max_queue=8, steps_per_call=1,
        events=continuous.SlotEvents(cancelled=cancelled.append),
    )  # fmt: skip
    try:
        future = slots.submit(parse(long_engine, prompt="ab", max_tokens=LONG, n=3))
        wait_until(lambda: slots.active() == 3)
        slots.cancel(future)
        wait_until(lambda: slots.active() == 0)
        assert cancelled == [3]
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(timeout=10)
        # A waiting request leaves the queue without running.
        first = slots.submit(parse(long_engine, prompt="a", max_tokens=LONG, n=4))
        wait_until(lambda: slots.active() == 4)
        second = slots.submit(parse(long_engine, prompt="b", max_tokens=2))
        assert slots.depth() == 1
        slots.cancel(second)
        # At once, not when it would reach the head of the queue.
        assert second.cancelled() and slots.depth() == 0
        slots.cancel(first)
        wait_until(lambda: slots.active() == 0 and slots.depth() == 0)
    finally:
        slots.stop()


def test_stop_cancels_a_running_request_rather_than_leaving_it_waiting(
    long_engine, monkeypatch
):
    gate_decoding(monkeypatch, all_cancelled)  # no request finishes by itself
    slots = continuous.SlotBatcher(long_engine, max_queue=8, steps_per_call=1)
    try:
        running = slots.submit(parse(long_engine, prompt="ab", max_tokens=LONG, n=2))
        wait_until(lambda: slots.active() == 2)
        waiting = slots.submit(parse(long_engine, prompt="a", max_tokens=LONG, n=4))
    finally:
        slots.stop()
    for future in (running, waiting):
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(timeout=10)


def test_a_request_that_fails_fails_alone_and_frees_its_slots(long_engine, monkeypatch):
    """An error in one request's bookkeeping (here its echo's scores) answers
    that request with the error; the others are served, no slot is held."""
    slots = continuous.SlotBatcher(long_engine, max_queue=8, steps_per_call=1)
    scores = continuous.completions.echo_scores

    def echo_scores(engine, request):
        if request.prompt_texts == ["bad"]:
            raise RuntimeError("no scores")
        return scores(engine, request)

    monkeypatch.setattr(continuous.completions, "echo_scores", echo_scores)
    try:
        bad = slots.submit(parse(long_engine, prompt="bad", max_tokens=2))
        good = slots.submit(parse(long_engine, prompt="good", max_tokens=2))
        with pytest.raises(RuntimeError, match="no scores"):
            bad.result(timeout=60)
        assert good.result(timeout=60)["completion_tokens"] == 2
        wait_until(lambda: slots.active() == 0 and slots.depth() == 0)
    finally:
        slots.stop()


def test_echoed_top_logprobs_past_a_small_vocabulary_give_every_token(long_engine):
    """``logprobs`` 15 over 10 tokens: every token, as the completion's are."""
    vocab_size = long_engine.tokenizer.vocab_size
    assert vocab_size < 15 <= requests.MAX_LOGPROBS
    slots = continuous.SlotBatcher(long_engine, max_queue=2, steps_per_call=1)
    try:
        request = parse(long_engine, prompt="abc", max_tokens=3, echo=True, logprobs=15)
        result = slots.submit(request).result(timeout=60)
        logprobs = result["choices"][0]["logprobs"]
        assert logprobs["top_logprobs"][0] is None
        assert {len(top) for top in logprobs["top_logprobs"][1:]} == {vocab_size}
    finally:
        slots.stop()


def stop_reference(text, stops, min_tokens, include):
    """Brute force over a text of one character per token: the first token
    ``n >= min_tokens`` whose text ends with a stop string, and the text cut
    before that string (the longest ending there: the first to start), or
    through it; None when no token ends one."""
    for n in range(max(min_tokens, 1), len(text) + 1):
        ending = [s for s in stops if text[:n].endswith(s)]
        if ending:
            return n, text[:n] if include else text[: n - max(map(len, ending))]
    return None


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_stop_strings_end_rows_in_the_step_where_generate_ends_them(
    long_engine, steps_per_call
):
    """Sampled rows with stop strings split across tokens and across calls,
    with ``min_tokens`` and ``include_stop_str_in_output``, streamed: the
    tokens are ``decoding.generate``'s with the same stop strings (cut where
    it cuts), the text is cut where a brute-force search of the plain text
    says, the stream never sends text the stop removes, and a row's slot
    decodes no token past its stop."""
    engine, run = long_engine, (long_engine.model, long_engine.params,
                                long_engine.tokenizer)  # fmt: skip
    common = dict(prompt="the", max_tokens=24, temperature=1.0, seed=11)
    plain = continuous.SlotBatcher(engine, max_queue=8, steps_per_call=steps_per_call)
    try:
        text = plain.submit(parse(engine, **common)).result(timeout=60)
    finally:
        plain.stop()
    text = text["choices"][0]["text"]
    assert len(text) == 24 and len(set(text)) > 4, text
    cases = [  # (stop strings, min_tokens, include_stop_str_in_output)
        ([text[1:3]], 0, False),  # inside the first call when it has 3 steps
        ([text[2:5], "zzz"], 0, False),  # across the first two calls
        ([text[5:7], text[6:9]], 0, True),  # two ending together: the longer
        ([text[0:2]], 4, False),  # too early: a later one, or none
    ]
    keys = jax.random.wrap_key_data(
        jax.random.key_data(jax.random.fold_in(jax.random.key(11), 0))[None]
    )
    table = data.token_bytes(engine.tokenizer)
    slots = continuous.SlotBatcher(engine, max_queue=8, steps_per_call=steps_per_call)
    try:
        streamed, futures = [], []
        for stops, min_tokens, include in cases:
            request = parse(engine, **common, stop=stops, min_tokens=min_tokens,
                            include_stop_str_in_output=include)  # fmt: skip
            sent = []  # the text so far at each streamed chunk
            request.sink = lambda texts, sent=sent: sent.append(texts[0][1])
            streamed.append(sent)
            futures.append(slots.submit(request))
        results = [future.result(timeout=60)["choices"][0] for future in futures]
    finally:
        slots.stop()
    for (stops, min_tokens, include), choice, sent in zip(cases, results, streamed):
        found = stop_reference(text, stops, min_tokens, include)
        n, cut = (24, text) if found is None else found
        assert choice["text"] == cut, (stops, min_tokens)
        assert choice["finish_reason"] == ("length" if found is None else "stop")
        assert all(cut.startswith(piece) for piece in sent), (sent, cut)
        knobs = parse(engine, **common, min_tokens=min_tokens).knobs
        want = reference(run, "the", 24, keys=keys, knobs=knobs, top=0,
                         stop=decoding.StopStrings.build(stops, table))  # fmt: skip
        assert int(want.lengths[0]) == n
        assert text_of(run, want.tokens[0, :n]) == text[:n]
    assert any(stop_reference(text, *case) for case in cases)


def test_a_row_that_stops_frees_its_slot_at_the_stop(long_engine):
    """Four steps a call and a stop string that the second token completes:
    the slot decodes two tokens, not on to the end of the call or past the
    next one."""
    engine = long_engine
    common = dict(prompt="the", temperature=0)
    slots = continuous.SlotBatcher(engine, max_queue=8, steps_per_call=4)
    try:
        text = slots.submit(parse(engine, **common, max_tokens=4)).result(timeout=60)
        stop = text["choices"][0]["text"][:2]
        request = parse(engine, **common, max_tokens=LONG, stop=stop)
        result = slots.submit(request).result(timeout=60)
        wait_until(lambda: slots.active() == 0)
        generated = np.asarray(slots._state.rows.generated)
    finally:
        slots.stop()
    choice = result["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop")
    assert result["completion_tokens"] == 2
    assert generated[0] == 2  # the slot the request held


def test_slots_must_hold_a_whole_request(long_engine):
    with pytest.raises(ValueError, match="slots"):
        continuous.SlotBatcher(long_engine, slots=2, max_queue=1)


openai = pytest.importorskip("openai")  # the dev extra
httpx = pytest.importorskip("httpx")


def metric(url, name):
    text = httpx.get(url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_a_client_that_disconnects_mid_stream_frees_its_slot(long_engine, monkeypatch):
    # The first two decoding calls run (the first call's tokens are handed
    # over while the second runs); then the request waits until it is
    # cancelled, so it is still running when its client leaves.
    gate_decoding(monkeypatch, lambda slots: slots._calls < 2 or all_cancelled(slots))
    config = web.ServiceConfig(model_name=MODEL, steps_per_call=1)
    with web.BackgroundServer(web.make_app(long_engine, config)) as url:
        body = {"model": MODEL, "prompt": "the", "max_tokens": LONG, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the first chunk, then hang up
        wait_until(lambda: metric(url, "lmhead_active_slots") == 0)
        assert metric(url, "lmhead_cancelled_sequences_total") == 1
    # A request past its timeout is cancelled in the engine too; a stream
    # ends with the error in band. The request cannot finish before it is
    # cancelled, and its timeout starts once it runs (submit returns then).
    gate_decoding(monkeypatch, all_cancelled)
    submit = continuous.SlotBatcher.submit

    def submit_and_wait_until_running(self, request):
        future = submit(self, request)
        wait_until(lambda: future.running() or future.done())
        return future

    monkeypatch.setattr(continuous.SlotBatcher, "submit", submit_and_wait_until_running)
    late = web.ServiceConfig(model_name=MODEL, steps_per_call=1, timeout_s=0.05)
    with web.BackgroundServer(web.make_app(long_engine, late)) as url:
        body = {"model": MODEL, "prompt": "a", "max_tokens": LONG}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 504
        wait_until(lambda: metric(url, "lmhead_active_slots") == 0)
        assert metric(url, "lmhead_cancelled_sequences_total") == 1
        with httpx.stream(
            "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: ") :])["error"]["type"] == "timeout"
        wait_until(lambda: metric(url, "lmhead_active_slots") == 0)
        assert metric(url, "lmhead_cancelled_sequences_total") == 2


@pytest.mark.parametrize(
    "error,status,kind",
    [
        (requests.QueueFull("the queue is full."), 503, "server_overloaded"),
        (RuntimeError("a bug"), 500, "server_error"),
    ],
)
def test_a_request_that_cannot_be_queued_is_refused_before_it_starts(
    long_engine, monkeypatch, error, status, kind
):
    """Streamed too: the refusal comes before the response's first byte, in
    OpenAI's error shape."""

    def refuse(self, request):
        raise error

    monkeypatch.setattr(continuous.SlotBatcher, "submit", refuse)
    config = web.ServiceConfig(model_name=MODEL, steps_per_call=1)
    with web.BackgroundServer(web.make_app(long_engine, config)) as url:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
        for stream in (False, True):
            answer = httpx.post(
                url + "/v1/completions", json={**body, "stream": stream}, timeout=60
            )
            assert answer.status_code == status, (stream, answer.text)
            assert answer.json()["error"]["type"] == kind


@pytest.mark.parametrize("count", [32, pytest.param(300, marks=pytest.mark.slow)])
def test_load_nothing_lost_or_duplicated_and_the_slots_drain(run, engine, count):
    """``count`` requests from 16 clients: one or two prompts, mixed
    lengths, ``n``, stop strings, streams read whole or dropped early;
    greedy answers and their log-probs equal ``decoding.generate``'s."""
    config = web.ServiceConfig(model_name=MODEL, max_queue=count)
    references = {p: reference(run, p, 8, top=0) for p in PROMPTS}
    greedy = []
    with web.BackgroundServer(web.make_app(engine, config)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def one(i):
            rng = random.Random(i)
            body = dict(
                model=MODEL,
                prompt=rng.sample(PROMPTS, rng.choice([1, 2])),
                max_tokens=rng.randint(1, 8),
                n=rng.choice([1, 1, 2]),
                temperature=rng.choice([0.0, 1.0]),
                stop=rng.choice([None, ["e"]]),
            )
            rows = len(body["prompt"]) * body["n"]
            kind = rng.choice(["plain", "plain", "stream", "drop"])
            if kind == "plain":
                answer = client.completions.create(**body, logprobs=0)
                choices = [(c.text, c.logprobs.token_logprobs) for c in answer.choices]
                assert [c.index for c in answer.choices] == list(range(rows))
                assert {c.finish_reason for c in answer.choices} <= {"stop", "length"}
            else:
                stream = client.completions.create(**body, stream=True)
                pieces = {}
                for chunk in stream:
                    for c in chunk.choices:
                        pieces[c.index] = pieces.get(c.index, "") + c.text
                    if kind == "drop":
                        stream.close()
                        return i
                choices = [(pieces.get(j, ""), None) for j in range(rows)]
            if body["temperature"] == 0:
                greedy.append((body, choices))
            return i

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            assert list(pool.map(one, range(count))) == list(range(count))
        wait_until(lambda: metric(url, "lmhead_active_slots") == 0)
        assert metric(url, "lmhead_queue_depth") == 0
    assert len(greedy) > count // 8
    for body, choices in greedy:
        for index, (text, log_probs) in enumerate(choices):
            want = references[body["prompt"][index // body["n"]]]
            m = min(body["max_tokens"], int(want.lengths[0]))
            full = text_of(run, want.tokens[0, :m])
            assert text == decoding.trim_at_stop(full, body["stop"] or []), body
            if log_probs is not None and not body["stop"]:
                np.testing.assert_allclose(log_probs, want.log_probs[0, :m], atol=1e-4)
