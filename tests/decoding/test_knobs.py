"""Tests for lmhead/decoding/knobs.py: one definition of the sampling knobs,
taken as an object or as keywords by process_logits, generate and beam_search,
and stacked per row by the service."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.decoding import knobs as knobs_lib
from lmhead.decoding.knobs import SamplingKnobs
from tests.decoding.references import MarkovChain, markov_step
from tests.errors import assert_raises_exactly

CHAIN = MarkovChain(21, vocab_size=6, batch=3)
SETTINGS = dict(
    temperature=np.array([0.0, 0.7, 1.3], np.float32),
    top_k=np.array([0, 3, 5], np.int32),
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.2,
    min_new_tokens=1,
    no_repeat_ngram_size=2,
    suppress_tokens=(4,),
)


def test_every_field_is_a_knob_with_documented_metadata():
    """The traced knobs carry a dtype, a range and a neutral value; the
    static ones are pytree metadata; the docstring documents every field."""
    assert knobs_lib.KNOBS == tuple(SETTINGS)
    assert knobs_lib.TRACED_KNOBS == knobs_lib.KNOBS[:6]
    for name in knobs_lib.KNOBS:
        assert f"{name}:" in SamplingKnobs.__doc__, name
    for name in knobs_lib.TRACED_KNOBS:
        low = knobs_lib.knob_range(name)["low"]
        assert knobs_lib.neutral_value(name) >= low
    assert [knobs_lib.is_integer_knob(n) for n in knobs_lib.TRACED_KNOBS] == [
        False,
        True,
        False,
        False,
        False,
        True,
    ]


def test_process_logits_takes_the_knobs_or_their_keywords_bitwise():
    history = jnp.array([[1, 2, 1], [0, 0, 3], [-1, 5, 5]], jnp.int32)
    by_keywords = decoding.process_logits(
        CHAIN.logits, history=history, num_generated=0, eos_id=0, **SETTINGS
    )
    by_knobs = decoding.process_logits(
        CHAIN.logits,
        SamplingKnobs(**SETTINGS),
        history=history,
        num_generated=0,
        eos_id=0,
    )
    np.testing.assert_array_equal(by_knobs, by_keywords)
    assert np.isneginf(by_keywords).any()  # the knobs removed some tokens


def test_generate_takes_the_knobs_or_their_keywords_bitwise():
    def run(**kwargs):
        return decoding.generate(
            markov_step,
            CHAIN.table,
            CHAIN.logits,
            CHAIN.state(),
            key=jax.random.key(4),
            max_new_tokens=5,
            eos_id=0,
            num_samples=2,
            **kwargs,
        )

    for got, want in zip(run(knobs=SamplingKnobs(**SETTINGS)), run(**SETTINGS)):
        np.testing.assert_array_equal(got, want)


def test_beam_search_takes_neutral_knobs_and_refuses_an_active_one():
    def run(knobs):
        return decoding.beam_search(
            markov_step,
            CHAIN.table,
            CHAIN.logits,
            CHAIN.state(),
            num_beams=2,
            max_new_tokens=3,
            eos_id=0,
            knobs=knobs,
        )

    neutral = SamplingKnobs(
        **{name: knobs_lib.neutral_value(name) for name in knobs_lib.TRACED_KNOBS}
    )
    for got, want in zip(run(neutral), run(None)):
        np.testing.assert_array_equal(got, want)
    assert_raises_exactly(
        lambda: run(SamplingKnobs(top_k=3)), ValueError, ("top_k", "beam search")
    )
    assert_raises_exactly(
        lambda: run(SamplingKnobs(suppress_tokens=(1,))), ValueError, "suppress_tokens"
    )


def test_of_refuses_both_forms_and_unknown_names():
    knobs = SamplingKnobs(top_k=2)
    assert SamplingKnobs.of(knobs) is knobs
    assert SamplingKnobs.of(None, top_k=2).top_k == 2
    assert_raises_exactly(
        lambda: SamplingKnobs.of(knobs, top_p=0.5), TypeError, ("knobs", "top_p")
    )
    assert_raises_exactly(
        lambda: SamplingKnobs.of(None, temprature=0.5),
        TypeError,
        ("temprature", "temperature"),
    )
    assert_raises_exactly(
        lambda: SamplingKnobs.of({"top_k": 2}), TypeError, ("knobs", "SamplingKnobs")
    )


def test_active_lists_the_knobs_that_change_the_distribution():
    assert SamplingKnobs().active() == ()
    neutral = {name: knobs_lib.neutral_value(name) for name in knobs_lib.TRACED_KNOBS}
    assert SamplingKnobs(**neutral, suppress_tokens=()).active() == ()
    assert SamplingKnobs(temperature=0.0, min_p=0.0).active() == ("temperature",)
    per_row = SamplingKnobs(top_k=np.array([0, 2]), no_repeat_ngram_size=3)
    assert per_row.active() == ("top_k", "no_repeat_ngram_size")
    traced = jax.jit(lambda t: jnp.float32(len(SamplingKnobs(temperature=t).active())))
    assert traced(1.0) == 1  # a traced value may be anything: active


def test_stack_makes_per_row_arrays_and_greedy_neutral_padding():
    rows = [
        SamplingKnobs(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3),
        SamplingKnobs(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.3),
    ]
    stacked = SamplingKnobs.stack(rows, size=4)
    np.testing.assert_array_equal(stacked.temperature, np.float32([0.8, 0, 0, 0]))
    assert stacked.temperature.dtype == np.float32
    np.testing.assert_array_equal(stacked.top_k, [40, 0, 0, 0])
    assert stacked.top_k.dtype == np.int32
    np.testing.assert_array_equal(stacked.top_p, np.float32([0.9, 1.0, 1.0, 1.0]))
    assert stacked.min_p is None
    assert stacked.repetition_penalty == np.float32(1.3)
    assert stacked.min_new_tokens == 0 and stacked.suppress_tokens is None
    # What rows must share is what the service groups requests by.
    assert rows[0].shared() == rows[1].shared()
    assert rows[0].shared() != SamplingKnobs(repetition_penalty=1.1).shared()


def test_stack_refuses_rows_that_cannot_share_a_batch():
    assert_raises_exactly(
        lambda: SamplingKnobs.stack(
            [SamplingKnobs(repetition_penalty=1.1), SamplingKnobs()], size=2
        ),
        ValueError,
        "repetition_penalty",
    )
    assert_raises_exactly(
        lambda: SamplingKnobs.stack([SamplingKnobs(top_k=2), SamplingKnobs()], size=2),
        ValueError,
        "top_k",
    )


def test_a_knobs_value_is_traced_and_its_switch_and_static_fields_are_not():
    """One compile serves every value of the traced knobs; turning a knob on
    or changing a static one gives another program."""
    calls = []

    @jax.jit
    def scale(knobs):
        calls.append(1)
        return knobs.temperature * 2

    base = SamplingKnobs(temperature=0.5, top_k=3, suppress_tokens=(1,))
    scale(base.as_arrays())
    scale(dataclasses.replace(base, temperature=0.9, top_k=4).as_arrays())
    assert len(calls) == 1
    scale(dataclasses.replace(base, top_p=0.5).as_arrays())
    scale(dataclasses.replace(base, suppress_tokens=(2,)).as_arrays())
    assert len(calls) == 3
    leaves = jax.tree.leaves(base.as_arrays())
    assert [leaf.dtype for leaf in leaves] == [np.float32, np.int32, np.int32]


def test_repeat_rows_repeats_per_row_values_only():
    knobs = SamplingKnobs(temperature=jnp.array([0.5, 1.0]), top_k=3).as_arrays()
    repeated = knobs.repeat_rows(2)
    np.testing.assert_array_equal(repeated.temperature, [0.5, 0.5, 1.0, 1.0])
    assert repeated.top_k.shape == ()


BAD_INPUTS = [
    (
        "per-row knob of the wrong shape",
        lambda: SamplingKnobs(top_p=np.full(3, 0.9)).check(2, 5),
        ValueError,
        "top_p",
    ),
    (
        "per-batch knob checked in range",
        lambda: SamplingKnobs(repetition_penalty=0.0).check(2, 5),
        ValueError,
        "repetition_penalty",
    ),
    (
        "integer knob given a float",
        lambda: SamplingKnobs(min_new_tokens=1.5).check(2, 5),
        TypeError,
        "min_new_tokens",
    ),
    (
        "static count below 1",
        lambda: SamplingKnobs(no_repeat_ngram_size=0).check(2, 5),
        ValueError,
        "no_repeat_ngram_size",
    ),
    (
        "suppressed id outside the vocabulary",
        lambda: SamplingKnobs(suppress_tokens=(5,)).check(2, 5),
        ValueError,
        "suppress_tokens",
    ),
    (
        "check_knob top_p > 1",
        lambda: knobs_lib.check_knob("top_p", 1.5),
        ValueError,
        "top_p",
    ),
]


@pytest.mark.parametrize(
    "call,error,named", [pytest.param(*case[1:], id=case[0]) for case in BAD_INPUTS]
)
def test_bad_input_raises_exactly_naming_the_argument(call, error, named):
    assert_raises_exactly(call, error, named)
