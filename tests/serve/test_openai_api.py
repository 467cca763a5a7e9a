"""Tests for the completions API (lmhead/serve/requests.py, completions.py,
engine.py, web.py): the official ``openai`` client against the real uvicorn
server on the tiny run of conftest.py.

References: ``lmhead.decoding.generate`` on the same run, one prompt at a
time, the scorer (``lmhead.lm.scoring.score_text``), and a numpy
``log_softmax`` of the model's logits.
"""

import json

import jax
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import inference, scoring
from lmhead.serve import completions, requests, web
from tests.serve.tiny_run import (
    PROMPTS,
    eos_id,
    greedy_tokens,
    numpy_log_softmax,
    reference,
    text_of,
)

openai = pytest.importorskip("openai")  # the dev extra
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "lmhead"


@pytest.fixture(scope="module")
def url(engine):
    app = web.make_app(engine, web.ServiceConfig(model_name=MODEL))
    with web.BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def top_map(tokenizer, tokens, values):
    return {tokenizer.decode([int(t)]): float(v) for t, v in zip(tokens, values)}


def assert_top_equal(got, want):
    assert list(got) == list(want)
    np.testing.assert_allclose(list(got.values()), list(want.values()), atol=1e-5)


def test_greedy_with_logprobs_equals_generate(run, client):
    tokenizer = run[2]
    answer = client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=0, logprobs=5
    )
    assert answer.object == "text_completion" and answer.model == MODEL
    assert [c.index for c in answer.choices] == [0, 1]
    for prompt, choice in zip(PROMPTS, answer.choices):
        want = reference(run, prompt, 6)
        assert want.lengths[0] == 6  # no EOS: every token below is compared
        assert choice.text == text_of(run, want.tokens[0])
        assert choice.finish_reason == "length"
        got = choice.logprobs
        assert got.tokens == [tokenizer.decode([int(t)]) for t in want.tokens[0]]
        np.testing.assert_allclose(got.token_logprobs, want.log_probs[0], atol=1e-5)
        for j, top in enumerate(got.top_logprobs):
            assert_top_equal(
                top,
                top_map(tokenizer, want.top_tokens[0, j], want.top_log_probs[0, j]),
            )
        assert got.text_offset == list(len(prompt) + np.arange(6))
    assert answer.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    assert answer.usage.completion_tokens == 12 and answer.usage.total_tokens == 12 + 8


@pytest.mark.parametrize("stop", [None, (3, 6), (1, 7)])
def test_stream_equals_one_answer(run, client, stop):
    """Also with a stop string, one longer than the text of the first
    chunks: the stream sends no text the stop removes."""
    full = text_of(run, reference(run, "Lord", 8).tokens[0])
    stop = stop and full[slice(*stop)]
    body = dict(model=MODEL, prompt=["KING", "Lord"], max_tokens=8, temperature=0,
                stop=stop)  # fmt: skip
    whole = client.completions.create(**body)
    chunks = list(
        client.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
    )
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    if stop is None:
        assert len(chunks) > 3  # text came in more than one delta per choice
        assert reasons == {0: "length", 1: "length"}
    else:
        assert texts[1] == decoding.trim_at_stop(full, stop) and reasons[1] == "stop"


def test_sampled_n_with_seed_equals_generate_with_row_keys(run, engine, client):
    body = {"model": MODEL, "prompt": "To be", "max_tokens": 8, "n": 3, "seed": 7}
    answer = client.completions.create(**body, temperature=1.0, extra_body={"top_k": 0})
    again = client.completions.create(**body)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]
    parsed = requests.parse_completion(
        dict(body, temperature=1.0),
        engine.tokenizer,
        engine.buckets,
        requests.Limits(),
        MODEL,
    )
    keys = jax.random.wrap_key_data(
        np.stack(
            [
                jax.random.key_data(jax.random.fold_in(jax.random.key(7), s))
                for s in range(3)
            ]
        )
    )
    want = reference(
        run,
        "To be",
        8,
        keys=keys,
        knobs=parsed.knobs,
        top=0,
    )
    assert [c.text for c in answer.choices] == [
        text_of(run, t[:n]) for t, n in zip(want.tokens, want.lengths)
    ]


def test_echo_with_zero_tokens_gives_the_scorer_log_probs(run, client):
    model, params, tokenizer = run
    text = "ROMEO: O"
    answer = client.completions.create(
        model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=5
    )
    choice = answer.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    got = choice.logprobs
    score = scoring.score_text(model, params, tokenizer, text)
    assert got.tokens == list(text) and got.token_logprobs[0] is None
    assert got.top_logprobs[0] is None and got.text_offset == list(range(len(text)))
    np.testing.assert_allclose(got.token_logprobs[1:], score.log_probs, atol=1e-5)
    ids = tokenizer.encode_array(text)
    full = numpy_log_softmax(run, ids)
    for j in range(1, len(ids)):
        order = np.argsort(-full[j - 1], kind="stable")[:5]
        assert_top_equal(
            got.top_logprobs[j],
            {tokenizer.decode([int(t)]): full[j - 1, t] for t in order},
        )
    assert answer.usage.completion_tokens == 0


def test_models_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


# (the param a 400 names, the fields set on {"model", "prompt": "K"}; None
# leaves a field out); an unknown model is a 404, a body that is no object
# names "body".
BAD = [
    ("model", {"model": None}),
    ("prompt", {"prompt": None}),
    ("prompt", {"prompt": ""}),
    ("prompt", {"prompt": [[0, -1]]}),
    ("prompt", {"prompt": [[10**6]]}),
    ("prompt", {"prompt": [[10**30]]}),  # past int64
    ("prompt", {"prompt": [[0], "K", 3]}),
    ("prompt", {"prompt": [[1], []]}),
    ("prompt", {"prompt": "KING\u20ac"}),  # not encodable
    ("prompt", {"prompt": "K" * 17}),  # past the context
    ("prompt", {"prompt": [[1] * 17], "echo": True, "max_tokens": 0}),
    ("prompt", {"prompt": "K" * 9, "max_tokens": 8}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -1}),
    ("temperature", {"temperature": 2.01}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": 10**400}),
    ("top_p", {"top_p": 0}),
    ("top_k", {"top_k": -2}),  # -1 is vLLM's "off"
    ("min_p", {"min_p": 1.01}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("presence_penalty", {"presence_penalty": 2.01}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("n", {"n": 0}),
    ("n", {"prompt": ["K", "O"], "n": 3}),
    ("stream", {"stream": "yes"}),
    ("stream_options", {"stream_options": {"include_usage": True}}),
    ("logprobs", {"logprobs": 21}),
    ("logprobs", {"logprobs": True}),
    ("echo", {"echo": 1}),
    ("stop", {"stop": ["a"] * 17}),
    ("stop", {"stop": ["a" * 65]}),
    ("stop", {"stop": [""]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": 3}),
    ("ignore_eos", {"ignore_eos": 1}),
    ("min_tokens", {"max_tokens": 4, "min_tokens": 5}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": "y"}),
    ("logit_bias", {"logit_bias": {"0": 101}}),
    ("logit_bias", {"logit_bias": {"x": 1}}),
    ("logit_bias", {"logit_bias": {"99999": 1}}),
    ("logit_bias", {"logit_bias": [1]}),
    ("seed", {"seed": "7"}),
    ("user", {"user": 3}),
    ("num_beams", {"num_beams": 3}),
    ("logprobs", {"num_beams": 2, "logprobs": 1}),
    ("suffix", {"suffix": "x"}),
    ("best_of", {"best_of": 2}),
    ("functions", {"functions": []}),
    ("model", {"model": "gpt-4"}),
    ("body", [1, 2]),
]


@pytest.mark.parametrize("param,fields", BAD)
def test_bad_request_names_the_param(url, param, fields):
    body, status = fields, 404 if fields == {"model": "gpt-4"} else 400
    if isinstance(fields, dict):
        given = {"model": MODEL, "prompt": "K", **fields}
        body = {k: v for k, v in given.items() if v is not None}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    # OpenAI's shape: every 4xx of a bad request is an invalid_request_error,
    # an unknown model's carries the code model_not_found.
    assert error["type"] == "invalid_request_error"
    assert error["code"] == ("model_not_found" if status == 404 else None)


def test_the_client_raises_on_a_bad_request_and_an_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="K", presence_penalty=3)
    assert caught.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="K")
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/v1/completions", 405),
        ("GET", "/nowhere", 404),
        ("POST", "/v1/generate", 404),  # the old API is gone
    ],
)
def test_an_unknown_route_answers_in_openais_error_shape(url, method, path, status):
    response = httpx.request(method, url + path, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert path in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] is None


def test_penalties_and_bias_are_served(run, client):
    tokenizer = run[2]
    greedy = client.completions.create(model=MODEL, prompt="KING", max_tokens=4,
                                       temperature=0)  # fmt: skip
    first = tokenizer.encode_array(greedy.choices[0].text[0])[0]
    biased = client.completions.create(
        model=MODEL, prompt="KING", max_tokens=4, temperature=0,
        logit_bias={str(first): -100}, presence_penalty=1.0, frequency_penalty=0.5,
    )  # fmt: skip
    text = biased.choices[0].text
    assert len(text) == 4 and tokenizer.decode([int(first)]) not in text
    assert json.loads(biased.model_dump_json())["usage"]["completion_tokens"] == 4


def test_running_text_holds_back_what_may_start_a_stop_string(engine):
    """While a row runs, the last ``len(longest stop) - 1`` characters are
    held back; a text shorter than that sends nothing."""
    stop = "LMNOPQ"
    request = requests.parse_completion(
        {"model": MODEL, "prompt": "K", "stop": [stop, "Z"]},
        engine.tokenizer, engine.buckets, requests.Limits(), MODEL,
    )  # fmt: skip
    for text in ("AB", "ABCD", "ABCDEFGH"):
        ids = engine.tokenizer.encode_array(text)
        running = completions.completion_text(engine, request, ids, done=False)
        assert running == text[: max(len(text) - (len(stop) - 1), 0)]
        assert completions.completion_text(engine, request, ids, done=True) == text


def test_beam_extension_equals_beam_search(run, client):
    model, params, tokenizer = run
    answer = client.completions.create(
        model=MODEL, prompt="KING", max_tokens=8, n=2, echo=True,
        extra_body={"num_beams": 2},
    )  # fmt: skip
    logits, cache = inference.prefill(
        model, params, tokenizer.encode_array("KING")[None]
    )
    tokens, _, lengths, _ = decoding.beam_search(
        inference.make_step_fn(model), params, logits, cache, num_beams=2,
        max_new_tokens=8, eos_id=eos_id(run), num_return_sequences=2,
    )  # fmt: skip
    assert [c.text for c in answer.choices] == [
        "KING" + text_of(run, tokens[0, k, : lengths[0, k]]) for k in range(2)
    ]
    assert answer.usage.completion_tokens == int(lengths.sum())


def test_stop_token_ids_and_min_tokens_are_vllms(run, client):
    """A stop id ends the choice and stays in it (vLLM's rule for a token
    that is not special); with ``min_tokens`` it cannot come before."""
    tokenizer, vocab = run[2], run[2].vocab_size
    plain = greedy_tokens(run, "Lord", 8)
    stop = plain[2]
    body = dict(model=MODEL, prompt="Lord", max_tokens=8, temperature=0, logprobs=0)
    answer = client.completions.create(**body, extra_body={"stop_token_ids": [stop]})
    choice = answer.choices[0]
    want = plain[: plain.index(stop) + 1]
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in want]
    assert choice.finish_reason == "stop" and choice.text == text_of(run, want)
    late = client.completions.create(
        **body, extra_body={"stop_token_ids": [stop], "min_tokens": 5}
    ).choices[0]
    mask = decoding.stop_token_mask(
        [stop] + [eos_id(run)] * (eos_id(run) is not None), vocab
    )
    want = greedy_tokens(run, "Lord", 8, stop_tokens=mask, min_new_tokens=5)
    assert late.logprobs.tokens == [tokenizer.decode([t]) for t in want]
    assert tokenizer.decode([stop]) not in late.logprobs.tokens[:5]


def test_sixteen_stops_up_to_64_characters_and_the_stop_kept(run, client):
    full = text_of(run, greedy_tokens(run, "Lord", 8))
    stops = [full[3:5]] + [f"{i:02d}" + "x" * 62 for i in range(15)]
    body = dict(model=MODEL, prompt="Lord", max_tokens=8, temperature=0, stop=stops)
    cut = client.completions.create(**body).choices[0]
    assert (
        cut.text == decoding.trim_at_stop(full, stops) and cut.finish_reason == "stop"
    )
    kept = client.completions.create(
        **body, extra_body={"include_stop_str_in_output": True}
    ).choices[0]
    assert kept.text == cut.text + full[3:5]


def test_eos_ends_a_choice_unless_ignore_eos(run, client):
    """EOS, made certain by a bias, ends the choice at once; ``ignore_eos``
    decodes on to ``max_tokens``."""
    eos = eos_id(run)
    assert eos is not None
    body = dict(model=MODEL, prompt="Lord", max_tokens=5, temperature=0,
                logit_bias={str(eos): 100})  # fmt: skip
    ended = client.completions.create(**body)
    assert ended.choices[0].text == "" and ended.choices[0].finish_reason == "stop"
    assert ended.usage.completion_tokens == 1
    on = client.completions.create(**body, extra_body={"ignore_eos": True})
    assert on.choices[0].finish_reason == "length"
    assert on.usage.completion_tokens == 5
