"""Linear + cross-entropy that never builds the ``[N, V]`` logits.

For a vocabulary of tens of thousands of tokens the logits dominate the
memory of a training step: ``N`` tokens times ``V`` classes in float32, once
for the values and once for their gradient. :func:`fused_cross_entropy`
computes the same loss and metrics as
``losses.cross_entropy(head.unembed(h, w, bias, ...), labels, ...)`` while
holding the logits of one block of tokens at a time.

It is a rule of the one chunked sweep, :mod:`lmhead._fused_sweep` (chunks,
blocks, the vocabulary split, skipped tokens, the custom VJP):
:class:`CrossEntropyRule`, the log-prob rule of the label plus what the
loss's options and the accuracy need. This module holds the rule, the
public function and the re-exports of the sweep's knobs, whose options are
checked once as a :class:`lmhead._sweep_options.SweepOptions`.
docs/fused_loss.md derives the gradient and says how the block sizes were
chosen.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from lmhead import _checks, head, losses
from lmhead._fused_rule import VocabShards
from lmhead._fused_sweep import run
from lmhead._sweep_options import (  # noqa: F401  (re-exported: the knobs' values)
    BLOCK_ELEMENTS,
    FILTER_TARGETS,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    VOCAB_BLOCK_ROWS,
    SweepOptions,
    default_chunk_size,
)
from lmhead._vocab_order import (  # noqa: F401  (re-exported: the row orders)
    frequency_order,
    mean_logit_order,
)
from lmhead.token_logprobs import LogProbRule


@dataclasses.dataclass(frozen=True, kw_only=True)
class CrossEntropyRule(LogProbRule):
    r"""Cross-entropy (smoothing, z-loss), the accuracy and optionally the
    entropy: the log-prob rule of the label, plus a logit sum and the argmax.

    Every option of the loss is a function of three statistics of a token's
    logits ``z`` -- ``lse``, the label's logit ``z_y`` and ``sum_i z_i``
    (:func:`lmhead.losses.token_losses`) -- and accuracy needs the argmax.
    The first two and the entropy are :class:`LogProbRule`'s (``num_ids``
    1, the label); this rule adds the logit sum and the argmax. Outputs:
    ``(lse[, entropy], argmax, label_logit, logit_sum)``. The gradient is

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
    argmax = True

    def statistics(self, outputs) -> tuple:
        """``(lse, label_logit, logit_sum)`` among the outputs (or coefficients)."""
        return outputs[0], self.picked(outputs)[0], outputs[-1]

    def block_stats(self, plan, pass_, z, v0, is_new, labels, previous):
        """The log-prob rule's statistics and the sum of the block's logits."""
        stats = super().block_stats(plan, pass_, z, v0, is_new, labels, previous)
        return stats + (jnp.sum(jnp.where(is_new, z, 0.0), axis=0),)

    def _token_loss(self, loss_scalars, lse, label_logit, logit_sum):
        """``losses.token_losses``' loss; ``loss_scalars: [2]`` float32 holds
        ``(label_smoothing, z_loss)``, used where the rule holds None."""
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

    def loss(self, loss_scalars, outputs, token_inputs=None):
        return self._token_loss(loss_scalars, *self.statistics(outputs))

    def loss_coefs(self, loss_scalars, outputs, weights, token_inputs=None):
        """``weights * dL/d(lse, label_logit, logit_sum)``, token by token;
        None for the entropy and the argmax, which the loss does not read."""
        loss = functools.partial(self._token_loss, loss_scalars)
        _, pullback = jax.vjp(loss, *self.statistics(outputs))
        c_lse, c_label, c_sum = pullback(weights)
        coefs = [None] * len(outputs)
        coefs[0], coefs[self._first_id], coefs[-1] = c_lse, c_label, c_sum
        return tuple(coefs)

    def linear_dlogits(self, z, v0, labels, p, coefs):
        r"""The log-prob rule's, plus :math:`\gamma` of the logit sum."""
        dz = super().linear_dlogits(z, v0, labels, p, coefs)
        return dz if coefs[-1] is None else dz + coefs[-1]


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
    ignore_index: int = losses.IGNORE_INDEX,
    grouped_metrics: bool = False,
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

    Labels follow the rule of ``losses.cross_entropy``
    (``losses.valid_weights``): a label equal to ``ignore_index`` gives its
    token weight 0, eagerly and inside ``jit``; any other label outside
    ``[0, V)`` is a ``ValueError`` when concrete, and weight 0 and a count
    in ``metrics["invalid_labels"]`` inside ``jit``.

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
        vocab_shards: None (default) on one device, or the rows of ``w``
            split over a mesh axis (``vocab_parallel.vocab_shards``; see
            ``vocab_parallel.vocab_parallel_cross_entropy``): each device's
            statistics are combined with ``pmax``/``psum``
            (:meth:`lmhead._fused_rule.Rule.combine`).
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
            ``dw`` is bounded as
            :meth:`lmhead._sweep_options.SweepOptions.gradient_options` states.
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
        ignore_index: the label of an ignored token (weight 0), ``-100`` by
            default as in PyTorch and Hugging Face; an integer.
        grouped_metrics: as in ``losses.cross_entropy``: True gives metrics
            per index of the leading axis (each ``[G]``; the depths of
            multi-token prediction stacked share one sweep this way); the
            entropy stays one number over every token.

    The options of the sweep (``scale`` to ``dw_accumulation``, less the
    loss's own) are checked once, as a
    :class:`lmhead._sweep_options.SweepOptions`, which every fused loss
    builds of the same keywords.

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
    options = SweepOptions(
        scale=scale,
        softcap=softcap,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        precision=precision,
        skip_zero_weights=skip_zero_weights,
        filter_eps=filter_eps,
        filter_target=filter_target,
        dw_accumulation=dw_accumulation,
    )
    _checks.check_unembed_inputs(h, w, bias)
    for name, value in dict(label_smoothing=label_smoothing, z_loss=z_loss).items():
        _checks.check_rank(name, value, 0, "[] (a scalar)")
    losses.check_loss_options(label_smoothing, smoothing, z_loss, reduction)
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be True or False; got {entropy!r}.")
    vocab_size, d_model = jnp.shape(w)
    leading = jnp.shape(h)[:-1]
    losses.check_labels_and_weights(labels, weights, leading)
    groups = losses.metric_groups(grouped_metrics, leading)
    num_tokens = math.prod(leading)
    loss_weights, safe_labels, invalid = losses.valid_weights(
        jnp.reshape(labels, (num_tokens,)),
        None if weights is None else jnp.reshape(weights, -1),
        vocab_size,
        ignore_index,
    )
    if num_tokens == 0:  # nothing to block or split: the logits are empty
        loss, metrics = losses.cross_entropy(
            head.unembed(h, w, bias, scale=scale, softcap=softcap),
            labels,
            weights=weights,
            label_smoothing=label_smoothing,
            smoothing=smoothing,
            z_loss=z_loss,
            reduction=reduction,
            ignore_index=ignore_index,
            grouped_metrics=grouped_metrics,
        )
        no_tokens = jnp.zeros(leading, jnp.float32)
        return loss, metrics | _entropy_metrics(
            entropy, reduction, no_tokens, no_tokens
        )

    plan_smoothing, plan_z_loss, loss_scalars = _loss_scalars(label_smoothing, z_loss)
    rule = CrossEntropyRule(
        entropy=entropy,
        vocab_size=vocab_size,
        label_smoothing=plan_smoothing,
        smoothing=smoothing,
        z_loss=plan_z_loss,
    )
    if skip_zero_weights:
        # A skipped token has no statistics: the gradient w.r.t. its weight
        # is made 0 rather than that of made-up statistics.
        loss_weights = jnp.where(
            loss_weights != 0, loss_weights, lax.stop_gradient(loss_weights)
        )
    objective, outputs = run(
        options,
        rule,
        jnp.reshape(h, (num_tokens, d_model)),
        w,
        bias,
        loss_weights,
        ((safe_labels[:, None], ()), ()),
        grads_in_forward=reduction != "none",
        loss_scalars=loss_scalars,
        vocab_order=vocab_order,
        vocab_shards=vocab_shards,
    )
    token_loss, nll, z_term = losses.token_losses(
        *rule.statistics(outputs),
        vocab_size,
        label_smoothing=label_smoothing,
        smoothing=smoothing,
        z_loss=z_loss,
    )
    correct = rule.predicted(outputs) == safe_labels
    loss, metrics = losses.weighted_metrics(
        token_loss, nll, z_term, correct, loss_weights, invalid, reduction, groups
    )
    if entropy:
        metrics |= _entropy_metrics(
            entropy,
            reduction,
            jnp.reshape(rule.token_entropy(outputs), leading),
            jnp.reshape(loss_weights, leading),
        )
    if reduction == "none":
        return jnp.reshape(loss, leading), metrics
    if reduction == "sum":
        return objective, metrics
    weight_sum = jnp.sum(metrics["weight_sum"])
    return objective / jnp.where(weight_sum > 0, weight_sum, 1.0), metrics
