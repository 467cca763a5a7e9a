r"""The fused sweep's optional row order of the vocabulary.

The sweep may run over the rows of ``w`` in another order than the caller's:
the table's and the bias's rows are gathered once by ``order``
(``w_sorted = w[order]``), each rule's per-vocabulary inputs (labels, ids, a
teacher's logits or table) are mapped into that order
(:meth:`lmhead._fused_rule.Rule.sorted_inputs`: an id ``y`` becomes
``inverse[y]``), a rule's outputs that are vocabulary ids come back in the
caller's order (:meth:`~lmhead._fused_rule.Rule.caller_outputs`), and the
gradients of ``w`` and ``bias`` are gathered back (``dw = dw_sorted[inverse]``).
The loss and the gradients are the caller's; only the order of the
online-softmax merges and of ``dh``'s sum over blocks changes, and with a
filter (``filter_eps``) which tiles are skipped. docs/fused_loss.md
("Vocabulary sorting") says what an order buys.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lmhead import _checks

# The orders the sweep computes itself; an integer array [V] is given.
ORDERS = ("mean_logit",)


def check_vocab_order(vocab_order, vocab_size: int, split: bool = False):
    """``vocab_order`` checked: None, ``"mean_logit"`` or an integer ``[V]``
    permutation of ``range(V)`` (returned as an int32 array).

    A traced order is taken to be a permutation: it cannot be checked
    without a host round trip, and one that is not gives wrong gradients
    (run it once outside ``jit``, or under ``checkify``, to check it).
    ``split``: the vocabulary is split over a mesh axis, where no order is
    allowed.

    Examples:
        >>> check_vocab_order([2, 0, 1], 3)
        Array([2, 0, 1], dtype=int32)
        >>> check_vocab_order([2, 0, 2], 3)
        Traceback (most recent call last):
        ...
        ValueError: vocab_order must be a permutation of range(3); it repeats 2 and lacks 1.
    """
    if vocab_order is None:
        return None
    if split:
        raise ValueError(
            "vocab_order is not supported with a vocabulary split over a mesh "
            "axis (vocab_shards): each device sweeps its own rows; got "
            f"{vocab_order if isinstance(vocab_order, str) else 'an order'}."
        )
    if isinstance(vocab_order, str):
        if vocab_order not in ORDERS:
            raise ValueError(
                "vocab_order must be None, 'mean_logit' or an integer array [V]; "
                f"got {vocab_order!r}."
            )
        return vocab_order
    if isinstance(vocab_order, (list, tuple)):
        vocab_order = np.asarray(vocab_order)
    if not hasattr(vocab_order, "dtype"):
        raise TypeError(
            "vocab_order must be None, 'mean_logit' or an integer array [V]; "
            f"got {type(vocab_order).__name__}."
        )
    _checks.check_integer("vocab_order", vocab_order)
    if np.shape(vocab_order) != (vocab_size,):
        raise ValueError(
            f"vocab_order must have shape [V] = ({vocab_size},), a permutation "
            f"of the rows of w; got shape {np.shape(vocab_order)}."
        )
    if not _checks.is_traced(vocab_order):
        ids = np.asarray(vocab_order)
        if np.any((ids < 0) | (ids >= vocab_size)):
            bad = ids[(ids < 0) | (ids >= vocab_size)][0]
            raise ValueError(
                f"vocab_order must be a permutation of range({vocab_size}); "
                f"it holds {bad}, out of range."
            )
        counts = np.bincount(ids, minlength=vocab_size)
        if np.any(counts != 1):
            raise ValueError(
                f"vocab_order must be a permutation of range({vocab_size}); "
                f"it repeats {int(np.argmax(counts > 1))} and lacks "
                f"{int(np.argmax(counts == 0))}."
            )
    return jnp.asarray(vocab_order, jnp.int32)


def frequency_order(counts: jax.typing.ArrayLike) -> np.ndarray:
    """The vocabulary's rows by token count, most frequent first.

    ``order = argsort(-counts)``, stable: tokens of equal count keep the
    order of their ids. ``counts: [V]`` (e.g. of the training data,
    ``np.bincount(tokens, minlength=V)``); returns ``[V]`` int32, a
    ``vocab_order`` of the fused losses.

    Examples:
        >>> frequency_order([3, 0, 7, 3])
        array([2, 0, 3, 1], dtype=int32)

    References:
        Wijmans et al., `Cut Your Losses in Large-Vocabulary Language Models
        <https://arxiv.org/abs/2411.09009>`_, 2024 (vocabulary sorting).
    """
    counts = np.asarray(counts)
    _checks.check_rank("counts", counts, 1, "[V]")
    if counts.size and not np.issubdtype(counts.dtype, np.number):
        raise TypeError(f"counts must be numbers; got dtype {counts.dtype}.")
    return np.argsort(-counts.astype(np.float64), kind="stable").astype(np.int32)


def mean_logit_order(h, w, bias=None, *, scale=None, weights=None) -> jax.Array:
    r"""The rows by their mean logit over the tokens, largest first.

    .. math::
        \bar z_i = \frac{\sum_t a_t\, (s\, w_i \cdot h_t + b_i)}{\sum_t a_t}
            = s\, w_i \cdot \bar h + b_i,

    with :math:`a_t = [\mathrm{weights}_t \ne 0]` (all tokens when None) and
    the logits before the softcap (which does not change their order), so
    one ``[V, D] x [D]`` product; ``order = argsort(-z_bar)``, stable (ties
    by id). ``h: [N, D]``, ``w: [V, D]``, ``bias: [V]``; returns ``[V]``
    int32. It gets no gradient.

    Examples:
        >>> w = jnp.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
        >>> mean_logit_order(jnp.array([[1.0, 2.0], [1.0, 0.0]]), w)
        Array([0, 1, 2], dtype=int32)

    References:
        Wijmans et al., `Cut Your Losses in Large-Vocabulary Language Models
        <https://arxiv.org/abs/2411.09009>`_, 2024 (vocabulary sorting).
    """
    h, w = lax.stop_gradient((h, w))
    live = jnp.ones(h.shape[:1], jnp.float32) if weights is None else weights != 0
    live = live.astype(jnp.float32)
    mean_h = live @ h.astype(jnp.float32) / jnp.maximum(jnp.sum(live), 1.0)
    score = w.astype(jnp.float32) @ mean_h
    if scale is not None:
        score = score * scale
    if bias is not None:
        score = score + lax.stop_gradient(bias).astype(jnp.float32)
    return jnp.argsort(-score, stable=True).astype(jnp.int32)


def inverse_order(order: jax.Array) -> jax.Array:
    """``inverse[order[k]] = k``: where each of the caller's rows went.

    Examples:
        >>> inverse_order(jnp.array([2, 0, 1]))
        Array([1, 2, 0], dtype=int32)
    """
    rows = jnp.arange(order.shape[0], dtype=jnp.int32)
    return jnp.zeros_like(rows).at[order].set(rows, unique_indices=True)


@jax.custom_vjp
def _rows(x, order, inverse):
    """``x[order]``; its gradient is ``g[inverse]``, a gather rather than
    autodiff's scatter-add."""
    return jnp.take(x, order, axis=0)


def _rows_fwd(x, order, inverse):
    return jnp.take(x, order, axis=0), inverse


def _rows_bwd(inverse, g):
    return jnp.take(g, inverse, axis=0), None, None


_rows.defvjp(_rows_fwd, _rows_bwd)


def sorted_call(core, plan, h, w, bias, loss_scalars, loss_weights, inputs, order):
    """``core(plan, h, w, bias, ...)`` (the sweep's custom VJP) over the rows
    of ``w`` in ``order`` (:func:`check_vocab_order`'s), as the caller sees
    it: inputs mapped into the order, outputs and gradients back out."""
    if plan.vocab_axis is not None:
        check_vocab_order(order, plan.num_rows, split=True)
    if isinstance(order, str):
        order = mean_logit_order(h, w, bias, scale=plan.scale, weights=loss_weights)
    order = lax.stop_gradient(order)
    inverse = inverse_order(order)
    token_inputs, row_inputs = inputs
    objective, outputs = core(
        plan,
        h,
        _rows(w, order, inverse),
        None if bias is None else _rows(bias, order, inverse),
        loss_scalars,
        loss_weights,
        (
            plan.rule.sorted_inputs(token_inputs, order, inverse),
            jax.tree.map(lambda x: jnp.take(x, order, axis=0), row_inputs),
        ),
    )
    return objective, plan.rule.caller_outputs(outputs, order)
