"""Tests for the factorized head, lmhead/modules.py's ``LMHead(rank=r)`` and
``FactorizedEmbed``, and the model's ``head_rank``.

The reference is the unfactorized head: numpy's ``h @ (A @ B).T``, and a
``DecoderLM`` without ``head_rank`` whose ``[V, D]`` table (tied) or head
(untied) is set to ``A @ B`` and whose other parameters are the factorized
model's. The two must give the same logits, the same loss (fused and
materialized) and the same logits through the prefill and a decoding step.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import modules
from lmhead.lm import generation, inference
from lmhead.lm import model as model_lib
from tests import references
from tests.errors import assert_raises_exactly

V, D, R = 13, 8, 3


def factors(seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((2, 5, D)).astype(np.float32),
        rng.standard_normal((V, R)).astype(np.float32),
        rng.standard_normal((R, D)).astype(np.float32),
    )


def test_untied_head_owns_both_factors_and_gives_h_times_their_product():
    h, _, _ = factors()
    lm_head = modules.LMHead(V, tied=False, rank=R, use_bias=True)
    params = jax.jit(lm_head.init)(jax.random.key(0), h)["params"]
    chex.assert_trees_all_equal_shapes(
        params,
        {
            "unembedding": np.zeros((V, R)),
            "projection": np.zeros((R, D)),
            "bias": np.zeros(V),
        },
    )
    params = {**params, "bias": np.arange(V, dtype=np.float32)}
    w = np.asarray(params["unembedding"]) @ np.asarray(params["projection"])
    np.testing.assert_allclose(
        lm_head.apply({"params": params}, h),
        references.unembed(h, w, params["bias"]),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("pass_module", [True, False])
def test_tied_head_shares_the_embeddings_factors(pass_module):
    h, a, b = factors()
    embed = modules.FactorizedEmbed(V, D, R)
    ids = jnp.array([[0, 4, 12]])
    variables = {"params": {"embedding": a, "projection": b}}
    np.testing.assert_allclose(
        embed.apply(variables, ids), (a @ b)[np.asarray(ids)], rtol=1e-5, atol=1e-6
    )
    lm_head = modules.LMHead(V, tied=True, rank=R)
    if pass_module:
        logits = lm_head.apply({}, h, embed.bind(variables))
    else:
        logits = lm_head.apply({}, h, (a, b))
    np.testing.assert_allclose(
        logits, references.unembed(h, a @ b), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("loss_impl", ["fused", "materialized"])
def test_loss_is_the_cross_entropy_of_the_products_logits(loss_impl):
    h, a, b = factors()
    labels = np.random.default_rng(1).integers(0, V, h.shape[:-1])
    lm_head = modules.LMHead(V, tied=True, rank=R)
    loss, _ = lm_head.apply(
        {},
        h,
        labels,
        (a, b),
        loss_impl=loss_impl,
        label_smoothing=0.1,
        method=modules.LMHead.loss,
    )
    _, expected = references.cross_entropy(
        references.unembed(h, a @ b), labels, eps=0.1
    )
    np.testing.assert_allclose(loss, expected["loss"], rtol=1e-5)


def model(**overrides):
    return model_lib.DecoderLM(
        vocab_size=V,
        num_layers=1,
        num_heads=2,
        d_model=D,
        mlp_dim=16,
        max_len=12,
        **overrides,
    )


def unfactorized(params, tied):
    """The factorized model's params with ``A @ B`` as the ``[V, D]`` table."""
    if tied:
        embed = params["embed"]
        return {
            **params,
            "embed": {"embedding": embed["embedding"] @ embed["projection"]},
        }
    head = params["head"]
    return {**params, "head": {"unembedding": head["unembedding"] @ head["projection"]}}


@pytest.fixture(scope="module", params=["tied", "untied"])
def models(request):
    tied = request.param == "tied"
    tokens = jnp.array([[1, 5, 2, 7], [3, 3, 9, 0]])
    factorized = model(tied=tied, head_rank=R)
    params = jax.jit(factorized.init)(jax.random.key(0), tokens)["params"]
    return (
        tied,
        tokens,
        factorized,
        params,
        model(tied=tied),
        unfactorized(params, tied),
    )


def test_the_model_is_the_unfactorized_model_of_the_product(models):
    tied, tokens, factorized, params, full, full_params = models
    shapes = jax.tree.map(jnp.shape, params)
    if tied:
        assert shapes["embed"] == {"embedding": (V, R), "projection": (R, D)}
        assert "head" not in shapes
    else:
        assert shapes["embed"] == {"embedding": (V, D)}
        assert shapes["head"] == {"unembedding": (V, R), "projection": (R, D)}
    np.testing.assert_allclose(
        jax.jit(factorized.apply)({"params": params}, tokens),
        jax.jit(full.apply)({"params": full_params}, tokens),
        rtol=1e-5,
        atol=1e-5,
    )


def test_prefill_and_the_step_equal_the_unfactorized_models(models):
    """Decoding (greedy, sampled, beams) reads the head only through the
    prefill and the step: their logits are the unfactorized model's."""
    tied, tokens, factorized, params, full, full_params = models

    def first_steps(m, p):
        logits, cache = inference.prefill(m, p, tokens, max_new_tokens=2)
        return logits, inference.make_step_fn(m)(p, tokens[:, 0], cache)[0]

    chex.assert_trees_all_close(
        first_steps(factorized, params),
        first_steps(full, full_params),
        rtol=1e-5,
        atol=1e-5,
    )


def test_an_int8_factor_decodes_close_to_float(models):
    tied, tokens, factorized, params, *_ = models
    small = generation.quantize_for_decoding(factorized, params, "int8")
    full, fewer = (
        jax.jit(factorized.apply)({"params": p}, tokens) for p in (params, small)
    )
    np.testing.assert_allclose(fewer, full, atol=2e-3)


def tied(rank, embedding):
    return modules.LMHead(V, tied=True, rank=rank).apply(
        {}, jnp.ones((1, D)), embedding
    )


A, B = jnp.ones((V, R)), jnp.ones((R, D))
KEY, X = jax.random.key(0), jnp.ones((1, D))


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda: modules.LMHead(V, rank=0), "rank"),
        (lambda: modules.LMHead(V, rank=V + 1), "rank"),
        (lambda: modules.LMHead(V, tied=False, rank=D + 1).init(KEY, X), "rank"),
        (lambda: modules.FactorizedEmbed(V, D, D + 1), "rank"),
        (lambda: tied(R, jnp.ones((V, D))), "embedding"),
        (lambda: tied(None, (A, B)), "embedding"),
        (lambda: tied(R, (A, jnp.ones((R + 1, D)))), "projection"),
        (lambda: model(head_rank=D + 1).init(KEY, jnp.ones((1, 2), int)), "rank"),
    ],
)
def test_bad_ranks_and_embeddings_are_named(call, named):
    assert_raises_exactly(call, ValueError, named)


def test_the_shared_factors_get_the_chain_rule_of_the_tables_gradient(models):
    """Tied: A and B get dE @ B.T and A.T @ dE, where dE is the unfactorized
    model's gradient w.r.t. its table E = A @ B (embedding and head paths
    together); the other parameters get the same gradients."""
    tied, tokens, factorized, params, full, full_params = models
    labels = jnp.roll(tokens, -1, axis=1)

    def loss(m):
        return lambda p: m.apply({"params": p}, tokens, labels, method=m.loss)[0]

    grads = jax.jit(jax.grad(loss(factorized)))(params)
    full_grads = jax.jit(jax.grad(loss(full)))(full_params)
    if tied:
        a, b = params["embed"]["embedding"], params["embed"]["projection"]
        d_table = full_grads["embed"]["embedding"]
        expected = {"embedding": d_table @ b.T, "projection": a.T @ d_table}
        chex.assert_trees_all_close(grads.pop("embed"), expected, rtol=1e-4, atol=1e-6)
        full_grads.pop("embed")
    else:
        a, b = params["head"]["unembedding"], params["head"]["projection"]
        d_table = full_grads["head"]["unembedding"]
        expected = {"unembedding": d_table @ b.T, "projection": a.T @ d_table}
        chex.assert_trees_all_close(grads.pop("head"), expected, rtol=1e-4, atol=1e-6)
        full_grads.pop("head")
    chex.assert_trees_all_close(grads, full_grads, rtol=1e-4, atol=1e-6)
