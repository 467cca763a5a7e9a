"""The output head as pure functions: hidden states to vocabulary scores.

One layout for the unembedding everywhere: ``w: [V, D]``, one row per token,
so that ``logits = h @ w.T + bias``. A tied head passes the input embedding
table as ``w``; an untied head passes its own matrix. Nothing here branches on
tying.
"""

import math

import jax
import jax.numpy as jnp

from lmhead import _checks, quantize

# A traced temperature cannot be checked for zero at trace time; it is
# clamped to this value instead, which gives a (near) one-hot distribution.
MIN_TEMPERATURE = 1e-6
# The logit of a token with probability 0: exp gives exactly 0 and it stays
# -inf under any rescaling. A row of nothing but -inf (max - max = NaN) is
# computed on zeros here, and avoided in decoding (docs/reliability.md).
NEG_INF = float("-inf")

OUTPUTS = ("logits", "log_probs", "probs")


def apply_softcap(logits: jax.typing.ArrayLike, cap: float) -> jax.Array:
    r"""Bounds logits smoothly to ``(-cap, cap)``, as Gemma 2 does.

    .. math::
        \mathrm{softcap}(z) = c \tanh(z / c)

    Args:
        logits: ``[..., V]`` scores.
        cap: finite ``c > 0``.

    Returns:
        ``[..., V]`` capped scores, same dtype as ``logits``.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_softcap(jnp.array([0.0, 1.0, 100.0]), 30.0)
        Array([ 0.       ,  0.9996298, 29.923738 ], dtype=float32)

    References:
        Gemma Team, `Gemma 2: Improving Open Language Models at a Practical
        Size <https://arxiv.org/abs/2408.00118>`_, 2024.
    """
    _checks.check_in_range(
        "softcap", cap, low=0.0, low_open=True, high=math.inf, high_open=True
    )
    return cap * jnp.tanh(logits / cap)


def unembed(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    precision: jax.lax.PrecisionLike = None,
    out_dtype: jax.typing.DTypeLike = jnp.float32,
) -> jax.Array:
    r"""Projects hidden states onto the vocabulary.

    .. math::
        z = \mathrm{softcap}_c(s \cdot h W^\top + b)

    The product accumulates in float32 whatever the input dtype (bf16 and
    fp16 inputs included), and the result is ``out_dtype`` (float32 unless
    asked otherwise).

    Args:
        h: ``[..., D]`` hidden states.
        w: ``[V, D]`` unembedding, one row per token. For a tied head this is
            the input embedding table. At inference it may be what
            ``quantize.quantize_unembedding`` returns: a half-precision array,
            or an int8 ``QuantizedTable`` (then ``h @ w.T`` is
            ``(h @ values.T) * scales``, still accumulated in float32).
        bias: optional ``[V]`` bias.
        scale: optional finite factor ``s > 0`` on ``h @ w.T`` (e.g.
            ``D ** -0.5``, as the Flax lm1b example does for a tied head).
        softcap: optional finite ``c > 0``; applies ``c * tanh(z / c)`` after
            the bias.
        precision: passed to the matmul (``jax.lax.Precision``).
        out_dtype: dtype of the returned logits.

    Returns:
        ``[..., V]`` logits.

    Examples:
        >>> import jax.numpy as jnp
        >>> h = jnp.array([[1.0, 2.0]])
        >>> w = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
        >>> unembed(h, w, jnp.array([0.5, 0.0, -0.5]), scale=2.0)
        Array([[2.5, 4. , 5.5]], dtype=float32)
    """
    quantized = isinstance(w, quantize.QuantizedTable)
    _checks.check_unembed_inputs(h, w.as_shape() if quantized else w, bias)
    _checks.check_in_range(
        "scale", scale, low=0.0, low_open=True, high=math.inf, high_open=True
    )
    if quantized:
        logits = quantize.matmul_transposed(h, w, precision)
    else:
        logits = jnp.einsum(
            "...d,vd->...v",
            h,
            w,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
    if scale is not None:
        logits = logits * scale
    if bias is not None:
        logits = logits + jnp.asarray(bias, jnp.float32)
    if softcap is not None:
        logits = apply_softcap(logits, softcap)
    return logits.astype(out_dtype)


def _distribution(
    logits: jax.typing.ArrayLike, temperature: float, log: bool
) -> jax.Array:
    """Softmax (or log-softmax) of ``z / T``, with the rule for infinities."""
    _checks.check_logits(logits)
    if (
        not _checks.is_traced(temperature)
        and jnp.ndim(temperature) == 0
        and temperature == 0
    ):
        raise ValueError(
            "temperature must be > 0 for a distribution; temperature 0 means "
            "greedy decoding, which is lmhead.decoding.generate(temperature=0)."
        )
    _checks.check_in_range("temperature", temperature, low=0.0, low_open=True)
    z = jnp.asarray(logits, jnp.float32) / jnp.maximum(temperature, MIN_TEMPERATURE)
    top = jnp.max(z, axis=-1, keepdims=True)
    # Softmax is exp(z - max z), normalized. Where max z = +inf its limit puts
    # all the mass on the +inf entries (where z - max z would be NaN).
    z = jnp.where(top == jnp.inf, jnp.where(z == top, 0.0, NEG_INF), z)
    # A row of -inf has no distribution. It is computed on zeros, which keeps
    # NaN out of the values and the gradients, then set to probability 0.
    empty = top == NEG_INF
    safe = jnp.where(empty, 0.0, z)
    if log:
        return jnp.where(empty, NEG_INF, jax.nn.log_softmax(safe, axis=-1))
    return jnp.where(empty, 0.0, jax.nn.softmax(safe, axis=-1))


def log_probs(logits: jax.typing.ArrayLike, temperature: float = 1.0) -> jax.Array:
    r"""Log-softmax over the last axis, computed in float32.

    .. math::
        \log p_i = z_i / T - \log \sum_j e^{z_j / T}

    The maximum is subtracted before exponentiating, so logits of any size
    give finite results. Infinite logits follow one rule, the limit of the
    formula: a ``-inf`` logit has probability 0; if some logits of a row are
    ``+inf``, they share the row's mass equally and the others get 0; a row
    whose logits are all ``-inf`` (every token masked) has no distribution:
    every entry is ``-inf`` (probability 0, so :func:`probs` sums to 0 there,
    which the caller can test). NaN logits give NaN.

    Args:
        logits: ``[..., V]`` scores.
        temperature: ``T > 0``. A traced ``T`` is clamped below at
            ``MIN_TEMPERATURE`` (its value cannot be checked inside ``jit``).

    Returns:
        ``[..., V]`` float32 log-probabilities.

    Examples:
        >>> import jax.numpy as jnp
        >>> inf = jnp.inf
        >>> log_probs(jnp.array([[0.0, -inf], [-inf, -inf]]))
        Array([[  0., -inf],
               [-inf, -inf]], dtype=float32)
    """
    return _distribution(logits, temperature, log=True)


def probs(logits: jax.typing.ArrayLike, temperature: float = 1.0) -> jax.Array:
    r"""Softmax over the last axis, computed in float32.

    .. math::
        p_i = \frac{e^{z_i / T}}{\sum_j e^{z_j / T}}

    ``T > 1`` flattens the distribution, ``T < 1`` sharpens it. Infinite
    logits follow the rule of :func:`log_probs`: ``probs == exp(log_probs)``.

    Args:
        logits: ``[..., V]`` scores.
        temperature: ``T > 0`` (see :func:`log_probs`).

    Returns:
        ``[..., V]`` float32 probabilities. Each row sums to 1, except a row
        whose logits are all ``-inf``, which is all 0.

    Examples:
        >>> import jax.numpy as jnp
        >>> probs(jnp.array([2.0, 1.0, 0.0]), temperature=10.0)
        Array([0.3671654, 0.332225 , 0.3006096], dtype=float32)
    """
    return _distribution(logits, temperature, log=False)


def output_distribution(
    h: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    *,
    output: str = "probs",
    temperature: float = 1.0,
    scale: float | None = None,
    softcap: float | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> jax.Array:
    r"""Hidden states to logits, log-probabilities or probabilities in one call.

    .. math::
        z = \mathrm{unembed}(h, W, b), \qquad
        p = \mathrm{softmax}(z / T)

    Args:
        h: ``[..., D]`` hidden states.
        w: ``[V, D]`` unembedding.
        bias: optional ``[V]``.
        output: ``"logits"`` (raw, ``temperature`` not applied),
            ``"log_probs"`` or ``"probs"``.
        temperature: ``T > 0`` for ``"log_probs"`` and ``"probs"``.
        scale, softcap, precision: as in :func:`unembed`.

    Returns:
        ``[..., V]`` float32 array of the requested kind.

    Examples:
        >>> import jax.numpy as jnp
        >>> h, w = jnp.ones((1, 2)), jnp.array([[1.0, 0.0], [1.0, 1.0]])
        >>> output_distribution(h, w, output="probs")
        Array([[0.26894143, 0.7310586 ]], dtype=float32)
    """
    _checks.check_choice("output", output, OUTPUTS)
    logits = unembed(h, w, bias, scale=scale, softcap=softcap, precision=precision)
    if output == "logits":
        return logits
    if output == "log_probs":
        return log_probs(logits, temperature)
    return probs(logits, temperature)


def last_positions(h: jax.typing.ArrayLike, lengths: jax.typing.ArrayLike) -> jax.Array:
    r"""Picks each sequence's last real position: ``h[b, lengths[b] - 1]``.

    At inference only these rows need to go through the head, which turns a
    ``[B, T, V]`` product into a ``[B, V]`` one.

    Args:
        h: ``[B, T, D]`` hidden states of right-padded sequences.
        lengths: ``[B]`` integer lengths in ``[1, T]``. Inside ``jit`` they
            are clipped to that range.

    Returns:
        ``[B, D]``.

    Examples:
        >>> import jax.numpy as jnp
        >>> h = jnp.arange(12.0).reshape(2, 3, 2)
        >>> last_positions(h, jnp.array([1, 3]))
        Array([[ 0.,  1.],
               [10., 11.]], dtype=float32)
    """
    _checks.check_rank("h", h, 3, "[B, T, D]")
    _checks.check_integer("lengths", lengths)
    _checks.check_rank("lengths", lengths, 1, "[B]")
    batch, time = jnp.shape(h)[:2]
    if time < 1:
        raise ValueError(
            f"h must have shape [B, T, D] with T >= 1; got {jnp.shape(h)}."
        )
    if jnp.shape(lengths)[0] != batch:
        raise ValueError(
            f"lengths must have shape [B] = ({batch},); got {jnp.shape(lengths)}."
        )
    _checks.check_in_range("lengths", lengths, low=1, high=time)
    index = jnp.clip(jnp.asarray(lengths) - 1, 0, time - 1)
    return jnp.take_along_axis(jnp.asarray(h), index[:, None, None], axis=1)[:, 0]


def token_log_probs(
    logits: jax.typing.ArrayLike,
    tokens: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Log-probability of each given token under its logits: a text's score.

    .. math::
        \ell_t = w_t \left(z_{t, y_t} - \log \sum_v e^{z_{t, v}}\right),
        \qquad \ell_t = 0 \text{ where } w_t = 0

    ``logits[b, t]`` is the model's prediction of ``tokens[b, t]`` (the
    logits of the positions before, shifted by one). The normalizer is a
    float32 logsumexp whatever the logits' dtype. A position of weight 0
    scores exactly 0, even if its logits are not finite.

    Args:
        logits: ``[B, T, V]`` (any leading shape) next-token scores.
        tokens: ``int [B, T]`` (the leading shape of ``logits``): the tokens
            to score, in ``[0, V)`` wherever the weight is not 0. Outside
            ``jit`` another id raises ValueError; inside ``jit`` its
            log-probability is ``-inf`` (the vocabulary gives it probability 0).
        weights: optional ``[B, T]`` weights, e.g. 0 for padding.

    Returns:
        ``float32 [B, T]`` log-probabilities (weighted), all ``<= 0`` when
        the weights are in ``[0, 1]``.

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
        >>> token_log_probs(logits, jnp.array([[0, 2]]), jnp.array([[1.0, 0.0]]))
        Array([[-0.6931472,  0.       ]], dtype=float32)
    """
    _checks.check_floating("logits", logits)
    _checks.check_integer("tokens", tokens)
    vocab_size = jnp.shape(logits)[-1]
    if jnp.shape(tokens) != jnp.shape(logits)[:-1]:
        raise ValueError(
            f"tokens must have the leading shape of logits "
            f"{jnp.shape(logits)[:-1]}; got {jnp.shape(tokens)}."
        )
    if weights is not None and jnp.shape(weights) != jnp.shape(tokens):
        raise ValueError(
            f"weights must have the shape of tokens "
            f"{jnp.shape(tokens)}; got {jnp.shape(weights)}."
        )
    _checks.check_ids_in_range("tokens", tokens, weights, vocab_size)
    logits = jnp.asarray(logits, jnp.float32)
    tokens = jnp.asarray(tokens)
    index = jnp.clip(tokens, 0, vocab_size - 1)[..., None]
    label_logit = jnp.take_along_axis(logits, index, axis=-1)[..., 0]
    scores = label_logit - jax.nn.logsumexp(logits, axis=-1)
    scores = jnp.where((tokens >= 0) & (tokens < vocab_size), scores, NEG_INF)
    if weights is None:
        return scores
    weights = jnp.asarray(weights, jnp.float32)
    return jnp.where(weights != 0, weights * scores, 0.0)


def sequence_log_prob(
    logits: jax.typing.ArrayLike,
    tokens: jax.typing.ArrayLike,
    weights: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    r"""Log-probability of each row's tokens: the weighted sum over positions.

    .. math::
        \log p(y_{1:T}) = \sum_t w_t \log p(y_t \mid y_{<t})

    Args:
        logits, tokens, weights: as in :func:`token_log_probs`, ``[B, T, V]``,
            ``[B, T]``, ``[B, T]``.

    Returns:
        ``float32 [B]`` (the leading shape without the last axis).

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.log(jnp.array([[[0.5, 0.5], [0.2, 0.8]]]))
        >>> jnp.exp(sequence_log_prob(logits, jnp.array([[0, 1]])))  # 0.5 * 0.8
        Array([0.4], dtype=float32)
    """
    return jnp.sum(token_log_probs(logits, tokens, weights), axis=-1)
