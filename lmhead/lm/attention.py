"""The model's attention, one softmax for its paths.

:func:`softmax_weights` is what ``kv_cache.attend_filled`` computes over the
filled slots of a cache (whose keys come in pieces, see
:mod:`lmhead.lm.kv_cache`; the scores are their concatenation): a prompt's
prefill and every decoding step. It is also what :func:`causal_attention`,
the attention of ``layers.CausalSelfAttention`` over a sequence (training,
scoring), computes in XLA (``"xla"``), so that the two cannot drift apart. On
an NVIDIA GPU of compute capability 8.0 or later, in bfloat16 or float16,
:func:`causal_attention` runs cuDNN's fused (flash) attention through
``jax.nn.dot_product_attention`` instead (``"cudnn"``): it never forms the
weights, and agrees with the cache's softmax to rounding, not bitwise.

The XLA path is the arrangement ``jax.nn.dot_product_attention``'s own
``implementation="xla"`` computes, equal to it to float32 rounding, and it is
not that function: on a CPU that function's value and gradient run slower at
the model's shapes (docs/benchmarks.md, "Attention", has the measurement).
"""

import math

import chex
import jax
import jax.numpy as jnp

from lmhead import _checks
from lmhead.head import NEG_INF

# "auto": cuDNN's where it runs (:func:`pick_implementation`), else XLA's.
IMPLEMENTATIONS = ("auto", "xla", "cudnn")
# What cuDNN's fused attention takes here: JAX's own checks allow larger
# heads on some GPUs; 128 is where every GPU with the kernel runs it.
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128
_CUDNN_MIN_COMPUTE_CAPABILITY = 8.0  # Ampere: cuDNN's flash attention


def cudnn_takes(dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention takes a compute ``dtype`` and head
    size ``head_dim``: bfloat16 or float16, ``Dh`` a multiple of 8 up to
    :data:`CUDNN_MAX_HEAD_DIM`.

    Examples:
        >>> cudnn_takes(jnp.bfloat16, 64), cudnn_takes(jnp.float32, 64)
        (True, False)
    """
    return (
        jnp.dtype(dtype).name in CUDNN_DTYPES
        and head_dim % 8 == 0
        and head_dim <= CUDNN_MAX_HEAD_DIM
    )


def _cudnn_device() -> bool:
    """Whether the default device is an NVIDIA GPU with cuDNN's flash
    attention (compute capability 8.0 or later; a ROCm GPU has none)."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return (
        device.platform == "gpu"
        and capability is not None
        and float(capability) >= _CUDNN_MIN_COMPUTE_CAPABILITY
    )


def pick_implementation(name: str, dtype, head_dim: int) -> str:
    """The implementation, ``"xla"`` or ``"cudnn"``, that ``name`` (one of
    :data:`IMPLEMENTATIONS`) picks for a compute ``dtype`` and head size
    ``head_dim`` on the default device.

    ``"auto"`` is ``"cudnn"`` where cuDNN's kernel runs (an NVIDIA GPU of
    compute capability 8.0 or later) and takes the shape
    (:func:`cudnn_takes`), ``"xla"`` elsewhere. ``"cudnn"`` where it does not
    run raises ValueError naming the setting (JAX itself would fail when it
    traces: "cuDNN is not detected").

    Examples:
        >>> pick_implementation("auto", jnp.float32, 32)  # float32: XLA's anywhere
        'xla'
    """
    _checks.check_choice("attention_implementation", name, IMPLEMENTATIONS)
    runs = cudnn_takes(dtype, head_dim) and _cudnn_device()
    if name == "auto":
        return "cudnn" if runs else "xla"
    if name == "cudnn" and not runs:
        raise ValueError(
            "attention_implementation='cudnn' needs an NVIDIA GPU of compute "
            f"capability 8.0 or later (the default device: "
            f"{jax.devices()[0].device_kind}), a bfloat16 or float16 dtype "
            f"(got {jnp.dtype(dtype).name}) and a head size that is a multiple "
            f"of 8 up to {CUDNN_MAX_HEAD_DIM} (got {head_dim}); 'auto' picks "
            "cuDNN's where it runs and XLA's elsewhere."
        )
    return name


def causal_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    implementation: str = "auto",
) -> jax.Array:
    r"""Causal attention of a sequence.

    .. math::
        \mathrm{out}_{bth} = \sum_{s \le t} w_{bhts}\, v_{bsh}, \qquad
        w = \mathrm{softmax\_weights}(q, k, s \le t)

    in the implementation :func:`pick_implementation` picks: XLA's computes
    the scores and the softmax in float32 and casts the weights to
    ``value``'s dtype before they mix the values; cuDNN's
    (``jax.nn.dot_product_attention(implementation="cudnn")``, flash
    attention) never forms the weights.

    Args:
        query, key, value: ``[B, T, H, Dh]``, one dtype.
        implementation: one of :data:`IMPLEMENTATIONS`.

    Returns:
        ``[B, T, H, Dh]`` in ``value``'s dtype.

    Examples:
        >>> q = k = jnp.ones((1, 2, 1, 4))
        >>> v = jnp.arange(8.0).reshape(1, 2, 1, 4)
        >>> causal_attention(q, k, v)[0, :, 0]  # equal keys: the running mean
        Array([[0., 1., 2., 3.],
               [2., 3., 4., 5.]], dtype=float32)
    """
    chex.assert_rank([query, key, value], 4)
    chex.assert_equal_shape([query, key, value])
    chex.assert_type([key, value], query.dtype)
    if pick_implementation(implementation, value.dtype, query.shape[-1]) == "cudnn":
        return jax.nn.dot_product_attention(
            query, key, value, is_causal=True, implementation="cudnn"
        )
    return mix_values(causal_weights(query, key), value)


def causal_weights(query: jax.Array, key: jax.Array) -> jax.Array:
    """:func:`softmax_weights` of ``query`` over ``key`` (both ``[B, T, H,
    Dh]``), each position seeing those up to its own: ``float32 [B, H, T, T]``.

    Examples:
        >>> causal_weights(jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 1, 4)))[0, 0]
        Array([[1. , 0. ],
               [0.5, 0.5]], dtype=float32)
    """
    positions = query.shape[1]
    causal = jnp.tril(jnp.ones((1, positions, positions), bool))
    return softmax_weights(query, [key], causal)


def mix_values(weights: jax.Array, value: jax.Array) -> jax.Array:
    """``weights [B, H, T, S]``, cast to ``value``'s dtype, mixing ``value
    [B, S, H, Dh]``: ``[B, T, H, Dh]``.

    Examples:
        >>> mix_values(jnp.full((1, 1, 1, 2), 0.5), jnp.eye(2).reshape(1, 2, 1, 2))
        Array([[[[0.5, 0.5]]]], dtype=float32)
    """
    return jnp.einsum("bhts,bshd->bthd", weights.astype(value.dtype), value)


def softmax_weights(
    query: jax.Array,
    keys: tuple[jax.Array, ...] | list[jax.Array],
    mask: jax.Array,
    keys_layout: str = "bshd",
) -> jax.Array:
    r"""float32 attention weights of ``query`` over the concatenated ``keys``.

    .. math::
        w_{bhts} = \mathrm{softmax}_s\big(q_{bth} \cdot k_{bsh} / \sqrt{D_h}\big)
        \text{ over the } s \text{ where } \mathrm{mask}_{bts}, \quad 0 \text{ elsewhere.}

    Masked scores are the head library's ``NEG_INF`` (``-inf``): a causal row
    always sees its own position (the diagonal; in a cache, at least slot 0,
    since positions are never negative), so no row is fully masked and the
    softmax never divides 0 by 0.

    Args:
        query: ``[B, T, H, Dh]``.
        keys: pieces ``[B, S_j, H, Dh]`` (``keys_layout="bshd"``) or ``[B, H,
            S_j, Dh]`` (``"bhsd"``, the cache's), ``S = sum_j S_j``.
        mask: ``bool [B | 1, T, S]``, True where query ``t`` sees key ``s``.

    Returns:
        ``float32 [B, H, T, S]``.

    Examples:
        >>> query, key = jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 1, 4))
        >>> causal = jnp.tril(jnp.ones((1, 2, 2), bool))
        >>> softmax_weights(query, [key], causal)
        Array([[[[1. , 0. ],
                 [0.5, 0.5]]]], dtype=float32)
        >>> pieces = [key[:, :1], key[:, 1:]]
        >>> bool((softmax_weights(query, pieces, causal)
        ...       == softmax_weights(query, [key], causal)).all())
        True
    """
    scores = jnp.concatenate(
        [
            jnp.einsum(
                f"bthd,{keys_layout}->bhts",
                query,
                key,
                preferred_element_type=jnp.float32,
            )
            for key in keys
        ],
        axis=-1,
    )
    scores = jnp.where(mask[:, None], scores / math.sqrt(query.shape[-1]), NEG_INF)
    return jax.nn.softmax(scores, axis=-1)
