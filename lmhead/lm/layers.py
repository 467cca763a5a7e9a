"""The layers of the decoder-only Transformer (``model.DecoderLM``): rotary
positions, the GELU (exact, or GPT-2's tanh form), LayerNorm, causal
self-attention over a sequence or a key/value cache, and the pre-LayerNorm
block, in GPT-2's layout.

Attention over a sequence is :func:`lmhead.lm.attention.causal_attention`
(cuDNN's flash attention on a GPU); over a cache it is
``kv_cache.attend_filled``. In XLA both compute one softmax
(:func:`lmhead.lm.attention.softmax_weights`).
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmhead.lm import kv_cache
from lmhead.lm.attention import causal_attention, causal_weights, mix_values

INIT_STD = 0.02
# GPT-2's and nanoGPT's (PyTorch's default); Flax's own default is 1e-6.
LAYER_NORM_EPSILON = 1e-5
ROPE_BASE = 10000.0
# The MLP's activations: the exact GELU, and the tanh form GPT-2 was trained
# with (Hugging Face's "gelu_new").
ACTIVATIONS = ("gelu", "gelu_tanh")


def rotary(x: jax.Array, positions: jax.Array) -> jax.Array:
    r"""Rotary position embedding of ``x: [B, T, H, Dh]`` at ``positions: [B, T]``.

    Pairs :math:`(x_i, x_{i + Dh/2})` turn by the angle
    :math:`p \cdot \mathrm{base}^{-2i/Dh}`, ``base`` = :data:`ROPE_BASE`;
    computed in float32, returned in ``x``'s dtype. A dot product of a
    rotated query and key depends on their positions' difference only.

    Examples:
        >>> x = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)  # Dh = 2: angle = p
        >>> rotary(x, jnp.array([[1]]))[0, 0, 0].round(3).tolist()  # cos 1, sin 1
        [0.54, 0.841]

    References:
        Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position
        Embedding", arXiv:2104.09864.
    """
    half = x.shape[-1] // 2
    frequencies = ROPE_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, :, None, None].astype(jnp.float32) * frequencies
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate(
        [first * cos - second * sin, first * sin + second * cos], axis=-1
    )
    return rotated.astype(x.dtype)


def gelu(x: jax.Array, approximate: bool = False) -> jax.Array:
    r"""GELU of ``x: [...]``, evaluated in float32 and returned in ``x``'s
    dtype: exact, :math:`\tfrac12 x\,(1 + \mathrm{erf}(x / \sqrt 2))`, or
    with ``approximate`` the tanh form
    :math:`\tfrac12 x\,(1 + \tanh(\sqrt{2/\pi}\,(x + 0.044715\,x^3)))`
    that GPT-2 was trained with.

    The exact one is the same function as ``jax.nn.gelu(x,
    approximate=False)``, which is written with ``erfc(-x / sqrt 2)``;
    ``docs/design.md`` ("The MLP's GELU") says why ``erf`` and why float32.

    Examples:
        >>> gelu(jnp.array([-1.0, 0.0, 1.0])).round(4)
        Array([-0.1587,  0.    ,  0.8413], dtype=float32)
        >>> gelu(jnp.array([-1.0, 0.0, 1.0]), approximate=True).round(4).tolist()
        [-0.1588, 0.0, 0.8412]

    References:
        Hendrycks & Gimpel 2016, "Gaussian Error Linear Units (GELUs)",
        arXiv:1606.08415.
    """
    x32 = x.astype(jnp.float32)
    if approximate:
        inner = math.sqrt(2.0 / math.pi) * (x32 + 0.044715 * x32**3)
        return (0.5 * x32 * (1.0 + jnp.tanh(inner))).astype(x.dtype)
    return (0.5 * x32 * (1.0 + jax.lax.erf(x32 / math.sqrt(2.0)))).astype(x.dtype)


def layer_norm(use_bias: bool, dtype: Any, name: str | None = None) -> nn.LayerNorm:
    r"""The model's LayerNorm over the last axis ``[..., D]``,
    :math:`\gamma (x - \mu) / \sqrt{\sigma^2 + \epsilon} + \beta` with
    :math:`\epsilon` = :data:`LAYER_NORM_EPSILON`; ``use_bias=False`` drops
    :math:`\beta`.

    Examples:
        >>> norm = layer_norm(True, jnp.float32)
        >>> x = jnp.array([[1.0, 3.0]])
        >>> norm.apply(norm.init(jax.random.key(0), x), x).round(4)
        Array([[-1.,  1.]], dtype=float32)

    References:
        Ba et al. 2016, "Layer Normalization", arXiv:1607.06450.
    """
    return nn.LayerNorm(
        epsilon=LAYER_NORM_EPSILON, use_bias=use_bias, dtype=dtype, name=name
    )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention over the sequence or over a key/value cache.

    Over a sequence it is :func:`~lmhead.lm.attention.causal_attention` in
    ``implementation`` (one of ``attention.IMPLEMENTATIONS``), unless its
    weights are needed (dropout on them: ``train`` and ``dropout_rate > 0``;
    or the ``"intermediates"`` collection is mutable, which sows them, see
    ``model.attention_weights``): then XLA's, whatever ``implementation``
    is, as cuDNN's never forms them."""

    num_heads: int
    dropout_rate: float
    residual_init_std: float
    rope: bool
    use_bias: bool
    dtype: Any
    implementation: str = "auto"

    @nn.compact
    def __call__(self, x, positions, cache, *, train):
        """x: [B, T, D]; positions: int [B, T]; cache: None (keys are this
        call's T positions, each query seeing those up to its own) or a
        layer's (keys, values), each in pieces [B, H, n_j, Dh]
        (kv_cache.cache_segments), and the cache's rows (see
        kv_cache.DecodeCache), into whose keys and values this call writes
        its T positions and whose slots up to each query's position it
        reads. Returns ([B, T, D], the updated (keys, values) or None).

        Without a cache, when ``"intermediates"`` is mutable, the float32
        softmax weights ``[B, H, T, T]`` (before dropout) are sown as
        ``intermediates/attention_weights``."""
        batch, time, width = x.shape
        head_dim = width // self.num_heads
        qkv = nn.Dense(
            3 * width,
            use_bias=self.use_bias,
            dtype=self.dtype,
            kernel_init=nn.initializers.normal(INIT_STD),
            name="qkv",
        )(x)
        qkv = qkv.reshape(batch, time, 3, self.num_heads, head_dim)
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.rope:
            query, key = rotary(query, positions), rotary(key, positions)
        if cache is None and (
            (train and self.dropout_rate > 0)
            or self.is_mutable_collection("intermediates")
        ):
            weights = causal_weights(query, key)
            self.sow("intermediates", "attention_weights", weights)
            weights = nn.Dropout(self.dropout_rate, deterministic=not train)(
                weights.astype(self.dtype)
            )
            out = mix_values(weights, value)
        elif cache is None:  # qkv's dense layer computes in self.dtype
            out = causal_attention(query, key, value, self.implementation)
        else:
            # Positions past the cache's end are dropped (see DecoderLM.extend).
            keys, values, slot_rows = cache
            cache = (
                kv_cache.write_slots(keys, key, positions),
                kv_cache.write_slots(values, value, positions),
            )
            out = kv_cache.attend_filled(
                query, *cache, slot_rows, positions, self.dtype
            )
        out = nn.Dense(
            width,
            use_bias=self.use_bias,
            dtype=self.dtype,
            name="out",
            kernel_init=nn.initializers.normal(self.residual_init_std),
        )(out.reshape(batch, time, width))
        return out, cache


class Block(nn.Module):
    """Pre-LayerNorm Transformer block: x + attention(LN(x)), then x + MLP(LN(x));
    the MLP's activation is one of :data:`ACTIVATIONS`."""

    num_heads: int
    mlp_dim: int
    dropout_rate: float
    residual_init_std: float
    rope: bool
    use_bias: bool
    dtype: Any
    activation: str = "gelu"
    attention_implementation: str = "auto"

    @nn.compact
    def __call__(self, x, positions, cache, *, train):
        """Same arguments and results as CausalSelfAttention."""
        dropout = nn.Dropout(self.dropout_rate, deterministic=not train)
        attention = CausalSelfAttention(
            num_heads=self.num_heads,
            dropout_rate=self.dropout_rate,
            residual_init_std=self.residual_init_std,
            rope=self.rope,
            use_bias=self.use_bias,
            dtype=self.dtype,
            implementation=self.attention_implementation,
            name="attention",
        )
        y, cache = attention(
            layer_norm(self.use_bias, self.dtype, "attention_norm")(x),
            positions,
            cache,
            train=train,
        )
        x = x + dropout(y)
        y = layer_norm(self.use_bias, self.dtype, "mlp_norm")(x)
        y = nn.Dense(
            self.mlp_dim,
            use_bias=self.use_bias,
            dtype=self.dtype,
            name="mlp_in",
            kernel_init=nn.initializers.normal(INIT_STD),
        )(y)
        y = nn.Dense(
            x.shape[-1],
            use_bias=self.use_bias,
            dtype=self.dtype,
            name="mlp_out",
            kernel_init=nn.initializers.normal(self.residual_init_std),
        )(gelu(y, approximate=self.activation == "gelu_tanh"))
        return x + dropout(y), cache
