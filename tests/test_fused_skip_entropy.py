"""Tests for lmhead/fused.py: skipped weight-0 tokens and the entropy.

Skipping is checked against the same loss with ``skip_zero_weights=False``
(every token computed, itself tested against numpy in test_fused.py): equal
up to float32 rounding for any weights, bitwise when none is 0. The entropy
is checked against ``-(p log p).sum()`` of the materialized softmax in
float64 numpy (with ``0 log 0 = 0`` for a banned token of logit ``-inf``),
and its gradient against autodiff of the same formula in jnp. N = 21 tokens
in chunks of 5, V = 37 rows in blocks of 16 (kept logits) or 7 (recomputed),
so that every loop is ragged.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmhead import _fused_sweep, fused, head, losses, vocab_parallel
from tests import DEFAULT_EMITTERS, references
from tests.errors import assert_raises_exactly

B, T, D, V = 3, 7, 8, 37
CHUNK = 5
KEPT = {"chunk_size": CHUNK}
RECOMPUTED = {"chunk_size": CHUNK, "vocab_chunk_size": 7}
N = B * T


@pytest.fixture(autouse=True)
def small_blocks_and_exact_matmuls(monkeypatch):
    monkeypatch.setitem(fused.VOCAB_BLOCK_ROWS, jax.default_backend(), 16)
    with jax.default_matmul_precision("highest"):
        yield


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((B, T, D)).astype(np.float32)
    w = rng.standard_normal((V, D)).astype(np.float32)
    bias = rng.standard_normal(V).astype(np.float32)
    labels = rng.integers(0, V, (B, T)).astype(np.int32)
    return h, w, bias, labels


def weight_patterns():
    """``[N]`` weight patterns by name: the ends of the token order hold
    whole chunks of weight 0 in ``"empty_ends"`` (tokens 0-9 and 16-20)."""
    rng = np.random.default_rng(1)
    scattered = (rng.random(N) < 0.4) * rng.uniform(0.5, 2.0, N)
    ends = np.zeros(N)
    ends[10:16] = rng.uniform(0.5, 2.0, 6)
    one_token = np.zeros(N)
    one_token[N - 1] = 1.0
    patterns = {
        "all_zero": np.zeros(N),
        "all_one": np.ones(N),
        "random": scattered,
        "empty_ends": ends,
        "last_token_only": one_token,
    }
    return {k: v.reshape(B, T).astype(np.float32) for k, v in patterns.items()}


def loss_and_grads(skip, reduction, sizes, h, w, bias, labels, weights):
    """Value and gradient w.r.t. ``h, w, bias, weights`` of the loss (for
    ``"none"``, of a non-uniform sum of the per-token losses)."""

    def objective(h, w, bias, weights):
        loss, metrics = fused.fused_cross_entropy(
            h,
            w,
            labels,
            bias=bias,
            weights=weights,
            label_smoothing=0.1,
            z_loss=1e-3,
            softcap=4.0,
            reduction=reduction,
            skip_zero_weights=skip,
            **sizes,
        )
        if reduction == "none":
            loss = jnp.sum(loss * jnp.arange(loss.size).reshape(loss.shape))
        return loss, metrics

    return jax.value_and_grad(objective, (0, 1, 2, 3), has_aux=True)(
        h, w, bias, weights
    )


class SkipZeroWeightsTest(parameterized.TestCase):
    @parameterized.product(reduction=["mean", "none"], blocks=["kept", "recomputed"])
    def test_equals_the_full_sweep(self, reduction, blocks):
        h, w, bias, labels = make_inputs()
        sizes = KEPT if blocks == "kept" else RECOMPUTED
        patterns = weight_patterns()
        # Compiled by XLA's default fusion emitters, the ones users' programs
        # get (the suite's faster ones, tests/conftest.py, round the two
        # programs differently): the bitwise check of "all_one" is theirs.
        skipped, full = (
            jax.jit(functools.partial(loss_and_grads, skip, reduction, sizes))
            .lower(h, w, bias, labels, patterns["all_one"])
            .compile(compiler_options=DEFAULT_EMITTERS)
            for skip in (True, False)
        )
        for name, weights in patterns.items():
            (loss, metrics), grads = skipped(h, w, bias, labels, weights)
            (want, want_metrics), want_grads = full(h, w, bias, labels, weights)
            if name == "all_one":  # nothing skipped, nothing reordered
                chex.assert_trees_all_equal(
                    (loss, metrics, grads[:3]), (want, want_metrics, want_grads[:3])
                )
            np.testing.assert_allclose(loss, want, rtol=1e-6, atol=1e-6, err_msg=name)
            chex.assert_trees_all_close(metrics, want_metrics, rtol=1e-6, atol=1e-6)
            for got, ref, arg in zip(grads[:3], want_grads[:3], ("h", "w", "bias")):
                np.testing.assert_allclose(
                    got, ref, rtol=1e-5, atol=1e-6, err_msg=f"{name} {arg}"
                )
            # The weights' gradient: exact where a weight is not 0, and 0
            # (not the token's loss) where it is.
            nonzero = weights != 0
            np.testing.assert_allclose(
                grads[3][nonzero], want_grads[3][nonzero], rtol=1e-5, atol=1e-6
            )
            np.testing.assert_array_equal(grads[3][~nonzero], 0.0)
            if name == "all_zero":
                self.assertEqual(float(loss), 0.0)
                self.assertEqual(float(jnp.abs(grads[0]).max()), 0.0)

    def test_full_sweep_gives_the_exact_gradient_of_a_zero_weight(self):
        # d loss_sum / d w_t is token t's loss, also where w_t = 0.
        h, w, bias, labels = make_inputs(8)
        weights = weight_patterns()["random"]

        def total(loss_fn, weights, **options):
            logits_or_h = (
                h if loss_fn is fused.fused_cross_entropy else head.unembed(h, w, bias)
            )
            args = (w,) if loss_fn is fused.fused_cross_entropy else ()
            return loss_fn(
                logits_or_h, *args, labels, weights=weights, reduction="sum",
                **options,
            )[0]  # fmt: skip

        got = jax.jit(jax.grad(
            functools.partial(total, fused.fused_cross_entropy, bias=bias,
                              skip_zero_weights=False, **KEPT)
        ))(weights)  # fmt: skip
        want = jax.grad(functools.partial(total, losses.cross_entropy))(weights)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        self.assertGreater(float(np.abs(got[weights == 0]).min()), 0.0)

    def test_members_with_their_own_weights_equal_single_calls(self):
        h, w, bias, labels = make_inputs(2)
        patterns = weight_patterns()
        weights = np.stack([patterns[k] for k in ("random", "empty_ends", "all_one")])
        step = functools.partial(loss_and_grads, True, "mean", KEPT)
        got = jax.jit(jax.vmap(step, (None,) * 4 + (0,)))(h, w, bias, labels, weights)
        single = jax.jit(step)
        for member in range(len(weights)):
            chex.assert_trees_all_close(
                jax.tree.map(lambda x, m=member: x[m], got),
                single(h, w, bias, labels, weights[member]),
                rtol=1e-5,
                atol=1e-6,
            )

    def test_skipped_chunks_are_not_computed(self):
        # Tokens 0-9 and 16-20 of "empty_ends" have weight 0: packed behind
        # the 6 weighted ones, they fill chunks 2 to 5, which are skipped
        # and keep statistics 0; chunk 1 holds 4 of them, computed.
        h, w, _, labels = make_inputs(3)
        weights = weight_patterns()["empty_ends"].reshape(-1)
        rule = fused.CrossEntropyRule(
            vocab_size=V, label_smoothing=0.0, smoothing="uniform", z_loss=0.0
        )
        options = fused.SweepOptions(chunk_size=CHUNK, skip_zero_weights=True)
        _, (lse, *_) = _fused_sweep.run(
            options,
            rule,
            jnp.reshape(h, (N, D)),
            jnp.asarray(w),
            None,
            jnp.asarray(weights),
            ((jnp.reshape(labels, (-1, 1)), ()), ()),
            grads_in_forward=False,
            loss_scalars=jnp.zeros(2),
        )
        order = np.argsort(weights == 0, kind="stable")
        computed = np.zeros(N, bool)
        computed[order[: 2 * CHUNK]] = True
        np.testing.assert_array_equal(np.asarray(lse) != 0, computed)


def np_entropy(logits):
    """``-(p log p).sum(-1)`` in float64, ``0 log 0 = 0``."""
    log_p = references.log_softmax(logits)
    p = np.exp(log_p)
    return -np.sum(p * np.where(p > 0, log_p, 0.0), axis=-1)


def jnp_entropy(logits):
    log_p = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(log_p)
    return -jnp.sum(p * jnp.where(p > 0, log_p, 0.0), axis=-1)


def banned_bias(bias):
    """``bias`` with tokens 3 and 20 banned (-inf): they add 0 to H."""
    bias = bias.copy()
    bias[[3, 20]] = -np.inf
    return bias


ENTROPY_CASES = {
    "kept_plain": (KEPT, {}),
    "recomputed_softcap_scale": (RECOMPUTED, dict(softcap=3.0, scale=0.8)),
}


class EntropyTest(parameterized.TestCase):
    # Compiled only: the sweep compiles its scans and custom VJP either way.
    @parameterized.named_parameters(*[(k, *v) for k, v in ENTROPY_CASES.items()])
    def test_values_and_gradients_equal_the_materialized_entropys(self, sizes, options):
        # An entropy bonus on the mean loss (the forward sweep's gradient
        # plus a second sweep), and a per-token mix of loss and entropy.
        h, w, bias, labels = make_inputs(4)
        bias = banned_bias(bias)
        weights = weight_patterns()["random"]
        cot = np.random.default_rng(5).standard_normal((2, B, T)).astype(np.float32)

        def fused_objective(h, w, bias):
            loss, mean = fused.fused_cross_entropy(
                h, w, labels, bias=bias, weights=weights, entropy=True,
                z_loss=1e-3, **sizes, **options,
            )  # fmt: skip
            per_token, none = fused.fused_cross_entropy(
                h, w, labels, bias=bias, weights=weights, entropy=True,
                reduction="none", z_loss=1e-3, **sizes, **options,
            )  # fmt: skip
            mix = jnp.sum(cot[0] * per_token + cot[1] * none["token_entropy"])
            return loss - 0.3 * mean["entropy"] + mix, (mean, none)

        def materialized_objective(h, w, bias):
            logits = head.unembed(h, w, bias, **options)
            loss, _ = losses.cross_entropy(logits, labels, weights=weights, z_loss=1e-3)
            per_token, _ = losses.cross_entropy(
                logits, labels, weights=weights, z_loss=1e-3, reduction="none"
            )
            ent = jnp.where(weights != 0, jnp_entropy(logits), 0.0)
            mean_ent = jnp.sum(weights * ent) / jnp.sum(weights)
            mix = jnp.sum(cot[0] * per_token + cot[1] * ent)
            return loss - 0.3 * mean_ent + mix

        (value, (mean, none)), grads = jax.jit(
            jax.value_and_grad(fused_objective, (0, 1, 2), has_aux=True)
        )(h, w, bias)
        want = np_entropy(references.unembed(h, w, bias, **options))
        want = np.where(weights != 0, want, 0.0)
        self.assertEqual(none["token_entropy"].shape, (B, T))
        np.testing.assert_allclose(none["token_entropy"], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            mean["entropy"], np.sum(weights * want) / np.sum(weights), rtol=1e-5
        )
        self.assertNotIn("token_entropy", mean)
        self.assertGreater(float(mean["entropy"]), 0.1)
        expected = jax.jit(jax.value_and_grad(materialized_objective, (0, 1, 2)))(
            h, w, bias
        )
        chex.assert_tree_all_finite(grads)
        chex.assert_trees_all_close((value, grads), expected, rtol=1e-5, atol=1e-5)
        self.assertGreater(float(jnp.abs(grads[0]).max()), 1e-2)

    def test_vocab_parallel_entropy_on_a_one_device_mesh(self):
        # The statistics combined across devices (one here) by psum/pmax.
        h, w, bias, labels = make_inputs(6)
        mesh = jax.make_mesh(
            (1, 1),
            (vocab_parallel.DATA_AXIS, vocab_parallel.MODEL_AXIS),
            (jax.sharding.AxisType.Auto,) * 2,
            devices=jax.devices()[:1],
        )
        _, metrics = jax.jit(
            lambda h, w, bias: vocab_parallel.vocab_parallel_cross_entropy(
                h, w, labels, bias=bias, mesh=mesh, entropy=True,
                reduction="none", **KEPT,
            )
        )(h, w, bias)  # fmt: skip
        want = np_entropy(references.unembed(h, w, bias))
        np.testing.assert_allclose(metrics["token_entropy"], want, rtol=1e-5)

    def test_uniform_and_one_hot_rows(self):
        # H = log V for equal logits; 0 when all but one token are banned.
        h = np.zeros((4, D), np.float32)
        w = np.ones((V, D), np.float32)
        bias = np.full(V, -np.inf, np.float32)
        bias[7] = 0.0
        _, uniform = fused.fused_cross_entropy(
            h, w, np.zeros(4, np.int32), entropy=True, reduction="none", **KEPT
        )
        # Whole vocabulary blocks of -inf: their sums are 0, not NaN.
        loss, single = fused.fused_cross_entropy(
            h, w, np.full(4, 7), bias=bias, entropy=True, reduction="none", **KEPT
        )
        np.testing.assert_array_equal(loss, 0.0)
        np.testing.assert_allclose(uniform["token_entropy"], np.log(V), rtol=1e-6)
        np.testing.assert_array_equal(single["token_entropy"], 0.0)


@pytest.mark.parametrize("name", ["entropy", "skip_zero_weights"])
def test_flags_must_be_booleans(name):
    def call():
        fused.fused_cross_entropy(
            jnp.ones((3, 4)), jnp.ones((5, 4)), jnp.zeros(3, jnp.int32), **{name: 1}
        )

    assert_raises_exactly(call, TypeError, name)
