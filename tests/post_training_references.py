"""Float64 numpy references of the post-training losses' inputs, for
tests/test_token_logprobs.py, test_preference.py, test_policy_gradient.py
and test_sparse_distillation.py: each loss's test writes its own formula on
top of these, and checks gradients against central differences of it.
"""

import numpy as np

from tests import references


def token_logprobs(h, w, bias, ids, *, scale=None, softcap=None, temperature=1.0):
    """``(log p(ids) [..., (k)], entropy [...], logsumexp [...])`` in float64."""
    z = references.unembed(h, w, bias, scale=scale, softcap=softcap) / temperature
    log_p = references.log_softmax(z)
    ids = np.asarray(ids)
    picked = np.take_along_axis(log_p, ids.reshape(ids.shape[: h.ndim - 1] + (-1,)), -1)
    picked = picked.reshape(ids.shape)
    p = np.exp(log_p)
    with np.errstate(invalid="ignore"):  # 0 * -inf at a banned token
        entropy = -np.sum(np.where(p > 0, p * log_p, 0.0), -1)
    top = np.max(z, -1, keepdims=True)
    lse = top[..., 0] + np.log(np.sum(np.exp(z - top), -1))
    return picked, entropy, lse


def numeric_grad(f, x, eps=1e-6):
    """Central differences of the scalar ``f`` at ``x`` (float64), entry by
    entry; an entry of ``x`` that is not finite gets 0."""
    x = np.array(x, np.float64)
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        if not np.isfinite(x[i]):
            continue
        up, down = x.copy(), x.copy()
        up[i] += eps
        down[i] -= eps
        grad[i] = (f(up) - f(down)) / (2 * eps)
    return grad


def grads(loss, h, w, bias):
    """``(dh, dw, dbias)`` of ``loss(h, w, bias)`` by central differences."""
    return (
        numeric_grad(lambda x: loss(x, w, bias), h),
        numeric_grad(lambda x: loss(h, x, bias), w),
        numeric_grad(lambda x: loss(h, w, x), bias),
    )
