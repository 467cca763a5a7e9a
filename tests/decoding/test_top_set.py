"""Tests for lmhead/decoding/top_set.py's keys and bisection against numpy's
float order. The top set it cuts is tested through apply_top_k and
apply_top_p against a numpy stable sort (test_processors.py), with ties,
signed zeros and -inf over a wide vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np

from lmhead.decoding import top_set

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
