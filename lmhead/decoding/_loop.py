"""What the decoders share: argument checks, EOS and finiteness tests, the guarded model step."""

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks

# step_fn(params, tokens int32[B], state) -> (logits [B, V], state)
StepFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]
# An empty slot of a token history (left padding, or not yet generated).
NO_TOKEN = -1
# Where generate's log-probs come from: what was sampled, or the model.
LOG_PROBS_FROM = ("processed", "model")


def check_token_id(name: str, value: int | None, vocab_size: int) -> None:
    if value is None:
        return
    integer = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not integer or not 0 <= value < vocab_size:
        raise ValueError(
            f"{name} must be an integer in [0, V) = [0, {vocab_size}); got {value!r}."
        )


def check_state(state: Any, batch: int) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for path, leaf in leaves:
        shape = jnp.shape(leaf)
        if not shape or shape[0] != batch:
            raise ValueError(
                f"every leaf of state must have the batch axis B = {batch} "
                f"first; state{jax.tree_util.keystr(path)} has shape {shape}."
            )


def check_static_callable(name: str, fn: Any) -> None:
    """Raises TypeError unless ``fn`` is callable and hashable: the loops jit
    with it static, compared by hash."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable; got {type(fn).__name__}.")
    try:
        hash(fn)
    except TypeError as error:
        raise TypeError(
            f"{name} must be hashable (it is a static argument of "
            f"the compiled loop); {error}."
        ) from None


def repeat_rows(step_fn: StepFn, state: Any, repeats: int) -> Any:
    """``state`` with each row repeated ``repeats`` times: row ``b * repeats +
    k`` continues row ``b``. By ``step_fn.repeat(state, repeats)`` if
    ``step_fn`` has one (a cache whose rows point at each other must move its
    pointers too), else by ``jnp.repeat`` of every leaf."""
    repeat = getattr(step_fn, "repeat", None)
    if repeat is not None:
        return repeat(state, repeats)
    return jax.tree.map(lambda x: jnp.repeat(x, repeats, axis=0), state)


def maybe_step(
    step_fn: StepFn,
    params: Any,
    keep_going: jax.Array,
    tokens: jax.Array,
    logits: jax.Array,
    model_state: Any,
    beside: Callable[[], Any] = lambda: (),
) -> tuple[jax.Array, Any, Any]:
    """``step_fn(params, tokens, model_state)`` unless the loop is about to
    stop, and ``beside()`` either way: ``(logits, model_state, beside's
    result)``.

    The skipped call would compute logits that nobody reads and write a cache
    slot that a cache sized for prompt + max_new_tokens - 1 does not have.
    ``beside`` (a constraint's host call) runs in the model's branch, beside
    its pass: outside the branch, XLA would wait for the branch first.
    """

    def call():
        new_logits, new_state = step_fn(params, tokens, model_state)
        if jnp.shape(new_logits) != logits.shape or jax.tree.structure(
            new_state
        ) != jax.tree.structure(model_state):
            raise ValueError(
                f"step_fn must return (logits {logits.shape}, state with the "
                f"structure it was given); got logits {jnp.shape(new_logits)}."
            )
        return jnp.asarray(new_logits, jnp.float32), new_state, beside()

    return jax.lax.cond(keep_going, call, lambda: (logits, model_state, beside()))


def right_aligned(prompt_tokens: jax.Array, width: int) -> jax.Array:
    """``int32 [B, width]``: each row's non-negative ids (a prompt, padded
    with negative ids anywhere) moved to the right end, in order, after
    :data:`NO_TOKEN`; the last ``width`` of them where there are more.

    Examples:
        >>> right_aligned(jnp.array([[5, -1, 6], [-1, -1, 7]]), 4).tolist()
        [[-1, -1, 5, 6], [-1, -1, -1, 7]]
    """
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    rows, have = prompt_tokens.shape
    if have < width:
        pad = jnp.full((rows, width - have), NO_TOKEN, jnp.int32)
        prompt_tokens = jnp.concatenate([pad, prompt_tokens], axis=1)
    # Padding (negative ids) moves to the left, so that the prompt's tokens
    # and the generated ones form one contiguous sequence for the n-grams.
    order = jnp.argsort(prompt_tokens >= 0, axis=1, stable=True)
    aligned = jnp.take_along_axis(prompt_tokens, order, axis=1)[:, -width:]
    return jnp.where(aligned >= 0, aligned, NO_TOKEN)


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """``bool [...]``: each of ``tokens [...]`` is one of ``eos_ids`` (the
    generated tokens, or ``arange(V)`` for a mask over the vocabulary)."""
    return jnp.isin(tokens, jnp.asarray(eos_ids, tokens.dtype))


def not_finite(logits: jax.Array) -> jax.Array:
    """``bool [...]``: the row of ``logits [..., V]`` has a NaN or ``+inf``
    logit, or no finite one: it cannot be decoded.

    Examples:
        >>> not_finite(jnp.array([[0.0, 1.0], [jnp.nan, 1.0], [-jnp.inf, -jnp.inf]]))
        Array([False,  True,  True], dtype=bool)
    """
    return jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1) | jnp.all(
        logits == -jnp.inf, axis=-1
    )


def check_token_rows(name: str, tokens: Any, batch: int, shape: str) -> None:
    """Raises unless ``tokens`` is an integer array of ``shape`` (``"[B, P]"``)
    with ``batch`` rows."""
    _checks.check_integer(name, tokens)
    _checks.check_rank(name, tokens, 2, shape)
    if jnp.shape(tokens)[0] != batch:
        raise ValueError(
            f"{name} must have shape {shape} with B = {batch}; got {jnp.shape(tokens)}."
        )


def check_prompt_tokens(prompt_tokens: Any, batch: int, vocab_size: int) -> None:
    """Raises unless ``prompt_tokens`` is None or integer ``[B, P]`` below ``V``."""
    if prompt_tokens is None:
        return
    check_token_rows("prompt_tokens", prompt_tokens, batch, "[B, P]")
    _checks.check_in_range("prompt_tokens", prompt_tokens, high=vocab_size - 1)


def check_call(step_fn: Any, logits: Any, state: Any) -> tuple[jax.Array, int, int]:
    """The checks both loops open with: ``(logits [B, V] as float, B, V)``."""
    logits = _checks.as_logits(logits, "[B, V]")
    batch, vocab_size = logits.shape
    check_static_callable("step_fn", step_fn)
    check_state(state, batch)
    return logits, batch, vocab_size


def eos_ids(eos_id: Any, vocab_size: int) -> tuple[int, ...]:
    """``eos_id`` (None, an id, or a non-empty sequence, set or array of ids)
    as its distinct ids in increasing order, each checked; ``()`` for None.

    Raises:
        TypeError: ``eos_id`` is neither an integer nor a collection.
        ValueError: an empty collection, or an id that is not an integer in
            ``[0, V)``.
    """
    if eos_id is None:
        return ()
    if isinstance(eos_id, (int, np.integer)):
        ids = (eos_id,)
    elif isinstance(eos_id, str) or not isinstance(eos_id, Iterable):
        raise TypeError(
            "eos_id must be None, an integer id or a collection of them; "
            f"got {eos_id!r}."
        )
    else:
        ids = tuple(eos_id)
        if not ids:
            raise ValueError(
                "eos_id must be None, an id or ids; got an empty collection."
            )
    for token_id in ids:
        check_token_id("eos_id", token_id, vocab_size)
    return tuple(sorted({int(token_id) for token_id in ids}))


@functools.partial(jax.jit, static_argnames=("num_samples", "raw"))
def _sample_keys(key: jax.Array, num_samples: int, raw: bool) -> jax.Array:
    """``[B * S]`` keys: ``fold_in(key_b, s)`` (``key`` raw ``[B, 2]`` data if ``raw``)."""
    if raw:
        key = jax.random.wrap_key_data(key)
    fold = lambda k: jax.vmap(lambda s: jax.random.fold_in(k, s))(
        jnp.arange(num_samples)
    )
    return jax.vmap(fold)(key).reshape(-1)


def row_keys(key: Any, batch: int, num_samples: int) -> jax.Array:
    """One key, as it is; or ``[B]`` keys, sample ``s`` of row ``b`` getting
    ``fold_in(key_b, s)`` (rows ``b * S + s``), in one compiled call."""
    if not isinstance(key, jax.Array):
        key = np.asarray(key)
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw = not typed and key.ndim == 2 and key.shape[0] == batch
    if not typed and key.ndim == 1:
        return jnp.asarray(key)  # one raw key
    if key.ndim == 0:
        return key
    if not raw and key.shape != (batch,):
        raise ValueError(
            f"key must be one PRNG key or one per row, shape [B] = ({batch},); "
            f"got shape {key.shape}."
        )
    return _sample_keys(key, num_samples=num_samples, raw=raw)


def row_limits(
    row_max_new_tokens: Any, batch: int, max_new_tokens: int
) -> jax.Array | None:
    """``row_max_new_tokens`` as ``int32 [B]`` (None stays), each ``1 <= n_b <=
    max_new_tokens`` where concrete."""
    if row_max_new_tokens is None:
        return None
    _checks.check_integer("row_max_new_tokens", row_max_new_tokens)
    if np.shape(row_max_new_tokens) != (batch,):
        raise ValueError(
            f"row_max_new_tokens must have one value per row, shape [B] = "
            f"({batch},); got shape {np.shape(row_max_new_tokens)}."
        )
    _checks.check_in_range(
        "row_max_new_tokens", row_max_new_tokens, low=1, high=max_new_tokens
    )
    return jnp.asarray(row_max_new_tokens, jnp.int32)


def check_outputs(top_logprobs: Any, log_probs_from: str, vocab_size: int) -> None:
    """Raises unless ``0 <= top_logprobs <= V`` and ``log_probs_from`` is a choice."""
    if isinstance(top_logprobs, (bool, np.bool_)) or not isinstance(
        top_logprobs, (int, np.integer)
    ):
        raise TypeError(f"top_logprobs must be an integer >= 0; got {top_logprobs!r}.")
    if not 0 <= top_logprobs <= vocab_size:
        raise ValueError(
            f"top_logprobs must be in [0, V] = [0, {vocab_size}]; got {top_logprobs}."
        )
    _checks.check_choice("log_probs_from", log_probs_from, LOG_PROBS_FROM)
