"""Tests for lmhead/sparse_distillation.py.

Hand-worked cases pin the two forms; the fused loss is checked against the
KL written here in float64 on numpy's log-softmax of the materialized
logits, with gradients by central differences. N = 2 x 5 = 10 tokens in
chunks of 4 (a ragged last chunk), V = 11, k = 3, some tokens masked.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmhead import sparse_distillation
from tests import post_training_references as refs
from tests.errors import bad_input_test, keyword_rows

B, T, D, V, K = 2, 5, 4, 11, 3
OPTIONS = dict(scale=0.8, softcap=3.0, temperature=1.5)


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def np_sparse_kl(log_q, log_p, renormalize):
    """Forward KL on the support, float64."""
    if renormalize:
        log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
        log_q = log_q - np.log(np.exp(log_q).sum(-1, keepdims=True))
    p = np.exp(log_p)
    return np.sum(p * (log_p - log_q), -1)


class HandWorkedTest(parameterized.TestCase):
    @parameterized.named_parameters(
        # Teacher (1/2, 3/10), student (1/4, 1/4):
        # 1/2 log 2 + 3/10 log(6/5) = 0.401270.
        ("unrenormalized", False, 0.5 * np.log(2) + 0.3 * np.log(1.2)),
        # Both renormalized: teacher (5/8, 3/8), student (1/2, 1/2):
        # 5/8 log(5/4) + 3/8 log(3/4) = 0.031583.
        ("renormalized", True, 0.625 * np.log(1.25) + 0.375 * np.log(0.75)),
    )
    def test_case(self, renormalize, expected):
        loss, metrics = sparse_distillation.sparse_distillation_loss(
            jnp.log(jnp.array([[0.25, 0.25]])),
            jnp.log(jnp.array([[0.5, 0.3]])),
            renormalize=renormalize,
        )
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        np.testing.assert_allclose(metrics["teacher_mass"], 0.8, rtol=1e-6)
        np.testing.assert_allclose(metrics["student_mass"], 0.5, rtol=1e-6)

    def test_renormalized_is_zero_for_a_proportional_student(self):
        """Student (0.1, 0.3) against teacher (0.2, 0.6): both (1/4, 3/4)."""
        loss, _ = sparse_distillation.sparse_distillation_loss(
            jnp.log(jnp.array([[0.1, 0.3]])),
            jnp.log(jnp.array([[0.2, 0.6]])),
        )
        np.testing.assert_allclose(loss, 0.0, atol=1e-7)

    def test_an_id_of_probability_zero_adds_nothing(self):
        """Teacher (1, 0): log(1 / q_1) = log 4, finite."""
        loss, _ = sparse_distillation.sparse_distillation_loss(
            jnp.log(jnp.array([[0.25, 0.5]])),
            jnp.array([[0.0, -jnp.inf]]),
            renormalize=False,
        )
        np.testing.assert_allclose(loss, np.log(4), rtol=1e-6)


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(V, K, replace=False) for _ in range(B * T)])
    teacher = rng.standard_normal((B * T, V)) * 2
    teacher = teacher - np.log(np.exp(teacher).sum(-1, keepdims=True))
    return dict(
        h=rng.standard_normal((B, T, D)),
        w=rng.standard_normal((V, D)),
        bias=rng.standard_normal(V),
        ids=ids.reshape(B, T, K).astype(np.int32),
        teacher=np.take_along_axis(teacher, ids, -1).reshape(B, T, K),
        weights=np.where(np.isin(np.arange(B * T), (2, 9)), 0.0, 1.5).reshape(B, T),
    )


class FusedTest(parameterized.TestCase):
    # Compiled only: the sweep runs its scans and custom VJP compiled either
    # way, and the plain JAX around it is stricter under jit than op by op.
    @chex.variants(with_jit=True)
    @parameterized.product(renormalize=(False, True), vocab_chunk_size=(None, 4))
    def test_value_and_gradients_match_float64(self, renormalize, vocab_chunk_size):
        """The weighted mean KL and d/d(h, w, bias); the teacher gets none."""
        x = make_inputs()

        def fused(h, w, bias, teacher):
            return sparse_distillation.fused_sparse_distillation_loss(
                h,
                w,
                x["ids"],
                teacher,
                bias=bias,
                weights=x["weights"],
                renormalize=renormalize,
                chunk_size=4,
                vocab_chunk_size=vocab_chunk_size,
                **OPTIONS,
            )[0]

        def reference(h, w, bias):
            log_q, *_ = refs.token_logprobs(h, w, bias, x["ids"], **OPTIONS)
            kl = np_sparse_kl(log_q, x["teacher"], renormalize)
            return np.sum(x["weights"] * kl) / x["weights"].sum()

        names = ("h", "w", "bias", "teacher")
        args = [jnp.asarray(x[n], jnp.float32) for n in names]
        value, grads = self.variant(jax.value_and_grad(fused, (0, 1, 2, 3)))(*args)
        np.testing.assert_allclose(
            value, reference(x["h"], x["w"], x["bias"]), rtol=1e-5
        )
        want = refs.grads(reference, x["h"], x["w"], x["bias"])
        for name, g, e in zip(names, grads, want):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(grads[3], 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_an_ignored_token_is_left_out(self):
        """A token whose ids are all ``ignore_index`` (-100, or another), its
        teacher's log-probs whatever they are: numpy's mean KL of the other
        tokens, and its gradient."""
        x = make_inputs(1)
        ignored = np.zeros((B, T), bool)
        ignored[0, 3] = ignored[1, 0] = True
        weights = np.where(ignored, 0.0, x["weights"])

        def reference(h, w, bias):
            log_q, *_ = refs.token_logprobs(h, w, bias, x["ids"], **OPTIONS)
            kl = np_sparse_kl(log_q, x["teacher"], True)
            return np.sum(weights * kl) / weights.sum()

        for ignore_index in (-100, V):
            ids = np.where(ignored[..., None], ignore_index, x["ids"])
            teacher = np.where(ignored[..., None], 0.0, x["teacher"])

            def fused(h, w, bias, ids=ids, teacher=teacher, ignore_index=ignore_index):
                return sparse_distillation.fused_sparse_distillation_loss(
                    h, w, ids, teacher, bias=bias, weights=x["weights"],
                    chunk_size=4, ignore_index=ignore_index, **OPTIONS,
                )  # fmt: skip

            names = ("h", "w", "bias")
            args = [jnp.asarray(x[n], jnp.float32) for n in names]
            grad = jax.value_and_grad(fused, (0, 1, 2), has_aux=True)
            (value, metrics), grads = self.variant(grad)(*args)
            want_value = reference(x["h"], x["w"], x["bias"])
            np.testing.assert_allclose(value, want_value, rtol=1e-5)
            self.assertEqual(float(metrics["weight_sum"]), weights.sum())
            want = refs.grads(reference, x["h"], x["w"], x["bias"])
            for name, g, e in zip(names, grads, want):
                np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5, err_msg=name)


def fused(**overrides):
    x = make_inputs()
    args = dict(h=x["h"], w=x["w"], teacher_ids=x["ids"], teacher_logps=x["teacher"])
    return sparse_distillation.fused_sparse_distillation_loss(**(args | overrides))


IDS = (B, T, K)
BAD_INPUTS = keyword_rows("fused", fused, [
    ("ids out of range", dict(teacher_ids=np.full(IDS, V, np.int32)), ValueError),
    ("ids negative", dict(teacher_ids=np.full(IDS, -1, np.int32)), ValueError),
    ("ids float", dict(teacher_ids=np.zeros(IDS)), TypeError),
    ("ids without k", dict(teacher_ids=np.zeros((B, T), np.int32)), ValueError),
    ("teacher positive", dict(teacher_logps=np.full(IDS, 0.1)), ValueError),
    ("teacher shape", dict(teacher_logps=np.zeros((B, T, K + 1)) - 1), ValueError),
    ("unknown reduction", dict(reduction="max"), ValueError),
    ("renormalize not bool", dict(renormalize="yes"), TypeError),
])  # fmt: skip
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
