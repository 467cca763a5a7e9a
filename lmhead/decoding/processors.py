"""Logits processors, one per knob of :class:`~lmhead.decoding.knobs.SamplingKnobs`,
and :func:`process_logits`, which applies them all in a fixed order. A removed
token has logit :data:`NEG_INF`; ties go to the lower token id, so ``top_k=1``
is exactly greedy; a per-row knob is a scalar or one value per row
(``logits.shape[:-1]``), ``logit_bias`` is ``[V]`` or ``[B, V]``."""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks
from lmhead.decoding import _loop, top_set
from lmhead.decoding._loop import NO_TOKEN
from lmhead.decoding.constraint import apply_token_mask, unpack_token_mask
from lmhead.decoding.knobs import (
    SamplingKnobs,
    check_knob,
    check_per_row,
    check_per_token,
)
from lmhead.head import NEG_INF

# Masses this close to p count as p: float32 sums of a set whose exact mass
# is p often fall an ulp below it (docs/decoding.md).
TOP_P_TOLERANCE = 1e-6


def _row_max(logits: jax.Array) -> jax.Array:
    """``max_j z_j`` per row, 0 for a row with no finite entry (never NaN)."""
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(jnp.isfinite(row_max), row_max, 0.0)


def _per_row(name: str, value: jax.typing.ArrayLike, logits: jax.Array) -> jax.Array:
    """A knob, checked, as an array that broadcasts against ``logits [..., V]``:
    a scalar stays a scalar, one value per row gets a trailing axis."""
    check_knob(name, value)
    check_per_row(name, value, logits.shape[:-1])
    value = jnp.asarray(value)
    return value[..., None] if value.ndim else value


def _token_mask(ids: jax.Array, vocab_size: int) -> jax.Array:
    """``bool [B, V]``: True where the id occurs in ``ids [B, L]`` (others ignored)."""
    rows = jnp.arange(ids.shape[0])[:, None]
    valid = (ids >= 0) & (ids < vocab_size)
    mask = jnp.zeros((ids.shape[0], vocab_size), bool)
    return mask.at[rows, jnp.where(valid, ids, vocab_size)].set(True, mode="drop")


def apply_temperature(
    logits: jax.typing.ArrayLike, temperature: jax.typing.ArrayLike
) -> jax.Array:
    r"""Divides logits by a temperature; ``T = 0`` leaves them as they are.

    .. math::
        z'_i = (z_i - \max_j z_j) / T \quad (T > 0), \qquad z' = z \quad (T = 0)

    The row maximum is subtracted first: softmax does not change, and
    ``z' <= 0``, so a tiny ``T`` can push a logit to ``-inf`` but never to
    ``+inf`` (where ``inf - inf`` would give NaN). ``T = 0`` is greedy
    decoding, which the samplers do by argmax; nothing is divided by zero.
    Inside ``jit`` a negative or NaN traced ``T`` acts as 0, and ``T =
    inf`` gives the limit, 0 for every token that is not ``-inf``.

    Args:
        logits: ``[..., V]`` scores.
        temperature: finite ``T >= 0``, a scalar or one per row (may be
            traced).

    Returns:
        ``[..., V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_temperature(jnp.array([1.0, 2.0, 3.0]), 0.5)
        Array([-4., -2.,  0.], dtype=float32)
    """
    logits = _checks.as_logits(logits)
    temperature = _per_row("temperature", temperature, logits)
    positive = temperature > 0
    scaled = (logits - _row_max(logits)) / jnp.where(positive, temperature, 1.0)
    # -inf stays -inf (-inf / inf would be NaN).
    scaled = jnp.where(logits == NEG_INF, NEG_INF, scaled)
    return jnp.where(positive, scaled, logits)


def apply_top_k(
    logits: jax.typing.ArrayLike, k: jax.typing.ArrayLike | None
) -> jax.Array:
    r"""Keeps the ``k`` largest logits of each row and removes the rest.

    .. math::
        z'_i = z_i \text{ if } \mathrm{rank}(i) < k \text{ else } -\infty

    where ``rank`` is the position in a stable descending sort, so exactly
    ``min(k, V)`` tokens stay and ties at the boundary go to the lower token
    id. ``k > V`` keeps every token; ``k = 0`` or None turns the filter off.

    Args:
        logits: ``[..., V]`` scores.
        k: integer ``k >= 0``, a scalar or one per row (may be traced; inside
            ``jit`` a negative ``k`` acts as 0), or None.

    Returns:
        ``[..., V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_top_k(jnp.array([1.0, 3.0, 2.0, 3.0]), 2)
        Array([-inf,   3., -inf,   3.], dtype=float32)
    """
    logits = _checks.as_logits(logits)
    if k is None:
        return logits
    k = _per_row("top_k", k, logits)
    budget = jnp.broadcast_to(k, logits.shape[:-1] + (1,)).astype(jnp.int32)
    keep = (k <= 0) | top_set.keep_from_the_top(
        logits, jnp.ones(logits.shape, jnp.int32), budget
    )
    return jnp.where(keep, logits, NEG_INF)


def apply_top_p(
    logits: jax.typing.ArrayLike, p: jax.typing.ArrayLike | None
) -> jax.Array:
    r"""Nucleus filter: keeps the smallest top set whose probability is >= p.

    With tokens in stable descending order :math:`\pi` and
    :math:`p_i = \mathrm{softmax}(z)_i`, token :math:`\pi(r)` is kept when the
    mass strictly before it is below ``p``:

    .. math::
        \sum_{s < r} p_{\pi(s)} < p - \epsilon

    so the token that crosses ``p`` is kept, a set of mass exactly ``p`` is
    complete (``epsilon = TOP_P_TOLERANCE`` absorbs float32 rounding), the
    argmax is always kept, and ``p = 1`` keeps every token. Ties at the
    boundary go to the lower token id.

    Args:
        logits: ``[..., V]`` scores.
        p: ``0 < p <= 1``, a scalar or one per row (may be traced; inside ``jit`` ``p <= 0`` keeps only
            the argmax and ``p > 1`` keeps all), or None for no filter.

    Returns:
        ``[..., V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.log(jnp.array([0.1, 0.5, 0.15, 0.25]))
        >>> apply_top_p(logits, 0.75)
        Array([      -inf, -0.6931472,       -inf, -1.3862944], dtype=float32)

    References:
        Holtzman et al., `The Curious Case of Neural Text Degeneration
        <https://arxiv.org/abs/1904.09751>`_, 2020.
    """
    logits = _checks.as_logits(logits)
    if p is None:
        return logits
    p = _per_row("top_p", p, logits)
    budget = jnp.broadcast_to(p - TOP_P_TOLERANCE, logits.shape[:-1] + (1,))
    keep = top_set.keep_from_the_top(logits, jax.nn.softmax(logits, axis=-1), budget)
    # The argmax (the lowest id among ties) stays even when p <= epsilon.
    first = jnp.argmax(logits, axis=-1, keepdims=True)
    keep = keep | (jnp.arange(logits.shape[-1]) == first)
    # p = 1 is neutral exactly: the tolerance must not cut a tail whose mass
    # is below it.
    keep = keep | (p >= 1.0)
    return jnp.where(keep, logits, NEG_INF)


def apply_min_p(
    logits: jax.typing.ArrayLike, min_p: jax.typing.ArrayLike | None
) -> jax.Array:
    r"""Keeps the tokens at least ``min_p`` times as likely as the most likely.

    .. math::
        p_i \ge m \max_j p_j \iff z_i - \max_j z_j \ge \log m

    evaluated in log space, so no probability underflows. Ties with the
    threshold are kept; the argmax always is; ``m = 0`` keeps every token.

    Args:
        logits: ``[..., V]`` scores.
        min_p: ``0 <= m <= 1``, a scalar or one per row (may be traced; clipped to that range inside
            ``jit``), or None for no filter.

    Returns:
        ``[..., V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_min_p(jnp.log(jnp.array([0.5, 0.3, 0.1, 0.1])), 0.25)
        Array([-0.6931472, -1.2039728,       -inf,       -inf], dtype=float32)

    References:
        Nguyen et al., `Turning Up the Heat: Min-p Sampling for Creative and
        Coherent LLM Outputs <https://arxiv.org/abs/2407.01082>`_, 2024.
    """
    logits = _checks.as_logits(logits)
    if min_p is None:
        return logits
    min_p = _per_row("min_p", min_p, logits)
    keep = logits - _row_max(logits) >= jnp.log(jnp.clip(min_p, 0.0, 1.0))
    return jnp.where(keep, logits, NEG_INF)


def apply_repetition_penalty(
    logits: jax.typing.ArrayLike,
    history: jax.typing.ArrayLike,
    penalty: jax.typing.ArrayLike | None,
) -> jax.Array:
    r"""Makes every token already in the history less likely (CTRL, Hugging Face).

    .. math::
        z'_i = \begin{cases} z_i / \theta & z_i > 0 \\ z_i \theta & z_i \le 0
        \end{cases} \quad \text{if token } i \text{ occurs in the history,}
        \quad z'_i = z_i \text{ otherwise.}

    ``theta > 1`` discourages repeats, ``theta < 1`` encourages them. Apply it
    before temperature: it depends on the sign of the raw logits.

    Args:
        logits: ``[B, V]`` scores.
        history: ``int [B, L]`` tokens so far (prompt and generated); entries
            outside ``[0, V)``, e.g. ``NO_TOKEN``, are ignored.
        penalty: finite ``theta > 0``, a scalar or one per row ``[B]``, or
            None for no penalty. Inside ``jit`` a traced ``theta`` outside
            ``(0, inf)`` (or NaN) acts as 1, no penalty.

    Returns:
        ``[B, V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_repetition_penalty(jnp.array([[2.0, -1.0, 3.0]]),
        ...                          jnp.array([[0, 1, -1]]), 2.0)
        Array([[ 1., -2.,  3.]], dtype=float32)

    References:
        Keskar et al., `CTRL: A Conditional Transformer Language Model for
        Controllable Generation <https://arxiv.org/abs/1909.05858>`_, 2019.
    """
    logits = _checks.as_logits(logits, "[B, V]")
    if penalty is None:
        return logits
    penalty = _per_row("repetition_penalty", penalty, logits)
    penalty = jnp.where((penalty > 0) & (penalty < jnp.inf), penalty, 1.0)
    history = _as_history(history, logits.shape[0])
    penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(_token_mask(history, logits.shape[-1]), penalized, logits)


def apply_no_repeat_ngram(
    logits: jax.typing.ArrayLike, history: jax.typing.ArrayLike, ngram_size: int | None
) -> jax.Array:
    r"""Removes every token that would repeat an n-gram of the history.

    With history :math:`x_1 \dots x_L`, token ``t`` is removed when
    :math:`(x_{L-n+2}, \dots, x_L, t)` already occurs as
    :math:`(x_j, \dots, x_{j+n-1})` for some ``j``. ``n = 1`` removes every
    token seen. N-grams touching an empty slot (``NO_TOKEN``) never match.

    Args:
        logits: ``[B, V]`` scores.
        history: ``int [B, L]`` tokens so far, the latest last; empty slots
            (negative) on the left.
        ngram_size: static ``n >= 1``, or None for no filter.

    Returns:
        ``[B, V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> history = jnp.array([[1, 2, 3, 1]])  # "1 2" happened: ban 2 after 1
        >>> apply_no_repeat_ngram(jnp.zeros((1, 4)), history, 2)
        Array([[  0.,   0., -inf,   0.]], dtype=float32)
    """
    logits = _checks.as_logits(logits, "[B, V]")
    if ngram_size is None:
        return logits
    _checks.check_count("no_repeat_ngram_size", ngram_size)
    history = _as_history(history, logits.shape[0])
    n, length = int(ngram_size), history.shape[1]
    if length < n:
        return logits
    windows = jnp.stack([history[:, i : length - n + 1 + i] for i in range(n)], -1)
    prefix = history[:, length - n + 1 :]
    match = jnp.all(windows[..., :-1] == prefix[:, None, :], axis=-1) & jnp.all(
        windows >= 0, axis=-1
    )
    banned = _token_mask(jnp.where(match, windows[..., -1], NO_TOKEN), logits.shape[-1])
    return jnp.where(banned, NEG_INF, logits)


def apply_suppress_tokens(
    logits: jax.typing.ArrayLike, token_ids: Sequence[int] | None
) -> jax.Array:
    r"""Removes the given token ids: :math:`z'_i = -\infty` for ``i`` in the set.

    Args:
        logits: ``[..., V]`` scores.
        token_ids: ids in ``[0, V)``, or None.

    Returns:
        ``[..., V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_suppress_tokens(jnp.array([1.0, 2.0, 3.0]), [0, 2])
        Array([-inf,   2., -inf], dtype=float32)
    """
    logits = _checks.as_logits(logits)
    if token_ids is None or len(token_ids) == 0:
        return logits
    _checks.check_in_range(
        "suppress_tokens", np.asarray(token_ids), low=0, high=logits.shape[-1] - 1
    )
    return logits.at[..., jnp.asarray(token_ids, jnp.int32)].set(NEG_INF)


def apply_min_new_tokens(
    logits: jax.typing.ArrayLike,
    num_generated: jax.typing.ArrayLike,
    *,
    min_new_tokens: jax.typing.ArrayLike,
    eos_id: int | Sequence[int] | None,
) -> jax.Array:
    r"""Removes EOS while fewer than ``min_new_tokens`` tokens have been made.

    .. math::
        z'_e = -\infty \quad \text{for every EOS id } e \text{ if }
        n_{\mathrm{generated}} < n_{\min}

    Args:
        logits: ``[B, V]`` scores.
        num_generated: ``int []`` or ``[B]``, tokens generated so far.
        min_new_tokens: ``int >= 0``, a scalar or one per row ``[B]`` (may
            be traced).
        eos_id: the EOS id, a sequence of EOS ids (every one is removed),
            or None (then nothing changes); ids in ``[0, V)``.

    Returns:
        ``[B, V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_min_new_tokens(jnp.zeros((2, 3)), jnp.array([0, 2]),
        ...                      min_new_tokens=2, eos_id=1)
        Array([[  0., -inf,   0.],
               [  0.,   0.,   0.]], dtype=float32)
    """
    logits = _checks.as_logits(logits, "[B, V]")
    eos_ids = _loop.eos_ids(eos_id, logits.shape[-1])
    if not eos_ids:
        return logits
    check_knob("min_new_tokens", min_new_tokens)
    check_per_row("min_new_tokens", min_new_tokens, logits.shape[:-1])
    check_per_row("num_generated", num_generated, logits.shape[:-1])
    too_early = jnp.reshape(jnp.asarray(num_generated) < min_new_tokens, (-1, 1))
    is_eos = _loop.is_eos(jnp.arange(logits.shape[-1]), eos_ids)
    return jnp.where(too_early & is_eos, NEG_INF, logits)


def apply_presence_frequency(
    logits: jax.typing.ArrayLike,
    counts: jax.typing.ArrayLike | None,
    presence: jax.typing.ArrayLike | None,
    frequency: jax.typing.ArrayLike | None,
) -> jax.Array:
    r"""OpenAI's presence and frequency penalties, over the generated tokens.

    .. math::
        z'_i = z_i - \alpha_{\mathrm{presence}} [c_i > 0]
               - \alpha_{\mathrm{frequency}} c_i

    with :math:`c_i` the times token ``i`` was generated in the row (the
    prompt does not count, as in OpenAI's API). Positive penalties
    discourage repeats, negative ones encourage them; a removed token
    (``-inf``) stays removed. Any finite penalty is allowed, computed in
    float32: one so large that ``penalty * count`` leaves float32's range
    makes the logit infinite.

    Args:
        logits: ``[B, V]`` scores.
        counts: ``int [B, V]``, ``c >= 0``; may be None when both penalties
            are.
        presence: a finite real, a scalar or one per row ``[B]`` (may be
            traced), or None (off).
        frequency: the same, for the frequency penalty.

    Returns:
        ``[B, V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_presence_frequency(jnp.zeros((1, 3)), jnp.array([[0, 1, 3]]),
        ...                          0.5, 0.25)
        Array([[ 0.  , -0.75, -1.25]], dtype=float32)

    References:
        OpenAI, `Parameter details: frequency and presence penalties
        <https://platform.openai.com/docs/advanced-usage>`_.
    """
    logits = _checks.as_logits(logits, "[B, V]")
    if presence is None and frequency is None:
        return logits
    counts = _as_counts(counts, logits.shape)
    z = logits
    if presence is not None:
        presence = _per_row("presence_penalty", presence, logits)
        z = z - presence * (counts > 0).astype(jnp.float32)
    if frequency is not None:
        frequency = _per_row("frequency_penalty", frequency, logits)
        z = z - frequency * counts.astype(jnp.float32)
    return z


def _as_counts(counts: jax.typing.ArrayLike | None, shape: tuple) -> jax.Array:
    if counts is None:
        raise ValueError(
            "counts (int [B, V], how often each token was generated) is "
            "required by presence_penalty and frequency_penalty; got None."
        )
    _checks.check_integer("counts", counts)
    if tuple(jnp.shape(counts)) != tuple(shape):
        raise ValueError(
            f"counts must have shape [B, V] = {tuple(shape)}; got {jnp.shape(counts)}."
        )
    _checks.check_in_range("counts", counts, low=0)
    return jnp.asarray(counts, jnp.int32)


def apply_logit_bias(
    logits: jax.typing.ArrayLike, bias: jax.typing.ArrayLike | None
) -> jax.Array:
    r"""Adds a bias per token: :math:`z'_i = z_i + b_i` (OpenAI's ``logit_bias``).

    A large negative bias (OpenAI suggests -100) all but bans a token, a
    large positive one all but forces it; a removed token (``-inf``) stays
    removed.

    Args:
        logits: ``[B, V]`` scores.
        bias: finite, ``[V]`` for every row or ``[B, V]`` one per row (may be
            traced), or None (off). :func:`~lmhead.decoding.logit_bias_vector`
            makes one from a ``{token id: bias}`` map.

    Returns:
        ``[B, V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_logit_bias(jnp.ones((2, 3)), jnp.array([0.0, -100.0, 2.0]))
        Array([[  1., -99.,   3.],
               [  1., -99.,   3.]], dtype=float32)
    """
    logits = _checks.as_logits(logits, "[B, V]")
    if bias is None:
        return logits
    check_per_token("logit_bias", bias, *logits.shape)
    check_knob("logit_bias", bias)
    return logits + jnp.asarray(bias, jnp.float32)


def _as_history(history: jax.typing.ArrayLike, batch: int) -> jax.Array:
    _loop.check_token_rows("history", history, batch, "[B, L]")
    return jnp.asarray(history, jnp.int32)


def process_logits(
    logits: jax.typing.ArrayLike,
    knobs: SamplingKnobs | None = None,
    *,
    history: jax.typing.ArrayLike | None = None,
    counts: jax.typing.ArrayLike | None = None,
    num_generated: jax.typing.ArrayLike = 0,
    eos_id: int | Sequence[int] | None = None,
    allowed: jax.typing.ArrayLike | None = None,
    **knob_values: Any,
) -> jax.Array:
    r"""Applies every processor in a fixed order: the distribution a sampler draws from.

    On the raw logits: repetition penalty, presence and frequency
    penalties, logit bias, no-repeat-n-gram, suppressed tokens and minimum
    new tokens; then the ``allowed`` mask of a constraint; then temperature;
    then top-k, top-p and min-p on the tempered distribution, so that they
    choose among the allowed tokens (``docs/decoding.md`` says why this
    order). A processor left at None is off. A row whose every token got
    removed falls back to a point mass on the argmax of the raw ``logits``
    among its allowed tokens (the first allowed token where none of them is
    finite): a constraint wins over ``min_new_tokens`` and the filters.
    Where a logit is ``+inf`` before temperature, the ``+inf`` ones share
    the mass (the limit of softmax): never NaN.

    Args:
        logits: ``[B, V]`` raw next-token logits.
        knobs: a :class:`~lmhead.decoding.knobs.SamplingKnobs`, or None to
            give its fields as keywords, not both; each is the argument of
            its ``apply_*`` processor.
        history: ``int [B, L]`` tokens so far, latest last, negative = empty;
            required by ``repetition_penalty`` and ``no_repeat_ngram_size``.
        counts: ``int [B, V]``, how many times each token has been generated
            in the row (the prompt does not count); required by
            ``presence_penalty`` and ``frequency_penalty``
            (:attr:`~lmhead.decoding.knobs.SamplingKnobs.reads_counts`).
        num_generated, eos_id: see :func:`apply_min_new_tokens`.
        allowed: ``int32 [B, ceil(V / 32)]``, each row's packed mask of the
            tokens a constraint allows (:func:`apply_token_mask`), or None.

    Returns:
        ``[B, V]`` float32 processed logits.

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.array([[3.0, 2.0, 1.0, 0.0]])
        >>> process_logits(logits, temperature=0.5, top_k=2)
        Array([[  0.,  -2., -inf, -inf]], dtype=float32)
    """
    knobs = SamplingKnobs.of(knobs, **knob_values)
    raw = _checks.as_logits(logits, "[B, V]")
    if history is None and knobs.reads_history:
        raise ValueError(
            "history is required by repetition_penalty and "
            "no_repeat_ngram_size; got None."
        )
    z = apply_repetition_penalty(raw, history, knobs.repetition_penalty)
    z = apply_presence_frequency(
        z,
        counts if knobs.reads_counts else None,
        knobs.presence_penalty,
        knobs.frequency_penalty,
    )
    z = apply_logit_bias(z, knobs.logit_bias)
    z = apply_no_repeat_ngram(z, history, knobs.no_repeat_ngram_size)
    z = apply_suppress_tokens(z, knobs.suppress_tokens)
    z = apply_min_new_tokens(
        z, num_generated, min_new_tokens=knobs.min_new_tokens, eos_id=eos_id
    )
    z = apply_token_mask(z, allowed)
    # A logit the penalty pushed (or the model put) at +inf holds all the
    # mass, as the limit of softmax says; inf - inf would be NaN.
    top = jnp.max(z, axis=-1, keepdims=True)
    z = jnp.where(top == jnp.inf, jnp.where(z == top, 0.0, NEG_INF), z)
    z = apply_temperature(z, knobs.temperature)
    z = apply_top_k(z, knobs.top_k)
    z = apply_min_p(apply_top_p(z, knobs.top_p), knobs.min_p)
    all_removed = jnp.all(z == NEG_INF, axis=-1, keepdims=True)
    fallback = jnp.argmax(raw, axis=-1, keepdims=True)
    if allowed is not None:
        mask = unpack_token_mask(allowed, raw.shape[-1])
        best = jnp.argmax(jnp.where(mask, raw, NEG_INF), axis=-1, keepdims=True)
        finite = jnp.any(mask & (raw > NEG_INF), axis=-1, keepdims=True)
        fallback = jnp.where(finite, best, jnp.argmax(mask, axis=-1, keepdims=True))
    is_fallback = jnp.arange(z.shape[-1]) == fallback
    return jnp.where(all_removed, jnp.where(is_fallback, 0.0, NEG_INF), z)
