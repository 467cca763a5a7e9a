"""Flax Linen wrapper of the output head.

``LMHead`` only decides which ``[V, D]`` array is the unembedding -- the
input embedding table when tied, a parameter of its own when untied -- and
calls the pure functions in :mod:`lmhead.head`, :mod:`lmhead.losses` and
:mod:`lmhead.fused`. No math is written here.
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks, fused, head, losses, quantize, vocab_parallel

LOSS_IMPLS = ("fused", "materialized", "vocab_parallel")

Embedding = nn.Embed | jax.typing.ArrayLike


class LMHead(nn.Module):
    """The language-model head: ``logits = softcap(scale * h @ w.T + bias)``.

    Attributes:
        vocab_size: ``V >= 1``.
        tied: if True, ``w`` is the embedding table passed to the call and the
            head owns no ``[V, D]`` parameter; if False, the head owns
            ``unembedding: [V, D]`` (the same layout as ``nn.Embed``).
        use_bias: whether to add a ``bias: [V]`` parameter (owned by the head
            in both cases).
        scale: optional factor on ``h @ w.T`` (e.g. ``D ** -0.5`` for a tied
            head, as in the Flax lm1b example).
        softcap: optional ``c``; logits become ``c * tanh(logits / c)``.
        dtype: dtype of the matmul inputs; the product accumulates in float32
            and logits are float32.
        param_dtype: dtype of the head's own parameters.
        kernel_init: initializer of the untied ``unembedding``.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> lm_head = LMHead(vocab_size=5, tied=False)
        >>> h = jnp.ones((2, 3, 4))
        >>> params = lm_head.init(jax.random.key(0), h)
        >>> jax.tree.map(jnp.shape, params)
        {'params': {'unembedding': (5, 4)}}
        >>> lm_head.apply(params, h).shape
        (2, 3, 5)
    """

    vocab_size: int
    tied: bool = True
    use_bias: bool = False
    scale: float | None = None
    softcap: float | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: nn.initializers.Initializer = nn.initializers.normal(0.02)

    def __post_init__(self):
        # When the module is built, so that a bad field fails before any
        # parameter or compilation.
        _checks.check_count("vocab_size", self.vocab_size)
        for name in ("tied", "use_bias"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}.")
        for name in ("scale", "softcap"):
            _checks.check_in_range(
                name,
                getattr(self, name),
                low=0.0,
                low_open=True,
                high=math.inf,
                high_open=True,
            )
        super().__post_init__()

    @nn.compact
    def unembedding(
        self, d_model: int, embedding: Embedding | None
    ) -> tuple[jax.Array, jax.Array | None]:
        """Returns ``(w: [V, D], bias: [V] | None)`` as used by the head.

        At inference ``w`` may be a ``quantize.QuantizedTable`` (passed as the
        ``embedding`` when tied, or in place of ``params["unembedding"]`` when
        untied); it is used as it is, not cast to ``dtype``.
        """
        if self.tied:
            if embedding is None:
                raise ValueError(
                    "embedding is required when tied=True: pass the nn.Embed "
                    "module or its [V, D] table."
                )
            w = embedding.embedding if isinstance(embedding, nn.Embed) else embedding
            if _table_shape(w) != (self.vocab_size, d_model):
                raise ValueError(
                    f"embedding must have shape [V, D] = ({self.vocab_size}, "
                    f"{d_model}); got {_table_shape(w)}."
                )
        else:
            if embedding is not None:
                raise ValueError(
                    "embedding must be None when tied=False: an untied head "
                    "owns its unembedding."
                )
            w = self.param(
                "unembedding",
                self.kernel_init,
                (self.vocab_size, d_model),
                self.param_dtype,
            )
        bias = (
            self.param(
                "bias", nn.initializers.zeros, (self.vocab_size,), self.param_dtype
            )
            if self.use_bias
            else None
        )
        if isinstance(w, quantize.QuantizedTable):
            return w, bias
        return jnp.asarray(w, self.dtype), bias

    def __call__(self, h: jax.Array, embedding: Embedding | None = None) -> jax.Array:
        """Logits ``[..., V]`` (float32) from hidden states ``h: [..., D]``."""
        _checks.check_floating("h", h)  # before the cast to self.dtype
        w, bias = self.unembedding(jnp.shape(h)[-1], embedding)
        return head.unembed(
            jnp.asarray(h, self.dtype), w, bias, scale=self.scale, softcap=self.softcap
        )

    def loss(
        self,
        h: jax.Array,
        labels: jax.Array,
        embedding: Embedding | None = None,
        *,
        weights: jax.Array | None = None,
        loss_impl: str = "fused",
        label_smoothing: float = 0.0,
        smoothing: str = "uniform",
        z_loss: float = 0.0,
        chunk_size: int | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The training loss on hidden states; see ``losses.cross_entropy``.

        Args:
            h: ``[..., D]`` hidden states.
            labels: ``[...]`` integer targets.
            embedding: the table (or ``nn.Embed``) when tied.
            weights: optional ``[...]`` per-token weights.
            loss_impl: ``"fused"`` never builds the ``[..., V]`` logits
                (see ``fused.fused_cross_entropy``); ``"materialized"``
                builds them;
                ``"vocab_parallel"`` splits them over the ``"model"`` axis of
                the mesh set by ``jax.set_mesh`` (see
                ``vocab_parallel.vocab_parallel_cross_entropy``).
            chunk_size: tokens per block of the blocked losses; must be None
                for ``"materialized"``.
            label_smoothing, smoothing, z_loss: as in
                ``losses.cross_entropy``.

        Returns:
            ``(loss, metrics)`` as ``losses.cross_entropy`` returns them.
        """
        _checks.check_choice("loss_impl", loss_impl, LOSS_IMPLS)
        _checks.check_floating("h", h)  # before the cast to self.dtype
        if loss_impl == "materialized" and chunk_size is not None:
            raise ValueError(
                f"chunk_size is for the blocked losses ('fused', "
                f"'vocab_parallel'); got chunk_size={chunk_size!r} with "
                f"loss_impl='materialized'."
            )
        w, bias = self.unembedding(jnp.shape(h)[-1], embedding)
        if isinstance(w, quantize.QuantizedTable):
            raise ValueError(
                "a QuantizedTable is for inference; train and "
                "evaluate the loss with the float table."
            )
        h = jnp.asarray(h, self.dtype)
        options = dict(
            weights=weights,
            label_smoothing=label_smoothing,
            smoothing=smoothing,
            z_loss=z_loss,
        )
        blocked = {
            "fused": fused.fused_cross_entropy,
            "vocab_parallel": vocab_parallel.vocab_parallel_cross_entropy,
        }
        if loss_impl in blocked:
            return blocked[loss_impl](
                h,
                w,
                labels,
                bias=bias,
                scale=self.scale,
                softcap=self.softcap,
                chunk_size=chunk_size,
                **options,
            )
        logits = head.unembed(h, w, bias, scale=self.scale, softcap=self.softcap)
        return losses.cross_entropy(logits, labels, **options)


def _table_shape(w: Any) -> tuple[int, ...]:
    return w.shape if isinstance(w, quantize.QuantizedTable) else jnp.shape(w)
