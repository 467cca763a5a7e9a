r"""KTO: a preference loss on completions labelled desirable or undesirable
one by one (no pairs), through the head without the ``[N, V]`` logits.

:func:`kto_loss` is plain JAX on per-token log-probabilities ``[B, T]``;
:func:`fused_kto_loss` gets them from one sweep of
:class:`lmhead.token_logprobs.LogProbRule` (one more without gradient for a
reference head), as :func:`lmhead.preference.fused_preference_loss` does
for ORPO, so the gradient is exact and no ``[N, V]`` array exists. The KL
reference point is an input, as in Liger-Kernel's fused KTO;
:func:`kto_reference_point` estimates it from mismatched completions as
TRL's KTOTrainer does. docs/post_training.md compares it with both.
"""

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks, losses, preference
from lmhead._sweep_options import SweepOptions


def _check_inputs(logps, mask, desirable, ref_logps, kl):
    preference.check_sequences("logps", logps, "mask", mask)
    if jnp.shape(desirable) != jnp.shape(logps)[:1]:
        raise ValueError(
            f"desirable must have shape [B] = {jnp.shape(logps)[:1]} (one label "
            f"per completion); got {jnp.shape(desirable)}."
        )
    if jnp.asarray(desirable).dtype != jnp.bool_:
        raise TypeError(
            "desirable must be boolean (True for a desirable completion); got "
            f"{jnp.asarray(desirable).dtype}."
        )
    if ref_logps is not None and jnp.shape(ref_logps) != jnp.shape(logps):
        raise ValueError(
            f"ref_logps must have shape {jnp.shape(logps)}; got {jnp.shape(ref_logps)}."
        )
    if kl is not None:
        if jnp.shape(kl) != ():
            raise ValueError(f"kl must be a scalar; got shape {jnp.shape(kl)}.")
        _checks.check_in_range(
            "kl", kl, low=-np.inf, high=np.inf, low_open=True, high_open=True
        )


def check_options(beta, desirable_weight, undesirable_weight, average_log_prob):
    """KTO's options, as :func:`kto_loss` checks them."""
    _checks.check_in_range("beta", beta, low=0.0, low_open=True)
    _checks.check_in_range("desirable_weight", desirable_weight, low=0.0)
    _checks.check_in_range("undesirable_weight", undesirable_weight, low=0.0)
    _check_average(average_log_prob)


def _check_average(average_log_prob):
    if not isinstance(average_log_prob, bool):
        raise TypeError(
            f"average_log_prob must be True or False; got {average_log_prob!r}."
        )


def _scores(logps, mask, average_log_prob):
    """Each row's sum of masked log-probs, or their mean."""
    m = jnp.asarray(mask, jnp.float32)
    # where, not a product: a padding token's value may not be finite.
    total = jnp.sum(m * jnp.where(m != 0, jnp.asarray(logps, jnp.float32), 0.0), -1)
    return total / jnp.sum(m, -1) if average_log_prob else total


def kto_loss(
    logps: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    desirable: jax.typing.ArrayLike,
    *,
    ref_logps: jax.typing.ArrayLike | None = None,
    kl: jax.typing.ArrayLike | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    average_log_prob: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""The KTO loss from per-token log-probabilities, mean over completions.

    With a completion's log-ratio :math:`r = P - P^{ref}`, :math:`P` the sum
    of its masked log-probs :math:`\sum_t m_t \log\pi(y_t)` (or their mean
    with ``average_log_prob``), :math:`z` the KL reference point ``kl``
    (no gradient) and :math:`\sigma` the sigmoid,

    .. math::
        \ell = \begin{cases}
            w_D\,(1 - \sigma(\beta (r - z))) & \text{desirable} \\
            w_U\,(1 - \sigma(\beta (z - r))) & \text{undesirable}
        \end{cases}

    averaged over the ``B`` completions (TRL's KTOTrainer; Liger's fused KTO
    with weights 1). A missing reference counts as 0 (Liger's
    ``use_ref_model=False``), a missing ``kl`` as 0 (Liger's ``kl=None``);
    TRL's estimate of :math:`z` is :func:`kto_reference_point`.

    Args:
        logps: ``[B, T]`` per-token log-probabilities of the completions
            under the policy.
        mask: ``[B, T]``, ``>= 0``: the completion's tokens (1) among prompt
            and padding (0), or token weights. Every row needs a token.
        desirable: ``[B]`` boolean, True for a desirable completion (TRL's
            ``label``, Liger's ``preference_labels``).
        ref_logps: ``[B, T]`` the reference's per-token log-probs (no
            gradient).
        kl: the reference point :math:`z`, a scalar (no gradient), e.g.
            :func:`kto_reference_point`'s.
        beta: ``> 0``. desirable_weight, undesirable_weight: :math:`w_D`,
            :math:`w_U`, ``>= 0`` (TRL's names).
        average_log_prob: True for the mean of the log-probs (Liger's name).

    Returns:
        ``(loss, metrics)``: ``loss`` a scalar; ``metrics`` the means over
        the desirable (``chosen_``) and the undesirable (``rejected_``)
        completions of the rewards :math:`\beta r` and of :math:`P`
        (``chosen_rewards``, ``rejected_rewards``, ``chosen_logps``,
        ``rejected_logps``; 0 for a group with no completion), their
        ``reward_margin`` (chosen minus rejected) and ``kl`` (:math:`z`).

    Raises:
        ValueError, TypeError: for bad shapes or options, naming the argument.

    Examples:
        A desirable completion at the reference point, and an undesirable
        one: each loss is :math:`1 - \sigma(0) = 1/2`:

        >>> import jax.numpy as jnp
        >>> logps, mask = jnp.full((2, 3), -1.0), jnp.ones((2, 3))
        >>> loss, metrics = kto_loss(
        ...     logps, mask, jnp.array([True, False]), ref_logps=logps)
        >>> print(f"{loss:.2f} {metrics['reward_margin']:.2f}")
        0.50 0.00

    References:
        Ethayarajh et al., `KTO: Model Alignment as Prospect Theoretic
        Optimization <https://arxiv.org/abs/2402.01306>`_, 2024.
    """
    _check_inputs(logps, mask, desirable, ref_logps, kl)
    check_options(beta, desirable_weight, undesirable_weight, average_log_prob)
    policy = _scores(logps, mask, average_log_prob)
    log_ratio = policy
    if ref_logps is not None:
        ref = jax.lax.stop_gradient(jnp.asarray(ref_logps))
        log_ratio = policy - _scores(ref, mask, average_log_prob)
    z = jnp.zeros(()) if kl is None else jnp.asarray(kl, jnp.float32)
    z = jax.lax.stop_gradient(z)
    good = jnp.asarray(desirable)
    sign = jnp.where(good, 1.0, -1.0)
    weight = jnp.where(good, desirable_weight, undesirable_weight)
    # 1 - sigmoid(x) = sigmoid(-x), exact where 1 - sigmoid(x) rounds to 0.
    loss = jnp.mean(weight * jax.nn.sigmoid(-beta * sign * (log_ratio - z)))
    rewards = beta * log_ratio

    def group_mean(x, group):
        count = jnp.sum(group.astype(jnp.float32))
        return jnp.sum(jnp.where(group, x, 0.0)) / jnp.maximum(count, 1.0)

    metrics = {
        "chosen_rewards": group_mean(rewards, good),
        "rejected_rewards": group_mean(rewards, ~good),
        "chosen_logps": group_mean(policy, good),
        "rejected_logps": group_mean(policy, ~good),
        "kl": z,
    }
    metrics["reward_margin"] = metrics["chosen_rewards"] - metrics["rejected_rewards"]
    return loss, metrics


def kto_reference_point(
    logps: jax.typing.ArrayLike,
    ref_logps: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    *,
    average_log_prob: bool = False,
) -> jax.Array:
    r"""KTO's KL reference point as TRL's KTOTrainer estimates it.

    .. math::
        z = \max\Big(0,\ \frac{1}{B} \sum_b \big(P_b - P^{ref}_b\big)\Big)

    with :math:`P` each row's sum of masked log-probs (or mean, with
    ``average_log_prob``), under the policy (``logps``) and the reference
    (``ref_logps``), of mismatched completions: each prompt with another
    row's completion (TRL pairs prompt ``b`` with completion ``b - 1``,
    cyclically). No gradient. TRL averages over the processes' batches
    too; this is the mean over the rows given.

    Args:
        logps, ref_logps: ``[B, T]`` per-token log-probs of the mismatched
            completions under the policy and the reference.
        mask: ``[B, T]``, ``>= 0``, a token in every row.
        average_log_prob: as in :func:`kto_loss`; the same as there.

    Returns:
        The scalar :math:`z`, float32, for :func:`kto_loss`'s ``kl``.

    Examples:
        >>> import jax.numpy as jnp
        >>> mask = jnp.ones((2, 2))
        >>> policy = jnp.array([[-1.0, -1.0], [-2.0, -2.0]])
        >>> print(kto_reference_point(policy, policy - 0.25, mask))
        0.5
        >>> print(kto_reference_point(policy, policy + 0.25, mask))
        0.0

    References:
        Ethayarajh et al., `KTO <https://arxiv.org/abs/2402.01306>`_, 2024.
    """
    preference.check_sequences("logps", logps, "mask", mask)
    preference.check_sequences("ref_logps", ref_logps, "mask", mask)
    _check_average(average_log_prob)
    log_ratio = _scores(logps, mask, average_log_prob) - _scores(
        ref_logps, mask, average_log_prob
    )
    return jax.lax.stop_gradient(jnp.maximum(jnp.mean(log_ratio), 0.0))


def fused_kto_loss(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    ids: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike,
    desirable: jax.typing.ArrayLike,
    *,
    bias: jax.typing.ArrayLike | None = None,
    reference_logps: jax.typing.ArrayLike | None = None,
    reference_head: tuple | None = None,
    kl: jax.typing.ArrayLike | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    average_log_prob: bool = False,
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r""":func:`kto_loss` of the head ``softcap(scale * h @ w.T + bias)``,
    fused.

    The policy's per-token log-probs of ``ids`` come from one sweep of
    :func:`lmhead.token_logprobs.fused_token_logprobs`, whose recompute
    sweep gives the exact gradient w.r.t. ``h``, ``w`` and ``bias``; no
    ``[N, V]`` array is built. The reference is either ``reference_logps``
    (precomputed) or ``reference_head``, whose log-probs come from a second
    sweep that gets no gradient. The reference point ``kl`` is given: for
    TRL's estimate, the policy's and the reference's log-probs of the
    mismatched completions (``fused_token_logprobs`` of each head, or
    ``LMHead.token_logprobs``) go to :func:`kto_reference_point`.

    Args:
        h: ``[B, T, D]`` hidden states (each position predicts its id).
        w: ``[V, D]``. bias: optional ``[V]``.
        ids: ``[B, T]`` the completions' tokens.
        mask, desirable: as in :func:`kto_loss`.
        reference_logps: ``[B, T]`` the reference's per-token log-probs.
        reference_head: ``(h_ref, w_ref[, bias_ref])`` of the frozen
            reference; the same scale, softcap and temperature.
        kl, beta, desirable_weight, undesirable_weight, average_log_prob:
            as in :func:`kto_loss`.
        temperature, scale, softcap, chunk_size, vocab_chunk_size,
            filter_eps, filter_target, dw_accumulation, vocab_order: as in
            :func:`lmhead.token_logprobs.fused_token_logprobs` (the
            reference's sweep, which gets no gradient, ignores the last
            four).
        ignore_index: the id of a token that is none (``-100``, as PyTorch
            and Hugging Face label padding): its mask is taken as 0.

    Returns:
        ``(loss, metrics)`` as :func:`kto_loss`.

    Examples:
        TRL's reference point from mismatched completions, then the loss.
        A model gives the hidden states of each prompt followed by another
        row's completion; for brevity this example rolls the ids over the
        same hidden states:

        >>> import jax, jax.numpy as jnp
        >>> from lmhead.token_logprobs import fused_token_logprobs
        >>> keys = jax.random.split(jax.random.key(0), 4)
        >>> h, h_ref = jax.random.normal(keys[0], (2, 2, 3, 4))
        >>> w, w_ref = jax.random.normal(keys[1], (2, 10, 4))
        >>> ids = jax.random.randint(keys[2], (2, 3), 0, 10)
        >>> mask, desirable = jnp.ones((2, 3)), jnp.array([True, False])
        >>> kl_ids = jnp.roll(ids, 1, axis=0)  # mismatched completions
        >>> kl = kto_reference_point(
        ...     fused_token_logprobs(h, w, kl_ids).logprobs,
        ...     fused_token_logprobs(h_ref, w_ref, kl_ids).logprobs, mask)
        >>> loss, metrics = fused_kto_loss(
        ...     h, w, ids, mask, desirable, kl=kl,
        ...     reference_head=(h_ref, w_ref), chunk_size=4)
        >>> bool(0 < loss < 1), metrics["kl"].shape
        (True, ())

    References:
        As :func:`kto_loss`.
    """
    check_options(beta, desirable_weight, undesirable_weight, average_log_prob)
    preference.check_head_inputs(dict(h=h), dict(ids=ids))
    if reference_logps is not None and reference_head is not None:
        raise ValueError("give reference_logps or reference_head, not both; got both.")
    options = SweepOptions(
        scale=scale,
        softcap=softcap,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        filter_eps=filter_eps,
        filter_target=filter_target,
        dw_accumulation=dw_accumulation,
    )
    mask = preference.without_ignored(ids, mask, ignore_index)
    # The shapes, masks and labels, checked before any sweep.
    _check_inputs(np.zeros(jnp.shape(ids), np.float32), mask, desirable, None, kl)
    if reference_head is not None:
        (reference_logps,) = preference.frozen_logps(
            reference_head, [ids], [mask], options, "(h_ref, w_ref[, bias_ref])"
        )
    (logps,) = preference.sequence_logps(
        [h], w, [ids], [mask], options, bias=bias, vocab_order=vocab_order
    )
    return kto_loss(
        logps,
        mask,
        desirable,
        ref_logps=reference_logps,
        kl=kl,
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        average_log_prob=average_log_prob,
    )
