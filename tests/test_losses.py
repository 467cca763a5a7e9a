"""Tests for lmhead/losses.py against numpy formulas, optax and brute force."""

import functools
import math

import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st
from jax.experimental import checkify
from jax.test_util import check_grads

from lmhead import head, losses
from tests import loss_scalars, references
from tests.errors import bad_input_test, rules_test

SETTINGS = hypothesis.settings(max_examples=25, deadline=None)


def random_case(seed, shape=(2, 3), vocab_size=7, scale=3.0):
    rng = np.random.default_rng(seed)
    logits = (scale * rng.standard_normal(shape + (vocab_size,))).astype(np.float32)
    labels = rng.integers(0, vocab_size, shape).astype(np.int32)
    weights = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    weights.flat[::4] = 0.0  # some padding
    return logits, labels, weights


def assert_metrics_close(got, want, rtol=1e-5, atol=1e-5):
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)


class CrossEntropyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_numpy_for_each_option(self):
        logits, labels, weights = random_case(0)
        for eps, smoothing, z_loss in [
            (0.0, "uniform", 0.0),
            (0.1, "uniform", 0.0),
            (0.2, "normalized", 0.0),
            (0.1, "normalized", 1e-2),
            (0.3, "uniform", 1e-1),
        ]:
            fn = self.variant(
                functools.partial(
                    losses.cross_entropy,
                    label_smoothing=eps,
                    smoothing=smoothing,
                    z_loss=z_loss,
                )
            )
            loss, metrics = fn(logits, labels, weights=weights)
            _, want = references.cross_entropy(
                logits, labels, weights, eps, smoothing, z_loss
            )
            msg = f"{eps} {smoothing} {z_loss}"
            np.testing.assert_allclose(loss, want["loss"], rtol=1e-5, err_msg=msg)
            assert_metrics_close(metrics, want)
            self.assertEqual(int(metrics["invalid_labels"]), 0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_uniform_smoothing_is_optax_smooth_labels(self):
        logits, labels, _ = random_case(1)
        eps = 0.25
        targets = optax.smooth_labels(jax.nn.one_hot(labels, 7), eps)
        want = optax.softmax_cross_entropy(logits, targets)
        fn = self.variant(
            functools.partial(
                losses.cross_entropy, label_smoothing=eps, reduction="none"
            )
        )
        got, _ = fn(logits, labels)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_normalized_smoothing_is_optax_minus_entropy(self):
        logits, labels, _ = random_case(2)
        eps, vocab_size = 0.2, 7
        onehot = jax.nn.one_hot(labels, vocab_size)
        targets = onehot * (1 - eps) + (1 - onehot) * eps / (vocab_size - 1)
        want = optax.softmax_cross_entropy(logits, targets) - references.target_entropy(
            vocab_size, eps
        )
        fn = self.variant(
            functools.partial(
                losses.cross_entropy,
                label_smoothing=eps,
                smoothing="normalized",
                reduction="none",
            )
        )
        got, _ = fn(logits, labels)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_z_loss_adds_z_times_lse_squared(self):
        logits, labels, _ = random_case(3)
        without, m0 = self.variant(
            functools.partial(losses.cross_entropy, reduction="none")
        )(logits, labels)
        with_z, m1 = self.variant(
            functools.partial(losses.cross_entropy, z_loss=0.1, reduction="none")
        )(logits, labels)
        lse = references.logsumexp(logits)
        np.testing.assert_allclose(with_z - without, 0.1 * lse**2, rtol=1e-5)
        self.assertEqual(float(m0["z_loss"]), 0.0)
        np.testing.assert_allclose(m1["z_loss"], np.mean(0.1 * lse**2), rtol=1e-5)
        # The nll metric is the same with and without the z-loss.
        np.testing.assert_allclose(m1["nll"], m0["nll"], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_reductions(self):
        logits, labels, weights = random_case(4)
        per_token, want = references.cross_entropy(logits, labels, weights, 0.1)
        results = {}
        for reduction in losses.REDUCTIONS:
            fn = self.variant(
                functools.partial(
                    losses.cross_entropy, label_smoothing=0.1, reduction=reduction
                )
            )
            results[reduction], _ = fn(logits, labels, weights=weights)
        self.assertEqual(results["none"].shape, labels.shape)
        np.testing.assert_allclose(
            results["none"], weights * per_token, rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            results["sum"], (weights * per_token).sum(), rtol=1e-5
        )
        np.testing.assert_allclose(results["mean"], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(
            results["mean"], results["sum"] / weights.sum(), rtol=1e-5
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_no_weights_is_plain_mean(self):
        logits, labels, _ = random_case(5, shape=(4,))
        loss, metrics = self.variant(losses.cross_entropy)(logits, labels)
        nll = -references.log_softmax(logits)[np.arange(4), labels]
        np.testing.assert_allclose(loss, nll.mean(), rtol=1e-5)
        self.assertEqual(float(metrics["weight_sum"]), 4.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_accuracy_counts_weighted_argmax_hits(self):
        logits = np.array(
            [[3.0, 0.0, 1.0], [0.0, 2.0, 1.0], [0.0, 1.0, 5.0], [1.0, 0.0, 0.0]],
            np.float32,
        )
        labels = np.array([0, 2, 2, 1], np.int32)
        weights = np.array([1.0, 1.0, 2.0, 0.0], np.float32)
        _, metrics = self.variant(losses.cross_entropy)(logits, labels, weights=weights)
        np.testing.assert_allclose(metrics["accuracy"], 3.0 / 4.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_all_zero_weights_give_zero_and_finite_gradient(self):
        logits, labels, _ = random_case(6)
        weights = np.zeros(labels.shape, np.float32)

        def objective(z):
            return losses.cross_entropy(
                z, labels, weights=weights, label_smoothing=0.1, z_loss=1e-3
            )

        (loss, metrics), grad = self.variant(
            jax.value_and_grad(objective, has_aux=True)
        )(logits)
        self.assertEqual(float(loss), 0.0)
        for name in ("loss", "nll", "z_loss", "accuracy", "weight_sum"):
            self.assertEqual(float(metrics[name]), 0.0, name)
        np.testing.assert_array_equal(grad, np.zeros_like(logits))

    @chex.variants(with_jit=True, without_jit=True)
    def test_bf16_logits_equal_float32_of_the_rounded_logits(self):
        logits, labels, weights = random_case(7)
        rounded = jnp.asarray(logits, jnp.bfloat16)
        fn = self.variant(
            functools.partial(losses.cross_entropy, z_loss=1e-3, label_smoothing=0.1)
        )
        loss, metrics = fn(rounded, labels, weights=weights)
        _, want = references.cross_entropy(
            np.asarray(rounded, np.float32), labels, weights, 0.1, "uniform", 1e-3
        )
        self.assertEqual(loss.dtype, jnp.float32)
        assert_metrics_close(metrics, want)


class GradientTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_gradient_is_softmax_minus_target(self):
        # d/dz [-sum_i t_i log p_i + z lse^2] = p - t + 2 z lse p, weighted.
        logits, labels, weights = random_case(8)
        eps, z_loss = 0.2, 0.05
        for smoothing in losses.SMOOTHINGS:

            def objective(z, s=smoothing):
                return losses.cross_entropy(
                    z,
                    labels,
                    weights=weights,
                    label_smoothing=eps,
                    smoothing=s,
                    z_loss=z_loss,
                )[0]

            grad = self.variant(jax.grad(objective))(logits)
            want = references.cross_entropy_gradient(
                logits, labels, weights, eps, smoothing, z_loss
            )
            np.testing.assert_allclose(
                grad, want, rtol=1e-4, atol=1e-6, err_msg=smoothing
            )

    def test_check_grads(self):
        logits, labels, weights = random_case(9, shape=(3,), vocab_size=4, scale=1.0)
        for smoothing in losses.SMOOTHINGS:
            objective = jax.jit(
                lambda z, s=smoothing: losses.cross_entropy(
                    z,
                    labels,
                    weights=weights,
                    label_smoothing=0.1,
                    smoothing=s,
                    z_loss=1e-2,
                )[0]
            )
            check_grads(
                objective,
                (logits,),
                order=2,
                modes=["rev"],
                eps=1e-2,
                atol=2e-2,
                rtol=2e-2,
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_finite_at_extreme_and_bf16_logits(self):
        labels = np.array([0, 1, 2], np.int32)
        extreme = np.array(
            [[1e4, -1e4, 0.0], [1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]], np.float32
        )

        def objective(z):
            return losses.cross_entropy(
                z, labels, label_smoothing=0.1, smoothing="normalized", z_loss=1e-4
            )[0]

        fn = self.variant(jax.value_and_grad(objective))
        for logits in (
            extreme,
            jnp.asarray(extreme, jnp.bfloat16),
            jnp.asarray(random_case(10, (3,), 3)[0], jnp.bfloat16),
        ):
            loss, grad = fn(logits)
            self.assertTrue(np.isfinite(float(loss)))
            self.assertEqual(grad.dtype, logits.dtype)
            self.assertTrue(np.all(np.isfinite(np.asarray(grad, np.float32))))
        # The extreme value: token 1's label logit is 2e4 below the maximum.
        loss, _ = fn(extreme)
        _, want = references.cross_entropy(
            extreme, labels, None, 0.1, "normalized", 1e-4
        )
        np.testing.assert_allclose(loss, want["loss"], rtol=1e-5)


class TracedLossScalarsTest(chex.TestCase):
    """label_smoothing and z_loss traced, one value per ensemble member."""

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(14)
        self.h = rng.standard_normal((2, 3, 4)).astype(np.float32)
        self.w = rng.standard_normal((7, 4)).astype(np.float32)
        self.labels = rng.integers(0, 7, (2, 3)).astype(np.int32)
        self.weights = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)

    def loss_and_grads(self, smoothing):
        def loss(h, w, label_smoothing, z_loss):
            return losses.cross_entropy(
                head.unembed(h, w),
                self.labels,
                weights=self.weights,
                label_smoothing=label_smoothing,
                smoothing=smoothing,
                z_loss=z_loss,
            )

        grad_fn = jax.value_and_grad(loss, (0, 1), has_aux=True)
        return lambda eps, z: grad_fn(self.h, self.w, eps, z)

    def test_members_equal_single_calls(self):
        loss_scalars.assert_members_match_static_calls(
            self.loss_and_grads("uniform"), transforms=("vmap", "map")
        )

    def test_traced_values_equal_the_static_call(self):
        loss_scalars.assert_traced_equals_static(
            self.loss_and_grads("normalized"), 0.1, 1e-3
        )

    def test_gradient_with_respect_to_the_values(self):
        logits = references.unembed(self.h, self.w, None, None, None)

        def reference(eps, z, smoothing):
            _, metrics = references.cross_entropy(
                logits, self.labels, self.weights, eps, smoothing, z
            )
            return metrics["loss"]

        @jax.jit
        def grads(eps, z):
            return {
                smoothing: jax.grad(
                    lambda e, z, s=smoothing: losses.cross_entropy(
                        logits.astype(np.float32),
                        self.labels,
                        weights=self.weights,
                        label_smoothing=e,
                        smoothing=s,
                        z_loss=z,
                    )[0],
                    (0, 1),
                )(eps, z)
                for smoothing in losses.SMOOTHINGS
            }

        eps, z, step = 0.1, 1e-2, 1e-5
        for smoothing, got in grads(np.float32(eps), np.float32(z)).items():
            # Central differences of the float64 reference.
            want = (
                (
                    reference(eps + step, z, smoothing)
                    - reference(eps - step, z, smoothing)
                )
                / (2 * step),
                (
                    reference(eps, z + step, smoothing)
                    - reference(eps, z - step, smoothing)
                )
                / (2 * step),
            )
            np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=smoothing)


class InvalidLabelsTest(chex.TestCase):
    def test_eager_padding_label_with_zero_weight_is_allowed(self):
        logits, labels, _ = random_case(12, shape=(3,))
        padded = labels.copy()
        padded[1] = -100
        weights = np.array([1.0, 0.0, 1.0], np.float32)
        loss, metrics = losses.cross_entropy(logits, padded, weights=weights)
        _, want = references.cross_entropy(logits, labels, weights, 0.0)
        np.testing.assert_allclose(loss, want["loss"], rtol=1e-5)
        self.assertEqual(int(metrics["invalid_labels"]), 0)

    def test_inside_jit_weight_zero_and_counted(self):
        logits, labels, weights = random_case(11, shape=(6,))
        weights[:] = [1.0, 2.0, 0.0, 1.0, 0.5, 1.0]
        bad = labels.copy()
        bad[[1, 2, 4]] = [7, -3, 100]  # token 2 is padding: not counted
        loss, metrics = jax.jit(
            functools.partial(losses.cross_entropy, label_smoothing=0.1)
        )(logits, bad, weights=weights)
        kept = weights.copy()
        kept[[1, 2, 4]] = 0.0
        _, want = references.cross_entropy(logits, labels, kept, 0.1)
        np.testing.assert_allclose(loss, want["loss"], rtol=1e-5)
        assert_metrics_close(metrics, want)
        self.assertEqual(int(metrics["invalid_labels"]), 2)

    def test_checkify_reports_out_of_range(self):
        checked = checkify.checkify(jax.jit(lambda y: losses.check_labels(y, 5)))
        err, _ = checked(jnp.array([[0, 4], [5, -1]]))
        self.assertIsNotNone(err.get())
        self.assertIn("labels must be in [0, 5)", err.get())
        self.assertIn("found 2", err.get())
        err, _ = checked(jnp.array([[0, 4], [3, 1]]))
        self.assertIsNone(err.get())


@SETTINGS
@hypothesis.given(
    vocab_size=st.sampled_from([2, 3, 8]),
    eps=st.floats(0.01, 0.95),
    shift=st.floats(-50.0, 50.0),
    data=st.data(),
)
def test_normalized_loss_is_zero_at_the_smoothed_target(vocab_size, eps, shift, data):
    labels = np.array(
        data.draw(st.lists(st.integers(0, vocab_size - 1), min_size=3, max_size=3)),
        np.int32,
    )
    logits = (
        np.log(references.smoothed_targets(labels, vocab_size, eps, "normalized"))
        + shift
    )
    loss, metrics = losses.cross_entropy(
        logits.astype(np.float32), labels, label_smoothing=eps, smoothing="normalized"
    )
    np.testing.assert_allclose(loss, 0.0, atol=2e-5)
    # Anywhere else it is larger (Gibbs' inequality).
    other, _ = losses.cross_entropy(
        (logits + np.eye(vocab_size)[(labels + 1) % vocab_size]).astype(np.float32),
        labels,
        label_smoothing=eps,
        smoothing="normalized",
    )
    assert float(other) > float(loss)


@SETTINGS
@hypothesis.given(
    raw=hnp.arrays(np.float32, (4, 6), elements=st.floats(-30, 30, width=32)),
    z_loss=st.floats(1e-4, 1.0),
)
def test_z_loss_is_zero_when_lse_is_zero(raw, z_loss):
    logits = np.asarray(jax.nn.log_softmax(raw), np.float32)  # lse == 0
    labels = np.zeros(4, np.int32)
    base, _ = losses.cross_entropy(logits, labels)
    loss, metrics = losses.cross_entropy(logits, labels, z_loss=z_loss)
    assert abs(float(metrics["z_loss"])) < 1e-8
    np.testing.assert_allclose(loss, base, rtol=1e-6, atol=1e-7)


@SETTINGS
@hypothesis.given(
    logits=hnp.arrays(np.float32, (3, 5), elements=st.floats(-1e4, 1e4, width=32)),
    labels=hnp.arrays(np.int32, (3,), elements=st.integers(0, 4)),
    eps=st.floats(0.0, 0.99),
    smoothing=st.sampled_from(losses.SMOOTHINGS),
    z_loss=st.sampled_from([0.0, 1e-4]),
)
def test_loss_is_non_negative_and_finite(logits, labels, eps, smoothing, z_loss):
    loss, metrics = losses.cross_entropy(
        logits, labels, label_smoothing=eps, smoothing=smoothing, z_loss=z_loss
    )
    assert np.isfinite(float(loss))
    # Float32 rounding of terms as large as the logits is the only slack.
    assert float(loss) >= -1e-6 * (1.0 + np.abs(logits).max())
    assert float(metrics["nll"]) >= 0.0


class SummaryMetricsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_perplexity_and_bits(self):
        nll = np.array([0.0, 1.0, 2.5], np.float32)
        np.testing.assert_allclose(
            self.variant(losses.perplexity)(nll), np.exp(nll), rtol=1e-6
        )
        np.testing.assert_allclose(
            self.variant(losses.bits_per_token)(nll), nll / math.log(2), rtol=1e-6
        )
        bpc = self.variant(
            functools.partial(losses.bits_per_character, chars_per_token=3.5)
        )(nll)
        np.testing.assert_allclose(bpc, nll / math.log(2) / 3.5, rtol=1e-6)


class CalibrationTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_numpy_loop(self):
        for seed, num_bins in [(12, 15), (13, 4), (14, 1)]:
            logits, labels, weights = random_case(
                seed, shape=(8, 9), vocab_size=5, scale=1.5
            )
            for w in (None, weights):
                fn = self.variant(
                    functools.partial(
                        losses.expected_calibration_error, num_bins=num_bins
                    )
                )
                got = fn(logits, labels, w)
                want = references.expected_calibration_error(
                    logits, labels, w, num_bins
                )
                self.assertGreater(want, 0.0)
                np.testing.assert_allclose(
                    got, want, rtol=1e-5, atol=1e-6, err_msg=f"{seed} {num_bins}"
                )

    @chex.variants(with_jit=True, without_jit=True)
    def test_bins_add_over_batches(self):
        first = random_case(15, shape=(4, 9), vocab_size=5, scale=1.5)
        second = random_case(16, shape=(4, 9), vocab_size=5, scale=1.5)
        bins = self.variant(functools.partial(losses.calibration_bins, num_bins=10))
        total = bins(*first) + bins(*second)
        got = losses.calibration_error_from_bins(total)
        joined = [np.concatenate(pair) for pair in zip(first, second)]
        np.testing.assert_allclose(
            got, references.expected_calibration_error(*joined, 10), rtol=1e-5
        )
        np.testing.assert_allclose(
            got, losses.expected_calibration_error(*joined, num_bins=10), rtol=1e-5
        )

    def test_bins_are_closed_on_the_right(self):
        # Confidences exactly 1/4, 1/2 and 1 fall in (0, 1/4], (1/4, 1/2] and
        # (3/4, 1] of four bins.
        logits = np.array(
            [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -1e4, -1e4], [1e4, 0.0, 0.0, 0.0]],
            np.float32,
        )
        labels = np.array([1, 0, 0], np.int32)
        weights = np.array([1.0, 2.0, 3.0], np.float32)
        bins = losses.calibration_bins(logits, labels, weights, num_bins=4)
        np.testing.assert_allclose(
            bins, [[1.0, 0.25, 0.0], [2.0, 1.0, 2.0], [0.0, 0.0, 0.0], [3.0, 3.0, 3.0]]
        )

    def test_perfectly_calibrated_and_empty(self):
        # Four tokens at confidence 0.75, three of them right: ECE is 0.
        logits = np.log(np.array([[0.75, 0.25]] * 4, np.float32))
        labels = np.array([0, 0, 0, 1], np.int32)
        np.testing.assert_allclose(
            losses.expected_calibration_error(logits, labels), 0.0, atol=1e-6
        )
        np.testing.assert_allclose(
            losses.expected_calibration_error(logits, labels, np.zeros(4, np.float32)),
            0.0,
        )


def test_non_finite_logits_of_zero_weight_tokens_do_not_reach_the_loss():
    logits, labels, _ = random_case(13, shape=(3,))
    poisoned = logits.copy()
    poisoned[1] = np.nan  # e.g. the logits of a padding id outside the table
    weights = np.array([1.0, 0.0, 1.0], np.float32)
    for reduction in ("mean", "sum", "none"):
        got, metrics = losses.cross_entropy(
            poisoned, labels, weights=weights, reduction=reduction
        )
        want, _ = losses.cross_entropy(
            logits, labels, weights=weights, reduction=reduction
        )
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert all(np.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------------------
# bad input: each case raises exactly the expected exception type (not a
# subclass, not an error from deeper down) with a message that names the
# argument (tests/errors.py). Bad values that cannot be refused inside jit
# follow a documented rule instead (RULES), checked with and without jit:
# never a NaN.

LOGITS = jnp.zeros((2, 5))
LABELS = jnp.zeros((2,), jnp.int32)
LOGITS_3D = jnp.zeros((2, 3, 5))
LABELS_2D = jnp.zeros((2, 3), jnp.int32)
NAN, INF = float("nan"), float("inf")
NEG = -float("inf")


def ce(logits=LOGITS, labels=LABELS, **kwargs):
    return losses.cross_entropy(logits, labels, **kwargs)


def ece(**kwargs):
    return losses.expected_calibration_error(LOGITS, LABELS, **kwargs)


BAD_INPUTS = [
    (
        "cross_entropy float labels",
        lambda: ce(labels=jnp.zeros(2)),
        TypeError,
        "labels",
    ),
    (
        "cross_entropy labels shape",
        lambda: ce(labels=jnp.zeros(3, jnp.int32)),
        ValueError,
        "labels",
    ),
    (
        "cross_entropy labels extra axis",
        lambda: ce(labels=LABELS[:, None]),
        ValueError,
        "labels",
    ),
    ("cross_entropy scalar labels", lambda: ce(labels=LABELS[0]), ValueError, "labels"),
    (
        "cross_entropy weights shape",
        lambda: ce(weights=jnp.ones(3)),
        ValueError,
        "weights",
    ),
    (
        "cross_entropy weights transposed",
        lambda: ce(LOGITS_3D, LABELS_2D, weights=jnp.ones((3, 2))),
        ValueError,
        "weights",
    ),
    (
        "cross_entropy negative weight",
        lambda: ce(weights=jnp.array([1.0, -1.0])),
        ValueError,
        "weights",
    ),
    (
        "cross_entropy NaN weight",
        lambda: ce(weights=jnp.array([1.0, NAN])),
        ValueError,
        "weights",
    ),
    (
        "cross_entropy label = V",
        lambda: ce(labels=jnp.array([0, 5])),
        ValueError,
        "labels",
    ),
    (
        "cross_entropy label < 0",
        lambda: ce(labels=jnp.array([-1, 0])),
        ValueError,
        "labels",
    ),
    (
        "cross_entropy label_smoothing 1",
        lambda: ce(label_smoothing=1.0),
        ValueError,
        "label_smoothing",
    ),
    (
        "cross_entropy label_smoothing < 0",
        lambda: ce(label_smoothing=-0.1),
        ValueError,
        "label_smoothing",
    ),
    ("cross_entropy smoothing", lambda: ce(smoothing="soft"), ValueError, "smoothing"),
    ("cross_entropy z_loss < 0", lambda: ce(z_loss=-1e-4), ValueError, "z_loss"),
    ("cross_entropy reduction", lambda: ce(reduction="avg"), ValueError, "reduction"),
    ("cross_entropy integer logits", lambda: ce(LABELS[:, None]), TypeError, "logits"),
    ("cross_entropy V = 0", lambda: ce(LOGITS[:, :0]), ValueError, "logits"),
    (
        "cross_entropy V = 0 in jit",
        lambda: jax.jit(losses.cross_entropy)(LOGITS[:, :0], LABELS),
        ValueError,
        "logits",
    ),
    ("ece num_bins 0", lambda: ece(num_bins=0), ValueError, "num_bins"),
    ("ece num_bins < 0", lambda: ece(num_bins=-2), ValueError, "num_bins"),
    ("ece num_bins float", lambda: ece(num_bins=2.5), TypeError, "num_bins"),
    ("ece num_bins bool", lambda: ece(num_bins=True), TypeError, "num_bins"),
    (
        "ece bins [M, 2]",
        lambda: losses.calibration_error_from_bins(jnp.ones((3, 2))),
        ValueError,
        "bins",
    ),
    (
        "ece negative bins",
        lambda: losses.calibration_error_from_bins(jnp.array([[-1.0, 0.5, 0.0]])),
        ValueError,
        "bins",
    ),
    (
        "bits_per_character 0 chars",
        lambda: losses.bits_per_character(1.0, 0.0),
        ValueError,
        "chars_per_token",
    ),
    (
        "bits_per_character inf chars",
        lambda: losses.bits_per_character(1.0, INF),
        ValueError,
        "chars_per_token",
    ),
]


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


RULES = [
    # losses.cross_entropy: a label of logit -inf has probability 0.
    (
        "cross_entropy of a row of -inf",
        lambda z, y: losses.cross_entropy(z, y, reduction="none")[0],
        (jnp.array([[NEG, NEG], [0.0, 0.0]]), jnp.array([0, 1])),
        np.array([INF, np.log(2.0)]),
    ),
    (
        "cross_entropy of a label of logit -inf",
        lambda z, y: losses.cross_entropy(z, y, reduction="none")[0],
        (jnp.array([[NEG, 0.0]]), jnp.array([0])),
        np.array([INF]),
    ),
    # A -inf logit off the label (a banned token) is no concern of the loss:
    # log 2 of the two live tokens, also where the z-loss and smoothing
    # coefficients are 0 (0 * inf used to give NaN).
    (
        "cross_entropy with a banned token",
        lambda z, y: losses.cross_entropy(z, y)[0],
        (jnp.array([[0.0, NEG, 0.0]]), jnp.array([0])),
        np.log(2.0),
    ),
    (
        "cross_entropy padding row of -inf",
        lambda z, y, w: losses.cross_entropy(
            z, y, weights=w, label_smoothing=0.1, z_loss=1e-4
        )[0],
        (jnp.array([[NEG, NEG], [0.0, 0.0]]), jnp.array([0, 1]), jnp.array([0.0, 1.0])),
        np.log(2.0) + 1e-4 * np.log(2.0) ** 2,
    ),
    # A row of -inf has confidence 0 and is never correct: bin 0, weight 1.
    (
        "calibration_bins of a row of -inf",
        lambda z, y: losses.calibration_bins(z, y, num_bins=2),
        (jnp.full((1, 3), NEG), jnp.array([0])),
        np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
    ),
]


test_documented_rules = rules_test(RULES)


def test_padding_row_of_neg_inf_has_zero_gradient():
    def loss(z):
        return losses.cross_entropy(
            z,
            jnp.array([0, 1]),
            weights=jnp.array([0.0, 1.0]),
            label_smoothing=0.1,
            z_loss=1e-4,
        )[0]

    grad = np.asarray(jax.grad(loss)(jnp.array([[NEG, NEG], [0.0, 1.0]])))
    assert np.all(np.isfinite(grad)), grad
    np.testing.assert_array_equal(grad[0], 0.0)
