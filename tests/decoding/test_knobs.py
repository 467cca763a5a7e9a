"""Tests for lmhead/decoding/knobs.py: one definition of the sampling knobs,
taken as an object or as keywords by process_logits, generate and beam_search,
and stacked per row by the service."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import decoding
from lmhead.decoding import knobs as knobs_lib
from lmhead.decoding.knobs import SamplingKnobs
from tests.decoding.references import (
    MarkovChain,
    generate_greedy,
    markov_step,
    np_counts,
    np_greedy,
    np_openai_penalties,
)
from tests.errors import assert_raises_exactly, bad_input_test

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


# The knobs that read the generated tokens' counts (SETTINGS is what
# generate's loop runs without them).
PENALTIES = dict(
    presence_penalty=np.array([0.5, -0.2, 1.0], np.float32),
    frequency_penalty=0.3,
    logit_bias=np.linspace(-2, 2, 6).astype(np.float32),
)
NEW_KNOBS = ("presence_penalty", "frequency_penalty", "logit_bias")


def test_every_field_is_a_knob_with_documented_metadata():
    """The traced knobs carry a dtype, a range and a neutral value; the
    static ones are pytree metadata; the docstring documents every field."""
    names = tuple(SETTINGS)
    assert knobs_lib.KNOBS == (*names[:6], *NEW_KNOBS, "stop_tokens", *names[6:])
    assert knobs_lib.TRACED_KNOBS == knobs_lib.KNOBS[:10]
    for name in knobs_lib.KNOBS:
        assert f"{name}:" in SamplingKnobs.__doc__, name
    for name in knobs_lib.TRACED_KNOBS:
        bounds = knobs_lib.knob_range(name)
        assert bounds["low"] <= knobs_lib.neutral_value(name)
        assert bounds["high"] is None or knobs_lib.neutral_value(name) <= bounds["high"]
    assert [knobs_lib.is_integer_knob(n) for n in knobs_lib.TRACED_KNOBS] == [
        False,
        True,
        False,
        False,
        False,
        True,
        False,
        False,
        False,
        True,
    ]
    for name in NEW_KNOBS:  # any finite real
        assert knobs_lib.knob_range(name) == dict(
            low=-np.inf, high=np.inf, low_open=True, high_open=True
        )


def test_reads_counts_for_the_presence_and_frequency_penalties_only():
    assert not SamplingKnobs(**SETTINGS).reads_counts
    assert not SamplingKnobs(logit_bias=np.zeros(4)).reads_counts
    assert SamplingKnobs(presence_penalty=0.0).reads_counts
    assert SamplingKnobs(frequency_penalty=np.zeros(3)).reads_counts
    assert not SamplingKnobs(presence_penalty=0.5).reads_history


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
    counts = jnp.array([[0, 2, 1, 0, 0, 0], [1, 0, 0, 0, 0, 3], [0] * 6], jnp.int32)
    with_penalties = [
        decoding.process_logits(
            CHAIN.logits, knobs, history=history, counts=counts, eos_id=0, **keywords
        )
        for knobs, keywords in [
            (SamplingKnobs(**SETTINGS, **PENALTIES), {}),
            (None, {**SETTINGS, **PENALTIES}),
        ]
    ]
    np.testing.assert_array_equal(*with_penalties)
    assert not np.array_equal(with_penalties[0], by_knobs)


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


def test_stop_tokens_end_generates_rows_after_min_new_tokens():
    """The ``stop_tokens`` knob in ``generate``: a row ends at the first of
    its stop tokens, which it emits (``FINISHED_STOP``), and cannot draw one
    before ``min_new_tokens``: as the numpy greedy loop ends at an EOS id,
    one row at a time."""
    chain = MarkovChain(5, vocab_size=6, batch=3)
    plain = np.asarray(generate_greedy(chain, 6).tokens)
    stops = [int(plain[0, 1]), int(plain[1, 0]), int(plain[2, 3])]
    mask = np.stack([decoding.stop_token_mask([t], 6) for t in stops])
    least = np.array([0, 2, 0], np.int32)
    got = generate_greedy(chain, 6, stop_tokens=mask, min_new_tokens=least)
    for row, stop in enumerate(stops):
        tokens, _, length = np_greedy(
            chain, row, 6, eos_id=stop, min_new_tokens=int(least[row])
        )
        assert int(got.lengths[row]) == length
        assert np.asarray(got.tokens[row, :length]).tolist() == tokens[:length]
        ended = length < 6 or tokens[length - 1] == stop
        assert int(got.finish_reasons[row]) == (
            decoding.FINISHED_STOP if ended else decoding.FINISHED_LENGTH
        )


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
    neutral = dataclasses.replace(neutral, logit_bias=np.zeros(6, np.float32))
    for got, want in zip(run(neutral), run(None)):
        np.testing.assert_array_equal(got, want)
    assert_raises_exactly(
        lambda: run(SamplingKnobs(top_k=3)), ValueError, ("top_k", "beam search")
    )
    assert_raises_exactly(
        lambda: run(SamplingKnobs(presence_penalty=0.5)),
        ValueError,
        ("presence_penalty", "beam search"),
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
    bias = np.zeros((2, 5), np.float32)
    assert SamplingKnobs(logit_bias=bias, frequency_penalty=0.0).active() == ()
    bias[1, 3] = -1.0
    assert SamplingKnobs(logit_bias=bias).active() == ("logit_bias",)
    traced = jax.jit(lambda t: jnp.float32(len(SamplingKnobs(temperature=t).active())))
    assert traced(1.0) == 1  # a traced value may be anything: active


def test_stack_makes_per_row_arrays_and_greedy_neutral_padding():
    rows = [
        SamplingKnobs(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3),
        SamplingKnobs(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.1),
    ]
    stacked = SamplingKnobs.stack(rows, size=4)
    np.testing.assert_array_equal(stacked.temperature, np.float32([0.8, 0, 0, 0]))
    assert stacked.temperature.dtype == np.float32
    np.testing.assert_array_equal(stacked.top_k, [40, 0, 0, 0])
    assert stacked.top_k.dtype == np.int32
    np.testing.assert_array_equal(stacked.top_p, np.float32([0.9, 1.0, 1.0, 1.0]))
    assert stacked.min_p is None
    np.testing.assert_array_equal(
        stacked.repetition_penalty, np.float32([1.3, 1.1, 1.0, 1.0])
    )
    np.testing.assert_array_equal(stacked.min_new_tokens, np.int32([0, 0, 0, 0]))
    assert stacked.suppress_tokens is None and stacked.logit_bias is None
    # What rows must share is what the service groups requests by: the
    # repetition penalty no longer splits batches; a static knob does.
    assert rows[0].shared() == rows[1].shared() == SamplingKnobs().shared()
    assert rows[0].shared() != SamplingKnobs(no_repeat_ngram_size=2).shared()


def test_stack_makes_per_row_penalties_and_a_bias_matrix():
    """Each row's [V] bias becomes a row of [B, V]; rows without one and
    padding rows get zeros; the penalties are per row, padding neutral."""
    rows = [
        SamplingKnobs(presence_penalty=0.5, frequency_penalty=-0.25, min_new_tokens=3),
        SamplingKnobs(
            presence_penalty=-1.0,
            frequency_penalty=2.0,
            logit_bias=knobs_lib.logit_bias_vector({1: -100.0, 3: 2.5}, 4),
        ),
        SamplingKnobs(presence_penalty=0.0, frequency_penalty=0.0),
    ]
    stacked = SamplingKnobs.stack(rows, size=4)
    np.testing.assert_array_equal(stacked.presence_penalty, [0.5, -1.0, 0.0, 0.0])
    np.testing.assert_array_equal(stacked.frequency_penalty, [-0.25, 2.0, 0.0, 0.0])
    np.testing.assert_array_equal(stacked.min_new_tokens, [3, 0, 0, 0])
    np.testing.assert_array_equal(
        stacked.logit_bias,
        np.float32([[0, 0, 0, 0], [0, -100, 0, 2.5], [0, 0, 0, 0], [0, 0, 0, 0]]),
    )
    assert stacked.logit_bias.dtype == np.float32
    stacked.check(4, 4)
    # The stacked batch processes each row as OpenAI's formula does alone.
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 4)).astype(np.float32)
    generated = [[1, 1, 3], [0, 3, 3, 3], [2], []]
    got = decoding.process_logits(
        logits,
        dataclasses.replace(stacked, temperature=0.0),
        counts=np_counts(generated, 4),
    )
    want = np_openai_penalties(
        logits,
        generated,
        stacked.presence_penalty,
        stacked.frequency_penalty,
        stacked.logit_bias,
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_logit_bias_vector_from_an_openai_map():
    bias = knobs_lib.logit_bias_vector({0: 1.5, np.int64(4): -100, 2: 0.25}, 6)
    want = np.zeros(6, np.float32)
    want[[0, 4, 2]] = [1.5, -100, 0.25]
    np.testing.assert_array_equal(bias, want)
    assert bias.dtype == np.float32
    np.testing.assert_array_equal(decoding.logit_bias_vector({}, 3), np.zeros(3))


def test_stack_refuses_rows_that_cannot_share_a_batch():
    assert_raises_exactly(
        lambda: SamplingKnobs.stack(
            [
                SamplingKnobs(logit_bias=np.zeros(3)),
                SamplingKnobs(logit_bias=np.zeros(4)),
            ],
            size=2,
        ),
        ValueError,
        "logit_bias",
    )
    assert_raises_exactly(
        lambda: SamplingKnobs.stack([SamplingKnobs(logit_bias=np.zeros((2, 3)))], 2),
        ValueError,
        "logit_bias",
    )
    assert_raises_exactly(
        lambda: SamplingKnobs.stack(
            [SamplingKnobs(no_repeat_ngram_size=2), SamplingKnobs()], size=2
        ),
        ValueError,
        "no_repeat_ngram_size",
    )
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
    knobs = SamplingKnobs(
        temperature=jnp.array([0.5, 1.0]),
        top_k=3,
        repetition_penalty=jnp.array([1.5, 2.0]),
        logit_bias=jnp.array([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]),
    ).as_arrays()
    repeated = knobs.repeat_rows(2)
    np.testing.assert_array_equal(repeated.temperature, [0.5, 0.5, 1.0, 1.0])
    np.testing.assert_array_equal(repeated.repetition_penalty, [1.5, 1.5, 2, 2])
    np.testing.assert_array_equal(
        repeated.logit_bias, np.repeat(knobs.logit_bias, 2, 0)
    )
    assert repeated.top_k.shape == ()
    shared = SamplingKnobs(logit_bias=jnp.arange(3.0)).as_arrays().repeat_rows(2)
    np.testing.assert_array_equal(shared.logit_bias, [0.0, 1.0, 2.0])  # [V] stays


BAD_INPUTS = [
    (
        "stack of a value its knob does not take",
        lambda: SamplingKnobs.stack(
            [SamplingKnobs(top_k=2.7), SamplingKnobs(top_k=3)], size=2
        ),
        TypeError,
        "top_k",
    ),
    (
        "stack of more rows than its size",
        lambda: SamplingKnobs.stack([SamplingKnobs()] * 3, size=2),
        ValueError,
        ("rows", "size"),
    ),
    (
        "stack of no rows",
        lambda: SamplingKnobs.stack([], size=2),
        ValueError,
        ("rows", "size"),
    ),
    (
        "per-row knob of the wrong shape",
        lambda: SamplingKnobs(top_p=np.full(3, 0.9)).check(2, 5),
        ValueError,
        "top_p",
    ),
    (
        "per-row knob checked in range",
        lambda: SamplingKnobs(repetition_penalty=0.0).check(2, 5),
        ValueError,
        "repetition_penalty",
    ),
    (
        "repetition_penalty of the wrong shape",
        lambda: SamplingKnobs(repetition_penalty=np.ones(3)).check(2, 5),
        ValueError,
        "repetition_penalty",
    ),
    (
        "min_new_tokens of the wrong shape",
        lambda: SamplingKnobs(min_new_tokens=np.ones((2, 1), np.int32)).check(2, 5),
        ValueError,
        "min_new_tokens",
    ),
    (
        "presence_penalty of the wrong shape",
        lambda: SamplingKnobs(presence_penalty=np.zeros(5)).check(2, 5),
        ValueError,
        "presence_penalty",
    ),
    (
        "frequency_penalty not finite",
        lambda: SamplingKnobs(frequency_penalty=np.float32([0, np.nan])).check(2, 5),
        ValueError,
        "frequency_penalty",
    ),
    (
        "presence_penalty infinite",
        lambda: SamplingKnobs(presence_penalty=-np.inf).check(2, 5),
        ValueError,
        "presence_penalty",
    ),
    (
        "logit_bias of the wrong vocabulary",
        lambda: SamplingKnobs(logit_bias=np.zeros(4)).check(2, 5),
        ValueError,
        "logit_bias",
    ),
    (
        "logit_bias per row of the wrong batch",
        lambda: SamplingKnobs(logit_bias=np.zeros((3, 5))).check(2, 5),
        ValueError,
        "logit_bias",
    ),
    (
        "logit_bias a scalar",
        lambda: SamplingKnobs(logit_bias=0.5).check(2, 5),
        ValueError,
        "logit_bias",
    ),
    (
        "logit_bias not finite",
        lambda: SamplingKnobs(logit_bias=np.full(5, np.nan)).check(2, 5),
        ValueError,
        "logit_bias",
    ),
    (
        "logit_bias_vector id outside the vocabulary",
        lambda: knobs_lib.logit_bias_vector({1: 1.0, 5: -2.0}, 5),
        ValueError,
        ("logit_bias", "5"),
    ),
    (
        "logit_bias_vector negative id",
        lambda: knobs_lib.logit_bias_vector({-1: 1.0}, 5),
        ValueError,
        ("logit_bias", "-1"),
    ),
    (
        "logit_bias_vector id not an integer",
        lambda: knobs_lib.logit_bias_vector({"3": 1.0}, 5),
        TypeError,
        ("logit_bias", "3"),
    ),
    (
        "logit_bias_vector bias not finite",
        lambda: knobs_lib.logit_bias_vector({2: float("inf")}, 5),
        ValueError,
        ("logit_bias", "2"),
    ),
    (
        "logit_bias_vector bias not a number",
        lambda: knobs_lib.logit_bias_vector({2: "high"}, 5),
        TypeError,
        ("logit_bias", "2"),
    ),
    (
        "logit_bias_vector not a mapping",
        lambda: knobs_lib.logit_bias_vector([(2, 1.0)], 5),
        TypeError,
        "logit_bias",
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


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
