r"""Multi-token prediction (MTP): the modules of ``DecoderLM``'s further heads.

``DecoderLM(mtp_heads=k)`` predicts, besides the next token, the tokens
``1 .. k`` positions past it, with ``k`` modules on the trunk
(:class:`DepthModule`), each read out by a LayerNorm of its own and an
unembedding (the main head's, ``mtp_unembedding="shared"``, or one table
for all depths, ``"own"``). Two designs (:data:`DESIGNS`):

* ``"sequential"`` (DeepSeek-V3): module :math:`i` at position :math:`t`
  reads the previous depth's residual stream :math:`g_{i-1,t}` (the
  trunk's, :math:`g_0`, before its final LayerNorm) and the embedding of
  the token :math:`i` positions ahead,

  .. math::
      g_{i,t} = \mathrm{Block}_i\big(P_i\,[\mathrm{LN}(g_{i-1,t});\,
          \mathrm{LN}(E\,x_{t+i})]\big),

  and predicts :math:`x_{t+i+1}`;
* ``"parallel"`` (Gloeckle et al.): :math:`g_{i,t} =
  \mathrm{Block}_i(g_{0,t})`, each module one block on the trunk.

Decoding (``DecoderLM.extend``) runs the modules beside the trunk when the
cache has their layers (``kv_cache.init_cache(..., mtp=True)``): module
:math:`i` of the sequential design, fed token :math:`x_s`, computes its
position :math:`t = s - i` (it reads the token :math:`i` ahead), from the
previous depth's stream one feed earlier; its keys and values take slot
:math:`t` of its own layer of the cache, so rolling the cache's ``index``
back drops every depth's rejected positions at once. docs/decoding.md,
"Speculative decoding", describes the proposals made from them.

References:
    Gloeckle et al. 2024, "Better & Faster Large Language Models via
    Multi-token Prediction", arXiv:2404.19737; DeepSeek-AI 2024,
    "DeepSeek-V3 Technical Report", arXiv:2412.19437.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmhead.lm.layers import INIT_STD, Block, layer_norm

DESIGNS = ("sequential", "parallel")
UNEMBEDDINGS = ("shared", "own")


class DepthModule(nn.Module):
    """Module ``i`` of the MTP heads: (sequential only) two LayerNorms and a
    projection of ``[LN(g_{i-1}); LN(E x_{t+i})]``, then one pre-LayerNorm
    :class:`~lmhead.lm.layers.Block`; :meth:`output` is its final LayerNorm,
    what the unembedding reads.

    Parameters: ``hidden_norm``, ``embed_norm`` (LayerNorm scale, bias
    ``[D]``) and ``projection`` (kernel ``[2D, D]``, bias ``[D]``), for the
    sequential design only; ``block/...`` as a trunk block's;
    ``final_norm`` (scale, bias ``[D]``). Biases follow ``use_bias``.
    """

    sequential: bool
    d_model: int
    num_heads: int
    mlp_dim: int
    dropout_rate: float
    residual_init_std: float
    rope: bool
    use_bias: bool
    dtype: Any
    activation: str
    attention_implementation: str

    def setup(self):
        if self.sequential:
            self.hidden_norm = layer_norm(self.use_bias, self.dtype)
            self.embed_norm = layer_norm(self.use_bias, self.dtype)
            self.projection = nn.Dense(
                self.d_model,
                use_bias=self.use_bias,
                dtype=self.dtype,
                kernel_init=nn.initializers.normal(INIT_STD),
            )
        self.block = Block(
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            dropout_rate=self.dropout_rate,
            residual_init_std=self.residual_init_std,
            rope=self.rope,
            use_bias=self.use_bias,
            dtype=self.dtype,
            activation=self.activation,
            attention_implementation=self.attention_implementation,
        )
        self.final_norm = layer_norm(self.use_bias, self.dtype)

    def __call__(self, previous, embedded, positions, cache, *, train):
        """``previous``: ``[B, T, D]`` the stream this depth reads (the
        previous depth's, or the trunk's); ``embedded``: ``[B, T, D]`` the
        embeddings of the tokens ``i`` ahead (sequential; None for
        parallel); ``positions`` and ``cache`` as
        :class:`~lmhead.lm.layers.CausalSelfAttention`'s. Returns ``(g
        [B, T, D] float32, cache)``."""
        x = previous
        if self.sequential:
            both = jnp.concatenate(
                [self.hidden_norm(previous), self.embed_norm(embedded)], axis=-1
            )
            x = self.projection(both).astype(jnp.float32)
        return self.block(x, positions, cache, train=train)

    def output(self, g: jax.Array) -> jax.Array:
        """The final LayerNorm of this depth's stream ``g: [..., D]``."""
        return self.final_norm(g)
