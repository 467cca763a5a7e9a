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
    assert_greedy,
    beam_chain,
    generate_greedy,
    np_greedy,
    run_chain,
)
from tests.errors import assert_raises_exactly, bad_input_test, keyword_rows

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
    """The traced knobs carry a dtype, a range holding their neutral value;
    the static ones are pytree metadata; the docstring documents every field."""
    names = tuple(SETTINGS)
    assert knobs_lib.KNOBS == (*names[:6], *NEW_KNOBS, "stop_tokens", *names[6:])
    assert knobs_lib.TRACED_KNOBS == knobs_lib.KNOBS[:10]
    for name in knobs_lib.KNOBS:
        assert f"{name}:" in SamplingKnobs.__doc__, name
    integers = []
    for name in knobs_lib.TRACED_KNOBS:
        spec = knobs_lib.knob_spec(name)
        assert spec["low"] <= knobs_lib.neutral_value(name)
        assert spec["high"] is None or knobs_lib.neutral_value(name) <= spec["high"]
        integers += [name] if np.issubdtype(spec["dtype"], np.integer) else []
        if name in NEW_KNOBS:  # any finite real
            bounds = [spec[k] for k in ("low", "high", "low_open", "high_open")]
            assert bounds == [-np.inf, np.inf, True, True]
    assert integers == ["top_k", "min_new_tokens", "stop_tokens"]


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
        return run_chain(
            CHAIN,
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
    of_row = lambda row: dict(eos_id=stops[row], min_new_tokens=int(least[row]))
    assert_greedy(chain, got, of_row, reasons=False)
    for row in range(3):
        reason = np_greedy(chain, row, 6, **of_row(row))[3]
        stopped = reason == decoding.FINISHED_EOS
        assert got.finish_reasons[row] == (decoding.FINISHED_STOP if stopped else 0)


def test_beam_search_takes_neutral_knobs_and_refuses_an_active_one():
    def run(knobs):
        return beam_chain(CHAIN, num_beams=2, max_new_tokens=3, eos_id=0, knobs=knobs)

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


def test_logit_bias_vector_from_an_openai_map():
    bias = knobs_lib.logit_bias_vector({0: 1.5, np.int64(4): -100, 2: 0.25}, 6)
    want = np.zeros(6, np.float32)
    want[[0, 4, 2]] = [1.5, -100, 0.25]
    np.testing.assert_array_equal(bias, want)
    assert bias.dtype == np.float32
    np.testing.assert_array_equal(decoding.logit_bias_vector({}, 3), np.zeros(3))


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


def check(**knobs):
    """``SamplingKnobs(**knobs).check`` for B = 2 rows, V = 5 tokens."""
    SamplingKnobs(**knobs).check(2, 5)


def bias_map(mapping):
    return knobs_lib.logit_bias_vector(mapping, 5)


NAN = np.float32([0, np.nan])
CHECKS = [
    ("top_p of 3 rows", dict(top_p=np.full(3, 0.9)), ValueError),
    ("penalty 0", dict(repetition_penalty=0.0), ValueError),
    ("penalty of 3 rows", dict(repetition_penalty=np.ones(3)), ValueError),
    (
        "min_new_tokens [2, 1]",
        dict(min_new_tokens=np.ones((2, 1), np.int32)),
        ValueError,
    ),
    ("min_new_tokens 1.5", dict(min_new_tokens=1.5), TypeError),
    ("presence of 5 rows", dict(presence_penalty=np.zeros(5)), ValueError),
    ("presence inf", dict(presence_penalty=-np.inf), ValueError),
    ("frequency NaN", dict(frequency_penalty=NAN), ValueError),
    ("bias of V = 4", dict(logit_bias=np.zeros(4)), ValueError),
    ("bias of B = 3", dict(logit_bias=np.zeros((3, 5))), ValueError),
    ("bias a scalar", dict(logit_bias=0.5), ValueError),
    ("bias NaN", dict(logit_bias=np.full(5, np.nan)), ValueError),
    ("ngram 0", dict(no_repeat_ngram_size=0), ValueError),
    ("suppressed id 5", dict(suppress_tokens=(5,)), ValueError),
]
BIAS_MAPS = [
    ("map id 5", dict(mapping={1: 1.0, 5: -2.0}), ValueError, ("logit_bias", "5")),
    ("map id -1", dict(mapping={-1: 1.0}), ValueError, ("logit_bias", "-1")),
    ("map id '3'", dict(mapping={"3": 1.0}), TypeError, ("logit_bias", "3")),
    ("map bias inf", dict(mapping={2: float("inf")}), ValueError, ("logit_bias", "2")),
    ("map bias 'high'", dict(mapping={2: "high"}), TypeError, ("logit_bias", "2")),
    ("not a map", dict(mapping=[(2, 1.0)]), TypeError, "logit_bias"),
]
OF = [  # SamplingKnobs.of: both forms, a misspelled knob, not knobs
    ("knobs and keywords", dict(knobs=SamplingKnobs(), top_p=0.5), TypeError),
    (
        "misspelled",
        dict(knobs=None, temprature=0.5),
        TypeError,
        ("temprature", "temperature"),
    ),
    ("a dict", dict(knobs={"top_k": 2}), TypeError, ("knobs", "SamplingKnobs")),
]
BAD_INPUTS = (
    keyword_rows("check", check, CHECKS)
    + keyword_rows("logit_bias_vector", bias_map, BIAS_MAPS)
    + keyword_rows("of", SamplingKnobs.of, OF)
)


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
