"""Float64 numpy references that the tests check the library against.

Each is written from its formula, with nothing taken from ``lmhead``, so a
test that compares the library with one of them can fail. They live here,
once, because several test files check different code paths (the
materialized, fused and vocabulary-parallel losses, the head, the decoders,
the model) against the same formula.
"""

import numpy as np


def log_softmax(z, temperature=1.0):
    r"""``log p_i = z_i / T - log sum_j exp(z_j / T)`` over the last axis.

    The maximum subtracted first is taken over the finite entries, so a
    ``-inf`` entry (a masked token) gets ``-inf``.

    >>> np.exp(log_softmax(np.array([0.0, np.log(3.0), -np.inf])))
    array([0.25, 0.75, 0.  ])
    """
    z = np.asarray(z, np.float64) / temperature
    top = np.max(np.where(np.isfinite(z), z, -np.inf), -1, keepdims=True)
    shifted = z - top
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def logsumexp(z):
    r"""``log sum_j exp(z_j)`` over the last axis, shape ``z.shape[:-1]``."""
    z = np.asarray(z, np.float64)
    top = z.max(-1)
    return top + np.log(np.exp(z - top[..., None]).sum(-1))


def unembed(h, w, bias=None, scale=None, softcap=None):
    """``softcap(scale * h @ w.T + bias)`` with ``w: [V, D]``."""
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    if scale is not None:
        z = z * scale
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    return z


def smoothed_targets(labels, vocab_size, eps, smoothing):
    """The target distribution ``[..., V]`` of each smoothing convention.

    ``"uniform"`` (PyTorch): ``(1 - e) * onehot + e / V``.
    ``"normalized"`` (T5X): ``1 - e`` on the label, ``e / (V - 1)`` elsewhere.
    """
    onehot = np.eye(vocab_size)[labels]
    if smoothing == "uniform":
        return (1 - eps) * onehot + eps / vocab_size
    return (1 - eps) * onehot + eps / (vocab_size - 1) * (1 - onehot)


def target_entropy(vocab_size, eps):
    """The entropy of the ``"normalized"`` target: what that convention
    subtracts so that its minimum is 0 (T5X's normalizing constant)."""
    confidence, low = 1.0 - eps, eps / (vocab_size - 1)
    terms = [(confidence, 1), (low, vocab_size - 1)]
    return -sum(count * p * np.log(p) for p, count in terms if p > 0)


def cross_entropy(
    logits, labels, weights=None, eps=0.0, smoothing="uniform", z_loss=0.0
):
    """Per-token smoothed cross-entropy + z-loss, and the weighted metrics.

    Returns:
        ``(per_token [...], metrics)`` with the weighted means ``loss``,
        ``nll``, ``z_loss``, ``accuracy`` (0 when the weights sum to 0) and
        ``weight_sum``.
    """
    logits = np.asarray(logits, np.float64)
    labels = np.asarray(labels)
    vocab_size = logits.shape[-1]
    lp = log_softmax(logits)
    ce = -(smoothed_targets(labels, vocab_size, eps, smoothing) * lp).sum(-1)
    if smoothing == "normalized":
        ce = ce - target_entropy(vocab_size, eps)
    z_term = z_loss * logsumexp(logits) ** 2
    per_token = ce + z_term
    nll = -np.take_along_axis(lp, labels[..., None], -1)[..., 0]
    correct = (np.argmax(logits, -1) == labels).astype(np.float64)
    w = np.ones(labels.shape) if weights is None else np.asarray(weights, np.float64)
    total = w.sum()

    def mean(x):
        return (w * x).sum() / total if total > 0 else 0.0

    metrics = {
        "loss": mean(per_token),
        "nll": mean(nll),
        "z_loss": mean(z_term),
        "accuracy": mean(correct),
        "weight_sum": total,
    }
    return per_token, metrics


def cross_entropy_gradient(
    logits, labels, weights=None, eps=0.0, smoothing="uniform", z_loss=0.0
):
    r"""``dL/dz`` of the weighted mean of :func:`cross_entropy`'s loss.

    Per token ``d/dz [-sum_i t_i log p_i + lambda lse^2] = p - t + 2 lambda
    lse p``, times ``w_t / sum w`` (0 when the weights sum to 0).
    """
    logits = np.asarray(logits, np.float64)
    w = (
        np.ones(np.shape(labels))
        if weights is None
        else np.asarray(weights, np.float64)
    )
    p = np.exp(log_softmax(logits))
    lse = logsumexp(logits)[..., None]
    targets = smoothed_targets(labels, logits.shape[-1], eps, smoothing)
    per_token = p - targets + 2 * z_loss * lse * p
    total = w.sum()
    return w[..., None] * per_token / (total if total > 0 else 1.0)


def expected_calibration_error(logits, labels, weights, num_bins):
    """Guo et al. (2017), equal-width bins ``(m/M, (m+1)/M]``, one at a time."""
    p = np.exp(log_softmax(logits)).reshape(-1, np.shape(logits)[-1])
    labels = np.asarray(labels).reshape(-1)
    w = (
        np.ones(labels.shape)
        if weights is None
        else np.asarray(weights, np.float64).reshape(-1)
    )
    confidence, correct = p.max(-1), p.argmax(-1) == labels
    ece = 0.0
    for m in range(num_bins):
        low, high = m / num_bins, (m + 1) / num_bins
        in_bin = (confidence > low) & (confidence <= high)
        bin_weight = w[in_bin].sum()
        if bin_weight == 0:
            continue
        accuracy = (w * correct)[in_bin].sum() / bin_weight
        mean_confidence = (w * confidence)[in_bin].sum() / bin_weight
        ece += bin_weight / w.sum() * abs(accuracy - mean_confidence)
    return ece
