"""Tests for lmhead/decoding/stopping.py and generate's stopping: EOS ids,
stop sequences and per-row lengths against a Python loop that stops by hand."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from lmhead import decoding
from tests.decoding.references import (
    MarkovChain,
    assert_greedy,
    generate_greedy,
    np_greedy,
)
from tests.errors import bad_input_test, keyword_rows


def test_stop_sequences_shared_and_per_row_match_a_python_loop():
    """Sequences taken from each row's free run, so that they fire. Row 3's
    sequence spans the prompt and the first generated token: the rule
    matches generated tokens only, so it does not stop the row there."""
    chain = MarkovChain(22, vocab_size=5, batch=4)
    free = np.asarray(generate_greedy(chain, 9).tokens)
    per_row = [
        [free[0, 2:5].tolist()],
        [free[1, 1:3].tolist(), [4, 4, 4, 4]],
        [],
        [[int(chain.prev[3]), int(free[3, 0])]],
    ]
    out = generate_greedy(chain, 9, stop_sequences=per_row, eos_id=None)
    assert_greedy(chain, out, lambda row: dict(stops=per_row[row]))
    assert int(out.lengths[3]) > 1  # the prompt's token did not count
    assert int(out.finish_reasons[0]) == decoding.FINISHED_STOP
    assert int(out.finish_reasons[2]) == decoding.FINISHED_LENGTH

    shared = [free[2, 3:5].tolist(), [int(free[1, 0])]]
    out = generate_greedy(chain, 9, stop_sequences=shared)
    assert_greedy(chain, out, stops=shared)


def test_row_lengths_eos_ids_and_stops_together_and_num_samples():
    """Two EOS ids (a list, taken as a set) that occur in the free runs."""
    chain = MarkovChain(23, vocab_size=5, batch=3, eos_boost=0.3)
    free = np.asarray(generate_greedy(chain, 7).tokens)
    limits = np.array([2, 7, 5], np.int32)
    stops, eos = [free[1, 2:4].tolist()], [int(free[2, 4]), int(free[0, 1])]
    out = generate_greedy(
        chain,
        7,
        row_max_new_tokens=limits,
        stop_sequences=stops,
        eos_id=eos,
        num_samples=2,
    )
    assert_greedy(
        chain,
        out,
        lambda row: dict(limit=limits[row]),
        samples=2,
        eos_id=eos,
        stops=stops,
    )
    assert (np.asarray(out.finish_reasons) == decoding.FINISHED_EOS).any()


def test_a_stop_condition_of_ones_own_through_the_protocol():
    """Any pytree with init/update/repeat_rows/check plugs in: here, a row
    ends after its second token above a threshold (a carried count)."""
    chain = MarkovChain(24, vocab_size=6, batch=3)
    out = generate_greedy(chain, 8, stop=SecondHighToken(jnp.array([2, 3, 4])))
    for row, threshold in enumerate((2, 3, 4)):
        tokens, _, length, reason = np_greedy(chain, row, 8)
        high = np.cumsum(np.asarray(tokens[:length]) > threshold)
        end = int(np.argmax(high >= 2)) + 1 if high[-1] >= 2 else length
        np.testing.assert_array_equal(out.tokens[row, :end], tokens[:end])
        assert int(out.lengths[row]) == end
        expected = decoding.FINISHED_STOP if high[-1] >= 2 else reason
        assert int(out.finish_reasons[row]) == expected


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SecondHighToken:
    threshold: jax.Array

    def init(self, batch):
        return jnp.zeros((batch,), jnp.int32)

    def update(self, carry, tokens, active):
        carry = carry + (active & (tokens > self.threshold)).astype(jnp.int32)
        return carry, active & (carry >= 2)

    def repeat_rows(self, repeats):
        return SecondHighToken(threshold=jnp.repeat(self.threshold, repeats))

    def check(self, batch, vocab_size):
        if self.threshold.shape != (batch,):
            raise ValueError("threshold must have shape [B].")


class StopSequencesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_update_matches_the_window_by_hand(self):
        stop = decoding.StopSequences.of([[[1, 2]], [[3], [0, 0, 0]]], batch=2)
        assert stop.sequences.shape == (2, 2, 3)
        update = self.variant(stop.update)
        rng = np.random.default_rng(0)
        carry, seen = stop.init(2), [[], []]
        active = np.array([True, True])
        for _ in range(30):
            tokens = rng.integers(0, 4, 2).astype(np.int32)
            active = active & (rng.random(2) < 0.95)
            carry, ended = update(carry, tokens, active)
            for row, sequences in enumerate(([[1, 2]], [[3], [0, 0, 0]])):
                if active[row]:
                    seen[row].append(int(tokens[row]))
                hit = any(seen[row][-len(s) :] == s for s in sequences)
                assert bool(ended[row]) == (bool(active[row]) and hit)

    def test_repeat_rows(self):
        stop = decoding.StopSequences.of([[[1]], [[2, 3]]], batch=2)
        repeated = stop.repeat_rows(2).sequences
        np.testing.assert_array_equal(repeated[1], stop.sequences[0])
        np.testing.assert_array_equal(repeated[2], stop.sequences[1])


CHAIN = MarkovChain(25, vocab_size=4, batch=2)
STOP_3 = decoding.StopSequences.of([[1]], batch=3)

ROWS_3 = [[[1]], [[2]], [[3]]]
BAD_INPUTS = keyword_rows(
    "generate",
    functools.partial(generate_greedy, CHAIN, 3),
    [
        ("empty stop sequence", dict(stop_sequences=[[1], []]), ValueError),
        ("stop sequence id = V", dict(stop_sequences=[[1, 4]]), ValueError),
        ("stop sequences of 3 rows", dict(stop_sequences=ROWS_3), ValueError),
        ("stop of 3 rows", dict(stop=STOP_3), ValueError, "stop_sequences"),
        ("stop not a condition", dict(stop=[[1, 2]]), TypeError),
        ("eos_id set with V", dict(eos_id=(1, 4)), ValueError),
        ("limits of 3 rows", dict(row_max_new_tokens=np.array([1, 2, 3])), ValueError),
        (
            "limit > max_new_tokens",
            dict(row_max_new_tokens=np.array([1, 4])),
            ValueError,
        ),
        ("limit 0", dict(row_max_new_tokens=np.array([0, 1])), ValueError),
        ("limits float", dict(row_max_new_tokens=np.array([1.0, 2.0])), TypeError),
    ],
) + [
    (
        "stop sequence longer than its window",
        lambda: decoding.StopSequences.of([[1, 2, 3]], batch=2, window=2),
        ValueError,
        "stop_sequences",
    ),
]


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
