"""Small DecoderLM variants and their parameters, shared by the model's and
the cache's tests (one ``init`` compile serves every variant)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from lmhead.lm.model import DecoderLM

VOCAB, WIDTH, HEADS, LAYERS, MAX_LEN = 17, 32, 4, 2, 16


def small_model(**overrides) -> DecoderLM:
    config = dict(
        vocab_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        d_model=WIDTH,
        mlp_dim=64,
        max_len=MAX_LEN,
    )
    return DecoderLM(**(config | overrides))


@functools.cache
def _full_params(seed: int):
    """One initialisation holding every parameter any small_model variant has
    (untied head, learned positions), so that the tests compile init once."""
    model = small_model(tied=False, positions="learned")
    params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))[
        "params"
    ]
    return jax.tree.map(np.asarray, params)


def init_params(model, seed=0, noise=0.0):
    """Parameters of ``model`` (a small_model variant), cut from _full_params;
    ``noise`` adds N(0, noise^2) to every entry so that attention is far from
    uniform and position or cache errors show."""
    params = dict(_full_params(seed))
    if not model.use_bias:
        flat = traverse_util.flatten_dict(params)
        params = traverse_util.unflatten_dict(
            {path: x for path, x in flat.items() if path[-1] != "bias"}
        )
    if model.tied:
        del params["head"]
    if model.positions == "rope":
        del params["position_embedding"]
    for i in range(model.num_layers, LAYERS):
        del params[f"blocks_{i}"]
    expected = jax.eval_shape(
        model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)
    )
    assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, expected["params"])
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: (x + noise * rng.standard_normal(x.shape)).astype(np.float32), params
    )


@functools.partial(jax.jit, static_argnums=0)
def forward(model, params, tokens):
    return model.apply({"params": params}, tokens)


def random_tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)
