"""Tests for generate's per-row keys and lengths, top log-probs, the
processor hook and the penalties' counts, against row-by-row decoding and
numpy references written here, and for generate_stream against generate."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from tests.decoding.references import (
    MarkovChain,
    assert_greedy,
    markov_step,
    np_greedy,
    run_chain,
)
from tests.errors import bad_input_test, keyword_rows
from tests.references import log_softmax as np_log_softmax


def test_per_row_keys_a_row_is_the_same_alone_and_in_any_batch():
    chain = MarkovChain(31, vocab_size=6, batch=4)
    keys = jax.random.split(jax.random.key(7), 4)
    limits = np.array([6, 3, 5, 1], np.int32)
    settings = dict(temperature=1.3, top_p=0.95, num_samples=2)
    batch = run_chain(chain, key=keys, row_max_new_tokens=limits, **settings)
    assert len({tuple(row) for row in np.asarray(batch.tokens[::2])}) > 1
    for order in ([2, 0], [3, 1, 0, 2]):
        other = run_chain(
            chain, order, key=keys[np.array(order)], row_max_new_tokens=limits[order],
            **settings,
        )  # fmt: skip
        for position, row in enumerate(order):
            for sample in range(2):
                got, want = 2 * position + sample, 2 * row + sample
                np.testing.assert_array_equal(other.tokens[got], batch.tokens[want])
                np.testing.assert_array_equal(
                    other.log_probs[got], batch.log_probs[want]
                )
    # Row by row: alone, with its own limit; raw keys work too.
    raw = jax.random.key_data(keys)
    for row in range(4):
        alone = run_chain(
            chain, [row], key=raw[row : row + 1], row_max_new_tokens=limits[row : row + 1],
            **settings,
        )  # fmt: skip
        np.testing.assert_array_equal(alone.tokens, batch.tokens[2 * row : 2 * row + 2])
        assert (np.asarray(alone.tokens[:, limits[row] :]) == 0).all()
    np.testing.assert_array_equal(batch.lengths, np.repeat(limits, 2))
    # Sample 0 of a row does not depend on num_samples.
    one = run_chain(
        chain, key=keys, row_max_new_tokens=limits, temperature=1.3, top_p=0.95
    )
    np.testing.assert_array_equal(one.tokens, batch.tokens[::2])


def test_one_key_is_unchanged_and_differs_from_per_row_keys():
    chain = MarkovChain(32, vocab_size=6, batch=3)
    key = jax.random.key(3)
    single = run_chain(chain, key=key, temperature=1.0)
    again = run_chain(chain, key=key, temperature=1.0)
    np.testing.assert_array_equal(single.tokens, again.tokens)
    per_row = run_chain(chain, key=jax.random.split(key, 3), temperature=1.0)
    assert not np.array_equal(single.tokens, per_row.tokens)
    assert single.top_tokens.shape == single.top_log_probs.shape == (3, 6, 0)


def np_top(log_dist, k):
    order = np.argsort(-log_dist, kind="stable")[:k]
    return order, log_dist[order]


def test_top_logprobs_match_log_softmax_and_a_stable_sort():
    """At each step of each row, the top k of the processed distribution
    (temperature then top-k, in numpy) or of the model's, along the row's own
    path; ties go to the lower id (a tie-rich table)."""
    chain = MarkovChain(33, vocab_size=7, batch=3)
    chain.table = np.round(chain.table, 0)
    chain.logits = np.round(chain.logits, 0)
    settings = dict(key=jax.random.key(1), temperature=0.7, top_k=4, top_logprobs=5)
    for source in ("processed", "model"):
        out = run_chain(chain, log_probs_from=source, **settings)
        assert out.top_tokens.shape == (3, 6, 5)
        for row in range(3):
            prev, logits = chain.prev[row], chain.logits[row].astype(np.float64)
            for step, token in enumerate(np.asarray(out.tokens[row])):
                z = logits / 0.7
                z[np.argsort(-z, kind="stable")[4:]] = -np.inf
                log_dist = np_log_softmax(z if source == "processed" else logits)
                ids, values = np_top(log_dist, 5)
                np.testing.assert_array_equal(out.top_tokens[row, step], ids)
                np.testing.assert_allclose(
                    out.top_log_probs[row, step], values, rtol=1e-5, atol=1e-5
                )
                np.testing.assert_allclose(
                    out.log_probs[row, step], log_dist[token], rtol=1e-5, atol=1e-5
                )
                logits, prev = chain.table[prev, token].astype(np.float64), token


VOWELS = jnp.array([True, True, False, False, False, False])  # ids 0, 1


def vowel_after_consonant(logits, context):
    """A grammar: after a consonant only a vowel may follow; a prompt longer
    than 2 tokens starts with a consonant."""
    previous = context.tokens[:, jnp.maximum(context.step - 1, 0)]
    after_consonant = (context.step > 0) & ~VOWELS[previous]
    first = (context.step == 0) & (context.prompt_lengths > 2)
    allowed = jnp.where(
        after_consonant[:, None], VOWELS, jnp.where(first[:, None], ~VOWELS, True)
    )
    return jnp.where(allowed, logits, decoding.NEG_INF)


def test_processor_hook_matches_applying_it_by_hand_row_by_row():
    chain = MarkovChain(34, vocab_size=6, batch=4)
    prompt = np.array([[1, 2, 3], [-1, 4, 5], [2, -1, -1], [0, 1, 2]], np.int32)
    out = run_chain(
        chain, key=jax.random.key(0), temperature=0.0, processor=vowel_after_consonant,
        prompt_tokens=prompt,
    )  # fmt: skip
    vowels = np.asarray(VOWELS)

    def allowed(row):  # the grammar, in numpy
        def rule(step, tokens):
            if step > 0 and not vowels[tokens[-1]]:
                return vowels
            return ~vowels if step == 0 and (prompt[row] >= 0).sum() > 2 else True

        return dict(allowed=rule)

    assert_greedy(chain, out, allowed)
    sampled = run_chain(
        chain, key=jax.random.key(1), temperature=2.0, processor=vowel_after_consonant,
        max_new_tokens=12, num_samples=3,
    )  # fmt: skip
    tokens = np.asarray(sampled.tokens)
    assert (vowels[tokens[:, 1:]] | vowels[tokens[:, :-1]]).all()
    assert not vowels[tokens].all()


def test_penalties_read_the_counts_of_generated_tokens():
    """Greedy with OpenAI's presence and frequency penalties, one pair per
    row, against the numpy loop."""
    chain = MarkovChain(35, vocab_size=5, batch=3)
    presence = np.array([0.0, 1.5, -0.5], np.float32)
    frequency = np.array([0.8, 0.0, 0.3], np.float32)
    out = run_chain(
        chain, key=jax.random.key(0), temperature=0.0, max_new_tokens=8,
        presence_penalty=presence, frequency_penalty=frequency,
    )  # fmt: skip
    of_row = lambda row: dict(presence=presence[row], frequency=frequency[row])
    assert_greedy(chain, out, of_row)
    plain = [np_greedy(chain, row, 8)[0] for row in range(3)]
    assert plain != np.asarray(out.tokens).tolist()  # the penalties act here


# ---------------------------------------------------------------------------
# streaming: the chunks concatenated equal one generate call bitwise, with
# every option of the loop on.

STREAM_CHAIN = MarkovChain(41, vocab_size=6, batch=3, eos_boost=0.2)


def stream_settings():
    return dict(
        key=jax.random.split(jax.random.key(5), 3),
        max_new_tokens=7,
        temperature=np.array([0.0, 1.2, 0.9], np.float32),
        top_p=0.95,
        eos_id=(0,),
        pad_id=5,
        num_samples=2,
        row_max_new_tokens=np.array([7, 4, 6], np.int32),
        stop_sequences=[[3, 3]],
        top_logprobs=2,
        processor=vowel_after_consonant,
        frequency_penalty=0.5,
    )


def run_all_options(fn, **kwargs):
    """``fn`` (generate or generate_stream) with every option of the loop on."""
    return fn(
        markov_step,
        STREAM_CHAIN.table,
        STREAM_CHAIN.logits,
        STREAM_CHAIN.state(),
        **{**stream_settings(), **kwargs},
    )


@pytest.mark.parametrize("chunk_steps", [1, 3, 7])
def test_chunks_concatenated_equal_one_call_bitwise(chunk_steps):
    whole = run_all_options(decoding.generate)
    chunks = list(run_all_options(decoding.generate_stream, chunk_steps=chunk_steps))
    widths = [chunk.tokens.shape[1] for chunk in chunks]
    assert sum(widths) == 7 and max(widths) <= chunk_steps
    assert len(chunks) == -(-7 // chunk_steps)
    for name in ("tokens", "log_probs", "top_tokens", "top_log_probs"):
        joined = np.concatenate([getattr(c, name) for c in chunks], axis=1)
        np.testing.assert_array_equal(joined, getattr(whole, name), err_msg=name)
    for name in ("lengths", "finish_reasons"):
        np.testing.assert_array_equal(getattr(chunks[-1], name), getattr(whole, name))
    # A chunk's lengths are those after its steps.
    end = 0
    for chunk in chunks:
        end += chunk.tokens.shape[1]
        assert (np.asarray(chunk.lengths) <= end).all()


def test_a_stream_whose_rows_all_end_early_still_covers_every_column():
    whole = run_all_options(
        decoding.generate, row_max_new_tokens=np.array([2, 1, 2], np.int32)
    )
    chunks = list(
        run_all_options(
            decoding.generate_stream,
            chunk_steps=2,
            row_max_new_tokens=np.array([2, 1, 2], np.int32),
        )
    )
    assert len(chunks) == 4
    joined = np.concatenate([c.tokens for c in chunks], axis=1)
    np.testing.assert_array_equal(joined, whole.tokens)
    assert (joined[:, 2:] == 5).all()


CHAIN = MarkovChain(36, vocab_size=4, batch=2)


@dataclasses.dataclass
class UnhashableProcessor:  # eq without frozen: __hash__ is None
    def __call__(self, logits, context):
        return logits


KEYS = jax.random.split(jax.random.key(0), 3)  # one per row, for 3 rows
BAD_INPUTS = keyword_rows(
    "generate",
    functools.partial(run_chain, CHAIN),
    [
        ("top_logprobs < 0", dict(top_logprobs=-1), ValueError, "top_logprobs"),
        ("top_logprobs > V", dict(top_logprobs=5), ValueError, "top_logprobs"),
        ("top_logprobs float", dict(top_logprobs=2.0), TypeError, "top_logprobs"),
        ("log_probs_from", dict(log_probs_from="raw"), ValueError, "log_probs_from"),
        ("keys of 3 rows", dict(key=KEYS), ValueError, "key"),
        (
            "unhashable hook",
            dict(processor=UnhashableProcessor()),
            TypeError,
            "processor",
        ),
        ("hook not callable", dict(processor=3), TypeError, "processor"),
    ],
) + keyword_rows(  # raised by the call, not at the first chunk
    "generate_stream",
    functools.partial(run_all_options, decoding.generate_stream),
    [
        ("chunk_steps 0", dict(chunk_steps=0), ValueError),
        ("top_logprobs < 0", dict(chunk_steps=2, top_logprobs=-1), ValueError,
         "top_logprobs"),
    ],
)  # fmt: skip


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
