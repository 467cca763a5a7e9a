"""Flax Linen wrappers of the output head and of a factorized embedding.

``LMHead`` only decides which ``[V, D]`` array is the unembedding -- the
input embedding table when tied, a parameter of its own when untied -- and
calls the pure functions in :mod:`lmhead.head`, :mod:`lmhead.losses`,
:mod:`lmhead.fused` and :mod:`lmhead.distillation`. No math is written here.

A factorized head (``LMHead(rank=r)``) has the unembedding ``w = A @ B``,
``A: [V, r]``, ``B: [r, D]``, and never forms it: the head projects
``h' = h @ B.T`` (``[..., r]``) and hands ``(h', A)`` to the same pure
functions, so the fused loss, decoding and quantization (of ``A``) work on
it unchanged. Untied, the head owns ``A`` (``unembedding``) and ``B``
(``projection``). Tied, it shares both with a :class:`FactorizedEmbed`,
whose embedding of token ``i`` is ``A[i] @ B``: the head's ``w`` is the
input embedding matrix ``A @ B`` itself, as in ALBERT's factorized
embedding. Parameters: ``V r + r D`` instead of ``V D``; FLOPs of the
logits of ``N`` tokens: ``2 N r (D + V)`` instead of ``2 N D V``.
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmhead import (
    _checks,
    distillation,
    fused,
    head,
    losses,
    policy_gradient,
    preference,
    quantize,
    sparse_distillation,
    token_logprobs,
    vocab_parallel,
)

LOSS_IMPLS = ("fused", "materialized", "vocab_parallel")


def projection_init(rank: int) -> nn.initializers.Initializer:
    """``B: [r, D]`` drawn from ``N(0, 1/r)``, so that ``A @ B`` has the
    standard deviation of ``A``'s entries (``sqrt(r) * std(A) / sqrt(r)``)."""
    return nn.initializers.normal(rank**-0.5)


class FactorizedEmbed(nn.Module):
    """A token embedding of rank ``r``: token ``i`` embeds as ``A[i] @ B``.

    ``A = embedding: [V, r]`` and ``B = projection: [r, D]``; the matrix
    ``A @ B: [V, D]`` is never formed. A tied ``LMHead(rank=r)`` given this
    module unembeds with the same two arrays. Ids outside ``[0, V)`` follow
    ``nn.Embed``'s rule (``jnp.take``'s: NaN rows inside ``jit``).

    Attributes:
        num_embeddings: ``V``.
        features: ``D``.
        rank: ``r``, an integer in ``[1, min(V, D)]``.
        embedding_init: of ``A`` (default ``N(0, 0.02^2)``, the scale of
            ``LMHead``'s ``kernel_init``, which ``A @ B`` then has given the
            default ``B``).
        projection_init: of ``B``; default :func:`projection_init`.
        dtype: of the output; param_dtype: of ``A`` and ``B``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> embed = FactorizedEmbed(num_embeddings=10, features=8, rank=2)
        >>> init = jax.jit(embed.init)
        >>> params = init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
        >>> jax.tree.map(jnp.shape, params)
        {'params': {'embedding': (10, 2), 'projection': (2, 8)}}
        >>> ids = jnp.array([[4, 1, 9]])
        >>> table = params["params"]["embedding"] @ params["params"]["projection"]
        >>> bool(jnp.allclose(jax.jit(embed.apply)(params, ids), table[ids], atol=1e-6))
        True
    """

    num_embeddings: int
    features: int
    rank: int
    embedding_init: nn.initializers.Initializer = nn.initializers.normal(0.02)
    projection_init: nn.initializers.Initializer | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        for name in ("num_embeddings", "features", "rank"):
            _checks.check_count(name, getattr(self, name))
        _check_rank(self.rank, self.num_embeddings, self.features)
        super().__post_init__()

    def setup(self):
        self.embedding = self.param(
            "embedding",
            self.embedding_init,
            (self.num_embeddings, self.rank),
            self.param_dtype,
        )
        self.projection = self.param(
            "projection",
            self.projection_init or projection_init(self.rank),
            (self.rank, self.features),
            self.param_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """``[..., D]`` embeddings of integer ``ids: [...]``."""
        _checks.check_integer("ids", ids)
        rows = jnp.take(jnp.asarray(self.embedding, self.dtype), ids, axis=0)
        return jnp.einsum(
            "...r,rd->...d",
            rows,
            jnp.asarray(self.projection, self.dtype),
            preferred_element_type=jnp.float32,
        ).astype(self.dtype)


Embedding = (
    nn.Embed
    | FactorizedEmbed
    | jax.typing.ArrayLike
    | tuple[jax.typing.ArrayLike, jax.typing.ArrayLike]
)


def _check_rank(rank: int | None, vocab_size: int, d_model: int | None) -> None:
    """``rank`` in ``[1, min(V, D)]`` (``D`` when known): a larger rank
    saves nothing and ``A @ B`` cannot have it."""
    _checks.check_count("rank", rank, optional=True)
    if rank is None:
        return
    bound = vocab_size if d_model is None else min(vocab_size, d_model)
    if rank > bound:
        raise ValueError(
            f"rank must be in [1, min(V, D)] = [1, {bound}] (V = {vocab_size}"
            + ("" if d_model is None else f", D = {d_model}")
            + f"); got {rank}."
        )


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
        rank: None (default) for a ``[V, D]`` unembedding, or ``r`` in
            ``[1, min(V, D)]`` for the factorized ``w = A @ B`` (see the
            module docstring): untied, the head owns ``unembedding: [V, r]``
            and ``projection: [r, D]`` (initialized by
            :func:`projection_init`); tied, the call's ``embedding`` is a
            :class:`FactorizedEmbed` or its pair ``(A, B)``.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> lm_head = LMHead(vocab_size=5, tied=False)
        >>> h = jnp.ones((2, 3, 4))
        >>> params = jax.jit(lm_head.init)(jax.random.key(0), h)
        >>> jax.tree.map(jnp.shape, params)
        {'params': {'unembedding': (5, 4)}}
        >>> jax.jit(lm_head.apply)(params, h).shape
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
    rank: int | None = None

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
        _check_rank(self.rank, self.vocab_size, None)
        super().__post_init__()

    @nn.compact
    def unembedding(
        self, d_model: int, embedding: Embedding | None
    ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """Returns ``(w, bias: [V] | None, projection: [r, D] | None)``.

        ``w`` is ``[V, D]``, or ``A: [V, r]`` of a factorized head, whose
        logits are those of ``h @ projection.T`` against it. At inference
        ``w`` may be a ``quantize.QuantizedTable`` (passed as the
        ``embedding`` when tied, or in place of ``params["unembedding"]`` when
        untied); it is used as it is, not cast to ``dtype``.
        """
        _check_rank(self.rank, self.vocab_size, d_model)
        width = d_model if self.rank is None else self.rank
        projection = None
        if self.tied:
            w, projection = self._tied_arrays(embedding)
            if _table_shape(w) != (self.vocab_size, width):
                layout = "[V, D]" if self.rank is None else "[V, r]"
                raise ValueError(
                    f"embedding must have shape {layout} = ({self.vocab_size}, "
                    f"{width}); got {_table_shape(w)}."
                )
            if projection is not None and jnp.shape(projection) != (width, d_model):
                raise ValueError(
                    f"embedding's projection must have shape [r, D] = ({width}, "
                    f"{d_model}); got {jnp.shape(projection)}."
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
                (self.vocab_size, width),
                self.param_dtype,
            )
            if self.rank is not None:
                projection = self.param(
                    "projection",
                    projection_init(self.rank),
                    (self.rank, d_model),
                    self.param_dtype,
                )
        bias = (
            self.param(
                "bias", nn.initializers.zeros, (self.vocab_size,), self.param_dtype
            )
            if self.use_bias
            else None
        )
        if projection is not None:
            projection = jnp.asarray(projection, self.dtype)
        if isinstance(w, quantize.QuantizedTable):
            return w, bias, projection
        return jnp.asarray(w, self.dtype), bias, projection

    def _tied_arrays(self, embedding: Embedding | None) -> tuple[Any, Any]:
        """``(table, projection or None)`` of a tied head's ``embedding``."""
        if embedding is None:
            raise ValueError(
                "embedding is required when tied=True: pass the nn.Embed "
                "module or its [V, D] table (for rank=r, the FactorizedEmbed "
                "module or its pair (A [V, r], B [r, D]))."
            )
        if isinstance(embedding, FactorizedEmbed):
            embedding = (embedding.embedding, embedding.projection)
        # A QuantizedTable is a NamedTuple, and one table, not a pair.
        factorized = isinstance(embedding, (tuple, list)) and not isinstance(
            embedding, quantize.QuantizedTable
        )
        if factorized != (self.rank is not None):
            wanted = (
                "a FactorizedEmbed or a pair (A, B)"
                if self.rank
                else "an nn.Embed or a [V, D] table"
            )
            got = "a pair" if factorized else type(embedding).__name__
            raise ValueError(
                f"embedding must be {wanted} for a tied head with "
                f"rank={self.rank}; got {got}."
            )
        if factorized:
            if len(embedding) != 2:
                raise ValueError(
                    "embedding must be the pair (A [V, r], B [r, D]); got "
                    f"{len(embedding)} arrays."
                )
            return tuple(embedding)
        w = embedding.embedding if isinstance(embedding, nn.Embed) else embedding
        return w, None

    def _project(self, h: jax.Array, projection: jax.Array | None) -> jax.Array:
        """``h`` in ``dtype``, times ``projection.T`` for a factorized head."""
        h = jnp.asarray(h, self.dtype)
        if projection is None:
            return h
        return jnp.einsum(
            "...d,rd->...r", h, projection, preferred_element_type=jnp.float32
        ).astype(self.dtype)

    def _loss_arrays(
        self, h: jax.Array, embedding: Embedding | None
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """``(h projected, w, bias)`` for a loss, which needs the float table."""
        w, bias, projection = self.unembedding(jnp.shape(h)[-1], embedding)
        if isinstance(w, quantize.QuantizedTable):
            raise ValueError(
                "a QuantizedTable is for inference; train, evaluate and "
                "distill with the float table."
            )
        return self._project(h, projection), w, bias

    def __call__(self, h: jax.Array, embedding: Embedding | None = None) -> jax.Array:
        """Logits ``[..., V]`` (float32) from hidden states ``h: [..., D]``."""
        _checks.check_floating("h", h)  # before the cast to self.dtype
        w, bias, projection = self.unembedding(jnp.shape(h)[-1], embedding)
        return head.unembed(
            self._project(h, projection),
            w,
            bias,
            scale=self.scale,
            softcap=self.softcap,
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
        **gradients: Any,
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
            **gradients: ``filter_eps``, ``filter_target`` and
                ``dw_accumulation`` of ``fused.fused_cross_entropy``, for
                ``loss_impl="fused"`` only.

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
        _check_gradient_options(gradients, loss_impl)
        h, w, bias = self._loss_arrays(h, embedding)
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
                **gradients,
            )
        logits = head.unembed(h, w, bias, scale=self.scale, softcap=self.softcap)
        return losses.cross_entropy(logits, labels, **options)

    def distillation_loss(
        self,
        h: jax.Array,
        teacher: Any,
        embedding: Embedding | None = None,
        *,
        labels: jax.Array | None = None,
        weights: jax.Array | None = None,
        divergence: str = "forward_kl",
        beta: float = 0.5,
        temperature: float = 1.0,
        hard_weight: float = 0.0,
        reduction: str = "mean",
        loss_impl: str = "fused",
        chunk_size: int | None = None,
        **gradients: Any,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The distillation loss of this head's logits of ``h`` against a teacher.

        See ``distillation.fused_distillation_loss`` (``loss_impl="fused"``,
        the default, which never builds the ``[..., V]`` logits) and
        ``distillation.distillation_loss`` (``"materialized"``); the head's
        bias, scale and softcap apply to the student, and a factorized head
        distills through its projection.

        Args:
            h: ``[..., D]`` the student's hidden states.
            teacher: ``[..., V]`` logits, or ``(h_t, w_t)``.
            embedding: the table (or module) when tied, as for ``__call__``.
            labels, weights, divergence, beta, temperature, hard_weight,
                reduction: as in ``distillation.distillation_loss``.
            loss_impl: ``"fused"`` or ``"materialized"``.
            chunk_size: tokens per chunk of the fused loss; None for
                ``"materialized"``.
            **gradients: ``filter_eps``, ``filter_target`` and
                ``dw_accumulation`` of the fused loss.

        Returns:
            ``(loss, metrics)`` as ``distillation.distillation_loss``
            returns them.
        """
        _checks.check_choice("loss_impl", loss_impl, ("fused", "materialized"))
        _checks.check_floating("h", h)
        if loss_impl == "materialized" and chunk_size is not None:
            raise ValueError(
                "chunk_size is for loss_impl='fused'; got "
                f"chunk_size={chunk_size!r} with loss_impl='materialized'."
            )
        _check_gradient_options(gradients, loss_impl)
        h, w, bias = self._loss_arrays(h, embedding)
        options = dict(
            labels=labels,
            weights=weights,
            divergence=divergence,
            beta=beta,
            temperature=temperature,
            hard_weight=hard_weight,
            reduction=reduction,
        )
        if loss_impl == "fused":
            return distillation.fused_distillation_loss(
                h,
                w,
                teacher,
                bias=bias,
                scale=self.scale,
                softcap=self.softcap,
                chunk_size=chunk_size,
                **options,
                **gradients,
            )
        logits = head.unembed(h, w, bias, scale=self.scale, softcap=self.softcap)
        if isinstance(teacher, (tuple, list)):
            teacher = head.unembed(*teacher)
        return distillation.distillation_loss(logits, teacher, **options)

    def _post_training(self, fn, hs, embedding, *args, **options):
        """``fn(*projected hs, w, *args, bias=..., scale=..., softcap=...)``:
        one read of the unembedding for every ``h`` of a loss."""
        for h in hs:
            _checks.check_floating("h", h)
        w, bias, projection = self.unembedding(jnp.shape(hs[0])[-1], embedding)
        if isinstance(w, quantize.QuantizedTable):
            raise ValueError(
                "a QuantizedTable is for inference; train with the float table."
            )
        hs = [self._project(h, projection) for h in hs]
        head_options = dict(bias=bias, scale=self.scale, softcap=self.softcap)
        return fn(*hs, w, *args, **head_options, **options)

    def token_logprobs(
        self,
        h: jax.Array,
        ids: jax.Array,
        embedding: Embedding | None = None,
        **options,
    ) -> token_logprobs.TokenLogProbs:
        """Per-token log-probs (and entropies) of ``ids`` under this head,
        fused; see ``token_logprobs.fused_token_logprobs`` for ``options``.
        A factorized head goes through its projection."""
        return self._post_training(
            lambda h, w, **o: token_logprobs.fused_token_logprobs(h, w, ids, **o),
            [h],
            embedding,
            **options,
        )

    def preference_loss(
        self,
        h_chosen: jax.Array,
        h_rejected: jax.Array,
        chosen_ids: jax.Array,
        rejected_ids: jax.Array,
        chosen_mask: jax.Array,
        rejected_mask: jax.Array,
        embedding: Embedding | None = None,
        **options,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """DPO, SimPO, ORPO or CPO of this head's log-probs, fused; see
        ``preference.fused_preference_loss`` for ``options`` (a
        ``reference_head`` gives the reference's own ``h`` and ``w``)."""
        return self._post_training(
            preference.fused_preference_loss,
            [h_chosen, h_rejected],
            embedding,
            chosen_ids,
            rejected_ids,
            chosen_mask,
            rejected_mask,
            **options,
        )

    def policy_gradient_loss(
        self,
        h: jax.Array,
        ids: jax.Array,
        mask: jax.Array,
        advantages: jax.Array,
        embedding: Embedding | None = None,
        **options,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """GRPO and its variants on this head's log-probs, fused; see
        ``policy_gradient.fused_policy_gradient_loss`` for ``options``."""
        return self._post_training(
            policy_gradient.fused_policy_gradient_loss,
            [h],
            embedding,
            ids,
            mask,
            advantages,
            **options,
        )

    def sparse_distillation_loss(
        self,
        h: jax.Array,
        teacher_ids: jax.Array,
        teacher_logps: jax.Array,
        embedding: Embedding | None = None,
        **options,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The forward KL from a teacher's top-k on this head, fused; see
        ``sparse_distillation.fused_sparse_distillation_loss``."""
        return self._post_training(
            sparse_distillation.fused_sparse_distillation_loss,
            [h],
            embedding,
            teacher_ids,
            teacher_logps,
            **options,
        )


def _check_gradient_options(gradients: dict, loss_impl: str) -> None:
    """``LMHead``'s pass-through of the fused sweep's gradient options:
    known names, and the fused loss only."""
    allowed = ("filter_eps", "filter_target", "dw_accumulation")
    unknown = sorted(set(gradients) - set(allowed))
    if unknown:
        raise TypeError(f"unknown options {unknown}; allowed: {list(allowed)}.")
    if gradients and loss_impl != "fused":
        raise ValueError(
            f"{', '.join(sorted(gradients))} are options of loss_impl='fused'; "
            f"got loss_impl={loss_impl!r}."
        )


def _table_shape(w: Any) -> tuple[int, ...]:
    return w.shape if isinstance(w, quantize.QuantizedTable) else jnp.shape(w)
