"""Tests for lmhead/decoding/top_set.py against a numpy stable sort.

The reference orders each row by descending logit with ties towards the
lower id (numpy's stable argsort of the negated row) and walks it, which is
the rule the bisection must reproduce without sorting.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead.decoding import top_set


def np_keep_from_the_top(logits, weights, budget):
    """Tokens in stable descending order whose preceding weight < budget."""
    keep = np.zeros(logits.shape, bool)
    for row in np.ndindex(logits.shape[:-1]):
        order = np.argsort(-logits[row], kind="stable")
        before = np.cumsum(weights[row][order]) - weights[row][order]
        keep[row][order] = before < budget[row][0]
    return keep


# Signed zeros, infinities, ties and the smallest normal float32 (XLA flushes
# subnormals to zero, so they would tie with 0 there but not in numpy).
SPECIALS = np.array(
    [-np.inf, -3.5, -0.0, 0.0, 1.2e-38, 2.0, 2.0, np.inf, -1e30, 7.25], np.float32
)


def test_order_keys_sort_like_the_floats():
    rng = np.random.default_rng(0)
    values = np.concatenate([SPECIALS, rng.normal(0, 1e3, 200).astype(np.float32)])
    keys = np.asarray(jax.jit(top_set.order_keys)(values))
    assert keys.dtype == np.uint32
    for i in range(len(values)):
        np.testing.assert_array_equal(keys[i] < keys, values[i] < values)
        np.testing.assert_array_equal(keys[i] == keys, values[i] == values)


def test_smallest_key_finds_a_monotone_threshold():
    thresholds = jnp.array([[0], [1], [12345], [2**32 - 1]], jnp.uint32)
    found = jax.jit(lambda t: top_set.smallest_key(lambda key: key >= t, t.shape))(
        thresholds
    )
    np.testing.assert_array_equal(found, thresholds)
    never = jax.jit(lambda: top_set.smallest_key(lambda key: key < 0, (1, 1)))()
    np.testing.assert_array_equal(never, [[2**32 - 1]])


@pytest.fixture(scope="module")
def keep():
    return jax.jit(top_set.keep_from_the_top)


def test_unit_weights_keep_the_top_k_with_ties_to_the_lower_id(keep):
    rng = np.random.default_rng(1)
    # few distinct values, so rows are full of ties
    logits = rng.integers(-3, 3, (6, 11)).astype(np.float32)
    logits[0] = SPECIALS.tolist() + [0.0]
    weights = np.ones_like(logits)
    budget = np.array([[0], [1], [3], [5], [11], [20]], np.float32)
    got = np.asarray(keep(logits, weights, budget))
    np.testing.assert_array_equal(got, np_keep_from_the_top(logits, weights, budget))
    np.testing.assert_array_equal(got.sum(-1), np.minimum(budget[:, 0], 11))


def test_probabilities_keep_the_nucleus(keep):
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (8, 16)).astype(np.float32)
    logits[1, 3] = logits[1, 9] = logits[1].max()  # a tie at the top
    probs = np.asarray(jax.nn.softmax(logits), np.float32)
    budget = rng.uniform(0.05, 1.0, (8, 1)).astype(np.float32)
    got = np.asarray(keep(logits, probs, budget))
    np.testing.assert_array_equal(got, np_keep_from_the_top(logits, probs, budget))
    assert got.any(-1).all()  # the first token has nothing before it
