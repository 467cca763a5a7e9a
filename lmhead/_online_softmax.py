"""The online-softmax steps the fused sweep's rules share.

A rule reduces a chunk's ``[Vb, Nc]`` logits block by block to per-token
accumulators, each a :class:`Softmax` (a running max and sums rescaled to
it) or a plain ``[Nc]`` sum over the vocabulary; these are their steps --
merged block by block, combined across devices when the vocabulary is split,
finished into outputs -- with the rule for blocks and logits of -inf
(:mod:`lmhead._fused_sweep`).
"""

from typing import NamedTuple

import jax
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
    """A block's ``(live logits, peak, exp(z - peak), sum_exp)`` over its new rows."""
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


class Softmax(NamedTuple):
    r"""A token's online softmax over the rows seen so far, ``[Nc]`` each.

    ``peak`` is the running max :math:`m`, ``sum_exp`` :math:`s = \sum_i
    e^{z_i - m}`; optional, ``tilted`` :math:`t = \sum_i e^{z_i - m}(z_i - m)`
    (the entropy's) and ``argmax`` (the first row of the max). Finished:
    ``lse`` :math:`= m + \log s`, the entropy :math:`H = \log s - t / s`
    and the argmax, in that order, those present.
    """

    peak: jax.Array
    sum_exp: jax.Array
    tilted: jax.Array | None = None
    argmax: jax.Array | None = None

    @classmethod
    def of_block(cls, z, v0, is_new, *, entropy=False, argmax=False):
        """The statistics of a block's new rows of ``z: [Vb, Nc]``."""
        live, peak, exp, sum_exp = block_softmax(z, is_new)
        tilted = first = None
        if entropy:
            # 0 where exp(z - max) is 0 (a logit of -inf), not 0 * -inf.
            tilted = jnp.sum(jnp.where(exp > 0, exp * (live - peak), 0.0), axis=0)
        if argmax:
            # The first row that attains the max, as jnp.argmax, by a float
            # min-reduce rather than XLA's (value, index) reduce (the cost is
            # in docs/fused_loss.md); float32 holds row numbers exactly up to
            # 2^24.
            rows = z.shape[0]
            index = lax.broadcasted_iota(jnp.float32, z.shape, 0)
            first = jnp.min(jnp.where(live == peak, index, jnp.inf), axis=0)
            first = v0 + jnp.minimum(first, rows - 1).astype(jnp.int32)
        return cls(peak, sum_exp, tilted, first)

    def identity(self, zeros):
        """The statistics of no rows, shaped as ``self`` (whose leaves may be
        ``jax.ShapeDtypeStruct``), from ``zeros: [Nc]``."""
        return Softmax(
            zeros + NEG_INF,
            zeros,
            None if self.tilted is None else zeros,
            None if self.argmax is None else zeros.astype(self.argmax.dtype),
        )

    def merge(self, block):
        """The statistics of the rows of ``self`` and of ``block`` together."""
        new_peak = jnp.maximum(self.peak, block.peak)
        tilted = argmax = None
        if self.tilted is not None:
            tilted = rescaled_tilt(
                self.tilted, self.sum_exp, self.peak, new_peak
            ) + rescaled_tilt(block.tilted, block.sum_exp, block.peak, new_peak)
        _, sum_exp = merge_softmax(self.peak, self.sum_exp, block.peak, block.sum_exp)
        if self.argmax is not None:
            # Strictly greater: on ties the earlier rows win, as jnp.argmax.
            argmax = jnp.where(block.peak > self.peak, block.argmax, self.argmax)
        return Softmax(new_peak, sum_exp, tilted, argmax)

    def combine(self, axis, first_row):
        """The statistics of every device's rows along the mesh axis ``axis``
        (``first_row``: this device's first vocabulary id): ``pmax`` of the
        running max, ``psum`` of the sums rescaled to it, ``pmin`` of the
        argmaxes that attain it."""
        top = lax.pmax(self.peak, axis)
        tilted = argmax = None
        if self.tilted is not None:
            tilted = lax.psum(
                rescaled_tilt(self.tilted, self.sum_exp, self.peak, top), axis
            )
        sum_exp = lax.psum(self.sum_exp * jnp.exp(self.peak - finite(top)), axis)
        if self.argmax is not None:
            # Ties go to the lowest index, as jnp.argmax does.
            none = jnp.iinfo(self.argmax.dtype).max
            argmax = lax.pmin(
                jnp.where(self.peak == top, self.argmax + first_row, none), axis
            )
        return Softmax(top, sum_exp, tilted, argmax)

    def finish(self):
        """``(lse[, entropy][, argmax])``."""
        outputs = (self.peak + jnp.log(self.sum_exp),)
        if self.tilted is not None:
            outputs += (jnp.log(self.sum_exp) - self.tilted / self.sum_exp,)
        return outputs + (() if self.argmax is None else (self.argmax,))
