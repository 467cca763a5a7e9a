"""The softmax of the model's attention, one function for its two paths.

:func:`softmax_weights` is what ``layers.CausalSelfAttention`` computes over a
sequence and what ``kv_cache.attend_filled`` computes over the filled slots
of a cache, so that the two cannot drift apart. Keys may come in pieces (the
cache's layout, see :mod:`lmhead.lm.kv_cache`); the scores are their
concatenation.
"""

import math

import jax
import jax.numpy as jnp

from lmhead.head import NEG_INF


def softmax_weights(
    query: jax.Array,
    keys: tuple[jax.Array, ...] | list[jax.Array],
    mask: jax.Array,
    keys_layout: str = "bshd",
) -> jax.Array:
    r"""float32 attention weights of ``query`` over the concatenated ``keys``.

    .. math::
        w_{bhts} = \mathrm{softmax}_s\big(q_{bth} \cdot k_{bsh} / \sqrt{D_h}\big)
        \text{ over the } s \text{ where } \mathrm{mask}_{bts}, \quad 0 \text{ elsewhere.}

    Masked scores are the head library's ``NEG_INF`` (``-inf``): a causal row
    always sees its own position (the diagonal; in a cache, at least slot 0,
    since positions are never negative), so no row is fully masked and the
    softmax never divides 0 by 0.

    Args:
        query: ``[B, T, H, Dh]``.
        keys: pieces ``[B, S_j, H, Dh]`` (``keys_layout="bshd"``) or ``[B, H,
            S_j, Dh]`` (``"bhsd"``, the cache's), ``S = sum_j S_j``.
        mask: ``bool [B | 1, T, S]``, True where query ``t`` sees key ``s``.

    Returns:
        ``float32 [B, H, T, S]``.

    Examples:
        >>> query, key = jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 1, 4))
        >>> causal = jnp.tril(jnp.ones((1, 2, 2), bool))
        >>> softmax_weights(query, [key], causal)
        Array([[[[1. , 0. ],
                 [0.5, 0.5]]]], dtype=float32)
        >>> pieces = [key[:, :1], key[:, 1:]]
        >>> bool((softmax_weights(query, pieces, causal)
        ...       == softmax_weights(query, [key], causal)).all())
        True
    """
    scores = jnp.concatenate(
        [
            jnp.einsum(
                f"bthd,{keys_layout}->bhts",
                query,
                key,
                preferred_element_type=jnp.float32,
            )
            for key in keys
        ],
        axis=-1,
    )
    scores = jnp.where(mask[:, None], scores / math.sqrt(query.shape[-1]), NEG_INF)
    return jax.nn.softmax(scores, axis=-1)
