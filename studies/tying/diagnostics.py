r"""What a trained head looks like: the tying study's diagnostics, as pure
functions of arrays (a run's tables, its training token counts, and the
logits of evaluation windows).

- **Row norms against frequency**: :func:`row_norms` of the embedding table
  and of the unembedding, against :func:`log_frequency` of each token in the
  training tokens (:func:`token_counts`), summarized by a Spearman rank
  correlation (:func:`rank_correlation`).
- **Alignment of an untied head**: :func:`row_cosines`, the cosine between
  each token's input row and its output row, and its frequency-weighted mean
  (:func:`weighted_mean` with the training counts as weights).
- **Logit scale**: per position, the standard deviation of the logits over
  the vocabulary and the largest logit (:func:`logit_statistics`), averaged
  over the evaluation positions.
- **Loss by frequency bucket**: the vocabulary cut into buckets of equal
  training-token mass (:func:`frequency_buckets`), and the mean negative
  log-likelihood of the evaluation tokens whose *target* falls in each
  bucket (:func:`bucket_losses`).

Buckets hold equal training-token mass (why: ``docs/tying_study/README.md``,
"Diagnostics of the trained heads").
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from lmhead import _checks, head

# A norm product below this counts as zero: the cosine of a zero row is 0.
_TINY = 1e-30


def token_counts(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """``int64 [V]``: how often each id occurs in ``tokens``.

    Args:
        tokens: ``int [N]`` token ids, each in ``[0, V)``.
        vocab_size: ``V >= 1``.

    Raises:
        ValueError: ``tokens`` is not a 1-D integer array, ``vocab_size`` is
            not a count, or an id lies outside ``[0, V)``.

    Examples:
        >>> token_counts(np.array([0, 2, 2, 3]), 5)
        array([1, 0, 2, 1, 0])
    """
    _checks.check_count("vocab_size", vocab_size)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"tokens must be an int array [N]; got {tokens.dtype} {tokens.shape}."
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"tokens must lie in [0, vocab_size={vocab_size}); got ids from "
            f"{tokens.min()} to {tokens.max()}."
        )
    return np.bincount(tokens, minlength=vocab_size).astype(np.int64)


def log_frequency(counts: jax.typing.ArrayLike) -> jax.Array:
    r"""``float32 [V]``: the add-one log frequency of each token,

    .. math::
        \log \frac{c_v + 1}{\sum_u c_u + V},

    finite for tokens the training text never holds (their ``c_v = 0``), and
    in the order of the counts, so a rank correlation with it is one with
    the counts.

    Args:
        counts: ``[V]`` non-negative token counts.

    Examples:
        >>> log_frequency(jnp.array([2, 0, 0]))
        Array([-0.5108256, -1.609438 , -1.609438 ], dtype=float32)
    """
    chex.assert_rank(counts, 1)
    counts = jnp.asarray(counts, jnp.float32)
    return jnp.log((counts + 1.0) / (jnp.sum(counts) + counts.shape[0]))


def row_norms(table: jax.typing.ArrayLike) -> jax.Array:
    r"""``float32 [V]``: :math:`\lVert w_v \rVert_2`, the norm of each row of a
    ``[V, D]`` table (an embedding table or an unembedding).

    Examples:
        >>> row_norms(jnp.array([[3.0, 4.0], [0.0, 1.0]]))
        Array([5., 1.], dtype=float32)
    """
    _checks.check_floating("table", table)
    chex.assert_rank(table, 2)
    return jnp.linalg.norm(jnp.asarray(table, jnp.float32), axis=-1)


def row_cosines(
    embedding: jax.typing.ArrayLike, unembedding: jax.typing.ArrayLike
) -> jax.Array:
    r"""``float32 [V]``: the cosine between each token's input row ``e_v`` and
    its output row ``u_v``,

    .. math::
        \cos_v = \frac{e_v \cdot u_v}{\lVert e_v \rVert \, \lVert u_v \rVert},

    with the rule that a zero row has cosine 0. A tied model's cosines are
    all 1; an untied head trained apart from its table shows how far the
    two drifted apart (and whether rare tokens drift more).

    Args:
        embedding: ``[V, D]`` the input embedding table.
        unembedding: ``[V, D]`` the head's table (``logits = h @ w.T``).

    Examples:
        >>> row_cosines(jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]),
        ...             jnp.array([[2.0, 0.0], [-1.0, 1.0], [1.0, 0.0]]))
        Array([1., 0., 0.], dtype=float32)
    """
    _checks.check_floating("embedding", embedding)
    _checks.check_floating("unembedding", unembedding)
    chex.assert_rank([embedding, unembedding], 2)
    chex.assert_equal_shape([embedding, unembedding])
    e = jnp.asarray(embedding, jnp.float32)
    u = jnp.asarray(unembedding, jnp.float32)
    norms = jnp.linalg.norm(e, axis=-1) * jnp.linalg.norm(u, axis=-1)
    return jnp.sum(e * u, axis=-1) / jnp.maximum(norms, _TINY)


def weighted_mean(
    values: jax.typing.ArrayLike, weights: jax.typing.ArrayLike
) -> jax.Array:
    r"""``float32 []``: :math:`\sum_i w_i x_i / \sum_i w_i`, e.g. the cosines of
    :func:`row_cosines` weighted by the training counts (the alignment the
    average training token sees), or a statistic over weighted positions.

    Weights summing to 0 give 0 (the rule inside ``jit``; outside it, they
    raise ValueError, as negative weights do).

    Args:
        values: ``[...]`` numbers.
        weights: their shape, non-negative.

    Examples:
        >>> weighted_mean(jnp.array([1.0, 0.0, 3.0]), jnp.array([1, 0, 1]))
        Array(2., dtype=float32)
    """
    chex.assert_equal_shape([values, weights])
    if not _checks.is_traced(weights):
        weights_np = np.asarray(weights)
        if np.any(weights_np < 0) or not np.sum(weights_np) > 0:
            raise ValueError(
                "weights must be non-negative with a positive sum; got a sum "
                f"of {np.sum(weights_np)} and a minimum of {np.min(weights_np)}."
            )
    values = jnp.asarray(values, jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    total = jnp.sum(weights)
    return jnp.where(total > 0, jnp.sum(weights * values) / total, 0.0)


def rank_correlation(x: np.ndarray, y: np.ndarray) -> float:
    r"""Spearman's :math:`\rho` of two ``[V]`` arrays (``scipy.stats.spearmanr``:
    the Pearson correlation of their ranks, ties given their mean rank).

    NaN when either array is constant (no ranks to correlate).

    Raises:
        ValueError: the arrays are not 1-D of one length >= 2.

    Examples:
        >>> rank_correlation(np.array([1.0, 2.0, 3.0]), np.array([10.0, 30.0, 20.0]))
        0.5
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 1 or x.shape != y.shape or x.shape[0] < 2:
        raise ValueError(
            f"x and y must be 1-D of one length >= 2; got {x.shape} and {y.shape}."
        )
    if np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    return float(stats.spearmanr(x, y).statistic)


class LogitStatistics(NamedTuple):
    """Per position ``[...]`` (the logits' leading shape), all float32.

    Attributes:
        nll: :math:`-\\log p(y_t)`, the negative log-likelihood of the label.
        std: the standard deviation of the logits over the vocabulary
            (unchanged by adding a constant to every logit of a position,
            as the softmax is).
        max: the largest logit.
    """

    nll: jax.Array
    std: jax.Array
    max: jax.Array


def logit_statistics(
    logits: jax.typing.ArrayLike, labels: jax.typing.ArrayLike
) -> LogitStatistics:
    r"""The loss and the scale of ``logits: [..., V]`` at each position:
    :math:`\mathrm{nll}_t = \log\sum_v e^{z_{t,v}} - z_{t,y_t}`,
    :math:`\mathrm{std}_t = \sqrt{\tfrac1V \sum_v (z_{t,v} - \bar z_t)^2}`,
    :math:`\max_t = \max_v z_{t,v}`.

    Args:
        logits: ``[..., V]`` next-token logits.
        labels: ``int [...]`` the tokens they predict, in ``[0, V)``
            (``head.token_log_probs``'s rule for others).

    Examples:
        >>> logits = jnp.log(jnp.array([[0.5, 0.25, 0.25], [1.0, 1.0, 1.0]]))
        >>> s = logit_statistics(logits, jnp.array([0, 2]))
        >>> s.nll
        Array([0.6931472, 1.0986123], dtype=float32)
        >>> np.round(s.std, 4), np.round(s.max, 4)
        (Array([0.3268, 0.    ], dtype=float32), Array([-0.6931,  0.    ], dtype=float32))
    """
    _checks.check_floating("logits", logits)
    chex.assert_rank(logits, jnp.ndim(labels) + 1)
    logits = jnp.asarray(logits, jnp.float32)
    return LogitStatistics(
        nll=-head.token_log_probs(logits, labels),
        std=jnp.std(logits, axis=-1),
        max=jnp.max(logits, axis=-1),
    )


def frequency_buckets(counts: np.ndarray, num_buckets: int) -> np.ndarray:
    r"""``int [V]``: each token's bucket of equal training-token mass, 0 the
    most frequent.

    Tokens are sorted by count, most frequent first (ties by id); a token
    whose mass lies in :math:`[m_v, m_v + c_v)` of the cumulative count
    :math:`N` goes to bucket :math:`\min(K - 1, \lfloor K (m_v + c_v/2) / N
    \rfloor)`: the ``1/K`` of the training text that its middle falls in.
    A token holding more than ``1/K`` of the mass leaves a bucket empty;
    tokens never seen go to the last bucket.

    Args:
        counts: ``int [V]`` training token counts, with a positive sum.
        num_buckets: ``K >= 1``.

    Raises:
        ValueError: ``counts`` is not 1-D, non-negative with a positive sum,
            or ``num_buckets`` is not a count.

    Examples:
        >>> frequency_buckets(np.array([1, 5, 0, 3, 1]), 2)  # masses 5 | 3, 1, 1
        array([1, 0, 1, 1, 1])
        >>> frequency_buckets(np.array([1, 5, 0, 3, 1]), 3)
        array([2, 0, 2, 1, 2])
    """
    _checks.check_count("num_buckets", num_buckets)
    counts = np.asarray(counts)
    if counts.ndim != 1 or np.any(counts < 0) or not np.sum(counts) > 0:
        raise ValueError(
            "counts must be a non-negative [V] array with a positive sum; got "
            f"shape {counts.shape}, sum {np.sum(counts)}."
        )
    order = np.lexsort((np.arange(len(counts)), -counts))
    sorted_counts = counts[order].astype(np.float64)
    middle = np.cumsum(sorted_counts) - sorted_counts / 2
    buckets = np.empty(len(counts), np.int64)
    buckets[order] = np.minimum(
        num_buckets - 1, np.floor(num_buckets * middle / np.sum(sorted_counts))
    )
    return buckets


def bucket_losses(
    nll: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike,
    buckets: jax.typing.ArrayLike,
    num_buckets: int,
) -> tuple[jax.Array, jax.Array]:
    r"""``(mean_nll [K], tokens [K])``: the weighted mean negative
    log-likelihood of the evaluated tokens whose label is in each bucket,

    .. math::
        \bar\ell_k = \frac{\sum_{t:\, b(y_t) = k} w_t \ell_t}
                          {\sum_{t:\, b(y_t) = k} w_t},

    and the weight (the token count, for 0/1 weights) behind each mean. An
    empty bucket's mean is NaN, and its count 0 says why.

    Args:
        nll: ``[N]`` negative log-likelihoods (:func:`logit_statistics`).
        labels: ``int [N]`` the tokens they score, in ``[0, V)``.
        weights: ``[N]`` non-negative (0: padding).
        buckets: ``int [V]`` each token's bucket in ``[0, K)``
            (:func:`frequency_buckets`).

    Raises:
        ValueError: outside ``jit``, a label outside ``[0, V)`` where its
            weight is not 0, or a bucket outside ``[0, K)``; inside ``jit``
            such a label reads the nearest row of ``buckets``.
        num_buckets: ``K >= 1``.

    Examples:
        >>> mean, tokens = bucket_losses(jnp.array([1.0, 2.0, 4.0, 8.0]),
        ...     jnp.array([0, 1, 1, 0]), jnp.array([1.0, 1.0, 1.0, 0.0]),
        ...     jnp.array([0, 1]), 3)
        >>> mean, tokens
        (Array([ 1.,  3., nan], dtype=float32), Array([1., 2., 0.], dtype=float32))
    """
    _checks.check_count("num_buckets", num_buckets)
    _checks.check_integer("labels", labels)
    _checks.check_integer("buckets", buckets)
    chex.assert_rank([nll, labels, weights, buckets], 1)
    chex.assert_equal_shape([nll, labels, weights])
    _checks.check_ids_in_range("labels", labels, weights, jnp.shape(buckets)[0])
    _checks.check_in_range("buckets", buckets, low=0, high=num_buckets - 1)
    weights = jnp.asarray(weights, jnp.float32)
    segment = jnp.asarray(buckets)[jnp.asarray(labels)]
    # Where a weight is 0 its nll may be anything, even inf: it adds 0.
    scored = jnp.where(weights > 0, weights * jnp.asarray(nll, jnp.float32), 0.0)
    totals = jax.ops.segment_sum(scored, segment, num_buckets)
    tokens = jax.ops.segment_sum(weights, segment, num_buckets)
    return totals / jnp.where(tokens > 0, tokens, jnp.nan), tokens
