"""Evaluation metrics of a model's predictions, as pure functions: the
conversions of a mean loss (perplexity, bits per token and per character)
and calibration (expected calibration error, from bins that add across
batches and devices). They take labels and weights under
:mod:`lmhead.losses`'s checks and weighting rule.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks, head
from lmhead.losses import IGNORE_INDEX, check_labels_and_weights, valid_weights


def perplexity(nll: jax.typing.ArrayLike) -> jax.Array:
    r"""Perplexity from a mean negative log-likelihood in nats.

    .. math:: \mathrm{ppl} = e^{\mathrm{nll}}

    Examples:
        >>> perplexity(jnp.log(4.0))
        Array(4., dtype=float32, weak_type=True)
    """
    return jnp.exp(nll)


def bits_per_token(nll: jax.typing.ArrayLike) -> jax.Array:
    r"""Nats per token to bits per token: :math:`\mathrm{nll} / \ln 2`.

    Examples:
        >>> bits_per_token(jnp.log(8.0))
        Array(3., dtype=float32, weak_type=True)
    """
    return jnp.asarray(nll) / math.log(2.0)


def bits_per_character(nll: jax.typing.ArrayLike, chars_per_token: float) -> jax.Array:
    r"""Nats per token to bits per character of the underlying text.

    .. math::
        \mathrm{bpc} = \frac{\mathrm{nll}}{\ln 2 \cdot \mathrm{chars/token}}

    For a character-level tokenizer ``chars_per_token`` is 1; for BPE it is
    the number of characters of the evaluated text over its number of tokens.

    Examples:
        >>> bits_per_character(jnp.log(8.0), chars_per_token=3.0)
        Array(1., dtype=float32, weak_type=True)
    """
    _checks.check_in_range(
        "chars_per_token",
        chars_per_token,
        low=0.0,
        low_open=True,
        high=math.inf,
        high_open=True,
    )
    return bits_per_token(nll) / chars_per_token


def calibration_bins(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike | None = None,
    num_bins: int = 15,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> jax.Array:
    r"""Per-bin sums for the calibration error, to accumulate over batches.

    A token whose top probability is :math:`c` falls in bin
    :math:`\lceil c \cdot M \rceil - 1` (equal-width bins ``(m/M, (m+1)/M]``).

    Args:
        logits: ``[..., V]``.
        labels: ``[...]`` integers.
        weights: optional ``[...]``.
        num_bins: ``M >= 1``.
        ignore_index: a label whose token is left out; labels follow
            :func:`~lmhead.losses.valid_weights`' rule.

    Returns:
        ``[M, 3]`` float32: per bin the weight, the weighted sum of
        confidences and the weighted number of correct tokens. Add the
        results of several batches and pass the sum to
        :func:`calibration_error_from_bins`.

    Examples:
        >>> import jax.numpy as jnp
        >>> calibration_bins(jnp.zeros((1, 2)), jnp.array([0]), num_bins=2)
        Array([[1. , 0.5, 1. ],
               [0. , 0. , 0. ]], dtype=float32)
    """
    _checks.check_logits(logits)
    _checks.check_count("num_bins", num_bins)
    vocab_size = jnp.shape(logits)[-1]
    check_labels_and_weights(labels, weights, jnp.shape(logits)[:-1])
    weights, safe_labels, _ = valid_weights(labels, weights, vocab_size, ignore_index)
    p = head.probs(logits)
    confidence = jnp.max(p, axis=-1)
    # A row of -inf logits has no distribution: confidence 0, never correct.
    correct = ((jnp.argmax(p, axis=-1) == safe_labels) & (confidence > 0)).astype(
        jnp.float32
    )
    index = jnp.clip(
        jnp.ceil(confidence * num_bins).astype(jnp.int32) - 1, 0, num_bins - 1
    )
    rows = jnp.stack([weights, weights * confidence, weights * correct], -1)
    return jax.ops.segment_sum(
        rows.reshape(-1, 3), index.reshape(-1), num_segments=num_bins
    )


def calibration_error_from_bins(bins: jax.typing.ArrayLike) -> jax.Array:
    r"""Expected calibration error from (summed) :func:`calibration_bins`.

    .. math::
        \mathrm{ECE} = \sum_m \frac{W_m}{W}\,
            \left|\mathrm{acc}_m - \mathrm{conf}_m\right|
        = \frac{1}{W} \sum_m \left|C_m - K_m\right|

    with :math:`W_m` the weight, :math:`K_m` the confidence sum and
    :math:`C_m` the correct count of bin :math:`m`. 0 when :math:`W = 0`.
    ``bins``: ``[M, 3]``, ``>= 0`` (checked when concrete).

    Examples:
        >>> calibration_error_from_bins(jnp.array([[2.0, 1.0, 2.0]]))
        Array(0.5, dtype=float32)
    """
    _checks.check_rank("bins", bins, 2, "[M, 3]")
    if jnp.shape(bins)[1] != 3:
        raise ValueError(f"bins must have shape [M, 3]; got {jnp.shape(bins)}.")
    # NaN passes: it comes from non-finite logits, and is reported as NaN.
    if not _checks.is_traced(bins) and np.any(np.asarray(bins) < 0):
        raise ValueError(
            "bins must be sums of weights, confidences and "
            "correct counts, all >= 0; got a negative entry."
        )
    bins = jnp.asarray(bins, jnp.float32)
    total = jnp.sum(bins[:, 0])
    gap = jnp.sum(jnp.abs(bins[:, 2] - bins[:, 1]))
    return jnp.where(total > 0, gap / jnp.where(total > 0, total, 1.0), 0.0)


def expected_calibration_error(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike | None = None,
    num_bins: int = 15,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> jax.Array:
    r"""Expected calibration error of the top-1 prediction (Guo et al., 2017).

    .. math::
        \mathrm{ECE} = \sum_{m=1}^{M} \frac{W_m}{W}\,
            \left|\mathrm{acc}_m - \mathrm{conf}_m\right|

    over ``M`` equal-width confidence bins (see :func:`calibration_bins`).

    Args:
        logits: ``[..., V]``.
        labels: ``[...]`` integers.
        weights: optional ``[...]`` per-token weights.
        num_bins: ``M >= 1``.
        ignore_index: as in :func:`calibration_bins`.

    Returns:
        Scalar in ``[0, 1]``.

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.log(jnp.array([[0.9, 0.1], [0.6, 0.4]]))
        >>> expected_calibration_error(logits, jnp.array([0, 1]), num_bins=10)
        Array(0.35, dtype=float32)

    References:
        Guo et al., `On Calibration of Modern Neural Networks
        <https://arxiv.org/abs/1706.04599>`_, 2017.
    """
    return calibration_error_from_bins(
        calibration_bins(logits, labels, weights, num_bins, ignore_index=ignore_index)
    )
