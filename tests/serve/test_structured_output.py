"""Structured output through the service (lmhead/serve/protocol.py,
requests.py): the ``openai`` client with ``response_format`` ``json_schema``
on chat and ``extra_body`` ``structured_outputs`` on completions, each choice
valid and streamed equal to not streamed; vLLM's ``guided_*`` fields; every
bad constraint a 400 naming its field; vLLM's ``stop_reason`` and
``prompt_logprobs``; and ``/openapi.json``. On a random model of a 64-token
context (conftest.py's ``wide_engine``)."""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import lark
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import constraints, inference
from lmhead.serve import web
from tests import references

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "lmhead"
SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["merry", "sad"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["mood", "n", "ok"],
    "additionalProperties": False,
}
GRAMMAR = 'start: "(" NUMBER ("+" NUMBER)* ")"\nNUMBER: /[1-9]/'


@pytest.fixture(scope="module")
def url(wide_engine):
    app = web.make_app(wide_engine, web.ServiceConfig(model_name=MODEL))
    with web.BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def post(url, route, body):
    return httpx.post(url + route, json={"model": MODEL, **body}, timeout=120)


def test_completions_structured_outputs_json_valid_and_streamed_equal(client):
    settings = dict(
        model=MODEL, prompt="Q:", max_tokens=48, n=4, temperature=1.0, seed=5,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )  # fmt: skip
    whole = client.completions.create(**settings)
    assert len(whole.choices) == 4
    for choice in whole.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    texts = {}
    for chunk in client.completions.create(stream=True, **settings):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]


def test_chat_response_format_json_schema_valid_and_streamed_equal(client):
    settings = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi?"}],
        max_completion_tokens=40,
        n=3,
        seed=11,
        temperature=1.0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "mood", "schema": SCHEMA, "strict": True},
        },
    )
    whole = client.chat.completions.create(**settings)
    for choice in whole.choices:
        assert choice.message.role == "assistant" and choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    texts, roles = {}, {}
    for chunk in client.chat.completions.create(stream=True, **settings):
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)
            texts[choice.index] = texts.get(choice.index, "") + (
                choice.delta.content or ""
            )
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert set(roles.values()) == {"assistant"}  # the first delta names it


@pytest.mark.parametrize(
    "fields, valid",
    [
        ({"guided_regex": "[a-z]{2,6}-[0-9]{2}"},
         lambda t: re.fullmatch("[a-z]{2,6}-[0-9]{2}", t)),
        ({"guided_choice": ["aye", "nay", "perchance"]},
         lambda t: t in ("aye", "nay", "perchance")),
        ({"guided_grammar": GRAMMAR}, lambda t: lark.Lark(GRAMMAR).parse(t)),
        ({"guided_json": json.dumps(SCHEMA)},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"json_object": True}},
         lambda t: isinstance(json.loads(t), dict)),
        ({"structured_outputs": {"regex": "(to|not) be"}},
         lambda t: t in ("to be", "not be")),
    ],
)  # fmt: skip
def test_each_structured_field_constrains_every_choice(url, fields, valid):
    response = post(url, "/v1/completions", {
        "prompt": "A:", "max_tokens": 40, "n": 4, "temperature": 1.0, "seed": 3,
        "top_k": 8, **fields,
    })  # fmt: skip
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        if choice["finish_reason"] == "stop":
            assert valid(choice["text"]), choice["text"]
        else:  # json_object may run to the length: a prefix, cut
            assert "json_object" in str(fields)


def test_greedy_under_a_constraint_is_the_librarys(wide_engine, url):
    model, params, tokenizer = (
        wide_engine.model,
        wide_engine.params,
        wide_engine.tokenizer,
    )
    response = post(url, "/v1/completions", {
        "prompt": "Q:", "max_tokens": 40, "temperature": 0, "logprobs": 1,
        "guided_json": SCHEMA,
    })  # fmt: skip
    choice = response.json()["choices"][0]
    ids = tokenizer.encode_array("Q:")
    logits, cache = inference.prefill(model, params, ids[None])
    masker = constraints.masker_for(tokenizer)
    row = constraints.row_constraint(
        masker, [constraints.Constraint.json_schema(SCHEMA)]
    )
    want = decoding.generate(
        inference.make_step_fn(model), params, logits, cache, key=jax.random.key(0),
        max_new_tokens=40, temperature=0.0, eos_id=tokenizer.eos_id, constraint=row,
        log_probs_from="model",
    )  # fmt: skip
    length = int(want.lengths[0])
    assert want.finish_reasons[0] == decoding.FINISHED_EOS
    assert choice["text"] == tokenizer.decode(want.tokens[0, : length - 1])
    np.testing.assert_allclose(
        choice["logprobs"]["token_logprobs"], want.log_probs[0, :length], atol=1e-5
    )


# (the field a 400 names, the fields added to a completion or a chat body)
BAD = [
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nothing"}}}}),  # an invalid schema
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "unheard-of"}}}}),
    ("response_format", {"response_format": {"type": "yaml"}}),  # no such type
    ("response_format", {"response_format": {"type": "json_schema"}}),
    ("guided_regex", {"guided_regex": "[a-"}),
    ("structured_outputs", {"structured_outputs": {"grammar": "start: missing"}}),
    ("guided_grammar", {"guided_grammar": "start ::= "}),
    ("guided_choice", {"guided_choice": []}),
    ("structured_outputs", {"structured_outputs": {"choice": []}}),
    ("guided_json", {"guided_json": "{not json"}),
    ("structured_outputs", {"structured_outputs": {}}),
    ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
    ("guided_regex", {"guided_json": SCHEMA, "guided_regex": "a"}),
    ("ignore_eos", {"guided_regex": "a+", "ignore_eos": True}),
    ("messages", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("messages", {"messages": []}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("top_logprobs", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),
    ("max_completion_tokens", {"messages": [{"role": "user", "content": "hi"}],
                               "max_completion_tokens": 0}),
    ("messages", {"messages": [{"role": "user", "content": "hi" * 40}]}),
    ("prompt_logprobs", {"prompt_logprobs": 21}),
]  # fmt: skip


@pytest.mark.parametrize("param, fields", BAD)
def test_bad_input_is_a_400_naming_the_field(url, param, fields):
    chat = "messages" in fields or "response_format" in fields
    base = (
        {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "K"}
    )
    response = post(url, "/v1/chat/completions" if chat else "/v1/completions",
                    {**base, **fields})  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_stop_reason_names_the_stop_string_or_token(wide_engine, url):
    tokenizer = wide_engine.tokenizer
    body = {"prompt": "Q:", "max_tokens": 12, "temperature": 0}
    free = post(url, "/v1/completions", body).json()["choices"][0]
    text = free["text"]
    assert free["stop_reason"] is None
    stop = text[3:5]
    stopped = post(url, "/v1/completions", {**body, "stop": ["@@", stop]}).json()
    assert stopped["choices"][0]["stop_reason"] == stop
    token = tokenizer.encode(text[2])[0]
    by_id = post(url, "/v1/completions", {**body, "stop_token_ids": [token]}).json()
    assert by_id["choices"][0]["stop_reason"] == token
    assert by_id["choices"][0]["finish_reason"] == "stop"
    chosen = post(url, "/v1/completions", {**body, "guided_choice": ["ay"]}).json()
    assert chosen["choices"][0]["stop_reason"] is None  # the end-of-text token


def test_prompt_logprobs_are_vllms_and_the_models(wide_engine, url):
    model, params, tokenizer = (
        wide_engine.model,
        wide_engine.params,
        wide_engine.tokenizer,
    )
    response = post(url, "/v1/completions", {
        "prompt": "To be, or", "max_tokens": 1, "prompt_logprobs": 3,
    })  # fmt: skip
    got = response.json()["choices"][0]["prompt_logprobs"]
    ids = tokenizer.encode("To be, or")
    want = references.log_softmax(
        jax.jit(model.apply)({"params": params}, jnp.asarray([ids]))[0]
    )
    assert got[0] is None and len(got) == len(ids)
    for j, entry in enumerate(got[1:]):
        token = ids[j + 1]
        order = np.argsort(-want[j], kind="stable")
        assert str(token) in entry and len(entry) in (3, 4)
        assert entry[str(token)]["rank"] == 1 + int(np.sum(want[j] > want[j, token]))
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        for rank, top in enumerate(order[:3]):
            assert entry[str(top)]["rank"] == rank + 1 or top == token
            np.testing.assert_allclose(
                entry[str(top)]["logprob"], want[j, top], atol=1e-4
            )


def test_openapi_describes_every_field_with_its_limits(url):
    spec = httpx.get(url + "/openapi.json", timeout=60).json()
    schemas = spec["components"]["schemas"]
    completion = schemas["CompletionBody"]["properties"]
    chat = schemas["ChatBody"]["properties"]
    assert {
        "prompt",
        "max_tokens",
        "structured_outputs",
        "guided_json",
        "prompt_logprobs",
        "response_format",
        "stop_token_ids",
    } <= set(completion)
    assert {"messages", "max_completion_tokens", "top_logprobs",
            "response_format"} <= set(chat)  # fmt: skip
    temperature = completion["temperature"]
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 2.0)
    assert completion["top_p"]["exclusiveMinimum"] == 0.0
    assert completion["logprobs"]["anyOf"][0]["maximum"] == 20
    for name, field in {**completion, **chat}.items():
        assert field.get("description") or "$ref" in str(field), name
    assert "/v1/chat/completions" in spec["paths"]
