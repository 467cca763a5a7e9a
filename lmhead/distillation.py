r"""Knowledge distillation losses: a teacher's distribution as the target.

Two functions compute one loss. :func:`distillation_loss` takes the
student's and the teacher's logits; :func:`fused_distillation_loss` takes
the student's hidden states and unembedding, ``h: [N, D]`` and ``w: [V, D]``,
and computes the student's logits a chunk of tokens at a time, never
``[N, V]`` at once (the teacher may be given the same way). Both reduce the
same per-token terms, :func:`token_divergence`, so they cannot drift apart.

The divergences. With a temperature :math:`T`, the student's
:math:`q = \mathrm{softmax}(z_s / T)` and the teacher's
:math:`p = \mathrm{softmax}(z_t / T)`:

.. math::
    \mathrm{forward\_kl} = \mathrm{KL}(p \,\|\, q), \qquad
    \mathrm{reverse\_kl} = \mathrm{KL}(q \,\|\, p), \\
    \mathrm{jsd}_\beta = \beta\, \mathrm{KL}(p \,\|\, m)
        + (1 - \beta)\, \mathrm{KL}(q \,\|\, m), \qquad
    m = \beta p + (1 - \beta) q,

the generalized Jensen-Shannon divergence of Agarwal et al. (GKD), as Liger
Kernel's ``LigerFusedLinearJSD`` defines it, and, as there, ``beta = 0``
and ``beta = 1`` mean forward and reverse KL (the limits of
:math:`\mathrm{jsd}_\beta / \beta` and :math:`\mathrm{jsd}_\beta / (1 -
\beta)`; ``jsd`` itself vanishes at both ends). A term :math:`0 \log 0` is
0, so a token banned by the teacher (logit ``-inf``) adds nothing to the
forward KL; under the reverse KL a student that gives it mass pays
:math:`+\infty`, as the formula says.

With ``labels`` and ``hard_weight`` :math:`\alpha`, the loss mixes in the
student's cross-entropy at temperature 1, as Hinton et al. do:
:math:`\ell_t = \alpha\, \mathrm{CE}(z_s, y) + (1 - \alpha)\, D_t`. The
divergence is not multiplied by :math:`T^2`; multiply it by ``temperature**2``
(or fold it into the learning rate) to keep its gradients' size across
temperatures as Hinton et al. suggest.

The fused gradient. With :math:`s = z_s / T`, the gradients of the
divergences with respect to the student's scaled logits are

.. math::
    \frac{\partial\, \mathrm{KL}(p \| q)}{\partial s_i} = q_i - p_i, \qquad
    \frac{\partial\, \mathrm{KL}(q \| p)}{\partial s_i}
        = q_i \big(\log\tfrac{q_i}{p_i} - \mathrm{KL}(q \| p)\big), \qquad
    \frac{\partial\, \mathrm{jsd}_\beta}{\partial s_i}
        = (1 - \beta)\, q_i \big(\log\tfrac{q_i}{m_i} - \mathrm{KL}(q \| m)\big),

(for ``jsd`` the teacher's term and the :math:`m` in the student's log
cancel), then :math:`1/T` to reach :math:`z_s`, and the cross-entropy's
:math:`\mathrm{softmax}(z_s) - e_y`. For a ``"mean"`` or ``"sum"`` loss a
chunk's gradient is known once its logits are, so the forward sweep
computes ``dh``, ``dw`` and ``dbias`` from each chunk's logits while they are
live: two matmuls per chunk beside the logits' one (the materialized
path's three), and no recomputation. ``reduction="none"`` recomputes the
logits in the backward pass, with each token's cotangent.

The teacher is a constant: it gets no gradient (a zero cotangent, as
``lax.stop_gradient`` would give), in both functions. So do the metrics,
which are values to log; differentiate the loss.

References:
    Hinton, Vinyals and Dean, `Distilling the Knowledge in a Neural Network
    <https://arxiv.org/abs/1503.02531>`_, 2015; Agarwal et al., `On-Policy
    Distillation of Language Models: Learning from Self-Generated Mistakes
    <https://arxiv.org/abs/2306.13649>`_, 2024 (generalized JSD); Hsu et al.,
    `Liger Kernel <https://arxiv.org/abs/2410.10989>`_, 2024 (fused linear
    JSD).
"""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lmhead import _checks, fused, head, losses

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")

_CONTRACT_COLUMNS = (((1,), (1,)), ((), ()))  # [a, D] x [b, D] -> [a, b]
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # [N, a] x [N, b] -> [a, b]
_MATMUL = (((1,), (0,)), ((), ()))  # [a, k] x [k, b] -> [a, b]


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
    q, p = jnp.exp(log_q), jnp.exp(log_p)
    divergence = _effective(divergence, float(beta))
    if divergence == "forward_kl":
        return jnp.sum(_x_log_ratio(p, log_p, log_q), axis=-1)
    if divergence == "reverse_kl":
        return jnp.sum(_x_log_ratio(q, log_q, log_p), axis=-1)
    log_m = _log_mixture(log_p, log_q, beta)
    return jnp.sum(
        beta * _x_log_ratio(p, log_p, log_m)
        + (1.0 - beta) * _x_log_ratio(q, log_q, log_m),
        axis=-1,
    )


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


def _token_weights(labels, weights, leading, vocab_size):
    """``(weights [N] float32, safe_labels [N] | None, invalid [N])``, checked."""
    num_tokens = math.prod(leading)
    if labels is not None:
        losses.check_labels_and_weights(labels, weights, leading, vocab_size)
        return losses.valid_weights(
            jnp.reshape(labels, num_tokens),
            None if weights is None else jnp.reshape(weights, num_tokens),
            vocab_size,
        )
    # Without labels, the weights' rules are those of the losses': the
    # labels check a dummy of the right shape.
    losses.check_labels_and_weights(
        np.zeros(leading, np.int32), weights, leading, vocab_size
    )
    weights = (
        jnp.ones(num_tokens, jnp.float32)
        if weights is None
        else jnp.reshape(jnp.asarray(weights, jnp.float32), num_tokens)
    )
    return weights, None, jnp.zeros(num_tokens, bool)


def _reduce(token_loss, divergence, nll, weights, invalid, leading, reduction):
    """``(loss, metrics)``: the weighted mean, sum or per-token ``w * loss``."""
    weight_sum = jnp.sum(weights)
    safe_sum = jnp.where(weight_sum > 0, weight_sum, 1.0)

    def weighted(x):
        return losses.weighted_values(x, weights)

    metrics = {
        "loss": jnp.sum(weighted(token_loss)) / safe_sum,
        "divergence": jnp.sum(weighted(divergence)) / safe_sum,
    }
    if nll is not None:
        metrics["nll"] = jnp.sum(weighted(nll)) / safe_sum
    metrics["weight_sum"] = weight_sum
    metrics["invalid_labels"] = jnp.sum(invalid).astype(jnp.int32)
    loss = _objective(token_loss, weights, reduction)
    if reduction == "none":
        loss = jnp.reshape(loss, leading)
    return loss, jax.tree.map(lax.stop_gradient, metrics)


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
            (``hard_weight``) and ``metrics["nll"]``. Labels outside
            ``[0, V)`` follow ``losses.cross_entropy``'s rule (an error when
            concrete, weight 0 and counted inside ``jit``).
        weights: optional ``[...]`` per-token weights >= 0 (0 for padding).
        divergence: ``"forward_kl"`` (default), ``"reverse_kl"`` or ``"jsd"``.
        beta: ``jsd``'s weight of the teacher, in ``[0, 1]``; concrete.
        temperature: :math:`T > 0` of both distributions; concrete.
        hard_weight: :math:`\alpha \in [0, 1]`; > 0 needs ``labels``.
        reduction: ``"mean"`` (over the weights), ``"sum"`` or ``"none"``
            (``[...]``, :math:`w_t \ell_t`).

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
        >>> loss, metrics = distillation_loss(
        ...     student, teacher, labels=jnp.array([2, 0]), hard_weight=0.5,
        ...     divergence="jsd", temperature=2.0)
        >>> print(f"{loss:.4f} {metrics['nll']:.4f}")
        0.2590 0.4795
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
    weights, safe_labels, invalid = _token_weights(labels, weights, leading, vocab_size)
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
    return _reduce(token_loss, div, nll, weights, invalid, leading, reduction)


# ----------------------------------------------------------------------------
# The fused sweep.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static part of a fused call."""

    divergence: str  # forward_kl, reverse_kl or jsd with 0 < beta < 1
    beta: float
    temperature: float
    hard_weight: float
    has_labels: bool
    teacher_is_logits: bool
    chunk_size: int
    precision: jax.lax.PrecisionLike
    grads_in_forward: bool
    scale: float | None = None  # the student's, as in head.unembed
    softcap: float | None = None

    def dot(self, a, b, dims):
        return lax.dot_general(
            a, b, dims, precision=self.precision, preferred_element_type=jnp.float32
        )


def _log_probs(z, temperature):
    """``log softmax(z / T)`` over the last axis, as ``z / T - lse``."""
    scaled = z / temperature
    return scaled - jax.nn.logsumexp(scaled, axis=-1, keepdims=True)


def _chunk(plan, i, num_tokens, h, w, bias, teacher, labels):
    """Chunk ``i``'s start, new-token mask, ``h`` rows and terms.

    Returns ``(start, is_new [C], h_c [C, D], token_loss, divergence, nll,
    g [C, V])`` with ``g`` the per-token loss's gradient w.r.t. the logits
    before the softcap (``scale * h @ w.T + bias``).
    The last chunk of a ragged ``N`` starts at ``N - C`` and masks what the
    previous chunk covered, so nothing is padded or indexed out of range.
    """
    size = plan.chunk_size
    start = jnp.minimum(i * size, num_tokens - size)
    is_new = start + jnp.arange(size) >= i * size
    h_c = lax.dynamic_slice_in_dim(h, start, size)
    z = plan.dot(h_c, w, _CONTRACT_COLUMNS)
    if plan.scale is not None:
        z = z * plan.scale
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    if plan.softcap is not None:
        z = head.apply_softcap(z, plan.softcap)
    if plan.teacher_is_logits:
        z_t = lax.dynamic_slice_in_dim(teacher[0], start, size).astype(jnp.float32)
    else:
        h_t, w_t = teacher
        z_t = plan.dot(
            lax.dynamic_slice_in_dim(h_t, start, size), w_t, _CONTRACT_COLUMNS
        )
    t = plan.temperature
    # Log-probs as logits minus a logsumexp, not jax.nn.log_softmax: XLA then
    # fuses each reduction below and the gradient with the elementwise work
    # that feeds it, and no [C, V] array but the logits and g is written.
    log_q = _log_probs(z, t)
    log_p = _log_probs(z_t, t)
    div = token_divergence(log_q, log_p, divergence=plan.divergence, beta=plan.beta)
    q = jnp.exp(log_q)
    if plan.divergence == "forward_kl":
        g = q - jnp.exp(log_p)
    elif plan.divergence == "reverse_kl":
        g = jnp.where(q > 0, q * (log_q - log_p - div[:, None]), 0.0)
    else:
        log_m = _log_mixture(log_p, log_q, plan.beta)
        kl_qm = jnp.sum(_x_log_ratio(q, log_q, log_m), axis=-1)
        g = (1.0 - plan.beta) * jnp.where(
            q > 0, q * (log_q - log_m - kl_qm[:, None]), 0.0
        )
    g = g / t
    nll = jnp.zeros(size, jnp.float32)
    token_loss = div
    if plan.has_labels:
        y = lax.dynamic_slice_in_dim(labels, start, size)
        lse = jax.nn.logsumexp(z, axis=-1)
        nll = lse - jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0]
        a = plan.hard_weight
        token_loss = _mix(a, nll, div)
        if a > 0:
            is_label = lax.broadcasted_iota(jnp.int32, z.shape, 1) == y[:, None]
            g_ce = jnp.exp(z - lse[:, None]) - is_label
            g = g_ce if a == 1 else a * g_ce + (1.0 - a) * g
    if plan.softcap is not None:  # d(c tanh(u / c)) / du = 1 - (z / c)^2
        g = g * (1.0 - jnp.square(z / plan.softcap))
    return start, is_new, h_c, token_loss, div, nll, g


def _sweep(plan, h, w, bias, teacher, labels, coefficients):
    """Per-token terms ``[N]`` x 3 and, with ``coefficients: [N]``, the
    gradients of ``sum_t c_t l_t`` w.r.t. ``h``, ``w`` and ``bias``."""
    num_tokens = h.shape[0]
    size = plan.chunk_size
    num_chunks = -(-num_tokens // size)
    with_grads = coefficients is not None
    zeros = jnp.zeros(num_tokens, jnp.float32)
    carry = (zeros, zeros, zeros)
    if with_grads:
        carry += (
            jnp.zeros(h.shape, jnp.float32),
            jnp.zeros(w.shape, jnp.float32),
            None if bias is None else jnp.zeros(bias.shape, jnp.float32),
        )

    def put(total, start, is_new, value):
        old = lax.dynamic_slice_in_dim(total, start, size)
        mask = is_new.reshape((size,) + (1,) * (value.ndim - 1))
        return lax.dynamic_update_slice_in_dim(
            total, jnp.where(mask, value, old), start, axis=0
        )

    def body(i, carry):
        start, is_new, h_c, token_loss, div, nll, g = _chunk(
            plan, i, num_tokens, h, w, bias, teacher, labels
        )
        terms = tuple(
            put(total, start, is_new, value)
            for total, value in zip(carry[:3], (token_loss, div, nll))
        )
        if not with_grads:
            return terms
        dh, dw, dbias = carry[3:]
        c = jnp.where(is_new, lax.dynamic_slice_in_dim(coefficients, start, size), 0.0)
        # A token of coefficient 0 (padding, a covered token) adds exactly 0,
        # even where its terms are not finite.
        g = jnp.where(c[:, None] != 0, g * c[:, None], 0.0)
        if dbias is not None:
            dbias = dbias + jnp.sum(g, axis=0)
        if plan.scale is not None:
            g = g * plan.scale
        g_in = g.astype(h_c.dtype)  # the matmuls at the inputs' precision
        dh = put(dh, start, is_new, plan.dot(g_in, w, _MATMUL))
        dw = dw + plan.dot(g_in, h_c, _CONTRACT_ROWS)
        return terms + (dh, dw, dbias)

    return lax.fori_loop(0, num_chunks, body, carry)


def _weights_cotangent(token_loss, weights, reduction, g):
    """The exact gradient w.r.t. the weights of the reduced loss."""
    finite = jnp.where(jnp.isfinite(token_loss) | (weights != 0), token_loss, 0.0)
    if reduction in ("none", "sum"):
        return g * finite
    weight_sum = jnp.sum(weights)
    safe_sum = jnp.where(weight_sum > 0, weight_sum, 1.0)
    mean = jnp.sum(weights * finite) / safe_sum
    return g * (finite - mean) / safe_sum


def _objective_coefficients(weights, reduction):
    if reduction == "sum":
        return weights
    weight_sum = jnp.sum(weights)
    return weights / jnp.where(weight_sum > 0, weight_sum, 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_core(plan, reduction, h, w, bias, teacher, labels, weights):
    """``(objective or [N] w * loss, (token_loss, divergence, nll))``."""
    token_loss, div, nll = _sweep(plan, h, w, bias, teacher, labels, None)[:3]
    return _objective(token_loss, weights, reduction), (token_loss, div, nll)


def _objective(token_loss, weights, reduction):
    """The reduced loss: the weighted mean, the sum, or ``[N]`` ``w * loss``."""
    per_token = losses.weighted_values(token_loss, weights)
    if reduction == "none":
        return per_token
    total = jnp.sum(per_token)
    if reduction == "sum":
        return total
    weight_sum = jnp.sum(weights)
    return total / jnp.where(weight_sum > 0, weight_sum, 1.0)


def _fused_forward(plan, reduction, h, w, bias, teacher, labels, weights):
    if plan.grads_in_forward:
        coefficients = _objective_coefficients(weights, reduction)
        token_loss, div, nll, dh, dw, dbias = _sweep(
            plan, h, w, bias, teacher, labels, coefficients
        )
        grads = (dh, dw, dbias)
    else:
        token_loss, div, nll = _sweep(plan, h, w, bias, teacher, labels, None)[:3]
        grads = None
    out = (_objective(token_loss, weights, reduction), (token_loss, div, nll))
    return out, (h, w, bias, teacher, labels, weights, token_loss, grads)


def _fused_backward(plan, reduction, residuals, cotangents):
    h, w, bias, teacher, labels, weights, token_loss, grads = residuals
    g = cotangents[0]  # the terms' cotangents are zero: they are metrics only
    if grads is None:
        _, _, _, dh, dw, dbias = _sweep(plan, h, w, bias, teacher, labels, g * weights)
    else:
        dh, dw, dbias = (None if x is None else g * x for x in grads)
    return (
        dh.astype(h.dtype),
        dw.astype(w.dtype),
        None if bias is None else dbias.astype(bias.dtype),
        None,  # the teacher is a constant
        None,
        _weights_cotangent(token_loss, weights, reduction, g),
    )


_fused_core.defvjp(_fused_forward, _fused_backward)


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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r""":func:`distillation_loss` of the student ``unembed(h, w, bias)``, fused.

    Returns what ``distillation_loss(head.unembed(h, w, bias, scale=scale,
    softcap=softcap), teacher_logits, ...)`` returns, holding the logits of ``chunk_size`` tokens at a time:
    temporary memory ``O(chunk_size * V)`` instead of ``O(N * V)``. The
    teacher is its logits ``[..., V]`` (an input, read a chunk at a time), or
    its hidden states and unembedding ``(h_t, w_t)``, whose logits are
    computed chunk by chunk too. The gradient w.r.t. ``h``, ``w``, ``bias``
    and ``weights`` is a custom VJP (the module docstring derives it), exact
    and computed in the forward sweep for ``"mean"`` and ``"sum"``; the
    teacher's is zero. Logits and gradients are float32 whatever the inputs'
    dtypes; gradients come back in the inputs' dtypes.

    Args:
        h: ``[..., D]`` the student's hidden states.
        w: ``[V, D]`` the student's unembedding (a tied head's embedding).
        teacher: ``[..., V]`` logits, or ``(h_t: [..., D_t], w_t: [V, D_t])``.
        labels, weights, divergence, beta, temperature, hard_weight,
            reduction: as in :func:`distillation_loss`.
        bias: optional ``[V]``, the student's.
        scale, softcap: the student's, as in ``head.unembed``; concrete
            numbers > 0 or None. A teacher ``(h_t, w_t)`` is plain
            ``h_t @ w_t.T``: pass its logits for any other head.
        chunk_size: tokens per chunk, an integer >= 1. Default:
            ``2 * fused.BLOCK_ELEMENTS[platform] // V`` clipped to
            ``[fused.MIN_CHUNK_SIZE, fused.MAX_CHUNK_SIZE]``, twice
            ``fused.fused_cross_entropy``'s.
        precision: of the matmuls, as in ``head.unembed``.

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
        >>> dh, dw = jax.jit(jax.grad(lambda h, w: fused_distillation_loss(
        ...     h, w, teacher, chunk_size=4)[0], argnums=(0, 1)))(h, w)
        >>> dh.shape, dw.shape
        ((2, 3, 4), (10, 4))

        A teacher given by its own head, with a quarter of the hard loss:

        >>> h_t = jax.random.normal(k3, (2, 3, 6))
        >>> w_t = jax.random.normal(k1, (10, 6))
        >>> labels = jnp.array([[8, 5, 3], [1, 2, 6]])
        >>> loss, metrics = fused_distillation_loss(
        ...     h, w, (h_t, w_t), labels=labels, hard_weight=0.25)
        >>> sorted(metrics)
        ['divergence', 'invalid_labels', 'loss', 'nll', 'weight_sum']
    """
    _checks.check_unembed_inputs(h, w, bias)
    _checks.check_count("chunk_size", chunk_size, optional=True)
    _check_options(divergence, beta, temperature, hard_weight, labels, reduction)
    _checks.check_concrete("fused_distillation_loss", scale=scale, softcap=softcap)
    for name, value in dict(scale=scale, softcap=softcap).items():
        _checks.check_in_range(name, value, low=0.0, low_open=True)
    vocab_size, d_model = np.shape(w)
    leading = np.shape(h)[:-1]
    teacher, teacher_is_logits = _check_teacher(teacher, leading, vocab_size)
    weights, safe_labels, invalid = _token_weights(labels, weights, leading, vocab_size)
    num_tokens = math.prod(leading)
    if num_tokens == 0:
        empty = jnp.zeros(0, jnp.float32)
        nll = None if labels is None else empty
        return _reduce(empty, empty, nll, weights, invalid, leading, reduction)
    if chunk_size is None:
        # Twice the cross-entropy's chunk: the largest temporary here is the
        # dw accumulator, so a chunk of [C, V] arrays twice as long costs
        # little memory, and the dw matmul contracts over twice the tokens.
        chunk_size = fused.default_chunk_size(max(1, vocab_size // 2))
    plan = _Plan(
        divergence=_effective(divergence, float(beta)),
        beta=float(beta),
        temperature=float(temperature),
        hard_weight=float(hard_weight),
        has_labels=labels is not None,
        teacher_is_logits=teacher_is_logits,
        chunk_size=min(int(chunk_size), num_tokens),
        precision=precision,
        grads_in_forward=reduction != "none",
        scale=None if scale is None else float(scale),
        softcap=None if softcap is None else float(softcap),
    )
    dtype = jnp.result_type(h, w)
    if teacher_is_logits:
        teacher = (jnp.reshape(teacher[0], (num_tokens, vocab_size)),)
    else:  # w_t keeps its [V, D_t]
        teacher = (jnp.reshape(teacher[0], (num_tokens, -1)), jnp.asarray(teacher[1]))
    objective, terms = _fused_core(
        plan,
        reduction,
        jnp.reshape(h, (num_tokens, d_model)).astype(dtype),
        jnp.asarray(w, dtype),
        None if bias is None else jnp.asarray(bias),
        tuple(lax.stop_gradient(x) for x in teacher),
        safe_labels,
        weights,
    )
    token_loss, div, nll = (lax.stop_gradient(x) for x in terms)
    _, metrics = _reduce(
        token_loss,
        div,
        nll if plan.has_labels else None,
        weights,
        invalid,
        leading,
        reduction,
    )
    if reduction == "none":
        return jnp.reshape(objective, leading), metrics
    return objective, metrics
