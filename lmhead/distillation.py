r"""Knowledge distillation losses: a teacher's distribution as the target.

:func:`distillation_loss` takes the student's and the teacher's logits;
:func:`fused_distillation_loss` takes the student's hidden states and
unembedding, ``h: [N, D]`` and ``w: [V, D]``, and is :class:`DistillationRule`
on the one chunked sweep (:mod:`lmhead._fused_sweep`), never holding
``[N, V]`` logits. Both reduce :func:`token_divergence`. With the student's
:math:`q = \mathrm{softmax}(z_s / T)` and the teacher's
:math:`p = \mathrm{softmax}(z_t / T)`:

.. math::
    \mathrm{forward\_kl} = \mathrm{KL}(p \,\|\, q), \qquad
    \mathrm{reverse\_kl} = \mathrm{KL}(q \,\|\, p), \\
    \mathrm{jsd}_\beta = \beta\, \mathrm{KL}(p \,\|\, m)
        + (1 - \beta)\, \mathrm{KL}(q \,\|\, m), \qquad
    m = \beta p + (1 - \beta) q,

the generalized JSD of GKD as Liger Kernel's ``LigerFusedLinearJSD`` defines
it, where ``beta`` 0 and 1 mean forward and reverse KL. A term
:math:`0 \log 0` is 0: a token the teacher bans adds nothing to the forward
KL, and under the reverse KL a student that gives it mass pays
:math:`+\infty`. With ``labels`` and ``hard_weight`` :math:`\alpha`:
:math:`\ell_t = \alpha\, \mathrm{CE}(z_s, y) + (1 - \alpha)\, D_t`, with no
:math:`T^2` factor. The teacher and the metrics get no gradient.
docs/fused_loss.md ("Distillation") describes the options and the sweep.

References:
    Hinton, Vinyals and Dean, `Distilling the Knowledge in a Neural Network
    <https://arxiv.org/abs/1503.02531>`_, 2015; Agarwal et al., `On-Policy
    Distillation of Language Models: Learning from Self-Generated Mistakes
    <https://arxiv.org/abs/2306.13649>`_, 2024 (generalized JSD); Hsu et al.,
    `Liger Kernel <https://arxiv.org/abs/2410.10989>`_, 2024 (fused linear
    JSD).
"""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lmhead import _checks, _fused_rule, _fused_sweep, _online_softmax, losses
from lmhead._sweep_options import SweepOptions

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")

_CONTRACT_COLUMNS = (((1,), (1,)), ((), ()))  # [a, D] x [b, D] -> [a, b]


def _x_log_ratio(x, log_x, log_y):
    """``x * (log_x - log_y)``, and 0 where ``x`` is 0 (``0 log 0 = 0``).

    A NaN ``x`` stays NaN. The inner ``where`` keeps the gradient of a
    zeroed term 0 rather than ``0 * inf``.
    """
    nonzero = x != 0
    return jnp.where(nonzero, x * jnp.where(nonzero, log_x - log_y, 0.0), 0.0)


def _effective(divergence: str, beta: float) -> str:
    """``jsd`` at ``beta`` 0 or 1 is forward or reverse KL (see the module)."""
    if divergence == "jsd" and beta in (0.0, 1.0):
        return "forward_kl" if beta == 0.0 else "reverse_kl"
    return divergence


def _mix(hard_weight, nll, divergence):
    """``a * nll + (1 - a) * divergence``; at ``a`` 0 or 1 the other term is
    left out, even where it is infinite (``0 * inf`` would be NaN)."""
    if hard_weight == 0:
        return divergence
    if hard_weight == 1:
        return nll
    return hard_weight * nll + (1.0 - hard_weight) * divergence


def _log_mixture(log_p, log_q, beta):
    """``log(beta p + (1 - beta) q)`` for ``0 < beta < 1``."""
    return jnp.logaddexp(math.log(beta) + log_p, math.log1p(-beta) + log_q)


def token_divergence(
    log_q: jax.typing.ArrayLike,
    log_p: jax.typing.ArrayLike,
    *,
    divergence: str = "forward_kl",
    beta: float = 0.5,
) -> jax.Array:
    r"""Each token's divergence between the student's and the teacher's log-probs.

    .. math::
        \mathrm{forward\_kl} = \sum_i p_i (\log p_i - \log q_i), \quad
        \mathrm{reverse\_kl} = \sum_i q_i (\log q_i - \log p_i), \quad
        \mathrm{jsd}_\beta = \beta \sum_i p_i \log\tfrac{p_i}{m_i}
            + (1 - \beta) \sum_i q_i \log\tfrac{q_i}{m_i},

    :math:`m = \beta p + (1 - \beta) q`; a term whose probability is 0 is 0.
    ``jsd`` at ``beta`` 0 and 1 is forward and reverse KL (module docstring).

    Args:
        log_q: ``[..., V]`` the student's log-probabilities.
        log_p: ``[..., V]`` the teacher's log-probabilities.
        divergence: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
        beta: ``jsd``'s weight of the teacher, in ``[0, 1]``.

    Returns:
        ``[...]`` float32 divergences in nats.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> log_q = jax.nn.log_softmax(jnp.array([0.0, 1.0, 2.0]))
        >>> log_p = jax.nn.log_softmax(jnp.array([2.0, 1.0, 0.0]))
        >>> for d in DIVERGENCES:
        ...     print(d, round(float(token_divergence(log_q, log_p, divergence=d)), 4))
        forward_kl 1.1504
        reverse_kl 1.1504
        jsd 0.2476
    """
    _checks.check_choice("divergence", divergence, DIVERGENCES)
    _checks.check_concrete("token_divergence", beta=beta)
    _checks.check_in_range("beta", beta, low=0.0, high=1.0)
    log_q = jnp.asarray(log_q, jnp.float32)
    log_p = jnp.asarray(log_p, jnp.float32)
    chex.assert_equal_shape((log_q, log_p))
    terms, _ = _divergence_terms(
        log_q, log_p, _effective(divergence, float(beta)), beta
    )
    return jnp.sum(terms, axis=-1)


def _divergence_terms(log_q, log_p, divergence, beta):
    """The divergence's terms ``[..., V]`` (their sum over ``V`` is the
    divergence), and for ``jsd`` those of ``KL(q || m)``, else None."""
    if divergence == "forward_kl":
        return _x_log_ratio(jnp.exp(log_p), log_p, log_q), None
    if divergence == "reverse_kl":
        return _x_log_ratio(jnp.exp(log_q), log_q, log_p), None
    log_m = _log_mixture(log_p, log_q, beta)
    kl_qm = _x_log_ratio(jnp.exp(log_q), log_q, log_m)
    kl_pm = _x_log_ratio(jnp.exp(log_p), log_p, log_m)
    return beta * kl_pm + (1.0 - beta) * kl_qm, kl_qm


def _check_options(divergence, beta, temperature, hard_weight, labels, reduction):
    _checks.check_choice("divergence", divergence, DIVERGENCES)
    _checks.check_concrete(
        "the distillation losses",
        beta=beta,
        temperature=temperature,
        hard_weight=hard_weight,
    )
    _checks.check_in_range("beta", beta, low=0.0, high=1.0)
    _checks.check_in_range("temperature", temperature, low=0.0, low_open=True)
    _checks.check_in_range("hard_weight", hard_weight, low=0.0, high=1.0)
    _checks.check_choice("reduction", reduction, losses.REDUCTIONS)
    if hard_weight > 0 and labels is None:
        raise ValueError(
            f"hard_weight={hard_weight} mixes in the cross-entropy of labels; "
            "pass labels, or hard_weight=0."
        )


def _token_weights(labels, weights, leading, vocab_size, ignore_index):
    """``(weights [N] float32, safe_labels [N] | None, invalid [N])``, checked:
    ``losses.valid_weights``' rule for the labels."""
    num_tokens = math.prod(leading)
    if labels is not None:
        losses.check_labels_and_weights(labels, weights, leading)
        return losses.valid_weights(
            jnp.reshape(labels, num_tokens),
            None if weights is None else jnp.reshape(weights, num_tokens),
            vocab_size,
            ignore_index,
        )
    # Without labels, the weights' rules are those of the losses': the
    # labels check a dummy of the right shape.
    losses.check_labels_and_weights(np.zeros(leading, np.int32), weights, leading)
    weights = (
        jnp.ones(num_tokens, jnp.float32)
        if weights is None
        else jnp.reshape(jnp.asarray(weights, jnp.float32), num_tokens)
    )
    return weights, None, jnp.zeros(num_tokens, bool)


def _reduce(token_loss, weights, reduction):
    """The weighted mean, the sum, or ``[N]`` ``w * loss``; a weight of 0
    gives 0 (``losses.weighted_values``)."""
    per_token = losses.weighted_values(token_loss, weights)
    if reduction == "none":
        return per_token
    total = jnp.sum(per_token)
    if reduction == "sum":
        return total
    weight_sum = jnp.sum(weights)
    return total / jnp.where(weight_sum > 0, weight_sum, 1.0)


def _metrics(token_loss, divergence, nll, weights, invalid):
    """The weighted means of the terms and the counts; no gradient."""
    metrics = {"loss": token_loss, "divergence": divergence}
    if nll is not None:
        metrics["nll"] = nll
    metrics = {k: _reduce(v, weights, "mean") for k, v in metrics.items()}
    metrics["weight_sum"] = jnp.sum(weights)
    metrics["invalid_labels"] = jnp.sum(invalid).astype(jnp.int32)
    return jax.tree.map(lax.stop_gradient, metrics)


def distillation_loss(
    logits: jax.typing.ArrayLike,
    teacher_logits: jax.typing.ArrayLike,
    *,
    labels: jax.typing.ArrayLike | None = None,
    weights: jax.typing.ArrayLike | None = None,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    hard_weight: float = 0.0,
    reduction: str = "mean",
    ignore_index: int = losses.IGNORE_INDEX,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""The distillation loss of a student's logits against a teacher's.

    .. math::
        \ell_t = \alpha\, \mathrm{CE}(z_{s,t}, y_t)
            + (1 - \alpha)\, D\big(\mathrm{softmax}(z_{s,t} / T),
              \mathrm{softmax}(z_{t,t} / T)\big), \qquad
        L = \frac{\sum_t w_t \ell_t}{\sum_t w_t},

    with :math:`D` one of :data:`DIVERGENCES` (see the module docstring).
    The materialized reference of :func:`fused_distillation_loss`; its
    gradient is autodiff's, the teacher's is zero.

    Args:
        logits: ``[..., V]`` the student's logits.
        teacher_logits: ``[..., V]`` the teacher's logits, the same shape.
        labels: optional ``[...]`` integer targets: the cross-entropy's
            (``hard_weight``) and ``metrics["nll"]``. They follow
            ``losses.cross_entropy``'s rule (``losses.valid_weights``): a
            label equal to ``ignore_index`` leaves its token out (weight 0,
            divergence included), eagerly and inside ``jit``; other labels
            outside ``[0, V)`` are an error when concrete, and get weight 0
            and are counted inside ``jit``.
        weights: optional ``[...]`` per-token weights >= 0 (0 for padding).
        divergence: ``"forward_kl"`` (default), ``"reverse_kl"`` or ``"jsd"``.
        beta: ``jsd``'s weight of the teacher, in ``[0, 1]``; concrete.
        temperature: :math:`T > 0` of both distributions; concrete.
        hard_weight: :math:`\alpha \in [0, 1]`; > 0 needs ``labels``.
        reduction: ``"mean"`` (over the weights), ``"sum"`` or ``"none"``
            (``[...]``, :math:`w_t \ell_t`).
        ignore_index: the label of an ignored token, ``-100`` by default.

    Returns:
        ``(loss, metrics)``: ``metrics`` holds the weighted means ``loss``
        and ``divergence`` (nats), ``nll`` when labels are given, and
        ``weight_sum`` and ``invalid_labels``; no gradient flows through it.

    Raises:
        ValueError, TypeError: naming the argument, for a teacher of another
            shape or vocabulary, an option out of range or a traced option.

    Examples:
        >>> import jax.numpy as jnp
        >>> student = jnp.array([[0.0, 1.0, 2.0], [1.0, 0.0, 0.0]])
        >>> teacher = jnp.array([[2.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
        >>> loss, metrics = distillation_loss(student, teacher)
        >>> print(f"{loss:.4f}")  # (1.1504 + 0) / 2
        0.5752
    """
    _checks.check_logits(logits)
    _checks.check_floating("teacher_logits", teacher_logits)
    if np.shape(teacher_logits) != np.shape(logits):
        raise ValueError(
            "teacher_logits must have the student's shape [..., V] = "
            f"{np.shape(logits)}; got {np.shape(teacher_logits)}."
        )
    _check_options(divergence, beta, temperature, hard_weight, labels, reduction)
    leading, vocab_size = np.shape(logits)[:-1], np.shape(logits)[-1]
    weights, safe_labels, invalid = _token_weights(
        labels, weights, leading, vocab_size, ignore_index
    )
    z = jnp.reshape(jnp.asarray(logits, jnp.float32), (-1, vocab_size))
    z_t = lax.stop_gradient(
        jnp.reshape(jnp.asarray(teacher_logits, jnp.float32), (-1, vocab_size))
    )
    # A token of weight 0 (padding) may have a teacher row that is all -inf or
    # NaN: it adds 0 to the loss, and 0 (not NaN) to the gradient.
    z_t = jnp.where(weights[:, None] != 0, z_t, 0.0)
    div = token_divergence(
        jax.nn.log_softmax(z / temperature),
        jax.nn.log_softmax(z_t / temperature),
        divergence=divergence,
        beta=beta,
    )
    nll = None
    token_loss = div
    if safe_labels is not None:
        log_probs = jax.nn.log_softmax(z)
        nll = -jnp.take_along_axis(log_probs, safe_labels[:, None], axis=-1)[:, 0]
        token_loss = _mix(hard_weight, nll, div)
    loss = _reduce(token_loss, weights, reduction)
    if reduction == "none":
        loss = jnp.reshape(loss, leading)
    return loss, _metrics(token_loss, div, nll, weights, invalid)


# Indices of the rule's outputs: pass 0's log-normalizers and nll, pass 1's
# divergence (and jsd's KL(q || m), which its gradient needs).
_LSE_Q, _LSE_P, _NLL, _LSE_1, _DIV, _KL_QM = range(6)


@dataclasses.dataclass(frozen=True)
class DistillationRule(_fused_rule.Rule):
    r"""The distillation loss as a rule of :mod:`lmhead._fused_sweep`.

    Pass 0 reduces the vocabulary blocks to the student's and the teacher's
    log-normalizers at temperature :math:`T` (online logsumexps), and with
    labels to the student's at temperature 1 and the label's logit; pass 1
    sums the divergence's terms (and :math:`\mathrm{KL}(q \| m)` for
    ``jsd``), which need those normalizers. With :math:`s = z_s / T`:

    .. math::
        \frac{\partial\, \mathrm{KL}(p \| q)}{\partial s_i} = q_i - p_i,
        \qquad \frac{\partial\, \mathrm{KL}(q \| p)}{\partial s_i}
            = q_i \big(\log\tfrac{q_i}{p_i} - \mathrm{KL}(q \| p)\big),
        \qquad \frac{\partial\, \mathrm{jsd}_\beta}{\partial s_i}
            = (1 - \beta)\, q_i \big(\log\tfrac{q_i}{m_i}
              - \mathrm{KL}(q \| m)\big),

    then :math:`1/T` to reach :math:`z_s`, and the cross-entropy's
    :math:`\mathrm{softmax}(z_s) - e_y`. ``inputs`` are ``((labels or None,
    teacher logits [N, V] or h_t [N, D_t]), w_t [V, D_t] or ())``; a chunk's
    teacher logits are computed (or transposed) once, ``[V, Nc]``, the rows
    of a device when the vocabulary is split. The accumulators merge and
    combine as the base's; coefficients are ``(divergence, nll)``'s.
    """

    divergence: str  # forward_kl, reverse_kl or jsd with 0 < beta < 1
    beta: float
    temperature: float
    hard_weight: float
    has_labels: bool
    teacher_is_logits: bool
    passes = 2
    # The largest temporary is the dw accumulator, so a chunk of [V, C]
    # arrays twice as long costs little memory, and the dw matmul contracts
    # over twice the tokens.
    chunk_factor = 2

    def chunk_context(self, plan, h_chunk, token_inputs, w_t):
        labels, teacher = token_inputs
        if labels is not None:
            labels = labels - plan.first_row()  # from a device's first row
        if self.teacher_is_logits:
            rows = teacher.astype(jnp.float32).T
            if plan.vocab_axis is None:
                return labels, rows
            return labels, lax.dynamic_slice_in_dim(
                rows, plan.first_row(), plan.num_rows
            )
        return labels, plan.dot(w_t, teacher, _CONTRACT_COLUMNS)

    def _groups(self, z, teacher):
        """The logits whose logsumexps pass 0 takes: ``z / T``, the
        teacher's ``/ T``, and ``z`` itself for the labels when ``T != 1``."""
        t = self.temperature
        groups = (z / t, teacher / t)
        return groups + ((z,) if self.has_labels and t != 1.0 else ())

    def block_stats(self, plan, pass_, z, v0, is_new, context, previous):
        labels, teacher = context
        teacher = lax.dynamic_slice_in_dim(teacher, v0, z.shape[0])
        if pass_ == 0:
            groups = tuple(
                _online_softmax.Softmax.of_block(x, v0, is_new)
                for x in self._groups(z, teacher)
            )
            labelled = self.has_labels
            label = (
                _online_softmax.label_logit(z, labels, v0, is_new) if labelled else 0.0
            )
            return groups + (label,)
        log_q, log_p = self._log_probs(z, teacher, previous)
        terms = _divergence_terms(log_q, log_p, self.divergence, self.beta)
        return tuple(
            0.0 if x is None else jnp.sum(jnp.where(is_new, x, 0.0), axis=0)
            for x in terms
        )

    def finish(self, pass_, carry):
        if pass_ == 1:  # (divergence, KL(q || m) or 0)
            return super().finish(pass_, carry)
        *groups, label = carry
        lse = tuple(group.finish()[0] for group in groups)
        lse_1 = lse[2] if len(lse) > 2 else lse[0]
        nll = lse_1 - label if self.has_labels else jnp.zeros_like(lse_1)
        return (lse[0], lse[1], nll, lse_1)

    def _log_probs(self, z, teacher, outputs):
        """The student's and the teacher's ``log softmax(. / T)`` of a block."""
        t = self.temperature
        return z / t - outputs[_LSE_Q], teacher / t - outputs[_LSE_P]

    def loss(self, loss_scalars, outputs, token_inputs=None):
        return _mix(self.hard_weight, outputs[_NLL], outputs[_DIV])

    def loss_coefs(self, loss_scalars, outputs, weights, token_inputs=None):
        """``weights * d loss / d(divergence, nll)``; None for a left-out term."""
        a = self.hard_weight
        c_div = None if a == 1 else weights if a == 0 else (1.0 - a) * weights
        c_nll = None if a == 0 else weights if a == 1 else a * weights
        return c_div, c_nll

    def cotangent_coefs(self, outputs, cotangents):
        nll = cotangents[_NLL] if self.has_labels else None
        return cotangents[_DIV], nll

    def dlogits(self, z, v0, context, outputs, coefs):
        labels, teacher = context
        c_div, c_nll = coefs
        dz = jnp.zeros_like(z)
        # A token of coefficient 0 (padding, a left-out term) adds exactly 0,
        # even where its term's gradient is not finite.
        if c_div is not None:
            teacher = lax.dynamic_slice_in_dim(teacher, v0, z.shape[0])
            log_q, log_p = self._log_probs(z, teacher, outputs)
            q = jnp.exp(log_q)
            if self.divergence == "forward_kl":
                g = q - jnp.exp(log_p)
            elif self.divergence == "reverse_kl":
                g = jnp.where(q > 0, q * (log_q - log_p - outputs[_DIV]), 0.0)
            else:
                log_m = _log_mixture(log_p, log_q, self.beta)
                g = (1.0 - self.beta) * jnp.where(
                    q > 0, q * (log_q - log_m - outputs[_KL_QM]), 0.0
                )
            dz = jnp.where(c_div != 0, c_div * (g / self.temperature), 0.0)
        if c_nll is not None:
            p = jnp.exp(z - outputs[_LSE_1])
            g = p - _online_softmax.is_label(z, v0, labels)
            dz = dz + jnp.where(c_nll != 0, c_nll * g, 0.0)
        return dz

    def sorted_inputs(self, token_inputs, order, inverse):
        labels, teacher = token_inputs
        if self.teacher_is_logits:  # [N, V]; h_t has no vocabulary axis
            teacher = jnp.take(teacher, order, axis=1)
        return (None if labels is None else inverse[labels]), teacher


def _check_teacher(teacher, leading, vocab_size):
    """``(teacher arrays, is_logits)``: logits ``[..., V]`` or ``(h_t, w_t)``."""
    if isinstance(teacher, (tuple, list)):
        if len(teacher) != 2:
            raise ValueError(
                "teacher must be its logits [..., V] or a pair (h_t [..., D_t], "
                f"w_t [V, D_t]); got a sequence of {len(teacher)}."
            )
        h_t, w_t = teacher
        try:
            _checks.check_unembed_inputs(h_t, w_t, None)
        except (TypeError, ValueError) as error:
            raise type(error)(f"teacher (h_t, w_t): {error}") from None
        if np.shape(w_t)[0] != vocab_size or np.shape(h_t)[:-1] != tuple(leading):
            raise ValueError(
                f"teacher (h_t, w_t) must have h_t: {tuple(leading)} + (D_t,) "
                f"and w_t: ({vocab_size}, D_t), the student's tokens and "
                f"vocabulary; got {np.shape(h_t)} and {np.shape(w_t)}."
            )
        return (h_t, w_t), False
    _checks.check_floating("teacher", teacher)
    if np.shape(teacher) != tuple(leading) + (vocab_size,):
        raise ValueError(
            f"teacher logits must have shape {tuple(leading) + (vocab_size,)}, "
            f"the student's tokens and vocabulary; got {np.shape(teacher)}."
        )
    return (teacher,), True


def fused_distillation_loss(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    teacher: jax.typing.ArrayLike | tuple[jax.typing.ArrayLike, jax.typing.ArrayLike],
    *,
    labels: jax.typing.ArrayLike | None = None,
    bias: jax.typing.ArrayLike | None = None,
    weights: jax.typing.ArrayLike | None = None,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    hard_weight: float = 0.0,
    reduction: str = "mean",
    scale: float | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    precision: jax.lax.PrecisionLike = None,
    filter_eps: float | str | None = None,
    filter_target: str = "both",
    dw_accumulation: str = "float32",
    vocab_order: jax.typing.ArrayLike | str | None = None,
    ignore_index: int = losses.IGNORE_INDEX,
    vocab_shards: _fused_rule.VocabShards | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r""":func:`distillation_loss` of the student ``unembed(h, w, bias)``, fused.

    Returns what ``distillation_loss(head.unembed(h, w, bias, scale=scale,
    softcap=softcap), teacher_logits, ...)`` returns, holding the logits of
    ``chunk_size`` tokens at a time: temporary memory ``O(chunk_size * V)``
    instead of ``O(N * V)``. The teacher is its logits ``[..., V]`` or its
    ``(h_t, w_t)``, whose logits are computed chunk by chunk too. The
    gradient w.r.t. ``h``, ``w``, ``bias`` and ``weights`` is exact (the
    sweep's custom VJP); the teacher's is zero. Gradients come back in the
    inputs' dtypes.

    Args:
        h: ``[..., D]`` the student's hidden states.
        w: ``[V, D]`` the student's unembedding (a tied head's embedding).
        teacher: ``[..., V]`` logits, or ``(h_t: [..., D_t], w_t: [V, D_t])``.
        labels, weights, divergence, beta, temperature, hard_weight,
            reduction, ignore_index: as in :func:`distillation_loss`.
        bias: optional ``[V]``, the student's.
        scale, softcap: the student's, as in ``head.unembed``; concrete
            numbers > 0 or None. A teacher ``(h_t, w_t)`` is plain
            ``h_t @ w_t.T``: pass its logits for any other head.
        chunk_size: tokens per chunk, an integer >= 1. Default:
            ``2 * fused.BLOCK_ELEMENTS[platform] // V`` clipped to
            ``[fused.MIN_CHUNK_SIZE, fused.MAX_CHUNK_SIZE]``, twice
            ``fused.fused_cross_entropy``'s.
        precision: of the matmuls, as in ``head.unembed``.
        filter_eps, filter_target, dw_accumulation, vocab_order: gradient
            filtering, ``dw``'s accumulation and the sweep's row order, as
            in ``fused.fused_cross_entropy``
            (:meth:`lmhead._sweep_options.SweepOptions.gradient_options`).
        vocab_shards: None (default) on one device, or the student's and
            ``w_t``'s rows split over a mesh axis
            (``vocab_parallel.vocab_shards``); each device's statistics are
            combined as ``fused.fused_cross_entropy``'s.

    Returns:
        ``(loss, metrics)`` as :func:`distillation_loss` returns them.

    Raises:
        ValueError, TypeError: naming the argument: a teacher of another
            vocabulary or token count, ``beta`` outside ``[0, 1]``, a
            temperature <= 0, a chunk size that is not a count.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from lmhead import head
        >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        >>> h = jax.random.normal(k1, (2, 3, 4))
        >>> w = jax.random.normal(k2, (10, 4))
        >>> teacher = jax.random.normal(k3, (2, 3, 10))
        >>> loss, _ = fused_distillation_loss(h, w, teacher, divergence="jsd",
        ...                                   temperature=2.0, chunk_size=4)
        >>> reference, _ = distillation_loss(head.unembed(h, w), teacher,
        ...                                  divergence="jsd", temperature=2.0)
        >>> print(f"{loss:.5f} {reference:.5f}")
        0.10795 0.10795
    """
    options = SweepOptions(
        scale=scale,
        softcap=softcap,
        chunk_size=chunk_size,
        precision=precision,
        filter_eps=filter_eps,
        filter_target=filter_target,
        dw_accumulation=dw_accumulation,
    )
    _checks.check_unembed_inputs(h, w, bias)
    _check_options(divergence, beta, temperature, hard_weight, labels, reduction)
    vocab_size, d_model = np.shape(w)
    leading = np.shape(h)[:-1]
    teacher, teacher_is_logits = _check_teacher(teacher, leading, vocab_size)
    weights, safe_labels, invalid = _token_weights(
        labels, weights, leading, vocab_size, ignore_index
    )
    num_tokens = math.prod(leading)
    if num_tokens == 0:
        empty = jnp.zeros(0, jnp.float32)
        nll = None if labels is None else empty
        loss = _reduce(empty, weights, reduction)
        loss = jnp.reshape(loss, leading) if reduction == "none" else loss
        return loss, _metrics(empty, empty, nll, weights, invalid)
    rule = DistillationRule(
        divergence=_effective(divergence, float(beta)),
        beta=float(beta),
        temperature=float(temperature),
        hard_weight=float(hard_weight),
        has_labels=labels is not None,
        teacher_is_logits=teacher_is_logits,
    )
    if teacher_is_logits:  # the teacher is a constant: no gradient
        inputs = (jnp.reshape(teacher[0], (num_tokens, vocab_size)), ())
    else:  # w_t keeps its [V, D_t]
        inputs = (jnp.reshape(teacher[0], (num_tokens, -1)), jnp.asarray(teacher[1]))
    inputs = jax.tree.map(lax.stop_gradient, ((safe_labels, inputs[0]), inputs[1]))
    objective, outputs = _fused_sweep.run(
        options,
        rule,
        jnp.reshape(h, (num_tokens, d_model)),
        w,
        bias,
        weights,
        inputs,
        grads_in_forward=reduction != "none",
        vocab_order=vocab_order,
        vocab_shards=vocab_shards,
    )
    token_loss = rule.loss(None, outputs)
    nll = outputs[_NLL] if rule.has_labels else None
    metrics = _metrics(token_loss, outputs[_DIV], nll, weights, invalid)
    if reduction == "none":
        return jnp.reshape(_reduce(token_loss, weights, "none"), leading), metrics
    if reduction == "sum":
        return objective, metrics
    weight_sum = jnp.sum(weights)
    return objective / jnp.where(weight_sum > 0, weight_sum, 1.0), metrics
