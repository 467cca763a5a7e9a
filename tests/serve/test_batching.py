"""Tests for lmhead/serve/batching.py: the engine's batches equal the
decoders and the scorer called directly on the same run."""

import threading
import types

import jax
import numpy as np
import pytest

from lmhead import decoding
from lmhead.decoding import SamplingKnobs
from lmhead.lm import model as model_lib
from lmhead.lm import scoring
from lmhead.serve import batching, requests
from tests.serve.tiny_run import BUCKETS, PROMPTS, direct_greedy


def parse(engine, body):
    return requests.parse_generate(
        body, engine.tokenizer, engine.buckets, requests.Limits()
    )


def sample(engine, body):
    """The completions of one sampled request, alone in its batch."""
    return engine.sample([parse(engine, body)])[0]


def test_greedy_equals_generate(run, engine):
    completions = sample(
        engine,
        {
            "prompt": PROMPTS[:3],
            "temperature": 0,
            "max_new_tokens": 6,
            "logprobs": True,
        },
    )
    assert [c["prompt_index"] for c in completions] == [0, 1, 2]
    for prompt, completion in zip(PROMPTS, completions):
        tokens, log_probs = direct_greedy(run, prompt, 6)
        assert completion["token_ids"] == tokens.tolist()
        assert completion["length"] == 6
        assert completion["text"] == run[2].decode(tokens)
        np.testing.assert_allclose(completion["log_probs"], log_probs, atol=1e-5)


def test_beam_equals_beam_search(run, engine):
    model, params, tokenizer = run
    completions = engine.beam(
        [
            parse(
                engine,
                {
                    "prompt": ["KING", "Lord"],
                    "num_beams": 2,
                    "num_return_sequences": 2,
                    "max_new_tokens": 8,
                },
            )
        ]
    )[0]
    assert [c["prompt_index"] for c in completions] == [0, 0, 1, 1]
    for p, prompt in enumerate(["KING", "Lord"]):
        logits, cache = model_lib.prefill(
            model, params, tokenizer.encode_array(prompt)[None]
        )
        tokens, scores, _, _ = decoding.beam_search(
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


def test_seed_is_reproducible_and_equals_generate(run, engine):
    model, params, tokenizer = run
    body = {
        "prompt": "KING",
        "temperature": 0.9,
        "top_k": 20,
        "seed": 7,
        "max_new_tokens": 8,
        "num_return_sequences": 4,
    }  # a whole bucket
    first, second = (sample(engine, body) for _ in range(2))
    assert first == second
    logits, cache = model_lib.prefill(
        model, params, tokenizer.encode_array("KING")[None]
    )
    tokens, *_ = decoding.generate(
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
    assert [c["token_ids"] for c in first] == tokens.tolist()


def test_score_equals_score_text(run, engine):
    text = "To be, or not to be, that is the question"  # longer than max_len: windows
    request = requests.parse_score(
        {"text": text, "stride": 4}, engine.model.max_len, requests.Limits()
    )
    got = engine.score(request)
    expected = scoring.score_text(*run, text, stride=4)
    np.testing.assert_allclose(got["log_probs"], expected.log_probs, atol=1e-5)
    assert got["token_texts"] == expected.token_texts
    summary = expected.summary()
    assert got["nats"] == pytest.approx(summary["nats"], rel=1e-5)
    assert got["bits_per_character"] == pytest.approx(
        summary["bits_per_character"], rel=1e-5
    )


def test_a_text_the_tokenizer_cannot_encode_is_refused_naming_the_text(engine):
    request = requests.parse_score({"text": "KING\u20ac"}, 16, requests.Limits())
    with pytest.raises(requests.RequestError) as raised:
        engine.score(request)
    assert raised.value.field == "text" and raised.value.message
    assert raised.value.status == 422


def test_requests_compile_nothing_after_warm_up(run):
    # An engine warmed up here, right before its requests: the session's
    # engine was warmed up long before, and in a process that has run many
    # other tests since, JAX's bounded caches may have let its programs go.
    engine = batching.Engine(*run, BUCKETS)
    engine.warm_up()
    compiles = []
    counting = threading.Event()
    # Compiles in this thread only, where the engine's calls run: the
    # listener is process-wide, and a thread another test left winding down
    # may compile its own programs meanwhile.
    here = threading.get_ident()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _seconds, **kw: (
            counting.is_set()
            and threading.get_ident() == here
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
            request = parse(engine, body)
            run = engine.beam if request.num_beams > 1 else engine.sample
            assert run([request])[0]
        score = {"text": "KING RICHARD " * 5}
        assert engine.score(
            requests.parse_score(score, engine.model.max_len, requests.Limits())
        )
    finally:
        counting.clear()
    assert compiles == []


def test_rows_of_different_repetition_penalties_equal_their_requests_alone(engine):
    bodies = [
        {"prompt": PROMPTS[0], "temperature": 0, "max_new_tokens": 8},
        {
            "prompt": PROMPTS[1],
            "temperature": 0,
            "max_new_tokens": 8,
            "repetition_penalty": 3.0,
        },
    ]
    together = engine.sample([parse(engine, body) for body in bodies])
    assert together == [sample(engine, body) for body in bodies]
    penalized = {**bodies[1], "repetition_penalty": 1.0}
    assert together[1] != sample(engine, penalized)  # the penalty acts


def request(**knobs):
    """A one-row sampling request with ``knobs``, built without an engine."""
    return requests.GenerateRequest(
        prompt_ids=[np.zeros([1], np.int32)],
        max_new_tokens=4,
        knobs=SamplingKnobs(**knobs),
        num_beams=1,
        num_return_sequences=1,
        seed=None,
        logprobs=False,
    )


def test_requests_share_a_batch_when_they_share_the_per_batch_knobs():
    """Per-row knobs may differ within a batch; the others split batches."""
    group = batching.group_of
    assert group(request(temperature=0.5, top_k=3)) == group(request(top_p=0.9))
    # The repetition penalty is per row; a static knob splits batches.
    penalized = request(repetition_penalty=1.3)
    assert group(penalized) == group(request(repetition_penalty=1.0))
    assert group(request(no_repeat_ngram_size=2)) != group(request())
    seeded = request()
    seeded.seed = 1
    assert group(seeded) != group(seeded)  # a seeded request runs alone


class _RecordingEngine:
    """An engine that records its batches: the queue's logic without a model."""

    buckets = types.SimpleNamespace(batch_sizes=(4,))

    def __init__(self):
        self.batches = []

    def sample(self, batch):
        self.batches.append(list(batch))
        return [[request] for request in batch]


def test_a_cancelled_waiting_request_leaves_the_queue_at_once():
    """It takes no place against ``max_queue`` and never reaches the engine."""
    engine = _RecordingEngine()
    batcher = batching.Batcher(engine, max_queue=1, window_s=0.2)
    try:
        first, second = request(), request()
        cancelled = batcher.submit(first)
        with pytest.raises(requests.QueueFull):
            batcher.submit(second)
        batcher.cancel(cancelled)
        assert cancelled.cancelled() and batcher.depth() == 0
        served = batcher.submit(second)
        assert served.result(timeout=10) == [second]
        assert engine.batches == [[second]]
        batcher.cancel(served)  # it ran: a no-op
        assert served.result() == [second] and not served.cancelled()
    finally:
        batcher.stop()
