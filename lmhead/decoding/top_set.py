"""The top set of a row without a sort (:func:`keep_from_the_top`), for the
top-k and top-p filters: a bisection over order-preserving integer keys of the
float32 logits, each pass a vectorized reduction over ``[..., V]``.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def order_keys(logits: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values: ``x < y`` iff
    ``key(x) < key(y)`` (``-0.0`` is read as ``+0.0``, so that they tie)."""
    logits = jnp.where(logits == 0, 0.0, logits.astype(jnp.float32))
    bits = jax.lax.bitcast_convert_type(logits, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def smallest_key(
    holds: Callable[[jax.Array], jax.Array], shape: tuple[int, ...]
) -> jax.Array:
    """Per row, the smallest uint32 ``K`` with ``holds(K)``, for ``holds``
    monotone in ``K`` (False, then True); ``2**32 - 1`` if it never holds.

    32 halvings of the key range, each one pass over ``[..., V]``, instead
    of a sort (``docs/decoding.md`` measures both).
    """

    def halve(_, bounds):
        low, high = bounds
        middle = low + (high - low) // 2
        ok = holds(middle)
        return jnp.where(ok, low, middle + 1), jnp.where(ok, middle, high)

    low = jnp.zeros(shape, jnp.uint32)
    high = jnp.full(shape, np.iinfo(np.uint32).max, jnp.uint32)
    return jax.lax.fori_loop(0, 32, halve, (low, high))[0]


def keep_from_the_top(
    logits: jax.Array, weights: jax.Array, budget: jax.Array
) -> jax.Array:
    """``bool [..., V]``: the tokens, taken in a stable descending order of
    ``logits`` (ties towards the lower id), whose ``weights`` summed over the
    tokens before them are below ``budget [..., 1]``.

    With weights 1 that is the top ``budget`` tokens; with probabilities, the
    nucleus. Found without a sort: the cut is the smallest value with less
    than ``budget`` of weight strictly above it (:func:`smallest_key`), and
    the tokens tied at the cut are taken in id order.
    """
    keys = order_keys(logits)
    above = lambda cut: jnp.sum(
        jnp.where(keys > cut, weights, 0), axis=-1, keepdims=True
    )
    cut = smallest_key(lambda cut: above(cut) < budget, budget.shape)
    tied = jnp.where(keys == cut, weights, 0)
    tied_before = jnp.cumsum(tied, axis=-1) - tied
    return (keys > cut) | ((keys == cut) & (above(cut) + tied_before < budget))
