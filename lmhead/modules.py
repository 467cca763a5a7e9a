"""Flax Linen wrappers of the output head and of a factorized embedding.

``LMHead`` only decides which ``[V, D]`` array is the unembedding -- the
input embedding table when tied, a parameter of its own when untied -- and
calls the pure functions of the head library with it. No math is written
here. A factorized head (``LMHead(rank=r)``) has ``w = A @ B``, ``A: [V, r]``,
``B: [r, D]``, and never forms it: it projects ``h @ B.T`` and hands it with
``A`` to the same functions (docs/large_vocab.md, "A factorized head").
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
    kto,
    losses,
    policy_gradient,
    preference,
    quantize,
    sparse_distillation,
    token_logprobs,
    vocab_parallel,
)

LOSS_IMPLS = ("fused", "materialized", "vocab_parallel")
GRADIENT_OPTIONS = ("filter_eps", "filter_target", "dw_accumulation", "vocab_order")


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
        >>> params = jax.jit(embed.init)(jax.random.key(0), jnp.zeros((1, 3), int))
        >>> jax.tree.map(jnp.shape, params)
        {'params': {'embedding': (10, 2), 'projection': (2, 8)}}
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


def _times_transposed(x: jax.Array, matrix: jax.Array) -> jax.Array:
    """``x @ matrix.T`` accumulated in float32, in ``x``'s dtype."""
    product = jnp.einsum("...a,ba->...b", x, matrix, preferred_element_type=jnp.float32)
    return product.astype(x.dtype)


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


def _check_blocked_options(
    loss_impl: str, impls: tuple[str, ...], chunk_size: Any, gradients: dict
) -> None:
    """``loss_impl`` in ``impls``; ``chunk_size`` for the blocked losses and
    the fused sweep's gradient options (known names) for ``"fused"`` only."""
    _checks.check_choice("loss_impl", loss_impl, impls)
    if loss_impl == "materialized" and chunk_size is not None:
        blocked = ", ".join(repr(i) for i in impls if i != "materialized")
        raise ValueError(
            f"chunk_size is for the blocked losses ({blocked}); got "
            f"chunk_size={chunk_size!r} with loss_impl='materialized'."
        )
    unknown = sorted(set(gradients) - set(GRADIENT_OPTIONS))
    if unknown:
        raise TypeError(
            f"unknown options {unknown}; allowed: {list(GRADIENT_OPTIONS)}."
        )
    if gradients and loss_impl != "fused":
        raise ValueError(
            f"{', '.join(sorted(gradients))} are options of loss_impl='fused'; "
            f"got loss_impl={loss_impl!r}."
        )


def _table_shape(w: Any) -> tuple[int, ...]:
    return w.shape if isinstance(w, quantize.QuantizedTable) else jnp.shape(w)


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
            ``[1, min(V, D)]`` for the factorized ``w = A @ B``: untied, the
            head owns ``unembedding: [V, r]`` and ``projection: [r, D]``
            (initialized by :func:`projection_init`); tied, the call's
            ``embedding`` is a :class:`FactorizedEmbed` or its pair ``(A, B)``.

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

    def _through_head(self, fn, hs, embedding, *args, training=True, **options):
        """``fn(*hs projected, w, *args, bias=, scale=, softcap=, **options)``:
        one read of the unembedding for every ``h`` of a call; a loss
        (``training``) refuses a quantized table."""
        for h in hs:
            _checks.check_floating("h", h)  # before the cast to self.dtype
        w, bias, projection = self.unembedding(jnp.shape(hs[0])[-1], embedding)
        if training and isinstance(w, quantize.QuantizedTable):
            raise ValueError(
                "a QuantizedTable is for inference; train, evaluate and "
                "distill with the float table."
            )
        hs = [jnp.asarray(h, self.dtype) for h in hs]
        if projection is not None:
            hs = [_times_transposed(h, projection) for h in hs]
        head_options = dict(bias=bias, scale=self.scale, softcap=self.softcap)
        return fn(*hs, w, *args, **head_options, **options)

    def __call__(self, h: jax.Array, embedding: Embedding | None = None) -> jax.Array:
        """Logits ``[..., V]`` (float32) from hidden states ``h: [..., D]``."""
        return self._through_head(head.unembed, [h], embedding, training=False)

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
        ignore_index: int = losses.IGNORE_INDEX,
        reduction: str = "mean",
        grouped_metrics: bool = False,
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
                builds them; ``"vocab_parallel"`` splits them over the
                ``"model"`` axis of the mesh set by ``jax.set_mesh`` (see
                ``vocab_parallel.vocab_parallel_cross_entropy``).
            chunk_size: tokens per block of the blocked losses; must be None
                for ``"materialized"``.
            label_smoothing, smoothing, z_loss: as in
                ``losses.cross_entropy``.
            ignore_index: the label of an ignored token (weight 0), ``-100``
                by default; the same rule for every ``loss_impl``
                (``losses.valid_weights``).
            reduction, grouped_metrics: as in ``losses.cross_entropy``
                (the multi-token loss sums depths stacked on the leading
                axis, with metrics per depth).
            **gradients: ``filter_eps``, ``filter_target``,
                ``dw_accumulation`` and ``vocab_order`` of
                ``fused.fused_cross_entropy``, for ``loss_impl="fused"`` only.

        Returns:
            ``(loss, metrics)`` as ``losses.cross_entropy`` returns them.
        """
        _check_blocked_options(loss_impl, LOSS_IMPLS, chunk_size, gradients)
        options = dict(
            weights=weights,
            label_smoothing=label_smoothing,
            smoothing=smoothing,
            z_loss=z_loss,
            ignore_index=ignore_index,
            reduction=reduction,
            grouped_metrics=grouped_metrics,
        )
        if loss_impl == "materialized":
            return self._through_head(
                lambda h, w, **o: losses.cross_entropy(
                    head.unembed(h, w, **o), labels, **options
                ),
                [h],
                embedding,
            )
        blocked = {
            "fused": fused.fused_cross_entropy,
            "vocab_parallel": vocab_parallel.vocab_parallel_cross_entropy,
        }
        return self._through_head(
            blocked[loss_impl],
            [h],
            embedding,
            labels,
            chunk_size=chunk_size,
            **options,
            **gradients,
        )

    def distillation_loss(
        self,
        h: jax.Array,
        teacher: Any,
        embedding: Embedding | None = None,
        *,
        loss_impl: str = "fused",
        chunk_size: int | None = None,
        **options: Any,
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
            loss_impl: ``"fused"`` or ``"materialized"``.
            chunk_size: tokens per chunk of the fused loss; None for
                ``"materialized"``.
            **options: ``labels``, ``weights``, ``divergence``, ``beta``,
                ``temperature``, ``hard_weight`` and ``reduction`` of
                ``distillation.distillation_loss``, and for the fused loss
                ``filter_eps``, ``filter_target``, ``dw_accumulation`` and
                ``vocab_order``.

        Returns:
            ``(loss, metrics)`` as ``distillation.distillation_loss``
            returns them.
        """
        gradients = {k: options.pop(k) for k in GRADIENT_OPTIONS if k in options}
        impls = ("fused", "materialized")
        _check_blocked_options(loss_impl, impls, chunk_size, gradients)
        if loss_impl == "fused":
            return self._through_head(
                distillation.fused_distillation_loss,
                [h],
                embedding,
                teacher,
                chunk_size=chunk_size,
                **options,
                **gradients,
            )
        if isinstance(teacher, (tuple, list)):
            teacher = head.unembed(*teacher)
        return self._through_head(
            lambda h, w, **o: distillation.distillation_loss(
                head.unembed(h, w, **o), teacher, **options
            ),
            [h],
            embedding,
        )

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
        return self._through_head(
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
        """A preference loss of chosen/rejected pairs (DPO and its family,
        SimPO, ORPO, CPO) on this head's log-probs, fused; see
        ``preference.fused_preference_loss`` for ``options`` (a
        ``reference_head`` gives the reference's own ``h`` and ``w``)."""
        return self._through_head(
            preference.fused_preference_loss,
            [h_chosen, h_rejected],
            embedding,
            chosen_ids,
            rejected_ids,
            chosen_mask,
            rejected_mask,
            **options,
        )

    def kto_loss(
        self,
        h: jax.Array,
        ids: jax.Array,
        mask: jax.Array,
        desirable: jax.Array,
        embedding: Embedding | None = None,
        **options,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """KTO on completions labelled ``desirable`` or not, on this head's
        log-probs, fused; see ``kto.fused_kto_loss`` for ``options`` (the
        reference point ``kl``, e.g. ``kto.kto_reference_point`` of
        :meth:`token_logprobs` of mismatched completions)."""
        return self._through_head(
            kto.fused_kto_loss,
            [h],
            embedding,
            ids,
            mask,
            desirable,
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
        return self._through_head(
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
        return self._through_head(
            sparse_distillation.fused_sparse_distillation_loss,
            [h],
            embedding,
            teacher_ids,
            teacher_logps,
            **options,
        )
