"""Tests for lmhead/losses.py against numpy formulas, optax and brute force.

Extreme and half-precision logits, and a batch of weight 0, are checked in
test_numerics.py for the three loss paths, this one included.
"""

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

from lmhead import head, losses, metrics
from tests import loss_scalars, references
from tests.errors import bad_input_test, keyword_rows, rules_test

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


# label_smoothing, smoothing, z_loss, weighted, dtype of the logits
CASES = [
    (0.0, "uniform", 0.0, False, jnp.float32),
    (0.1, "uniform", 0.0, True, jnp.float32),
    (0.2, "normalized", 0.0, True, jnp.float32),
    (0.1, "normalized", 1e-2, True, jnp.float32),
    (0.3, "uniform", 1e-1, False, jnp.float32),
    (0.1, "uniform", 1e-3, True, jnp.bfloat16),
]


class CrossEntropyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_value_metrics_and_gradient_match_numpy_for_each_option(self):
        # d/dz [-sum_i t_i log p_i + z lse^2] = p - t + 2 z lse p, weighted.
        logits, labels, weights = random_case(0)
        # The "uniform" targets are optax's smoothed labels (PyTorch's rule).
        np.testing.assert_allclose(
            references.smoothed_targets(labels, 7, 0.25, "uniform"),
            optax.smooth_labels(jax.nn.one_hot(labels, 7), 0.25),
            rtol=1e-6,
        )
        for eps, smoothing, z_loss, weighted, dtype in CASES:
            w = weights if weighted else None
            options = dict(label_smoothing=eps, smoothing=smoothing, z_loss=z_loss)
            (loss, metrics), grad = self.variant(
                jax.value_and_grad(
                    lambda z, w=w, o=options: losses.cross_entropy(
                        z, labels, weights=w, **o
                    ),
                    has_aux=True,
                )
            )(jnp.asarray(logits, dtype))
            # bf16 logits give the float32 loss of the rounded logits.
            rounded = np.asarray(jnp.asarray(logits, dtype), np.float32)
            reference = (rounded, labels, w, eps, smoothing, z_loss)
            _, want = references.cross_entropy(*reference)
            msg = f"{eps} {smoothing} {z_loss} {weighted} {dtype.__name__}"
            self.assertEqual(loss.dtype, jnp.float32)
            self.assertEqual(grad.dtype, dtype)
            np.testing.assert_allclose(loss, want["loss"], rtol=1e-5, err_msg=msg)
            assert_metrics_close(metrics, want)
            self.assertEqual(int(metrics["invalid_labels"]), 0)
            np.testing.assert_allclose(
                np.asarray(grad, np.float32),
                references.cross_entropy_gradient(*reference),
                rtol=1e-4 if dtype == jnp.float32 else 1e-2,
                atol=1e-6 if dtype == jnp.float32 else 1e-3,
                err_msg=msg,
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_reductions(self):
        logits, labels, weights = random_case(4)
        per_token, want = references.cross_entropy(logits, labels, weights, 0.1)
        results = {}
        for reduction in losses.REDUCTIONS:
            fn = functools.partial(
                losses.cross_entropy, label_smoothing=0.1, reduction=reduction
            )
            results[reduction], _ = self.variant(fn)(logits, labels, weights=weights)
        self.assertEqual(results["none"].shape, labels.shape)
        np.testing.assert_allclose(
            results["none"], weights * per_token, rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            results["sum"], (weights * per_token).sum(), rtol=1e-5
        )
        np.testing.assert_allclose(results["mean"], want["loss"], rtol=1e-5)

    def test_second_order_gradients(self):
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


class TracedLossScalarsTest(chex.TestCase):
    """label_smoothing and z_loss traced, one value per ensemble member."""

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(14)
        self.h = rng.standard_normal((2, 3, 4)).astype(np.float32)
        self.w = rng.standard_normal((7, 4)).astype(np.float32)
        self.labels = rng.integers(0, 7, (2, 3)).astype(np.int32)
        self.weights = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)

    def loss(self, logits, label_smoothing, z_loss, smoothing="uniform"):
        return losses.cross_entropy(
            logits,
            self.labels,
            weights=self.weights,
            label_smoothing=label_smoothing,
            smoothing=smoothing,
            z_loss=z_loss,
        )

    def test_members_equal_single_calls(self):
        # Under lax.map each member's values are traced scalars.
        grad_fn = jax.value_and_grad(
            lambda h, w, e, z: self.loss(head.unembed(h, w), e, z), (0, 1), has_aux=True
        )
        loss_scalars.assert_members_match_static_calls(
            lambda e, z: grad_fn(self.h, self.w, e, z), transforms=("vmap", "map")
        )

    def test_gradient_with_respect_to_the_values(self):
        logits = references.unembed(self.h, self.w)

        def reference(eps, z, smoothing):
            return references.cross_entropy(
                logits, self.labels, self.weights, eps, smoothing, z
            )[1]["loss"]

        @jax.jit
        def grads(eps, z):
            return {
                s: jax.grad(
                    lambda e, z, s=s: self.loss(logits.astype(np.float32), e, z, s)[0],
                    (0, 1),
                )(eps, z)
                for s in losses.SMOOTHINGS
            }

        eps, z, step = 0.1, 1e-2, 1e-5
        for smoothing, got in grads(np.float32(eps), np.float32(z)).items():
            # Central differences of the float64 reference.
            want = [
                (reference(*up, smoothing) - reference(*down, smoothing)) / (2 * step)
                for up, down in (
                    ((eps + step, z), (eps - step, z)),
                    ((eps, z + step), (eps, z - step)),
                )
            ]
            np.testing.assert_allclose(got, want, rtol=1e-4, err_msg=smoothing)


class InvalidLabelsTest(chex.TestCase):
    def test_padding_label_of_weight_zero_is_allowed_and_others_counted_in_jit(self):
        logits, labels, _ = random_case(12, shape=(6,))
        weights = np.array([1.0, 2.0, 0.0, 1.0, 0.5, 1.0], np.float32)
        padded = labels.copy()
        padded[2] = -100
        loss, metrics = losses.cross_entropy(logits, padded, weights=weights)
        _, want = references.cross_entropy(logits, labels, weights, 0.0)
        np.testing.assert_allclose(loss, want["loss"], rtol=1e-5)
        self.assertEqual(int(metrics["invalid_labels"]), 0)
        # Inside jit an out-of-range label gets weight 0 and is counted.
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
        self.assertIn("labels must be in [0, 5) or equal ignore_index=-100", err.get())
        self.assertIn("found 2", err.get())
        err, _ = checked(jnp.array([[0, 4], [-100, 1]]))  # an ignored label
        self.assertIsNone(err.get())


class IgnoreIndexTest(chex.TestCase):
    """The one ignore_index rule (``losses.valid_weights``): a token whose
    label is ``ignore_index`` is dropped, the same eagerly and under jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_an_ignored_label_drops_its_token(self):
        logits, labels, weights = random_case(13, shape=(8,))
        ignored = np.array([0, 1, 0, 0, 1, 0, 0, 1], bool)
        kept = ~ignored
        for ignore_index, options in ((-100, {}), (-1, dict(ignore_index=-1))):
            marked = np.where(ignored, ignore_index, labels).astype(np.int32)
            loss, stats = self.variant(
                functools.partial(losses.cross_entropy, label_smoothing=0.1, **options)
            )(logits, marked, weights=weights)
            # numpy's loss of the other tokens alone
            _, want = references.cross_entropy(
                logits[kept], labels[kept], weights[kept], 0.1
            )
            np.testing.assert_allclose(loss, want["loss"], rtol=1e-5)
            assert_metrics_close(stats, want)
            self.assertEqual(int(stats["invalid_labels"]), 0)
            bins = self.variant(
                functools.partial(metrics.calibration_bins, num_bins=4, **options)
            )(logits, marked, weights)
            want_ece = references.expected_calibration_error(
                logits[kept], labels[kept], weights[kept], 4
            )
            np.testing.assert_allclose(
                metrics.calibration_error_from_bins(bins), want_ece, rtol=1e-5
            )

    def test_the_rule_for_ids_per_token_and_out_of_range_labels(self):
        ids = np.array([[1, 2], [-100, -100], [3, -100], [0, 9]])
        weights, _, invalid = jax.jit(losses.valid_weights, static_argnums=2)(
            ids, jnp.ones(4), 5
        )
        # All of a token's ids ignored: weight 0; one of them: out of range.
        np.testing.assert_array_equal(weights, [1, 0, 0, 0])
        np.testing.assert_array_equal(invalid, [False, False, True, True])
        # Eagerly, an error naming the argument: a partly ignored token, a
        # label V, and -100 when another index is the ignored one.
        for labels, weight, ignore_index, named in (
            (ids, np.ones(4), -100, "ids"),
            (np.array([2, -100, 7]), None, -100, "labels"),
            (np.array([2, -100, -1]), None, -1, "labels"),
        ):
            with self.assertRaisesRegex(ValueError, rf"^{named} must be in \[0, 5\)"):
                losses.valid_weights(labels, weight, 5, ignore_index, name=named)
        with self.assertRaisesRegex(TypeError, "ignore_index"):
            losses.valid_weights(np.array([1]), None, 5, ignore_index=-1.0)


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
    options = dict(label_smoothing=eps, smoothing="normalized")
    loss, _ = losses.cross_entropy(logits.astype(np.float32), labels, **options)
    np.testing.assert_allclose(loss, 0.0, atol=2e-5)
    # Anywhere else it is larger (Gibbs' inequality).
    moved = logits + np.eye(vocab_size)[(labels + 1) % vocab_size]
    other, _ = losses.cross_entropy(moved.astype(np.float32), labels, **options)
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
        bpc = functools.partial(metrics.bits_per_character, chars_per_token=3.5)
        for fn, want in [
            (metrics.perplexity, np.exp(nll)),
            (metrics.bits_per_token, nll / math.log(2)),
            (bpc, nll / math.log(2) / 3.5),
        ]:
            np.testing.assert_allclose(self.variant(fn)(nll), want, rtol=1e-6)


class CalibrationTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_numpy_loop_and_bins_add_over_batches(self):
        for seed, num_bins in [(12, 15), (13, 4), (14, 1)]:
            logits, labels, weights = random_case(seed, (8, 9), 5, 1.5)
            fn = functools.partial(
                metrics.expected_calibration_error, num_bins=num_bins
            )
            for w in (None, weights):
                want = references.expected_calibration_error(
                    logits, labels, w, num_bins
                )
                self.assertGreater(want, 0.0)
                got = self.variant(fn)(logits, labels, w)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        first = random_case(15, shape=(4, 9), vocab_size=5, scale=1.5)
        second = random_case(16, shape=(4, 9), vocab_size=5, scale=1.5)
        bins = self.variant(functools.partial(metrics.calibration_bins, num_bins=10))
        got = metrics.calibration_error_from_bins(bins(*first) + bins(*second))
        joined = [np.concatenate(pair) for pair in zip(first, second)]
        np.testing.assert_allclose(
            got, references.expected_calibration_error(*joined, 10), rtol=1e-5
        )

    def test_bins_are_closed_on_the_right_and_calibrated_rows_give_zero(self):
        # Confidences exactly 1/4, 1/2 and 1 fall in (0, 1/4], (1/4, 1/2] and
        # (3/4, 1] of four bins.
        logits = np.array(
            [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -1e4, -1e4], [1e4, 0.0, 0.0, 0.0]],
            np.float32,
        )
        labels = np.array([1, 0, 0], np.int32)
        weights = np.array([1.0, 2.0, 3.0], np.float32)
        bins = metrics.calibration_bins(logits, labels, weights, num_bins=4)
        np.testing.assert_allclose(
            bins, [[1.0, 0.25, 0.0], [2.0, 1.0, 2.0], [0.0, 0.0, 0.0], [3.0, 3.0, 3.0]]
        )
        # Four tokens at confidence 0.75, three of them right: ECE is 0; and
        # 0 when no token has weight.
        logits = np.log(np.array([[0.75, 0.25]] * 4, np.float32))
        labels = np.array([0, 0, 0, 1], np.int32)
        for weights in (None, np.zeros(4, np.float32)):
            ece = metrics.expected_calibration_error(logits, labels, weights)
            np.testing.assert_allclose(ece, 0.0, atol=1e-6)


def test_non_finite_logits_of_zero_weight_tokens_do_not_reach_the_loss():
    logits, labels, _ = random_case(13, shape=(3,))
    poisoned = logits.copy()
    poisoned[1] = np.nan  # e.g. the logits of a padding id outside the table
    weights = np.array([1.0, 0.0, 1.0], np.float32)
    for reduction in ("mean", "sum", "none"):
        options = dict(weights=weights, reduction=reduction)
        got, metrics = losses.cross_entropy(poisoned, labels, **options)
        want, _ = losses.cross_entropy(logits, labels, **options)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert all(np.isfinite(v) for v in metrics.values())


# Bad input raises exactly its error, naming the argument (tests/errors.py);
# values that cannot be refused inside jit follow a documented rule (RULES).

LOGITS = jnp.zeros((2, 5))
LABELS = jnp.zeros((2,), jnp.int32)
NAN, INF, NEG = float("nan"), float("inf"), -float("inf")


def ce(logits=LOGITS, labels=LABELS, **kwargs):
    return losses.cross_entropy(logits, labels, **kwargs)


def ece(**kwargs):
    return metrics.expected_calibration_error(LOGITS, LABELS, **kwargs)


CROSS_ENTROPY = [
    ("float labels", dict(labels=jnp.zeros(2)), TypeError, "labels"),
    ("labels shape", dict(labels=jnp.zeros(3, int)), ValueError, "labels"),
    ("labels extra axis", dict(labels=LABELS[:, None]), ValueError, "labels"),
    ("scalar labels", dict(labels=LABELS[0]), ValueError, "labels"),
    ("weights shape", dict(weights=jnp.ones(3)), ValueError, "weights"),
    ("negative weight", dict(weights=jnp.array([1, -1.0])), ValueError, "weights"),
    ("NaN weight", dict(weights=jnp.array([1.0, NAN])), ValueError, "weights"),
    ("label = V", dict(labels=jnp.array([0, 5])), ValueError, "labels"),
    ("label < 0", dict(labels=jnp.array([-1, 0])), ValueError, "labels"),
    ("label_smoothing 1", dict(label_smoothing=1.0), ValueError, "label_smoothing"),
    ("label_smoothing < 0", dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    ("smoothing", dict(smoothing="soft"), ValueError, "smoothing"),
    ("z_loss < 0", dict(z_loss=-1e-4), ValueError, "z_loss"),
    ("reduction", dict(reduction="avg"), ValueError, "reduction"),
    ("integer logits", dict(logits=LABELS[:, None]), TypeError, "logits"),
    ("V = 0", dict(logits=LOGITS[:, :0]), ValueError, "logits"),
]
ECE = [
    ("num_bins 0", dict(num_bins=0), ValueError, "num_bins"),
    ("num_bins < 0", dict(num_bins=-2), ValueError, "num_bins"),
    ("num_bins float", dict(num_bins=2.5), TypeError, "num_bins"),
    ("num_bins bool", dict(num_bins=True), TypeError, "num_bins"),
]
BINS = [
    ("[M, 2]", dict(bins=jnp.ones((3, 2))), ValueError, "bins"),
    ("negative", dict(bins=jnp.array([[-1.0, 0.5, 0.0]])), ValueError, "bins"),
]
BITS = [
    ("0 chars", dict(chars_per_token=0.0), ValueError, "chars_per_token"),
    ("inf chars", dict(chars_per_token=INF), ValueError, "chars_per_token"),
]
BAD_INPUTS = [
    *keyword_rows("cross_entropy", ce, CROSS_ENTROPY),
    (
        "cross_entropy weights transposed",
        lambda: ce(
            jnp.zeros((2, 3, 5)), jnp.zeros((2, 3), int), weights=jnp.ones((3, 2))
        ),
        ValueError,
        "weights",
    ),
    (
        "cross_entropy V = 0 in jit",
        lambda: jax.jit(losses.cross_entropy)(LOGITS[:, :0], LABELS),
        ValueError,
        "logits",
    ),
    *keyword_rows("ece", ece, ECE),
    *keyword_rows("ece bins", metrics.calibration_error_from_bins, BINS),
    *keyword_rows(
        "bits_per_character", functools.partial(metrics.bits_per_character, 1.0), BITS
    ),
]


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


def ce_none(z, y):
    return losses.cross_entropy(z, y, reduction="none")[0]


RULES = [
    # A label of logit -inf has probability 0; a -inf logit off the label (a
    # banned token) is no concern of the loss, also where the z-loss and
    # smoothing coefficients are 0 (0 * inf would be NaN).
    (
        "cross_entropy of a row of -inf",
        ce_none,
        (jnp.array([[NEG, NEG], [0.0, 0.0]]), jnp.array([0, 1])),
        np.array([INF, np.log(2.0)]),
    ),
    (
        "cross_entropy of a label of logit -inf",
        ce_none,
        (jnp.array([[NEG, 0.0]]), jnp.array([0])),
        np.array([INF]),
    ),
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
        lambda z, y: metrics.calibration_bins(z, y, num_bins=2),
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
