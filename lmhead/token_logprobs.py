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

from lmhead import _checks, _fused_sweep
from lmhead.head import NEG_INF


@dataclasses.dataclass(frozen=True)
class LogProbRule:
    r"""Log-normalizer, logits of ``k`` given ids and optionally the entropy.

    Outputs ``(lse, z_{y_1}, ..., z_{y_k}[, H])`` per token, from an online
    logsumexp (running max ``m``, :math:`s = \sum_i e^{z_i - m}`), ``k``
    gathers per block and, for the entropy, :math:`t = \sum_i e^{z_i - m}
    (z_i - m)`: :math:`H = \log s - t / s`. For cotangents
    :math:`(\alpha, \beta_1..\beta_k, c)` on the outputs the gradient is

    .. math::
        \frac{\partial L}{\partial z_i} = \alpha p_i + \sum_j \beta_j [i = y_j]
            - c\, p_i (\log p_i + H).

    The rule's own loss (the sweep's objective) is ``token_loss(log p [Nc, k],
    H [Nc] or None, operands)``, ``operands`` the per-token arrays given
    beside the ids (``token_inputs = (ids, operands)``); its gradient
    coefficients are its VJP, known per token while the forward sweep holds
    a chunk's logits, so the sweep's forward gradients apply. Without
    ``token_loss`` it is the first id's negative log-likelihood, which
    :func:`fused_token_logprobs` does not use. With ``segment_loss_fn``
    (``(loss_scalars, sums [S]) -> [S]``, elementwise) and the plan's
    ``segment_length``, the objective is that of each segment's weighted
    sum of ``token_loss``, summed (:class:`lmhead._fused_sweep.Rule`).
    """

    num_ids: int
    entropy: bool
    token_loss: Callable | None = None  # hashable: a module-level function
    segment_loss_fn: Callable | None = None  # hashable too
    passes = 1

    def empty(self, zeros, token_inputs):
        return (zeros,) * (1 + self.num_ids + self.entropy)

    def chunk_context(self, plan, h_chunk, token_inputs, row_inputs):
        return token_inputs[0] - plan.first_row()

    def init(self, pass_, zeros):
        return (zeros + NEG_INF, zeros) + (zeros,) * (self.num_ids + self.entropy)

    def block_stats(self, plan, pass_, z, v0, is_new, ids, previous):
        """Max, sum of ``exp(z - max)``, the ids' logits and the tilted sum."""
        live, peak, exp, sum_exp = _fused_sweep.block_softmax(z, is_new)
        picked = tuple(
            _fused_sweep.label_logit(z, ids[:, j], v0, is_new)
            for j in range(self.num_ids)
        )
        stats = (peak, sum_exp) + picked
        if not self.entropy:
            return stats
        # 0 where exp(z - max) is 0 (a logit of -inf), not 0 * -inf.
        return stats + (jnp.sum(jnp.where(exp > 0, exp * (live - peak), 0.0), axis=0),)

    def merge(self, pass_, carry, block):
        peak, sum_exp, *rest = carry
        b_peak, b_sum_exp, *b_rest = block
        new_peak = jnp.maximum(peak, b_peak)
        k = self.num_ids
        picked = tuple(a + b for a, b in zip(rest[:k], b_rest[:k]))
        tilted = tuple(
            _fused_sweep.rescaled_tilt(t, sum_exp, peak, new_peak)
            + _fused_sweep.rescaled_tilt(b_t, b_sum_exp, b_peak, new_peak)
            for t, b_t in zip(rest[k:], b_rest[k:])
        )
        _, sum_exp = _fused_sweep.merge_softmax(peak, sum_exp, b_peak, b_sum_exp)
        return (new_peak, sum_exp) + picked + tilted

    def combine(self, plan, pass_, carry):
        raise NotImplementedError("token log-probs over a split vocabulary")

    def finish(self, pass_, carry):
        peak, sum_exp, *rest = carry
        picked, tilted = rest[: self.num_ids], rest[self.num_ids :]
        entropy = tuple(jnp.log(sum_exp) - t / sum_exp for t in tilted)
        return (peak + jnp.log(sum_exp), *picked, *entropy)

    def loss(self, loss_scalars, outputs, token_inputs):
        if self.token_loss is None:
            return outputs[0] - outputs[1]
        lse, *picked = outputs[: 1 + self.num_ids]
        logps = jnp.stack(picked, axis=-1) - lse[:, None]
        entropy = outputs[-1] if self.entropy else None
        return self.token_loss(logps, entropy, token_inputs[1])

    def loss_coefs(self, loss_scalars, outputs, weights, token_inputs):
        if self.token_loss is None:
            return (weights, -weights) + (None,) * (self.num_ids - 1 + self.entropy)
        _, pullback = jax.vjp(
            lambda *x: self.loss(loss_scalars, x, token_inputs), *outputs
        )
        return pullback(weights)

    def segment_loss(self, loss_scalars, sums):
        return self.segment_loss_fn(loss_scalars, sums)

    def cotangent_coefs(self, outputs, cotangents):
        return tuple(cotangents)

    def dlogits(self, z, v0, ids, outputs, coefs):
        c_lse, *c_ids = coefs[: 1 + self.num_ids]
        lse = outputs[0]
        p = jnp.exp(z - lse)
        dz = jnp.zeros_like(z) if c_lse is None else c_lse * p
        for j, c in enumerate(c_ids):
            if c is not None:
                dz = dz + jnp.where(_fused_sweep.is_label(z, v0, ids[:, j]), c, 0.0)
        c_entropy = coefs[-1] if self.entropy else None
        if c_entropy is not None:
            # dH/dz_i = -p_i (log p_i + H); 0 where p is 0 (a banned token).
            dz = dz - jnp.where(p > 0, c_entropy * p * (z - lse + outputs[-1]), 0.0)
        return dz

    def sorted_inputs(self, token_inputs, order, inverse):
        ids, operands = token_inputs
        return inverse[ids], operands

    def caller_outputs(self, outputs, order):
        return outputs


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


def _tempered(bias, scale, softcap, temperature):
    """``(bias, scale, softcap)`` of the logits divided by ``temperature``:
    ``c tanh(u / c) / T = (c / T) tanh((u / T) / (c / T))``, so dividing the
    pre-softcap logits ``u`` and the cap by ``T`` divides the logits by it."""
    if temperature == 1.0:
        return bias, scale, softcap
    scale = (1.0 if scale is None else scale) / temperature
    bias = None if bias is None else bias / temperature
    return bias, scale, None if softcap is None else softcap / temperature


def check_options(temperature, scale, softcap, chunk_size, vocab_chunk_size):
    """The sweep's options, as :func:`fused_token_logprobs` checks them."""
    _checks.check_concrete(
        "fused_token_logprobs", temperature=temperature, scale=scale, softcap=softcap
    )
    for name, value in dict(
        temperature=temperature, scale=scale, softcap=softcap
    ).items():
        _checks.check_in_range(name, value, low=0.0, low_open=True)
    _checks.check_count("chunk_size", chunk_size, optional=True)
    _checks.check_count("vocab_chunk_size", vocab_chunk_size, optional=True)


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
    weight 0 (padding, prompts) get outputs 0 and add nothing to a gradient
    (their logits may even be non-finite). ``ids`` get no gradient.

    Args:
        h: ``[..., D]`` hidden states (float32, bf16 or fp16).
        w: ``[V, D]`` unembedding.
        ids: ``[...]`` integer ids, or ``[..., k]`` for ``k`` ids per token
            (e.g. a teacher's top-k), in ``[0, V)`` where ``weights`` is
            nonzero (checked when concrete; inside ``jit`` an id out of
            range reads the logit 0).
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
            (:func:`lmhead._fused_sweep.gradient_options`); the filter
            compares :math:`|p - \\mathrm{onehot}|` of the ids a function
            of the outputs puts a cotangent on.
        vocab_order: the sweep's row order, as in
            ``fused.fused_cross_entropy``; invisible to the caller.

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

    References:
        Wijmans et al., `Cut Your Losses in Large-Vocabulary Language Models
        <https://arxiv.org/abs/2411.09009>`_, 2024 (the chunked sweep);
        Hsu et al., `Liger Kernel <https://arxiv.org/abs/2410.10989>`_, 2024
        (chunked post-training losses).
    """
    _checks.check_unembed_inputs(h, w, bias)
    _checks.check_integer("ids", ids)
    check_options(temperature, scale, softcap, chunk_size, vocab_chunk_size)
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be True or False; got {entropy!r}.")
    vocab_size, d_model = jnp.shape(w)
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
    single = len(ids_shape) == len(leading)
    num_tokens = math.prod(leading)
    num_ids = 1 if single else ids_shape[-1]
    if num_ids < 1:
        raise ValueError(f"ids must have shape [..., k] with k >= 1; got {ids_shape}.")
    if weights is None or _checks.is_traced(weights):
        id_weights = None
    else:
        id_weights = np.broadcast_to(
            np.reshape(np.asarray(weights), (num_tokens, 1)), (num_tokens, num_ids)
        ).reshape(ids_shape)
    _checks.check_ids_in_range("ids", ids, id_weights, vocab_size)
    live = (
        jnp.ones((num_tokens,), jnp.float32)
        if weights is None
        else (jnp.reshape(weights, -1) != 0).astype(jnp.float32)
    )
    options = dict(
        bias=bias,
        temperature=temperature,
        scale=scale,
        softcap=softcap,
        entropy=entropy,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        precision=precision,
        filter_eps=filter_eps,
        filter_target=filter_target,
        dw_accumulation=dw_accumulation,
        vocab_order=vocab_order,
    )
    return token_loss_sweep(h, w, ids, live, **options)[1]


def token_loss_sweep(
    h,
    w,
    ids,
    loss_weights,
    *,
    token_loss=None,
    operands=(),
    segment_loss=None,
    segment_length=None,
    loss_scalars=(),
    **options,
) -> tuple[jax.Array, TokenLogProbs]:
    """``(sum_t loss_weights_t * token_loss_t, TokenLogProbs)`` from one sweep.

    For losses that are a weighted sum over tokens of a function of each
    token's own log-probs, entropy and ``operands`` (``[N]`` arrays, e.g.
    old log-probs and advantages): :class:`LogProbRule` with ``token_loss``
    computes the gradient of the sum in the forward sweep, from each
    chunk's kept logits, as the fused cross-entropy does. Tokens of
    ``loss_weights`` 0 have outputs 0 and no gradient. ``h``, ``w``, ``ids``
    and the options are :func:`fused_token_logprobs`' (after its checks);
    ``token_loss(logps [Nc, k], entropy [Nc] or None, operands) -> [Nc]``,
    a hashable callable (a frozen dataclass or a module-level function).

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
        ...     h, w, ids, weights, token_loss=nll, bias=None, temperature=1.0,
        ...     scale=None, softcap=None, entropy=False, chunk_size=4,
        ...     vocab_chunk_size=None, precision=None, filter_eps=None,
        ...     filter_target="both", dw_accumulation="float32")
        >>> bool(jnp.allclose(loss, -jnp.sum(weights * out.logprobs)))
        True
    """
    bias, temperature, entropy = (
        options["bias"],
        options["temperature"],
        options["entropy"],
    )
    vocab_size, d_model = jnp.shape(w)
    leading, ids_shape = jnp.shape(h)[:-1], jnp.shape(ids)
    num_tokens = math.prod(leading)
    num_ids = 1 if len(ids_shape) == len(leading) else ids_shape[-1]
    loss_weights = jnp.reshape(jnp.asarray(loss_weights, jnp.float32), -1)
    flat_ids = jnp.reshape(jnp.clip(ids, 0, vocab_size - 1), (num_tokens, num_ids))
    bias, scale, softcap = _tempered(
        bias, options["scale"], options["softcap"], float(temperature)
    )
    rule = LogProbRule(num_ids, entropy, token_loss, segment_loss)
    dtype = jnp.result_type(h, w)
    gradients = _fused_sweep.gradient_options(
        options["filter_eps"],
        options["filter_target"],
        options["dw_accumulation"],
        dtype,
    )
    order = _fused_sweep.check_vocab_order(options.get("vocab_order"), vocab_size)
    if num_tokens == 0:
        objective = jnp.zeros((), jnp.float32)
        outputs = (jnp.zeros((0,), jnp.float32),) * (1 + num_ids + entropy)
    else:
        plan = _fused_sweep.Plan(
            rule,
            vocab_size,
            None,
            *_fused_sweep.block_sizes(
                num_tokens,
                vocab_size,
                options["chunk_size"],
                options["vocab_chunk_size"],
                segment_length,
            ),
            None if scale is None else float(scale),
            None if softcap is None else float(softcap),
            options["precision"],
            grads_in_forward=token_loss is not None,
            **gradients,
            segment_length=segment_length,
        )
        objective, outputs = _fused_sweep.fused_core(
            plan,
            jnp.reshape(h, (num_tokens, d_model)).astype(dtype),
            jnp.asarray(w, dtype),
            None if bias is None else jnp.asarray(bias),
            jnp.asarray(loss_scalars, jnp.float32),
            loss_weights,
            ((flat_ids, operands), ()),
            order,
        )
    live = loss_weights
    lse, *picked = outputs[: 1 + num_ids]
    kept = live != 0

    def shaped(x, shape):
        # where, not a product: a padding token's outputs may not be finite.
        return jnp.reshape(
            jnp.where(kept.reshape(kept.shape + (1,) * (x.ndim - 1)), x, 0.0), shape
        )

    logprobs = jnp.stack(picked, axis=-1) - lse[:, None]
    return objective, TokenLogProbs(
        shaped(logprobs, ids_shape),
        shaped(outputs[-1], leading) if entropy else None,
        shaped(lse, leading),
    )
