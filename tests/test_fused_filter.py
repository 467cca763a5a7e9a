"""Gradient filtering and dw's accumulation in the fused sweep, for every rule.

The filtered gradient is checked against a float64 numpy gradient summed
over the tiles (a chunk's tokens x a vocabulary block) that the filter keeps,
found in numpy from ``|p - onehot|``, and against the bound of
``SweepOptions.gradient_options``; the other rules' filtered gradients
against their exact ones within that bound, their token scale ``sigma`` from
autodiff of the plain-JAX loss. N = 24 tokens in chunks of 5 (a ragged last
chunk), V = 40 rows in blocks of 8.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import (
    distillation,
    fused,
    modules,
    policy_gradient,
    preference,
    sparse_distillation,
    token_logprobs,
)
from tests.errors import bad_input_test

N, D, V = 24, 6, 40
CHUNK, ROWS = 5, 8


@pytest.fixture(autouse=True)
def small_blocks_and_exact_matmuls(monkeypatch):
    monkeypatch.setitem(fused.VOCAB_BLOCK_ROWS, jax.default_backend(), ROWS)
    with jax.default_matmul_precision("highest"):
        yield


def make_inputs(peaked, seed=0):
    """Random inputs, or peaked ones: each ``h`` points at its label's row of
    ``w``, so the label gets almost all the mass, as in a trained model."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((V, D))
    # Labels of the first rows only: the later blocks hold no label.
    labels = rng.integers(0, 12, N)
    h = rng.standard_normal((N, D))
    if peaked:
        h = 3.0 * w[labels] + 0.3 * h
    weights = rng.uniform(0.5, 2.0, N) * (rng.random(N) < 0.85)
    return (x.astype(np.float32) for x in (h, w)), labels, weights.astype(np.float32)


def tiles(n, v):
    """``(token slice, row slice)`` of each tile, as the sweep partitions."""
    for i in range(0, n, CHUNK):
        for j in range(0, v, ROWS):
            yield slice(i, min(i + CHUNK, n)), slice(j, min(j + ROWS, v))


def np_filtered_grads(h, w, labels, weights, eps, target):
    """The mean cross-entropy's ``(dh, dw)`` in float64 over the kept tiles
    (all tiles for a gradient ``target`` does not filter), and the skipped
    tiles' mask ``[N, V]``."""
    h, w = h.astype(np.float64), w.astype(np.float64)
    z = h @ w.T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = (p - np.eye(V)[labels]) * weights[:, None] / weights.sum()
    skipped = np.zeros((N, V), bool)
    for t, r in tiles(N, V):
        small = (np.abs(p - np.eye(V)[labels])[t, r] < eps) | (weights[t, None] == 0)
        skipped[t, r] = small.all()
    g_dh = np.where(skipped, 0.0, g) if target in ("both", "dh") else g
    g_dw = np.where(skipped, 0.0, g) if target in ("both", "dw") else g
    return g_dh @ w, g_dw.T @ h, skipped


def bound(h, w, sigma, skipped, eps):
    """``SweepOptions.gradient_options``' bound of ``|dh - exact|`` and
    ``|dw - exact|`` (``sigma`` includes the objective's cotangent)."""
    s = np.where(skipped, sigma[:, None], 0.0)
    return eps * s @ np.abs(w), eps * s.T @ np.abs(h)


def fused_grads(h, w, labels, weights, **options):
    def loss(h, w):
        return fused.fused_cross_entropy(
            h, w, labels, weights=weights, chunk_size=CHUNK, **options
        )[0]

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(h, w)


@pytest.mark.parametrize("peaked", [False, True], ids=["random", "peaked"])
@pytest.mark.parametrize("target", fused.FILTER_TARGETS)
def test_cross_entropy_skips_the_small_tiles_within_the_bound(peaked, target):
    (h, w), labels, weights = make_inputs(peaked)
    eps = 0.05 if peaked else 0.1
    dh, dw = fused_grads(h, w, labels, weights, filter_eps=eps, filter_target=target)
    exact = fused_grads(h, w, labels, weights)
    ref_dh, ref_dw, skipped = np_filtered_grads(h, w, labels, weights, eps, target)
    assert 0 < skipped.mean() < 1, skipped.mean()  # some tiles, not all
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-4, atol=1e-6)
    sigma = weights / weights.sum()
    dh_bound, dw_bound = bound(h, w, sigma, skipped, eps)
    assert np.all(np.abs(dh - exact[0]) <= dh_bound + 1e-7)
    assert np.all(np.abs(dw - exact[1]) <= dw_bound + 1e-7)
    assert np.any(dh != exact[0]) == (target != "dw")
    assert np.any(dw != exact[1]) == (target != "dh")


def test_a_tile_just_below_eps_is_dropped_and_one_just_above_is_kept():
    # w = I: the logits are h. Token t's label is row t of block 0, logit 8;
    # block 1's logits are -4 - t / 10, so its largest |p - onehot| is p of
    # token 0 at any row of block 1, computed here in float64.
    logits = np.full((CHUNK, 2 * ROWS), 0.0)
    logits[:, :ROWS] = -2.0
    labels = np.arange(CHUNK)
    logits[labels, labels] = 8.0
    logits[:, ROWS:] = -4.0 - np.arange(CHUNK)[:, None] / 10
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    largest = p[:, ROWS:].max()
    h, w = logits.astype(np.float32), np.eye(2 * ROWS, dtype=np.float32)
    weights = np.ones(CHUNK, np.float32)
    exact = fused_grads(h, w, labels, weights)
    below = fused_grads(h, w, labels, weights, filter_eps=largest * 1.001)
    above = fused_grads(h, w, labels, weights, filter_eps=largest * 0.999)
    for got, want in zip(above, exact):  # eps below the tile's max: kept
        np.testing.assert_array_equal(got, want)
    # eps above it: block 1 dropped. dh = g @ I has g's columns, dw = g.T @ h
    # its rows.
    (dh, dw), (exact_dh, exact_dw) = below, exact
    np.testing.assert_allclose(dh[:, :ROWS], exact_dh[:, :ROWS], rtol=1e-6)
    np.testing.assert_allclose(dw[:ROWS], exact_dw[:ROWS], rtol=1e-6)
    assert np.all(exact_dh[:, ROWS:] != 0) and np.all(exact_dw[ROWS:] != 0)
    np.testing.assert_array_equal(dh[:, ROWS:], 0.0)
    np.testing.assert_array_equal(dw[ROWS:], 0.0)


class ExactTest(chex.TestCase):
    # Compiled only: the sweep runs its scans and custom VJP compiled either
    # way, and the plain JAX around it is stricter under jit than op by op.
    @chex.variants(with_jit=True)
    def test_eps_zero_is_the_exact_gradient_and_the_loss_stays_exact(self):
        (h, w), labels, weights = make_inputs(peaked=True)

        def loss(filter_eps):
            return jax.value_and_grad(
                lambda h, w: fused.fused_cross_entropy(
                    h,
                    w,
                    labels,
                    weights=weights,
                    chunk_size=CHUNK,
                    filter_eps=filter_eps,
                )[0],
                argnums=(0, 1),
            )

        exact = self.variant(loss(None))(h, w)
        # No coefficient is 0, so no tile is skipped: the kept branch of each
        # block's cond is bitwise the exact gradient (a training run whose
        # filter skips nothing trains bitwise as an exact one).
        nothing_small = self.variant(loss(0.0))(h, w)
        filtered = self.variant(loss(0.5))(h, w)
        for kept, reference in zip(nothing_small[1], exact[1]):
            np.testing.assert_array_equal(kept, reference)
        assert filtered[0] == exact[0]
        assert all(np.any(f != e) for f, e in zip(filtered[1], exact[1]))


def rule_cases():
    """``(name, loss(h, w, **options), sigma(h, w))`` for each rule of the
    sweep: the token scale ``sigma_t`` (with the objective's cotangent) is
    ``|dL/d log p_t|`` from autodiff of the plain-JAX loss on the log-probs,
    or the token's weight over the weight sum."""
    (h, w), labels, weights = make_inputs(peaked=True, seed=1)
    ids = labels.reshape(2, N // 2)
    mask = (weights > 0).reshape(2, N // 2).astype(np.float32)
    teacher = 4.0 * np.eye(V, dtype=np.float32)[labels]
    kw = dict(chunk_size=CHUNK)

    def logps(h, w):
        return jax.nn.log_softmax(h @ w.T)[np.arange(N), labels].reshape(2, N // 2)

    def scale_of(loss_of_logps):
        return lambda h, w: np.abs(jax.grad(loss_of_logps)(logps(h, w))).ravel()

    def weight_scale(h, w):
        return weights / weights.sum()

    advantages = np.array([1.0, -0.5], np.float32)
    return [
        (
            "distillation",
            lambda h, w, **o: distillation.fused_distillation_loss(
                h, w, teacher, weights=weights, **kw, **o
            )[0],
            weight_scale,
        ),
        (
            "logprobs",
            lambda h, w, **o: (
                -jnp.sum(
                    token_logprobs.fused_token_logprobs(
                        h, w, labels, weights=weights, **kw, **o
                    ).logprobs
                    * weights
                )
            ),
            lambda h, w: weights,
        ),
        (
            "grpo",
            lambda h, w, **o: policy_gradient.fused_policy_gradient_loss(
                h.reshape(2, N // 2, D),
                w,
                ids,
                mask,
                advantages,
                loss_type="grpo",
                **kw,
                **o,
            )[0],
            scale_of(
                lambda lp: policy_gradient.policy_gradient_loss(
                    lp, mask, advantages, loss_type="grpo"
                )[0]
            ),
        ),
        (
            "dpo",
            lambda h, w, **o: preference.fused_preference_loss(
                h.reshape(2, N // 2, D)[0:1],
                h.reshape(2, N // 2, D)[1:2],
                w,
                ids[0:1],
                ids[1:2],
                mask[0:1],
                mask[1:2],
                reference_logps=(np.zeros((1, N // 2)), np.zeros((1, N // 2))),
                **kw,
                **o,
            )[0],
            scale_of(
                lambda lp: preference.preference_loss(
                    lp[0:1],
                    lp[1:2],
                    mask[0:1],
                    mask[1:2],
                    ref_chosen_logps=np.zeros((1, N // 2)),
                    ref_rejected_logps=np.zeros((1, N // 2)),
                )[0]
            ),
        ),
    ]


@pytest.mark.parametrize(
    "name,loss,sigma", [pytest.param(*c, id=c[0]) for c in rule_cases()]
)
def test_every_rule_is_filtered_within_the_bound(name, loss, sigma):
    (h, w), labels, _ = make_inputs(peaked=True, seed=1)
    eps = 0.05
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnames="filter_eps")
    exact = grads(h, w, filter_eps=None)
    dh, dw = grads(h, w, filter_eps=eps)
    assert np.any(dh != exact[0]) and np.any(dw != exact[1])  # tiles skipped
    # Every entry of a skipped tile is below eps * sigma, so summing the
    # bound over all rows (tokens) rather than the skipped ones bounds it.
    everything = np.ones((N, V), bool)
    dh_bound, dw_bound = bound(h, w, np.asarray(sigma(h, w)), everything, eps)
    assert np.all(np.abs(dh - exact[0]) <= dh_bound + 1e-6)
    assert np.all(np.abs(dw - exact[1]) <= dw_bound + 1e-6)


def test_kahan_keeps_a_bf16_dw_where_plain_bf16_sums_drift():
    # 512 chunks of 4 tokens summed into each row of dw. At V = 2048 a row's
    # sum is a few label terms of size |h| and thousands of terms of p ~ 1/V:
    # once the sum holds a label term, bf16 rounds those to a fraction of
    # their size (swamping); the compensation keeps what each addition lost.
    rng = np.random.default_rng(0)
    n, d, v = 2048, 4, 2048
    h = rng.standard_normal((n, d)).astype(jnp.bfloat16)
    w = (0.1 * rng.standard_normal((v, d))).astype(jnp.bfloat16)
    labels = rng.integers(0, v, n)
    z = h.astype(np.float64) @ w.astype(np.float64).T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(n), labels] -= 1
    reference = p.T @ h.astype(np.float64) / n

    def error(accumulation):
        dw = jax.jit(
            jax.grad(
                lambda w: fused.fused_cross_entropy(
                    h, w, labels, chunk_size=4, dw_accumulation=accumulation
                )[0]
            )
        )(w)
        return np.linalg.norm(np.asarray(dw, np.float64) - reference) / np.linalg.norm(
            reference
        )

    plain, kahan = error("input_dtype"), error("kahan")
    assert plain > 0.02, plain
    # What is left is the gradient's rounding to bf16 (2^-9), not the sum's.
    assert kahan < 0.005, kahan


def call(fn, **options):
    (h, w), labels, _ = make_inputs(peaked=False)
    ids = labels.reshape(2, N // 2)
    mask = np.ones((2, N // 2), np.float32)
    calls = {
        "fused": lambda: fused.fused_cross_entropy(h, w, labels, **options),
        "distillation": lambda: distillation.fused_distillation_loss(
            h, w, h @ w.T, **options
        ),
        "logprobs": lambda: token_logprobs.fused_token_logprobs(
            h, w, labels, **options
        ),
        "grpo": lambda: policy_gradient.fused_policy_gradient_loss(
            h.reshape(2, N // 2, D), w, ids, mask, np.ones(2), **options
        ),
        "sparse": lambda: sparse_distillation.fused_sparse_distillation_loss(
            h, w, labels[:, None], np.zeros((N, 1)), **options
        ),
        "head_materialized": lambda: modules.LMHead(V).apply(
            {},
            h,
            labels,
            w,
            loss_impl="materialized",
            method="loss",
            **options,
        ),
    }
    return calls[fn]


BAD_INPUTS = [
    ("negative_eps", call("fused", filter_eps=-1e-3), ValueError, "filter_eps"),
    ("eps_word", call("distillation", filter_eps="fast"), ValueError, "filter_eps"),
    ("eps_bool", call("logprobs", filter_eps=True), TypeError, "filter_eps"),
    (
        "traced_eps",
        lambda: jax.jit(lambda e: call("fused", filter_eps=e)())(1e-3),
        TypeError,
        "filter_eps",
    ),
    ("target", call("grpo", filter_target="dx"), ValueError, "filter_target"),
    ("sparse_target", call("sparse", filter_target="w"), ValueError, "filter_target"),
    (
        "accumulation",
        call("fused", dw_accumulation="bf16"),
        ValueError,
        "dw_accumulation",
    ),
    (
        "materialized_head",
        call("head_materialized", filter_eps=1e-3),
        ValueError,
        ("filter_eps", "loss_impl"),
    ),
]
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


def test_the_head_passes_the_options_to_the_fused_loss():
    (h, w), labels, weights = make_inputs(peaked=True)
    options = dict(filter_eps=0.05, filter_target="dh", dw_accumulation="kahan")

    def head_loss(h):
        return modules.LMHead(V).apply(
            {},
            h,
            labels,
            w,
            weights=weights,
            chunk_size=CHUNK,
            method="loss",
            **options,
        )[0]

    dh = jax.jit(jax.grad(head_loss))(h)
    reference = fused_grads(h, w, labels, weights, **options)[0]
    np.testing.assert_array_equal(dh, reference)
    assert np.any(dh != fused_grads(h, w, labels, weights)[0])
