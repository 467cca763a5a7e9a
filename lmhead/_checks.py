"""Argument checks shared by the public functions.

Every check raises ``ValueError`` or ``TypeError`` with a message that names
the argument and says what is allowed. Checks on *values* run only when the
value is concrete (a Python number or an array outside ``jit``); inside
``jit`` the caller documents what happens instead.
"""

from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_traced(x: Any) -> bool:
    """True when ``x`` is an abstract value inside a jax transformation."""
    return isinstance(x, jax.core.Tracer)


def check_choice(name: str, value: Any, choices: Collection[Any]) -> None:
    """Raises ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}.")


def check_floating(name: str, x: jax.typing.ArrayLike) -> None:
    """Raises TypeError unless ``x`` has a floating-point dtype."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(
            f"{name} must have a floating-point dtype; got {jnp.result_type(x)}."
        )


def check_integer(name: str, x: jax.typing.ArrayLike) -> None:
    """Raises TypeError unless ``x`` has an integer dtype."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise TypeError(f"{name} must have an integer dtype; got {jnp.result_type(x)}.")


def check_rank(
    name: str, x: jax.typing.ArrayLike, rank: int | set[int], layout: str
) -> None:
    """Raises ValueError unless ``x.ndim`` is ``rank`` (or in the set)."""
    ranks = {rank} if isinstance(rank, int) else rank
    if np.ndim(x) not in ranks:
        raise ValueError(f"{name} must have shape {layout}; got shape {np.shape(x)}.")


def check_in_range(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raises ValueError unless every element of ``value`` lies in the range.

    Skipped for traced values, whose range cannot be known at trace time.
    """
    if value is None or is_traced(value):
        return
    array = np.asarray(value)
    ok = np.ones(array.shape, bool)
    if low is not None:
        ok &= (array > low) if low_open else (array >= low)
    if high is not None:
        ok &= (array < high) if high_open else (array <= high)
    if not np.all(ok):
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        low_text = "-inf" if low is None else f"{low:g}"
        high_text = "inf" if high is None else f"{high:g}"
        bad = array[~ok].ravel()[0] if array.ndim else array.item()
        raise ValueError(
            f"{name} must be in {left}{low_text}, {high_text}{right}; got {bad}."
        )


def check_unembed_inputs(
    h: jax.typing.ArrayLike, w: jax.typing.ArrayLike, bias: jax.typing.ArrayLike | None
) -> None:
    """Checks ``h: [..., D]``, ``w: [V, D]`` and ``bias: [V] | None``."""
    check_floating("h", h)
    check_floating("w", w)
    check_rank("w", w, 2, "[V, D]")
    if 0 in np.shape(w):
        raise ValueError(
            f"w must have shape [V, D] with V >= 1 and D >= 1; got {np.shape(w)}."
        )
    if np.ndim(h) < 1 or np.shape(h)[-1] != np.shape(w)[1]:
        raise ValueError(
            f"h must have shape [..., D] with D = w.shape[1] = {np.shape(w)[1]};"
            f" got h.shape={np.shape(h)}."
        )
    if bias is not None:
        check_floating("bias", bias)
        if np.shape(bias) != (np.shape(w)[0],):
            raise ValueError(
                f"bias must have shape [V] = ({np.shape(w)[0]},); got {np.shape(bias)}."
            )


def check_count(name: str, value: Any, *, optional: bool = False) -> None:
    """Checks that ``value`` is a count: an integer ``>= 1`` (or None if ``optional``).

    A count is a Python or numpy integer; a bool is not one, nor is a float
    with an integral value, nor an array. Use it for every size, length and
    number of things an argument or field gives.

    Raises:
        TypeError: ``value`` is not an integer (or is a bool).
        ValueError: ``value < 1``.

    Examples:
        >>> check_count("chunk_size", 2.5, optional=True)
        Traceback (most recent call last):
        ...
        TypeError: chunk_size must be an integer >= 1 or None; got 2.5.
    """
    if optional and value is None:
        return
    rule = "an integer >= 1 or None" if optional else "an integer >= 1"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be {rule}; got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be {rule}; got {value!r}.")


def check_concrete(where: str, **values: Any) -> None:
    """Raises TypeError for a traced value among ``values``.

    For numbers that a blocked loss compiles into its loops.
    """
    for name, value in values.items():
        if is_traced(value):
            raise TypeError(
                f"{name} must be a concrete number for {where} (it is compiled "
                "into the blocked loops); got a traced value."
            )


def check_logits(logits: jax.typing.ArrayLike, layout: str = "[..., V]") -> None:
    """Checks ``logits``: floating point, ``V >= 1``, and rank 2 for
    ``layout="[B, V]"``, else rank >= 1."""
    check_floating("logits", logits)
    ranks = 2 if layout == "[B, V]" else set(range(1, 64))
    check_rank("logits", logits, ranks, layout)
    if np.shape(logits)[-1] < 1:
        raise ValueError(
            f"logits must have shape {layout} with V >= 1; got shape "
            f"{np.shape(logits)}."
        )


def as_logits(logits: jax.typing.ArrayLike, layout: str = "[..., V]") -> jax.Array:
    """``logits`` as float32, after :func:`check_logits`."""
    check_logits(logits, layout)
    return jnp.asarray(logits, jnp.float32)


def check_ids_in_range(
    name: str,
    ids: Any,
    weights: Any,
    vocab_size: int,
    note: str = "",
    ignore_index: int | None = None,
) -> None:
    """Concrete ``ids`` outside ``[0, V)`` where ``weights`` (None: all) are
    nonzero raise ValueError naming ``name``; traced ones are the caller's rule.

    ``weights`` has the shape of ``ids``, or one fewer axis for ``ids: [...,
    k]``, ``k`` ids per token. With ``ignore_index``, a token whose ids all
    equal it is allowed (``losses.valid_weights``' rule).
    """
    if is_traced(ids) or is_traced(weights):
        return
    ids = np.asarray(ids)
    live = np.ones(ids.shape, bool) if weights is None else np.asarray(weights) != 0
    per_id = live.ndim < ids.ndim
    if per_id:
        live = live[..., None]
    bad = live & ((ids < 0) | (ids >= vocab_size))
    allowed = ""
    if ignore_index is not None:
        ignored = ids == ignore_index
        if per_id:
            ignored = np.all(ignored, axis=-1, keepdims=True)
        bad &= ~ignored
        allowed = f" or equal ignore_index={ignore_index}"
        allowed += " (all of a token's ids)" if per_id else ""
    if np.any(bad):
        raise ValueError(
            f"{name} must be in [0, {vocab_size}){allowed} wherever weights are "
            f"nonzero; got {ids[bad].ravel()[0]}.{note}"
        )
