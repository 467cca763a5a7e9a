"""Tests of the attention softmax that the sequence and the cached paths share.

Reference: scipy's softmax of scores computed in float64 numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from lmhead import decoding, head
from lmhead.lm import attention


def numpy_weights(query, keys, mask):
    """float64 softmax of q k^T / sqrt(Dh) over the masked keys, [B, H, T, S]."""
    q, k = np.asarray(query, np.float64), np.asarray(keys, np.float64)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    return special.softmax(np.where(mask[:, None], scores, -np.inf), axis=-1)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_weights_over_pieces_match_numpy(layout):
    rng = np.random.default_rng(0)
    query = jnp.asarray(rng.standard_normal((2, 5, 3, 4)) * 3, jnp.float32)
    keys = jnp.asarray(rng.standard_normal((2, 7, 3, 4)) * 3, jnp.float32)
    # Each row sees a prefix of the keys that holds at least one key.
    mask = np.arange(7)[None, None, :] <= rng.integers(0, 7, (2, 5))[..., None]
    stored = keys if layout == "bshd" else keys.transpose(0, 2, 1, 3)
    axis = 1 if layout == "bshd" else 2
    pieces = jnp.split(stored, [2, 3], axis=axis)  # 2, 1 and 4 keys
    got = jax.jit(attention.softmax_weights, static_argnums=3)(
        query, pieces, jnp.asarray(mask), layout
    )
    assert got.shape == (2, 3, 5, 7) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, numpy_weights(query, keys, mask), atol=1e-6)


def test_masked_keys_get_exactly_zero_and_causal_rows_sum_to_one():
    rng = np.random.default_rng(1)
    query, keys = (
        jnp.asarray(rng.standard_normal((1, 6, 2, 4)) * 30, jnp.bfloat16)
        for _ in range(2)
    )
    causal = jnp.tril(jnp.ones((1, 6, 6), bool))
    weights = np.asarray(attention.softmax_weights(query, [keys], causal))
    assert attention.NEG_INF is head.NEG_INF is decoding.NEG_INF  # one of it
    assert weights.dtype == np.float32 and np.all(np.isfinite(weights))
    np.testing.assert_array_equal(weights[..., ~np.asarray(causal[0])], 0.0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
