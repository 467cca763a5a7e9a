"""A small decoder-only Transformer whose output layer is ``modules.LMHead``.

GPT-2 layout: token embedding plus positions (learned, or rotary), pre-LayerNorm
blocks of causal self-attention and a GELU MLP (:mod:`lmhead.lm.layers`), a
final LayerNorm, then the head, tied to the embedding table or with an
unembedding of its own. Decoding: :mod:`lmhead.lm.inference`'s ``prefill``
fills a key/value cache (:mod:`lmhead.lm.kv_cache`) and its ``make_step_fn``
gives the decoders' ``step_fn(params, tokens, cache) -> (logits, cache)``.

Parameter tree (``params``)::

    embed/embedding          [V, D]      token table (the tied head's W)
    position_embedding       [max_len, D]   only with positions="learned"
    blocks_{i}/attention_norm, mlp_norm     LayerNorm scale, bias [D]
    blocks_{i}/attention/qkv kernel [D, 3D], bias [3D]
    blocks_{i}/attention/out kernel [D, D], bias [D]    (residual projection)
    blocks_{i}/mlp_in        kernel [D, F], bias [F]
    blocks_{i}/mlp_out       kernel [F, D], bias [D]    (residual projection)
    final_norm               scale, bias [D]
    head/...                 untied: unembedding [V, D]; bias [V] if head_bias
    (head_rank = r)          embed/embedding [V, r] and embed/projection [r, D]
                             when tied (modules.FactorizedEmbed, shared by the
                             head); head/unembedding [V, r] and
                             head/projection [r, D] when untied
    head_table               optional, tied only, inference only: the head's
                             [V, D] table in place of embed/embedding (e.g. a
                             quantize.QuantizedTable; see
                             generation.quantize_for_decoding)
    mtp_{i}/...              with mtp_heads = k: depth i + 1's module
                             (mtp.DepthModule: a block, its final norm, and
                             for the sequential design two norms and a
                             projection [2D, D])
    mtp_head/unembedding     with mtp_unembedding="own": the MTP depths' [V, D]

With ``use_bias=False`` (nanoGPT's default) none of the blocks' or norms'
``bias`` entries exist; the head's bias is ``head_bias``'s alone.
"""

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmhead import _checks, losses, modules
from lmhead.head import last_positions
from lmhead.lm import attention, kv_cache, mtp
from lmhead.lm.layers import ACTIVATIONS, INIT_STD, Block, layer_norm
from lmhead.lm.layers import LAYER_NORM_EPSILON as LAYER_NORM_EPSILON

POSITIONS = ("learned", "rope")
# The params entry of a tied model's inference-only head table.
HEAD_TABLE = "head_table"


class DecoderLM(nn.Module):
    r"""Decoder-only Transformer language model with a tied or untied head.

    Parameters are float32; ``dtype`` is the compute dtype of the matmuls,
    LayerNorm outputs and the cache. The residual stream stays float32 and the
    logits are float32 whatever ``dtype`` is. Init as in GPT-2: every weight
    :math:`\mathcal N(0, 0.02^2)` except the two residual projections of each
    block (``attention/out``, ``mlp_out``), :math:`\mathcal N(0, (0.02 /
    \sqrt{2 L})^2)`, so that the residual stream's variance does not grow
    with depth; biases 0, LayerNorm scales 1. LayerNorms use
    :math:`\epsilon` = ``LAYER_NORM_EPSILON`` (1e-5, as GPT-2), the MLP the
    exact (erf) GELU unless ``activation`` says otherwise.

    Attributes:
        vocab_size: ``V``.
        num_layers: ``L``, the number of blocks.
        num_heads: ``H``; must divide ``d_model``.
        d_model: ``D``, the width of the residual stream.
        mlp_dim: ``F``, the MLP's hidden width.
        max_len: the longest sequence, and the cache's length.
        dropout_rate: on embeddings, attention weights and both residual
            branches when ``train=True`` (rng name ``"dropout"``).
        tied: the head uses the embedding table as its unembedding.
        positions: ``"learned"`` (a ``[max_len, D]`` table added to the token
            embeddings) or ``"rope"`` (queries and keys rotated, no table).
        use_bias: biases in the attention and MLP dense layers and in every
            LayerNorm (GPT-2); False drops them all, as nanoGPT's default
            ``bias=False`` does. The head's bias is ``head_bias``.
        head_rank: None, or ``r`` for the factorized head ``w = A @ B``
            (``modules.LMHead``'s ``rank``): tied, the input embedding is a
            ``modules.FactorizedEmbed`` of the same rank and the head shares
            its ``A`` and ``B``; untied, the embedding stays ``[V, D]`` and
            the head owns its factors.
        head_bias, head_scale, logits_softcap: passed to ``modules.LMHead``
            as ``use_bias``, ``scale``, ``softcap``.
        dtype: compute dtype, e.g. ``jnp.float32`` or ``jnp.bfloat16``.
        activation: the MLP's, one of ``layers.ACTIVATIONS``: ``"gelu"``
            (exact) or ``"gelu_tanh"`` (GPT-2's tanh form, for checkpoints
            trained with it; see ``lmhead.lm.gpt2_import``).
        mtp_heads: ``k >= 0`` multi-token prediction depths
            (:mod:`lmhead.lm.mtp`): depth ``i`` predicts the token ``i``
            past the next one. 0 (default) is the plain model.
        mtp_design: ``"sequential"`` (DeepSeek-V3's chained modules) or
            ``"parallel"`` (Gloeckle et al.'s blocks on the trunk).
        mtp_unembedding: ``"shared"`` (the depths read out through the main
            head, tied or untied as it is) or ``"own"`` (one ``[V, D]``
            table of their own, shared by the depths).
        attention_implementation: attention over a sequence (training,
            scoring), one of ``attention.IMPLEMENTATIONS``: ``"xla"`` (the
            softmax written out), ``"cudnn"`` (flash attention through
            ``jax.nn.dot_product_attention``: an NVIDIA GPU, bfloat16 or
            float16), or ``"auto"`` (default), cuDNN's where it runs and
            XLA's elsewhere (:func:`lmhead.lm.attention.causal_attention`).
            Dropout on the weights, and sowing them, write them out in XLA
            whatever this is; so do a prompt's prefill and decoding, which
            read the cache's filled slots.

    Token ids outside ``[0, V)`` raise ValueError outside ``jit``; inside
    ``jit`` they look up NaN embeddings (``nn.Embed``'s rule), so the logits of
    that row are NaN.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = DecoderLM(vocab_size=17, num_layers=1, num_heads=2,
        ...                   d_model=8, mlp_dim=16, max_len=8)
        >>> tokens = jnp.array([[1, 2, 3, 4]])
        >>> params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
        >>> sum(x.size for x in jax.tree.leaves(params))
        816
        >>> jax.jit(model.apply)({"params": params}, tokens).shape
        (1, 4, 17)
        >>> loss, metrics = model.apply({"params": params}, tokens[:, :-1],
        ...                             tokens[:, 1:], method=DecoderLM.loss)
        >>> bool(abs(loss - jnp.log(17.0)) < 0.3)  # near-uniform at init
        True
    """

    vocab_size: int
    num_layers: int = 4
    num_heads: int = 4
    d_model: int = 128
    mlp_dim: int = 512
    max_len: int = 64
    dropout_rate: float = 0.0
    tied: bool = True
    positions: str = "learned"
    use_bias: bool = True
    head_bias: bool = False
    head_scale: float | None = None
    logits_softcap: float | None = None
    head_rank: int | None = None
    dtype: Any = jnp.float32
    activation: str = "gelu"
    mtp_heads: int = 0
    mtp_design: str = "sequential"
    mtp_unembedding: str = "shared"
    attention_implementation: str = "auto"

    def setup(self):
        self._check_config()
        normal = nn.initializers.normal(INIT_STD)
        if self.tied and self.head_rank is not None:
            self.embed = modules.FactorizedEmbed(
                self.vocab_size, self.d_model, self.head_rank, embedding_init=normal
            )
        else:
            self.embed = nn.Embed(self.vocab_size, self.d_model, embedding_init=normal)
        if self.positions == "learned":
            self.position_embedding = self.param(
                "position_embedding", normal, (self.max_len, self.d_model)
            )
        # What every block takes, the MTP depths' blocks too.
        block = dict(
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            dropout_rate=self.dropout_rate,
            residual_init_std=INIT_STD / math.sqrt(2 * self.num_layers),
            rope=self.positions == "rope",
            use_bias=self.use_bias,
            dtype=self.dtype,
            activation=self.activation,
            attention_implementation=self.attention_implementation,
        )
        self.blocks = [Block(**block) for _ in range(self.num_layers)]
        self.embed_dropout = nn.Dropout(self.dropout_rate)
        self.final_norm = layer_norm(self.use_bias, self.dtype)
        self.head = modules.LMHead(
            self.vocab_size,
            tied=self.tied,
            use_bias=self.head_bias,
            scale=self.head_scale,
            softcap=self.logits_softcap,
            dtype=self.dtype,
            rank=self.head_rank,
        )
        self.mtp = [
            mtp.DepthModule(
                sequential=self.mtp_design == "sequential",
                d_model=self.d_model,
                **block,
            )
            for _ in range(self.mtp_heads)
        ]
        if self.mtp_heads and self.mtp_unembedding == "own":
            self.mtp_head = modules.LMHead(
                self.vocab_size,
                tied=False,
                use_bias=self.head_bias,
                scale=self.head_scale,
                softcap=self.logits_softcap,
                dtype=self.dtype,
                rank=self.head_rank,
            )

    def _check_config(self):
        for name in (
            "vocab_size",
            "num_layers",
            "num_heads",
            "d_model",
            "mlp_dim",
            "max_len",
        ):
            _checks.check_count(name, getattr(self, name))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"num_heads must divide d_model; got num_heads="
                f"{self.num_heads}, d_model={self.d_model}."
            )
        _checks.check_choice("positions", self.positions, POSITIONS)
        _checks.check_choice("activation", self.activation, ACTIVATIONS)
        _checks.check_choice(
            "attention_implementation",
            self.attention_implementation,
            attention.IMPLEMENTATIONS,
        )
        _checks.check_in_range("mtp_heads", self.mtp_heads, low=0)
        if isinstance(self.mtp_heads, bool) or not isinstance(self.mtp_heads, int):
            raise TypeError(
                f"mtp_heads must be an integer >= 0; got {self.mtp_heads!r}."
            )
        _checks.check_choice("mtp_design", self.mtp_design, mtp.DESIGNS)
        _checks.check_choice("mtp_unembedding", self.mtp_unembedding, mtp.UNEMBEDDINGS)
        if self.positions == "rope" and (self.d_model // self.num_heads) % 2:
            raise ValueError(
                "positions='rope' needs an even head size d_model / "
                f"num_heads; got {self.d_model // self.num_heads}."
            )
        _checks.check_in_range(
            "dropout_rate", self.dropout_rate, low=0.0, high=1.0, high_open=True
        )
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise TypeError(f"dtype must be a floating dtype; got {self.dtype}.")

    def _check_tokens(self, tokens) -> jax.Array:
        _checks.check_integer("tokens", tokens)
        _checks.check_rank("tokens", tokens, 2, "[B, T]")
        _checks.check_in_range("tokens", tokens, low=0, high=self.vocab_size - 1)
        if jnp.shape(tokens)[1] > self.max_len:
            raise ValueError(
                f"tokens has {jnp.shape(tokens)[1]} positions but the "
                f"model's max_len is {self.max_len}."
            )
        return jnp.asarray(tokens)

    def _tied_unembedding(self) -> Any:
        """The unembedding the head is given when tied: ``params[HEAD_TABLE]``
        if present (a table for inference, see
        ``generation.quantize_for_decoding``), else the embedding table;
        with ``head_rank``, the pair (that table, the embedding's
        projection). None when untied (the head owns its own)."""
        if not self.tied:
            return None
        if self.has_variable("params", HEAD_TABLE):
            table = self.get_variable("params", HEAD_TABLE)
        else:
            table = self.embed.embedding
        if self.head_rank is None:
            return table
        return table, self.embed.projection

    def _residual_stream(self, tokens, positions, caches, train):
        """Embedding and blocks: (the residual stream [B, T, D] before the
        final LayerNorm, new caches)."""
        x = self.embed(tokens)
        if self.positions == "learned":
            # Clipped: a position past max_len only occurs past a full cache.
            x = x + jnp.take(self.position_embedding, positions, axis=0, mode="clip")
        x = self.embed_dropout(x, deterministic=not train)
        new_caches = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block(x, positions, cache, train=train)
            new_caches.append(cache)
        return x, new_caches

    def _sequence(self, tokens, train):
        """The trunk over a whole sequence: ``(residual stream [B, T, D],
        positions [B, T])``."""
        tokens = self._check_tokens(tokens)
        time = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(time), tokens.shape)
        x, _ = self._residual_stream(tokens, positions, [None] * self.num_layers, train)
        return x, positions

    def hidden(self, tokens: jax.typing.ArrayLike, *, train: bool = False) -> jax.Array:
        """Final hidden states ``h: [B, T, D]`` (after the final LayerNorm) of
        ``tokens: int [B, T]``, ``T <= max_len``; causal: ``h[:, t]`` depends
        on ``tokens[:, :t + 1]`` only."""
        return self.final_norm(self._sequence(tokens, train)[0])

    def __call__(
        self, tokens: jax.typing.ArrayLike, *, train: bool = False
    ) -> jax.Array:
        """Next-token logits ``float32 [B, T, V]`` for ``tokens: int [B, T]``."""
        if self.mtp_heads and self.is_initializing():
            # The MTP depths' parameters are made with the rest.
            self.depth_logits(tokens)
        return self.head(self.hidden(tokens, train=train), self._tied_unembedding())

    def _depth(self, depth, previous, tokens, positions, cache, train):
        """Module ``depth`` (1-based) over ``previous [B, T, D]`` and (the
        sequential design) the embeddings of ``tokens [B, T]``."""
        module = self.mtp[depth - 1]
        embedded = self.embed(tokens) if self.mtp_design == "sequential" else None
        return module(previous, embedded, positions, cache, train=train)

    def _depth_streams(self, x, tokens, positions, train):
        """Every depth's stream ``g_i: [B, T, D]`` over a whole sequence:
        the sequential design's depth ``i`` reads the tokens ``i`` ahead
        (padded with 0 past the end: positions whose targets do not exist)."""
        streams, previous = [], x
        for depth in range(1, self.mtp_heads + 1):
            ahead = jnp.pad(tokens[:, depth:], ((0, 0), (0, depth)))
            previous, _ = self._depth(
                depth, previous if self.mtp_design == "sequential" else x,
                ahead, positions, None, train,
            )  # fmt: skip
            streams.append(previous)
        return streams

    def _depth_head(self, outputs: jax.Array) -> jax.Array:
        """Logits of the MTP depths' outputs ``[..., D]``: ``[..., V]``."""
        if self.mtp_unembedding == "own":
            return self.mtp_head(outputs)
        return self.head(outputs, self._tied_unembedding())

    def depth_logits(self, tokens: jax.typing.ArrayLike) -> jax.Array:
        """The MTP depths' logits ``float32 [k, B, T, V]``: row ``i - 1``
        at position ``t`` is depth ``i``'s distribution of token ``t + i +
        1`` (meaningless where ``t + i >= T``: the sequential design reads
        the tokens ``i`` ahead). Materialized, for tests and inspection; the
        training loss is :meth:`loss`'s."""
        x, positions = self._sequence(tokens, False)
        streams = self._depth_streams(x, jnp.asarray(tokens), positions, False)
        return jnp.stack(
            [self._depth_head(module.output(g)) for module, g in zip(self.mtp, streams)]
        )

    def loss(
        self,
        tokens: jax.typing.ArrayLike,
        labels: jax.typing.ArrayLike,
        weights: jax.typing.ArrayLike | None = None,
        *,
        train: bool = False,
        mtp_weight: jax.typing.ArrayLike = 0.3,
        **loss_kwargs,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        r"""``LMHead.loss`` of the hidden states of ``tokens: int [B, T]``.

        ``labels: int [B, T]``, ``weights: [B, T]`` or None; ``loss_kwargs``
        are ``LMHead.loss``'s keywords (``loss_impl``, ``label_smoothing``,
        ``smoothing``, ``z_loss``, ``chunk_size``, the fused sweep's). Returns
        (loss, metrics) as ``losses.cross_entropy`` does.

        With ``mtp_heads = k > 0`` the loss is

        .. math::
            L = \mathrm{CE}_0 + \frac{\lambda}{k} \sum_{i=1}^k \mathrm{CE}_i,

        :math:`\lambda` = ``mtp_weight``, :math:`\mathrm{CE}_i` depth
        :math:`i`'s mean loss (every option of the main one) over the
        positions whose target :math:`y_{t+i}` exists
        (``losses.depth_targets``: the others weigh 0). Depths that share an
        unembedding are one call of the head's loss: their hidden states
        stacked ``[G, B, T, D]``, reduced as a sum with those weights, so
        the fused loss runs one sweep (``"shared"``: the main head and the
        ``k`` depths; ``"own"``: the main head, then the depths). The
        metrics are the main head's (``loss`` is :math:`L`), plus
        ``depth{i}_loss``,
        ``depth{i}_nll`` and ``depth{i}_accuracy`` of each depth (its
        accuracy estimates how often its proposals are accepted by greedy
        speculative decoding).
        """
        if not self.mtp_heads:
            h = self.hidden(tokens, train=train)
            return self.head.loss(
                h, labels, self._tied_unembedding(), weights=weights, **loss_kwargs
            )
        x, positions = self._sequence(tokens, train)
        streams = self._depth_streams(x, jnp.asarray(tokens), positions, train)
        outputs = [module.output(g) for module, g in zip(self.mtp, streams)]
        for key in ("reduction", "grouped_metrics"):
            if key in loss_kwargs:
                raise ValueError(
                    f"{key} is not a keyword of a model with MTP heads: its loss "
                    "is the main head's mean plus the depths' weighted means."
                )
        if not _checks.is_traced(mtp_weight) and not (
            jnp.ndim(mtp_weight) == 0 and 0 <= float(mtp_weight) < math.inf
        ):
            raise ValueError(
                f"mtp_weight must be a finite number >= 0; got {mtp_weight!r}."
            )
        k, ignore = self.mtp_heads, loss_kwargs.get("ignore_index", losses.IGNORE_INDEX)
        depth_scale = jnp.asarray(mtp_weight, jnp.float32) / k
        grouped = dict(reduction="sum", grouped_metrics=True, **loss_kwargs)
        h = self.final_norm(x)
        if self.mtp_unembedding == "shared":
            scales = jnp.concatenate([jnp.ones(1), jnp.full(k, depth_scale)])
            labels_g, weights_g = losses.depth_targets(
                labels, weights, tuple(range(k + 1)), scales, ignore
            )
            loss, stacked = self.head.loss(
                jnp.stack([h, *outputs]), labels_g, self._tied_unembedding(),
                weights=weights_g, **grouped,
            )  # fmt: skip
            main = {name: value[0] for name, value in stacked.items()}
            depths = {name: value[1:] for name, value in stacked.items()}
        else:
            loss, main = self.head.loss(
                h, labels, self._tied_unembedding(), weights=weights, **loss_kwargs
            )
            labels_g, weights_g = losses.depth_targets(
                labels,
                weights,
                tuple(range(1, k + 1)),
                jnp.full(k, depth_scale),
                ignore,
            )
            depth_loss, depths = self.mtp_head.loss(
                jnp.stack(outputs), labels_g, weights=weights_g, **grouped
            )
            loss = loss + depth_loss
        valid = jnp.asarray(labels) != ignore
        main["weight_sum"] = jnp.sum(
            valid if weights is None else jnp.where(valid, weights, 0.0),
            dtype=jnp.float32,
        )
        main["loss"] = loss
        for i in range(k):
            for name in ("loss", "nll", "accuracy"):
                main[f"depth{i + 1}_{name}"] = depths[name][i]
        return loss, main

    def extend(
        self,
        tokens: jax.Array,
        cache: kv_cache.DecodeCache,
        lengths: jax.Array,
        every_position: bool = False,
    ) -> tuple[jax.Array, kv_cache.DecodeCache]:
        """Appends ``lengths[b]`` tokens to row ``b`` of the cache.

        Args:
            tokens: ``int [B, T]``, right-padded: row ``b``'s new tokens are
                ``tokens[b, :lengths[b]]``; they take positions
                ``cache.index[b]`` onwards.
            cache: a :class:`~lmhead.lm.kv_cache.DecodeCache` for ``B`` rows;
                one made with ``mtp=True`` runs the MTP depths too
                (:mod:`lmhead.lm.mtp`), their streams kept in
                ``cache.hidden``.
            lengths: ``int32 [B]`` in ``[1, T]``.
            every_position: False: the logits after each row's last new
                token only (only that position goes through the head); True:
                after every new token (speculative verification).

        Returns:
            ``float32 [B, V]`` next-token logits (``[B, T, V]`` with
            ``every_position``), and the cache with ``index + lengths``.
            Keys and values of the padding are written after a row's end,
            where nothing reads them before they are overwritten. Positions
            at or past ``max_len`` are not stored and their logits are
            meaningless; ``inference.prefill`` refuses requests that would get
            there.
        """
        batch, time = tokens.shape
        positions = cache.index[:, None] + jnp.arange(time, dtype=jnp.int32)
        rows = cache.rows
        if rows is not None:
            # The slots written now are the row's own.
            own = jnp.arange(batch, dtype=jnp.int32)[:, None]
            rows = rows.at[own, positions].set(
                jnp.broadcast_to(own, positions.shape), mode="drop"
            )
        layers = [(k, v, rows) for k, v in zip(cache.keys, cache.values)]
        x, kv = self._residual_stream(
            tokens, positions, layers[: self.num_layers], train=False
        )
        hidden = cache.hidden
        if hidden is not None:
            streams, depth_kv = self._cached_depths(
                x, tokens, positions, layers[self.num_layers :], cache
            )
            kv += depth_kv
            written = jnp.stack([x, *streams], axis=2).astype(hidden.dtype)
            hidden = hidden.at[jnp.arange(batch)[:, None], positions].set(
                written, mode="drop"
            )
        h = self.final_norm(x)
        if not every_position:
            h = last_positions(h, lengths)
        logits = self.head(h, self._tied_unembedding())
        return logits, kv_cache.DecodeCache(
            keys=tuple(k for k, _ in kv),
            values=tuple(v for _, v in kv),
            index=cache.index + lengths,
            rows=rows,
            hidden=hidden,
        )

    def _carried(self, cache: kv_cache.DecodeCache) -> jax.Array:
        """``[B, k + 1, D]``: the trunk's and each depth's stream at each
        row's last fed position (``index - 1``; zeros for an empty row)."""
        batch = cache.index.shape[0]
        return cache.hidden[jnp.arange(batch), jnp.maximum(cache.index - 1, 0)]

    def _cached_depths(self, x, tokens, positions, layers, cache):
        """The MTP depths over fed tokens ``[B, T]`` at ``positions``, with
        their layers of the cache: ``(streams, new layers)``. The
        sequential depth ``i`` fed token ``x_s`` computes position ``s -
        i`` from the previous depth's stream one feed earlier (the carried
        one for the first)."""
        carried = self._carried(cache)
        streams, new_layers, previous = [], [], x
        for depth, layer in enumerate(layers, start=1):
            if self.mtp_design == "sequential":
                before = carried[:, depth - 1, None].astype(previous.dtype)
                stream_in = jnp.concatenate([before, previous[:, :-1]], axis=1)
                depth_positions = positions - depth
            else:
                stream_in, depth_positions = x, positions
            previous, layer = self._depth(
                depth, stream_in, tokens, depth_positions, layer, False
            )
            streams.append(previous)
            new_layers.append(layer)
        return streams, new_layers

    def propose(
        self, last: jax.Array, cache: kv_cache.DecodeCache, num_tokens: int
    ) -> tuple[jax.Array, kv_cache.DecodeCache]:
        """The MTP depths' proposals of the ``num_tokens`` tokens after
        ``last``, greedily.

        Args:
            last: ``int32 [B]``, each row's token just chosen, not yet fed
                (it follows the cache's last position ``p = index - 1``).
            cache: a cache made with ``mtp=True``.
            num_tokens: ``1 <= n <= mtp_heads``.

        Returns:
            ``(drafts int32 [B, n], cache)``: draft ``i`` is the argmax of
            depth ``i``'s logits for position ``p + 1 + i``. Parallel: each
            depth read at ``p``. Sequential: depth ``i`` at ``p`` reads the
            tokens after ``p``, ``last`` and the drafts before it, so the
            depths run in a staircase (step ``j`` feeds token ``p + j`` to
            the depths ``j .. n``), writing their keys and values at
            positions the next verification rewrites.
        """
        carried = self._carried(cache)
        if self.mtp_design == "parallel":
            outputs = jnp.stack(
                [self.mtp[i].output(carried[:, i + 1]) for i in range(num_tokens)],
                axis=1,
            )
            drafts = jnp.argmax(self._depth_head(outputs), axis=-1)
            return drafts.astype(jnp.int32), cache
        keys, values = list(cache.keys), list(cache.values)
        # previous[i]: the stream depth i + 1 reads next (depth i's, a feed earlier).
        previous = [carried[:, i, None].astype(jnp.float32) for i in range(num_tokens)]
        token, drafts = last[:, None], []
        for step in range(1, num_tokens + 1):
            fed = cache.index[:, None] + step - 1
            new = {}
            for depth in range(step, num_tokens + 1):
                layer = self.num_layers + depth - 1
                new[depth], (keys[layer], values[layer]) = self._depth(
                    depth, previous[depth - 1], token, fed - depth,
                    (keys[layer], values[layer], cache.rows), False,
                )  # fmt: skip
            logits = self._depth_head(self.mtp[step - 1].output(new[step][:, 0]))
            drafts.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
            token = drafts[-1][:, None]
            previous = [None] * step + [new[d] for d in range(step, num_tokens)]
        return jnp.stack(drafts, axis=1), cache._replace(
            keys=tuple(keys), values=tuple(values)
        )


@functools.partial(jax.jit, static_argnums=0)
def _sown_intermediates(model, params, tokens):
    _, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
    return state["intermediates"]


def attention_weights(
    model: DecoderLM, params: Any, tokens: jax.typing.ArrayLike
) -> tuple[jax.Array, ...]:
    r"""Each layer's attention weights for ``tokens: int [B, T]``.

    Row ``t`` of head ``h`` is the softmax over the positions ``s <= t``,
    :math:`\mathrm{softmax}_s(q_t \cdot k_s / \sqrt{D_h})`, the weights of
    the values that the head mixes at position ``t``; above the diagonal it
    is 0. They are what :class:`CausalSelfAttention` sows into the
    ``"intermediates"`` collection: an ``apply`` that does not make that
    collection mutable computes and keeps nothing extra.

    Returns:
        ``num_layers`` arrays ``float32 [B, H, T, T]`` (query, key).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> model = DecoderLM(vocab_size=17, num_layers=2, num_heads=2,
        ...                   d_model=8, mlp_dim=16, max_len=8)
        >>> tokens = jnp.array([[1, 2, 3, 4]])
        >>> params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
        >>> maps = attention_weights(model, params, tokens)
        >>> len(maps), maps[0].shape, maps[0][0, 0, 0]
        (2, (1, 2, 4, 4), Array([1., 0., 0., 0.], dtype=float32))
    """
    sown = _sown_intermediates(model, params, jnp.asarray(tokens))
    return tuple(
        sown[f"blocks_{i}"]["attention"]["attention_weights"][0]
        for i in range(model.num_layers)
    )


def training_flops_per_token(model: DecoderLM) -> int:
    r"""Training FLOPs per token, :math:`6 N_\text{matmul} + 6 (L + k) T D`
    (Kaplan et al. 2020's :math:`C \approx 6N`, with the attention scores'
    :math:`2 \cdot 2 T D` forward per layer at context :math:`T` =
    ``max_len``, times 3 for the backward pass), the MTP depths included:
    :math:`N_\text{matmul}` counts the weights a token multiplies by, every
    block's dense kernels (the ``k`` depths' too, and the sequential
    design's ``[2D, D]`` projections) and the unembedding once per head that
    reads it (the main one and each depth; ``r (V + D)`` for a factorized
    head of rank ``r``).

    Examples:
        >>> plain = DecoderLM(vocab_size=2048, num_layers=4, d_model=128,
        ...                   mlp_dim=512, max_len=64)
        >>> training_flops_per_token(plain)
        6488064
        >>> mtp = DecoderLM(vocab_size=2048, num_layers=4, d_model=128,
        ...                 mlp_dim=512, max_len=64, mtp_heads=1)
        >>> training_flops_per_token(mtp) - training_flops_per_token(plain)
        2998272
    """
    d, f, v = model.d_model, model.mlp_dim, model.vocab_size
    block = 4 * d * d + 2 * d * f
    unembedding = v * d if model.head_rank is None else model.head_rank * (v + d)
    depth = block + unembedding
    if model.mtp_design == "sequential":
        depth += 2 * d * d
    matmul = model.num_layers * block + unembedding + model.mtp_heads * depth
    layers = model.num_layers + model.mtp_heads
    return 6 * matmul + 6 * layers * model.max_len * d
