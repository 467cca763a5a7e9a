"""Decoding: logits processors, greedy and sampled generation, beam search.

Every function here is pure. A model plugs in through one function,

    step_fn(tokens: int32[B], state) -> (logits: float[B, V], state),

which feeds one token per row and returns the next-token logits; every leaf of
``state`` (e.g. a key/value cache) has a leading batch axis ``B``.
:func:`generate` and :func:`beam_search` start from the logits after the prompt
and the matching ``state`` (what a model's prefill returns) and run one
``lax.while_loop`` with static shapes, calling ``step_fn`` once per new token.

Conventions shared by everything below:

* A removed token has logit :data:`NEG_INF`, i.e. probability exactly 0.
* Ties are broken towards the lower token id everywhere (argmax, top-k, top-p,
  beam ranking), so ``top_k=1`` is exactly greedy.
* A sequence's length counts generated tokens up to and including EOS; the
  positions after it hold ``pad_id``.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks

# The logit of a removed token. -inf rather than a large finite number: exp
# gives exactly 0, it stays -inf under every later rescaling (temperature,
# repetition penalty), and no finite logit can be mistaken for a removed one.
# The one way -inf makes NaN, a row of nothing but -inf (max - max), is ruled
# out by the all-removed fallback in `process_logits` and by guarded row maxima.
NEG_INF = float("-inf")
# top-p compares float32 cumulative sums with p. A set whose exact mass is p
# often sums to an ulp below it (softmax of log [.52, .15, .13, .13, .07]:
# .52 + .15 gives 0.66999996), which would keep one token too many for
# p = 0.67; masses this close to p count as p.
TOP_P_TOLERANCE = 1e-6
# An empty slot of a token history (left padding, or not yet generated).
NO_TOKEN = -1
PENALTIES = ("gnmt", "hf")

StepFn = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


def _as_logits(logits: jax.typing.ArrayLike, layout: str = "[..., V]") -> jax.Array:
    _checks.check_floating("logits", logits)
    ranks = 2 if layout == "[B, V]" else set(range(1, 64))
    _checks.check_rank("logits", logits, ranks, layout)
    return jnp.asarray(logits, jnp.float32)


def _row_max(logits: jax.Array) -> jax.Array:
    """``max_j z_j`` per row, 0 for a row with no finite entry (never NaN)."""
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(jnp.isfinite(row_max), row_max, 0.0)


def _descending_ranks(logits: jax.Array) -> jax.Array:
    """Rank of each token in a stable descending sort (0 = largest)."""
    order = jnp.argsort(-logits, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def _token_mask(ids: jax.Array, vocab_size: int) -> jax.Array:
    """``bool [B, V]``: True where the id occurs in ``ids [B, L]`` (others ignored)."""
    rows = jnp.arange(ids.shape[0])[:, None]
    valid = (ids >= 0) & (ids < vocab_size)
    mask = jnp.zeros((ids.shape[0], vocab_size), bool)
    return mask.at[rows, jnp.where(valid, ids, vocab_size)].set(True, mode="drop")


def apply_temperature(logits: jax.typing.ArrayLike,
                      temperature: jax.typing.ArrayLike) -> jax.Array:
    r"""Divides logits by a temperature; ``T = 0`` leaves them as they are.

    .. math::
        z'_i = (z_i - \max_j z_j) / T \quad (T > 0), \qquad z' = z \quad (T = 0)

    The row maximum is subtracted first: softmax does not change, and
    ``z' <= 0``, so a tiny ``T`` can push a logit to ``-inf`` but never to
    ``+inf`` (where ``inf - inf`` would give NaN). ``T = 0`` is greedy
    decoding, which the samplers do by argmax; nothing is divided by zero.
    Inside ``jit`` a negative traced ``T`` acts as 0.

    Args:
        logits: ``[..., V]`` scores.
        temperature: scalar ``T >= 0`` (may be traced).

    Returns:
        ``[..., V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_temperature(jnp.array([1.0, 2.0, 3.0]), 0.5)
        Array([-4., -2.,  0.], dtype=float32)
        >>> apply_temperature(jnp.array([1.0, 2.0, 3.0]), 0.0)
        Array([1., 2., 3.], dtype=float32)
    """
    logits = _as_logits(logits)
    _checks.check_in_range("temperature", temperature, low=0.0)
    positive = temperature > 0
    scaled = (logits - _row_max(logits)) / jnp.where(positive, temperature, 1.0)
    return jnp.where(positive, scaled, logits)


def apply_top_k(logits: jax.typing.ArrayLike,
                k: jax.typing.ArrayLike | None) -> jax.Array:
    r"""Keeps the ``k`` largest logits of each row and removes the rest.

    .. math::
        z'_i = z_i \text{ if } \mathrm{rank}(i) < k \text{ else } -\infty

    where ``rank`` is the position in a stable descending sort, so exactly
    ``min(k, V)`` tokens stay and ties at the boundary go to the lower token
    id. ``k > V`` keeps every token; ``k = 0`` or None turns the filter off.

    Args:
        logits: ``[..., V]`` scores.
        k: integer ``k >= 0`` (may be traced; inside ``jit`` a negative ``k``
            acts as 0), or None.

    Returns:
        ``[..., V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_top_k(jnp.array([1.0, 3.0, 2.0, 3.0]), 2)
        Array([-inf,   3., -inf,   3.], dtype=float32)
        >>> apply_top_k(jnp.array([1.0, 2.0, 2.0]), 2)  # tie: lower id wins
        Array([-inf,   2.,   2.], dtype=float32)
        >>> apply_top_k(jnp.array([1.0, 2.0, 2.0]), 1)
        Array([-inf,   2., -inf], dtype=float32)
    """
    logits = _as_logits(logits)
    if k is None:
        return logits
    _checks.check_integer("top_k", k)
    _checks.check_in_range("top_k", k, low=0)
    keep = (k <= 0) | (_descending_ranks(logits) < k)
    return jnp.where(keep, logits, NEG_INF)


def apply_top_p(logits: jax.typing.ArrayLike,
                p: jax.typing.ArrayLike | None) -> jax.Array:
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
        p: ``0 < p <= 1`` (may be traced; inside ``jit`` ``p <= 0`` keeps only
            the argmax and ``p > 1`` keeps all), or None for no filter.

    Returns:
        ``[..., V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.log(jnp.array([0.1, 0.5, 0.15, 0.25]))
        >>> apply_top_p(logits, 0.75)
        Array([      -inf, -0.6931472,       -inf, -1.3862944], dtype=float32)
        >>> apply_top_p(logits, 0.8)
        Array([      -inf, -0.6931472, -1.89712  , -1.3862944], dtype=float32)

    References:
        Holtzman et al., `The Curious Case of Neural Text Degeneration
        <https://arxiv.org/abs/1904.09751>`_, 2020.
    """
    logits = _as_logits(logits)
    if p is None:
        return logits
    _checks.check_in_range("top_p", p, low=0.0, high=1.0, low_open=True)
    order = jnp.argsort(-logits, axis=-1, stable=True)
    sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    mass = jnp.cumsum(sorted_probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(mass[..., :1]), mass[..., :-1]], -1)
    num_kept = jnp.sum(mass_before < p - TOP_P_TOLERANCE, axis=-1, keepdims=True)
    num_kept = jnp.maximum(num_kept, 1)
    keep = jnp.argsort(order, axis=-1, stable=True) < num_kept
    return jnp.where(keep, logits, NEG_INF)


def apply_min_p(logits: jax.typing.ArrayLike,
                min_p: jax.typing.ArrayLike | None) -> jax.Array:
    r"""Keeps the tokens at least ``min_p`` times as likely as the most likely.

    .. math::
        p_i \ge m \max_j p_j \iff z_i - \max_j z_j \ge \log m

    evaluated in log space, so no probability underflows. Ties with the
    threshold are kept; the argmax always is; ``m = 0`` keeps every token.

    Args:
        logits: ``[..., V]`` scores.
        min_p: ``0 <= m <= 1`` (may be traced; clipped to that range inside
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
    logits = _as_logits(logits)
    if min_p is None:
        return logits
    _checks.check_in_range("min_p", min_p, low=0.0, high=1.0)
    keep = logits - _row_max(logits) >= jnp.log(jnp.clip(min_p, 0.0, 1.0))
    return jnp.where(keep, logits, NEG_INF)


def apply_repetition_penalty(logits: jax.typing.ArrayLike,
                             history: jax.typing.ArrayLike,
                             penalty: jax.typing.ArrayLike | None) -> jax.Array:
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
        penalty: ``theta > 0``, or None for no penalty.

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
    logits = _as_logits(logits, "[B, V]")
    if penalty is None:
        return logits
    _checks.check_in_range("repetition_penalty", penalty, low=0.0, low_open=True)
    history = _as_history(history, logits.shape[0])
    penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(_token_mask(history, logits.shape[-1]), penalized, logits)


def apply_no_repeat_ngram(logits: jax.typing.ArrayLike,
                          history: jax.typing.ArrayLike,
                          ngram_size: int | None) -> jax.Array:
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
    logits = _as_logits(logits, "[B, V]")
    if ngram_size is None:
        return logits
    if not isinstance(ngram_size, (int, np.integer)) or ngram_size < 1:
        raise ValueError(
            f"no_repeat_ngram_size must be an integer >= 1; got {ngram_size!r}.")
    history = _as_history(history, logits.shape[0])
    n, length = int(ngram_size), history.shape[1]
    if length < n:
        return logits
    windows = jnp.stack([history[:, i:length - n + 1 + i] for i in range(n)], -1)
    prefix = history[:, length - n + 1:]
    match = (jnp.all(windows[..., :-1] == prefix[:, None, :], axis=-1)
             & jnp.all(windows >= 0, axis=-1))
    banned = _token_mask(jnp.where(match, windows[..., -1], NO_TOKEN),
                         logits.shape[-1])
    return jnp.where(banned, NEG_INF, logits)


def apply_suppress_tokens(logits: jax.typing.ArrayLike,
                          token_ids: Sequence[int] | None) -> jax.Array:
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
    logits = _as_logits(logits)
    if token_ids is None or len(token_ids) == 0:
        return logits
    _checks.check_in_range("suppress_tokens", np.asarray(token_ids), low=0,
                           high=logits.shape[-1] - 1)
    return logits.at[..., jnp.asarray(token_ids, jnp.int32)].set(NEG_INF)


def apply_min_new_tokens(logits: jax.typing.ArrayLike,
                         num_generated: jax.typing.ArrayLike, *,
                         min_new_tokens: jax.typing.ArrayLike,
                         eos_id: int | None) -> jax.Array:
    r"""Removes EOS while fewer than ``min_new_tokens`` tokens have been made.

    .. math::
        z'_{\mathrm{eos}} = -\infty \quad \text{if } n_{\mathrm{generated}} <
        n_{\min}

    Args:
        logits: ``[B, V]`` scores.
        num_generated: ``int []`` or ``[B]``, tokens generated so far.
        min_new_tokens: ``int >= 0`` (may be traced).
        eos_id: the EOS id, or None (then nothing changes).

    Returns:
        ``[B, V]`` float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> apply_min_new_tokens(jnp.zeros((2, 3)), jnp.array([0, 2]),
        ...                      min_new_tokens=2, eos_id=1)
        Array([[  0., -inf,   0.],
               [  0.,   0.,   0.]], dtype=float32)
    """
    logits = _as_logits(logits, "[B, V]")
    if eos_id is None:
        return logits
    _checks.check_in_range("min_new_tokens", min_new_tokens, low=0)
    too_early = jnp.reshape(jnp.asarray(num_generated) < min_new_tokens, (-1, 1))
    is_eos = jnp.arange(logits.shape[-1]) == eos_id
    return jnp.where(too_early & is_eos, NEG_INF, logits)


def _as_history(history: jax.typing.ArrayLike, batch: int) -> jax.Array:
    _checks.check_integer("history", history)
    _checks.check_rank("history", history, 2, "[B, L]")
    if jnp.shape(history)[0] != batch:
        raise ValueError(f"history must have shape [B, L] with B = {batch}; "
                         f"got {jnp.shape(history)}.")
    return jnp.asarray(history, jnp.int32)


def process_logits(
    logits: jax.typing.ArrayLike,
    *,
    temperature: jax.typing.ArrayLike = 1.0,
    top_k: jax.typing.ArrayLike | None = None,
    top_p: jax.typing.ArrayLike | None = None,
    min_p: jax.typing.ArrayLike | None = None,
    repetition_penalty: jax.typing.ArrayLike | None = None,
    no_repeat_ngram_size: int | None = None,
    history: jax.typing.ArrayLike | None = None,
    suppress_tokens: Sequence[int] | None = None,
    min_new_tokens: jax.typing.ArrayLike = 0,
    num_generated: jax.typing.ArrayLike = 0,
    eos_id: int | None = None,
) -> jax.Array:
    r"""Applies every processor in a fixed order: the distribution a sampler draws from.

    The order follows Hugging Face's ``generate``: on the raw logits,
    repetition penalty, no-repeat-n-gram, suppressed tokens and minimum new
    tokens; then temperature; then top-k, top-p and min-p on the tempered
    distribution. A processor left at None is off.

    A row whose every token got removed falls back to a point mass on the
    argmax of the raw ``logits`` (0 there, ``-inf`` elsewhere), so the result
    is always a valid distribution and never NaN.

    Args:
        logits: ``[B, V]`` raw next-token logits.
        temperature, top_k, top_p, min_p: see :func:`apply_temperature`,
            :func:`apply_top_k`, :func:`apply_top_p`, :func:`apply_min_p`.
        repetition_penalty, no_repeat_ngram_size: see
            :func:`apply_repetition_penalty`, :func:`apply_no_repeat_ngram`;
            both read ``history``.
        history: ``int [B, L]`` tokens so far, latest last, negative = empty.
        suppress_tokens: ids never produced (:func:`apply_suppress_tokens`).
        min_new_tokens, num_generated, eos_id: see
            :func:`apply_min_new_tokens`.

    Returns:
        ``[B, V]`` float32 processed logits.

    Examples:
        >>> import jax.numpy as jnp
        >>> logits = jnp.array([[3.0, 2.0, 1.0, 0.0]])
        >>> process_logits(logits, temperature=0.5, top_k=2)
        Array([[  0.,  -2., -inf, -inf]], dtype=float32)
        >>> process_logits(logits, suppress_tokens=[0, 1, 2, 3])  # fallback
        Array([[  0., -inf, -inf, -inf]], dtype=float32)
    """
    raw = _as_logits(logits, "[B, V]")
    if history is None and (repetition_penalty is not None
                            or no_repeat_ngram_size is not None):
        raise ValueError("history is required by repetition_penalty and "
                         "no_repeat_ngram_size; got None.")
    z = apply_repetition_penalty(raw, history, repetition_penalty)
    z = apply_no_repeat_ngram(z, history, no_repeat_ngram_size)
    z = apply_suppress_tokens(z, suppress_tokens)
    z = apply_min_new_tokens(z, num_generated, min_new_tokens=min_new_tokens,
                             eos_id=eos_id)
    z = apply_temperature(z, temperature)
    z = apply_min_p(apply_top_p(apply_top_k(z, top_k), top_p), min_p)
    all_removed = jnp.all(z == NEG_INF, axis=-1, keepdims=True)
    is_argmax = jnp.arange(z.shape[-1]) == jnp.argmax(raw, axis=-1, keepdims=True)
    return jnp.where(all_removed, jnp.where(is_argmax, 0.0, NEG_INF), z)


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a Python integer >= 1; got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {value}.")


def _check_token_id(name: str, value: int | None, vocab_size: int) -> None:
    if value is None:
        return
    if not isinstance(value, (int, np.integer)) or not 0 <= value < vocab_size:
        raise ValueError(f"{name} must be an integer in [0, V) = [0, "
                         f"{vocab_size}); got {value!r}.")


def _check_state(state: Any, batch: int) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for path, leaf in leaves:
        shape = jnp.shape(leaf)
        if not shape or shape[0] != batch:
            raise ValueError(
                f"every leaf of state must have the batch axis B = {batch} "
                f"first; state{jax.tree_util.keystr(path)} has shape {shape}.")


def _maybe_step(step_fn: StepFn, keep_going: jax.Array, tokens: jax.Array,
                logits: jax.Array, model_state: Any) -> tuple[jax.Array, Any]:
    """``step_fn(tokens, model_state)`` unless the loop is about to stop.

    The skipped call would compute logits that nobody reads and write a cache
    slot that a cache sized for prompt + max_new_tokens - 1 does not have.
    """
    def call():
        new_logits, new_state = step_fn(tokens, model_state)
        if (jnp.shape(new_logits) != logits.shape or jax.tree.structure(new_state)
                != jax.tree.structure(model_state)):
            raise ValueError(
                f"step_fn must return (logits {logits.shape}, state with the "
                f"structure it was given); got logits {jnp.shape(new_logits)}.")
        return jnp.asarray(new_logits, jnp.float32), new_state
    return jax.lax.cond(keep_going, call, lambda: (logits, model_state))


class SamplingState(NamedTuple):
    """The carry of :func:`generate`'s while loop.

    ``B`` rows (prompts times samples), ``N = max_new_tokens``, ``V`` tokens,
    ``H = P + N - 1`` history slots for a prompt of ``P`` tokens.

    Attributes:
        step: ``int32 []``, tokens generated so far by every row.
        logits: ``float32 [B, V]``, the model's logits for the next token.
        model_state: ``step_fn``'s state, every leaf ``[B, ...]``.
        key: PRNG key for the remaining steps.
        tokens: ``int32 [B, N]``, the output; ``pad_id`` after a row's end.
        log_probs: ``float32 [B, N]``, each token's log-probability under the
            processed distribution; 0 after a row's end.
        finished: ``bool [B]``, the row has produced EOS.
        lengths: ``int32 [B]``, tokens generated, EOS included.
        history: ``int32 [B, H]``, prompt then generated tokens, latest last,
            ``NO_TOKEN`` on the left; None when no processor reads it.
    """
    step: jax.Array
    logits: jax.Array
    model_state: Any
    key: jax.Array
    tokens: jax.Array
    log_probs: jax.Array
    finished: jax.Array
    lengths: jax.Array
    history: jax.Array | None


class _SamplingKnobs(NamedTuple):
    """Traced values; a None turns its processor off, which is static."""
    temperature: jax.Array
    top_k: jax.Array | None
    top_p: jax.Array | None
    min_p: jax.Array | None
    repetition_penalty: jax.Array | None
    min_new_tokens: jax.Array


class _SamplingConfig(NamedTuple):
    """Static (hashable) settings of :func:`generate`."""
    max_new_tokens: int
    no_repeat_ngram_size: int | None
    suppress_tokens: tuple[int, ...] | None
    eos_id: int | None
    pad_id: int


def _choose_tokens(key: jax.Array, processed: jax.Array,
                   temperature: jax.Array) -> jax.Array:
    """A draw from softmax(processed), or its argmax when ``temperature == 0``."""
    sampled = jax.random.categorical(key, processed, axis=-1)
    greedy = jnp.argmax(processed, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def _sampling_continues(s: SamplingState) -> jax.Array:
    return (s.step < s.tokens.shape[1]) & ~jnp.all(s.finished)


def _sampling_step(s: SamplingState, *, step_fn: StepFn, knobs: _SamplingKnobs,
                   config: _SamplingConfig) -> SamplingState:
    processed = process_logits(
        s.logits, temperature=knobs.temperature, top_k=knobs.top_k,
        top_p=knobs.top_p, min_p=knobs.min_p,
        repetition_penalty=knobs.repetition_penalty,
        no_repeat_ngram_size=config.no_repeat_ngram_size, history=s.history,
        suppress_tokens=config.suppress_tokens,
        min_new_tokens=knobs.min_new_tokens, num_generated=s.step,
        eos_id=config.eos_id)
    key, sample_key = jax.random.split(s.key)
    token = _choose_tokens(sample_key, processed, knobs.temperature)
    log_prob = jnp.take_along_axis(jax.nn.log_softmax(processed, axis=-1),
                                   token[:, None], axis=-1)[:, 0]
    token = jnp.where(s.finished, config.pad_id, token)
    log_prob = jnp.where(s.finished, 0.0, log_prob)
    finished = s.finished
    if config.eos_id is not None:
        finished = finished | (token == config.eos_id)
    history = s.history
    if history is not None:
        history = jnp.concatenate([history[:, 1:], token[:, None]], axis=1)
    new = SamplingState(
        step=s.step + 1, logits=s.logits, model_state=s.model_state, key=key,
        tokens=s.tokens.at[:, s.step].set(token),
        log_probs=s.log_probs.at[:, s.step].set(log_prob), finished=finished,
        lengths=s.lengths + (~s.finished).astype(jnp.int32), history=history)
    logits, model_state = _maybe_step(step_fn, _sampling_continues(new), token,
                                      s.logits, s.model_state)
    return new._replace(logits=logits, model_state=model_state)


@functools.partial(jax.jit, static_argnames=("step_fn", "config"))
def _sampling_loop(step_fn: StepFn, logits: jax.Array, model_state: Any,
                   key: jax.Array, history: jax.Array | None,
                   knobs: _SamplingKnobs, config: _SamplingConfig):
    batch, num_new = logits.shape[0], config.max_new_tokens
    init = SamplingState(
        step=jnp.zeros((), jnp.int32), logits=logits, model_state=model_state,
        key=key, tokens=jnp.full((batch, num_new), config.pad_id, jnp.int32),
        log_probs=jnp.zeros((batch, num_new), jnp.float32),
        finished=jnp.zeros((batch,), bool),
        lengths=jnp.zeros((batch,), jnp.int32), history=history)
    body = lambda s: _sampling_step(s, step_fn=step_fn, knobs=knobs, config=config)
    final = jax.lax.while_loop(_sampling_continues, body, init)
    return final.tokens, final.log_probs, final.lengths


def _sampling_knobs(temperature, top_k, top_p, min_p, repetition_penalty,
                    min_new_tokens) -> _SamplingKnobs:
    """Checks the traced values (when concrete) and fixes their dtypes."""
    _checks.check_in_range("temperature", temperature, low=0.0)
    if top_k is not None:
        _checks.check_integer("top_k", top_k)
    _checks.check_in_range("top_k", top_k, low=0)
    _checks.check_in_range("top_p", top_p, low=0.0, high=1.0, low_open=True)
    _checks.check_in_range("min_p", min_p, low=0.0, high=1.0)
    _checks.check_in_range("repetition_penalty", repetition_penalty, low=0.0,
                           low_open=True)
    _checks.check_in_range("min_new_tokens", min_new_tokens, low=0)
    as_array = lambda x, dtype: None if x is None else jnp.asarray(x, dtype)
    return _SamplingKnobs(
        temperature=as_array(temperature, jnp.float32),
        top_k=as_array(top_k, jnp.int32), top_p=as_array(top_p, jnp.float32),
        min_p=as_array(min_p, jnp.float32),
        repetition_penalty=as_array(repetition_penalty, jnp.float32),
        min_new_tokens=as_array(min_new_tokens, jnp.int32))


def _initial_history(prompt_tokens: jax.typing.ArrayLike | None, batch: int,
                     vocab_size: int, max_new_tokens: int) -> jax.Array:
    """``int32 [B, P + N - 1]``: the prompt right-aligned, ``NO_TOKEN`` before it."""
    if prompt_tokens is None:
        prompt = jnp.zeros((batch, 0), jnp.int32)
    else:
        _checks.check_integer("prompt_tokens", prompt_tokens)
        _checks.check_rank("prompt_tokens", prompt_tokens, 2, "[B, P]")
        if jnp.shape(prompt_tokens)[0] != batch:
            raise ValueError(f"prompt_tokens must have shape [B, P] with B = "
                             f"{batch}; got {jnp.shape(prompt_tokens)}.")
        _checks.check_in_range("prompt_tokens", prompt_tokens, high=vocab_size - 1)
        prompt = jnp.asarray(prompt_tokens, jnp.int32)
    # Padding (negative ids) moves to the left, so that the prompt's tokens
    # and the generated ones form one contiguous sequence for the n-grams.
    prompt = jnp.take_along_axis(
        prompt, jnp.argsort(prompt >= 0, axis=1, stable=True), axis=1)
    prompt = jnp.where(prompt >= 0, prompt, NO_TOKEN)
    empty = jnp.full((batch, max_new_tokens - 1), NO_TOKEN, jnp.int32)
    return jnp.concatenate([empty, prompt], axis=1)


def generate(
    step_fn: StepFn,
    logits: jax.typing.ArrayLike,
    state: Any,
    *,
    key: jax.Array,
    max_new_tokens: int,
    temperature: jax.typing.ArrayLike = 1.0,
    top_k: jax.typing.ArrayLike | None = None,
    top_p: jax.typing.ArrayLike | None = None,
    min_p: jax.typing.ArrayLike | None = None,
    repetition_penalty: jax.typing.ArrayLike | None = None,
    no_repeat_ngram_size: int | None = None,
    suppress_tokens: Sequence[int] | None = None,
    min_new_tokens: jax.typing.ArrayLike = 0,
    eos_id: int | None = None,
    pad_id: int = 0,
    num_samples: int = 1,
    prompt_tokens: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""Greedy decoding or sampling, with any combination of the processors.

    At step ``t`` every unfinished row draws

    .. math::
        y_t \sim \mathrm{softmax}(\tilde z_t), \qquad
        \tilde z_t = \mathrm{process\_logits}(z_t, \dots)

    (:func:`process_logits`), or takes :math:`\arg\max \tilde z_t` when
    ``temperature == 0``. The returned log-probabilities are
    :math:`\log \mathrm{softmax}(\tilde z_t)_{y_t}`, under the *processed*
    distribution (at ``temperature == 0``, the processed logits without any
    temperature), not under the model's raw one. A row that produces
    ``eos_id`` is finished: it emits ``pad_id`` with log-prob 0 from then on,
    and the loop stops as soon as every row is finished.

    Static arguments (changing them recompiles): ``step_fn`` (by identity),
    ``max_new_tokens``, ``num_samples``, the shapes of ``logits``, ``state``
    and ``prompt_tokens``, which processors are on (None or not),
    ``no_repeat_ngram_size``, ``suppress_tokens``, ``eos_id`` and ``pad_id``.
    The values of ``temperature`` (0 included), ``top_k``, ``top_p``,
    ``min_p``, ``repetition_penalty``, ``min_new_tokens`` and ``key`` are
    traced: changing them does not recompile. Inside an outer ``jit`` they
    cannot be checked; the processors' documented rules apply.

    Args:
        step_fn: ``step_fn(tokens int32[B], state) -> (logits [B, V], state)``;
            must keep the structure, shapes and dtypes of ``state``.
        logits: ``[B, V]`` next-token logits after each prompt.
        state: pytree whose every leaf has leading axis ``B`` (may be empty).
        key: PRNG key (unused when ``temperature == 0``).
        max_new_tokens: ``N >= 1`` tokens at most per row.
        temperature: ``T >= 0``; 0 is greedy.
        top_k, top_p, min_p, repetition_penalty, no_repeat_ngram_size,
            suppress_tokens, min_new_tokens: see :func:`process_logits`.
        eos_id: id in ``[0, V)`` that ends a row, or None.
        pad_id: id written after a row's end.
        num_samples: ``S >= 1`` samples per prompt, drawn in one batch: the
            prompt rows of ``logits`` and ``state`` are repeated, and output
            row ``b * S + s`` is sample ``s`` of prompt ``b``.
        prompt_tokens: ``int [B, P]``, the prompts, read by the repetition
            penalty and the n-gram filter (negative ids are padding, at either
            end). None: those processors see only the generated tokens.

    Returns:
        ``tokens int32 [B*S, N]``, ``log_probs float32 [B*S, N]`` and
        ``lengths int32 [B*S]`` (generated tokens, EOS included).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> table = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.2, 0.1, 0.7],
        ...                            [0.5, 0.3, 0.2]]))
        >>> markov = lambda tokens, state: (table[tokens], state)
        >>> logits = table[jnp.array([0, 1])]  # prompts ending in 0 and in 1
        >>> tokens, log_probs, lengths = generate(
        ...     markov, logits, (), key=jax.random.key(0), max_new_tokens=4,
        ...     temperature=0.0, eos_id=0, pad_id=-1)
        >>> tokens
        Array([[ 1,  2,  0, -1],
               [ 2,  0, -1, -1]], dtype=int32)
        >>> lengths, jnp.exp(log_probs[1])
        (Array([3, 2], dtype=int32), Array([0.7, 0.5, 1. , 1. ], dtype=float32))
    """
    logits = _as_logits(logits, "[B, V]")
    batch, vocab_size = logits.shape
    _check_state(state, batch)
    _check_count("max_new_tokens", max_new_tokens)
    _check_count("num_samples", num_samples)
    knobs = _sampling_knobs(temperature, top_k, top_p, min_p, repetition_penalty,
                            min_new_tokens)
    if no_repeat_ngram_size is not None:
        _check_count("no_repeat_ngram_size", no_repeat_ngram_size)
    _check_token_id("eos_id", eos_id, vocab_size)
    if suppress_tokens is not None:
        for token_id in suppress_tokens:
            _check_token_id("suppress_tokens", token_id, vocab_size)
        suppress_tokens = tuple(int(i) for i in suppress_tokens)
    history = None
    if repetition_penalty is not None or no_repeat_ngram_size is not None:
        history = _initial_history(prompt_tokens, batch, vocab_size, max_new_tokens)
    if num_samples > 1:
        repeat = lambda x: jnp.repeat(x, num_samples, axis=0)
        logits, state, history = jax.tree.map(repeat, (logits, state, history))
    config = _SamplingConfig(
        max_new_tokens=int(max_new_tokens),
        no_repeat_ngram_size=(None if no_repeat_ngram_size is None
                              else int(no_repeat_ngram_size)),
        suppress_tokens=suppress_tokens,
        eos_id=None if eos_id is None else int(eos_id), pad_id=int(pad_id))
    return _sampling_loop(step_fn, logits, state, key, history, knobs, config)


def length_penalty_divisor(length: jax.typing.ArrayLike,
                           alpha: jax.typing.ArrayLike,
                           penalty: str = "gnmt") -> jax.Array:
    r"""The divisor of a hypothesis's summed log-probs in beam search.

    .. math::
        \mathrm{gnmt}: \left(\frac{5 + L}{6}\right)^\alpha, \qquad
        \mathrm{hf}: L^\alpha

    ``L`` counts generated tokens, EOS included. Both are positive and
    monotone in ``L`` (increasing for ``alpha > 0``); ``alpha = 0`` gives 1.

    Args:
        length: ``L >= 1``, any shape.
        alpha: the exponent (``length_penalty`` of :func:`beam_search`).
        penalty: ``"gnmt"`` (Wu et al.; T5X, Flax WMT) or ``"hf"`` (Hugging
            Face).

    Returns:
        float32 array of ``length``'s shape.

    Examples:
        >>> length_penalty_divisor(7, 0.6), length_penalty_divisor(7, 0.6, "hf")
        (Array(1.51572, dtype=float32), Array(3.21410, dtype=float32))

    References:
        Wu et al., `Google's Neural Machine Translation System
        <https://arxiv.org/abs/1609.08144>`_, 2016.
    """
    _checks.check_choice("penalty", penalty, PENALTIES)
    length = jnp.asarray(length, jnp.float32)
    base = (5.0 + length) / 6.0 if penalty == "gnmt" else length
    return base ** jnp.asarray(alpha, jnp.float32)


class BeamState(NamedTuple):
    """The carry of :func:`beam_search`'s while loop.

    ``B`` prompts, ``K = num_beams``, ``n = num_return_sequences``,
    ``N = max_new_tokens``, ``V`` tokens; beam ``k`` of prompt ``b`` is row
    ``b * K + k`` of the flat arrays.

    Attributes:
        step: ``int32 []``, tokens generated so far by every live beam.
        logits: ``float32 [B*K, V]``, each live beam's next-token logits.
        model_state: ``step_fn``'s state, every leaf ``[B*K, ...]``.
        live_tokens: ``int32 [B, K, N]``, the live beams (not ended by EOS);
            ``pad_id`` from ``step`` on.
        live_log_probs: ``float32 [B, K]``, each live beam's summed log-probs;
            ``-inf`` for an empty beam.
        finished_tokens: ``int32 [B, n, N]``, the best ended hypotheses so
            far, best first; ``pad_id`` after each one's end.
        finished_scores: ``float32 [B, n]``, their scores; ``-inf`` for an
            empty slot.
        finished_lengths: ``int32 [B, n]``, their lengths; 0 for an empty slot.
    """
    step: jax.Array
    logits: jax.Array
    model_state: Any
    live_tokens: jax.Array
    live_log_probs: jax.Array
    finished_tokens: jax.Array
    finished_scores: jax.Array
    finished_lengths: jax.Array


class _BeamConfig(NamedTuple):
    """Static (hashable) settings of :func:`beam_search`."""
    num_beams: int
    num_return_sequences: int
    max_new_tokens: int
    eos_id: int | None
    pad_id: int
    penalty: str


def _extend(sequences: jax.Array, beam: jax.Array, token: jax.Array,
            step: jax.Array) -> jax.Array:
    """``sequences[b, beam[b, m]]`` with ``token[b, m]`` written at ``step``."""
    picked = jnp.take_along_axis(sequences, beam[..., None], axis=1)
    return picked.at[:, :, step].set(token)


def _beam_continues(s: BeamState, alpha: jax.Array, config: _BeamConfig) -> jax.Array:
    """False once no live beam can still enter the finished n-best.

    A live beam with summed log-probs ``S`` at length ``l`` ends at some
    ``L`` in ``[l + 1, N]`` with a sum ``S' <= S`` (log-probs are ``<= 0``),
    so its score ``S' / d(L) <= S / d(L) <= S / max_L d(L)`` because ``S <= 0``.
    ``d`` is monotone in ``L`` for either sign of ``alpha``, so the maximum is
    at ``L = l + 1`` or ``L = N``. This bound is attained when the remaining
    tokens have probability 1, so it is exact, not a heuristic. A tie with
    the worst kept hypothesis cannot displace it (the n-best keeps the older
    one), hence the strict ``>``.
    """
    num_new = config.max_new_tokens
    divisor = jnp.maximum(
        length_penalty_divisor(s.step + 1, alpha, config.penalty),
        length_penalty_divisor(num_new, alpha, config.penalty))
    best_possible = jnp.max(s.live_log_probs, axis=-1) / divisor
    can_improve = best_possible > s.finished_scores[:, -1]
    return (s.step < num_new) & jnp.any(can_improve)


def _keep_best_finished(s: BeamState, scores: jax.Array, length: jax.Array,
                        pad_id: int) -> dict[str, jax.Array]:
    """Merges hypotheses ending now (``scores [B, K*V]``, -inf if not) into the n-best."""
    num_kept = s.finished_scores.shape[1]
    vocab_size = s.logits.shape[-1]
    # Kept hypotheses come first, so on a tie lax.top_k prefers the older one.
    best_scores, best = jax.lax.top_k(
        jnp.concatenate([s.finished_scores, scores], axis=1), num_kept)
    was_kept = best < num_kept
    old = jnp.minimum(best, num_kept - 1)
    new = jnp.maximum(best - num_kept, 0)
    tokens = jnp.where(
        was_kept[..., None],
        jnp.take_along_axis(s.finished_tokens, old[..., None], axis=1),
        _extend(s.live_tokens, new // vocab_size, new % vocab_size, s.step))
    lengths = jnp.where(was_kept,
                        jnp.take_along_axis(s.finished_lengths, old, axis=1),
                        length)
    empty = best_scores == NEG_INF
    return dict(finished_tokens=jnp.where(empty[..., None], pad_id, tokens),
                finished_scores=best_scores,
                finished_lengths=jnp.where(empty, 0, lengths))


def _beam_step(s: BeamState, *, step_fn: StepFn, alpha: jax.Array,
               config: _BeamConfig) -> BeamState:
    batch, num_beams, _ = s.live_tokens.shape
    vocab_size = s.logits.shape[-1]
    length = s.step + 1
    token_log_probs = jax.nn.log_softmax(s.logits, axis=-1)
    totals = s.live_log_probs[..., None] + token_log_probs.reshape(
        batch, num_beams, vocab_size)
    is_eos = jnp.arange(vocab_size) == (-1 if config.eos_id is None else config.eos_id)
    # Every candidate ends at the last step, with or without EOS.
    ends_now = is_eos | (length == config.max_new_tokens)
    ending_scores = jnp.where(
        ends_now, totals / length_penalty_divisor(length, alpha, config.penalty),
        NEG_INF)
    finished = _keep_best_finished(s, ending_scores.reshape(batch, -1), length,
                                   config.pad_id)
    live_log_probs, best = jax.lax.top_k(
        jnp.where(is_eos, NEG_INF, totals).reshape(batch, -1), num_beams)
    beam, token = best // vocab_size, best % vocab_size
    new = s._replace(step=length, live_log_probs=live_log_probs,
                     live_tokens=_extend(s.live_tokens, beam, token, s.step),
                     **finished)
    rows = (jnp.arange(batch)[:, None] * num_beams + beam).reshape(-1)
    model_state = jax.tree.map(lambda x: jnp.take(x, rows, axis=0), s.model_state)
    logits, model_state = _maybe_step(step_fn, _beam_continues(new, alpha, config),
                                      token.reshape(-1), s.logits, model_state)
    return new._replace(logits=logits, model_state=model_state)


@functools.partial(jax.jit, static_argnames=("step_fn", "config"))
def _beam_loop(step_fn: StepFn, logits: jax.Array, model_state: Any,
               alpha: jax.Array, config: _BeamConfig):
    batch = logits.shape[0]
    beams, kept, num_new = (config.num_beams, config.num_return_sequences,
                            config.max_new_tokens)
    tile = lambda x: jnp.repeat(x, beams, axis=0)
    # All beams start as the same empty hypothesis; only one may expand.
    first_only = jnp.where(jnp.arange(beams) == 0, 0.0, NEG_INF)
    init = BeamState(
        step=jnp.zeros((), jnp.int32), logits=tile(logits),
        model_state=jax.tree.map(tile, model_state),
        live_tokens=jnp.full((batch, beams, num_new), config.pad_id, jnp.int32),
        live_log_probs=jnp.broadcast_to(first_only, (batch, beams)),
        finished_tokens=jnp.full((batch, kept, num_new), config.pad_id, jnp.int32),
        finished_scores=jnp.full((batch, kept), NEG_INF, jnp.float32),
        finished_lengths=jnp.zeros((batch, kept), jnp.int32))
    final = jax.lax.while_loop(
        lambda s: _beam_continues(s, alpha, config),
        lambda s: _beam_step(s, step_fn=step_fn, alpha=alpha, config=config),
        init)
    return final.finished_tokens, final.finished_scores, final.finished_lengths


def beam_search(
    step_fn: StepFn,
    logits: jax.typing.ArrayLike,
    state: Any,
    *,
    num_beams: int,
    max_new_tokens: int,
    eos_id: int | None,
    length_penalty: jax.typing.ArrayLike = 0.6,
    penalty: str = "gnmt",
    num_return_sequences: int = 1,
    pad_id: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""Beam search for the n best continuations under a length penalty.

    A hypothesis :math:`y_{1..L}` ends with EOS or at ``L = N``; its score is

    .. math::
        s(y) = \frac{\sum_{t=1}^{L} \log p(y_t \mid y_{<t})}{d(L)}

    with ``d`` from :func:`length_penalty_divisor` (``L`` counts EOS). Each
    step extends the ``K`` live beams by every token, moves the candidates
    that end (EOS, or any token at step ``N``) into a separate n-best store,
    and keeps the ``K`` best other candidates by summed log-probs as the new
    live beams; ``step_fn``'s state is reordered by gathering their parent
    rows. The search stops early only when no live beam can still enter the
    n-best, by an exact bound (see ``_beam_continues``), so stopping early
    never changes the result. With ``K >= V ** (N - 1)`` nothing is pruned
    and the result is the exact n-best over all sequences. Scores use the
    model's raw log-probs (no logits processors).

    Static arguments: ``step_fn``, ``num_beams``, ``max_new_tokens``,
    ``eos_id``, ``penalty``, ``num_return_sequences``, ``pad_id`` and the
    shapes; ``length_penalty`` is traced.

    Args:
        step_fn: ``step_fn(tokens int32[M], state) -> (logits [M, V], state)``
            for any number of rows ``M`` (it gets ``B * num_beams``).
        logits: ``[B, V]`` next-token logits after each prompt.
        state: pytree whose every leaf has leading axis ``B``; tiled to
            ``B * num_beams`` rows.
        num_beams: ``K >= 1``.
        max_new_tokens: ``N >= 1``.
        eos_id: id in ``[0, V)`` that ends a hypothesis, or None.
        length_penalty: the exponent ``alpha`` (0: plain log-prob sums).
        penalty: ``"gnmt"`` or ``"hf"``.
        num_return_sequences: ``1 <= n <= K`` hypotheses returned per prompt.
        pad_id: id written after a hypothesis's end.

    Returns:
        ``tokens int32 [B, n, N]``, ``scores float32 [B, n]`` and ``lengths
        int32 [B, n]``, best first. If fewer than ``n`` hypotheses exist (tiny
        ``V`` and ``N``), the missing ones have score ``-inf`` and length 0.

    Examples:
        >>> import jax.numpy as jnp
        >>> table = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.2, 0.1, 0.7],
        ...                            [0.5, 0.3, 0.2]]))
        >>> markov = lambda tokens, state: (table[tokens], state)
        >>> tokens, scores, lengths = beam_search(
        ...     markov, table[jnp.array([1])], (), num_beams=3,
        ...     max_new_tokens=3, eos_id=0, length_penalty=0.0,
        ...     num_return_sequences=2, pad_id=-1)
        >>> tokens
        Array([[[ 2,  0, -1],
                [ 0, -1, -1]]], dtype=int32)
        >>> scores.round(4).tolist(), lengths.tolist()  # log(0.7 * 0.5), log 0.2
        ([[-1.0498, -1.6094]], [[2, 1]])

    References:
        Wu et al., `Google's Neural Machine Translation System
        <https://arxiv.org/abs/1609.08144>`_, 2016.
    """
    logits = _as_logits(logits, "[B, V]")
    batch, vocab_size = logits.shape
    _check_state(state, batch)
    _check_count("num_beams", num_beams)
    _check_count("max_new_tokens", max_new_tokens)
    _check_count("num_return_sequences", num_return_sequences)
    if num_return_sequences > num_beams:
        raise ValueError(f"num_return_sequences must be <= num_beams = "
                         f"{num_beams}; got {num_return_sequences}.")
    _checks.check_choice("penalty", penalty, PENALTIES)
    _check_token_id("eos_id", eos_id, vocab_size)
    if not _checks.is_traced(length_penalty) and not np.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be finite; got {length_penalty}.")
    config = _BeamConfig(
        num_beams=int(num_beams), num_return_sequences=int(num_return_sequences),
        max_new_tokens=int(max_new_tokens),
        eos_id=None if eos_id is None else int(eos_id), pad_id=int(pad_id),
        penalty=penalty)
    return _beam_loop(step_fn, logits, state,
                      jnp.asarray(length_penalty, jnp.float32), config)


class TokenDecoder(Protocol):
    """Anything with ``decode(ids: list[int]) -> str``.

    ``lmhead.data``'s tokenizers and ``tokenizers.Tokenizer`` both qualify.
    """

    def decode(self, ids: list[int]) -> str: ...


def detokenize(ids: jax.typing.ArrayLike, tokenizer: TokenDecoder, *,
               eos_id: int | None = None,
               pad_id: int | None = None) -> str | list:
    """Token ids to text: each row is cut before its first EOS, then decoded.

    Args:
        ids: ``int [..., N]``; a single row gives a string, ``[B, N]`` a list
            of strings, ``[B, n, N]`` (beam search) a list of lists.
        tokenizer: a :class:`TokenDecoder`.
        eos_id: the row ends before its first ``eos_id`` (EOS is not text).
            None: no cut.
        pad_id: every ``pad_id`` is dropped. None: none is, which is right for
            rows cut at EOS and for a ``pad_id`` that is also a real token.

    Returns:
        ``str``, or nested lists of ``str`` following the leading axes.

    Examples:
        >>> class Letters:
        ...     def decode(self, ids):
        ...         return "".join("abcd"[i] for i in ids)
        >>> detokenize([[0, 1, 3, 2], [2, 2, 2, 2]], Letters(), eos_id=3)
        ['ab', 'cccc']
    """
    if not callable(getattr(tokenizer, "decode", None)):
        raise TypeError("tokenizer must have a decode(ids: list[int]) -> str "
                        f"method; got {type(tokenizer).__name__}.")
    ids = np.asarray(ids)
    if ids.ndim == 0:
        raise ValueError(f"ids must have shape [..., N]; got shape {ids.shape}.")
    if ids.size:
        _checks.check_integer("ids", ids)
    if ids.ndim > 1:
        return [detokenize(row, tokenizer, eos_id=eos_id, pad_id=pad_id)
                for row in ids]
    row = ids.tolist()
    if eos_id is not None and eos_id in row:
        row = row[:row.index(eos_id)]
    if pad_id is not None:
        row = [i for i in row if i != pad_id]
    return tokenizer.decode(row)
