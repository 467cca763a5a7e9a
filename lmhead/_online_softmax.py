"""The online-softmax steps the fused sweep's rules share.

A rule reduces a chunk's ``[Vb, Nc]`` logits block by block to per-token
accumulators (a running max and sums rescaled to it); these are its steps,
with the rule for blocks and logits of -inf (:mod:`lmhead._fused_sweep`).
"""

import jax.numpy as jnp
from jax import lax

from lmhead.head import NEG_INF


def finite(peak):
    """A running max as the reference of ``exp(z - max)``, with 0 for a max
    of -inf (every logit so far -inf, e.g. a block of banned tokens), where
    ``-inf - (-inf)`` would make the sum NaN rather than 0."""
    return jnp.where(peak == NEG_INF, 0.0, peak)


def rescaled_tilt(tilted, sum_exp, peak, new_peak):
    """``sum e_i (z_i - m)`` re-based from the max ``m = peak`` to ``new_peak``:
    ``e^(m - M) (t + (m - M) s)``; 0 while nothing is summed (``s = 0``)."""
    shift = peak - new_peak
    return jnp.where(sum_exp > 0, jnp.exp(shift) * (tilted + shift * sum_exp), 0.0)


def block_softmax(z, is_new):
    """A block's ``(peak, exp(z - peak), sum_exp)`` over its new rows."""
    live = jnp.where(is_new, z, NEG_INF)
    peak = jnp.max(live, axis=0)
    exp = jnp.exp(live - finite(peak))
    return live, peak, exp, jnp.sum(exp, axis=0)


def merge_softmax(peak, sum_exp, b_peak, b_sum_exp):
    """The online logsumexp's step: ``(new_peak, rescaled sum_exp)``."""
    new_peak = jnp.maximum(peak, b_peak)
    reference = finite(new_peak)
    sum_exp = sum_exp * jnp.exp(peak - reference) + b_sum_exp * jnp.exp(
        b_peak - reference
    )
    return new_peak, sum_exp


def label_logit(z, labels, v0, is_new):
    """Each token's logit of its label if the label is a new row of the block,
    else 0: a gather of one logit per token, not a masked pass over the block."""
    rows = z.shape[0]
    row = labels - v0
    safe_row = jnp.clip(row, 0, rows - 1)
    value = jnp.take_along_axis(z, safe_row[None, :], axis=0)[0]
    counted = (row >= 0) & (row < rows) & is_new[safe_row, 0]
    return jnp.where(counted, value, 0.0)


def is_label(z, v0, labels):
    """``[Vb, Nc]`` True at each token's label row."""
    return v0 + lax.broadcasted_iota(jnp.int32, z.shape, 0) == labels
