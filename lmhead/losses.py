"""Training losses and evaluation metrics on logits, as pure functions.

The cross-entropy is written in terms of three per-token statistics of the
logits ``z`` -- the log-normalizer ``lse = logsumexp(z)``, the label's logit
``z_y`` and the sum ``sum_i z_i`` -- because every option below (both label
smoothing conventions, z-loss) is a function of them. The fused loss in
:mod:`lmhead.fused` computes the same statistics a block at a time and reuses
:func:`token_losses` and :func:`weighted_metrics`, so the two paths cannot
drift apart. The conversions of a mean loss (perplexity, bits) and the
calibration metrics are :mod:`lmhead.metrics`'s.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.scipy.special import xlogy

from lmhead import _checks

SMOOTHINGS = ("uniform", "normalized")
REDUCTIONS = ("mean", "sum", "none")
# The label of a token that is ignored (weight 0), as PyTorch's and Hugging
# Face's ignore_index: valid_weights is its one rule.
IGNORE_INDEX = -100


def check_loss_options(
    label_smoothing: float, smoothing: str, z_loss: float, reduction: str
) -> None:
    """Validates the options shared by the materialized and fused losses.

    ``label_smoothing`` and ``z_loss`` are range-checked when concrete; a
    traced value (one per ensemble member, say) is not, as its range cannot
    be known when tracing (``_checks.check_in_range``): its caller checks it.

    Raises:
        ValueError: naming the argument, when an option is out of range.
    """
    _checks.check_in_range(
        "label_smoothing", label_smoothing, low=0.0, high=1.0, high_open=True
    )
    _checks.check_choice("smoothing", smoothing, SMOOTHINGS)
    _checks.check_in_range("z_loss", z_loss, low=0.0)
    _checks.check_choice("reduction", reduction, REDUCTIONS)


def check_labels_and_weights(
    labels: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike | None,
    leading_shape: tuple[int, ...],
) -> None:
    """Validates dtypes and shapes, and the weights when they are concrete.

    The labels' values follow :func:`valid_weights`.

    Raises:
        TypeError: for non-integer labels.
        ValueError: for shapes that do not match ``leading_shape``, and for
            concrete weights that are negative or not finite.
    """
    _checks.check_integer("labels", labels)
    if jnp.shape(labels) != tuple(leading_shape):
        raise ValueError(
            f"labels must have the leading shape of the logits / hidden states "
            f"{tuple(leading_shape)}; got {jnp.shape(labels)}."
        )
    if weights is not None and jnp.shape(weights) != tuple(leading_shape):
        raise ValueError(
            f"weights must have the shape of labels {tuple(leading_shape)}; "
            f"got {jnp.shape(weights)}."
        )
    if weights is not None and not _checks.is_traced(weights):
        bad_weights = ~(np.asarray(weights) >= 0) | ~np.isfinite(weights)
        if np.any(bad_weights):
            raise ValueError(
                "weights must be finite and >= 0 (0 for padding); got "
                f"{np.asarray(weights)[bad_weights].ravel()[0]}."
            )


def check_labels(
    labels: jax.typing.ArrayLike, vocab_size: int, ignore_index: int = IGNORE_INDEX
) -> None:
    """A ``checkify`` check that every label lies in ``[0, vocab_size)`` or
    equals ``ignore_index``.

    Inside ``jit`` the losses give an out-of-range label weight 0 (and count
    it in ``metrics["invalid_labels"]``; :func:`valid_weights`). Call this
    in a function transformed by ``checkify.checkify`` to get an error
    instead.

    Args:
        labels: integer array of any shape.
        vocab_size: ``V``.
        ignore_index: the label of an ignored token, allowed.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from jax.experimental import checkify
        >>> f = checkify.checkify(jax.jit(lambda y: check_labels(y, 4)))
        >>> err, _ = f(jnp.array([0, 5, -100]))
        >>> print(err.get())
        labels must be in [0, 4) or equal ignore_index=-100; found 1 outside (`check` failed)
    """
    labels = jnp.asarray(labels)
    bad = (labels < 0) | (labels >= vocab_size)
    bad = bad & (labels != ignore_index)
    checkify.check(
        ~jnp.any(bad),
        f"labels must be in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
        "found {n} outside",
        n=jnp.sum(bad),
    )


def token_losses(
    lse: jax.Array,
    label_logit: jax.Array,
    logit_sum: jax.Array,
    vocab_size: int,
    *,
    label_smoothing: float = 0.0,
    smoothing: str = "uniform",
    z_loss: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""Per-token losses from the statistics of each token's logits.

    With :math:`\ell = \mathrm{lse}(z)`, :math:`\mathrm{nll} = \ell - z_y`,
    and :math:`S = V\ell - \sum_i z_i = \sum_i -\log p_i`:

    - ``"uniform"`` (PyTorch ``label_smoothing``): target
      :math:`(1-\epsilon)\,\mathrm{onehot} + \epsilon / V`, so
      :math:`L = (1-\epsilon)\,\mathrm{nll} + \tfrac{\epsilon}{V} S`.
    - ``"normalized"`` (Flax WMT, T5X): :math:`c = 1-\epsilon` on the label,
      :math:`u = \epsilon/(V-1)` elsewhere, minus the target's entropy so that
      the minimum is 0:
      :math:`L = c\,\mathrm{nll} + u\,(S - \mathrm{nll}) + c\log c + (V-1)\,u\log u`.
    - z-loss: :math:`+\, \lambda_z \ell^2`.

    Infinite statistics follow the limit of these formulas: a label logit of
    ``-inf`` (probability 0, including a row of ``-inf``) gives ``nll = +inf``,
    and so does a smoothed target that puts mass on a token of logit
    ``-inf``; a term whose coefficient is 0 is 0. A ``+inf`` or NaN logit (an
    overflow upstream) gives a loss that is not finite.

    Args:
        lse, label_logit, logit_sum: ``[...]`` float32 statistics.
        vocab_size: ``V``.
        label_smoothing: :math:`\epsilon \in [0, 1)`.
        smoothing: ``"uniform"`` or ``"normalized"``.
        z_loss: :math:`\lambda_z \ge 0`.

    Returns:
        ``(loss, nll, z_term)``, each ``[...]``: the objective per token, the
        unsmoothed negative log-likelihood, and the z-loss term.

    Examples:
        >>> import jax.numpy as jnp
        >>> z = jnp.array([2.0, 0.0, 0.0])
        >>> lse = jax.nn.logsumexp(z)
        >>> loss, nll, _ = token_losses(lse, z[0], z.sum(), 3)
        >>> round(float(loss), 4), round(float(nll), 4)
        (0.2395, 0.2395)
    """
    # A label whose logit is -inf has probability 0, so nll = +inf; also
    # where the whole row is -inf, and lse - z_y would be -inf - (-inf).
    nll = jnp.where(label_logit == -jnp.inf, jnp.inf, lse - label_logit)
    # S is +inf as soon as one logit is -inf (one p_i = 0).
    total = jnp.where(logit_sum == -jnp.inf, jnp.inf, vocab_size * lse - logit_sum)
    eps = label_smoothing
    if smoothing == "uniform":
        loss = (1.0 - eps) * nll + _times_or_zero(eps / vocab_size, total)
    else:
        confidence = 1.0 - eps
        low = eps / max(vocab_size - 1, 1)
        # The target's entropy, with 0 log 0 = 0 (xlogy), is what makes the
        # minimum 0: it is the loss at the smoothed target itself.
        entropy = -(xlogy(confidence, confidence) + (vocab_size - 1) * xlogy(low, low))
        rest = jnp.where(total == jnp.inf, jnp.inf, total - nll)
        loss = confidence * nll + _times_or_zero(low, rest) - entropy
    z_term = _times_or_zero(z_loss, jnp.square(lse))
    return loss + z_term, nll, z_term


def _times_or_zero(coefficient: float, term: jax.Array) -> jax.Array:
    # A coefficient of 0 switches its term off even where the term is
    # infinite, where the product would be 0 * inf = NaN.
    return jnp.where(coefficient == 0, 0.0, coefficient * term)


def weighted_values(values: jax.Array, weights: jax.Array) -> jax.Array:
    r"""``weights * values``, and exactly 0 where a weight is 0.

    .. math::
        y_t = w_t x_t \ (w_t \neq 0), \qquad y_t = 0 \ (w_t = 0),

    even where :math:`x_t` is not finite (e.g. the logits of a padding id
    outside the embedding, or a padded token's teacher). A finite value is
    kept as it is, so :math:`\partial (w x) / \partial w = x` holds at
    :math:`w = 0` too. The rule of every weighted mean and sum of the losses.

    Args:
        values: ``[...]`` per-token values.
        weights: ``[...]`` per-token weights, the same shape.

    Returns:
        ``[...]`` the weighted values.

    Examples:
        >>> import jax.numpy as jnp
        >>> weighted_values(jnp.array([2.0, jnp.inf, 3.0]), jnp.array([0.5, 0.0, 0.0]))
        Array([1., 0., 0.], dtype=float32)
    """
    return weights * jnp.where(jnp.isfinite(values) | (weights != 0), values, 0.0)


def weighted_metrics(
    loss: jax.Array,
    nll: jax.Array,
    z_term: jax.Array,
    correct: jax.Array,
    weights: jax.Array,
    invalid: jax.Array,
    reduction: str,
    groups: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Reduces per-token losses and builds the metrics dict.

    A weighted mean is :math:`\sum_t w_t x_t / \sum_t w_t`, and 0 when
    :math:`\sum_t w_t = 0` (so an all-padding batch gives 0, not NaN). A
    token of weight 0 contributes 0 even when its value is NaN or infinite.

    Args:
        loss, nll, z_term: ``[...]`` per-token values (see :func:`token_losses`).
        correct: ``[...]`` 1.0 where the argmax is the label.
        weights: ``[...]`` float32 weights, already 0 for invalid labels.
        invalid: ``[...]`` bool, labels outside ``[0, V)`` with nonzero weight.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-token ``w * loss``).
        groups: None, or ``G``: the tokens, in order, are ``G`` groups of
            equal size (the leading axis of ``labels``, e.g. the depths of
            multi-token prediction stacked), and every metric is ``[G]``, one
            per group. The reduced loss is over every token either way.

    Returns:
        ``(reduced_loss, metrics)``; ``metrics`` holds the weighted means
        ``loss``, ``nll``, ``z_loss``, ``accuracy``, and the counts
        ``weight_sum`` and ``invalid_labels``.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([1.0, 3.0])
        >>> w = jnp.array([1.0, 0.0])
        >>> loss, m = weighted_metrics(x, x, 0 * x, x > 2, w, x < 0, "mean")
        >>> float(loss), float(m["weight_sum"]), float(m["accuracy"])
        (1.0, 1.0, 0.0)
        >>> _, m = weighted_metrics(x, x, 0 * x, x > 2, 0 * x + 1, x < 0, "sum",
        ...                         groups=2)
        >>> m["accuracy"], m["weight_sum"]
        (Array([0., 1.], dtype=float32), Array([1., 1.], dtype=float32))
    """
    weighted_loss = weighted_values(loss, weights)
    if reduction == "none":
        reduced = weighted_loss
    elif reduction == "sum":
        reduced = jnp.sum(weighted_loss)
    axis = None
    if groups is not None:
        loss, nll, z_term, correct, weights, invalid = (
            jnp.reshape(x, (groups, -1))
            for x in (loss, nll, z_term, correct, weights, invalid)
        )
        axis = -1
    weight_sum = jnp.sum(weights, axis=axis)
    safe_sum = jnp.where(weight_sum > 0, weight_sum, 1.0)

    def mean(x):
        return jnp.sum(weighted_values(x, weights), axis=axis) / safe_sum

    metrics = {
        "loss": mean(loss),
        "nll": mean(nll),
        "z_loss": mean(z_term),
        "accuracy": mean(correct.astype(jnp.float32)),
        "weight_sum": weight_sum,
        "invalid_labels": jnp.sum(invalid, axis=axis).astype(jnp.int32),
    }
    if reduction != "mean":
        return reduced, metrics
    if groups is None:
        return metrics["loss"], metrics
    total = jnp.sum(weight_sum)
    return jnp.sum(weighted_loss) / jnp.where(total > 0, total, 1.0), metrics


def valid_weights(
    labels: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike | None,
    vocab_size: int,
    ignore_index: int = IGNORE_INDEX,
    *,
    name: str = "labels",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The one rule for labels: float32 weights, clipped labels, invalid ones.

    A token whose label equals ``ignore_index`` (``-100`` by default, as
    PyTorch's and Hugging Face's) is ignored: its weight is 0, so it adds
    nothing to a loss, a mean's denominator or a gradient, eagerly and
    under ``jit`` alike. Any other label outside ``[0, V)`` whose weight is
    not 0 is invalid: ``ValueError`` naming ``name`` when the labels and
    weights are concrete; inside ``jit`` weight 0 too, counted in
    ``invalid`` (the losses' ``metrics["invalid_labels"]``; use
    :func:`check_labels` under ``checkify`` to fail instead).

    Args:
        labels: ``[...]`` integers, or ``[..., k]`` for ``k`` ids per token
            (with ``weights`` given), a token ignored when all its ids equal
            ``ignore_index``.
        weights: ``[...]`` per-token weights, or None for 1.
        vocab_size: ``V``.
        ignore_index: an integer.
        name: the labels' argument, for the error.

    Returns:
        ``(weights, safe_labels, invalid)``: ``weights`` 0 for ignored and
        invalid tokens, ``safe_labels`` clipped into range so that gathers
        stay in bounds, ``invalid [...]`` bool.

    Raises:
        ValueError: for concrete invalid labels, naming ``name``.
        TypeError: for an ``ignore_index`` that is not an integer.

    Examples:
        >>> import jax.numpy as jnp
        >>> valid_weights(jnp.array([1, -100, 2]), None, 4)[0]
        Array([1., 0., 1.], dtype=float32)
        >>> w, y, bad = jax.jit(valid_weights, static_argnums=2)(
        ...     jnp.array([1, 7]), None, 4)
        >>> w, y, bad
        (Array([1., 0.], dtype=float32), Array([1, 3], dtype=int32), Array([False,  True], dtype=bool))
        >>> valid_weights(jnp.array([1, 7]), None, 4)
        Traceback (most recent call last):
        ...
        ValueError: labels must be in [0, 4) or equal ignore_index=-100 wherever weights are nonzero; got 7. (Inside jit such labels give their token weight 0; see losses.valid_weights.)
    """
    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(
        ignore_index, (int, np.integer)
    ):
        raise TypeError(f"ignore_index must be an integer; got {ignore_index!r}.")
    labels = jnp.asarray(labels)
    w = (
        jnp.ones(labels.shape, jnp.float32)
        if weights is None
        else jnp.asarray(weights, jnp.float32)
    )
    per_id = labels.ndim > w.ndim  # [..., k] ids per token

    def per_token(x, reduce):
        return reduce(x, axis=-1) if per_id else x

    ignored = per_token(labels == ignore_index, jnp.all)
    out_of_range = per_token((labels < 0) | (labels >= vocab_size), jnp.any)
    out_of_range = out_of_range & ~ignored
    _checks.check_ids_in_range(
        name,
        labels,
        w,
        vocab_size,
        ignore_index=ignore_index,
        note=f" (Inside jit such {name} give their token weight 0; see "
        "losses.valid_weights.)",
    )
    return (
        jnp.where(ignored | out_of_range, 0.0, w),
        jnp.clip(labels, 0, vocab_size - 1),
        out_of_range & (w != 0),
    )


def depth_targets(
    labels: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike | None,
    depths: tuple[int, ...],
    scales: jax.typing.ArrayLike,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[jax.Array, jax.Array]:
    r"""The labels and weights of prediction depths, stacked for one loss.

    Depth :math:`d` (multi-token prediction: 0 is the next token) predicts,
    at position :math:`t`, the label :math:`y_{t+d}`; where :math:`t + d
    \ge T` there is none (label ``ignore_index``, weight 0). Each depth's
    weights are scaled by :math:`a_d / W_d`, :math:`W_d` the sum of its
    weights whose labels are not ``ignore_index`` (a depth of none gets
    weights 0), so that the sum-reduced loss of the stack is the weighted
    sum of the depths' means:

    .. math::
        \sum_d \sum_t \frac{a_d\, w_{t+d}}{W_d} \ell_{d,t}
        = \sum_d a_d \, \frac{\sum_t w_{t+d}\, \ell_{d,t}}{W_d}.

    Args:
        labels: ``int [..., T]`` targets of depth 0.
        weights: ``[..., T]`` or None (1).
        depths: the ``G`` depths, integers ``>= 0``.
        scales: ``[G]`` the factors :math:`a_d` (floats, traced ones too).
        ignore_index: the label of an ignored token.

    Returns:
        ``(labels int32 [G, ..., T], weights float32 [G, ..., T])``.

    Examples:
        >>> labels, weights = depth_targets(jnp.array([5, 6, 7]), None, (0, 1),
        ...                                 jnp.array([1.0, 0.5]))
        >>> labels
        Array([[   5,    6,    7],
               [   6,    7, -100]], dtype=int32)
        >>> weights
        Array([[0.33333334, 0.33333334, 0.33333334],
               [0.25      , 0.25      , 0.        ]], dtype=float32)
    """
    _checks.check_integer("labels", labels)
    labels = jnp.asarray(labels, jnp.int32)
    if labels.ndim < 1:
        raise ValueError("labels must have a position axis [..., T]; got a scalar.")
    time = labels.shape[-1]
    weights = (
        jnp.ones(labels.shape, jnp.float32)
        if weights is None
        else jnp.asarray(weights, jnp.float32)
    )
    if weights.shape != labels.shape:
        raise ValueError(
            f"weights must have the shape of labels {labels.shape}; got {weights.shape}."
        )
    scales = jnp.asarray(scales, jnp.float32)
    if scales.shape != (len(depths),):
        raise ValueError(
            f"scales must have one value per depth, shape ({len(depths)},); got "
            f"{scales.shape}."
        )
    stacked_labels, stacked_weights = [], []
    for g, depth in enumerate(depths):
        _checks.check_in_range(f"depths[{g}]", depth, low=0)
        shift = min(depth, time)
        pad = [(0, 0)] * (labels.ndim - 1) + [(0, shift)]
        shifted = jnp.pad(labels[..., shift:], pad, constant_values=ignore_index)
        kept = jnp.pad(weights[..., shift:], pad)
        kept = jnp.where(shifted == ignore_index, 0.0, kept)
        total = jnp.sum(kept)
        stacked_labels.append(shifted)
        stacked_weights.append(kept * scales[g] / jnp.where(total > 0, total, 1.0))
    return jnp.stack(stacked_labels), jnp.stack(stacked_weights)


def cross_entropy(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    *,
    weights: jax.typing.ArrayLike | None = None,
    label_smoothing: float = 0.0,
    smoothing: str = "uniform",
    z_loss: float = 0.0,
    reduction: str = "mean",
    ignore_index: int = IGNORE_INDEX,
    grouped_metrics: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Weighted softmax cross-entropy with label smoothing and z-loss.

    .. math::
        L = \frac{\sum_t w_t \big(\mathrm{CE}_\epsilon(z_t, y_t)
            + \lambda_z \,\mathrm{lse}(z_t)^2\big)}{\sum_t w_t}

    where :math:`\mathrm{CE}_\epsilon` is defined in :func:`token_losses` for
    both smoothing conventions. The log-normalizer is computed in float32
    whatever the dtype of ``logits``, with the maximum subtracted, so logits
    of :math:`\pm 10^4` and bf16 logits give finite losses and gradients.

    A label whose logit is ``-inf`` has probability 0 (as in
    :func:`lmhead.head.log_probs`), so its loss and nll are ``+inf``; this
    holds for a row whose logits are all ``-inf`` too, which is never
    correct and whose gradient is 0. A token of weight 0 contributes 0 to
    the loss and its gradient whatever its logits.

    A label equal to ``ignore_index`` (``-100``, as in PyTorch and Hugging
    Face) gives its token weight 0, eagerly and inside ``jit``: the mean is
    over the other tokens. Other labels outside ``[0, V)`` raise
    ``ValueError`` when they are concrete; inside ``jit`` they get weight 0
    and are counted in ``metrics["invalid_labels"]`` (use
    :func:`check_labels` with ``checkify`` to fail instead). The rule is
    :func:`valid_weights`'.

    ``label_smoothing`` and ``z_loss`` may be traced scalars, e.g. one value
    per ensemble member under ``jax.vmap`` or ``lax.map``; a traced value is
    not range-checked (see :func:`check_loss_options`).

    Args:
        logits: ``[..., V]`` floating-point scores.
        labels: ``[...]`` integer targets.
        weights: optional ``[...]`` per-token weights (0 for padding).
        label_smoothing: :math:`\epsilon \in [0, 1)`.
        smoothing: ``"uniform"`` (PyTorch) or ``"normalized"`` (T5X).
        z_loss: :math:`\lambda_z \ge 0` (PaLM uses ``1e-4``).
        reduction: ``"mean"`` (over the weights), ``"sum"``, or ``"none"``
            (``[...]`` weighted per-token losses).
        ignore_index: the label of an ignored token, an integer.
        grouped_metrics: False (default), or True for metrics per index of
            the leading axis of ``labels`` (each ``[G]``, e.g. one per
            depth of multi-token prediction; :func:`weighted_metrics`'
            ``groups``); the loss is reduced over every token either way.

    Returns:
        ``(loss, metrics)``: see :func:`weighted_metrics` for the metrics.

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
        >>> loss, m = cross_entropy(logits, jnp.array([0, 2]))
        >>> round(float(loss), 4), float(m["accuracy"])
        (1.6672, 0.5)
        >>> loss, m = cross_entropy(logits, jnp.array([0, -100]))
        >>> round(float(loss), 4), float(m["weight_sum"])
        (0.2395, 1.0)

    References:
        Szegedy et al., `Rethinking the Inception Architecture
        <https://arxiv.org/abs/1512.00567>`_, 2016 (label smoothing);
        Chowdhery et al., `PaLM <https://arxiv.org/abs/2204.02311>`_, 2022
        (z-loss).
    """
    _checks.check_logits(logits)
    check_loss_options(label_smoothing, smoothing, z_loss, reduction)
    vocab_size = jnp.shape(logits)[-1]
    check_labels_and_weights(labels, weights, jnp.shape(logits)[:-1])
    chex.assert_rank(logits, jnp.ndim(labels) + 1)

    logits = jnp.asarray(logits, jnp.float32)
    weights, safe_labels, invalid = valid_weights(
        labels, weights, vocab_size, ignore_index
    )
    # A row of -inf (every token masked) is computed on zeros, which keeps
    # NaN out of the gradients, and then given the rule's values.
    empty = jnp.max(logits, axis=-1) == -jnp.inf
    logits = jnp.where(empty[..., None], 0.0, logits)
    lse = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.take_along_axis(logits, safe_labels[..., None], -1)[..., 0]
    loss, nll, z_term = token_losses(
        lse,
        label_logit,
        jnp.sum(logits, axis=-1),
        vocab_size,
        label_smoothing=label_smoothing,
        smoothing=smoothing,
        z_loss=z_loss,
    )
    loss, nll = (jnp.where(empty, jnp.inf, x) for x in (loss, nll))
    z_term = jnp.where(empty, _times_or_zero(z_loss, jnp.inf), z_term)
    correct = (jnp.argmax(logits, axis=-1) == safe_labels) & ~empty
    return weighted_metrics(
        loss,
        nll,
        z_term,
        correct,
        weights,
        invalid,
        reduction,
        metric_groups(grouped_metrics, jnp.shape(labels)),
    )


def metric_groups(grouped_metrics: bool, leading_shape: tuple[int, ...]) -> int | None:
    """:func:`weighted_metrics`' ``groups`` for a loss's ``grouped_metrics``:
    the size of the labels' leading axis, or None.

    Examples:
        >>> metric_groups(True, (3, 2, 5)), metric_groups(False, (3, 2, 5))
        (3, None)
    """
    if not isinstance(grouped_metrics, (bool, np.bool_)):
        raise TypeError(
            f"grouped_metrics must be True or False; got {grouped_metrics!r}."
        )
    if not grouped_metrics:
        return None
    if not leading_shape:
        raise ValueError(
            "grouped_metrics needs labels with a leading axis of groups; got "
            "scalar labels."
        )
    return leading_shape[0]
