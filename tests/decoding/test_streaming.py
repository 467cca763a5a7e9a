"""Tests for lmhead/decoding/streaming.py: the chunks concatenated equal one
generate call bitwise, with every option of the loop on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from tests.decoding.references import MarkovChain, markov_step
from tests.decoding.test_sampling_options import vowel_after_consonant
from tests.errors import assert_raises_exactly

CHAIN = MarkovChain(41, vocab_size=6, batch=3, eos_boost=0.2)


def settings():
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


def run(fn, **kwargs):
    return fn(
        markov_step,
        CHAIN.table,
        CHAIN.logits,
        {"prev": jnp.asarray(CHAIN.prev)},
        **{**settings(), **kwargs},
    )


@pytest.mark.parametrize("chunk_steps", [1, 3, 7])
def test_chunks_concatenated_equal_one_call_bitwise(chunk_steps):
    whole = run(decoding.generate)
    chunks = list(run(decoding.generate_stream, chunk_steps=chunk_steps))
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
    whole = run(decoding.generate, row_max_new_tokens=np.array([2, 1, 2], np.int32))
    chunks = list(
        run(
            decoding.generate_stream,
            chunk_steps=2,
            row_max_new_tokens=np.array([2, 1, 2], np.int32),
        )
    )
    assert len(chunks) == 4
    joined = np.concatenate([c.tokens for c in chunks], axis=1)
    np.testing.assert_array_equal(joined, whole.tokens)
    assert (joined[:, 2:] == 5).all()


def test_bad_arguments_raise_when_called_not_at_the_first_chunk():
    assert_raises_exactly(
        lambda: run(decoding.generate_stream, chunk_steps=0), ValueError, "chunk_steps"
    )
    assert_raises_exactly(
        lambda: run(decoding.generate_stream, chunk_steps=2, top_logprobs=-1),
        ValueError,
        "top_logprobs",
    )
