r"""Per-token log-probabilities and entropies through the head, fused.

Post-training losses (preference optimization, policy gradients, sparse
distillation) need, for each token, the log-probability of given ids under
``softmax(softcap(scale * h @ w.T + bias) / T)``, sometimes its entropy,
and nothing else of the ``[N, V]`` logits. :func:`fused_token_logprobs`
returns them as ``[N]`` (or ``[N, k]``) arrays from one rule of the one
chunked sweep (:mod:`lmhead._fused_sweep`), :class:`LogProbRule`; every loss
above it (:mod:`lmhead.preference`, :mod:`lmhead.policy_gradient`,
:mod:`lmhead.sparse_distillation`) is plain JAX on these vectors, and its
gradient reaches ``h``, ``w`` and ``bias`` through the sweep's custom VJP,
which recomputes the logits for whatever cotangent the loss puts on them.
docs/post_training.md derives the rule and lists the losses.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks, _fused_rule, _fused_sweep, _online_softmax, losses
from lmhead._sweep_options import SweepOptions


@dataclasses.dataclass(frozen=True)
class LogProbRule(_fused_rule.Rule):
    r"""Log-normalizer, logits of ``k`` given ids and optionally the entropy.

    Outputs ``(lse[, H][, argmax], z_{y_1}, ..., z_{y_k})`` per token, from
    an online logsumexp (running max ``m``, :math:`s = \sum_i e^{z_i - m}`;
    for the entropy :math:`t = \sum_i e^{z_i - m} (z_i - m)`, :math:`H =
    \log s - t / s`; the argmax for a subclass that sets ``argmax``,
    :class:`lmhead.fused.CrossEntropyRule`) and ``k`` gathers per block.
    For cotangents :math:`(\alpha, c, \beta_1..\beta_k)` on the outputs
    the gradient is

    .. math::
        \frac{\partial L}{\partial z_i} = \alpha p_i + \sum_j \beta_j [i = y_j]
            - c\, p_i (\log p_i + H).

    The rule's own loss (the sweep's objective) is ``token_loss(log p [Nc, k],
    H [Nc] or None, operands)``, ``operands`` the per-token arrays given
    beside the ids (``token_inputs = (ids [N, k], operands)``); its gradient
    coefficients are its VJP, known per token while the forward sweep holds
    a chunk's logits, so the sweep's forward gradients apply. Without
    ``token_loss`` it is the first id's negative log-likelihood, which
    :func:`fused_token_logprobs` does not use. With ``segment_loss_fn``
    (``(loss_scalars, sums [S]) -> [S]``, elementwise) and the plan's
    ``segment_length``, the objective is that of each segment's weighted
    sum of ``token_loss``, summed (:class:`lmhead._fused_rule.Rule`).
    """

    num_ids: int = 1
    entropy: bool = False
    token_loss: Callable | None = None  # hashable: a module-level function
    segment_loss_fn: Callable | None = None  # hashable too
    argmax = False  # the first row of each token's max, an output too

    @property
    def _first_id(self) -> int:
        return 1 + self.entropy + self.argmax

    def picked(self, outputs) -> tuple:
        """The ``k`` ids' logits among the outputs."""
        return outputs[self._first_id : self._first_id + self.num_ids]

    def token_entropy(self, outputs):
        """The entropy among the outputs, or None."""
        return outputs[1] if self.entropy else None

    def predicted(self, outputs):
        """Each token's argmax among the outputs (a rule with ``argmax``)."""
        return outputs[1 + self.entropy]

    def logprobs(self, outputs):
        """``[N, k]`` log-probabilities of the ids."""
        return jnp.stack(self.picked(outputs), axis=-1) - outputs[0][:, None]

    def chunk_context(self, plan, h_chunk, token_inputs, row_inputs):
        return token_inputs[0] - plan.first_row()  # ids from a device's rows

    def block_stats(self, plan, pass_, z, v0, is_new, ids, previous):
        """The online softmax (its tilted sum, its argmax) and the ids' logits."""
        softmax = _online_softmax.Softmax.of_block(
            z, v0, is_new, entropy=self.entropy, argmax=self.argmax
        )
        picked = tuple(
            _online_softmax.label_logit(z, ids[:, j], v0, is_new)
            for j in range(self.num_ids)
        )
        return (softmax, *picked)

    def loss(self, loss_scalars, outputs, token_inputs):
        if self.token_loss is None:
            return outputs[0] - self.picked(outputs)[0]
        entropy = self.token_entropy(outputs)
        return self.token_loss(self.logprobs(outputs), entropy, token_inputs[1])

    def segment_loss(self, loss_scalars, sums):
        return self.segment_loss_fn(loss_scalars, sums)

    def linear_dlogits(self, z, v0, ids, p, coefs):
        r"""The gradient through the statistics linear in ``p`` and ``z``:
        :math:`\alpha p_i + \sum_j \beta_j [i = y_j]`."""
        c_lse = coefs[0]
        dz = jnp.zeros_like(z) if c_lse is None else c_lse * p
        for j, c in enumerate(self.picked(coefs)):
            if c is not None:
                dz = dz + jnp.where(_online_softmax.is_label(z, v0, ids[:, j]), c, 0.0)
        return dz

    def dlogits(self, z, v0, ids, outputs, coefs):
        lse = outputs[0]
        p = jnp.exp(z - lse)
        dz = self.linear_dlogits(z, v0, ids, p, coefs)
        c_entropy = self.token_entropy(coefs)
        if c_entropy is not None:
            # dH/dz_i = -p_i (log p_i + H); 0 where p is 0 (a logit of -inf),
            # not 0 * -inf.
            entropy = self.token_entropy(outputs)
            dz = dz - jnp.where(p > 0, c_entropy * p * (z - lse + entropy), 0.0)
        return dz

    def sorted_inputs(self, token_inputs, order, inverse):
        ids, operands = token_inputs
        return inverse[ids], operands

    def caller_outputs(self, outputs, order):
        if not self.argmax:
            return outputs
        at = 1 + self.entropy
        return outputs[:at] + (order[self.predicted(outputs)],) + outputs[at + 1 :]


class TokenLogProbs(NamedTuple):
    """What :func:`fused_token_logprobs` returns.

    Attributes:
        logprobs: ``[...]`` (or ``[..., k]``) ``log p(id)``.
        entropy: ``[...]`` :math:`H = -\\sum_i p_i \\log p_i`, or None when
            not asked for.
        log_normalizer: ``[...]`` ``logsumexp(z)`` of the tempered logits.
    """

    logprobs: jax.Array
    entropy: jax.Array | None
    log_normalizer: jax.Array


def fused_token_logprobs(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    ids: jax.typing.ArrayLike,
    *,
    bias: jax.typing.ArrayLike | None = None,
    weights: jax.typing.ArrayLike | None = None,
    temperature: float = 1.0,
    scale: float | None = None,
    softcap: float | None = None,
    entropy: bool = False,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    precision: jax.lax.PrecisionLike = None,
    filter_eps: float | str | None = None,
    filter_target: str = "both",
    dw_accumulation: str = "float32",
    vocab_order: jax.typing.ArrayLike | str | None = None,
    ignore_index: int = losses.IGNORE_INDEX,
    vocab_shards: _fused_rule.VocabShards | None = None,
) -> TokenLogProbs:
    r"""Each token's log-probability of given ids, without the ``[N, V]`` logits.

    .. math::
        z_t = \mathrm{softcap}_c(s\, W h_t + b) / T, \qquad
        \log p_t(y) = z_{t,y} - \mathrm{logsumexp}(z_t), \qquad
        H_t = -\sum_i p_{t,i} \log p_{t,i}.

    The gradient of any function of the outputs with respect to ``h``, ``w``
    and ``bias`` is exact: the sweep's custom VJP recomputes the logits chunk
    by chunk and applies :class:`LogProbRule`'s gradient for the cotangents
    the function puts on ``log p``, ``H`` and the log-normalizer. Tokens of
    weight 0 (padding, prompts) and ignored tokens get outputs 0 and add
    nothing to a gradient (their logits may even be non-finite). ``ids``
    get no gradient.

    Args:
        h: ``[..., D]`` hidden states (float32, bf16 or fp16).
        w: ``[V, D]`` unembedding.
        ids: ``[...]`` integer ids, or ``[..., k]`` for ``k`` ids per token
            (e.g. a teacher's top-k), in ``[0, V)``. A token whose ids all
            equal ``ignore_index`` is ignored (weight 0); any other id
            outside ``[0, V)`` where ``weights`` is nonzero is an error
            when concrete, and inside ``jit`` gives its token weight 0
            (``losses.valid_weights``).
        bias: optional ``[V]``.
        weights: optional ``[...]``; 0 marks a token whose outputs are 0 and
            that gets no gradient. Only ``!= 0`` matters.
        temperature: ``T > 0`` divides the logits (after the softcap), as a
            sampler at temperature ``T`` does; concrete.
        scale, softcap, precision: as in ``head.unembed``; concrete.
        entropy: True to return :math:`H_t` too.
        chunk_size, vocab_chunk_size: as in ``fused.fused_cross_entropy``.
        filter_eps, filter_target, dw_accumulation: gradient filtering and
            ``dw``'s accumulation, as in ``fused.fused_cross_entropy``
            (:meth:`lmhead._sweep_options.SweepOptions.gradient_options`);
            the filter compares :math:`|p - \\mathrm{onehot}|` of the ids a
            function of the outputs puts a cotangent on.
        vocab_order: the sweep's row order, as in
            ``fused.fused_cross_entropy``; invisible to the caller.
        ignore_index: the id of an ignored token, ``-100`` by default (as in
            PyTorch and Hugging Face).
        vocab_shards: None (default) on one device, or the rows of ``w``
            split over a mesh axis (``vocab_parallel.vocab_shards``), each
            device's statistics combined as ``fused.fused_cross_entropy``'s.

    Returns:
        :class:`TokenLogProbs` ``(logprobs, entropy or None, log_normalizer)``,
        float32.

    Raises:
        ValueError, TypeError: for bad shapes, dtypes or options, naming the
            argument.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> h = jax.random.normal(jax.random.key(0), (2, 3, 4))
        >>> w = jax.random.normal(jax.random.key(1), (10, 4))
        >>> ids = jnp.array([[8, 5, 3], [1, 2, 6]])
        >>> out = fused_token_logprobs(h, w, ids, entropy=True, chunk_size=4)
        >>> reference = jnp.take_along_axis(
        ...     jax.nn.log_softmax(h @ w.T), ids[..., None], axis=-1)[..., 0]
        >>> bool(jnp.allclose(out.logprobs, reference, atol=1e-5))
        True
        >>> out.entropy.shape, out.log_normalizer.shape
        ((2, 3), (2, 3))
        >>> fused_token_logprobs(h, w, ids.at[1, 2].set(-100)).logprobs[1, 2]
        Array(0., dtype=float32)

    References:
        Wijmans et al., `Cut Your Losses in Large-Vocabulary Language Models
        <https://arxiv.org/abs/2411.09009>`_, 2024 (the chunked sweep);
        Hsu et al., `Liger Kernel <https://arxiv.org/abs/2410.10989>`_, 2024
        (chunked post-training losses).
    """
    options = SweepOptions(
        scale=scale,
        softcap=softcap,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        precision=precision,
        filter_eps=filter_eps,
        filter_target=filter_target,
        dw_accumulation=dw_accumulation,
    )
    return sweep_token_logprobs(
        h,
        w,
        ids,
        options,
        bias=bias,
        weights=weights,
        entropy=entropy,
        vocab_order=vocab_order,
        ignore_index=ignore_index,
        vocab_shards=vocab_shards,
    )


def sweep_token_logprobs(
    h,
    w,
    ids,
    options: SweepOptions,
    *,
    bias=None,
    weights=None,
    entropy=False,
    vocab_order=None,
    ignore_index=losses.IGNORE_INDEX,
    vocab_shards=None,
) -> TokenLogProbs:
    """:func:`fused_token_logprobs` with its sweep's options built: the checks
    of the arrays and the ids' rule, then one sweep."""
    _checks.check_unembed_inputs(h, w, bias)
    _checks.check_integer("ids", ids)
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be True or False; got {entropy!r}.")
    vocab_size = jnp.shape(w)[0]
    leading = jnp.shape(h)[:-1]
    ids_shape = jnp.shape(ids)
    if ids_shape[: len(leading)] != leading or len(ids_shape) > len(leading) + 1:
        raise ValueError(
            f"ids must have shape [...] = {leading} or [..., k]; got {ids_shape}."
        )
    if weights is not None and jnp.shape(weights) != leading:
        raise ValueError(
            f"weights must have shape [...] = {leading}; got {jnp.shape(weights)}."
        )
    if weights is not None and not _checks.is_traced(weights):
        if np.any(~np.isfinite(np.asarray(weights, np.float64))):
            raise ValueError("weights must be finite (0 marks padding).")
    num_tokens = math.prod(leading)
    num_ids = 1 if len(ids_shape) == len(leading) else ids_shape[-1]
    if num_ids < 1:
        raise ValueError(f"ids must have shape [..., k] with k >= 1; got {ids_shape}.")
    token_weights, _, _ = losses.valid_weights(
        jnp.reshape(ids, (num_tokens, num_ids)),
        jnp.ones(num_tokens) if weights is None else jnp.reshape(weights, -1),
        vocab_size,
        ignore_index,
        name="ids",
    )
    live = (token_weights != 0).astype(jnp.float32)
    return token_loss_sweep(
        h,
        w,
        ids,
        live,
        options,
        bias=bias,
        entropy=entropy,
        vocab_order=vocab_order,
        vocab_shards=vocab_shards,
    )[1]


def token_loss_sweep(
    h,
    w,
    ids,
    loss_weights,
    options: SweepOptions,
    *,
    bias=None,
    entropy=False,
    vocab_order=None,
    vocab_shards=None,
    token_loss=None,
    operands=(),
    segment_loss=None,
    segment_length=None,
    loss_scalars=(),
) -> tuple[jax.Array, TokenLogProbs]:
    """``(sum_t loss_weights_t * token_loss_t, TokenLogProbs)`` from one sweep.

    For losses that are a weighted sum over tokens of a function of each
    token's own log-probs, entropy and ``operands`` (``[N]`` arrays, e.g.
    old log-probs and advantages): :class:`LogProbRule` with ``token_loss``
    computes the gradient of the sum in the forward sweep, from each
    chunk's kept logits, as the fused cross-entropy does. Tokens of
    ``loss_weights`` 0 have outputs 0 and no gradient; the ids of the
    others are taken to be in ``[0, V)`` (clipped into it: the caller's
    checks and rule come first). ``h``, ``w``, ``ids``, ``bias``,
    ``entropy``, ``vocab_order`` and ``vocab_shards`` are
    :func:`fused_token_logprobs`' (after its checks); ``options`` its
    :class:`SweepOptions`; ``token_loss(logps [Nc, k], entropy [Nc] or None,
    operands) -> [Nc]``, a hashable callable (a frozen dataclass or a
    module-level function).

    With ``segment_length`` ``L`` (dividing ``N``) and ``segment_loss``
    (hashable, ``(loss_scalars, sums [S]) -> [S]`` elementwise), the first
    output is ``sum_s segment_loss(U)_s``, ``U_s`` the weighted sum of
    ``token_loss`` over tokens ``[s L, (s + 1) L)`` (e.g. a DPO pair's
    log-ratio margin): its gradient comes from the forward sweep too, each
    token's coefficient scaled by its segment's ``segment_loss'(U_s)`` once
    the segment is done (:func:`lmhead._fused_sweep._chunk_loop`).
    ``loss_scalars``: ``[k]`` array operands of ``segment_loss`` (traced
    options), with exact gradients.

    Examples:
        The negative log-likelihood as a token loss, weighted:

        >>> import jax, jax.numpy as jnp
        >>> h = jax.random.normal(jax.random.key(0), (6, 4))
        >>> w = jax.random.normal(jax.random.key(1), (10, 4))
        >>> ids = jnp.array([8, 5, 3, 1, 2, 6])
        >>> weights = jnp.array([1.0, 1.0, 1.0, 0.5, 0.5, 0.0])
        >>> nll = lambda logps, entropy, operands: -logps[:, 0]
        >>> loss, out = token_loss_sweep(
        ...     h, w, ids, weights, SweepOptions(chunk_size=4), token_loss=nll)
        >>> bool(jnp.allclose(loss, -jnp.sum(weights * out.logprobs)))
        True
    """
    vocab_size, d_model = jnp.shape(w)
    leading, ids_shape = jnp.shape(h)[:-1], jnp.shape(ids)
    num_tokens = math.prod(leading)
    num_ids = 1 if len(ids_shape) == len(leading) else ids_shape[-1]
    loss_weights = jnp.reshape(jnp.asarray(loss_weights, jnp.float32), -1)
    flat_ids = jnp.reshape(jnp.clip(ids, 0, vocab_size - 1), (num_tokens, num_ids))
    rule = LogProbRule(num_ids, entropy, token_loss, segment_loss)
    if num_tokens == 0:
        objective = jnp.zeros((), jnp.float32)
        outputs = (jnp.zeros((0,), jnp.float32),) * (1 + entropy + num_ids)
    else:
        objective, outputs = _fused_sweep.run(
            options,
            rule,
            jnp.reshape(h, (num_tokens, d_model)),
            w,
            bias,
            loss_weights,
            ((flat_ids, operands), ()),
            grads_in_forward=token_loss is not None,
            loss_scalars=jnp.asarray(loss_scalars, jnp.float32),
            vocab_order=vocab_order,
            vocab_shards=vocab_shards,
            segment_length=segment_length,
        )
    kept = loss_weights != 0

    def shaped(x, shape):
        # where, not a product: a padding token's outputs may not be finite.
        return jnp.reshape(
            jnp.where(kept.reshape(kept.shape + (1,) * (x.ndim - 1)), x, 0.0), shape
        )

    return objective, TokenLogProbs(
        shaped(rule.logprobs(outputs), ids_shape),
        shaped(rule.token_entropy(outputs), leading) if entropy else None,
        shaped(outputs[0], leading),
    )
