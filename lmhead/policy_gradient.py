r"""Policy-gradient losses per token: GRPO and its variants (DAPO, BNPO,
Dr. GRPO, GSPO), with a k3 KL to a reference and an entropy bonus, through
the head without the ``[N, V]`` logits.

:func:`policy_gradient_loss` is plain JAX on per-token log-probabilities
``[B, T]`` (and entropies); :func:`fused_policy_gradient_loss` gets them
from :func:`lmhead.token_logprobs.fused_token_logprobs`, whose sweep gives
the exact gradient. The formulas follow Liger-Kernel's GRPO
(``chunked_loss/grpo_loss.py``); docs/post_training.md lists them.
"""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks, losses, token_logprobs
from lmhead._sweep_options import SweepOptions

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
IMPORTANCE_SAMPLING = ("token", "sequence")


def k3_kl(logps: jax.Array, ref_logps: jax.Array) -> jax.Array:
    r"""Schulman's k3 estimate of :math:`\mathrm{KL}(\pi \| \pi_{ref})` per
    token: :math:`e^{r} - r - 1` with :math:`r = \log\pi_{ref} - \log\pi`;
    unbiased for samples of :math:`\pi`, and ``>= 0``.

    Examples:
        >>> import jax.numpy as jnp
        >>> print(f"{k3_kl(jnp.log(0.25), jnp.log(0.5)):.4f}")  # 1 - log 2
        0.3069

    References:
        Schulman, `Approximating KL Divergence
        <http://joschu.net/blog/kl-approx.html>`_, 2020.
    """
    r = ref_logps - logps
    return jnp.exp(r) - r - 1.0


@dataclasses.dataclass(frozen=True)
class TokenObjective:
    """GRPO's per-token loss given each token's log-ratio: the clipped
    surrogate, ``beta`` times the k3 KL, minus the entropy bonus. Hashable,
    so that :class:`lmhead.token_logprobs.LogProbRule` can hold it.

    Examples:
        A ratio of 1.5 clipped to 1.2 for an advantage of 1:

        >>> import jax.numpy as jnp
        >>> objective = TokenObjective(0.2, 0.2, None, 0.0, 0.0)
        >>> loss, ratio = objective.terms(jnp.log(1.5), 1.0, None, None, None)
        >>> print(f"{loss:.2f} {ratio:.2f}")
        -1.20 1.50
    """

    epsilon_low: float
    epsilon_high: float
    delta: float | None
    beta: float
    entropy_weight: float

    def terms(self, log_ratio, advantage, logps, ref_logps, entropy):
        """``(token loss, ratio)``; ``log_ratio`` and ``advantage`` broadcast
        against ``logps``, ``ref_logps`` and ``entropy`` (None: left out)."""
        ratio = jnp.exp(log_ratio)
        clipped = jnp.clip(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
        unclipped = ratio if self.delta is None else jnp.minimum(ratio, self.delta)
        loss = -jnp.minimum(unclipped * advantage, clipped * advantage)
        if self.beta > 0:
            loss = loss + self.beta * k3_kl(logps, ref_logps)
        if entropy is not None and self.entropy_weight != 0:
            loss = loss - self.entropy_weight * entropy
        return loss, ratio

    def __call__(self, logps, entropy, operands):
        """The rule's ``token_loss``: ``logps [Nc, 1]``, ``operands = (old
        log-probs or None, reference log-probs, advantages)``, each ``[Nc]``."""
        old, ref, advantage = operands
        logps = logps[:, 0]
        old = jax.lax.stop_gradient(logps) if old is None else old
        return self.terms(logps - old, advantage, logps, ref, entropy)[0]


def check_options(
    loss_type,
    importance_sampling,
    epsilon_low,
    epsilon_high,
    delta,
    beta,
    max_completion_length,
):
    """The loss options, as :func:`policy_gradient_loss` checks them."""
    _checks.check_choice("loss_type", loss_type, LOSS_TYPES)
    _checks.check_choice(
        "importance_sampling", importance_sampling, IMPORTANCE_SAMPLING
    )
    _checks.check_in_range(
        "epsilon_low", epsilon_low, low=0.0, high=1.0, high_open=True
    )
    _checks.check_in_range("epsilon_high", epsilon_high, low=0.0)
    if delta is not None:
        _checks.check_in_range("delta", delta, low=1.0 + epsilon_high, low_open=True)
    _checks.check_in_range("beta", beta, low=0.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError(
                "max_completion_length is required for loss_type='dr_grpo' (its "
                "constant normalizer is B * max_completion_length); got None."
            )
        _checks.check_count("max_completion_length", max_completion_length)


def _check_shapes(logps, mask, advantages, **per_token):
    _checks.check_floating("logps", logps)
    _checks.check_rank("logps", logps, 2, "[B, T]")
    shape = jnp.shape(logps)
    if jnp.shape(advantages) != shape[:1]:
        raise ValueError(
            f"advantages must have shape [B] = {shape[:1]} (one per sequence); "
            f"got {jnp.shape(advantages)}."
        )
    for name, x in dict(mask=mask, **per_token).items():
        if x is not None and jnp.shape(x) != shape:
            raise ValueError(
                f"{name} must have shape [B, T] = {shape}; got {jnp.shape(x)}."
            )
    if not _checks.is_traced(mask):
        m = np.asarray(mask, np.float64)
        if np.any(~(m >= 0)) or np.any(~np.isfinite(m)):
            raise ValueError("mask must be finite and >= 0.")
        if not np.any(m > 0):
            raise ValueError("mask must mark at least one token; got none.")


def policy_gradient_loss(
    logps: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    advantages: jax.typing.ArrayLike,
    *,
    old_logps: jax.typing.ArrayLike | None = None,
    ref_logps: jax.typing.ArrayLike | None = None,
    entropy: jax.typing.ArrayLike | None = None,
    loss_type: str = "dapo",
    importance_sampling: str = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    beta: float = 0.0,
    entropy_weight: float = 0.0,
    max_completion_length: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""The clipped policy-gradient loss of GRPO and its variants.

    Per token, with :math:`A_b` the sequence's advantage and the importance
    ratio :math:`\rho_t = e^{\log\pi_t - \log\pi^{old}_t}` (``token``) or
    :math:`\rho_b = \exp(\sum_t m_t (\log\pi_t - \log\pi^{old}_t) / \sum_t
    m_t)` (``sequence``: GSPO),

    .. math::
        \ell_t = -\min\big(\min(\rho, \delta) A_b,\
            \mathrm{clip}(\rho, 1 - \epsilon_{low}, 1 + \epsilon_{high}) A_b\big)
            + \beta\, \mathrm{k3}(\pi_t, \pi^{ref}_t) - \lambda_H H_t,

    aggregated with the mask :math:`m` as ``grpo`` (each sequence's
    :math:`\sum_t m_t \ell_t / \sum_t m_t`, mean over the ``B``
    sequences), ``bnpo`` and ``dapo`` (:math:`\sum m \ell / \sum m` over the
    batch; DAPO's normalizer is the global token count, which is the
    batch's when the batch is the whole step), or ``dr_grpo``
    (:math:`\sum m \ell / (B L_{max})`). Without ``old_logps`` the ratio is
    1 and its gradient that of :math:`\log\pi` (one update per rollout).
    :math:`\delta` (optional) bounds the unclipped ratio from above, the
    two-sided clipping of TRL's ``delta``. The entropy bonus
    :math:`\lambda_H` is this project's addition (Liger has none).

    Args:
        logps: ``[B, T]`` the policy's log-probabilities of the sampled tokens.
        mask: ``[B, T]`` ``>= 0``: the completions' tokens (1), prompt and
            padding (0); values weight tokens. Some token must be marked.
        advantages: ``[B]``, one per sequence (no gradient).
        old_logps, ref_logps: optional ``[B, T]`` of the sampling policy and
            the reference (no gradient); ``ref_logps`` is needed for
            ``beta > 0``.
        entropy: optional ``[B, T]`` per-token entropies, for the bonus and
            the ``entropy`` metric.
        loss_type: one of ``LOSS_TYPES``. importance_sampling: ``"token"`` or
            ``"sequence"``.
        epsilon_low: in ``[0, 1)``. epsilon_high: ``>= 0``.
        delta: None, or ``> 1 + epsilon_high``.
        beta: the k3 KL's weight, ``>= 0``. entropy_weight: :math:`\lambda_H`.
        max_completion_length: :math:`L_{max}`, for ``dr_grpo``.

    Returns:
        ``(loss, metrics)``: ``metrics`` has token means (over the mask) of
        ``clip_ratio`` (tokens whose clipped term is the one taken: ratio
        below :math:`1-\epsilon_{low}` with :math:`A < 0` or above
        :math:`1+\epsilon_{high}` with :math:`A > 0`), ``clip_low``,
        ``clip_high``, ``ratio``, and ``kl`` (with ``ref_logps``) and
        ``entropy`` (with ``entropy``).

    Raises:
        ValueError, TypeError: for bad shapes or options, naming the argument.

    Examples:
        A token whose ratio 1.5 is clipped to 1.2 for an advantage of 1:

        >>> import jax.numpy as jnp
        >>> loss, metrics = policy_gradient_loss(
        ...     jnp.log(jnp.array([[0.3]])), jnp.ones((1, 1)), jnp.ones(1),
        ...     old_logps=jnp.log(jnp.array([[0.2]])))
        >>> print(f"{loss:.3f} {metrics['clip_ratio']:.1f}")
        -1.200 1.0

    References:
        Shao et al., `DeepSeekMath <https://arxiv.org/abs/2402.03300>`_, 2024
        (GRPO); Yu et al., `DAPO <https://arxiv.org/abs/2503.14476>`_, 2025;
        Liu et al., `Understanding R1-Zero-Like Training
        <https://arxiv.org/abs/2503.20783>`_, 2025 (Dr. GRPO); Zheng et al.,
        `Group Sequence Policy Optimization
        <https://arxiv.org/abs/2507.18071>`_, 2025 (GSPO).
    """
    check_options(
        loss_type,
        importance_sampling,
        epsilon_low,
        epsilon_high,
        delta,
        beta,
        max_completion_length,
    )
    _check_shapes(
        logps,
        mask,
        advantages,
        old_logps=old_logps,
        ref_logps=ref_logps,
        entropy=entropy,
    )
    if beta > 0 and ref_logps is None:
        raise ValueError("ref_logps is required for beta > 0 (the KL's reference).")
    m = jnp.asarray(mask, jnp.float32)
    live = m != 0

    def masked(x):
        # where, not a product: a padding token's value may not be finite.
        return jnp.where(live, jnp.asarray(x, jnp.float32), 0.0)

    logps = masked(logps)
    old = jax.lax.stop_gradient(logps if old_logps is None else masked(old_logps))
    advantage = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))[:, None]
    log_ratio = logps - old
    if importance_sampling == "sequence":
        counts = jnp.maximum(jnp.sum(m, -1, keepdims=True), 1.0)
        log_ratio = jnp.sum(m * log_ratio, -1, keepdims=True) / counts
    objective = TokenObjective(
        epsilon_low,
        epsilon_high,
        delta,
        beta,
        0.0 if entropy is None else entropy_weight,
    )
    ref = None if ref_logps is None else jax.lax.stop_gradient(masked(ref_logps))
    entropy = None if entropy is None else masked(entropy)
    token_loss, ratio = objective.terms(log_ratio, advantage, logps, ref, entropy)
    token_loss = jnp.broadcast_to(token_loss, m.shape)
    low = jnp.broadcast_to((ratio < 1.0 - epsilon_low) & (advantage < 0), m.shape)
    high = jnp.broadcast_to((ratio > 1.0 + epsilon_high) & (advantage > 0), m.shape)
    token_mean = lambda x: jnp.sum(m * x) / jnp.sum(m)  # noqa: E731
    metrics = {
        "clip_low": token_mean(low),
        "clip_high": token_mean(high),
        "clip_ratio": token_mean(low | high),
        "ratio": token_mean(jnp.broadcast_to(ratio, m.shape)),
    }
    if ref is not None:
        metrics["kl"] = token_mean(masked(k3_kl(logps, ref)))
    if entropy is not None:
        metrics["entropy"] = token_mean(entropy)
    total = jnp.sum(m * token_loss)
    if loss_type == "grpo":
        counts = jnp.maximum(jnp.sum(m, -1), 1.0)
        loss = jnp.mean(jnp.sum(m * token_loss, -1) / counts)
    elif loss_type == "dr_grpo":
        loss = total / (m.shape[0] * max_completion_length)
    else:
        loss = total / jnp.sum(m)
    return loss, metrics


def fused_policy_gradient_loss(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    ids: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    advantages: jax.typing.ArrayLike,
    *,
    bias: jax.typing.ArrayLike | None = None,
    old_logps: jax.typing.ArrayLike | None = None,
    ref_logps: jax.typing.ArrayLike | None = None,
    reference_head: tuple | None = None,
    entropy_weight: float | None = None,
    temperature: float = 1.0,
    scale: float | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    filter_eps: float | str | None = None,
    filter_target: str = "both",
    dw_accumulation: str = "float32",
    vocab_order: jax.typing.ArrayLike | str | None = None,
    ignore_index: int = losses.IGNORE_INDEX,
    **options,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r""":func:`policy_gradient_loss` of the head ``softcap(scale * h @ w.T +
    bias) / T``, fused.

    The policy's per-token log-probs (and entropies, when
    ``entropy_weight`` is a number) come from one
    :func:`lmhead.token_logprobs.fused_token_logprobs` sweep; the gradient
    w.r.t. ``h``, ``w`` and ``bias`` is exact and no ``[N, V]`` array is
    built. The reference is ``ref_logps`` or ``reference_head = (h_ref,
    w_ref[, bias_ref])``, whose log-probs come from a sweep that gets no
    gradient.

    Args:
        h: ``[B, T, D]``; position ``t`` predicts ``ids[:, t]``.
        w: ``[V, D]``. bias: optional ``[V]``.
        ids: ``[B, T]`` the sampled tokens. A token whose id equals
            ``ignore_index`` (``-100`` by default) is left out, as if its
            mask were 0; any other id outside ``[0, V)`` where the mask is
            nonzero is an error when concrete, and left out too inside
            ``jit`` (``losses.valid_weights``).
        mask, advantages, old_logps, ref_logps: as in
            :func:`policy_gradient_loss`.
        reference_head: the frozen reference's ``(h_ref [B, T, D_ref],
            w_ref [V, D_ref][, bias_ref])``; not with ``ref_logps``.
        entropy_weight: None computes no entropy; a number computes it (the
            ``entropy`` metric) and weights the bonus (0: metric only).
        temperature, scale, softcap, chunk_size, vocab_chunk_size,
            filter_eps, filter_target, dw_accumulation, vocab_order: as in
            :func:`lmhead.token_logprobs.fused_token_logprobs`.
        **options: the rest of :func:`policy_gradient_loss`'s options
            (``loss_type``, ``importance_sampling``, ``epsilon_low``,
            ``epsilon_high``, ``delta``, ``beta``, ``max_completion_length``).

    Returns:
        ``(loss, metrics)`` as :func:`policy_gradient_loss`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> h = jax.random.normal(jax.random.key(0), (2, 3, 4))
        >>> w = jax.random.normal(jax.random.key(1), (10, 4))
        >>> ids = jnp.array([[8, 5, 3], [1, 2, 6]])
        >>> loss, metrics = fused_policy_gradient_loss(
        ...     h, w, ids, jnp.ones((2, 3)), jnp.array([1.0, -1.0]),
        ...     loss_type="grpo", chunk_size=4)
        >>> print(f"{loss:.4f}")  # ratio 1: the mean of -A
        0.0000

    References:
        As :func:`policy_gradient_loss`.
    """
    sweep = SweepOptions(
        scale=scale,
        softcap=softcap,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        filter_eps=filter_eps,
        filter_target=filter_target,
        dw_accumulation=dw_accumulation,
    )
    _checks.check_rank("h", h, 3, "[B, T, D]")
    if jnp.shape(ids) != jnp.shape(h)[:2]:
        raise ValueError(
            f"ids must have shape [B, T] = {jnp.shape(h)[:2]}; got {jnp.shape(ids)}."
        )
    if jnp.shape(mask) != jnp.shape(ids):
        raise ValueError(
            f"mask must have shape [B, T] = {jnp.shape(ids)}; got {jnp.shape(mask)}."
        )
    if ref_logps is not None and reference_head is not None:
        raise ValueError("give ref_logps or reference_head, not both; got both.")
    settings = _OPTIONS | options
    if set(options) - set(_OPTIONS):
        raise TypeError(
            f"unknown options {sorted(set(options) - set(_OPTIONS))}; allowed: "
            f"{sorted(_OPTIONS)}."
        )
    check_options(**settings)
    _check_shapes(
        jnp.zeros(jnp.shape(ids), jnp.float32),
        mask,
        advantages,
        old_logps=old_logps,
        ref_logps=ref_logps,
    )
    _checks.check_unembed_inputs(h, w, bias)
    _checks.check_integer("ids", ids)
    # Ignored (and, inside jit, invalid) ids leave their tokens out of the mask.
    mask, _, _ = losses.valid_weights(
        ids, mask, jnp.shape(w)[0], ignore_index, name="ids"
    )
    if reference_head is not None:
        if len(reference_head) not in (2, 3):
            raise ValueError(
                "reference_head must be (h_ref, w_ref[, bias_ref]); got "
                f"{len(reference_head)} arrays."
            )
        h_ref, w_ref, *bias_ref = jax.lax.stop_gradient(tuple(reference_head))
        ref_logps = token_logprobs.sweep_token_logprobs(
            h_ref,
            w_ref,
            ids,
            sweep,
            bias=bias_ref[0] if bias_ref else None,
            weights=mask,
            vocab_order=vocab_order,
            ignore_index=ignore_index,
        ).logprobs
    if settings["beta"] > 0 and ref_logps is None:
        raise ValueError("ref_logps is required for beta > 0 (the KL's reference).")
    bonus = 0.0 if entropy_weight is None else entropy_weight
    metric_options = dict(
        old_logps=old_logps, ref_logps=ref_logps, entropy_weight=bonus, **options
    )
    if settings["importance_sampling"] == "sequence":
        out = token_logprobs.sweep_token_logprobs(
            h,
            w,
            ids,
            sweep,
            bias=bias,
            weights=mask,
            entropy=entropy_weight is not None,
            vocab_order=vocab_order,
            ignore_index=ignore_index,
        )
        return policy_gradient_loss(
            out.logprobs, mask, advantages, entropy=out.entropy, **metric_options
        )
    # Token-level ratios: each token's loss depends on its own log-prob only,
    # so the sweep takes its gradient while it holds the logits.
    live = mask != 0

    def operand(x):
        return None if x is None else jnp.ravel(jnp.where(live, x, 0.0))

    advantage = jnp.broadcast_to(
        jnp.asarray(advantages, jnp.float32)[:, None], mask.shape
    )
    operands = jax.lax.stop_gradient(
        (operand(old_logps), operand(ref_logps), jnp.ravel(advantage))
    )
    objective = TokenObjective(
        settings["epsilon_low"],
        settings["epsilon_high"],
        settings["delta"],
        settings["beta"],
        bonus,
    )
    loss, out = token_logprobs.token_loss_sweep(
        h,
        w,
        ids,
        _token_weights(mask, settings),
        sweep,
        bias=bias,
        entropy=entropy_weight is not None,
        vocab_order=vocab_order,
        token_loss=objective,
        operands=operands,
    )
    _, metrics = policy_gradient_loss(
        jax.lax.stop_gradient(out.logprobs),
        mask,
        advantages,
        entropy=jax.lax.stop_gradient(out.entropy),
        **metric_options,
    )
    return loss, metrics


# The options check_options takes, with policy_gradient_loss's defaults:
# what fused_policy_gradient_loss's **options may hold.
_OPTIONS = {
    name: inspect.signature(policy_gradient_loss).parameters[name].default
    for name in inspect.signature(check_options).parameters
}


def _token_weights(m, settings):
    """Each token's weight in the aggregation: ``grpo`` ``m / (B n_b)``,
    ``bnpo`` and ``dapo`` ``m / sum m``, ``dr_grpo`` ``m / (B L_max)``."""
    loss_type, batch = settings["loss_type"], m.shape[0]
    if loss_type == "grpo":
        return m / (batch * jnp.maximum(jnp.sum(m, -1, keepdims=True), 1.0))
    if loss_type == "dr_grpo":
        return m / (batch * settings["max_completion_length"])
    return m / jnp.sum(m)
