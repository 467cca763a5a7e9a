r"""Linear + cross-entropy that never builds the ``[N, V]`` logits.

For a vocabulary of tens of thousands of tokens the logits dominate the
memory of a training step: ``N`` tokens times ``V`` classes in float32, once
for the values and once for their gradient. :func:`fused_cross_entropy`
computes the same loss and metrics as
``losses.cross_entropy(head.unembed(h, w, bias, ...), labels, ...)`` while
holding the logits of one block of tokens at a time.

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

Blocks. The forward sweep computes a chunk's logits ``[V, chunk_size]`` with
one matmul and keeps them while it reduces them (an online logsumexp) and
turns them into gradients, ``VOCAB_BLOCK_ROWS`` vocabulary rows at a time.
The kept logits are the largest temporary, so by default ``chunk_size`` is
``BLOCK_ELEMENTS // V`` clipped to ``[MIN_CHUNK_SIZE, MAX_CHUNK_SIZE]``. On
CPU (``2**22`` numbers, 16 MiB; 1024-row blocks) each vocabulary block
stays in a core's cache and the matmuls stay large enough to run near the
machine's matmul rate; on GPU and TPU (``2**26`` numbers, 16384-row blocks)
there are fewer, larger kernels, still a small fraction of the device's
memory. The ``dw`` matmul contracts over the chunk's tokens, so chunks much
smaller than 128 tokens make it slow. With ``vocab_chunk_size`` the logits
are computed that many rows at a time, twice (statistics, then gradients),
as Cut Cross-Entropy does: no temporary grows with ``V``, at the price of a
fourth matmul.

Split vocabulary. With :class:`VocabShards` (what
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
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from lmhead import _checks, head, losses

# Default block sizes by platform (``jax.default_backend()``), see the module
# docstring: numbers in one chunk's kept logits, and vocabulary rows per block
# of the elementwise work and of each ``dw`` update (XLA does not accumulate
# into a matmul's output, so an update needs a ``[rows, D]`` temporary).
BLOCK_ELEMENTS = {"cpu": 2**22, "gpu": 2**26, "tpu": 2**26}
VOCAB_BLOCK_ROWS = {"cpu": 1024, "gpu": 16384, "tpu": 16384}
MIN_CHUNK_SIZE = 128
MAX_CHUNK_SIZE = 1024

_CONTRACT_COLUMNS = (((1,), (1,)), ((), ()))  # [a, D] x [b, D] -> [a, b]
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # [V, a] x [V, b] -> [a, b]
_MATMUL = (((1,), (0,)), ((), ()))  # [a, k] x [k, b] -> [a, b]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static part of a call: loss options, block sizes, vocabulary split."""

    vocab_size: int  # V of the loss, all devices' rows together
    num_rows: int  # rows of w on this device: V, or V / devices along vocab_axis
    vocab_axis: str | None  # the mesh axis w's rows are split over, if any
    chunk_size: int
    block_rows: int  # vocabulary rows per block
    keep_logits: bool  # a chunk's [V, Nc] logits computed once and kept
    label_smoothing: float
    smoothing: str
    z_loss: float
    scale: float | None
    softcap: float | None
    precision: jax.lax.PrecisionLike
    grads_in_forward: bool

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.block_rows)

    def first_row(self) -> jax.Array | int:
        """The vocabulary id of this device's first row of ``w``."""
        if self.vocab_axis is None:
            return 0
        return lax.axis_index(self.vocab_axis) * self.num_rows

    def token_loss(self, lse, label_logit, logit_sum):
        return losses.token_losses(
            lse,
            label_logit,
            logit_sum,
            self.vocab_size,
            label_smoothing=self.label_smoothing,
            smoothing=self.smoothing,
            z_loss=self.z_loss,
        )[0]

    def dot(self, a, b, dims):
        return lax.dot_general(
            a, b, dims, precision=self.precision, preferred_element_type=jnp.float32
        )


def _fresh(start: jax.Array, first_new: jax.Array, size: int) -> jax.Array:
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
    """``block(j) -> (v0, fresh [Vb, 1], w_block, logits [Vb, Nc])``.

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
        return v0, _fresh(v0, j * rows, rows)[:, None], w_block, z

    return block


def _block_stats(z, labels, v0, fresh):
    """Per-token max, sum of exp(z - max), label logit, logit sum, argmax."""
    live = jnp.where(fresh, z, -jnp.inf)
    peak = jnp.max(live, axis=0)
    sum_exp = jnp.sum(jnp.exp(live - peak), axis=0)
    logit_sum = jnp.sum(jnp.where(fresh, z, 0.0), axis=0)
    # A gather of one logit per token, not a masked pass over the block.
    rows = z.shape[0]
    row = labels - v0
    safe_row = jnp.clip(row, 0, rows - 1)
    label_logit = jnp.take_along_axis(z, safe_row[None, :], axis=0)[0]
    counted = (row >= 0) & (row < rows) & fresh[safe_row, 0]
    label_logit = jnp.where(counted, label_logit, 0.0)
    # The first row that attains the max, as jnp.argmax; a float min-reduce
    # is several times faster on CPU than XLA's (value, index) reduce, and
    # float32 holds row numbers exactly up to 2^24.
    index = lax.broadcasted_iota(jnp.float32, z.shape, 0)
    first = jnp.min(jnp.where(live == peak, index, jnp.inf), axis=0)
    argmax = v0 + jnp.minimum(first, rows - 1).astype(jnp.int32)
    return peak, sum_exp, label_logit, logit_sum, argmax


def _combine_devices(plan, peak, sum_exp, label_logit, logit_sum, argmax):
    """The statistics of the whole vocabulary from each device's rows.

    The online logsumexp of the blocks, once more across devices: ``pmax``
    of the running max, ``psum`` of the rescaled sums of exponentials and of
    the sums; every device then holds the same values.
    """
    axis = plan.vocab_axis
    top = lax.pmax(peak, axis)
    sum_exp = lax.psum(sum_exp * jnp.exp(peak - top), axis)
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
    )


def _chunk_stats(plan, h_chunk, w, bias, labels):
    """``(kept logits or None, (lse, label_logit, logit_sum, argmax))``.

    Block by block, with a running max and rescaled sum of exponentials
    (an online logsumexp), so no temporary is larger than one block.
    ``labels`` count from this device's first row; the statistics are those
    of all devices' rows.
    """
    kept = _logits(plan, h_chunk, w, bias) if plan.keep_logits else None
    block = _vocab_blocks(plan, h_chunk, w, bias, kept)

    def merge(j, carry):
        peak, sum_exp, label_logit, logit_sum, argmax = carry
        v0, fresh, _, z = block(j)
        b_peak, b_sum_exp, b_label, b_sum, b_arg = _block_stats(z, labels, v0, fresh)
        new_peak = jnp.maximum(peak, b_peak)
        sum_exp = sum_exp * jnp.exp(peak - new_peak) + b_sum_exp * jnp.exp(
            b_peak - new_peak
        )
        # Strictly greater: on ties the earlier block (lower index) wins,
        # as jnp.argmax does.
        argmax = jnp.where(b_peak > peak, b_arg, argmax)
        return (new_peak, sum_exp, label_logit + b_label, logit_sum + b_sum, argmax)

    # zeros_like keeps h's mesh axes, which a loop carry must keep inside
    # shard_map.
    zeros = jnp.zeros_like(h_chunk[:, 0], jnp.float32)
    init = (zeros - jnp.inf, zeros, zeros, zeros, zeros.astype(jnp.int32))
    stats = lax.fori_loop(0, plan.num_blocks, merge, init)
    if plan.vocab_axis is not None:
        stats = _combine_devices(plan, *stats)
    peak, sum_exp, *rest = stats
    return kept, (peak + jnp.log(sum_exp), *rest)


def _logit_grads(plan, z, lse, coefs, labels, v0, live):
    """``dL/du`` for the pre-softcap logits ``u`` of one block, ``[Vb, Nc]``.

    ``live: [Vb, Nc]`` masks out rows of an overlapping block and tokens that
    add nothing (whose logits may not even be finite).
    """
    alpha, beta, gamma = coefs
    token_ids = v0 + lax.broadcasted_iota(jnp.int32, z.shape, 0)
    dz = alpha * jnp.exp(z - lse) + jnp.where(token_ids == labels, beta, 0.0) + gamma
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
        v0, fresh, w_block, z = block(j)
        dz = _logit_grads(plan, z, lse, coefs, labels, v0, fresh & active)
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


def _loss_coefs(plan, stats, loss_weights):
    """``loss_weights * dL/d(lse, label_logit, logit_sum)``, token by token."""
    _, pullback = jax.vjp(plan.token_loss, *stats)
    return pullback(loss_weights)


def _sweep(plan, h, w, bias, labels, loss_weights, *, grads=None, lse=None, coefs=None):
    """One pass over chunks of tokens.

    Three uses: statistics only (``grads`` is None: the primal); statistics
    and the gradient of ``sum_t loss_weights_t * L_t`` (the differentiated
    forward pass); or, given ``lse`` and per-token ``coefs``, the gradient
    they define (recomputing the logits). Gradients are added to ``grads``,
    ``(dh, dw, db)`` with None for one not wanted. Tokens of weight 0 never
    contribute to a gradient.

    Returns:
        ``(stats, grads)``; ``stats`` is ``(lse, label_logit, logit_sum,
        argmax)``, each ``[N]`` (None when ``coefs`` are given).
    """
    n, size = h.shape[0], plan.chunk_size
    # zeros_like keeps the mesh axes of the inputs, which a loop carry must
    # keep inside shard_map: the statistics vary as the tokens do.
    stats = (
        None
        if coefs is not None
        else ((jnp.zeros_like(loss_weights),) * 3 + (jnp.zeros_like(labels),))
    )
    label_rows = labels - plan.first_row()

    def body(i, carry):
        stats, (dh, dw, db) = carry
        start = _block_start(i, size, n)
        fresh = _fresh(start, i * size, size)

        def chunk(x):
            return lax.dynamic_slice_in_dim(x, start, size)

        h_chunk, chunk_labels = chunk(h), chunk(label_rows)
        if coefs is None:
            z, new = _chunk_stats(plan, h_chunk, w, bias, chunk_labels)
            stats = tuple(
                lax.dynamic_update_slice_in_dim(
                    s, jnp.where(fresh, x, chunk(s)), start, 0
                )
                for s, x in zip(stats, new)
            )
            if grads is None:
                return stats, (dh, dw, db)
            chunk_lse = new[0]
            chunk_coefs = _loss_coefs(plan, new[:3], chunk(loss_weights))
        else:
            z, chunk_lse = None, chunk(lse)
            chunk_coefs = tuple(chunk(c) for c in coefs)
        # Not a token of an earlier chunk, and of nonzero weight: 0 * NaN is
        # NaN, so the others are masked rather than multiplied by 0.
        active = fresh & (chunk(loss_weights) != 0)
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
    return lax.fori_loop(0, -(-n // size), body, (stats, init))


def _objective(plan, stats, loss_weights):
    """``sum_t w_t L_t`` by the rule of ``losses.weighted_metrics``."""
    token_loss = plan.token_loss(*stats[:3])
    zeros = jnp.zeros_like(token_loss)
    return losses.weighted_metrics(
        token_loss, zeros, zeros, zeros, loss_weights, zeros, "sum"
    )[0]


def _zero_grads(h, w, bias):
    return tuple(
        None if x is None else jnp.zeros_like(x, jnp.float32) for x in (h, w, bias)
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_core(plan, h, w, bias, loss_weights, labels):
    """``(sum_t loss_weights_t * L_t, stats)`` without keeping any logits.

    Inside ``shard_map``, ``h``, ``w`` and ``bias`` must vary over the same
    mesh axes (``lax.pcast``): each one's gradient is a product of the
    others, and a cotangent has the type of its input.
    """
    stats, _ = _sweep(plan, h, w, bias, labels, loss_weights)
    return _objective(plan, stats, loss_weights), stats


# The rule has no symbolic zeros, which shard_map does not support: every
# input is taken to be differentiated, and a zero cotangent of the statistics
# is told from a nonzero one at run time.
def _fused_core_fwd(plan, h, w, bias, loss_weights, labels):
    stats, saved = _sweep(
        plan,
        h,
        w,
        bias,
        labels,
        loss_weights,
        grads=_zero_grads(h, w, bias) if plan.grads_in_forward else None,
    )
    residuals = (h, w, bias, loss_weights, labels, stats, saved)
    return (_objective(plan, stats, loss_weights), stats), residuals


def _fused_core_bwd(plan, residuals, cotangents):
    h, w, bias, loss_weights, labels, stats, saved = residuals
    d_objective, d_stats = cotangents
    coefs = d_stats[:3]
    if plan.grads_in_forward:
        grads = tuple(None if g is None else d_objective * g for g in saved)
    else:
        grads = _zero_grads(h, w, bias)
        objective_coefs = _loss_coefs(plan, stats[:3], d_objective * loss_weights)
        coefs = tuple(c + o for c, o in zip(coefs, objective_coefs))

    def recompute(grads):
        # A cotangent on the statistics themselves (a metric or the unreduced
        # loss is differentiated): the logits are needed again.
        return _sweep(
            plan,
            h,
            w,
            bias,
            labels,
            loss_weights,
            grads=grads,
            lse=stats[0],
            coefs=coefs,
        )[1]

    grads = lax.cond(
        jnp.any(jnp.stack(coefs) != 0), recompute, lambda grads: grads, grads
    )
    _, pullback = jax.vjp(lambda x: _objective(plan, stats, x), loss_weights)
    (d_weights,) = pullback(d_objective)
    dh, dw, db = (
        None if g is None else g.astype(x.dtype) for g, x in zip(grads, (h, w, bias))
    )
    return dh, dw, db, d_weights, None


_fused_core.defvjp(_fused_core_fwd, _fused_core_bwd)


@dataclasses.dataclass(frozen=True)
class VocabShards:
    """The rows of ``w`` split over the devices along a mesh axis.

    For ``vocab_parallel.vocab_parallel_cross_entropy``, which passes it to
    :func:`fused_cross_entropy`.

    Attributes:
        axis: the mesh axis.
        count: devices along it; it must divide ``V``.
        run: ``run(core, h, w, bias, weights, labels) -> (objective,
            stats)`` calls ``core`` (a function of the same arguments) on
            every device, with a device's tokens and its rows of ``w`` and
            ``bias`` (``[N, D]``, ``[V, D]``, ``[V]``, ``[N]``, ``[N]`` in
            all), and returns ``core``'s objective summed over the devices'
            tokens and its statistics of every token.
    """

    axis: str
    count: int
    run: Callable[..., tuple[jax.Array, tuple[jax.Array, ...]]]


def _check_inputs(h, w, bias, chunk_size, vocab_chunk_size, **static):
    _checks.check_unembed_inputs(h, w, bias)
    _checks.check_count("chunk_size", chunk_size, optional=True)
    _checks.check_count("vocab_chunk_size", vocab_chunk_size, optional=True)
    _checks.check_concrete("fused_cross_entropy", **static)
    for name in ("scale", "softcap"):
        _checks.check_in_range(name, static[name], low=0.0, low_open=True)


def _check_vocab_shards(vocab_shards, vocab_size):
    if vocab_shards is not None and vocab_size % vocab_shards.count:
        raise ValueError(
            f"w has {vocab_size} rows, which the mesh's {vocab_shards.axis!r} "
            f"axis ({vocab_shards.count}) must divide."
        )


def _block_sizes(num_tokens, num_rows, chunk_size, vocab_chunk_size):
    """``(chunk_size, block_rows, keep_logits)`` with the defaults filled in.

    ``num_tokens`` and ``num_rows`` are those of ``h`` and ``w`` on a device.
    """
    platform = jax.default_backend()
    keep_logits = vocab_chunk_size is None or vocab_chunk_size >= num_rows
    width = num_rows if keep_logits else int(vocab_chunk_size)
    if chunk_size is None:
        elements = BLOCK_ELEMENTS.get(platform, BLOCK_ELEMENTS["cpu"])
        chunk_size = min(max(elements // width, MIN_CHUNK_SIZE), MAX_CHUNK_SIZE)
    rows = (
        VOCAB_BLOCK_ROWS.get(platform, VOCAB_BLOCK_ROWS["cpu"])
        if keep_logits
        else width
    )
    return min(int(chunk_size), num_tokens), min(rows, num_rows), keep_logits


def _optional_float(x):
    return None if x is None else float(x)


def fused_cross_entropy(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    *,
    bias: jax.typing.ArrayLike | None = None,
    weights: jax.typing.ArrayLike | None = None,
    label_smoothing: float = 0.0,
    smoothing: str = "uniform",
    z_loss: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    precision: jax.lax.PrecisionLike = None,
    reduction: str = "mean",
    vocab_shards: VocabShards | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Cross-entropy of ``unembed(h, w, bias)`` without materializing logits.

    Returns what ``losses.cross_entropy(head.unembed(h, w, bias, scale=scale,
    softcap=softcap), labels, ...)`` returns -- the same loss and the same
    metrics, computed by the same :func:`lmhead.losses.token_losses` and
    :func:`lmhead.losses.weighted_metrics` from per-token statistics --
    with temporary memory ``O(chunk_size * V)`` (or ``O(chunk_size *
    vocab_chunk_size)``) instead of ``O(N * V)``:

    .. math::
        z_t = \mathrm{softcap}_c(s\, W h_t + b), \qquad
        L = \frac{\sum_t w_t \big(\mathrm{CE}_\epsilon(z_t, y_t)
            + \lambda_z\, \mathrm{lse}(z_t)^2\big)}{\sum_t w_t}.

    The gradient with respect to ``h``, ``w`` and ``bias`` is a custom VJP
    (see the module docstring for the formula): for ``reduction="mean"`` or
    ``"sum"`` it is computed during the forward sweep, from each chunk's
    logits, so a training step does the three matmuls of the materialized
    path and nothing more. Statistics and gradients accumulate in float32
    whatever the input dtype; gradients are returned in the inputs' dtypes.
    ``labels`` get no gradient; ``weights`` get the exact one.

    Labels outside ``[0, V)`` follow the rule of ``losses.cross_entropy``:
    ``ValueError`` when concrete, weight 0 and a count in
    ``metrics["invalid_labels"]`` inside ``jit``.

    Args:
        h: ``[..., D]`` hidden states (float32, bf16 or fp16).
        w: ``[V, D]`` unembedding (for a tied head, the embedding table).
        labels: ``[...]`` integer targets.
        bias: optional ``[V]``.
        weights: optional ``[...]`` per-token weights (0 for padding).
        label_smoothing, smoothing, z_loss, reduction: as in
            ``losses.cross_entropy``; must be concrete numbers.
        scale, softcap, precision: as in ``head.unembed``; concrete numbers.
        chunk_size: tokens per chunk, an integer >= 1. Default:
            ``BLOCK_ELEMENTS[platform] // width`` clipped to
            ``[MIN_CHUNK_SIZE, MAX_CHUNK_SIZE]``, where ``width`` is the
            rows of ``w`` on a device (``V``, or ``V / vocab_shards.count``)
            or ``vocab_chunk_size``.
        vocab_chunk_size: None (default) computes a chunk's logits for the
            whole vocabulary with one matmul and keeps them; an integer >= 1
            computes them that many rows at a time, twice, so that no
            temporary grows with ``V``.
        vocab_shards: None (default) on one device; see
            ``vocab_parallel.vocab_parallel_cross_entropy``, which splits the rows
            of ``w`` over devices and combines each device's statistics
            with ``pmax``/``psum`` (module docstring).

    Returns:
        ``(loss, metrics)`` as ``losses.cross_entropy`` returns them; ``loss``
        is a scalar, or ``[...]`` for ``reduction="none"``.

    Raises:
        ValueError, TypeError: for bad shapes, dtypes or options, naming the
            argument (chunk sizes must be integers >= 1).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from lmhead import head, losses
        >>> h = jax.random.normal(jax.random.key(0), (2, 3, 4))
        >>> w = jax.random.normal(jax.random.key(1), (10, 4))
        >>> labels = jnp.array([[8, 5, 3], [1, 2, 6]])
        >>> loss, metrics = fused_cross_entropy(h, w, labels, chunk_size=4,
        ...                                     label_smoothing=0.1)
        >>> reference, _ = losses.cross_entropy(head.unembed(h, w), labels,
        ...                                     label_smoothing=0.1)
        >>> print(f"{loss:.5f} {reference:.5f}")
        2.37197 2.37197
        >>> for name, value in metrics.items():
        ...     print(name, round(float(value), 4))
        loss 2.372
        nll 2.127
        z_loss 0.0
        accuracy 0.5
        weight_sum 6.0
        invalid_labels 0.0
        >>> dh, dw = jax.grad(lambda h, w: fused_cross_entropy(
        ...     h, w, labels, chunk_size=4, vocab_chunk_size=3)[0],
        ...     argnums=(0, 1))(h, w)
        >>> dh.shape, dw.shape
        ((2, 3, 4), (10, 4))

    References:
        Wijmans et al., `Cut Your Losses in Large-Vocabulary Language Models
        <https://arxiv.org/abs/2411.09009>`_, 2024 (Cut Cross-Entropy);
        Hsu et al., `Liger Kernel: Efficient Triton Kernels for LLM Training
        <https://arxiv.org/abs/2410.10989>`_, 2024 (fused linear
        cross-entropy).
    """
    static = dict(
        label_smoothing=label_smoothing, z_loss=z_loss, scale=scale, softcap=softcap
    )
    _check_inputs(h, w, bias, chunk_size, vocab_chunk_size, **static)
    losses.check_loss_options(label_smoothing, smoothing, z_loss, reduction)
    vocab_size, d_model = jnp.shape(w)
    leading = jnp.shape(h)[:-1]
    losses.check_labels_and_weights(labels, weights, leading, vocab_size)
    _check_vocab_shards(vocab_shards, vocab_size)
    num_tokens = math.prod(leading)
    if num_tokens == 0:  # nothing to block or split: the logits are empty
        return losses.cross_entropy(
            head.unembed(h, w, bias, scale=scale, softcap=softcap),
            labels,
            weights=weights,
            label_smoothing=label_smoothing,
            smoothing=smoothing,
            z_loss=z_loss,
            reduction=reduction,
        )

    def core(h, w, bias, loss_weights, labels):
        # Block sizes from what one device holds: its tokens and its rows.
        plan = _Plan(
            vocab_size,
            w.shape[0],
            None if vocab_shards is None else vocab_shards.axis,
            *_block_sizes(h.shape[0], w.shape[0], chunk_size, vocab_chunk_size),
            float(label_smoothing),
            smoothing,
            float(z_loss),
            _optional_float(scale),
            _optional_float(softcap),
            precision,
            grads_in_forward=reduction != "none",
        )
        return _fused_core(plan, h, w, bias, loss_weights, labels)

    dtype = jnp.result_type(h, w)
    loss_weights, safe_labels, invalid = losses.valid_weights(
        jnp.reshape(labels, (num_tokens,)),
        None if weights is None else jnp.reshape(weights, -1),
        vocab_size,
    )
    args = (
        jnp.reshape(h, (num_tokens, d_model)).astype(dtype),
        jnp.asarray(w, dtype),
        None if bias is None else jnp.asarray(bias),
        loss_weights,
        safe_labels,
    )
    objective, (lse, label_logit, logit_sum, argmax) = (
        core(*args) if vocab_shards is None else vocab_shards.run(core, *args)
    )
    token_loss, nll, z_term = losses.token_losses(
        lse,
        label_logit,
        logit_sum,
        vocab_size,
        label_smoothing=label_smoothing,
        smoothing=smoothing,
        z_loss=z_loss,
    )
    loss, metrics = losses.weighted_metrics(
        token_loss, nll, z_term, argmax == safe_labels, loss_weights, invalid, reduction
    )
    if reduction == "none":
        return jnp.reshape(loss, leading), metrics
    if reduction == "sum":
        return objective, metrics
    weight_sum = metrics["weight_sum"]
    return objective / jnp.where(weight_sum > 0, weight_sum, 1.0), metrics
