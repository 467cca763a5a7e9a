r"""The one chunked sweep behind every loss through the head, and its custom VJP.

A loss of ``logits = softcap(scale * h @ w.T + bias)`` that never holds the
``[N, V]`` logits is written as a *rule* (:class:`lmhead._fused_rule.Rule`)
and run by this engine. The engine owns everything that is not the loss's
formula: chunks of tokens and blocks of vocabulary rows, the logits of a
block (scale, bias, softcap), the ragged last chunk and block, the split of
the vocabulary over a mesh axis, packing and skipping the tokens of weight
0, the gradients ``dh``, ``dw``, ``dbias`` (accumulated in float32) and the
second sweep that recomputes the logits for any other cotangent. A rule
(whose members have defaults) says only:

* the per-token statistics a token needs from a block of its logits, as
  accumulators (online-softmax ones, :class:`lmhead._online_softmax.Softmax`,
  and sums), which the base merges block by block and, with a split
  vocabulary, combines across devices; one or more passes, each of which
  may read the previous passes' results;
* the per-token loss as a function of the finished statistics (its
  gradient coefficients are its VJP by default);
* the gradient with respect to a block's logits, ``dlogits: [Vb, Nc]``,
  from those coefficients.

Every entry point builds its options once (:class:`~lmhead._sweep_options.SweepOptions`)
and comes in through :func:`run`, which builds the plan from them.

For a chunk of tokens the forward sweep computes the chunk's logits
(``[V, Nc]``, vocabulary-major, kept when they fit, else block by block),
runs the rule's passes over its blocks, and, for a reduced loss (whose
per-token cotangent, the weight, is known in advance), turns each block's
``dlogits`` into ``dh``, ``dw`` and ``dbias`` while the logits are live.
``dlogits`` is the one place where the per-chunk gradient coefficient
exists (:func:`_block_grads`), after the softcap's derivative and before the
matmuls, and where every rule's tiles of small coefficients are filtered
(:meth:`~lmhead._sweep_options.SweepOptions.gradient_options`).
docs/fused_loss.md derives the gradients.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from lmhead import head, losses
from lmhead._fused_rule import Rule, VocabShards
from lmhead._online_softmax import Softmax
from lmhead._sweep_options import SweepOptions
from lmhead._vocab_order import check_vocab_order, sorted_call

_CONTRACT_COLUMNS = (((1,), (1,)), ((), ()))  # [a, D] x [b, D] -> [a, b]
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # [V, a] x [V, b] -> [a, b]
_MATMUL = (((1,), (0,)), ((), ()))  # [a, k] x [k, b] -> [a, b]


def run(
    options: SweepOptions,
    rule: Rule,
    h,
    w,
    bias,
    loss_weights,
    inputs,
    *,
    grads_in_forward: bool,
    loss_scalars=None,
    vocab_order=None,
    vocab_shards: VocabShards | None = None,
    segment_length: int | None = None,
):
    """``(sum_t loss_weights_t * L_t, outputs)`` of ``rule`` over ``h: [N, D]``
    (``N >= 1``) and ``w: [V, D]``: the one way into the engine.

    The :class:`~lmhead._sweep_options.Plan` is built once from ``options``
    (on each device of ``vocab_shards``, from the rows it holds), the inputs
    are cast to their common dtype, and :func:`fused_core` runs, with the
    rows in ``vocab_order`` (checked here) when given.
    ``loss_scalars``: array operands of the loss (None: none).
    """
    vocab_size = jnp.shape(w)[0]
    if vocab_shards is not None and vocab_size % vocab_shards.count:
        raise ValueError(
            f"w has {vocab_size} rows, which the mesh's {vocab_shards.axis!r} "
            f"axis ({vocab_shards.count}) must divide."
        )
    order = check_vocab_order(vocab_order, vocab_size, split=vocab_shards is not None)
    dtype = jnp.result_type(h, w)

    def core(h, w, bias, loss_scalars, loss_weights, inputs):
        # Block sizes from what one device holds: its tokens and its rows.
        plan = options.plan(
            rule,
            h.shape[0],
            w.shape[0],
            dtype,
            grads_in_forward=grads_in_forward,
            vocab_axis=None if vocab_shards is None else vocab_shards.axis,
            segment_length=segment_length,
        )
        return fused_core(plan, h, w, bias, loss_scalars, loss_weights, inputs, order)

    bias = options.tempered_bias(bias)
    args = (
        jnp.asarray(h, dtype),
        jnp.asarray(w, dtype),
        None if bias is None else jnp.asarray(bias),
        jnp.zeros(0, jnp.float32) if loss_scalars is None else loss_scalars,
        loss_weights,
        inputs,
    )
    return core(*args) if vocab_shards is None else vocab_shards.run(core, *args)


def add_coefs(a, b):
    """Coefficients summed entry by entry; None is a zero."""
    return tuple(y if x is None else x if y is None else x + y for x, y in zip(a, b))


# ----------------------------------------------------------------------------
# The sweep.
# ----------------------------------------------------------------------------


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


def _chunk_stats(plan, h_chunk, w, bias, context):
    """``(kept logits or None, outputs)`` of one chunk: the rule's passes.

    Block by block, so no temporary is larger than one block (or the kept
    logits); with a split vocabulary each pass's accumulators are combined
    across devices before they are finished.
    """
    rule = plan.rule
    kept = _logits(plan, h_chunk, w, bias) if plan.keep_logits else None
    block = _vocab_blocks(plan, h_chunk, w, bias, kept)
    # zeros_like keeps h's mesh axes, as a loop carry inside shard_map must.
    zeros = jnp.zeros_like(h_chunk[:, 0], jnp.float32)
    outputs = ()
    for pass_ in range(rule.passes):

        def stats(j, pass_=pass_, previous=outputs):
            v0, is_new, _, z = block(j)
            return rule.block_stats(plan, pass_, z, v0, is_new, context, previous)

        def merge(j, carry, pass_=pass_):
            return rule.merge(pass_, carry, stats(j, pass_))

        # The accumulators of no rows, shaped as a block's (nothing computed).
        init = tuple(
            a.identity(zeros)
            if isinstance(a, Softmax)
            else jnp.zeros_like(zeros, a.dtype)
            for a in jax.eval_shape(stats, 0)
        )
        carry = lax.fori_loop(0, plan.num_blocks, merge, init)
        if plan.vocab_axis is not None:
            carry = rule.combine(plan, pass_, carry)
        outputs += rule.finish(pass_, carry)
    return kept, outputs


def _empty_outputs(plan, h_chunk, w, bias, context, zeros):
    """Zeros shaped as ``zeros: [N]`` and typed as the rule's outputs (nothing
    computed; the shapes do not depend on a split vocabulary's combine)."""
    local = dataclasses.replace(plan, vocab_axis=None)
    shapes = jax.eval_shape(lambda: _chunk_stats(local, h_chunk, w, bias, context)[1])
    return tuple(jnp.zeros_like(zeros, x.dtype) for x in shapes)


def _add_rows(total, start, update):
    """``total[start:start + len(update)] += update``, in place under jit."""
    rows = lax.dynamic_slice_in_dim(total, start, update.shape[0])
    return lax.dynamic_update_slice_in_dim(total, rows + update, start, 0)


def _accumulate(dw, start, update):
    """:func:`_add_rows` into an array of any dtype, or into ``(pair,)``, a
    Kahan sum and its compensation (what each addition lost) as one
    ``[2, V, D]`` array, read and written at once so it is updated in place."""
    if not isinstance(dw, tuple):
        return _add_rows(dw, start, update.astype(dw.dtype))
    old, lost = lax.dynamic_slice_in_dim(dw[0], start, update.shape[0], axis=1)
    corrected = update - lost
    new = old + corrected
    pair = jnp.stack([new, (new - old) - corrected])
    return (lax.dynamic_update_slice_in_dim(dw[0], pair, start, axis=1),)


def _block_grads(plan, z, v0, live, context, outputs, coefs, sigma):
    """``(dL/du, keep)`` for the pre-softcap logits ``u`` of one block.

    The per-chunk gradient coefficient, in one place: the rule's ``dlogits``
    times the softcap's derivative, ``[Vb, Nc]``. ``live: [Vb, Nc]`` masks
    out rows of an overlapping block and tokens that add nothing (whose
    logits may not even be finite). ``keep``: None without a filter, else
    False when each entry is 0 or below ``filter_eps * sigma`` of its token.
    """
    dz = plan.rule.dlogits(z, v0, context, outputs, coefs)
    if plan.softcap is not None:
        # d/du c tanh(u / c) = 1 - tanh^2 = 1 - (z / c)^2.
        dz = dz * (1.0 - jnp.square(z / plan.softcap))
    dz = jnp.where(live, dz, 0.0)
    if plan.filter_eps is None:
        return dz, None
    small = (jnp.abs(dz) < plan.filter_eps * sigma) | (dz == 0)
    return dz, jnp.logical_not(jnp.all(small))


def _filtered(plan, keep, updates, values):
    """``{name: updates[name](values[name])}``, None staying None; those that
    ``filter_target`` names run under one ``lax.cond`` on ``keep``, so that a
    skipped tile's matmuls are not run."""
    names = [k for k, v in values.items() if v is not None]
    cut = (
        [] if keep is None else [k for k in names if plan.filter_target in ("both", k)]
    )
    out = {
        k: updates[k](v) if k in names and k not in cut else v
        for k, v in values.items()
    }
    if cut:
        run = lambda x: tuple(updates[k](v) for k, v in zip(cut, x))
        kept = lax.cond(keep, run, lambda x: x, tuple(values[k] for k in cut))
        out |= dict(zip(cut, kept))
    return out


def _chunk_grads(plan, h_chunk, active, w, bias, kept, context, outputs, coefs, grads):
    """One token chunk's ``dh: [Nc, D]`` and its additions to ``dw``, ``db``.

    ``kept`` is the chunk's ``[V, Nc]`` logits when the forward sweep holds
    them; otherwise the logits are computed again, block by block. Tokens
    not ``active`` contribute nothing: their rows of ``h`` are zeroed for the
    ``dw`` matmul, so that even a non-finite one cannot reach ``dw``. ``dw``
    is :func:`_accumulators`'; with ``filter_eps``, a vocabulary block
    whose coefficients are all small skips its matmuls (:func:`_filtered`).
    """
    want_dh, dw, db = grads
    h_active = jnp.where(active[:, None], h_chunk, 0.0)
    if plan.keep_logits and kept is None:
        kept = _logits(plan, h_chunk, w, bias)
    block = _vocab_blocks(plan, h_chunk, w, bias, kept)
    scale = 1.0 if plan.scale is None else plan.scale
    # The filter's scale of each token, sigma_t = max_k |c_tk|, [Nc].
    present = [jnp.abs(c) for c in coefs if c is not None]
    sigma = None if plan.filter_eps is None else functools.reduce(jnp.maximum, present)

    def step(j, carry):
        dh_chunk, dw, db = carry
        v0, is_new, w_block, z = block(j)
        live = is_new & active
        dz, keep = _block_grads(plan, z, v0, live, context, outputs, coefs, sigma)
        dz_in = dz.astype(h_chunk.dtype)
        updates = dict(
            dh=lambda dh: dh + scale * plan.dot(dz_in, w_block, _CONTRACT_ROWS),
            dw=lambda dw: _accumulate(
                dw, v0, scale * plan.dot(dz_in, h_active, _MATMUL)
            ),
        )
        new = _filtered(plan, keep, updates, dict(dh=dh_chunk, dw=dw))
        if db is not None:
            db = _add_rows(db, v0, jnp.sum(dz, axis=1))
        return new["dh"], new["dw"], db

    dh_chunk = jnp.zeros_like(h_chunk, jnp.float32) if want_dh else None
    return lax.fori_loop(0, plan.num_blocks, step, (dh_chunk, dw, db))


def _sweep(
    plan, h, w, bias, loss_scalars, inputs, loss_weights, *, grads=None, given=None
):
    """One pass over chunks of tokens.

    Three uses: outputs only (``grads`` is None: the primal); outputs and
    the gradient of ``sum_t loss_weights_t * L_t`` (the differentiated
    forward pass); or, given ``(outputs, coefs)``, the gradient those
    per-token coefficients define (recomputing the logits). Gradients are
    added to ``grads``, ``(dh, dw, db)`` with None for one not wanted.
    Tokens of weight 0 never contribute to a gradient.

    With ``plan.skip_zero_weights`` the tokens are first put in the order of
    a stable argsort of ``loss_weights == 0`` (weighted tokens first, each
    group in its own order), and the loop runs over the
    ``ceil(#weighted / chunk_size)`` chunks that hold a weighted token only
    (a ``while`` loop: the count is traced, every shape static); outputs
    and ``dh`` are put back in the tokens' order after it. When every token
    is weighted the order is the identity and the chunks are those of the
    unpacked sweep. Tokens in skipped chunks get outputs 0.

    Returns:
        ``(outputs, grads)``; ``outputs`` is the rule's, each ``[N]`` (None
        when ``given``).
    """
    n, size = h.shape[0], plan.chunk_size
    # A single chunk is not packed: a while loop of one trip is compiled
    # apart from what surrounds it, and may round differently.
    if not plan.skip_zero_weights or n <= size:
        loop = functools.partial(_chunk_loop, num_chunks=-(-n // size))
        return loop(plan, h, w, bias, loss_scalars, inputs, loss_weights, grads, given)
    weighted = loss_weights != 0
    order = jnp.argsort(jnp.logical_not(weighted), stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=order.dtype))
    num_chunks = (jnp.sum(weighted, dtype=jnp.int32) + size - 1) // size

    # asarray: custom_vjp may pass a constant argument as a numpy array.
    def packed(x):
        return jax.tree.map(lambda x: jnp.asarray(x)[order], x)

    def unpacked(x):
        return jax.tree.map(lambda x: x[inverse], x)

    dh, dw, db = (None, None, None) if grads is None else grads
    token_inputs, row_inputs = inputs
    outputs, (dh, dw, db) = _chunk_loop(
        plan,
        packed(h),
        w,
        bias,
        loss_scalars,
        (packed(token_inputs), row_inputs),
        packed(loss_weights),
        None if grads is None else (packed(dh), dw, db),
        packed(given),
        num_chunks=num_chunks,
    )
    return unpacked(outputs), (unpacked(dh), dw, db)


def _chunk_loop(
    plan, h, w, bias, loss_scalars, inputs, loss_weights, grads, given, num_chunks
):
    """:func:`_sweep`'s loop over the first ``num_chunks`` chunks of tokens.

    Differentiated with segments longer than a chunk, it loops over the
    segments and over each one's chunks (the last one clamped to the
    segment's end), with the coefficients of ``U_s``'s terms: a segment's
    ``dw`` and ``db`` are summed apart and its ``dh`` rows (0 before it)
    kept, and all are multiplied by ``segment_loss'(U_s)`` once the segment
    is done, the gradients being linear in the coefficients.
    """
    rule = plan.rule
    n, size, length = h.shape[0], plan.chunk_size, plan.segment_length
    token_inputs, row_inputs = inputs
    outputs = None
    if given is None:
        # zeros_like keeps the mesh axes of the inputs, which a loop carry
        # must keep inside shard_map: the outputs vary as the tokens do.
        first = jax.tree.map(lambda x: x[:size], (h, token_inputs))
        context = rule.chunk_context(plan, first[0], first[1], row_inputs)
        outputs = _empty_outputs(
            plan, first[0], w, bias, context, jnp.zeros_like(loss_weights)
        )
    deferred = grads is not None and given is None and (length or 0) > size
    per_segment = -(-length // size) if deferred else 1

    def body(i, carry):
        outputs, (dh, dw, db), total = carry
        if deferred:
            first = i // per_segment * length
            start = first + _block_start(i % per_segment, size, length)
            is_new = _new_positions(start, first + i % per_segment * size, size)
        else:
            start = _block_start(i, size, n)
            is_new = _new_positions(start, i * size, size)

        def chunk(x):
            return jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, start, size), x)

        h_chunk = chunk(h)
        context = rule.chunk_context(plan, h_chunk, chunk(token_inputs), row_inputs)
        if given is None:
            z, new = _chunk_stats(plan, h_chunk, w, bias, context)
            outputs = tuple(
                lax.dynamic_update_slice_in_dim(
                    s, jnp.where(is_new, x, chunk(s)), start, 0
                )
                for s, x in zip(outputs, new)
            )
            if grads is None:
                return outputs, (dh, dw, db), total
            chunk_coefs = _loss_coefs(
                plan,
                deferred,
                loss_scalars,
                new,
                chunk(loss_weights),
                chunk(token_inputs),
            )
        else:
            z, (new, chunk_coefs) = None, chunk(given)
        # Not a token of an earlier chunk, and of nonzero weight: 0 * NaN is
        # NaN, so the others are masked rather than multiplied by 0.
        active = is_new & (chunk(loss_weights) != 0)
        chunk_coefs = tuple(
            None if c is None else jnp.where(active, c, 0.0) for c in chunk_coefs
        )
        if deferred:
            token_loss = rule.loss(loss_scalars, new, chunk(token_inputs))
            weights = jnp.where(active, chunk(loss_weights), 0.0)
            total = total + jnp.sum(losses.weighted_values(token_loss, weights))
        dh_chunk, dw, db = _chunk_grads(
            plan,
            h_chunk,
            active,
            w,
            bias,
            z,
            context,
            new,
            chunk_coefs,
            (dh is not None, dw, db),
        )
        if dh is not None:
            dh = _add_rows(dh, start, dh_chunk)
        return outputs, (dh, dw, db), total

    init = (None, None, None) if grads is None else grads
    zero = jnp.zeros((), jnp.float32)
    if not deferred:
        return lax.fori_loop(0, num_chunks, body, (outputs, init, zero))[:2]

    def segment(s, carry):
        outputs, (dh, dw, db) = carry
        apart = tuple(
            None if x is None else jnp.zeros(x.shape, jnp.float32) for x in (w, bias)
        )
        outputs, (dh, dw_s, db_s), total = lax.fori_loop(
            s * per_segment, (s + 1) * per_segment, body, (outputs, (dh, *apart), zero)
        )
        factor = jax.grad(lambda u: jnp.sum(rule.segment_loss(loss_scalars, u)))(
            total[None]
        )[0]
        if dh is not None:
            rows = lax.dynamic_slice_in_dim(dh, s * length, length)
            dh = lax.dynamic_update_slice_in_dim(dh, factor * rows, s * length, 0)
        if dw is not None:
            dw = _accumulate(dw, 0, factor * dw_s)
        if db is not None:
            db = db + factor * db_s
        return outputs, (dh, dw, db)

    return lax.fori_loop(0, n // length, segment, (outputs, init))


def _loss_coefs(plan, deferred, loss_scalars, outputs, weights, token_inputs):
    """The objective's coefficients on a chunk's outputs: the rule's
    ``loss_coefs``, or, for a chunk of whole segments, the segments' VJP."""
    if plan.segment_length is None or deferred:
        return plan.rule.loss_coefs(loss_scalars, outputs, weights, token_inputs)
    _, pullback = jax.vjp(
        lambda *x: _objective(plan, loss_scalars, x, weights, token_inputs), *outputs
    )
    return pullback(jnp.ones((), jnp.float32))


def _objective(plan, loss_scalars, outputs, loss_weights, token_inputs):
    """``sum_t w_t L_t``, a weight of 0 giving 0 (``losses.weighted_values``),
    or with segments ``sum_s segment_loss(U)_s`` of the segments' sums."""
    token_loss = plan.rule.loss(loss_scalars, outputs, token_inputs)
    values = losses.weighted_values(token_loss, loss_weights)
    if plan.segment_length is None:
        return jnp.sum(values)
    sums = jnp.sum(jnp.reshape(values, (-1, plan.segment_length)), axis=1)
    return jnp.sum(plan.rule.segment_loss(loss_scalars, sums))


def _zero_grads(h, w, bias):
    return tuple(
        None if x is None else jnp.zeros_like(x, jnp.float32) for x in (h, w, bias)
    )


def _accumulators(plan, grads, dtype):
    """``(dh, dw, db)`` with ``dw`` as :func:`_accumulate` sums into it."""
    dh, dw, db = grads
    if dw is not None and plan.dw_accumulation == "kahan":
        dw = (jnp.stack([dw, jnp.zeros_like(dw)]),)
    elif dw is not None and plan.dw_accumulation == "input_dtype":
        dw = dw.astype(dtype)
    return dh, dw, db


def _sums(grads):
    """:func:`_accumulators`' inverse: ``(dh, dw, db)`` float32."""
    dh, dw, db = grads
    if isinstance(dw, tuple):
        dw = dw[0][0] - dw[0][1]  # the sum less what the compensation holds
    return dh, None if dw is None else dw.astype(jnp.float32), db


def fused_core(plan, h, w, bias, loss_scalars, loss_weights, inputs, order=None):
    """:func:`_fused_core`, with the rows of ``w`` swept in ``order``
    (:func:`check_vocab_order`'s) when given, invisibly to the caller
    (:mod:`lmhead._vocab_order`)."""
    args = (plan, h, w, bias, loss_scalars, loss_weights, inputs)
    return (
        _fused_core(*args) if order is None else sorted_call(_fused_core, *args, order)
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_core(plan, h, w, bias, loss_scalars, loss_weights, inputs):
    """``(sum_t loss_weights_t * L_t, outputs)`` without keeping any logits.

    ``loss_scalars`` is an array operand of the rule's loss (e.g. traced
    loss options, one per member of a ``vmap``); its gradient, like that of
    ``loss_weights``, is exact. ``inputs`` is the rule's
    ``(token_inputs, row_inputs)``; it gets no gradient. Inside
    ``shard_map``, ``h``, ``w`` and ``bias`` must vary over the same mesh
    axes (``lax.pcast``): each one's gradient is a product of the others,
    and a cotangent has the type of its input; ``loss_scalars`` must vary
    over the axes of the tokens.
    """
    outputs, _ = _sweep(plan, h, w, bias, loss_scalars, inputs, loss_weights)
    return _objective(plan, loss_scalars, outputs, loss_weights, inputs[0]), outputs


# The rule has no symbolic zeros, which shard_map does not support: every
# input is taken to be differentiated, and a zero cotangent of the outputs
# is told from a nonzero one at run time.
def _fused_core_fwd(plan, h, w, bias, loss_scalars, loss_weights, inputs):
    outputs, saved = _sweep(
        plan,
        h,
        w,
        bias,
        loss_scalars,
        inputs,
        loss_weights,
        grads=(
            _accumulators(plan, _zero_grads(h, w, bias), w.dtype)
            if plan.grads_in_forward
            else None
        ),
    )
    saved = _sums(saved)
    residuals = (h, w, bias, loss_scalars, loss_weights, inputs, outputs, saved)
    objective = _objective(plan, loss_scalars, outputs, loss_weights, inputs[0])
    return (objective, outputs), residuals


def _fused_core_bwd(plan, residuals, cotangents):
    h, w, bias, loss_scalars, loss_weights, inputs, outputs, saved = residuals
    d_objective, d_outputs = cotangents
    rule = plan.rule
    if plan.grads_in_forward:
        grads = tuple(None if g is None else d_objective * g for g in saved)
        coefs = rule.cotangent_coefs(outputs, d_outputs)
    else:
        grads = _zero_grads(h, w, bias)
        objective_coefs = rule.loss_coefs(
            loss_scalars, outputs, d_objective * loss_weights, inputs[0]
        )
        coefs = add_coefs(rule.cotangent_coefs(outputs, d_outputs), objective_coefs)

    def recompute(grads):
        # A cotangent on the outputs themselves (a metric or the unreduced
        # loss is differentiated): the logits are needed again.
        return _sweep(
            plan,
            h,
            w,
            bias,
            loss_scalars,
            inputs,
            loss_weights,
            grads=grads,
            given=(outputs, coefs),
        )[1]

    nonzero = jnp.any(jnp.stack([c for c in coefs if c is not None]) != 0)
    grads = _accumulators(plan, grads, w.dtype)
    grads = _sums(lax.cond(nonzero, recompute, lambda grads: grads, grads))
    # The outputs do not depend on loss_scalars or loss_weights: their
    # gradients are those of the objective alone.
    _, pullback = jax.vjp(
        lambda s, x: _objective(plan, s, outputs, x, inputs[0]),
        loss_scalars,
        loss_weights,
    )
    d_scalars, d_weights = pullback(d_objective)
    dh, dw, db = (
        None if g is None else g.astype(x.dtype) for g, x in zip(grads, (h, w, bias))
    )
    return dh, dw, db, d_scalars, d_weights, None


_fused_core.defvjp(_fused_core_fwd, _fused_core_bwd)
