r"""Distillation from a sparse teacher: its top-k ids and their log-probs.

The student's log-probs of the teacher's ``k`` ids come from one
:func:`lmhead.token_logprobs.fused_token_logprobs` sweep; the forward KL on
the teacher's support is plain JAX on those ``[N, k]`` values
(docs/post_training.md, "A sparse teacher").
"""

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks, losses, token_logprobs

REDUCTIONS = ("mean", "sum", "none")


def _check_teacher(teacher_logps, student_shape):
    _checks.check_floating("teacher_logps", teacher_logps)
    if jnp.shape(teacher_logps) != tuple(student_shape):
        raise ValueError(
            f"teacher_logps must have the shape of the ids [..., k] = "
            f"{tuple(student_shape)}; got {jnp.shape(teacher_logps)}."
        )
    if not _checks.is_traced(teacher_logps):
        x = np.asarray(teacher_logps, np.float64)
        if np.any(x > 0) or np.any(np.isnan(x)):
            raise ValueError(
                "teacher_logps must be log-probabilities, <= 0 (-inf for an id "
                f"of probability 0); got {x[(x > 0) | np.isnan(x)].ravel()[0]}."
            )


def sparse_distillation_loss(
    student_logps: jax.typing.ArrayLike,
    teacher_logps: jax.typing.ArrayLike,
    *,
    weights: jax.typing.ArrayLike | None = None,
    renormalize: bool = True,
    reduction: str = "mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Forward KL from a teacher's top-k to the student, on the teacher's support.

    With the teacher's probabilities :math:`p_j = e^{\ell_j}` of its ``k``
    ids and the student's :math:`q_j` of the same ids (its full softmax):

    .. math::
        \text{unrenormalized:}\ \sum_j p_j \log\frac{p_j}{q_j}, \qquad
        \text{renormalized:}\ \sum_j \hat p_j \log\frac{\hat p_j}{\hat q_j},
        \quad \hat p_j = \frac{p_j}{\sum_i p_i},\ \hat q_j = \frac{q_j}{\sum_i q_i}.

    The unrenormalized form drops the teacher's missing mass
    :math:`1 - \sum_j p_j`; the renormalized form is 0 when the student's
    probabilities are proportional to the teacher's on the support. An id of
    teacher log-prob ``-inf`` adds 0.

    Args:
        student_logps: ``[..., k]`` the student's log-probs of the ids.
        teacher_logps: ``[..., k]`` the teacher's, ``<= 0`` (no gradient).
        weights: optional ``[...]`` per-token weights (0 for padding).
        renormalize: True (default) for the renormalized form.
        reduction: ``"mean"`` (weighted mean), ``"sum"`` or ``"none"``.

    Returns:
        ``(loss, metrics)``: ``metrics`` has the weighted means of ``kl``,
        ``teacher_mass`` (:math:`\sum_j p_j`) and ``student_mass``
        (:math:`\sum_j q_j`), and ``weight_sum``.

    Examples:
        Teacher ``(1/2, 3/10)``, student ``(1/4, 1/4)``:
        :math:`\frac12\log 2 + \frac3{10}\log\frac65` and
        :math:`\frac58\log\frac54 + \frac38\log\frac34`.

        >>> import jax.numpy as jnp
        >>> q, p = jnp.log(jnp.array([0.25, 0.25])), jnp.log(jnp.array([0.5, 0.3]))
        >>> for renormalize in (False, True):
        ...     loss, _ = sparse_distillation_loss(q, p, renormalize=renormalize)
        ...     print(f"{loss:.5f}")
        0.40127
        0.03158

    References:
        Hinton et al., `Distilling the Knowledge in a Neural Network
        <https://arxiv.org/abs/1503.02531>`_, 2015; Agarwal et al.,
        `On-Policy Distillation of Language Models
        <https://arxiv.org/abs/2306.13649>`_, 2024.
    """
    _checks.check_floating("student_logps", student_logps)
    _checks.check_rank("student_logps", student_logps, set(range(1, 64)), "[..., k]")
    _check_teacher(teacher_logps, jnp.shape(student_logps))
    _checks.check_choice("reduction", reduction, REDUCTIONS)
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be True or False; got {renormalize!r}.")
    leading = jnp.shape(student_logps)[:-1]
    if weights is not None and jnp.shape(weights) != leading:
        raise ValueError(
            f"weights must have shape [...] = {leading}; got {jnp.shape(weights)}."
        )
    log_q = jnp.asarray(student_logps, jnp.float32)
    log_p = jax.lax.stop_gradient(jnp.asarray(teacher_logps, jnp.float32))
    weights = (
        jnp.ones(leading, jnp.float32)
        if weights is None
        else jnp.asarray(weights, jnp.float32)
    )
    live = weights != 0
    teacher_mass = jnp.sum(jnp.exp(log_p), -1)
    student_mass = jnp.sum(jnp.exp(log_q), -1)
    if renormalize:
        log_p = log_p - jnp.log(teacher_mass)[..., None]
        log_q = log_q - jax.nn.logsumexp(log_q, -1, keepdims=True)
    p = jnp.exp(log_p)
    # 0 where p is 0 (an id of teacher log-prob -inf), not 0 * -inf.
    token_kl = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), -1)
    token_kl = jnp.where(live, token_kl, 0.0)
    weight_sum = jnp.sum(weights)
    denominator = jnp.where(weight_sum > 0, weight_sum, 1.0)
    mean = lambda x: jnp.sum(jnp.where(live, weights * x, 0.0)) / denominator  # noqa: E731
    metrics = {
        "kl": mean(token_kl),
        "teacher_mass": mean(teacher_mass),
        "student_mass": mean(student_mass),
        "weight_sum": weight_sum,
    }
    if reduction == "none":
        return token_kl, metrics
    total = jnp.sum(weights * token_kl)
    return (total if reduction == "sum" else total / denominator), metrics


def fused_sparse_distillation_loss(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    teacher_ids: jax.typing.ArrayLike,
    teacher_logps: jax.typing.ArrayLike,
    *,
    bias: jax.typing.ArrayLike | None = None,
    weights: jax.typing.ArrayLike | None = None,
    renormalize: bool = True,
    reduction: str = "mean",
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
    r""":func:`sparse_distillation_loss` of the head ``softcap(scale * h @ w.T
    + bias) / T``, fused.

    The gradient w.r.t. ``h``, ``w`` and ``bias`` is exact, and neither
    ``[N, V]`` logits nor a dense teacher exist. The student's temperature
    ``T`` applies here; the teacher's log-probs are taken as given.

    Args:
        h: ``[..., D]``. w: ``[V, D]``. bias: optional ``[V]``.
        teacher_ids: ``[..., k]`` integer ids in ``[0, V)``. A token whose
            ids all equal ``ignore_index`` (``-100`` by default) is left
            out (weight 0); any other id outside ``[0, V)`` where
            ``weights`` is nonzero is an error when concrete, and leaves its
            token out inside ``jit`` (``losses.valid_weights``).
        teacher_logps: ``[..., k]`` their log-probs, ``<= 0``.
        weights, renormalize, reduction: as in :func:`sparse_distillation_loss`.
        temperature, scale, softcap, chunk_size, vocab_chunk_size,
            filter_eps, filter_target, dw_accumulation, vocab_order,
            ignore_index: as in
            :func:`lmhead.token_logprobs.fused_token_logprobs`.

    Returns:
        ``(loss, metrics)`` as :func:`sparse_distillation_loss`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> h = jax.random.normal(jax.random.key(0), (2, 3, 4))
        >>> w = jax.random.normal(jax.random.key(1), (10, 4))
        >>> log_q = jax.nn.log_softmax(h @ w.T)
        >>> top = jax.lax.top_k(log_q, 3)  # the student as its own teacher
        >>> loss, metrics = fused_sparse_distillation_loss(
        ...     h, w, top[1], top[0], chunk_size=4)
        >>> print(f"{loss:.5f}")
        0.00000

    References:
        As :func:`sparse_distillation_loss`.
    """
    _checks.check_integer("teacher_ids", teacher_ids)
    ids_shape = jnp.shape(teacher_ids)
    if ids_shape[:-1] != jnp.shape(h)[:-1] or len(ids_shape) != jnp.ndim(h):
        raise ValueError(
            f"teacher_ids must have shape [..., k] with [...] = {jnp.shape(h)[:-1]};"
            f" got {ids_shape}."
        )
    _check_teacher(teacher_logps, ids_shape)
    _checks.check_unembed_inputs(h, w, bias)
    if weights is not None and jnp.shape(weights) != ids_shape[:-1]:
        raise ValueError(
            f"weights must have shape [...] = {ids_shape[:-1]}; "
            f"got {jnp.shape(weights)}."
        )
    # Ignored (and, inside jit, invalid) tokens get weight 0, in the KL too.
    weights, _, _ = losses.valid_weights(
        teacher_ids,
        jnp.ones(ids_shape[:-1]) if weights is None else weights,
        jnp.shape(w)[0],
        ignore_index,
        name="teacher_ids",
    )
    student = token_logprobs.fused_token_logprobs(
        h,
        w,
        teacher_ids,
        bias=bias,
        weights=weights,
        temperature=temperature,
        scale=scale,
        softcap=softcap,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        filter_eps=filter_eps,
        filter_target=filter_target,
        dw_accumulation=dw_accumulation,
        vocab_order=vocab_order,
        ignore_index=ignore_index,
    )
    return sparse_distillation_loss(
        student.logprobs,
        teacher_logps,
        weights=weights,
        renormalize=renormalize,
        reduction=reduction,
    )
