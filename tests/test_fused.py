"""Tests for lmhead/fused.py: against numpy, the materialized path, and XLA.

The values are checked against a float64 numpy loss written from the target
distributions; the gradients against autodiff of the materialized path
(``losses.cross_entropy(head.unembed(...))``, itself tested against numpy in
test_losses.py) and against finite differences. Small vocabulary blocks make
every loop ragged: N = 21 tokens in chunks of 5, V = 37 rows in blocks of 16
(kept logits) or 7 (recomputed).
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.test_util import check_grads

from lmhead import _fused_rule, _fused_sweep, fused, head, losses
from tests import loss_scalars, references
from tests.errors import bad_input_test, rules_test

B, T, D, V = 3, 7, 8, 37
RAGGED = {"chunk_size": 5}
KEPT_BLOCK_ROWS = 16  # V = 16 + 16 + 5: a clamped, overlapping last block
RECOMPUTED = {"chunk_size": 5, "vocab_chunk_size": 7}
METRICS = ("loss", "nll", "z_loss", "accuracy", "weight_sum", "invalid_labels")


@pytest.fixture(autouse=True)
def small_blocks_and_exact_matmuls(monkeypatch):
    monkeypatch.setitem(fused.VOCAB_BLOCK_ROWS, jax.default_backend(), KEPT_BLOCK_ROWS)
    with jax.default_matmul_precision("highest"):
        yield


def make_inputs(seed=0, shape=(B, T), d=D, v=V, dtype=np.float32):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal(shape + (d,)).astype(dtype)
    w = rng.standard_normal((v, d)).astype(dtype)
    bias = rng.standard_normal(v).astype(dtype)
    labels = rng.integers(0, v, shape).astype(np.int32)
    weights = (rng.random(shape) < 0.7) * rng.uniform(0.5, 2.0, shape)
    return h, w, bias, labels, weights.astype(np.float32)


def np_loss(
    h,
    w,
    bias,
    labels,
    weights,
    *,
    label_smoothing=0.0,
    smoothing="uniform",
    z_loss=0.0,
    scale=None,
    softcap=None,
):
    """Weighted mean of the smoothed cross-entropy + z-loss, in float64."""
    logits = references.unembed(h, w, bias, scale, softcap)
    _, metrics = references.cross_entropy(
        logits, labels, weights, label_smoothing, smoothing, z_loss
    )
    return metrics["loss"]


def materialized(
    h,
    w,
    labels,
    *,
    bias=None,
    scale=None,
    softcap=None,
    chunk_size=None,
    vocab_chunk_size=None,
    **options,
):
    del chunk_size, vocab_chunk_size
    logits = head.unembed(h, w, bias, scale=scale, softcap=softcap)
    return losses.cross_entropy(logits, labels, **options)


OPTIONS = {
    "plain": {},
    "uniform_smoothing_bias_weights": dict(
        label_smoothing=0.1, bias=True, weights=True
    ),
    "normalized_smoothing_z_loss": dict(
        label_smoothing=0.2, smoothing="normalized", z_loss=1e-2, bias=True
    ),
    "softcap_scale_z_loss": dict(
        softcap=2.5, scale=0.7, z_loss=1e-3, weights=True, label_smoothing=0.05
    ),
}


def resolve(options, bias, weights):
    """Options with the ``bias``/``weights`` flags replaced by arrays."""
    options = dict(options)
    options["bias"] = bias if options.pop("bias", False) else None
    options["weights"] = weights if options.pop("weights", False) else None
    return options


class MatchesMaterializedTest(parameterized.TestCase):
    @parameterized.product(name=sorted(OPTIONS), blocks=["kept", "recomputed"])
    def test_value_metrics_and_gradients(self, name, blocks):
        h, w, bias, labels, weights = make_inputs()
        options = resolve(OPTIONS[name], bias, weights)
        sizes = RAGGED if blocks == "kept" else RECOMPUTED

        def run(loss_fn, **sizes):
            def objective(h, w, bias, weights):
                opts = dict(
                    options,
                    bias=None if options["bias"] is None else bias,
                    weights=None if options["weights"] is None else weights,
                )
                return loss_fn(h, w, labels, **opts, **sizes)

            grad_fn = jax.value_and_grad(objective, argnums=(0, 1, 2, 3), has_aux=True)
            return jax.jit(grad_fn)(h, w, bias, weights)

        (loss, metrics), grads = run(fused.fused_cross_entropy, **sizes)
        (ref_loss, ref_metrics), ref_grads = run(materialized)
        np_options = {k: v for k, v in options.items() if k != "weights"}
        np.testing.assert_allclose(
            loss,
            np_loss(h, w, labels=labels, weights=options["weights"], **np_options),
            rtol=1e-5,
        )
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        self.assertEqual(sorted(metrics), sorted(METRICS))
        for key in METRICS:
            np.testing.assert_allclose(
                metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-7, err_msg=key
            )
        for got, want, arg in zip(grads, ref_grads, ("h", "w", "bias", "weights")):
            self.assertEqual(got.dtype, want.dtype, arg)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=arg)
        # The arguments that matter do get gradients.
        self.assertGreater(np.abs(grads[0]).max(), 1e-3)
        self.assertGreater(np.abs(grads[1]).max(), 1e-3)

    @parameterized.parameters("sum", "none")
    def test_other_reductions(self, reduction):
        h, w, bias, labels, weights = make_inputs(1)

        def total(loss_fn, h, w, bias):
            loss, _ = loss_fn(
                h,
                w,
                labels,
                bias=bias,
                weights=weights,
                z_loss=1e-3,
                reduction=reduction,
                **RAGGED,
            )
            # A non-uniform cotangent for "none": not a multiple of weights.
            return jnp.sum(loss * jnp.arange(loss.size).reshape(loss.shape))

        for argnums in [(0, 1, 2)]:
            got = jax.jit(
                jax.value_and_grad(
                    functools.partial(total, fused.fused_cross_entropy), argnums
                )
            )(h, w, bias)
            want = jax.value_and_grad(functools.partial(total, materialized), argnums)(
                h, w, bias
            )
            chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
        loss, _ = fused.fused_cross_entropy(
            h, w, labels, weights=weights, reduction=reduction
        )
        self.assertEqual(loss.shape, () if reduction == "sum" else (B, T))

    def test_gradient_of_a_metric_recomputes_logits(self):
        h, w, bias, labels, weights = make_inputs(2)

        def nll_plus_loss(loss_fn, h, w):
            loss, metrics = loss_fn(
                h, w, labels, weights=weights, z_loss=0.1, **RECOMPUTED
            )
            return metrics["nll"] + 2.0 * metrics["z_loss"] + loss

        # Compiled: op by op, the fused loss's scans take seconds.
        got = jax.jit(
            jax.grad(
                functools.partial(nll_plus_loss, fused.fused_cross_entropy), (0, 1)
            )
        )(h, w)
        want = jax.grad(functools.partial(nll_plus_loss, materialized), (0, 1))(h, w)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)

    def test_tied_and_untied_tables(self):
        h, w, _, labels, _ = make_inputs(3)
        tokens = np.random.default_rng(3).integers(0, V, (B, T))

        def tied(loss_fn, table):
            # The table embeds the inputs and unembeds the outputs.
            hidden = jnp.tanh(table[tokens] + h)
            return loss_fn(hidden, table, labels, **RAGGED)[0]

        def untied(loss_fn, embed, unembed):
            return loss_fn(jnp.tanh(embed[tokens] + h), unembed, labels, **RAGGED)[0]

        grad_tied = jax.grad(functools.partial(tied, fused.fused_cross_entropy))
        want_tied = jax.grad(functools.partial(tied, materialized))(w)
        np.testing.assert_allclose(grad_tied(w), want_tied, rtol=1e-5, atol=1e-6)
        got = jax.grad(functools.partial(untied, fused.fused_cross_entropy), (0, 1))(
            w, w
        )
        want = jax.grad(functools.partial(untied, materialized), (0, 1))(w, w)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
        # Tied = the sum of the embedding and unembedding paths.
        np.testing.assert_allclose(got[0] + got[1], grad_tied(w), rtol=1e-5, atol=1e-6)


class FusedTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_leading_axes_and_block_shapes(self):
        for shape, sizes in [
            ((21,), dict(chunk_size=21)),
            ((2, 1, 5), dict(chunk_size=4)),
            ((3, 7), dict(chunk_size=100, vocab_chunk_size=37)),
            ((3, 7), dict(chunk_size=1, vocab_chunk_size=1)),
        ]:
            h, w, _, labels, _ = make_inputs(4, shape)
            fn = self.variant(functools.partial(fused.fused_cross_entropy, **sizes))
            loss, metrics = fn(h, w, labels)
            np.testing.assert_allclose(
                loss, np_loss(h, w, None, labels, None), rtol=1e-5, err_msg=str(sizes)
            )
            self.assertEqual(float(metrics["weight_sum"]), np.prod(shape))

    @chex.variants(with_jit=True, without_jit=True)
    def test_accuracy_counts_the_first_maximum_like_argmax(self):
        # Tied maxima across two vocabulary blocks and within one.
        h = np.ones((4, 1), np.float32)
        w = np.array([[1.0], [3.0], [0.0], [3.0], [3.0], [2.0]], np.float32)
        labels = np.array([1, 1, 3, 4], np.int32)  # argmax is 1: half right
        for sizes in [dict(chunk_size=3, vocab_chunk_size=2), dict(chunk_size=3)]:
            fn = self.variant(functools.partial(fused.fused_cross_entropy, **sizes))
            _, metrics = fn(h, w, labels)
            self.assertEqual(float(metrics["accuracy"]), 0.5)

    @chex.variants(with_jit=True)
    def test_invalid_labels_inside_jit_get_weight_zero(self):
        h, w, _, labels, weights = make_inputs(5)
        labels = labels.copy()
        labels[0, 0], labels[1, 2], labels[2, 3] = -1, V + 3, V
        weights[0, 0] = weights[1, 2] = weights[2, 3] = 1.0
        loss, metrics = self.variant(
            functools.partial(fused.fused_cross_entropy, **RAGGED)
        )(h, w, labels, weights=weights)
        ref_loss, ref_metrics = jax.jit(materialized)(h, w, labels, weights=weights)
        self.assertEqual(int(metrics["invalid_labels"]), 3)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        chex.assert_trees_all_close(metrics, ref_metrics, rtol=1e-5)
        self.assertTrue(np.isfinite(loss))

    @chex.variants(with_jit=True, without_jit=True)
    def test_an_ignored_label_drops_its_token(self):
        # ignore_index -100 (the default) and another, in every kind of sweep:
        # the loss and the gradients are numpy's of the other tokens alone.
        h, w, bias, labels, weights = make_inputs(7)
        ignored = np.zeros(labels.shape, bool)
        ignored[0, :3] = ignored[2, 4] = True
        kept = ~ignored
        for ignore_index, sizes in ((-100, RAGGED), (V, RECOMPUTED)):
            marked = np.where(ignored, ignore_index, labels).astype(np.int32)
            options = dict(label_smoothing=0.1, ignore_index=ignore_index, **sizes)
            loss_fn = functools.partial(fused.fused_cross_entropy, **options)
            grad = self.variant(jax.value_and_grad(loss_fn, (0, 1), has_aux=True))
            (loss, metrics), (dh, dw) = grad(h, w, marked, weights=weights)
            args = (h[kept], w, None, labels[kept], weights[kept])
            np.testing.assert_allclose(
                loss, np_loss(*args, label_smoothing=0.1), rtol=1e-5
            )
            np.testing.assert_allclose(metrics["weight_sum"], weights[kept].sum())
            self.assertEqual(int(metrics["invalid_labels"]), 0)
            dz = references.cross_entropy_gradient(
                references.unembed(h[kept], w), labels[kept], weights[kept], 0.1
            )
            np.testing.assert_allclose(dh[kept], dz @ w, rtol=1e-4, atol=1e-6)
            np.testing.assert_array_equal(dh[ignored], 0.0)
            np.testing.assert_allclose(dw, dz.T @ h[kept], rtol=1e-4, atol=1e-6)

    def test_zero_total_weight_gives_zero(self):
        h, w, _, labels, _ = make_inputs(6)
        loss, grads = jax.value_and_grad(
            lambda h: fused.fused_cross_entropy(
                h, w, labels, weights=jnp.zeros((B, T))
            )[0]
        )(h)
        self.assertEqual(float(loss), 0.0)
        self.assertEqual(float(jnp.abs(grads).max()), 0.0)

    def test_non_finite_hidden_state_of_a_zero_weight_token_is_ignored(self):
        h, w, bias, labels, weights = make_inputs(10)
        weights[1, 2] = 0.0
        poisoned = h.copy()
        poisoned[1, 2] = np.nan  # e.g. a padding id outside the embedding
        step = jax.jit(
            jax.value_and_grad(
                lambda h, w, b: fused.fused_cross_entropy(
                    h, w, labels, bias=b, weights=weights, z_loss=1e-3, **RAGGED
                ),
                (0, 1, 2),
                has_aux=True,
            )
        )
        got = step(poisoned, w, bias)
        chex.assert_tree_all_finite(got)
        chex.assert_trees_all_close(got, step(h, w, bias))
        np.testing.assert_allclose(
            got[0][0],
            materialized(h, w, labels, bias=bias, weights=weights, z_loss=1e-3)[0],
            rtol=1e-5,
        )

    def test_bfloat16_inputs_are_close_to_float32(self):
        h, w, bias, labels, weights = make_inputs(7, d=64)
        h, w = h / 4, w / 4

        def run(dtype):
            cast = [jnp.asarray(x, dtype) for x in (h, w, bias)]
            return jax.value_and_grad(
                lambda h, w, b: fused.fused_cross_entropy(
                    h, w, labels, bias=b, weights=weights, z_loss=1e-3, **RAGGED
                )[0],
                (0, 1, 2),
            )(*cast)

        loss16, grads16 = run(jnp.bfloat16)
        loss32, grads32 = run(jnp.float32)
        self.assertEqual(loss16.dtype, jnp.float32)
        self.assertEqual([g.dtype for g in grads16], [jnp.bfloat16] * 3)
        # bf16 keeps 8 bits of mantissa: inputs rounded by 2^-9 relative move
        # the loss by well under 1% and each gradient by a few percent of its
        # largest entry.
        np.testing.assert_allclose(loss16, loss32, rtol=1e-2)
        for g16, g32 in zip(grads16, grads32):
            scale = float(jnp.abs(g32).max())
            np.testing.assert_allclose(
                np.asarray(g16, np.float32), g32, atol=0.03 * scale
            )

    def test_finite_differences(self):
        h, w, bias, labels, weights = make_inputs(8, shape=(5,), d=3, v=6)

        def loss(h, w, bias):
            return fused.fused_cross_entropy(
                h,
                w,
                labels,
                bias=bias,
                weights=weights,
                label_smoothing=0.1,
                smoothing="normalized",
                z_loss=0.05,
                scale=0.9,
                softcap=3.0,
                chunk_size=2,
                vocab_chunk_size=4,
            )[0]

        # Compiled once: the finite differences call the loss many times.
        check_grads(
            jax.jit(loss), (h, w, bias), order=1, modes=("rev",), atol=1e-2, rtol=1e-2
        )

    def test_large_logits_give_finite_loss_and_gradients(self):
        h, w, _, labels, _ = make_inputs(9)
        loss, grads = jax.value_and_grad(
            lambda h: fused.fused_cross_entropy(1e3 * h, w, labels, **RECOMPUTED)[0]
        )(h)
        self.assertTrue(np.isfinite(loss))
        self.assertTrue(np.all(np.isfinite(grads)))
        np.testing.assert_allclose(loss, materialized(1e3 * h, w, labels)[0], rtol=1e-5)


class TracedLossScalarsTest(parameterized.TestCase):
    """label_smoothing and z_loss traced, one value per ensemble member."""

    def test_members_equal_single_calls(self):
        h, w, bias, labels, weights = make_inputs(11)

        def loss_and_grads(label_smoothing, z_loss):
            def loss(h, w):
                return fused.fused_cross_entropy(
                    h,
                    w,
                    labels,
                    bias=bias,
                    weights=weights,
                    label_smoothing=label_smoothing,
                    smoothing="normalized",
                    z_loss=z_loss,
                    **RAGGED,
                )

            return jax.value_and_grad(loss, (0, 1), has_aux=True)(h, w)

        # lax.map too: each member's values are then traced scalars.
        loss_scalars.assert_members_match_static_calls(
            loss_and_grads, transforms=("vmap", "map")
        )

    def test_traced_values_equal_the_static_call(self):
        h, w, _, labels, weights = make_inputs(12)

        def loss_and_grads(label_smoothing, z_loss):
            return jax.value_and_grad(
                lambda h, w: fused.fused_cross_entropy(
                    h,
                    w,
                    labels,
                    weights=weights,
                    label_smoothing=label_smoothing,
                    z_loss=z_loss,
                    **RAGGED,
                )[0],
                (0, 1),
            )(h, w)

        loss_scalars.assert_traced_equals_static(loss_and_grads, 0.1, 1e-3)

    def test_gradient_with_respect_to_the_values(self):
        h, w, bias, labels, weights = make_inputs(13)

        def scalar_grads(loss_fn):
            def loss(label_smoothing, z_loss):
                return loss_fn(
                    h,
                    w,
                    labels,
                    bias=bias,
                    weights=weights,
                    label_smoothing=label_smoothing,
                    smoothing="normalized",
                    z_loss=z_loss,
                    **RAGGED,
                )[0]

            return jax.jit(jax.grad(loss, (0, 1)))(np.float32(0.1), np.float32(1e-2))

        got = scalar_grads(fused.fused_cross_entropy)
        chex.assert_trees_all_close(got, scalar_grads(materialized), rtol=1e-5)
        self.assertTrue(all(abs(float(g)) > 1e-2 for g in got), got)


def compiled_temp_bytes(loss_fn, *args):
    step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


class MemoryTest(parameterized.TestCase):
    """Properties of the compiled programs (nothing is run or timed)."""

    def test_fused_needs_a_small_fraction_of_the_materialized_memory(self):
        h = jax.ShapeDtypeStruct((2048, 64), jnp.float32)
        w = jax.ShapeDtypeStruct((32768, 64), jnp.float32)
        labels = jax.ShapeDtypeStruct((2048,), jnp.int32)
        fused_bytes = compiled_temp_bytes(fused.fused_cross_entropy, h, w, labels)
        materialized_bytes = compiled_temp_bytes(materialized, h, w, labels)
        # The [N, V] logits alone are 256 MiB.
        self.assertGreater(materialized_bytes, 2048 * 32768 * 4)
        self.assertLess(fused_bytes, materialized_bytes / 16)

    def test_vocabulary_blocks_make_memory_independent_of_vocab_size(self):
        def temp(vocab):
            h = jax.ShapeDtypeStruct((1024, 32), jnp.float32)
            w = jax.ShapeDtypeStruct((vocab, 32), jnp.float32)
            labels = jax.ShapeDtypeStruct((1024,), jnp.int32)
            return compiled_temp_bytes(
                functools.partial(
                    fused.fused_cross_entropy, chunk_size=256, vocab_chunk_size=512
                ),
                h,
                w,
                labels,
            )

        self.assertEqual(temp(8192), temp(65536))


# ---------------------------------------------------------------------------
# bad input: each case raises exactly the expected exception type (not a
# subclass, not an error from deeper down) with a message that names the
# argument (tests/errors.py). Bad values that cannot be refused inside jit
# follow a documented rule instead (RULES), checked with and without jit:
# never a NaN.

H = jnp.ones((2, 3, 4))
W = jnp.ones((5, 4))
LABELS = jnp.zeros((2,), jnp.int32)
NEG = -float("inf")


def fused_ce(**kwargs):
    return fused.fused_cross_entropy(
        kwargs.pop("h", H[0]),
        kwargs.pop("w", W),
        kwargs.pop("labels", jnp.zeros((3,), jnp.int32)),
        **kwargs,
    )


BAD_INPUTS = [
    ("fused chunk_size 0", lambda: fused_ce(chunk_size=0), ValueError, "chunk_size"),
    ("fused chunk_size < 0", lambda: fused_ce(chunk_size=-3), ValueError, "chunk_size"),
    (
        "fused chunk_size float",
        lambda: fused_ce(chunk_size=2.5),
        TypeError,
        "chunk_size",
    ),
    (
        "fused chunk_size bool",
        lambda: fused_ce(chunk_size=True),
        TypeError,
        "chunk_size",
    ),
    (
        "fused vocab_chunk_size 0",
        lambda: fused_ce(vocab_chunk_size=0),
        ValueError,
        "vocab_chunk_size",
    ),
    (
        "fused vocab_chunk_size float",
        lambda: fused_ce(vocab_chunk_size=2.5),
        TypeError,
        "vocab_chunk_size",
    ),
    ("fused smoothing", lambda: fused_ce(smoothing="label"), ValueError, "smoothing"),
    (
        "fused label_smoothing 1",
        lambda: fused_ce(label_smoothing=1.0),
        ValueError,
        "label_smoothing",
    ),
    ("fused z_loss < 0", lambda: fused_ce(z_loss=-1.0), ValueError, "z_loss"),
    ("fused reduction", lambda: fused_ce(reduction="max"), ValueError, "reduction"),
    ("fused scale 0", lambda: fused_ce(scale=0.0), ValueError, "scale"),
    ("fused softcap 0", lambda: fused_ce(softcap=0.0), ValueError, "softcap"),
    ("fused softcap < 0", lambda: fused_ce(softcap=-1.0), ValueError, "softcap"),
    ("fused D mismatch", lambda: fused_ce(w=jnp.ones((5, 3))), ValueError, "h"),
    ("fused w rank 1", lambda: fused_ce(w=W[0]), ValueError, "w"),
    ("fused V = 0", lambda: fused_ce(w=W[:0]), ValueError, "w"),
    ("fused integer h", lambda: fused_ce(h=H[0].astype(jnp.int32)), TypeError, "h"),
    ("fused integer w", lambda: fused_ce(w=W.astype(jnp.int32)), TypeError, "w"),
    ("fused bias shape", lambda: fused_ce(bias=jnp.zeros(4)), ValueError, "bias"),
    ("fused float labels", lambda: fused_ce(labels=jnp.zeros(3)), TypeError, "labels"),
    ("fused labels shape", lambda: fused_ce(labels=LABELS), ValueError, "labels"),
    (
        "fused label = V",
        lambda: fused_ce(labels=jnp.array([0, 1, 5])),
        ValueError,
        "labels",
    ),
    (
        "fused weights shape",
        lambda: fused_ce(weights=jnp.ones(2)),
        ValueError,
        "weights",
    ),
    (
        "fused traced scale",
        lambda: jax.jit(lambda scale: fused_ce(scale=scale))(0.5),
        TypeError,
        "scale",
    ),
    (
        "fused label_smoothing not a scalar",
        lambda: fused_ce(label_smoothing=jnp.array([0.1, 0.2])),
        ValueError,
        "label_smoothing",
    ),
    (
        "fused traced z_loss not a scalar",
        lambda: jax.jit(lambda z: fused_ce(z_loss=z))(jnp.zeros(3)),
        ValueError,
        "z_loss",
    ),
]


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


RULES = [
    (
        "fused with a banned token (bias -inf)",
        lambda b: fused_ce(h=jnp.zeros((3, 4)), bias=b, labels=jnp.array([0, 2, 3]))[0],
        (jnp.array([0.0, NEG, 0.0, 0.0, 0.0]),),
        np.log(4.0),
    ),
]


test_documented_rules = rules_test(RULES)


@dataclasses.dataclass(frozen=True)
class SquaredLogitsRule(_fused_rule.Rule):
    """A loss written only as its per-chunk formula, the three members a
    rule must write, every other one the base's default: ``L_t = sum_i
    z_ti^2 / 2``, its one output ``sum_i z_ti^2`` (a sum over the
    vocabulary); ``dL/dz_ti = z_ti`` (``c z_ti`` for a cotangent ``c`` on
    the output: ``2 c z_ti``)."""

    def block_stats(self, plan, pass_, z, v0, is_new, context, previous):
        return (jnp.sum(jnp.where(is_new, z * z, 0.0), axis=0),)

    def loss(self, loss_scalars, outputs, token_inputs):
        return 0.5 * outputs[0]

    def dlogits(self, z, v0, context, outputs, coefs):
        return 2.0 * coefs[0] * z


class EngineTest(parameterized.TestCase):
    """The one sweep runs a rule it has never seen: value and gradients of
    the squared logits equal numpy's and autodiff's of the materialized
    logits, through the forward gradients and the recompute sweep."""

    @parameterized.product(blocks=["kept", "recomputed"], forward=[True, False])
    def test_a_new_loss_is_a_rule(self, blocks, forward):
        h, w, bias, _, weights = make_inputs(5)
        h, weights = h.reshape(-1, D), weights.reshape(-1)
        vocab_chunk = None if blocks == "kept" else RECOMPUTED["vocab_chunk_size"]
        options = fused.SweepOptions(
            scale=0.9, softcap=3.0, chunk_size=5, vocab_chunk_size=vocab_chunk
        )

        def fused_loss(h, w, bias):
            objective, (squares,) = _fused_sweep.run(
                options,
                SquaredLogitsRule(),
                h,
                w,
                bias,
                jnp.asarray(weights),
                ((), ()),
                grads_in_forward=forward,
            )
            # A cotangent on the output too: the recompute sweep's work.
            return objective + jnp.sum(jnp.arange(len(h)) * squares)

        def reference(h, w, bias):
            # A token of weight 0 adds nothing to a gradient (the engine's rule).
            z = head.unembed(h, w, bias, scale=0.9, softcap=3.0)
            squares = jnp.sum(z * z, axis=-1)
            cotangent = jnp.arange(len(h)) * (weights != 0)
            return jnp.sum(weights * 0.5 * squares + cotangent * squares)

        z = references.unembed(h, w, bias, scale=0.9, softcap=3.0)
        squares = np.sum(z.astype(np.float64) ** 2, axis=-1)
        expected = np.sum(weights * 0.5 * squares + np.arange(len(h)) * squares)
        value, grads = jax.jit(jax.value_and_grad(fused_loss, (0, 1, 2)))(h, w, bias)
        np.testing.assert_allclose(value, expected, rtol=1e-5)
        want = jax.grad(reference, (0, 1, 2))(h, w, bias)
        chex.assert_trees_all_close(grads, want, rtol=2e-5, atol=1e-4)


class SweepOptionsTest(parameterized.TestCase):
    """The one options object: checked when built, hashable, one plan."""

    def test_equal_options_are_one_static_argument(self):
        numpy_typed = fused.SweepOptions(
            scale=np.float32(0.5), chunk_size=np.int64(8), filter_eps=np.float64(0.25)
        )
        plain = fused.SweepOptions(scale=0.5, chunk_size=8, filter_eps=0.25)
        self.assertEqual(numpy_typed, plain)
        self.assertEqual(hash(numpy_typed), hash(plain))
        traced = []

        @functools.partial(jax.jit, static_argnums=0)
        def scaled(options, x):
            traced.append(options)
            return x * options.scale

        scaled(numpy_typed, 1.0), scaled(plain, 1.0)
        self.assertLen(traced, 1)

    def test_the_plan_folds_the_temperature_and_fills_the_defaults(self):
        options = fused.SweepOptions(
            scale=0.5, softcap=4.0, temperature=2.0, filter_eps="auto"
        )
        plan = options.plan(
            SquaredLogitsRule(), 21, V, jnp.bfloat16, grads_in_forward=True
        )
        self.assertEqual((plan.scale, plan.softcap), (0.25, 2.0))
        self.assertEqual(plan.filter_eps, float(jnp.finfo(jnp.bfloat16).eps) / 32)
        # 21 tokens: one chunk of them all; V rows in blocks of 16, kept.
        self.assertEqual((plan.chunk_size, plan.block_rows), (21, KEPT_BLOCK_ROWS))
        self.assertTrue(plan.keep_logits)
        np.testing.assert_array_equal(
            options.tempered_bias(jnp.array([1.0, -2.0])), [0.5, -1.0]
        )
