"""Tests for lmhead/serve/requests.py: every bad field is named, absent
knobs are neutral, and the buckets are checked."""

import numpy as np
import pytest

from lmhead.decoding import SamplingKnobs
from lmhead.decoding import knobs as knobs_lib
from lmhead.lm import data
from lmhead.serve import requests
from tests.errors import assert_raises_exactly
from tests.serve.tiny_run import BUCKETS


@pytest.fixture(scope="module")
def tokenizer(corpus):
    with open(corpus, encoding="utf-8") as f:
        return data.CharTokenizer.train(f.read())


BAD_GENERATE = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": "x" * 9}, "prompt"),
    ({"prompt": "KING\u20ac"}, "prompt"),
    ({"prompt": "K", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "K", "temperature": 10**400}, "temperature"),  # past float
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
    ({"text": "KING", "stride": 0}, "stride"),
    ({"text": "KING", "stride": 17}, "stride"),
    ({"txt": "KING"}, "txt"),
]


@pytest.mark.parametrize("body,field", BAD_GENERATE)
def test_bad_generate_request_names_the_field(tokenizer, body, field):
    with pytest.raises(requests.RequestError) as raised:
        requests.parse_generate(body, tokenizer, BUCKETS, requests.Limits())
    assert raised.value.field == field and raised.value.message
    assert raised.value.status == 422


@pytest.mark.parametrize("body,field", BAD_SCORE)
def test_bad_score_request_names_the_field(body, field):
    with pytest.raises(requests.RequestError) as raised:
        requests.parse_score(body, 16, requests.Limits())
    assert raised.value.field == field and raised.value.message
    assert raised.value.status == 422


def test_absent_knobs_are_neutral_and_given_ones_are_kept(tokenizer):
    parse = lambda body: requests.parse_generate(
        body, tokenizer, BUCKETS, requests.Limits()
    )
    knobs = parse({"prompt": "KING"}).knobs
    for name in requests.SERVED_KNOBS:
        assert getattr(knobs, name) == knobs_lib.neutral_value(name), name
    assert knobs.active() == ()
    knobs = parse({"prompt": "KING", "temperature": 0.5, "top_k": 7}).knobs
    assert (knobs.temperature, knobs.top_k) == (0.5, 7)
    assert knobs.active() == ("temperature", "top_k")
    assert isinstance(knobs, SamplingKnobs)


def test_served_knobs_take_the_ranges_of_the_one_definition(tokenizer):
    """A value just outside a knob's range is refused, naming the knob."""
    parse = lambda body: requests.parse_generate(
        body, tokenizer, BUCKETS, requests.Limits()
    )
    for name, value in [
        ("temperature", -0.1),
        ("top_k", -1),
        ("top_p", 0.0),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
    ]:
        assert_raises_exactly(
            lambda: parse({"prompt": "K", name: value}), requests.RequestError, name
        )


BAD_BUCKETS = [
    ("batch size 0", dict(batch_sizes=(0, 4)), ValueError, "batch_sizes"),
    ("float new tokens", dict(new_tokens=(8.0,)), TypeError, "new_tokens"),
    (
        "unsorted prompt lengths",
        dict(prompt_lengths=(8, 4)),
        ValueError,
        "prompt_lengths",
    ),
    ("no batch size", dict(batch_sizes=()), ValueError, "batch_sizes"),
    ("beam size 1", dict(beam_sizes=(1, 2)), ValueError, "beam_sizes"),
    ("longer than max_len", dict(new_tokens=(16,)), ValueError, "max_len"),
]


@pytest.mark.parametrize(
    "fields,error,named", [pytest.param(*case[1:], id=case[0]) for case in BAD_BUCKETS]
)
def test_bad_buckets_are_refused_naming_the_field(fields, error, named):
    sizes = dict(batch_sizes=(1, 4), prompt_lengths=(8,), new_tokens=(8,))
    buckets = requests.Buckets(**{**sizes, **fields})
    assert_raises_exactly(lambda: buckets.check(16), error, named)


def test_a_request_runs_in_the_smallest_bucket_that_holds_it():
    assert [requests.bucket(n, (1, 4, 8)) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    assert np.all(np.diff(BUCKETS.batch_sizes) > 0)
