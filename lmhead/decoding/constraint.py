r"""Constrained decoding as data of the one decoding step: each row's allowed
tokens, a packed bitmask that the step reads and a host automaton advances.

A constraint (a JSON Schema, a regex, a grammar: the upper layer's, which
compiles it) is, to the step, a row's *allowed-token mask* ``int32 [B, W]``,
``W = ceil(V / 32)`` words whose bit ``j`` of word ``i`` allows token ``32 i +
j`` (the layout of llguidance's and XGrammar's token bitmasks). The step
removes the tokens it does not allow (:func:`apply_token_mask`, inside
:func:`~lmhead.decoding.process_logits`) and, once it has drawn each row's
token, hands the tokens to a host object, the :class:`TokenMasker`, which
advances each constrained row's automaton and returns the masks of the next
step (a ``jax.experimental.io_callback``, issued beside the model's next
forward pass, on which it does not depend, so the host fills the masks while
the device runs the model). The masker and whether there is a constraint are
static; the rows' automaton ids and masks are traced arrays, so a new
constraint costs no compile. Rows with id ``-1`` are unconstrained (every bit
set), and a step in which no constrained row emits calls nothing.
``docs/decoding.md`` describes the contract.
"""

import dataclasses
import functools
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from lmhead import _checks
from lmhead.head import NEG_INF

# Bits per word of a packed mask.
MASK_BITS = 32
# The id of a row without a constraint.
UNCONSTRAINED = -1


def mask_width(vocab_size: int) -> int:
    """``W = ceil(V / 32)``, the words of one row's mask.

    Examples:
        >>> mask_width(85), mask_width(64), mask_width(50257)
        (3, 2, 1571)
    """
    _checks.check_count("vocab_size", vocab_size)
    return -(-vocab_size // MASK_BITS)


def pack_token_mask(allowed: Any) -> np.ndarray:
    """``bool [..., V]`` as packed words ``int32 [..., ceil(V / 32)]`` (host,
    numpy): bit ``j`` of word ``i`` is token ``32 i + j``; the bits past
    ``V`` are 0.

    Examples:
        >>> pack_token_mask(np.array([True, False, True]))
        array([5], dtype=int32)
    """
    allowed = np.asarray(allowed, bool)
    vocab_size = allowed.shape[-1]
    padded = np.zeros((*allowed.shape[:-1], mask_width(vocab_size) * MASK_BITS), bool)
    padded[..., :vocab_size] = allowed
    packed = np.packbits(padded, axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view(np.int32)


def unpack_token_mask(words: jax.typing.ArrayLike, vocab_size: int) -> jax.Array:
    """Packed words ``int32 [..., W]`` as ``bool [..., V]``, ``V <= 32 W``.

    Examples:
        >>> unpack_token_mask(jnp.array([5], jnp.int32), 3)
        Array([ True, False,  True], dtype=bool)
    """
    words = jnp.asarray(words, jnp.int32)
    if words.shape[-1] * MASK_BITS < vocab_size:
        raise ValueError(
            f"the mask has {words.shape[-1]} words, {words.shape[-1] * MASK_BITS} "
            f"bits, fewer than V = {vocab_size} tokens."
        )
    shifts = jnp.arange(MASK_BITS, dtype=jnp.int32)
    bits = (words[..., :, None] >> shifts) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(bool)


def apply_token_mask(
    logits: jax.typing.ArrayLike, words: jax.typing.ArrayLike | None
) -> jax.Array:
    r"""Removes the tokens a row's packed mask does not allow.

    .. math::
        z'_i = z_i \text{ if bit } i \text{ of the row's mask is set, else }
        -\infty

    Args:
        logits: ``[B, V]`` scores.
        words: ``int32 [B, W]``, ``W = ceil(V / 32)`` (:func:`pack_token_mask`),
            or None (no mask).

    Returns:
        ``[B, V]`` float32.

    Examples:
        >>> apply_token_mask(jnp.array([[1.0, 2.0, 3.0]]), jnp.array([[5]]))
        Array([[  1., -inf,   3.]], dtype=float32)
    """
    logits = _checks.as_logits(logits, "[B, V]")
    if words is None:
        return logits
    check_words(words, logits.shape[0], logits.shape[-1])
    return jnp.where(unpack_token_mask(words, logits.shape[-1]), logits, NEG_INF)


def check_words(words: Any, rows: int, vocab_size: int) -> None:
    """Raises unless ``words`` is integer ``[rows, ceil(V / 32)]``."""
    _checks.check_integer("allowed", words)
    shape = (rows, mask_width(vocab_size))
    if jnp.shape(words) != shape:
        raise ValueError(
            f"allowed must be the packed token masks, shape [B, ceil(V / 32)] = "
            f"{shape}; got {jnp.shape(words)}."
        )


@runtime_checkable
class TokenMasker(Protocol):
    """The host side of a constraint: one automaton per id, advanced token by token.

    ``advance(ids int32 [B], tokens int32 [B], emitted bool [B]) -> int32
    [B, W]``: each row ``b`` with ``emitted[b]`` (its id is then ``>= 0``)
    takes ``tokens[b]`` in the automaton ``ids[b]``; the result is every
    row's mask of the tokens its automaton allows next (:func:`pack_token_mask`
    layout; all bits set for an id that is ``-1`` or unknown, a row the
    masker does not constrain). End-of-text is allowed only where the
    automaton accepts; a mask that allows no token ends its row. The step
    calls it from a host thread while the device runs, so it must tolerate
    being called beside the thread that created its automata, and must be
    hashable (it is static: the same masker compiles once).
    """

    def advance(
        self, ids: np.ndarray, tokens: np.ndarray, emitted: np.ndarray
    ) -> np.ndarray: ...


def _host_advance(masker: TokenMasker, width: int, ids, tokens, emitted) -> np.ndarray:
    words = np.asarray(
        masker.advance(np.asarray(ids), np.asarray(tokens), np.asarray(emitted))
    )
    if words.shape != (len(ids), width):
        raise ValueError(
            f"TokenMasker.advance must return int32 [B, W] = {(len(ids), width)}; "
            f"got shape {words.shape}."
        )
    return words.astype(np.int32, copy=False)


def host_masks(
    masker: TokenMasker,
    ids: jax.Array,
    tokens: jax.Array,
    emitted: jax.Array,
    width: int,
) -> jax.Array:
    """``masker.advance(ids, tokens, emitted)`` from inside a compiled program
    (an ``io_callback``): ``int32 [B, W]``."""
    return io_callback(
        functools.partial(_host_advance, masker, width),
        jax.ShapeDtypeStruct((ids.shape[0], width), jnp.int32),
        ids,
        tokens,
        emitted,
        ordered=False,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class TokenConstraint:
    """Each row's constraint: its automaton's id in ``masker`` and its mask.

    A pytree: ``ids`` and ``words`` are traced, ``masker`` is static (the
    same masker with new ids compiles nothing). Give
    :func:`~lmhead.decoding.generate` ``TokenConstraint(ids, masker)``; the
    loop fills ``words`` (the masks of each row's next token) by asking the
    masker before the first step, and carries them in its rows.

    Attributes:
        ids: ``int32 [B]``, each row's automaton id, ``-1``: unconstrained.
        masker: the :class:`TokenMasker` that holds the automata.
        words: ``int32 [B, W]``, each row's mask for its next token, or None
            before the loop has asked for it.
    """

    ids: jax.Array
    masker: TokenMasker = dataclasses.field(metadata=dict(static=True))
    words: jax.Array | None = None

    def check(self, rows: int) -> None:
        """Raises unless ``ids`` is integer ``[rows]`` and ``masker`` a
        :class:`TokenMasker`."""
        if not isinstance(self.masker, TokenMasker):
            raise TypeError(
                "constraint.masker must have advance(ids, tokens, emitted); got "
                f"{type(self.masker).__name__}."
            )
        _checks.check_integer("constraint.ids", self.ids)
        if jnp.shape(self.ids) != (rows,):
            raise ValueError(
                f"constraint.ids must have one id per row, shape [B] = ({rows},); "
                f"got {jnp.shape(self.ids)}."
            )

    def started(self, vocab_size: int) -> "TokenConstraint":
        """With ``words`` the masks of each row's first token (asked of the
        masker, nothing emitted)."""
        ids = jnp.asarray(self.ids, jnp.int32)
        nothing = jnp.zeros_like(ids)
        words = host_masks(
            self.masker, ids, nothing, nothing > 0, mask_width(vocab_size)
        )
        return TokenConstraint(ids, self.masker, words)

    def advanced(self, tokens: jax.Array, emitted: jax.Array) -> "TokenConstraint":
        """After a step: the rows that emitted take their token, and their
        masks become those of their next token (a row's mask stays where it
        emitted nothing); no host call when no constrained row emitted."""
        taken = emitted & (self.ids >= 0)
        width = self.words.shape[-1]
        words = jax.lax.cond(
            jnp.any(taken),
            lambda: host_masks(self.masker, self.ids, tokens, taken, width),
            lambda: self.words,
        )
        words = jnp.where(taken[:, None], words, self.words)
        return dataclasses.replace(self, words=words)

    def any_allowed(self, vocab_size: int) -> jax.Array:
        """``bool [B]``: the row's mask allows at least one token."""
        return jnp.any(unpack_token_mask(self.words, vocab_size), axis=-1)
