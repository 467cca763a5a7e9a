"""What both decoding loops share: argument checks and the guarded model step."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# step_fn(params, tokens int32[B], state) -> (logits [B, V], state)
StepFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]


def check_token_id(name: str, value: int | None, vocab_size: int) -> None:
    if value is None:
        return
    if not isinstance(value, (int, np.integer)) or not 0 <= value < vocab_size:
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


def check_step_fn(step_fn: Any) -> None:
    """The loops jit with ``step_fn`` static, so it must be hashable."""
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable; got {type(step_fn).__name__}.")
    try:
        hash(step_fn)
    except TypeError as error:
        raise TypeError(
            "step_fn must be hashable (it is a static argument of "
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
) -> tuple[jax.Array, Any]:
    """``step_fn(params, tokens, model_state)`` unless the loop is about to stop.

    The skipped call would compute logits that nobody reads and write a cache
    slot that a cache sized for prompt + max_new_tokens - 1 does not have.
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
        return jnp.asarray(new_logits, jnp.float32), new_state

    return jax.lax.cond(keep_going, call, lambda: (logits, model_state))
