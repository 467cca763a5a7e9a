r"""Preference losses on chosen/rejected pairs: DPO (sigmoid, hinge, robust,
IPO), SimPO, ORPO and CPO, through the head without the ``[N, V]`` logits.

:func:`preference_loss` is plain JAX on per-token log-probabilities
``[B, T]`` and token masks; :func:`fused_preference_loss` gets them from
one sweep of :class:`lmhead.token_logprobs.LogProbRule` over the chosen and
rejected tokens together (one more without gradient for a reference head),
so the gradient is exact and no ``[N, V]`` array exists. The losses of a
pair's margin (``MARGIN_LOSSES``) are that sweep's objective, a pair being
one of its segments, and take their gradient in its forward pass.

Each loss's defaults compute what its reference's defaults compute
(Liger-Kernel's ``chunked_loss``, TRL's trainers): sums of log-probs for
DPO and CPO, means for IPO, SimPO and ORPO, the NLL term for ORPO and CPO;
``average_log_prob`` and ``compute_nll_loss`` change them.
docs/post_training.md lists the formulas, their papers and every difference
from the references. KTO, on completions labelled one by one, is
:mod:`lmhead.kto`.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks, losses, token_logprobs
from lmhead._sweep_options import SweepOptions

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "simpo", "orpo", "cpo")
# The DPO family compares the policy with a reference; the others do not.
WITH_REFERENCE = ("sigmoid", "hinge", "ipo", "robust")
# A pair's loss a function of one weighted sum of its log-probs (Delta, or
# the policy's margin): without the NLL term the fused sweep takes their
# gradient in its forward pass.
MARGIN_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "simpo", "cpo")
# Means of log-probs by default, as the references compute these (TRL's IPO,
# Liger's and TRL's SimPO and ORPO); sums for the others (Liger, TRL).
AVERAGED = ("ipo", "simpo", "orpo")
# The chosen tokens' NLL added by default (Liger's compute_nll_loss, TRL's
# cpo_alpha): ORPO and CPO; SimPO's is off, as in its paper, Liger's
# function and TRL's SimPO.
WITH_NLL = ("orpo", "cpo")


def check_sequences(name, logps, mask_name, mask):
    """Per-token log-probs ``[B, T]`` and their mask: same shape, the mask
    finite, ``>= 0`` and marking a token of every row (when concrete)."""
    _checks.check_floating(name, logps)
    _checks.check_rank(name, logps, 2, "[B, T]")
    if jnp.shape(mask) != jnp.shape(logps):
        raise ValueError(
            f"{mask_name} must have the shape of its log-probs {jnp.shape(logps)}; "
            f"got {jnp.shape(mask)}."
        )
    if not _checks.is_traced(mask):
        m = np.asarray(mask, np.float64)
        if np.any(~(m >= 0)) or np.any(~np.isfinite(m)):
            raise ValueError(f"{mask_name} must be finite and >= 0.")
        if np.any(m.sum(-1) == 0):
            raise ValueError(
                f"{mask_name} must mark at least one token of every sequence; "
                f"rows {np.flatnonzero(m.sum(-1) == 0).tolist()} have none."
            )


def _check_pair(chosen, rejected, chosen_mask, rejected_mask):
    for name, x in dict(chosen_logps=chosen, rejected_logps=rejected).items():
        _checks.check_rank(name, x, 2, "[B, T]")
    if jnp.shape(chosen)[0] != jnp.shape(rejected)[0]:
        raise ValueError(
            "chosen_logps and rejected_logps must have the same batch size B "
            f"(one pair per row); got {jnp.shape(chosen)[0]} and "
            f"{jnp.shape(rejected)[0]}."
        )
    check_sequences("chosen_logps", chosen, "chosen_mask", chosen_mask)
    check_sequences("rejected_logps", rejected, "rejected_mask", rejected_mask)


def _check_switch(name, value):
    """``value`` is True, False or None (the loss's reference default)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True, False or None (the loss's default); got {value!r}."
        )


def check_options(
    loss_type, beta, gamma, alpha, label_smoothing, average_log_prob, compute_nll_loss
):
    """The loss options, as :func:`preference_loss` checks them; returns
    ``(average_log_prob, compute_nll_loss)`` with None resolved to the
    loss's reference default (``AVERAGED``, ``WITH_NLL``)."""
    _checks.check_choice("loss_type", loss_type, LOSS_TYPES)
    _checks.check_in_range("beta", beta, low=0.0, low_open=True)
    _checks.check_in_range("alpha", alpha, low=0.0)
    # The robust loss divides by 1 - 2 eps (Liger and TRL refuse 0.5 too).
    _checks.check_in_range(
        "label_smoothing",
        label_smoothing,
        low=0.0,
        high=0.5,
        high_open=loss_type == "robust",
    )
    _checks.check_in_range(
        "gamma", gamma, low=-math.inf, high=math.inf, low_open=True, high_open=True
    )
    _check_switch("average_log_prob", average_log_prob)
    _check_switch("compute_nll_loss", compute_nll_loss)
    return (
        loss_type in AVERAGED if average_log_prob is None else average_log_prob,
        loss_type in WITH_NLL if compute_nll_loss is None else compute_nll_loss,
    )


def _sigmoid_loss(logits, label_smoothing):
    """``-(1 - eps) log sigmoid(x) - eps log sigmoid(-x)``."""
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(
        logits
    ) - label_smoothing * jax.nn.log_sigmoid(-logits)


def _margin_loss(loss_type, margin, beta, gamma, label_smoothing):
    """The loss of a pair of margin ``Delta`` (DPO family) or ``A_c - A_r``."""
    if loss_type in ("sigmoid", "cpo"):
        return _sigmoid_loss(beta * margin, label_smoothing)
    if loss_type == "robust":
        # Unbiased under labels flipped at the rate eps (Chowdhury et al.).
        x, eps = beta * margin, label_smoothing
        return (-(1.0 - eps) * jax.nn.log_sigmoid(x) + eps * jax.nn.log_sigmoid(-x)) / (
            1.0 - 2.0 * eps
        )
    if loss_type == "hinge":
        return jax.nn.relu(1.0 - beta * margin)
    if loss_type == "ipo":
        return jnp.square(margin - 1.0 / (2.0 * beta))
    return _sigmoid_loss(beta * margin - gamma, label_smoothing)  # simpo


@dataclasses.dataclass(frozen=True)
class MarginLoss:
    """A pair's loss of its margin ``U`` ``[S]``, as the sweep's
    ``segment_loss``: ``l_eps(beta U)`` (sigmoid, cpo), ``r_eps(beta U)``
    (robust), ``max(0, 1 - beta U)`` (hinge), ``(U - 1 / (2 beta))^2``
    (ipo), ``l_eps(beta U - gamma)`` (simpo), with ``scalars = (beta, gamma,
    label_smoothing)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> MarginLoss("ipo")(jnp.array([0.1, 0.5, 0.0]), jnp.array([2.0]))
        Array([9.], dtype=float32)

    References:
        As :func:`preference_loss`.
    """

    loss_type: str

    def __call__(self, scalars, margins):
        return _margin_loss(self.loss_type, margins, *(scalars[i] for i in range(3)))


def margin_terms(logps, entropy, operands):
    """A token's term of its pair's margin, ``c_t (log p_t - ref_t)``: a
    ``token_loss`` of the sweep, ``logps: [Nc, 1]``, ``operands = (c, ref)``
    ``[Nc]`` each, ``entropy`` unused.

    Examples:
        >>> import jax.numpy as jnp
        >>> coef, ref = jnp.array([1.0, -1.0]), jnp.array([-1.0, -1.0])
        >>> margin_terms(jnp.array([[-0.5], [-2.0]]), None, (coef, ref))
        Array([0.5, 1. ], dtype=float32)

    References:
        Rafailov et al., `Direct Preference Optimization
        <https://arxiv.org/abs/2305.18290>`_, 2023.
    """
    coef, ref = operands
    return coef * (logps[:, 0] - ref)


def _log1m_exp(x):
    """``log(1 - e^x)`` for ``x < 0``, accurate at both ends."""
    return jnp.where(x > -0.693, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def preference_loss(
    chosen_logps: jax.typing.ArrayLike,
    rejected_logps: jax.typing.ArrayLike,
    chosen_mask: jax.typing.ArrayLike,
    rejected_mask: jax.typing.ArrayLike,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    gamma: float = 0.5,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
    average_log_prob: bool | None = None,
    compute_nll_loss: bool | None = None,
    ref_chosen_logps: jax.typing.ArrayLike | None = None,
    ref_rejected_logps: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""A preference loss from per-token log-probabilities, mean over pairs.

    A sequence's score :math:`P` is the sum :math:`S = \sum_t m_t
    \log\pi(y_t)` (:math:`m` its mask, which may weight tokens) or, with
    ``average_log_prob``, the mean :math:`A = S / \sum_t m_t`;
    :math:`P^{ref}` the same of the reference's log-probs. With ``c`` the
    chosen and ``r`` the rejected sequence, :math:`\sigma` the sigmoid,
    :math:`\ell_\epsilon(x) = -(1-\epsilon)\log\sigma(x) - \epsilon
    \log\sigma(-x)` and :math:`\Delta = (P_c - P^{ref}_c) - (P_r - P^{ref}_r)`:

    * ``sigmoid`` (DPO): :math:`\ell_\epsilon(\beta\Delta)`; ``robust``:
      :math:`(-(1-\epsilon)\log\sigma(\beta\Delta) + \epsilon
      \log\sigma(-\beta\Delta)) / (1 - 2\epsilon)`; ``hinge``:
      :math:`\max(0, 1 - \beta\Delta)`; ``ipo``:
      :math:`(\Delta - 1/(2\beta))^2`. Rewards :math:`\beta(P - P^{ref})`;
      a missing reference counts as 0 (Liger's ``use_ref_model=False``).
    * ``simpo``: :math:`\ell_\epsilon(\beta(P_c - P_r) - \gamma)`.
    * ``orpo``: :math:`-\beta\log\sigma(\log\frac{e^{P_c}}{1 - e^{P_c}}
      - \log\frac{e^{P_r}}{1 - e^{P_r}})`.
    * ``cpo``: :math:`\ell_\epsilon(\beta(P_c - P_r))`.

    SimPO, ORPO and CPO have rewards :math:`\beta P`. With
    ``compute_nll_loss`` the loss adds :math:`\alpha` times the chosen
    tokens' negative log-likelihood, :math:`-\sum_b S_{c,b} / \sum_b \sum_t
    m_{c,b,t}` (a mean over all chosen tokens of the batch, whatever
    ``average_log_prob``). The defaults are the references' (Liger-Kernel,
    TRL): means for ``ipo`` (TRL's), ``simpo`` and ``orpo``, sums for the
    others (``AVERAGED``); the NLL for ``orpo`` and ``cpo`` (``WITH_NLL``).

    Args:
        chosen_logps, rejected_logps: ``[B, T_c]``, ``[B, T_r]`` per-token
            log-probabilities under the policy (row ``b`` of each is pair
            ``b``).
        chosen_mask, rejected_mask: same shapes, ``>= 0``: the response's
            tokens (1) among prompt and padding (0), or token weights. Every
            row needs a token.
        loss_type: one of ``LOSS_TYPES``.
        beta: ``> 0``. gamma: SimPO's margin. alpha: the NLL's weight,
            ``>= 0``. label_smoothing: :math:`\epsilon` in ``[0, 0.5]``
            (``[0, 0.5)`` for ``robust``), for ``sigmoid``, ``robust``,
            ``simpo`` and ``cpo``.
        average_log_prob: True for :math:`P = A`, False for :math:`P = S`,
            None for the loss's default (Liger's name).
        compute_nll_loss: True to add :math:`\alpha` NLL, None for the
            loss's default (Liger's name; TRL's ``cpo_alpha=0`` is False).
        ref_chosen_logps, ref_rejected_logps: the reference's per-token
            log-probs, same shapes, for the DPO family (no gradient).

    Returns:
        ``(loss, metrics)``: ``loss`` a scalar; ``metrics`` the means over
        pairs of ``chosen_rewards``, ``rejected_rewards``, ``reward_margin``
        and ``reward_accuracy`` (chosen reward > rejected reward), and of
        ``chosen_logps`` and ``rejected_logps`` (:math:`P`),
        ``preference_loss`` (the loss without the NLL), and ``nll`` (with
        the NLL) and ``log_odds_ratio`` (ORPO).

    Raises:
        ValueError, TypeError: for bad shapes or options, naming the argument.

    Examples:
        DPO at a reward margin of 0 is :math:`\log 2`:

        >>> import jax.numpy as jnp
        >>> logps, mask = jnp.full((1, 2), -1.0), jnp.ones((1, 2))
        >>> loss, metrics = preference_loss(logps, logps, mask, mask)
        >>> print(f"{loss:.4f} {metrics['reward_accuracy']}")
        0.6931 0.0

        CPO on sums, :math:`\log(1 + e^{-0.1 \cdot 2})`, plus the NLL 1:

        >>> loss, metrics = preference_loss(
        ...     logps, 2 * logps, mask, mask, loss_type="cpo")
        >>> print(f"{loss:.4f} {metrics['nll']:.1f}")
        1.5981 1.0

    References:
        Rafailov et al., `Direct Preference Optimization
        <https://arxiv.org/abs/2305.18290>`_, 2023; Chowdhury et al.,
        `Provably Robust DPO <https://arxiv.org/abs/2403.00409>`_, 2024
        (robust); Azar et al., `A General Theoretical Paradigm to Understand
        Learning from Human Preferences
        <https://arxiv.org/abs/2310.12036>`_, 2023 (IPO); Meng et al.,
        `SimPO <https://arxiv.org/abs/2405.14734>`_, 2024; Hong et al.,
        `ORPO <https://arxiv.org/abs/2403.07691>`_, 2024; Xu et al.,
        `Contrastive Preference Optimization
        <https://arxiv.org/abs/2401.08417>`_, 2024 (CPO).
    """
    _check_pair(chosen_logps, rejected_logps, chosen_mask, rejected_mask)
    average, nll = check_options(
        loss_type,
        beta,
        gamma,
        alpha,
        label_smoothing,
        average_log_prob,
        compute_nll_loss,
    )
    masks = [jnp.asarray(m, jnp.float32) for m in (chosen_mask, rejected_mask)]
    counts = [jnp.sum(m, -1) for m in masks]

    def sums(x, m):
        # where, not a product: a padding token's value may not be finite.
        return jnp.sum(m * jnp.where(m != 0, jnp.asarray(x, jnp.float32), 0.0), -1)

    def scores(x, m, count):
        return sums(x, m) / count if average else sums(x, m)

    chosen, rejected = [
        scores(x, m, c)
        for x, m, c in zip((chosen_logps, rejected_logps), masks, counts)
    ]
    metrics = {}
    refs = (0.0, 0.0)
    if loss_type in WITH_REFERENCE:
        refs = _reference_scores(
            (ref_chosen_logps, ref_rejected_logps), masks, counts, scores
        )
    rewards = [beta * (chosen - refs[0]), beta * (rejected - refs[1])]
    if loss_type == "orpo":
        log_odds = (chosen - rejected) - (_log1m_exp(chosen) - _log1m_exp(rejected))
        pair_loss = -beta * jax.nn.log_sigmoid(log_odds)
        metrics["log_odds_ratio"] = jnp.mean(log_odds)
    else:
        margin = (chosen - refs[0]) - (rejected - refs[1])
        pair_loss = _margin_loss(loss_type, margin, beta, gamma, label_smoothing)
    loss = jnp.mean(pair_loss)
    metrics |= {
        "preference_loss": loss,
        "chosen_rewards": jnp.mean(rewards[0]),
        "rejected_rewards": jnp.mean(rewards[1]),
        "reward_margin": jnp.mean(rewards[0] - rewards[1]),
        "reward_accuracy": jnp.mean((rewards[0] > rewards[1]).astype(jnp.float32)),
        "chosen_logps": jnp.mean(chosen),
        "rejected_logps": jnp.mean(rejected),
    }
    if nll:
        metrics["nll"] = -jnp.sum(sums(chosen_logps, masks[0])) / jnp.sum(counts[0])
        loss = loss + alpha * metrics["nll"]
    return loss, metrics


def _reference_scores(refs, masks, counts, scores):
    """The reference's scores ``P^ref`` of chosen and rejected, without
    gradient; 0 for a reference not given."""
    out = []
    for name, ref, m, count in zip(
        ("ref_chosen_logps", "ref_rejected_logps"), refs, masks, counts
    ):
        if ref is None:
            out.append(0.0)
            continue
        if jnp.shape(ref) != jnp.shape(m):
            raise ValueError(
                f"{name} must have shape {jnp.shape(m)}; got {jnp.shape(ref)}."
            )
        out.append(scores(jax.lax.stop_gradient(jnp.asarray(ref)), m, count))
    return out


def without_ignored(ids, mask, ignore_index):
    """``mask`` with 0 where ``ids`` is ``ignore_index``: a token labelled so
    (-100, PyTorch's and Hugging Face's padding) is no token of its
    sequence, as it is no token of the fused losses (``losses.valid_weights``).

    Examples:
        >>> without_ignored(jnp.array([[3, -100]]), jnp.ones((1, 2)), -100)
        Array([[1., 0.]], dtype=float32)
    """
    mask = jnp.asarray(mask)
    return jnp.where(jnp.asarray(ids) == ignore_index, jnp.zeros((), mask.dtype), mask)


def sequence_logps(hs, w, ids, masks, options, *, bias=None, vocab_order=None):
    """Per-token log-probs ``[B_i, T_i]`` of each ``ids[i]`` under the head
    of ``w`` (and ``bias``) at ``hs[i]`` ``[B_i, T_i, D]``, from one fused
    sweep of ``options`` (:class:`~lmhead._sweep_options.SweepOptions`) over
    all their tokens (``masks[i]`` != 0 marks the tokens swept)."""
    flat = [jnp.reshape(h, (-1, jnp.shape(h)[-1])) for h in hs]
    out = token_logprobs.sweep_token_logprobs(
        jnp.concatenate(flat),
        w,
        jnp.concatenate([jnp.ravel(x) for x in ids]),
        options,
        bias=bias,
        weights=jnp.concatenate([jnp.ravel(m) for m in masks]),
        vocab_order=vocab_order,
    )
    ends = np.cumsum([jnp.size(x) for x in ids])
    return [
        jnp.reshape(out.logprobs[end - jnp.size(x) : end], jnp.shape(x))
        for x, end in zip(ids, ends)
    ]


def frozen_logps(reference_head, ids, masks, options, layout):
    """:func:`sequence_logps` under ``reference_head = (*hs, w[, bias])``
    (one ``h`` per ``ids``), without gradient, so without the gradient's
    options of ``options``; ``layout`` names the tuple in the error for a
    wrong length."""
    n = len(ids)
    if len(reference_head) not in (n + 1, n + 2):
        raise ValueError(
            f"reference_head must be {layout}; got {len(reference_head)} arrays."
        )
    arrays = jax.lax.stop_gradient(tuple(reference_head))
    bias = arrays[n + 1] if len(arrays) == n + 2 else None
    forward = dataclasses.replace(
        options, filter_eps=None, filter_target="both", dw_accumulation="float32"
    )
    return sequence_logps(arrays[:n], arrays[n], ids, masks, forward, bias=bias)


def check_head_inputs(hs, ids):
    """Hidden states ``[B, T, D]`` (a dict by name) and their ids
    ``[B, T]`` (a dict in the same order)."""
    for (h_name, h), (ids_name, x) in zip(hs.items(), ids.items()):
        _checks.check_rank(h_name, h, 3, "[B, T, D]")
        if jnp.shape(x) != jnp.shape(h)[:2]:
            raise ValueError(
                f"{ids_name} must have shape [B, T] = {jnp.shape(h)[:2]}; "
                f"got {jnp.shape(x)}."
            )


def fused_preference_loss(
    h_chosen: jax.typing.ArrayLike,
    h_rejected: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    chosen_ids: jax.typing.ArrayLike,
    rejected_ids: jax.typing.ArrayLike,
    chosen_mask: jax.typing.ArrayLike,
    rejected_mask: jax.typing.ArrayLike,
    *,
    bias: jax.typing.ArrayLike | None = None,
    reference_logps: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike] | None = None,
    reference_head: tuple | None = None,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    gamma: float = 0.5,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
    average_log_prob: bool | None = None,
    compute_nll_loss: bool | None = None,
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
    r""":func:`preference_loss` of the head ``softcap(scale * h @ w.T + bias)``,
    fused.

    The policy's per-token log-probs of ``chosen_ids`` and ``rejected_ids``
    come from one sweep over both sequences' tokens, and no ``[N, V]``
    array is built; the gradient w.r.t. ``h_chosen``, ``h_rejected``, ``w``
    and ``bias`` is exact. For ``MARGIN_LOSSES`` without the NLL term the
    tokens are swept pair by pair and the loss is the sweep's segment
    objective: the pair's loss of its margin :math:`\sum_t c_t
    (\log\pi(y_t) - \log\pi^{ref}(y_t))` (:func:`margin_terms`,
    :class:`MarginLoss`), whose gradient the sweep takes in its forward pass
    (``_fused_sweep.Plan.segment_length``); ORPO, a loss with the NLL term
    (CPO's default), and a gradient of the metrics take the recompute sweep
    of :func:`lmhead.token_logprobs.fused_token_logprobs`. The reference is
    either ``reference_logps`` (precomputed) or ``reference_head``, whose
    log-probs come from a second sweep that gets no gradient.

    Args:
        h_chosen, h_rejected: ``[B, T_c, D]``, ``[B, T_r, D]`` hidden states
            (each position predicts its id).
        w: ``[V, D]``. bias: optional ``[V]``.
        chosen_ids, rejected_ids: ``[B, T_c]``, ``[B, T_r]`` the responses'
            tokens.
        chosen_mask, rejected_mask: as in :func:`preference_loss`; a token
            whose id is ``ignore_index`` counts as masked out.
        reference_logps: ``(ref_chosen [B, T_c], ref_rejected [B, T_r])``.
        reference_head: ``(h_ref_chosen, h_ref_rejected, w_ref[, bias_ref])``
            of the frozen reference; the same scale, softcap and temperature.
        loss_type, beta, gamma, alpha, label_smoothing, average_log_prob,
            compute_nll_loss: as in :func:`preference_loss`.
        temperature, scale, softcap, chunk_size, vocab_chunk_size,
            filter_eps, filter_target, dw_accumulation, vocab_order: as in
            :func:`lmhead.token_logprobs.fused_token_logprobs` (the
            reference's sweep, which gets no gradient, ignores the last
            four).
        ignore_index: the id of a token that is none (``-100``, as PyTorch
            and Hugging Face label padding): its mask is taken as 0.

    Returns:
        ``(loss, metrics)`` as :func:`preference_loss`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> keys = jax.random.split(jax.random.key(0), 3)
        >>> h_c, h_r = jax.random.normal(keys[0], (2, 2, 3, 4))
        >>> w = jax.random.normal(keys[1], (10, 4))
        >>> ids = jax.random.randint(keys[2], (2, 2, 3), 0, 10)
        >>> mask = jnp.ones((2, 3))
        >>> loss, metrics = fused_preference_loss(
        ...     h_c, h_r, w, ids[0], ids[1], mask, mask, chunk_size=4,
        ...     reference_head=(h_c, h_r, w))  # the policy as its reference
        >>> print(f"{loss:.4f} {metrics['reward_margin']:.4f}")
        0.6931 0.0000

    References:
        As :func:`preference_loss`.
    """
    average, nll = check_options(
        loss_type,
        beta,
        gamma,
        alpha,
        label_smoothing,
        average_log_prob,
        compute_nll_loss,
    )
    check_head_inputs(
        dict(h_chosen=h_chosen, h_rejected=h_rejected),
        dict(chosen_ids=chosen_ids, rejected_ids=rejected_ids),
    )
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
    ids = (chosen_ids, rejected_ids)
    masks = tuple(
        without_ignored(x, m, ignore_index)
        for x, m in zip(ids, (chosen_mask, rejected_mask))
    )
    # The pairs' shapes and masks, checked before any sweep.
    _check_pair(*(np.zeros(jnp.shape(x), np.float32) for x in ids), *masks)
    if reference_head is not None:
        reference_logps = frozen_logps(
            reference_head,
            ids,
            masks,
            options,
            "(h_ref_chosen, h_ref_rejected, w_ref[, bias_ref])",
        )
    if reference_logps is not None and len(reference_logps) != 2:
        raise ValueError(
            "reference_logps must be (ref_chosen [B, T_c], ref_rejected [B, T_r]); "
            f"got {len(reference_logps)} arrays."
        )
    ref_chosen, ref_rejected = (
        (None, None) if reference_logps is None else reference_logps
    )
    settings = dict(
        loss_type=loss_type,
        beta=beta,
        gamma=gamma,
        alpha=alpha,
        label_smoothing=label_smoothing,
        average_log_prob=average,
        compute_nll_loss=nll,
        ref_chosen_logps=ref_chosen,
        ref_rejected_logps=ref_rejected,
    )
    if loss_type not in MARGIN_LOSSES or nll:
        chosen, rejected = sequence_logps(
            (h_chosen, h_rejected), w, ids, masks, options,
            bias=bias, vocab_order=vocab_order,
        )  # fmt: skip
        return preference_loss(chosen, rejected, *masks, **settings)
    args = h_chosen, h_rejected, w, bias, *ids, masks
    total, (chosen, rejected) = _pair_margins(*args, settings, options, vocab_order)
    _, metrics = preference_loss(chosen, rejected, *masks, **settings)
    return total / jnp.shape(chosen_ids)[0], metrics


def _pair_margins(h_c, h_r, w, bias, ids_c, ids_r, masks, settings, options, order):
    """``(the pairs' losses summed, (chosen, rejected) log-probs)`` from one
    sweep over the tokens pair by pair (chosen, then rejected): a pair is a
    segment, its loss a :class:`MarginLoss` of the sum of its tokens'
    :func:`margin_terms`, so the sweep takes the gradient in its forward
    pass."""
    lengths = jnp.shape(ids_c)[1], jnp.shape(ids_r)[1]
    m = [jnp.asarray(x, jnp.float32) for x in masks]
    if settings["average_log_prob"]:
        m = [x / jnp.sum(x, -1, keepdims=True) for x in m]
    refs = [settings["ref_chosen_logps"], settings["ref_rejected_logps"]]
    refs = [
        jnp.zeros_like(x)
        if r is None or settings["loss_type"] not in WITH_REFERENCE
        else jnp.where(x != 0, jnp.asarray(r, jnp.float32), 0.0)
        for x, r in zip(m, refs)
    ]

    def pairs(chosen, rejected):
        return jnp.concatenate([chosen, rejected], axis=1)

    h = pairs(jnp.asarray(h_c), jnp.asarray(h_r))
    ids = pairs(jnp.asarray(ids_c), jnp.asarray(ids_r))
    live = (pairs(*m) != 0).astype(jnp.float32)
    _checks.check_unembed_inputs(h, w, bias)
    _checks.check_integer("chosen_ids and rejected_ids", ids)
    _checks.check_ids_in_range(
        "chosen_ids and rejected_ids", ids, live, jnp.shape(w)[0]
    )
    operands = jax.lax.stop_gradient(
        (jnp.ravel(pairs(m[0], -m[1])), jnp.ravel(pairs(*refs)))
    )
    scalars = [settings[k] for k in ("beta", "gamma", "label_smoothing")]
    total, out = token_logprobs.token_loss_sweep(
        h,
        w,
        ids,
        live,
        options,
        bias=bias,
        vocab_order=order,
        token_loss=margin_terms,
        operands=operands,
        segment_loss=MarginLoss(settings["loss_type"]),
        segment_length=sum(lengths),
        loss_scalars=jnp.stack([jnp.asarray(x, jnp.float32) for x in scalars]),
    )
    return total, (out.logprobs[:, : lengths[0]], out.logprobs[:, lengths[0] :])
