"""Linear + cross-entropy that never builds the ``[N, V]`` logits.

For a vocabulary of tens of thousands of tokens the logits dominate the
memory of a training step: ``N`` tokens times ``V`` classes in float32, once
for the values and once for their gradient. :func:`fused_cross_entropy`
computes the same loss and metrics as
``losses.cross_entropy(head.unembed(h, w, bias, ...), labels, ...)`` while
holding the logits of one block of tokens at a time.

It is a rule of the one chunked sweep, :mod:`lmhead._fused_sweep` (chunks,
blocks, the vocabulary split, skipped tokens, the custom VJP):
:class:`CrossEntropyRule` says which statistics a token needs and the
gradient with respect to its logits. This module holds the rule, the public
function, its checks and the block sizes' re-exports. docs/fused_loss.md
derives the gradient and says how the block sizes were chosen.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from lmhead import _checks, _fused_sweep, head, losses
from lmhead._fused_sweep import (  # noqa: F401  (re-exported: the knobs' values)
    BLOCK_ELEMENTS,
    FILTER_TARGETS,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    VOCAB_BLOCK_ROWS,
    default_chunk_size,
)
from lmhead._vocab_order import (  # noqa: F401  (re-exported: the row orders)
    frequency_order,
    mean_logit_order,
)
from lmhead.head import NEG_INF


@dataclasses.dataclass(frozen=True)
class VocabShards:
    """The rows of ``w`` split over the devices along a mesh axis.

    For ``vocab_parallel.vocab_parallel_cross_entropy``, which passes it to
    :func:`fused_cross_entropy`.

    Attributes:
        axis: the mesh axis.
        count: devices along it; it must divide ``V``.
        run: ``run(core, h, w, bias, loss_scalars, weights, inputs) ->
            (objective, outputs)`` calls ``core`` (a function of the same
            arguments) on every device, with a device's tokens and its rows
            of ``w`` and ``bias`` (``[N, D]``, ``[V, D]``, ``[V]``, ``[2]``,
            ``[N]`` in all; ``loss_scalars`` is replicated; ``inputs`` is
            ``(labels [N], ())``), and returns ``core``'s objective summed
            over the devices' tokens and its outputs for every token.
    """

    axis: str
    count: int
    run: Callable[..., tuple[jax.Array, tuple[jax.Array, ...]]]


@dataclasses.dataclass(frozen=True)
class CrossEntropyRule:
    r"""Cross-entropy (smoothing, z-loss) and optionally the entropy, as a rule.

    Every option of the loss is a function of three statistics of a token's
    logits ``z`` -- ``lse``, the label's logit ``z_y`` and ``sum_i z_i``
    (:func:`lmhead.losses.token_losses`) -- and accuracy needs the argmax;
    the entropy adds :math:`t = \sum_i e^{z_i - m}(z_i - m)`, so that
    :math:`H = \log s - t / s` with :math:`s = \sum_i e^{z_i - m}`. Outputs:
    ``(lse, label_logit, logit_sum, argmax[, entropy])``. The gradient is

    .. math::
        \frac{\partial L}{\partial z_i} = \alpha p_i + \beta [i = y] + \gamma
            - c\, p_i (\log p_i + H),

    with :math:`(\alpha, \beta, \gamma)` the cotangents of the three
    statistics and :math:`c` that of the entropy. ``label_smoothing`` and
    ``z_loss`` are Python floats compiled in, or None: traced, read from
    ``loss_scalars: [2]``.
    """

    vocab_size: int  # V of the loss, all devices' rows together
    label_smoothing: float | None
    smoothing: str
    z_loss: float | None
    entropy: bool = False
    passes = 1

    def empty(self, zeros, labels):
        return (zeros,) * 3 + (jnp.zeros_like(labels),) + (zeros,) * self.entropy

    def chunk_context(self, plan, h_chunk, labels, row_inputs):
        return labels - plan.first_row()  # labels count from this device's rows

    def init(self, pass_, zeros):
        init = (zeros + NEG_INF, zeros, zeros, zeros, zeros.astype(jnp.int32))
        return init + (zeros,) * self.entropy

    def block_stats(self, plan, pass_, z, v0, is_new, labels, previous):
        """Per-token max, sum of exp(z - max), label logit, logit sum, argmax,
        and with ``entropy`` the sum of ``exp(z - max) * (z - max)``."""
        live, peak, exp, sum_exp = _fused_sweep.block_softmax(z, is_new)
        logit_sum = jnp.sum(jnp.where(is_new, z, 0.0), axis=0)
        label = _fused_sweep.label_logit(z, labels, v0, is_new)
        # The first row that attains the max, as jnp.argmax, by a float
        # min-reduce rather than XLA's (value, index) reduce (the cost is in
        # docs/fused_loss.md); float32 holds row numbers exactly up to 2^24.
        rows = z.shape[0]
        index = lax.broadcasted_iota(jnp.float32, z.shape, 0)
        first = jnp.min(jnp.where(live == peak, index, jnp.inf), axis=0)
        argmax = v0 + jnp.minimum(first, rows - 1).astype(jnp.int32)
        stats = (peak, sum_exp, label, logit_sum, argmax)
        if not self.entropy:
            return stats
        # 0 where exp(z - max) is 0 (a logit of -inf), not 0 * -inf.
        return stats + (jnp.sum(jnp.where(exp > 0, exp * (live - peak), 0.0), axis=0),)

    def merge(self, pass_, carry, block):
        peak, sum_exp, label, logit_sum, argmax, *tilted = carry
        b_peak, b_sum_exp, b_label, b_sum, b_arg, *b_tilted = block
        new_peak = jnp.maximum(peak, b_peak)
        tilted = tuple(
            _fused_sweep.rescaled_tilt(t, sum_exp, peak, new_peak)
            + _fused_sweep.rescaled_tilt(b_t, b_sum_exp, b_peak, new_peak)
            for t, b_t in zip(tilted, b_tilted)
        )
        _, sum_exp = _fused_sweep.merge_softmax(peak, sum_exp, b_peak, b_sum_exp)
        # Strictly greater: on ties the earlier block (lower index) wins,
        # as jnp.argmax does.
        argmax = jnp.where(b_peak > peak, b_arg, argmax)
        return (new_peak, sum_exp, label + b_label, logit_sum + b_sum, argmax, *tilted)

    def combine(self, plan, pass_, carry):
        """The statistics of the whole vocabulary from each device's rows:
        ``pmax`` of the running max, ``psum`` of the rescaled sums."""
        peak, sum_exp, label, logit_sum, argmax, *tilted = carry
        axis = plan.vocab_axis
        top = lax.pmax(peak, axis)
        tilted = tuple(
            lax.psum(_fused_sweep.rescaled_tilt(t, sum_exp, peak, top), axis)
            for t in tilted
        )
        sum_exp = lax.psum(sum_exp * jnp.exp(peak - _fused_sweep.finite(top)), axis)
        # Ties go to the lowest index, as jnp.argmax does.
        argmax = lax.pmin(
            jnp.where(peak == top, argmax + plan.first_row(), self.vocab_size), axis
        )
        label, logit_sum = lax.psum(label, axis), lax.psum(logit_sum, axis)
        return (top, sum_exp, label, logit_sum, argmax, *tilted)

    def finish(self, pass_, carry):
        peak, sum_exp, label, logit_sum, argmax, *tilted = carry
        entropy = tuple(jnp.log(sum_exp) - t / sum_exp for t in tilted)
        return (peak + jnp.log(sum_exp), label, logit_sum, argmax, *entropy)

    def loss(self, loss_scalars, outputs, token_inputs=None):
        """``losses.token_losses``' loss; ``loss_scalars: [2]`` float32 holds
        ``(label_smoothing, z_loss)``, used where the rule holds None."""
        return losses.token_losses(
            *outputs[:3],
            self.vocab_size,
            label_smoothing=(
                loss_scalars[0]
                if self.label_smoothing is None
                else self.label_smoothing
            ),
            smoothing=self.smoothing,
            z_loss=loss_scalars[1] if self.z_loss is None else self.z_loss,
        )[0]

    def loss_coefs(self, loss_scalars, outputs, weights, token_inputs=None):
        """``weights * dL/d(lse, label_logit, logit_sum)``, token by token."""
        loss = functools.partial(lambda s, *x: self.loss(s, x), loss_scalars)
        _, pullback = jax.vjp(loss, *outputs[:3])
        return pullback(weights) + (None,) * self.entropy

    def cotangent_coefs(self, outputs, cotangents):
        return cotangents[:3] + (cotangents[4:5] if self.entropy else ())

    def dlogits(self, z, v0, labels, outputs, coefs):
        alpha, beta, gamma, *c_entropy = coefs
        lse = outputs[0]
        p = jnp.exp(z - lse)
        dz = alpha * p + jnp.where(_fused_sweep.is_label(z, v0, labels), beta, 0.0)
        dz = dz + gamma
        if c_entropy and c_entropy[0] is not None:
            # dH/dz_i = -p_i (log p_i + H); 0 where p is 0 (a logit of
            # -inf), not 0 * -inf.
            dz = dz - jnp.where(p > 0, c_entropy[0] * p * (z - lse + outputs[4]), 0.0)
        return dz

    def sorted_inputs(self, labels, order, inverse):
        return inverse[labels]

    def caller_outputs(self, outputs, order):
        lse, label, logit_sum, argmax, *entropy = outputs
        return (lse, label, logit_sum, order[argmax], *entropy)


def _check_inputs(h, w, bias, chunk_size, vocab_chunk_size, scalars, static):
    _checks.check_unembed_inputs(h, w, bias)
    _checks.check_count("chunk_size", chunk_size, optional=True)
    _checks.check_count("vocab_chunk_size", vocab_chunk_size, optional=True)
    for name, value in scalars.items():
        _checks.check_rank(name, value, 0, "[] (a scalar)")
    _checks.check_concrete("fused_cross_entropy", **static)
    for name in ("scale", "softcap"):
        _checks.check_in_range(name, static[name], low=0.0, low_open=True)


def _check_vocab_shards(vocab_shards, vocab_size):
    if vocab_shards is not None and vocab_size % vocab_shards.count:
        raise ValueError(
            f"w has {vocab_size} rows, which the mesh's {vocab_shards.axis!r} "
            f"axis ({vocab_shards.count}) must divide."
        )


def _optional_float(x):
    return None if x is None else float(x)


def _loss_scalars(label_smoothing, z_loss):
    """``(rule's label_smoothing, rule's z_loss, loss_scalars: [2] float32)``.

    A concrete value goes into the rule as a Python float, compiled in; a
    traced one is None there and read from ``loss_scalars``.
    """
    values = (label_smoothing, z_loss)
    static = (None if _checks.is_traced(x) else float(x) for x in values)
    return *static, jnp.stack([jnp.asarray(x, jnp.float32) for x in values])


def _entropy_metrics(entropy, reduction, token_entropy, weights):
    """``{"entropy": weighted mean[, "token_entropy": [...]]}``, or ``{}``."""
    if not entropy:
        return {}
    # Weight 0 (skipped, or padding whose logits may not be finite) gives 0.
    token_entropy = jnp.where(weights != 0, token_entropy, 0.0)
    weight_sum = jnp.sum(weights)
    metrics = {
        "entropy": jnp.sum(weights * token_entropy)
        / jnp.where(weight_sum > 0, weight_sum, 1.0)
    }
    if reduction == "none":
        metrics["token_entropy"] = token_entropy
    return metrics


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
    entropy: bool = False,
    skip_zero_weights: bool = False,
    filter_eps: float | str | None = None,
    filter_target: str = "both",
    dw_accumulation: str = "float32",
    vocab_order: jax.typing.ArrayLike | str | None = None,
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
    (:class:`CrossEntropyRule` gives it): for ``reduction="mean"`` or
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
        label_smoothing, z_loss: as in ``losses.cross_entropy``; Python
            floats or scalar arrays, traced ones too (e.g. one value per
            member under ``jax.vmap`` or ``lax.map``). A concrete value is
            range-checked and compiled into the sweep; a traced value is
            not range-checked (its range cannot be known when tracing), so
            its caller checks it. The loss's gradient with respect to a
            traced value is exact.
        smoothing, reduction: as in ``losses.cross_entropy``; concrete.
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
            with ``pmax``/``psum`` (see :meth:`CrossEntropyRule.combine`).
        entropy: False (default), or True to add ``metrics["entropy"]``, the
            weighted mean of each token's :math:`H_t = -\sum_i p_i \log p_i`,
            :math:`p = \mathrm{softmax}(z_t)` of the logits the loss sees
            (after ``scale``, ``bias`` and ``softcap``; a token of logit
            ``-inf`` adds 0), from the same sweep: a running
            :math:`\sum_i e^{z_i - m}(z_i - m)` beside the logsumexp's sum,
            :math:`H = \mathrm{lse} - \mathbb{E}_p[z]`. With
            ``reduction="none"`` also ``metrics["token_entropy"]``: ``[...]``,
            :math:`H_t`, and 0 for a token of weight 0. Both have the exact
            gradient (an entropy bonus or penalty is a loss term):
            :math:`\partial H / \partial z_i = -p_i (\log p_i + H)`,
            from a second sweep that recomputes the logits, as for any
            metric's gradient.
        skip_zero_weights: True skips the tokens of weight 0
            (padding, prompt tokens): weighted tokens are packed first (a
            stable argsort of ``weights == 0``, a gather of ``h`` and a
            scatter of ``dh``, ``O(N D)``, against the ``O(N V D)`` of the
            chunks' matmuls, so it is always done), and only the chunks
            that hold one are swept (a ``while`` loop over a traced count;
            shapes stay static). The loss and the gradients w.r.t. ``h``,
            ``w`` and ``bias`` are those of the full sweep up to float32
            rounding (bitwise when no weight is 0). The gradient w.r.t. a
            weight that is 0 is then 0 (its token's logits are not
            computed), which is why it is not the default: False (default)
            computes every token, and the gradient w.r.t. a zero weight is
            exactly that token's loss. Pass True when ``weights`` is data
            (padding masks), not something differentiated.
        filter_eps: None (default: the exact gradient), a number ``>= 0``,
            or ``"auto"`` (``finfo(dtype).eps / 32`` of the inputs' dtype):
            a tile of a chunk's tokens and a vocabulary block where every
            :math:`|p - \mathrm{onehot}|` (the gradient coefficient divided
            by the token's largest coefficient, e.g. its weight) is below
            it adds nothing to the gradients ``filter_target`` names, and
            their matmuls are skipped, as Cut Cross-Entropy does. The loss,
            the metrics and ``dbias`` stay exact; the error of ``dh`` and
            ``dw`` is bounded as :func:`lmhead._fused_sweep.gradient_options`
            states.
        filter_target: ``"both"`` (default), ``"dh"`` or ``"dw"``: the
            gradients a skipped tile leaves out (CCE's ``filter_e_grad`` and
            ``filter_c_grad``; filtering ``dh`` only keeps the classifier's
            gradient exact).
        dw_accumulation: ``"float32"`` (default), ``"kahan"`` (float32 with a
            Kahan compensation, a second ``[V, D]`` array) or
            ``"input_dtype"`` (``dw`` summed over the chunks in the inputs'
            dtype).
        vocab_order: None (default: the rows of ``w`` in their order), an
            integer ``[V]`` permutation of ``range(V)`` (e.g.
            ``_vocab_order.frequency_order`` of the training data's token
            counts) or ``"mean_logit"`` (this call's rows by mean logit,
            ``_vocab_order.mean_logit_order``): the sweep's order of the
            rows, invisible to the caller, which gets the same loss,
            metrics and gradients in its own order up to float32 rounding
            (the blocks' merges and ``dh``'s sum run in another order; an
            argmax tie goes to the row first in ``vocab_order``). With
            ``filter_eps`` it changes which tiles are skipped, within the
            same bound. Not with ``vocab_shards``. A traced order is
            assumed to be a permutation (checked when concrete).

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
        >>> dh, dw = jax.jit(jax.grad(lambda h, w: fused_cross_entropy(
        ...     h, w, labels, chunk_size=4, vocab_chunk_size=3)[0],
        ...     argnums=(0, 1)))(h, w)
        >>> dh.shape, dw.shape
        ((2, 3, 4), (10, 4))

        One loss per member of an ensemble, ``label_smoothing`` traced:

        >>> per_member = jax.vmap(lambda eps: fused_cross_entropy(
        ...     h, w, labels, chunk_size=4, label_smoothing=eps)[0])
        >>> print(per_member(jnp.array([0.0, 0.1])).round(3))
        [2.127 2.372]

        Each token's entropy, padding skipped (weight 0, entropy 0):

        >>> _, metrics = fused_cross_entropy(
        ...     h, w, labels, weights=jnp.array([[1, 1, 1], [1, 0, 0]]),
        ...     entropy=True, reduction="none", chunk_size=2)
        >>> print(metrics["token_entropy"].astype(float).round(3))
        [[0.68  1.651 0.331]
         [1.203 0.    0.   ]]

    References:
        Wijmans et al., `Cut Your Losses in Large-Vocabulary Language Models
        <https://arxiv.org/abs/2411.09009>`_, 2024 (Cut Cross-Entropy);
        Hsu et al., `Liger Kernel: Efficient Triton Kernels for LLM Training
        <https://arxiv.org/abs/2410.10989>`_, 2024 (fused linear
        cross-entropy).
    """
    _check_inputs(
        h,
        w,
        bias,
        chunk_size,
        vocab_chunk_size,
        scalars=dict(label_smoothing=label_smoothing, z_loss=z_loss),
        static=dict(scale=scale, softcap=softcap),
    )
    losses.check_loss_options(label_smoothing, smoothing, z_loss, reduction)
    for name, flag in dict(
        entropy=entropy, skip_zero_weights=skip_zero_weights
    ).items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False; got {flag!r}.")
    vocab_size, d_model = jnp.shape(w)
    leading = jnp.shape(h)[:-1]
    losses.check_labels_and_weights(labels, weights, leading, vocab_size)
    _check_vocab_shards(vocab_shards, vocab_size)
    order = _fused_sweep.check_vocab_order(
        vocab_order, vocab_size, split=vocab_shards is not None
    )
    dtype = jnp.result_type(h, w)
    gradients = _fused_sweep.gradient_options(
        filter_eps, filter_target, dw_accumulation, dtype
    )
    num_tokens = math.prod(leading)
    if num_tokens == 0:  # nothing to block or split: the logits are empty
        loss, metrics = losses.cross_entropy(
            head.unembed(h, w, bias, scale=scale, softcap=softcap),
            labels,
            weights=weights,
            label_smoothing=label_smoothing,
            smoothing=smoothing,
            z_loss=z_loss,
            reduction=reduction,
        )
        no_tokens = jnp.zeros(leading, jnp.float32)
        return loss, metrics | _entropy_metrics(
            entropy, reduction, no_tokens, no_tokens
        )

    plan_smoothing, plan_z_loss, loss_scalars = _loss_scalars(label_smoothing, z_loss)

    rule = CrossEntropyRule(
        vocab_size, plan_smoothing, smoothing, plan_z_loss, entropy=entropy
    )

    def core(h, w, bias, loss_scalars, loss_weights, inputs):
        # Block sizes from what one device holds: its tokens and its rows.
        plan = _fused_sweep.Plan(
            rule,
            w.shape[0],
            None if vocab_shards is None else vocab_shards.axis,
            *_fused_sweep.block_sizes(
                h.shape[0], w.shape[0], chunk_size, vocab_chunk_size
            ),
            _optional_float(scale),
            _optional_float(softcap),
            precision,
            grads_in_forward=reduction != "none",
            skip_zero_weights=skip_zero_weights,
            **gradients,
        )
        return _fused_sweep.fused_core(
            plan, h, w, bias, loss_scalars, loss_weights, inputs, order
        )

    loss_weights, safe_labels, invalid = losses.valid_weights(
        jnp.reshape(labels, (num_tokens,)),
        None if weights is None else jnp.reshape(weights, -1),
        vocab_size,
    )
    if skip_zero_weights:
        # A skipped token has no statistics: the gradient w.r.t. its weight
        # is made 0 rather than that of made-up statistics.
        loss_weights = jnp.where(
            loss_weights != 0, loss_weights, lax.stop_gradient(loss_weights)
        )
    args = (
        jnp.reshape(h, (num_tokens, d_model)).astype(dtype),
        jnp.asarray(w, dtype),
        None if bias is None else jnp.asarray(bias),
        loss_scalars,
        loss_weights,
        (safe_labels, ()),
    )
    objective, (lse, label_logit, logit_sum, argmax, *token_entropy) = (
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
    if entropy:
        metrics |= _entropy_metrics(
            entropy,
            reduction,
            jnp.reshape(token_entropy[0], leading),
            jnp.reshape(loss_weights, leading),
        )
    if reduction == "none":
        return jnp.reshape(loss, leading), metrics
    if reduction == "sum":
        return objective, metrics
    weight_sum = metrics["weight_sum"]
    return objective / jnp.where(weight_sum > 0, weight_sum, 1.0), metrics
