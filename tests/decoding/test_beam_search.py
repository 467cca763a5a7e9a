"""Tests for lmhead/decoding/beam_search.py against brute force: on a
Markov chain, and through the model's key/value cache."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import inference
from tests.decoding.references import (
    CALLS,
    UNIFORM_LOGITS,
    UNIFORM_TABLE,
    MarkovChain,
    beam_chain,
    counted_markov_step,
    generate_greedy,
    markov_step,
    np_divisor,
    uniform_markov,
)
from tests.errors import bad_input_test, keyword_rows
from tests.references import log_softmax as np_log_softmax


def test_greedy_equals_one_beam_without_eos():
    """Without EOS every hypothesis has length N, so one beam is greedy.

    (With EOS they may differ: greedy stops at an EOS argmax, one beam puts
    the ended hypothesis aside and goes on with the best non-EOS token.)
    """
    chain = MarkovChain(5, vocab_size=4, batch=5)
    # Indexed, not unpacked: generate's result grows fields.
    greedy = generate_greedy(chain, 10)
    tokens, log_probs = greedy[0], greedy[1]
    beam_tokens, beam_scores, beam_lengths, beam_log_probs = beam_chain(
        chain, num_beams=1, max_new_tokens=10, eos_id=None, length_penalty=0.6
    )
    np.testing.assert_array_equal(beam_tokens[:, 0], tokens)
    np.testing.assert_allclose(
        beam_scores[:, 0], log_probs.sum(-1) / np_divisor(10, 0.6, "gnmt"), rtol=1e-5
    )
    np.testing.assert_array_equal(beam_lengths[:, 0], 10)
    np.testing.assert_allclose(beam_log_probs[:, 0], log_probs, rtol=1e-5, atol=1e-6)


def eos_set(eos_id):
    """``eos_id`` (None, an id or a tuple of ids) as a set."""
    return set() if eos_id is None else set(np.atleast_1d(eos_id).tolist())


def brute_force_scores(chain, row, max_new_tokens, eos_id, alpha, penalty):
    """{sequence: score} for every hypothesis: ended by EOS (any of the ids
    ``eos_id``), or of length N; one that reads NaN logits has none."""
    scores, eos = {}, eos_set(eos_id)
    for length in range(1, max_new_tokens + 1):
        for sequence in itertools.product(range(chain.vocab_size), repeat=length):
            ends_with_eos = sequence[-1] in eos
            if eos.intersection(sequence[:-1]):
                continue
            if length < max_new_tokens and not ends_with_eos:
                continue
            with np.errstate(invalid="ignore"):  # NaN logits: no score
                log_prob = sum(chain.log_probs(row, sequence))
            if not np.isnan(log_prob):
                scores[sequence] = log_prob / np_divisor(length, alpha, penalty)
    return scores


def assert_matches_brute_force(
    chain, outputs, max_new_tokens, eos_id, alpha, penalty, pad_id
):
    """The n-best scores are the n largest; each sequence has its score, and
    its tokens' log-probs are the chain's, 0 after the end.

    (Sequences with exactly equal scores exist in a Markov chain, e.g. ones
    that make the same transitions in another order; either order is right.)
    """
    tokens, scores, lengths, log_probs = (np.asarray(x) for x in outputs)
    for row in range(tokens.shape[0]):
        every = brute_force_scores(chain, row, max_new_tokens, eos_id, alpha, penalty)
        best = sorted(every.values(), reverse=True)[: tokens.shape[1]]
        np.testing.assert_allclose(scores[row], best, rtol=1e-5, atol=1e-5)
        found = []
        for rank, length in enumerate(lengths[row]):
            sequence = tuple(tokens[row, rank, :length].tolist())
            np.testing.assert_array_equal(tokens[row, rank, length:], pad_id)
            assert sequence in every, (row, rank, sequence)
            np.testing.assert_allclose(
                every[sequence], scores[row, rank], rtol=1e-5, atol=1e-5
            )
            np.testing.assert_allclose(
                log_probs[row, rank, :length],
                chain.log_probs(row, sequence),
                rtol=1e-5,
                atol=1e-6,
            )
            np.testing.assert_array_equal(log_probs[row, rank, length:], 0.0)
            found.append(sequence)
        assert len(set(found)) == len(found), found


@pytest.mark.parametrize("eos_id", [None, 0, (2, 0)])
@pytest.mark.parametrize("penalty", ["gnmt", "hf"])
def test_beam_search_with_enough_beams_is_exhaustive(eos_id, penalty):
    chain = MarkovChain(12, vocab_size=3, batch=2, eos_boost=-0.5)
    for alpha in (0.0, 0.6, 2.0, -0.5):
        outputs = beam_chain(
            chain,
            num_beams=27,
            max_new_tokens=4,
            eos_id=eos_id,
            length_penalty=alpha,
            penalty=penalty,
            num_return_sequences=6,
            pad_id=7,
        )
        assert_matches_brute_force(chain, outputs, 4, eos_id, alpha, penalty, pad_id=7)


def test_a_beam_that_reads_nan_logits_ends_there():
    """A transition whose next logits are NaN: every hypothesis that reads
    them is dropped, the rest are the exact n-best (brute force without
    them); with NaN logits after the prompt there is no hypothesis."""
    chain = MarkovChain(12, vocab_size=3, batch=2, eos_boost=-0.5)
    chain.table[1, 2] = np.nan  # after tokens 1 then 2
    chain.table[2, 2, 0] = np.inf  # and a +inf logit after 2 then 2
    outputs = beam_chain(
        chain,
        num_beams=27,
        max_new_tokens=4,
        eos_id=0,
        length_penalty=0.6,
        num_return_sequences=6,
        pad_id=7,
    )
    every = brute_force_scores(chain, 0, 4, 0, 0.6, "gnmt")
    assert any(1 in seq[:-1] for seq in every)  # the table still has paths
    assert_matches_brute_force(chain, outputs, 4, 0, 0.6, "gnmt", pad_id=7)
    assert np.isfinite(np.asarray(outputs[1])).all()
    nan_prompt = decoding.beam_search(
        markov_step, chain.table, np.full_like(chain.logits, np.nan), chain.state(),
        num_beams=3, max_new_tokens=4, eos_id=0, num_return_sequences=2,
    )  # fmt: skip
    np.testing.assert_array_equal(nan_prompt.scores, -np.inf)
    np.testing.assert_array_equal(nan_prompt.lengths, 0)


@pytest.mark.parametrize(
    "penalty,alpha", [("gnmt", 0.0), ("gnmt", 0.6), ("gnmt", 1.0), ("hf", 0.5)]
)
def test_beam_search_stops_early_with_the_exact_result(penalty, alpha):
    """EOS is likely, so the n-best is settled before max_new_tokens."""
    for seed in (13, 15):
        chain = MarkovChain(seed, vocab_size=3, batch=2, eos_boost=2.5)
        CALLS.clear()
        outputs = beam_chain(
            chain,
            counted_markov_step,
            num_beams=128,
            max_new_tokens=8,
            eos_id=0,
            length_penalty=alpha,
            penalty=penalty,
            num_return_sequences=4,
        )
        jax.effects_barrier()
        assert len(CALLS) < 7, (seed, len(CALLS))
        assert_matches_brute_force(chain, outputs, 8, 0, alpha, penalty, pad_id=0)


def test_beam_search_goes_on_while_a_longer_hypothesis_can_still_win():
    """[EOS] ends at once with log 0.6 = -0.51; the live beam [1] has log 0.4
    = -0.92 and 1 -> 1 is almost certain. Ended at L = 2 it would score at best
    -0.92 / d(2) = -0.79, but at L = N = 8 it scores -0.92 / d(8) = -0.42
    (gnmt, alpha = 1), so a bound that looks only at the next length (or the
    current one) would stop after one step with the wrong answer.
    """
    chain = MarkovChain(0, vocab_size=3, batch=1)
    chain.logits = np.log(np.array([[0.6, 0.4, 1e-6]], np.float32))
    chain.table[:, 1] = np.log(np.array([1e-4, 1 - 2e-4, 1e-4], np.float32))
    outputs = beam_chain(
        chain,
        num_beams=2,
        max_new_tokens=8,
        eos_id=0,
        length_penalty=1.0,
        penalty="gnmt",
    )
    np.testing.assert_array_equal(outputs[0][0, 0], [1] * 8)
    assert_matches_brute_force(chain, outputs, 8, 0, 1.0, "gnmt", pad_id=0)


def test_beam_search_with_fewer_hypotheses_than_asked():
    chain = MarkovChain(14, vocab_size=2, batch=1)
    tokens, scores, lengths, log_probs = beam_chain(
        chain, num_beams=3, max_new_tokens=1, eos_id=0, num_return_sequences=3, pad_id=5
    )
    assert np.isfinite(scores[0, :2]).all() and np.isneginf(scores[0, 2])
    np.testing.assert_array_equal(lengths[0], [1, 1, 0])
    np.testing.assert_array_equal(tokens[0, 2], [5])
    np.testing.assert_array_equal(log_probs[0, 2], [0.0])


def test_any_of_several_eos_ids_ends_a_hypothesis():
    """eos_id=(1, 2) on a chain where 1 and 2 are certain after the prompt:
    both end at once with their own log-probs; the order of the ids and
    repeats do not matter."""
    chain = MarkovChain(3, vocab_size=4, batch=1)
    chain.logits = np.log(np.array([[0.1, 0.5, 0.3, 0.1]], np.float32))
    results = [
        beam_chain(
            chain,
            num_beams=2,
            max_new_tokens=3,
            eos_id=eos_id,
            length_penalty=0.0,
            num_return_sequences=2,
            pad_id=9,
        )
        for eos_id in ((1, 2), [2, 1, 2], {2, 1}, np.array([2, 1]))
    ]
    for result in results:
        np.testing.assert_array_equal(result.tokens[0], [[1, 9, 9], [2, 9, 9]])
        np.testing.assert_array_equal(result.lengths[0], [1, 1])
        np.testing.assert_allclose(
            result.log_probs[0], np.log([[0.5, 1, 1], [0.3, 1, 1]]), rtol=1e-6
        )
        np.testing.assert_allclose(result.scores[0], np.log([0.5, 0.3]), rtol=1e-6)


# ---------------------------------------------------------------------------
# through the model's key/value cache


@pytest.mark.parametrize("jit", [False, True])
def test_beam_generation_gives_rows_and_reasons_as_generate_does(jit):
    """Row ``b * n + k`` is hypothesis ``k`` of prompt ``b``; the reasons by
    hand: EOS (any of a set, also as the N-th token), the length, and an
    early end without EOS or a missing hypothesis (bad logits)."""
    tokens = np.array([[[4, 1, 0, 0], [2, 2, 2, 3]], [[1, 2, 0, 0], [0, 0, 0, 0]]])
    lengths = np.array([[2, 4], [2, 0]])
    log_probs = -np.arange(16, dtype=np.float32).reshape(2, 2, 4)
    result = decoding.BeamResult(tokens, np.zeros([2, 2]), lengths, log_probs)
    convert = jax.jit(decoding.beam_generation, static_argnums=1) if jit else (
        decoding.beam_generation
    )  # fmt: skip
    out = convert(result, frozenset({1, 3}) if jit else {1, 3})
    np.testing.assert_array_equal(out.tokens, tokens.reshape(4, 4))
    np.testing.assert_array_equal(out.lengths, [2, 4, 2, 0])
    np.testing.assert_array_equal(out.log_probs, log_probs.reshape(4, 4))
    eos, length, bad = (decoding.FINISHED_EOS, decoding.FINISHED_LENGTH,
                        decoding.FINISHED_BAD_LOGITS)  # fmt: skip
    np.testing.assert_array_equal(out.finish_reasons, [eos, eos, bad, bad])
    none = decoding.beam_generation(result, None)
    np.testing.assert_array_equal(none.finish_reasons, [bad, length, bad, bad])
    assert out.top_tokens.shape == out.top_log_probs.shape == (4, 4, 0)


def test_beam_search_through_the_kv_cache_matches_recomputing_the_prefix(monkeypatch):
    """Beam search on the model's cache (kv_cache.py; repeated to beams
    sharing the prompt's slots, reordered by moving slot pointers) gives what
    a step_fn that reruns the model on the whole prefix gives. Row 1's prompt
    is shorter than row 0's. MIN_SPAN = 4 makes the attention spans (4, 8, 16,
    19) and the cache's pieces (4, 4, 8, 3) small, so that decoding crosses
    several of them, and max_len 19 makes the last piece a short one.
    (tests/lm/test_kv_cache.py checks the cache's logits step by step and
    tests/lm/test_model.py greedy decoding through it.)"""
    from lmhead.lm import kv_cache
    from lmhead.lm import model as model_lib

    monkeypatch.setattr(kv_cache, "MIN_SPAN", 4)
    model = model_lib.DecoderLM(
        vocab_size=11, num_layers=2, num_heads=2, d_model=16, mlp_dim=32, max_len=19
    )
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, 11, (2, 6)), jnp.int32)
    lengths_prompt = jnp.array([6, 3], jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), prompt)["params"]
    # Away from the near-uniform init, so that rankings are clear-cut.
    params = jax.tree.map(lambda p: p + 0.3 * rng.standard_normal(p.shape), params)
    forward = jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))

    def recompute(params, tokens, state):
        rows = jnp.arange(tokens.shape[0])
        buffer = state["tokens"].at[rows, state["length"]].set(tokens)
        return forward(params, buffer)[rows, state["length"]], {
            "tokens": buffer,
            "length": state["length"] + 1,
        }

    buffer = jnp.zeros((2, 19), jnp.int32).at[:, :6].set(prompt)
    recompute_logits = forward(params, buffer)[jnp.arange(2), lengths_prompt - 1]
    recompute_state = {"tokens": buffer, "length": lengths_prompt}
    cache_logits, cache = inference.prefill(
        model, params, prompt, lengths_prompt, max_new_tokens=13
    )
    cached = inference.make_step_fn(model)
    np.testing.assert_allclose(cache_logits, recompute_logits, rtol=1e-5, atol=1e-5)

    beams = lambda step_fn, logits, state: decoding.beam_search(
        step_fn,
        params,
        logits,
        state,
        num_beams=4,
        max_new_tokens=13,
        eos_id=None,
        num_return_sequences=3,
    )
    tokens, scores, lengths, token_log_probs = beams(cached, cache_logits, cache)
    expected = beams(recompute, recompute_logits, recompute_state)
    np.testing.assert_array_equal(tokens, expected[0])
    np.testing.assert_allclose(scores, expected[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(lengths, expected[2])
    np.testing.assert_allclose(token_log_probs, expected[3], rtol=1e-4, atol=1e-5)
    # Each token's log-prob is the model's log_softmax along its sequence, by
    # teacher forcing, and the score is their sum over the length penalty.
    for row, rank in itertools.product(range(2), range(3)):
        start, length = int(lengths_prompt[row]), int(lengths[row, rank])
        sequence = np.asarray(buffer[row]).copy()
        sequence[start : start + length] = tokens[row, rank, :length]
        log_probs = np_log_softmax(forward(params, jnp.asarray(sequence[None]))[0])
        along = [log_probs[start - 1 + t, sequence[start + t]] for t in range(length)]
        np.testing.assert_allclose(
            token_log_probs[row, rank, :length], along, rtol=1e-4, atol=1e-5
        )
        np.testing.assert_array_equal(token_log_probs[row, rank, length:], 0.0)
        total = sum(along)
        np.testing.assert_allclose(
            scores[row, rank], total / np_divisor(length, 0.6, "gnmt"), rtol=1e-4
        )


def test_beam_search_through_the_kv_cache_equals_brute_force(monkeypatch):
    """With K = V ** (N - 1) beams nothing is pruned, so the n-best from the
    model's cache (in pieces of 2, 2, 4, 4 slots: MIN_SPAN = 2) must be the
    n-best of all V ** N continuations, scored by running the model on each.
    The search's N - 1 = 2 steps after prompts of 4 and 3 reach slot 5, so it
    drops the last piece (kv_cache.trim_cache) before repeating the cache."""
    from lmhead.lm import kv_cache
    from lmhead.lm import model as model_lib

    monkeypatch.setattr(kv_cache, "MIN_SPAN", 2)
    vocab, num_new = 4, 3
    model = model_lib.DecoderLM(
        vocab_size=vocab, num_layers=1, num_heads=2, d_model=8, mlp_dim=16, max_len=12
    )
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, vocab, (2, 4)), jnp.int32)
    prompt_lengths = np.array([4, 3])
    params = jax.jit(model.init)(jax.random.key(1), prompt)["params"]
    params = jax.tree.map(lambda p: p + 0.5 * rng.standard_normal(p.shape), params)
    logits, cache = inference.prefill(
        model, params, prompt, jnp.asarray(prompt_lengths), max_new_tokens=num_new
    )
    assert len(kv_cache.trim_cache(cache, num_new - 1).keys[0]) == 3
    tokens, scores, _, token_log_probs = decoding.beam_search(
        inference.make_step_fn(model),
        params,
        logits,
        cache,
        num_beams=vocab**2,
        max_new_tokens=num_new,
        eos_id=None,
        length_penalty=0.0,
        num_return_sequences=3,
    )
    continuations = np.array(list(itertools.product(range(vocab), repeat=num_new)))
    for row, start in enumerate(prompt_lengths):
        sequences = np.concatenate(
            [
                np.tile(np.asarray(prompt[row, :start]), (len(continuations), 1)),
                continuations,
            ],
            1,
        )
        log_probs = np_log_softmax(
            jax.jit(model.apply)({"params": params}, jnp.asarray(sequences))
        )
        totals = sum(
            log_probs[np.arange(len(sequences)), start - 1 + t, continuations[:, t]]
            for t in range(num_new)
        )
        best = np.argsort(-totals, kind="stable")[:3]
        np.testing.assert_array_equal(tokens[row], continuations[best])
        np.testing.assert_allclose(scores[row], totals[best], rtol=1e-5, atol=1e-5)
        for rank, sequence in enumerate(best):
            np.testing.assert_allclose(
                token_log_probs[row, rank],
                [
                    log_probs[sequence, start - 1 + t, continuations[sequence, t]]
                    for t in range(num_new)
                ],
                rtol=1e-5,
                atol=1e-5,
            )


# ---------------------------------------------------------------------------
# bad input: each case raises exactly the expected type with a message that
# names the argument, and what is allowed where that is the point
# (tests/errors.py).


def uniform_beam(logits=UNIFORM_LOGITS, state=(), **kwargs):
    return decoding.beam_search(
        uniform_markov,
        UNIFORM_TABLE,
        logits,
        state,
        **{"num_beams": 2, "max_new_tokens": 2, "eos_id": None, **kwargs},
    )


BAD_INPUTS = keyword_rows(
    "beam_search",
    uniform_beam,
    [
        ("num_beams 0", dict(num_beams=0), ValueError),
        ("3 sequences of 2 beams", dict(num_return_sequences=3), ValueError),
        ("penalty 'wu'", dict(penalty="wu"), ValueError),
        ("length_penalty inf", dict(length_penalty=np.inf), ValueError),
        ("length_penalty nan", dict(length_penalty=np.nan), ValueError, "finite"),
        ("eos_id < 0", dict(eos_id=-1), ValueError),
        ("eos_id = V among several", dict(eos_id=(0, 5)), ValueError, "[0, V)"),
        ("eos_id empty", dict(eos_id=()), ValueError),
        ("eos_id not an id", dict(eos_id={0, "a"}), ValueError),
        ("max_new_tokens 0", dict(max_new_tokens=0), ValueError),
        ("logits rank 1", dict(logits=UNIFORM_LOGITS[0]), ValueError, "[B, V]"),
        ("state's batch", dict(state=jnp.zeros((1, 2))), ValueError),
    ],
) + [
    (
        "length_penalty_divisor penalty",
        lambda: decoding.length_penalty_divisor(3, 0.6, "gnmt2"),
        ValueError,
        ("penalty", "'gnmt', 'hf'"),
    ),
]


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
