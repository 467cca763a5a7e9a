r"""The blocked sweep behind :func:`lmhead.fused.fused_cross_entropy`, and its custom VJP.

One piece because the forward sweep, the gradients it computes on the way
and the backward rule share one plan and one block iteration: the custom
VJP's residuals are the sweep's own results.

How it works. Every option of the loss is a function of three statistics of
each token's logits ``z`` -- ``lse = logsumexp(z)``, the label's logit
``z_y`` and ``sum_i z_i`` -- (see :func:`lmhead.losses.token_losses`), and
accuracy needs the argmax. So the forward pass sweeps over chunks of tokens,
computes a chunk's logits, reduces them to these four numbers per token and
drops them. For a loss :math:`L` of the statistics, the gradient with
respect to the logits is

.. math::
    \frac{\partial L}{\partial z_{i}} = \alpha\, p_{i}
        + \beta\, [i = y] + \gamma, \qquad
    p_i = e^{z_i - \mathrm{lse}}, \quad
    (\alpha, \beta, \gamma) = \Big(\frac{\partial L}{\partial \mathrm{lse}},
        \frac{\partial L}{\partial z_y},
        \frac{\partial L}{\partial \textstyle\sum_i z_i}\Big),

(e.g. :math:`\alpha = 1 + 2\lambda_z\,\mathrm{lse}`,
:math:`\beta = -(1-\epsilon)`, :math:`\gamma = -\epsilon / V` for uniform
smoothing), times :math:`1 - (z_i / c)^2` through a softcap :math:`c`, times
the scale :math:`s` before the matmul. Because :math:`(\alpha, \beta,
\gamma)` of a reduced (``"mean"`` or ``"sum"``) loss are known as soon as a
chunk's ``lse`` is, the differentiated forward pass computes ``dh``, ``dw``
and ``dbias`` in the same sweep, from the chunk's logits while they are still
in cache: three matmuls per chunk and no recomputation. Any other cotangent
(``reduction="none"``, or differentiating a metric) is handled by a second
sweep that recomputes the logits.

Split vocabulary. With :class:`lmhead.fused.VocabShards` (what
``vocab_parallel.vocab_parallel_cross_entropy`` passes), each device holds ``V/m``
rows of ``w`` inside ``shard_map`` and runs the same sweep on them: after a
chunk's blocks, the online logsumexp goes one step further, across devices
(``pmax`` of the running max, ``psum`` of the rescaled sums, the label logits
and the logit sums). Every device then knows the chunk's global ``lse`` and
:math:`(\alpha, \beta, \gamma)`, so it computes its rows' ``dw`` and its
share of ``dh`` in the same sweep; the sum of the shares is ``dh``. The
custom VJP has no symbolic zeros, which ``shard_map`` does not support: the
second sweep is skipped at run time when the statistics' cotangent is zero
(under ``jit`` XLA removes it when that zero is a constant).

Traced loss options. ``label_smoothing`` and ``z_loss`` may be traced (an
ensemble's members, one value each under ``vmap`` or ``lax.map``): they
then reach the sweep as the operand ``loss_scalars`` of :func:`fused_core`,
whose gradient is exact, and :class:`Plan` holds None for them. A concrete
value stays a Python float in the plan, compiled in, so a single run's
program and numbers are those it always had.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from lmhead import head, losses
from lmhead.head import NEG_INF

_CONTRACT_COLUMNS = (((1,), (1,)), ((), ()))  # [a, D] x [b, D] -> [a, b]
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # [V, a] x [V, b] -> [a, b]
_MATMUL = (((1,), (0,)), ((), ()))  # [a, k] x [k, b] -> [a, b]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static part of a call: loss options, block sizes, vocabulary split."""

    vocab_size: int  # V of the loss, all devices' rows together
    num_rows: int  # rows of w on this device: V, or V / devices along vocab_axis
    vocab_axis: str | None  # the mesh axis w's rows are split over, if any
    chunk_size: int
    block_rows: int  # vocabulary rows per block
    keep_logits: bool  # a chunk's [V, Nc] logits computed once and kept
    # A concrete value is compiled in, as a Python float; None means it is
    # traced and read from fused_core's loss_scalars operand.
    label_smoothing: float | None
    smoothing: str
    z_loss: float | None
    scale: float | None
    softcap: float | None
    precision: jax.lax.PrecisionLike
    grads_in_forward: bool
    # Chunks of weight-0 tokens are skipped, weighted tokens packed first.
    skip_zero_weights: bool = False
    # A fifth statistic, each token's entropy, with its gradient.
    entropy: bool = False

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.block_rows)

    def first_row(self) -> jax.Array | int:
        """The vocabulary id of this device's first row of ``w``."""
        if self.vocab_axis is None:
            return 0
        return lax.axis_index(self.vocab_axis) * self.num_rows

    def token_loss(self, loss_scalars, lse, label_logit, logit_sum):
        """``losses.token_losses``' loss; ``loss_scalars: [2]`` float32 holds
        ``(label_smoothing, z_loss)``, used where the plan holds None."""
        return losses.token_losses(
            lse,
            label_logit,
            logit_sum,
            self.vocab_size,
            label_smoothing=(
                loss_scalars[0]
                if self.label_smoothing is None
                else self.label_smoothing
            ),
            smoothing=self.smoothing,
            z_loss=loss_scalars[1] if self.z_loss is None else self.z_loss,
        )[0]

    def dot(self, a, b, dims):
        return lax.dot_general(
            a, b, dims, precision=self.precision, preferred_element_type=jnp.float32
        )


def _new_positions(start: jax.Array, first_new: jax.Array, size: int) -> jax.Array:
    """Marks the positions of a clamped block that no earlier block covered.

    The last block of a ragged axis starts at ``length - size`` instead of
    running past the end, so it overlaps the previous one; the overlap is
    masked rather than padded, and nothing is indexed out of range.
    """
    return start + jnp.arange(size) >= first_new


def _block_start(index: jax.Array, size: int, length: int) -> jax.Array:
    return jnp.minimum(index * size, length - size)


def _logits(plan, h_chunk, w_block, bias_block):
    """``[Vb, Nc]`` float32 logits, vocabulary-major, as ``head.unembed``."""
    z = plan.dot(w_block, h_chunk, _CONTRACT_COLUMNS)
    if plan.scale is not None:
        z = z * plan.scale
    if bias_block is not None:
        z = z + bias_block.astype(jnp.float32)[:, None]
    if plan.softcap is not None:
        z = head.apply_softcap(z, plan.softcap)
    return z


def _vocab_blocks(plan, h_chunk, w, bias, kept):
    """``block(j) -> (v0, is_new [Vb, 1], w_block, logits [Vb, Nc])``.

    The logits are sliced from ``kept`` (the chunk's whole logits) when given,
    and computed from ``w``'s rows otherwise.
    """
    rows = plan.block_rows

    def block(j):
        v0 = _block_start(j, rows, plan.num_rows)
        w_block = lax.dynamic_slice_in_dim(w, v0, rows)
        if kept is not None:
            z = lax.dynamic_slice_in_dim(kept, v0, rows)
        else:
            bias_block = (
                None if bias is None else lax.dynamic_slice_in_dim(bias, v0, rows)
            )
            z = _logits(plan, h_chunk, w_block, bias_block)
        return v0, _new_positions(v0, j * rows, rows)[:, None], w_block, z

    return block


def _finite(peak):
    """A running max as the reference of ``exp(z - max)``, with 0 for a max
    of -inf (every logit so far -inf, e.g. a block of banned tokens), where
    ``-inf - (-inf)`` would make the sum NaN rather than 0."""
    return jnp.where(peak == NEG_INF, 0.0, peak)


def _block_stats(z, labels, v0, is_new, entropy=False):
    """Per-token max, sum of exp(z - max), label logit, logit sum, argmax,
    and with ``entropy`` the sum of ``exp(z - max) * (z - max)``."""
    live = jnp.where(is_new, z, NEG_INF)
    peak = jnp.max(live, axis=0)
    exp = jnp.exp(live - _finite(peak))
    sum_exp = jnp.sum(exp, axis=0)
    logit_sum = jnp.sum(jnp.where(is_new, z, 0.0), axis=0)
    # A gather of one logit per token, not a masked pass over the block.
    rows = z.shape[0]
    row = labels - v0
    safe_row = jnp.clip(row, 0, rows - 1)
    label_logit = jnp.take_along_axis(z, safe_row[None, :], axis=0)[0]
    counted = (row >= 0) & (row < rows) & is_new[safe_row, 0]
    label_logit = jnp.where(counted, label_logit, 0.0)
    # The first row that attains the max, as jnp.argmax; a float min-reduce
    # is several times faster on CPU than XLA's (value, index) reduce, and
    # float32 holds row numbers exactly up to 2^24.
    index = lax.broadcasted_iota(jnp.float32, z.shape, 0)
    first = jnp.min(jnp.where(live == peak, index, jnp.inf), axis=0)
    argmax = v0 + jnp.minimum(first, rows - 1).astype(jnp.int32)
    if not entropy:
        return peak, sum_exp, label_logit, logit_sum, argmax
    # 0 where exp(z - max) is 0 (a logit of -inf), not 0 * -inf.
    tilted = jnp.sum(jnp.where(exp > 0, exp * (live - peak), 0.0), axis=0)
    return peak, sum_exp, label_logit, logit_sum, argmax, tilted


def _rescaled_tilt(tilted, sum_exp, peak, new_peak):
    """``sum e_i (z_i - m)`` re-based from the max ``m = peak`` to ``new_peak``:
    ``e^(m - M) (t + (m - M) s)``; 0 while nothing is summed (``s = 0``)."""
    shift = peak - new_peak
    return jnp.where(sum_exp > 0, jnp.exp(shift) * (tilted + shift * sum_exp), 0.0)


def _combine_devices(plan, peak, sum_exp, label_logit, logit_sum, argmax, *tilted):
    """The statistics of the whole vocabulary from each device's rows.

    The online logsumexp of the blocks, once more across devices: ``pmax``
    of the running max, ``psum`` of the rescaled sums of exponentials and of
    the sums; every device then holds the same values.
    """
    axis = plan.vocab_axis
    top = lax.pmax(peak, axis)
    tilted = tuple(
        lax.psum(_rescaled_tilt(t, sum_exp, peak, top), axis) for t in tilted
    )
    sum_exp = lax.psum(sum_exp * jnp.exp(peak - _finite(top)), axis)
    # Ties go to the lowest index, as jnp.argmax does.
    argmax = lax.pmin(
        jnp.where(peak == top, argmax + plan.first_row(), plan.vocab_size), axis
    )
    return (
        top,
        sum_exp,
        lax.psum(label_logit, axis),
        lax.psum(logit_sum, axis),
        argmax,
        *tilted,
    )


def _chunk_stats(plan, h_chunk, w, bias, labels):
    """``(kept logits or None, (lse, label_logit, logit_sum, argmax[, entropy]))``.

    Block by block, with a running max and rescaled sum of exponentials
    (an online logsumexp), so no temporary is larger than one block.
    ``labels`` count from this device's first row; the statistics are those
    of all devices' rows. The entropy is ``log s - t / s`` with ``s = sum_i
    e^(z_i - m)`` and ``t = sum_i e^(z_i - m) (z_i - m)``, both re-based to
    each new running max ``m``: ``lse - E_p[z]`` without ``p`` or ``log p``.
    """
    kept = _logits(plan, h_chunk, w, bias) if plan.keep_logits else None
    block = _vocab_blocks(plan, h_chunk, w, bias, kept)

    def merge(j, carry):
        peak, sum_exp, label_logit, logit_sum, argmax, *tilted = carry
        v0, is_new, _, z = block(j)
        b_peak, b_sum_exp, b_label, b_sum, b_arg, *b_tilted = _block_stats(
            z, labels, v0, is_new, plan.entropy
        )
        new_peak = jnp.maximum(peak, b_peak)
        tilted = tuple(
            _rescaled_tilt(t, sum_exp, peak, new_peak)
            + _rescaled_tilt(b_t, b_sum_exp, b_peak, new_peak)
            for t, b_t in zip(tilted, b_tilted)
        )
        reference = _finite(new_peak)
        sum_exp = sum_exp * jnp.exp(peak - reference) + b_sum_exp * jnp.exp(
            b_peak - reference
        )
        # Strictly greater: on ties the earlier block (lower index) wins,
        # as jnp.argmax does.
        argmax = jnp.where(b_peak > peak, b_arg, argmax)
        return (
            new_peak,
            sum_exp,
            label_logit + b_label,
            logit_sum + b_sum,
            argmax,
            *tilted,
        )

    # zeros_like keeps h's mesh axes, which a loop carry must keep inside
    # shard_map.
    zeros = jnp.zeros_like(h_chunk[:, 0], jnp.float32)
    init = (zeros + NEG_INF, zeros, zeros, zeros, zeros.astype(jnp.int32))
    init += (zeros,) if plan.entropy else ()
    stats = lax.fori_loop(0, plan.num_blocks, merge, init)
    if plan.vocab_axis is not None:
        stats = _combine_devices(plan, *stats)
    peak, sum_exp, label_logit, logit_sum, argmax, *tilted = stats
    entropy = tuple(jnp.log(sum_exp) - t / sum_exp for t in tilted)
    return kept, (peak + jnp.log(sum_exp), label_logit, logit_sum, argmax, *entropy)


def _logit_grads(plan, z, lse, coefs, labels, v0, live):
    """``dL/du`` for the pre-softcap logits ``u`` of one block, ``[Vb, Nc]``.

    ``live: [Vb, Nc]`` masks out rows of an overlapping block and tokens that
    add nothing (whose logits may not even be finite). ``coefs`` are
    ``(alpha, beta, gamma)``, and ``(c, H)`` after them for a cotangent ``c``
    on the entropy ``H``: ``dH/dz_i = -p_i (log p_i + H)``.
    """
    alpha, beta, gamma, *entropy = coefs
    token_ids = v0 + lax.broadcasted_iota(jnp.int32, z.shape, 0)
    p = jnp.exp(z - lse)
    dz = alpha * p + jnp.where(token_ids == labels, beta, 0.0) + gamma
    if entropy:
        c, ent = entropy
        # 0 where p is 0 (a logit of -inf), not 0 * -inf.
        dz = dz - jnp.where(p > 0, c * p * (z - lse + ent), 0.0)
    if plan.softcap is not None:
        # d/du c tanh(u / c) = 1 - tanh^2 = 1 - (z / c)^2.
        dz = dz * (1.0 - jnp.square(z / plan.softcap))
    return jnp.where(live, dz, 0.0)


def _add_rows(total, start, update):
    """``total[start:start + len(update)] += update``, in place under jit."""
    rows = lax.dynamic_slice_in_dim(total, start, update.shape[0])
    return lax.dynamic_update_slice_in_dim(total, rows + update, start, 0)


def _chunk_grads(plan, h_chunk, active, w, bias, labels, kept, lse, coefs, grads):
    """One token chunk's ``dh: [Nc, D]`` and its additions to ``dw``, ``db``.

    ``kept`` is the chunk's ``[V, Nc]`` logits when the forward sweep holds
    them; otherwise the logits are computed again, block by block. Tokens
    not ``active`` contribute nothing: their rows of ``h`` are zeroed for the
    ``dw`` matmul, so that even a non-finite one cannot reach ``dw``.
    """
    want_dh, dw, db = grads
    h_active = jnp.where(active[:, None], h_chunk, 0.0)
    if plan.keep_logits and kept is None:
        kept = _logits(plan, h_chunk, w, bias)
    block = _vocab_blocks(plan, h_chunk, w, bias, kept)
    scale = 1.0 if plan.scale is None else plan.scale

    def step(j, carry):
        dh_chunk, dw, db = carry
        v0, is_new, w_block, z = block(j)
        dz = _logit_grads(plan, z, lse, coefs, labels, v0, is_new & active)
        dz_in = dz.astype(h_chunk.dtype)
        if dh_chunk is not None:
            dh_chunk = dh_chunk + scale * plan.dot(dz_in, w_block, _CONTRACT_ROWS)
        if dw is not None:
            dw = _add_rows(dw, v0, scale * plan.dot(dz_in, h_active, _MATMUL))
        if db is not None:
            db = _add_rows(db, v0, jnp.sum(dz, axis=1))
        return dh_chunk, dw, db

    dh_chunk = jnp.zeros_like(h_chunk, jnp.float32) if want_dh else None
    return lax.fori_loop(0, plan.num_blocks, step, (dh_chunk, dw, db))


def _loss_coefs(plan, loss_scalars, stats, loss_weights):
    """``loss_weights * dL/d(lse, label_logit, logit_sum)``, token by token."""
    _, pullback = jax.vjp(functools.partial(plan.token_loss, loss_scalars), *stats)
    return pullback(loss_weights)


def _sweep(
    plan,
    h,
    w,
    bias,
    loss_scalars,
    labels,
    loss_weights,
    *,
    grads=None,
    lse=None,
    coefs=None,
):
    """One pass over chunks of tokens.

    Three uses: statistics only (``grads`` is None: the primal); statistics
    and the gradient of ``sum_t loss_weights_t * L_t`` (the differentiated
    forward pass); or, given ``lse`` and per-token ``coefs``, the gradient
    they define (recomputing the logits). Gradients are added to ``grads``,
    ``(dh, dw, db)`` with None for one not wanted. Tokens of weight 0 never
    contribute to a gradient.

    With ``plan.skip_zero_weights`` the tokens are first put in the order of
    a stable argsort of ``loss_weights == 0`` (weighted tokens first, each
    group in its own order), and the loop runs over the
    ``ceil(#weighted / chunk_size)`` chunks that hold a weighted token only
    (a ``while`` loop: the count is traced, every shape static); statistics
    and ``dh`` are put back in the tokens' order after it. When every token
    is weighted the order is the identity and the chunks are those of the
    unpacked sweep. Tokens in skipped chunks get statistics 0.

    Returns:
        ``(stats, grads)``; ``stats`` is ``(lse, label_logit, logit_sum,
        argmax[, entropy])``, each ``[N]`` (None when ``coefs`` are given).
    """
    n, size = h.shape[0], plan.chunk_size
    # One chunk is computed as before: a while loop of one trip is compiled
    # apart from what surrounds it, and may round differently.
    if not plan.skip_zero_weights or n <= size:
        return _chunk_loop(
            plan,
            h,
            w,
            bias,
            loss_scalars,
            labels,
            loss_weights,
            grads,
            lse,
            coefs,
            num_chunks=-(-n // size),
        )
    weighted = loss_weights != 0
    order = jnp.argsort(jnp.logical_not(weighted), stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=order.dtype))
    num_chunks = (jnp.sum(weighted, dtype=jnp.int32) + size - 1) // size

    # asarray: custom_vjp may pass a constant argument as a numpy array.
    def packed(x):
        return None if x is None else jnp.asarray(x)[order]

    def unpacked(x):
        return None if x is None else x[inverse]

    dh, dw, db = (None, None, None) if grads is None else grads
    stats, (dh, dw, db) = _chunk_loop(
        plan,
        packed(h),
        w,
        bias,
        loss_scalars,
        packed(labels),
        packed(loss_weights),
        None if grads is None else (packed(dh), dw, db),
        packed(lse),
        None if coefs is None else tuple(packed(c) for c in coefs),
        num_chunks=num_chunks,
    )
    stats = None if stats is None else tuple(unpacked(s) for s in stats)
    return stats, (unpacked(dh), dw, db)


def _chunk_loop(
    plan, h, w, bias, loss_scalars, labels, loss_weights, grads, lse, coefs, num_chunks
):
    """:func:`_sweep`'s loop over the first ``num_chunks`` chunks of tokens."""
    n, size = h.shape[0], plan.chunk_size
    # zeros_like keeps the mesh axes of the inputs, which a loop carry must
    # keep inside shard_map: the statistics vary as the tokens do.
    stats = (
        None
        if coefs is not None
        else (
            (jnp.zeros_like(loss_weights),) * 3
            + (jnp.zeros_like(labels),)
            + (jnp.zeros_like(loss_weights),) * plan.entropy
        )
    )
    label_rows = labels - plan.first_row()

    def body(i, carry):
        stats, (dh, dw, db) = carry
        start = _block_start(i, size, n)
        is_new = _new_positions(start, i * size, size)

        def chunk(x):
            return lax.dynamic_slice_in_dim(x, start, size)

        h_chunk, chunk_labels = chunk(h), chunk(label_rows)
        if coefs is None:
            z, new = _chunk_stats(plan, h_chunk, w, bias, chunk_labels)
            stats = tuple(
                lax.dynamic_update_slice_in_dim(
                    s, jnp.where(is_new, x, chunk(s)), start, 0
                )
                for s, x in zip(stats, new)
            )
            if grads is None:
                return stats, (dh, dw, db)
            chunk_lse = new[0]
            chunk_coefs = _loss_coefs(plan, loss_scalars, new[:3], chunk(loss_weights))
        else:
            z, chunk_lse = None, chunk(lse)
            chunk_coefs = tuple(chunk(c) for c in coefs)
        # Not a token of an earlier chunk, and of nonzero weight: 0 * NaN is
        # NaN, so the others are masked rather than multiplied by 0.
        active = is_new & (chunk(loss_weights) != 0)
        chunk_coefs = tuple(jnp.where(active, c, 0.0) for c in chunk_coefs)
        dh_chunk, dw, db = _chunk_grads(
            plan,
            h_chunk,
            active,
            w,
            bias,
            chunk_labels,
            z,
            chunk_lse,
            chunk_coefs,
            (dh is not None, dw, db),
        )
        if dh is not None:
            dh = _add_rows(dh, start, dh_chunk)
        return stats, (dh, dw, db)

    init = (None, None, None) if grads is None else grads
    return lax.fori_loop(0, num_chunks, body, (stats, init))


def _objective(plan, loss_scalars, stats, loss_weights):
    """``sum_t w_t L_t`` by the rule of ``losses.weighted_metrics``."""
    token_loss = plan.token_loss(loss_scalars, *stats[:3])
    zeros = jnp.zeros_like(token_loss)
    return losses.weighted_metrics(
        token_loss, zeros, zeros, zeros, loss_weights, zeros, "sum"
    )[0]


def _zero_grads(h, w, bias):
    return tuple(
        None if x is None else jnp.zeros_like(x, jnp.float32) for x in (h, w, bias)
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_core(plan, h, w, bias, loss_scalars, loss_weights, labels):
    """``(sum_t loss_weights_t * L_t, stats)`` without keeping any logits.

    ``loss_scalars: [2]`` float32 is ``(label_smoothing, z_loss)``, read
    where ``plan`` holds None for them (traced values, e.g. one per member
    of a ``vmap``); its gradient, like that of ``loss_weights``, is exact.
    Inside ``shard_map``, ``h``, ``w`` and ``bias`` must vary over the same
    mesh axes (``lax.pcast``): each one's gradient is a product of the
    others, and a cotangent has the type of its input; ``loss_scalars``
    must vary over the axes of the tokens.
    """
    stats, _ = _sweep(plan, h, w, bias, loss_scalars, labels, loss_weights)
    return _objective(plan, loss_scalars, stats, loss_weights), stats


# The rule has no symbolic zeros, which shard_map does not support: every
# input is taken to be differentiated, and a zero cotangent of the statistics
# is told from a nonzero one at run time.
def _fused_core_fwd(plan, h, w, bias, loss_scalars, loss_weights, labels):
    stats, saved = _sweep(
        plan,
        h,
        w,
        bias,
        loss_scalars,
        labels,
        loss_weights,
        grads=_zero_grads(h, w, bias) if plan.grads_in_forward else None,
    )
    residuals = (h, w, bias, loss_scalars, loss_weights, labels, stats, saved)
    objective = _objective(plan, loss_scalars, stats, loss_weights)
    return (objective, stats), residuals


def _fused_core_bwd(plan, residuals, cotangents):
    h, w, bias, loss_scalars, loss_weights, labels, stats, saved = residuals
    d_objective, d_stats = cotangents
    coefs = d_stats[:3]
    if plan.grads_in_forward:
        grads = tuple(None if g is None else d_objective * g for g in saved)
    else:
        grads = _zero_grads(h, w, bias)
        objective_coefs = _loss_coefs(
            plan, loss_scalars, stats[:3], d_objective * loss_weights
        )
        coefs = tuple(c + o for c, o in zip(coefs, objective_coefs))
    # The entropy's cotangent, and the entropy its gradient needs.
    coefs += (d_stats[4], stats[4]) if plan.entropy else ()

    def recompute(grads):
        # A cotangent on the statistics themselves (a metric or the unreduced
        # loss is differentiated): the logits are needed again.
        return _sweep(
            plan,
            h,
            w,
            bias,
            loss_scalars,
            labels,
            loss_weights,
            grads=grads,
            lse=stats[0],
            coefs=coefs,
        )[1]

    grads = lax.cond(
        jnp.any(jnp.stack(coefs[:4]) != 0), recompute, lambda grads: grads, grads
    )
    # The statistics do not depend on loss_scalars or loss_weights: their
    # gradients are those of the objective alone.
    _, pullback = jax.vjp(
        lambda s, x: _objective(plan, s, stats, x), loss_scalars, loss_weights
    )
    d_scalars, d_weights = pullback(d_objective)
    dh, dw, db = (
        None if g is None else g.astype(x.dtype) for g, x in zip(grads, (h, w, bias))
    )
    return dh, dw, db, d_scalars, d_weights, None


fused_core.defvjp(_fused_core_fwd, _fused_core_bwd)
