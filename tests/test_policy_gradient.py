"""Tests for lmhead/policy_gradient.py.

Hand-worked cases pin the clipping, the KL, the aggregations and GSPO's
sequence-level ratio (Liger-Kernel's GRPO definitions); the fused loss is
checked against the formula written here in float64 on numpy's log-softmax
of the materialized logits, with gradients by central differences.
B = 3 rollouts of T = 4 tokens, N = 12 in chunks of 5 (a ragged last
chunk), some tokens masked.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmhead import policy_gradient
from tests import post_training_references as refs
from tests.errors import bad_input_test, keyword_rows

B, T, D, V = 3, 4, 4, 11
OPTIONS = dict(scale=0.8, softcap=3.0, temperature=0.9)
EPS_LOW, EPS_HIGH, BETA, ENTROPY_WEIGHT = 0.2, 0.28, 0.3, 0.05


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def np_policy_gradient_loss(
    logp, old, ref, entropy, mask, adv, loss_type, level, delta
):
    """The formula, float64 (the clipped surrogate, k3, the aggregations)."""
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = (np.sum(mask * log_ratio, -1) / mask.sum(-1))[:, None]
    ratio = np.exp(log_ratio)
    a = adv[:, None]
    unclipped = ratio if delta is None else np.minimum(ratio, delta)
    loss = -np.minimum(unclipped * a, np.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    r = ref - logp
    loss = loss + BETA * (np.exp(r) - r - 1) - ENTROPY_WEIGHT * entropy
    if loss_type == "grpo":
        return np.mean(np.sum(mask * loss, -1) / mask.sum(-1))
    if loss_type == "dr_grpo":
        return np.sum(mask * loss) / (B * 6)
    return np.sum(mask * loss) / mask.sum()


class HandWorkedTest(parameterized.TestCase):
    """One token, log-probs given as probabilities: the ratio is p / p_old."""

    @parameterized.named_parameters(
        # ratio 1.5, A = 1: clipped to 1 + 0.2, loss -1.2, a clipped token.
        ("clip_high", 0.3, 0.2, 1.0, dict(), -1.2, 1.0),
        # ratio 1.5, A = -1: min(-1.5, -1.2) = -1.5, so loss 1.5, not clipped.
        ("no_clip_for_negative_advantage", 0.3, 0.2, -1.0, dict(), 1.5, 0.0),
        # ratio 0.5, A = -1: clipped to 0.8, loss 0.8, a clipped token.
        ("clip_low", 0.1, 0.2, -1.0, dict(), 0.8, 1.0),
        # DAPO's clip-higher: ratio 1.5 under 1 + 0.6, loss -1.5.
        ("epsilon_high", 0.3, 0.2, 1.0, dict(epsilon_high=0.6), -1.5, 0.0),
        # delta = 1.3 bounds the unclipped ratio: min(-1.3, -1.2) = -1.3.
        ("delta", 0.3, 0.2, -1.0, dict(delta=1.3), 1.3, 0.0),
    )
    def test_clipping(self, p, p_old, advantage, options, expected, clip_ratio):
        loss, metrics = policy_gradient.policy_gradient_loss(
            jnp.log(jnp.array([[p]])),
            jnp.ones((1, 1)),
            jnp.array([advantage]),
            old_logps=jnp.log(jnp.array([[p_old]])),
            **options,
        )
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        np.testing.assert_allclose(metrics["clip_ratio"], clip_ratio)

    def test_k3_kl_term(self):
        """p = 1/4, p_ref = 1/2, A = 0: beta (e^{log 2} - log 2 - 1) =
        0.5 (1 - log 2)."""
        loss, metrics = policy_gradient.policy_gradient_loss(
            jnp.log(jnp.array([[0.25]])),
            jnp.ones((1, 1)),
            jnp.zeros(1),
            ref_logps=jnp.log(jnp.array([[0.5]])),
            beta=0.5,
        )
        np.testing.assert_allclose(loss, 0.5 * (1 - np.log(2)), rtol=1e-6)
        np.testing.assert_allclose(metrics["kl"], 1 - np.log(2), rtol=1e-6)

    @parameterized.named_parameters(
        # Rollout 0: 2 tokens of loss 2 (A = -2), one masked; rollout 1: one
        # token of loss 5. grpo: (2 + 5) / 2; bnpo, dapo: 9 / 3; dr_grpo with
        # L_max = 3: 9 / (2 * 3).
        ("grpo", "grpo", 3.5),
        ("bnpo", "bnpo", 3.0),
        ("dapo", "dapo", 3.0),
        ("dr_grpo", "dr_grpo", 1.5),
    )
    def test_aggregation(self, loss_type, expected):
        mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
        loss, _ = policy_gradient.policy_gradient_loss(
            jnp.full((2, 3), -1.0),
            mask,
            jnp.array([-2.0, -5.0]),
            loss_type=loss_type,
            max_completion_length=3,
        )
        np.testing.assert_allclose(loss, expected, rtol=1e-6)

    @parameterized.named_parameters(
        # Token ratios 2 and 1: GSPO's ratio exp((log 2 + 0) / 2) = sqrt 2,
        # clipped to 1.2 for A = 1 (both tokens), or kept under 1 + 0.5.
        ("clipped", 0.2, -1.2),
        ("unclipped", 0.5, -np.sqrt(2)),
    )
    def test_sequence_level_ratio(self, epsilon_high, expected):
        loss, _ = policy_gradient.policy_gradient_loss(
            jnp.log(jnp.array([[0.4, 0.3]])),
            jnp.ones((1, 2)),
            jnp.ones(1),
            old_logps=jnp.log(jnp.array([[0.2, 0.3]])),
            importance_sampling="sequence",
            epsilon_high=epsilon_high,
        )
        np.testing.assert_allclose(loss, expected, rtol=1e-6)

    def test_without_old_logps_the_gradient_is_minus_advantage(self):
        """Ratio 1 and d/d log p of -A * ratio is -A: for dapo, -A_b / #tokens."""
        grad = jax.grad(
            lambda x: policy_gradient.policy_gradient_loss(
                x, jnp.ones((2, 2)), jnp.array([1.0, -3.0])
            )[0]
        )(jnp.full((2, 2), -1.0))
        np.testing.assert_allclose(grad, [[-0.25, -0.25], [0.75, 0.75]], rtol=1e-6)


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T))
    mask[0, 0] = mask[2, -2:] = 0
    return dict(
        h=rng.standard_normal((B, T, D)),
        w=rng.standard_normal((V, D)),
        bias=rng.standard_normal(V),
        h_ref=rng.standard_normal((B, T, D)),
        w_ref=rng.standard_normal((V, D)),
        ids=rng.integers(0, V, (B, T)).astype(np.int32),
        mask=mask,
        advantages=rng.standard_normal(B),
        # Old log-probs spread so that some ratios are clipped.
        old_shift=rng.uniform(-0.4, 0.4, (B, T)),
    )


class FusedTest(parameterized.TestCase):
    # Compiled only: the sweep runs its scans and custom VJP compiled either
    # way, and the plain JAX around it is stricter under jit than op by op.
    @chex.variants(with_jit=True)
    # The reference's form is independent of the loss and its level: each
    # loss at both levels, with both forms, each level with both.
    @parameterized.parameters(
        (loss_type, level, ("head", "logps")[(i + j) % 2])
        for i, loss_type in enumerate(policy_gradient.LOSS_TYPES)
        for j, level in enumerate(policy_gradient.IMPORTANCE_SAMPLING)
    )
    def test_value_and_gradients_match_float64(self, loss_type, level, reference):
        x = make_inputs()
        delta = 1.5 if loss_type == "grpo" else None
        logp, entropy, _ = refs.token_logprobs(
            x["h"], x["w"], x["bias"], x["ids"], **OPTIONS
        )
        old = logp + x["old_shift"]
        ref, *_ = refs.token_logprobs(x["h_ref"], x["w_ref"], None, x["ids"], **OPTIONS)
        options = dict(
            loss_type=loss_type,
            importance_sampling=level,
            epsilon_low=EPS_LOW,
            epsilon_high=EPS_HIGH,
            delta=delta,
            beta=BETA,
            entropy_weight=ENTROPY_WEIGHT,
            max_completion_length=6,
            chunk_size=5,
            old_logps=old,
            **OPTIONS,
        )

        def fused(h, w, bias, h_ref, w_ref):
            if reference == "head":
                options["reference_head"] = (h_ref, w_ref)
            else:
                options["ref_logps"] = ref
            return policy_gradient.fused_policy_gradient_loss(
                h, w, x["ids"], x["mask"], x["advantages"], bias=bias, **options
            )[0]

        def reference_loss(h, w, bias):
            logp, entropy, _ = refs.token_logprobs(h, w, bias, x["ids"], **OPTIONS)
            args = (logp, old, ref, entropy, x["mask"], x["advantages"])
            return np_policy_gradient_loss(*args, loss_type, level, delta)

        names = ("h", "w", "bias", "h_ref", "w_ref")
        args = [jnp.asarray(x[n], jnp.float32) for n in names]
        value, grads = self.variant(jax.value_and_grad(fused, tuple(range(5))))(*args)
        np.testing.assert_allclose(
            value, reference_loss(x["h"], x["w"], x["bias"]), rtol=1e-5
        )
        want = refs.grads(reference_loss, x["h"], x["w"], x["bias"])
        for name, g, e in zip(names, grads, want):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(grads[3], 0.0)  # the reference: none
        np.testing.assert_array_equal(grads[4], 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*policy_gradient.IMPORTANCE_SAMPLING)
    def test_an_ignored_id_drops_its_token(self, level):
        """Ids of ``ignore_index`` (-100, or another) on tokens the mask
        keeps: numpy's loss with those tokens' mask 0, and their gradient."""
        x = make_inputs(2)
        ignored = np.zeros((B, T), bool)
        ignored[1, 1] = ignored[2, 0] = True
        mask = np.where(ignored, 0.0, x["mask"])
        logp, *_ = refs.token_logprobs(x["h"], x["w"], None, x["ids"])
        old = logp + x["old_shift"]

        def reference_loss(h, w, bias):
            logp, entropy, _ = refs.token_logprobs(h, w, None, x["ids"])
            args = (logp, old, logp, 0 * entropy, mask, x["advantages"])
            return np_policy_gradient_loss(*args, "dapo", level, None)

        for ignore_index in (-100, V):
            ids = np.where(ignored, ignore_index, x["ids"]).astype(np.int32)
            fused = functools.partial(
                policy_gradient.fused_policy_gradient_loss,
                ids=ids,
                mask=x["mask"],
                advantages=x["advantages"],
                old_logps=old,
                importance_sampling=level,
                epsilon_low=EPS_LOW,
                epsilon_high=EPS_HIGH,
                chunk_size=5,
                ignore_index=ignore_index,
            )
            grad = jax.value_and_grad(lambda h, w: fused(h, w)[0], (0, 1))
            args = [jnp.asarray(x[n], jnp.float32) for n in ("h", "w")]
            value, (dh, dw) = self.variant(grad)(*args)
            np.testing.assert_allclose(
                value, reference_loss(x["h"], x["w"], None), rtol=1e-5
            )
            want = refs.grads(reference_loss, x["h"], x["w"], x["bias"])
            np.testing.assert_allclose(dh, want[0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(dw, want[1], rtol=1e-4, atol=1e-5)


def loss(**overrides):
    args = dict(logps=-np.ones((2, 3)), mask=np.ones((2, 3)), advantages=np.ones(2))
    return policy_gradient.policy_gradient_loss(**(args | overrides))


BAD_INPUTS = [
    *keyword_rows("loss", loss, [
        ("epsilon_low negative", dict(epsilon_low=-0.1), ValueError),
        ("epsilon_high negative", dict(epsilon_high=-0.1), ValueError),
        ("delta inside the clip", dict(delta=1.1), ValueError),
        ("unknown loss_type", dict(loss_type="ppo"), ValueError),
        ("unknown level", dict(importance_sampling="batch"), ValueError),
        ("dr_grpo without a length", dict(loss_type="dr_grpo"), ValueError,
         "max_completion_length"),
        ("mask with no tokens", dict(mask=np.zeros((2, 3))), ValueError),
        ("advantages per token", dict(advantages=np.ones((2, 3))), ValueError),
        ("old_logps shape", dict(old_logps=np.ones((2, 2))), ValueError),
        ("beta without a reference", dict(beta=0.1), ValueError, "ref_logps"),
    ]),
    ("fused ids shape",
     lambda: policy_gradient.fused_policy_gradient_loss(
         np.ones((2, 3, D)), np.ones((V, D)), np.zeros((2, 2), np.int32),
         np.ones((2, 3)), np.ones(2)),
     ValueError, "ids"),
]  # fmt: skip
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
