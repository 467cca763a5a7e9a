"""Tests of the model's attention: the softmax written out, which the cached
path, the sown weights and (in XLA) a sequence's attention compute; the
choice of implementation; and which path the layer takes.

References: scipy's softmax of scores computed in float64 numpy, and
``jax.nn.dot_product_attention``'s XLA implementation.
"""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from scipy import special

from lmhead import decoding, head
from lmhead.lm import attention, generation, layers
from lmhead.lm.model import DecoderLM

ON_CPU = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="XLA's is the only implementation here"
)


def numpy_weights(query, keys, mask):
    """float64 softmax of q k^T / sqrt(Dh) over the masked keys, [B, H, T, S]."""
    q, k = np.asarray(query, np.float64), np.asarray(keys, np.float64)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    return special.softmax(np.where(mask[:, None], scores, -np.inf), axis=-1)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_weights_over_pieces_match_numpy(layout):
    rng = np.random.default_rng(0)
    query = jnp.asarray(rng.standard_normal((2, 5, 3, 4)) * 3, jnp.float32)
    keys = jnp.asarray(rng.standard_normal((2, 7, 3, 4)) * 3, jnp.float32)
    # Each row sees a prefix of the keys that holds at least one key.
    mask = np.arange(7)[None, None, :] <= rng.integers(0, 7, (2, 5))[..., None]
    stored = keys if layout == "bshd" else keys.transpose(0, 2, 1, 3)
    axis = 1 if layout == "bshd" else 2
    pieces = jnp.split(stored, [2, 3], axis=axis)  # 2, 1 and 4 keys
    got = jax.jit(attention.softmax_weights, static_argnums=3)(
        query, pieces, jnp.asarray(mask), layout
    )
    assert got.shape == (2, 3, 5, 7) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, numpy_weights(query, keys, mask), atol=1e-6)


def test_masked_keys_get_exactly_zero_and_causal_rows_sum_to_one():
    rng = np.random.default_rng(1)
    query, keys = (
        jnp.asarray(rng.standard_normal((1, 6, 2, 4)) * 30, jnp.bfloat16)
        for _ in range(2)
    )
    causal = jnp.tril(jnp.ones((1, 6, 6), bool))
    weights = np.asarray(attention.softmax_weights(query, [keys], causal))
    assert attention.NEG_INF is head.NEG_INF is decoding.NEG_INF  # one of it
    assert weights.dtype == np.float32 and np.all(np.isfinite(weights))
    np.testing.assert_array_equal(weights[..., ~np.asarray(causal[0])], 0.0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


def numpy_causal_attention(query, key, value):
    """float64 causal attention ``[B, T, H, Dh]``."""
    time = query.shape[1]
    weights = numpy_weights(query, key, np.tril(np.ones((1, time, time), bool)))
    return np.einsum("bhts,bshd->bthd", weights, np.asarray(value, np.float64))


def jax_xla_attention(query, key, value):
    return jax.nn.dot_product_attention(
        query, key, value, is_causal=True, implementation="xla"
    )


class CausalAttentionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(("float32", 1e-5, 1e-6), ("bfloat16", 2e-2, 8e-3))
    def test_matches_numpy_and_jaxs_xla_attention_with_its_gradient(
        self, dtype, to_numpy, to_jax
    ):
        """The value against float64 numpy; the value and the gradient
        w.r.t. query, key and value against ``jax.nn.dot_product_attention``'s
        XLA implementation, which computes the same arrangement: equal to
        rounding (bfloat16's: the weights cast before they mix the values)."""
        rng = np.random.default_rng(2)
        query, key, value = (
            jnp.asarray(rng.standard_normal((2, 9, 3, 8)) * 2, dtype) for _ in range(3)
        )
        cotangent = jnp.asarray(rng.standard_normal((2, 9, 3, 8)), jnp.float32)
        got = self.variant(attention.causal_attention)(query, key, value)
        assert got.shape == (2, 9, 3, 8) and got.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            numpy_causal_attention(query, key, value),
            atol=to_numpy,
        )

        def objective(fn):
            value_and_grad = jax.value_and_grad(
                lambda *qkv: jnp.sum(fn(*qkv).astype(jnp.float32) * cotangent),
                argnums=(0, 1, 2),
            )
            return self.variant(value_and_grad)(query, key, value)

        ours, theirs = (
            objective(attention.causal_attention),
            objective(jax_xla_attention),
        )
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a, b, atol=to_jax * np.abs(b).max())


@ON_CPU
def test_auto_is_xla_here_and_cudnn_is_refused_by_name_off_a_gpu():
    for dtype in (jnp.float32, jnp.bfloat16):
        assert attention.pick_implementation("auto", dtype, 64) == "xla"
        assert attention.pick_implementation("xla", dtype, 64) == "xla"
    with pytest.raises(
        ValueError, match="attention_implementation='cudnn' needs an NVIDIA GPU"
    ):
        attention.pick_implementation("cudnn", jnp.bfloat16, 64)
    for bad in (
        lambda: attention.pick_implementation("flash", jnp.float32, 64),
        lambda: DecoderLM(vocab_size=5, attention_implementation="flash").init(
            jax.random.key(0), jnp.zeros((1, 2), jnp.int32)
        ),
    ):
        with pytest.raises(ValueError, match="attention_implementation"):
            bad()


def test_the_layer_writes_the_weights_out_only_when_they_are_needed(monkeypatch):
    """A plain apply calls causal_attention; dropout in training and a mutable
    "intermediates" (sown weights) write the weights out instead."""
    calls = []
    for name in ("causal_attention", "causal_weights"):
        real = getattr(layers, name)
        monkeypatch.setattr(
            layers,
            name,
            lambda *a, real=real, name=name: calls.append(name) or real(*a),
        )
    model = DecoderLM(
        vocab_size=7, num_layers=1, num_heads=2, d_model=8, mlp_dim=8, max_len=4,
        dropout_rate=0.1,
    )  # fmt: skip
    tokens = jnp.zeros((1, 4), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    ways = {
        "plain": lambda: model.apply({"params": params}, tokens),
        "sown": lambda: model.apply(
            {"params": params}, tokens, mutable=["intermediates"]
        ),
        "dropout": lambda: model.apply(
            {"params": params},
            tokens,
            train=True,
            rngs={"dropout": jax.random.key(1)},
        ),  # fmt: skip
    }
    taken = {}
    for way, apply in ways.items():
        calls.clear()
        apply()
        taken[way] = list(calls)
    assert taken == {
        "plain": ["causal_attention"],
        "sown": ["causal_weights"],
        "dropout": ["causal_weights"],
    }


def test_a_run_trained_with_cudnn_loads_anywhere(copy_of_finished_run):
    path = os.path.join(copy_of_finished_run, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["model"]["attention_implementation"] = "cudnn"
    with open(path, "w") as f:
        json.dump(config, f)
    config, _, model, params = generation.load_run(copy_of_finished_run)
    assert config.model.attention_implementation == model.attention_implementation
    assert model.attention_implementation == "auto"
    assert model.apply({"params": params}, jnp.zeros((1, 3), jnp.int32)).shape[1] == 3
