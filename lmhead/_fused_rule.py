r"""What a loss writes to run on the one chunked sweep (:mod:`lmhead._fused_sweep`).

:class:`Rule` is a loss as the engine runs it: its per-block statistics, its
per-token loss and the gradient with respect to a block's logits, with
defaults for the rest. :class:`VocabShards` is the split of the
vocabulary's rows over a mesh axis that the engine runs a rule on.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from lmhead._online_softmax import Softmax


class Rule:
    r"""A loss as the engine runs it; subclass it as a frozen (hashable) dataclass.

    A rule writes its per-chunk formula, three members:

    * ``block_stats(plan, pass_, z, v0, is_new, context, previous)``: the
      statistics a token needs from a block of its logits ``z: [Vb, Nc]``
      (rows ``v0 + i``; ``is_new: [Vb, 1]`` marks the rows no earlier block
      covered), a tuple of accumulators, each a
      :class:`lmhead._online_softmax.Softmax` (an online logsumexp, with the
      entropy's tilted sum and the argmax if asked) or an ``[Nc]`` array,
      a sum over the vocabulary (a label's logit, a divergence's terms).
      ``previous`` are the earlier passes' outputs;
    * ``loss(loss_scalars, outputs, token_inputs)``: the per-token loss
      ``[Nc]`` of the finished statistics;
    * ``dlogits(z, v0, context, outputs, coefs)``: ``[Vb, Nc]``, the
      gradient of :math:`\sum_t \sum_k c_{tk}\, o_{tk}` (``coefs`` ``c``,
      outputs ``o``) with respect to a block's logits.

    The rest has defaults, generic for any such accumulators: their merge
    over blocks, their ``combine`` across the devices of a split
    vocabulary (so that every rule can split it), their ``finish`` into
    outputs (a :class:`~lmhead._online_softmax.Softmax`'s ``lse``, entropy
    and argmax, a sum as it is), in order; ``loss_coefs``, the loss's VJP;
    ``cotangent_coefs``, the cotangents themselves. Coefficients are then a
    tuple aligned with the outputs, None for an integer output (or a zero);
    a rule that overrides ``loss_coefs`` and ``cotangent_coefs`` may lay
    them out as its ``dlogits`` reads them.

    ``outputs`` are the per-token results of all passes, a tuple of ``[N]``
    (``[Nc]`` inside a chunk) arrays. ``inputs`` is the rule's own operand
    of :func:`fused_core`, ``(token_inputs, row_inputs)``: pytrees of arrays
    with a leading token axis (sliced per chunk, packed when weight-0 tokens
    are skipped) and a leading vocabulary axis (split with ``w``).
    ``loss`` and ``loss_coefs`` also get the token inputs (a chunk's, or all
    tokens'), for a loss with per-token operands. With
    ``Plan.segment_length``, the objective is ``sum_s segment_loss(U)_s``
    of the segments' sums ``U_s = sum_{t in s} w_t L_t`` (elementwise on
    ``[S]``); ``loss_coefs`` are then those of ``U``'s terms. With a row
    order (:func:`fused_core`'s ``vocab_order``), ``sorted_inputs`` maps the
    token inputs' vocabulary ids ``y`` to ``inverse[y]`` and their
    vocabulary axes by ``order``, and ``caller_outputs`` maps output ids back.
    """

    passes = 1  # passes over the vocabulary, each reading the previous ones'
    # The default chunk is that of logits chunk_factor times narrower: for a
    # rule whose chunk holds more than its logits (a teacher's too).
    chunk_factor = 1

    def chunk_context(self, plan, h_chunk, token_inputs, row_inputs):
        """What ``block_stats`` and ``dlogits`` get besides the logits: by
        default the chunk's token inputs. Vocabulary ids among them count
        from ``plan.first_row()``, a device's first row."""
        return token_inputs

    def merge(self, pass_, carry, block):
        """The accumulators of the rows of ``carry`` and ``block`` together."""
        return tuple(
            a.merge(b) if isinstance(a, Softmax) else a + b
            for a, b in zip(carry, block)
        )

    def combine(self, plan, pass_, carry):
        """The accumulators of every device's rows along ``plan.vocab_axis``."""
        axis = plan.vocab_axis
        return tuple(
            a.combine(axis, plan.first_row())
            if isinstance(a, Softmax)
            else lax.psum(a, axis)
            for a in carry
        )

    def finish(self, pass_, carry) -> tuple:
        """The pass's outputs from its accumulators."""
        return sum((a.finish() if isinstance(a, Softmax) else (a,) for a in carry), ())

    def loss_coefs(self, loss_scalars, outputs, weights, token_inputs) -> tuple:
        """``weights * dL/d(outputs)``, token by token; None for an integer output."""
        floating = [jnp.issubdtype(x.dtype, jnp.floating) for x in outputs]

        def loss(*values):
            values = iter(values)
            full = tuple(next(values) if f else x for x, f in zip(outputs, floating))
            return self.loss(loss_scalars, full, token_inputs)

        _, pullback = jax.vjp(loss, *(x for x, f in zip(outputs, floating) if f))
        coefs = iter(pullback(weights))
        return tuple(next(coefs) if f else None for f in floating)

    def segment_loss(self, loss_scalars, sums):
        raise NotImplementedError(f"{type(self).__name__} has no segment loss")

    def cotangent_coefs(self, outputs, cotangents) -> tuple:
        """The coefficients of cotangents on the outputs: themselves."""
        return tuple(
            None if c is None or c.dtype == jax.dtypes.float0 else c for c in cotangents
        )

    def sorted_inputs(self, token_inputs, order, inverse):
        """The token inputs with the rows in ``order``; by default as they
        are (a rule with vocabulary ids or axes among them maps them)."""
        return token_inputs

    def caller_outputs(self, outputs, order):
        """The outputs with vocabulary ids in the caller's order; by default
        as they are."""
        return outputs


@dataclasses.dataclass(frozen=True)
class VocabShards:
    """The rows of ``w`` split over the devices along a mesh axis.

    ``vocab_parallel.vocab_shards`` makes one, for the ``vocab_shards``
    argument of the fused losses.

    Attributes:
        axis: the mesh axis.
        count: devices along it; it must divide ``V``.
        run: ``run(core, h, w, bias, loss_scalars, weights, inputs) ->
            (objective, outputs)`` calls ``core`` (a function of the same
            arguments) on every device, with a device's tokens and its rows
            of ``w`` and ``bias`` (``[N, D]``, ``[V, D]``, ``[V]``, ``[N]``
            in all; ``loss_scalars`` is replicated; ``inputs`` is the rule's
            ``(token_inputs, row_inputs)``), and returns ``core``'s objective
            summed over the devices' tokens and its outputs for every token.
    """

    axis: str
    count: int
    run: Callable[..., tuple[jax.Array, tuple[jax.Array, ...]]]
