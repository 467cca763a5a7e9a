"""Tests for lmhead/distillation.py against float64 numpy.

The reference loss is written here from the formulas (KL, the generalized
JSD with its mixture, the cross-entropy, the weighted reductions), and its
gradients are central finite differences of it in float64, so that neither
the value nor the gradient of either function is checked against code of
the library. N = 2 x 5 = 10 tokens in chunks of 4, so the last chunk is
ragged.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmhead import distillation, head
from tests import references
from tests.errors import bad_input_test, keyword_rows
from tests.post_training_references import numeric_grad

B, T, D, D_T, V = 2, 5, 4, 6, 11
CHUNK = 4

OPTIONS = {
    "forward_kl": dict(divergence="forward_kl"),
    "reverse_kl": dict(divergence="reverse_kl", temperature=2.5),
    "jsd": dict(divergence="jsd", beta=0.3, temperature=0.7),
    "jsd_at_0": dict(divergence="jsd", beta=0.0),
    "jsd_at_1": dict(divergence="jsd", beta=1.0, temperature=2.0),
    "hard": dict(divergence="jsd", beta=0.5, temperature=2.0, hard_weight=0.4),
}
# The student's scale and softcap (fused only: the materialized loss takes
# logits), with the hard labels, so every term of the gradient goes through.
STUDENT = dict(scale=0.7, softcap=2.5)


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        h=rng.standard_normal((B, T, D)),
        w=rng.standard_normal((V, D)),
        bias=rng.standard_normal(V),
        h_t=rng.standard_normal((B, T, D_T)),
        w_t=rng.standard_normal((V, D_T)),
        labels=rng.integers(0, V, (B, T)).astype(np.int32),
        # Some zeros (padding) and a spread of positive weights.
        weights=np.where(rng.random((B, T)) < 0.3, 0.0, rng.uniform(0.5, 2, (B, T))),
    )


def np_divergence(log_q, log_p, divergence, beta):
    q, p = np.exp(log_q), np.exp(log_p)

    def kl(a, log_a, log_b):  # sum a log(a / b), 0 log 0 = 0
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(a > 0, a * (log_a - log_b), 0.0).sum(-1)

    if divergence == "jsd" and beta == 0.0:
        divergence = "forward_kl"
    if divergence == "jsd" and beta == 1.0:
        divergence = "reverse_kl"
    if divergence == "forward_kl":
        return kl(p, log_p, log_q)
    if divergence == "reverse_kl":
        return kl(q, log_q, log_p)
    with np.errstate(divide="ignore"):
        log_m = np.log(beta * p + (1 - beta) * q)
    return beta * kl(p, log_p, log_m) + (1 - beta) * kl(q, log_q, log_m)


def np_loss(
    z,
    z_t,
    labels=None,
    weights=None,
    divergence="forward_kl",
    beta=0.5,
    temperature=1.0,
    hard_weight=0.0,
    reduction="mean",
):
    """The loss from logits, float64."""
    d = np_divergence(
        references.log_softmax(z, temperature),
        references.log_softmax(z_t, temperature),
        divergence,
        beta,
    )
    loss = d
    if hard_weight > 0:
        nll = -np.take_along_axis(
            references.log_softmax(z), labels[..., None], axis=-1
        )[..., 0]
        loss = hard_weight * nll + (1 - hard_weight) * d
    weights = np.ones(loss.shape) if weights is None else weights
    if reduction == "none":
        return weights * loss
    total = (weights * loss).sum()
    return total if reduction == "sum" else total / weights.sum()


def f32(x):
    return jnp.asarray(x, jnp.float32)


class MaterializedTest(parameterized.TestCase):
    @parameterized.named_parameters(
        (f"{name}_{reduction}", name, reduction)
        for name in OPTIONS
        for reduction in ("mean", "sum", "none")
    )
    def test_equals_numpy(self, name, reduction):
        x = make_inputs()
        z = references.unembed(x["h"], x["w"], x["bias"])
        z_t = references.unembed(x["h_t"], x["w_t"])
        options = dict(OPTIONS[name], reduction=reduction)
        loss, metrics = distillation.distillation_loss(
            f32(z), f32(z_t), labels=x["labels"], weights=f32(x["weights"]), **options
        )
        expected = np_loss(z, z_t, x["labels"], x["weights"], **options)
        np.testing.assert_allclose(loss, expected, rtol=2e-5, atol=1e-6)
        nll = -np.take_along_axis(
            references.log_softmax(z), x["labels"][..., None], -1
        )[..., 0]
        np.testing.assert_allclose(
            metrics["nll"], (x["weights"] * nll).sum() / x["weights"].sum(), rtol=2e-5
        )

    def test_gradient_is_the_numpy_losss_and_the_teacher_gets_none(self):
        x = make_inputs()
        z = references.unembed(x["h"], x["w"], x["bias"])
        z_t = references.unembed(x["h_t"], x["w_t"])
        options = OPTIONS["hard"]
        dz, dz_t = jax.grad(
            lambda a, b: distillation.distillation_loss(
                a, b, labels=x["labels"], weights=f32(x["weights"]), **options
            )[0],
            argnums=(0, 1),
        )(f32(z), f32(z_t))
        expected = numeric_grad(
            lambda z: np_loss(z, z_t, x["labels"], x["weights"], **options), z
        )
        np.testing.assert_allclose(dz, expected, rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(dz_t, np.zeros(z_t.shape))

    def test_a_token_the_teacher_bans_adds_nothing_to_the_forward_kl(self):
        z = np.array([[0.5, -1.0, 2.0, 0.0]])
        z_t = np.array([[1.0, -np.inf, 0.0, -np.inf]])
        forward, _ = distillation.distillation_loss(f32(z), f32(z_t))
        reverse, _ = distillation.distillation_loss(
            f32(z), f32(z_t), divergence="reverse_kl"
        )
        np.testing.assert_allclose(forward, np_loss(z, z_t), rtol=1e-6)
        self.assertEqual(float(reverse), np.inf)  # q > 0 where p = 0


class FusedTest(chex.TestCase):
    # Compiled only: the sweep runs its scans and custom VJP compiled either
    # way, so op by op would add time and nothing the compiled call misses.
    @chex.variants(with_jit=True)
    @parameterized.named_parameters(
        [
            # The teacher's form and the divergence are independent: each
            # option with one form, the forms taking turns.
            (f"{name}_{teacher}", name, teacher, False, "mean")
            for name, teacher in zip(OPTIONS, ["logits", "head"] * len(OPTIONS))
        ]
        + [("hard_scale_softcap", "hard", "head", True, "mean")]
        + [(f"jsd_{r}", "jsd", "head", False, r) for r in ("sum", "none")]
    )
    def test_value_and_gradients_equal_numpy(self, name, teacher, student, reduction):
        x = make_inputs()
        z_t = references.unembed(x["h_t"], x["w_t"])
        options = dict(OPTIONS[name], reduction=reduction)
        student = STUDENT if student else {}
        # "none" is summed against a cotangent that is not a multiple of 1.
        rng = np.random.default_rng(2)
        cotangent = rng.standard_normal((B, T)) if reduction == "none" else 1.0
        teacher_arg = (
            f32(z_t) if teacher == "logits" else (f32(x["h_t"]), f32(x["w_t"]))
        )

        @self.variant
        def value_and_grad(h, w, bias, weights):
            return jax.value_and_grad(
                lambda *a: jnp.sum(
                    f32(cotangent)
                    * distillation.fused_distillation_loss(
                        a[0],
                        a[1],
                        teacher_arg,
                        labels=x["labels"],
                        bias=a[2],
                        weights=a[3],
                        chunk_size=CHUNK,
                        **options,
                        **student,
                    )[0]
                ),
                argnums=(0, 1, 2, 3),
            )(h, w, bias, weights)

        loss, grads = value_and_grad(
            f32(x["h"]), f32(x["w"]), f32(x["bias"]), f32(x["weights"])
        )
        args = dict(h=x["h"], w=x["w"], bias=x["bias"], weights=x["weights"])

        def reference(name, value):
            inputs = dict(args, **{name: value})
            return np.sum(
                cotangent
                * np_loss(
                    references.unembed(
                        inputs["h"], inputs["w"], inputs["bias"], **student
                    ),
                    z_t,
                    labels=x["labels"],
                    weights=inputs["weights"],
                    **options,
                )
            )

        np.testing.assert_allclose(loss, reference("h", x["h"]), rtol=2e-5)
        for grad, argument in zip(grads, args):
            np.testing.assert_allclose(
                grad,
                numeric_grad(functools.partial(reference, argument), args[argument]),
                rtol=2e-4,
                atol=2e-6,
                err_msg=argument,
            )

    def test_the_teacher_gets_no_gradient_and_the_metrics_are_the_materialized(self):
        x = make_inputs()
        args = (f32(x["h"]), f32(x["w"]), f32(x["h_t"]), f32(x["w_t"]))

        def loss(h, w, h_t, w_t):
            return distillation.fused_distillation_loss(
                h,
                w,
                (h_t, w_t),
                labels=x["labels"],
                chunk_size=CHUNK,
                **OPTIONS["hard"],
            )

        grads = jax.grad(lambda *a: loss(*a)[0], argnums=(2, 3))(*args)
        chex.assert_trees_all_equal(grads, tuple(jnp.zeros_like(a) for a in args[2:]))
        _, metrics = loss(*args)
        _, expected = distillation.distillation_loss(
            head.unembed(*args[:2]),
            head.unembed(*args[2:]),
            labels=x["labels"],
            **OPTIONS["hard"],
        )
        chex.assert_trees_all_close(metrics, expected, rtol=2e-5)

    def test_bfloat16_inputs_give_bfloat16_gradients_close_to_float32(self):
        x = make_inputs()
        z_t = f32(references.unembed(x["h_t"], x["w_t"]))

        def grads(dtype):
            return jax.grad(
                lambda h, w: distillation.fused_distillation_loss(
                    h, w, z_t, chunk_size=CHUNK
                )[0],
                argnums=(0, 1),
            )(jnp.asarray(x["h"], dtype), jnp.asarray(x["w"], dtype))

        low, high = grads(jnp.bfloat16), grads(jnp.float32)
        self.assertEqual({g.dtype for g in low}, {jnp.dtype(jnp.bfloat16)})
        chex.assert_trees_all_close(
            jax.tree.map(lambda g: g.astype(jnp.float32), low), high, atol=0.03
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_an_ignored_label_drops_its_token(self):
        """Labels of ``ignore_index`` (-100, or another) leave their tokens
        out, divergence and cross-entropy alike: numpy's loss of the other
        tokens, fused and materialized, eagerly and compiled."""
        x = make_inputs(3)
        z_t = references.unembed(x["h_t"], x["w_t"])
        ignored = np.zeros((B, T), bool)
        ignored[0, 2] = ignored[1, :2] = True
        kept = ~ignored
        options = OPTIONS["hard"]
        want = np_loss(
            references.unembed(x["h"][kept], x["w"]),
            z_t[kept],
            x["labels"][kept],
            x["weights"][kept],
            **options,
        )
        for ignore_index in (-100, -1):
            labels = np.where(ignored, ignore_index, x["labels"]).astype(np.int32)
            keywords = dict(options, labels=labels, ignore_index=ignore_index)
            fused_loss = self.variant(
                functools.partial(
                    distillation.fused_distillation_loss, chunk_size=CHUNK, **keywords
                )
            )
            loss, metrics = fused_loss(
                f32(x["h"]), f32(x["w"]), f32(z_t), weights=f32(x["weights"])
            )
            np.testing.assert_allclose(loss, want, rtol=1e-5)
            self.assertEqual(int(metrics["invalid_labels"]), 0)
            loss, _ = self.variant(
                functools.partial(distillation.distillation_loss, **keywords)
            )(
                f32(references.unembed(x["h"], x["w"])),
                f32(z_t),
                weights=f32(x["weights"]),
            )
            np.testing.assert_allclose(loss, want, rtol=1e-5)

    def test_no_tokens_gives_zero(self):
        loss, metrics = distillation.fused_distillation_loss(
            jnp.zeros((0, D)), jnp.ones((V, D)), jnp.zeros((0, V))
        )
        self.assertEqual((float(loss), float(metrics["weight_sum"])), (0.0, 0.0))


H, W = np.ones((B, T, D), np.float32), np.ones((V, D), np.float32)
TEACHER, LOGITS = np.ones((B, T, V)), np.ones((B, V))


def fused(teacher=TEACHER, **kwargs):
    return distillation.fused_distillation_loss(H, W, teacher, **kwargs)


def materialized(teacher_logits=LOGITS, **kwargs):
    return distillation.distillation_loss(LOGITS, teacher_logits, **kwargs)


FUSED = [
    ("teacher vocabulary", dict(teacher=np.ones((B, T, V + 1))), ValueError, "teacher"),
    ("teacher head", dict(teacher=(H[..., :3], W[:-1, :3])), ValueError, "teacher"),
    ("teacher of one", dict(teacher=(H[..., :3],)), ValueError, "teacher"),
    ("beta > 1", dict(divergence="jsd", beta=1.5), ValueError, "beta"),
    ("temperature 0", dict(temperature=0.0), ValueError, "temperature"),
    ("hard_weight without labels", dict(hard_weight=0.5), ValueError, "labels"),
    ("divergence", dict(divergence="kl"), ValueError, "divergence"),
    ("chunk_size 0", dict(chunk_size=0), ValueError, "chunk_size"),
    ("softcap 0", dict(softcap=0.0), ValueError, "softcap"),
    ("negative weights", dict(weights=-np.ones((B, T))), ValueError, "weights"),
]
MATERIALIZED = [
    (
        "teacher vocabulary",
        dict(teacher_logits=np.ones((B, V + 1))),
        ValueError,
        "teacher_logits",
    ),
    ("beta < 0", dict(beta=-0.1), ValueError, "beta"),
    ("label = V", dict(labels=np.array([0, V])), ValueError, "labels"),
]
BAD_INPUTS = [
    *keyword_rows("fused", fused, FUSED),
    *keyword_rows("materialized", materialized, MATERIALIZED),
    (
        "fused traced beta",
        lambda: jax.jit(lambda b: fused(divergence="jsd", beta=b))(0.5),
        TypeError,
        "beta",
    ),
]
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


@pytest.mark.parametrize("loss_impl", ["fused", "materialized"])
def test_a_tied_factorized_heads_distillation_is_numpys(loss_impl):
    """``LMHead.distillation_loss`` of a tied head of rank 2 with a scale and a
    softcap: the student's logits are softcap(scale * h @ (A @ B).T)."""
    from lmhead import modules

    x = make_inputs()
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((V, 2)), rng.standard_normal((2, D))
    lm_head = modules.LMHead(V, tied=True, rank=2, **STUDENT)
    options = dict(OPTIONS["hard"], labels=x["labels"], weights=f32(x["weights"]))
    loss, _ = lm_head.apply(
        {},
        f32(x["h"]),
        (f32(x["h_t"]), f32(x["w_t"])),
        (f32(a), f32(b)),
        loss_impl=loss_impl,
        method=modules.LMHead.distillation_loss,
        **options,
    )
    expected = np_loss(
        references.unembed(x["h"], a @ b, **STUDENT),
        references.unembed(x["h_t"], x["w_t"]),
        x["labels"],
        x["weights"],
        **OPTIONS["hard"],
    )
    np.testing.assert_allclose(loss, expected, rtol=2e-5)


@pytest.mark.parametrize("bad", [-np.inf, np.nan])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_a_padded_tokens_bad_teacher_row_changes_nothing(bad, divergence):
    """A token of weight 0 whose teacher row is all -inf or NaN (padding) adds
    0 to the loss and 0 to every gradient, in both functions."""
    x = make_inputs()
    weights = np.ones((B, T))
    weights[1, 2] = 0.0
    z_t = references.unembed(x["h_t"], x["w_t"])
    bad_t = z_t.copy()
    bad_t[1, 2] = bad

    def value_and_grads(fn, teacher):
        return jax.value_and_grad(fn, argnums=(0, 1))(
            f32(x["h"]), f32(x["w"]), f32(teacher)
        )

    def fused_loss(h, w, teacher):
        return distillation.fused_distillation_loss(
            h, w, teacher, weights=f32(weights), divergence=divergence, chunk_size=CHUNK
        )[0]

    def materialized(h, w, teacher):
        return distillation.distillation_loss(
            head.unembed(h, w), teacher, weights=f32(weights), divergence=divergence
        )[0]

    clean = value_and_grads(materialized, z_t)
    for fn in (fused_loss, materialized):
        chex.assert_trees_all_close(
            value_and_grads(fn, bad_t), clean, rtol=2e-5, atol=1e-6
        )


def test_a_nan_teacher_on_a_weighted_token_is_a_nan_loss_not_a_zero():
    z = np.zeros((1, 4), np.float32)
    z_t = np.array([[0.0, np.nan, 1.0, 2.0]], np.float32)
    for divergence in distillation.DIVERGENCES:
        loss, _ = distillation.distillation_loss(z, z_t, divergence=divergence)
        assert np.isnan(loss), divergence


def test_reverse_kl_where_student_and_teacher_both_give_a_token_nothing():
    """The student's probability underflows to 0 where the teacher bans the
    token: the term is 0 log 0 = 0, and its gradient 0, not NaN."""
    w = jnp.diag(jnp.array([0.0, 1.0, -200.0]))
    z_t = jnp.array([[0.0, 1.0, -jnp.inf]])
    for fn in (
        lambda w: distillation.distillation_loss(
            head.unembed(jnp.ones((1, 3)), w), z_t, divergence="reverse_kl"
        )[0],
        lambda w: distillation.fused_distillation_loss(
            jnp.ones((1, 3)), w, z_t, divergence="reverse_kl"
        )[0],
    ):
        loss, grad = jax.value_and_grad(fn)(w)
        assert float(loss) == pytest.approx(0.0, abs=1e-6)
        assert np.all(np.isfinite(grad))
