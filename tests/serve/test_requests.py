"""Tests for lmhead/serve/requests.py and protocol.py: absent knobs are
neutral, the knobs' ranges and messages are lmhead.decoding.knobs's through
the pydantic models, the context rule, and the buckets are checked (the
table of bad bodies, each field just outside its range, is
tests/serve/test_openai_api.py's, through the service)."""

import numpy as np
import pytest

from lmhead.decoding import SamplingKnobs
from lmhead.decoding import knobs as knobs_lib
from lmhead.lm import data
from lmhead.serve import requests
from tests.errors import bad_input_test, cases, keyword_rows
from tests.serve.tiny_run import BUCKETS


@pytest.fixture(scope="module")
def tokenizer(corpus):
    with open(corpus, encoding="utf-8") as f:
        return data.CharTokenizer.train(f.read())


def parse(tokenizer, body):
    return requests.parse_completion(
        {"model": "m", **body}, tokenizer, BUCKETS, requests.Limits(), "m"
    )


def test_absent_knobs_are_neutral_and_given_ones_are_kept(tokenizer):
    knobs = parse(tokenizer, {"prompt": "KING"}).knobs
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        assert getattr(knobs, name) == knobs_lib.neutral_value(name), name
    assert knobs.active() == ()
    knobs = parse(tokenizer, {"prompt": "KING", "temperature": 0.5, "top_k": 7}).knobs
    assert (knobs.temperature, knobs.top_k) == (0.5, 7)
    assert knobs.active() == ("temperature", "top_k")
    assert isinstance(knobs, SamplingKnobs)


# A value past an end of a knob's range and the message, the knob's own
# (lmhead.decoding.knobs) where the service adds no narrower policy.
KNOB_MESSAGES = [
    ({"temperature": 2.5}, "temperature must be in [0, 2]; got 2.5."),
    ({"top_p": 0}, "top_p must be in (0, 1]; got 0.0."),
    ({"top_k": 2**31}, "top_k must be in [0, 2.14748e+09]; got 2147483648."),
    ({"min_p": 1.5}, "min_p must be in [0, 1]; got 1.5."),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 1e+06]; got 0.0."),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2]; got -3.0."),
    ({"logit_bias": {"1": 101}}, "logit_bias must be in [-100, 100]; got 101.0."),
]


@pytest.mark.parametrize("fields,message", KNOB_MESSAGES)
def test_knob_ranges_and_messages_are_the_knobs_own(tokenizer, fields, message):
    with pytest.raises(requests.RequestError) as raised:
        parse(tokenizer, {"prompt": "KING", **fields})
    assert (raised.value.field, raised.value.message) == (next(iter(fields)), message)


@pytest.mark.parametrize("prompt", [[[], []], [[1], []], ["K", ""]])
def test_an_empty_prompt_item_is_refused_as_empty(tokenizer, prompt):
    # lm-evaluation-harness sends empty token lists when it cuts a prompt to
    # nothing (max_gen_toks >= max_length): the message says what is wrong.
    with pytest.raises(requests.RequestError, match="non-empty") as raised:
        parse(tokenizer, {"prompt": prompt, "max_tokens": 4})
    assert raised.value.field == "prompt" and raised.value.status == 400


def check_buckets(**fields):
    sizes = dict(batch_sizes=(1, 4), prompt_lengths=(8,), new_tokens=(8,))
    requests.Buckets(**{**sizes, **fields}).check(16)


test_bad_buckets_are_refused_naming_the_field = bad_input_test(
    keyword_rows("Buckets", check_buckets, [
        ("batch size 0", dict(batch_sizes=(0, 4)), ValueError),
        ("float new tokens", dict(new_tokens=(8.0,)), TypeError),
        ("unsorted prompt lengths", dict(prompt_lengths=(8, 4)), ValueError),
        ("no batch size", dict(batch_sizes=()), ValueError),
        ("beam size 1", dict(beam_sizes=(1, 2)), ValueError),
        ("new tokens past max_len", dict(new_tokens=(17,)), ValueError, "max_len"),
        ("prompt past max_len", dict(prompt_lengths=(4, 17)), ValueError, "max_len"),
    ])
)  # fmt: skip


def test_a_request_runs_in_the_smallest_bucket_that_holds_it():
    assert [requests.bucket(n, (1, 4, 8)) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    assert np.all(np.diff(BUCKETS.batch_sizes) > 0)


# (id, body, cap_max_tokens, each prompt's max_tokens or the field a 400
# names) on a context of 16 tokens (BUCKETS' longest prompt).
CONTEXT_RULE = [
    ("fits", {"prompt": "K" * 8, "max_tokens": 8}, False, [8]),
    ("one past", {"prompt": "K" * 9, "max_tokens": 8}, False, "prompt"),
    ("prompt past", {"prompt": "K" * 17, "echo": True, "max_tokens": 0}, True, "prompt"),
    ("default 16, cut", {"prompt": ["K" * 4, "K" * 12]}, False, [12, 4]),
    ("whole prompt, none", {"prompt": "K" * 16}, False, "prompt"),
    ("echo scores it, 0", {"prompt": "K" * 16, "echo": True, "max_tokens": 0}, False, [0]),
    ("echo scores it, 1", {"prompt": "K" * 16, "echo": True, "max_tokens": 1}, False, [1]),
    ("echo, default", {"prompt": "K" * 16, "echo": True}, False, [1]),
    ("echo, 2", {"prompt": "K" * 16, "echo": True, "max_tokens": 2}, True, "prompt"),
    ("capped", {"prompt": ["K" * 4, "K" * 12], "max_tokens": 256}, True, [12, 4]),
    ("capped, no room", {"prompt": "K" * 16, "max_tokens": 256}, True, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize("body,cap,want", cases(CONTEXT_RULE))
def test_a_prompt_plus_max_tokens_must_fit_the_context(tokenizer, body, cap, want):
    """vLLM's rule, the echo exception, and --cap_max_tokens."""
    limits = requests.Limits(cap_max_tokens=cap)
    call = lambda: requests.parse_completion(
        {"model": "m", **body}, tokenizer, BUCKETS, limits, "m", context=16
    )
    if isinstance(want, str):  # OpenAI's param; vLLM's words
        with pytest.raises(requests.RequestError) as raised:
            call()
        assert raised.value.field == want and raised.value.status == 400
        assert "maximum context length is 16 tokens" in raised.value.message
    else:
        assert call().prompt_max_tokens == want
