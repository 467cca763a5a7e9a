"""Tests of LMHead's post-training methods (lmhead/modules.py): on tied,
untied, factorized and biased, softcapped heads, the log-probs equal float64
numpy's of the head's own materialized logits (``LMHead.__call__``), and
each loss method equals, with its gradient w.r.t. the head's parameters,
the same loss on the log-softmax of those logits (the losses' formulas are
tested against numpy in their own test files).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmhead import kto, modules, policy_gradient, preference, sparse_distillation
from tests import references

B, T, D, V, RANK = 2, 3, 8, 13, 4
HEADS = {
    "tied": dict(tied=True),
    "untied_bias_softcap": dict(tied=False, use_bias=True, softcap=2.0, scale=0.7),
    "factorized_tied": dict(tied=True, rank=RANK),
    "factorized_untied": dict(tied=False, rank=RANK),
}


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def setup_head(name, seed=0):
    rng = np.random.default_rng(seed)
    lm_head = modules.LMHead(vocab_size=V, **HEADS[name])
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    embedding = None
    if lm_head.tied:
        embedding = (f32(V, RANK), f32(RANK, D)) if lm_head.rank else f32(V, D)
    h = f32(B, T, D)
    params = lm_head.init(jax.random.key(seed), h, embedding)
    if lm_head.use_bias:
        params["params"]["bias"] = f32(V)
    return lm_head, params, embedding, rng


def numpy_logprobs(lm_head, params, h, embedding, ids):
    logits = np.asarray(lm_head.apply(params, h, embedding), np.float64)
    log_p = references.log_softmax(logits)
    return np.take_along_axis(log_p, np.asarray(ids)[..., None], -1)[..., 0]


class MethodsTest(parameterized.TestCase):
    @parameterized.named_parameters(*[(n, n) for n in HEADS])
    def test_token_logprobs(self, name):
        lm_head, params, embedding, rng = setup_head(name)
        h = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
        ids = rng.integers(0, V, (B, T))
        out = lm_head.apply(
            params,
            h,
            ids,
            embedding,
            entropy=True,
            chunk_size=4,
            method=modules.LMHead.token_logprobs,
        )
        np.testing.assert_allclose(
            out.logprobs,
            numpy_logprobs(lm_head, params, h, embedding, ids),
            rtol=1e-5,
            atol=1e-5,
        )

    @parameterized.named_parameters(*[(n, n) for n in HEADS])
    def test_losses_and_parameter_gradients(self, name):
        """DPO and KTO (with precomputed reference log-probs), GRPO and the
        sparse KL through the method equal the loss of the materialized
        log-probs; so do their gradients w.r.t. the head's parameters."""
        lm_head, params, embedding, rng = setup_head(name)
        h = [jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32) for _ in range(2)]
        ids = [rng.integers(0, V, (B, T)) for _ in range(2)]
        mask = np.ones((B, T))
        ref = [rng.standard_normal((B, T)) - 3 for _ in range(2)]
        advantages = rng.standard_normal(B)
        top = rng.integers(0, V, (B, T, 2))
        teacher = np.log(np.full((B, T, 2), 0.3))
        desirable = np.array([True, False])

        def materialized(params):
            def logp(h, ids):
                logits = lm_head.apply(params, h, embedding)
                return jnp.take_along_axis(
                    jax.nn.log_softmax(logits), jnp.asarray(ids)[..., None], -1
                )[..., 0]

            dpo, _ = preference.preference_loss(
                logp(h[0], ids[0]),
                logp(h[1], ids[1]),
                mask,
                mask,
                ref_chosen_logps=ref[0],
                ref_rejected_logps=ref[1],
            )
            grpo, _ = policy_gradient.policy_gradient_loss(
                logp(h[0], ids[0]), mask, advantages
            )
            logits = lm_head.apply(params, h[0], embedding)
            student = jnp.take_along_axis(jax.nn.log_softmax(logits), top, -1)
            kl, _ = sparse_distillation.sparse_distillation_loss(student, teacher)
            unpaired, _ = kto.kto_loss(
                logp(h[1], ids[1]), mask, desirable, ref_logps=ref[1], kl=0.2
            )
            return jnp.stack([dpo, grpo, kl, unpaired])

        def fused(params):
            apply = lambda method, *a, **k: lm_head.apply(  # noqa: E731
                params, *a, method=method, **k
            )
            dpo, _ = apply(
                modules.LMHead.preference_loss,
                h[0],
                h[1],
                ids[0],
                ids[1],
                mask,
                mask,
                embedding,
                reference_logps=ref,
                chunk_size=4,
            )
            grpo, _ = apply(
                modules.LMHead.policy_gradient_loss,
                h[0],
                ids[0],
                mask,
                advantages,
                embedding,
                chunk_size=4,
            )
            kl, _ = apply(
                modules.LMHead.sparse_distillation_loss,
                h[0],
                top,
                teacher,
                embedding,
                chunk_size=4,
            )
            unpaired, _ = apply(
                modules.LMHead.kto_loss,
                h[1],
                ids[1],
                mask,
                desirable,
                embedding,
                reference_logps=ref[1],
                kl=0.2,
                chunk_size=4,
            )
            return jnp.stack([dpo, grpo, kl, unpaired])

        def values_and_grads(losses, params):
            """The four losses and each one's gradient, in one program."""
            grads = [jax.grad(lambda p, i=i: losses(p)[i])(params) for i in range(4)]
            return losses(params), grads

        (got, got_grads), (want, want_grads) = (
            jax.jit(values_and_grads, static_argnums=0)(losses, params)
            for losses in (fused, materialized)
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        for got, want in zip(got_grads, want_grads, strict=True):
            chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-6)
