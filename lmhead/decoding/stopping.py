"""Stop conditions besides EOS and a row's length: the protocol
:class:`StopCondition`, and :class:`StopSequences` of token ids. The loop ends
a row where any condition fires (:data:`~lmhead.decoding.FINISHED_STOP`),
keeping the tokens that made the stop; the text layer trims them.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks
from lmhead.decoding.processors import NO_TOKEN


@runtime_checkable
class StopCondition(Protocol):
    """The protocol of a stop condition (``B`` rows).

    A condition is a pytree of traced leaves (its shapes and static fields
    are part of the compiled program); only its carry leads with ``B``.

    * ``init(batch) -> carry``: the carry before the first token, every leaf
      ``[batch, ...]``.
    * ``update(carry, tokens int32 [B], active bool [B]) -> (carry, ended bool
      [B])``: called once per step with the token each row just generated;
      ``active`` is False for rows that emitted nothing (their token is
      ``pad_id``): such a row keeps its carry and does not end, so a step in
      which no row is active may be skipped (speculative decoding skips a
      call's draft tests from the first depth where no row has a draft left
      to test). ``ended`` is True where the row's generated tokens now end a
      stop.
    * ``repeat_rows(repeats) -> StopCondition``: each row repeated ``repeats``
      times, row ``b`` becoming rows ``b * repeats ... b * repeats + repeats -
      1`` (for ``num_samples``).
    * ``check(batch, vocab_size)``: raises ValueError, naming the argument,
      unless the condition suits ``batch`` rows over ``vocab_size`` tokens.
    """

    def init(self, batch: int) -> Any: ...

    def update(
        self, carry: Any, tokens: jax.Array, active: jax.Array
    ) -> tuple[Any, jax.Array]: ...

    def repeat_rows(self, repeats: int) -> "StopCondition": ...

    def check(self, batch: int, vocab_size: int) -> None: ...


def _is_token(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _rows_of_sequences(sequences: Sequence, batch: int) -> list[list[list[int]]]:
    """Per-row lists of sequences from one shared list or one list per row."""
    per_row = any(
        not _is_token(item) for sequence in sequences for item in sequence
    ) or (len(sequences) > 0 and all(len(sequence) == 0 for sequence in sequences))
    if not per_row:
        return [[list(sequence) for sequence in sequences]] * batch
    if len(sequences) != batch:
        raise ValueError(
            f"stop_sequences given per row must have one list per row, B = {batch}; "
            f"got {len(sequences)}."
        )
    for row in sequences:
        for sequence in row:
            if isinstance(sequence, (str, bytes)) or not all(
                _is_token(t) for t in sequence
            ):
                raise TypeError(
                    "stop_sequences must hold token-id lists (integers); got "
                    f"{sequence!r}."
                )
    return [[list(sequence) for sequence in row] for row in sequences]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class StopSequences:
    r"""Token stop sequences: a row ends when its generated tokens end with one of its own.

    Row ``b`` with generated tokens :math:`y_1 \dots y_t` ends at step ``t``
    when, for one of its sequences :math:`s_1 \dots s_L`,
    :math:`(y_{t-L+1}, \dots, y_t) = (s_1, \dots, s_L)` with :math:`t \ge L`.

    Only generated tokens are matched: a sequence that begins in the prompt
    and ends in the generated tokens does not stop the row (as OpenAI matches
    stop strings on the completion only). The carry is each row's window of
    its last ``W`` generated tokens, ``NO_TOKEN`` before the first, so a
    step costs ``O(B S W)``.

    Attributes:
        sequences: ``int32 [B, S, W]``, row ``b``'s sequences right-aligned,
            ``NO_TOKEN`` (-1) on their left; a slot of only ``NO_TOKEN`` is
            empty. ``W``, the window, is the longest sequence a row may have.

    Examples:
        >>> import jax.numpy as jnp
        >>> stop = StopSequences.of([[2, 3], [1]], batch=2)
        >>> stop.sequences[0]
        Array([[ 2,  3],
               [-1,  1]], dtype=int32)
        >>> carry = stop.init(2)
        >>> active = jnp.array([True, True])
        >>> carry, ended = stop.update(carry, jnp.array([2, 0]), active)
        >>> carry, ended = stop.update(carry, jnp.array([3, 0]), active)
        >>> ended
        Array([ True, False], dtype=bool)
    """

    sequences: jax.Array

    @classmethod
    def of(
        cls,
        sequences: Sequence,
        batch: int,
        *,
        window: int | None = None,
        max_sequences: int | None = None,
    ) -> "StopSequences":
        """Builds the arrays from token-id lists.

        Args:
            sequences: one list of non-empty token-id lists shared by every
                row (``[[13, 13], [50256]]``), or one such list per row
                (``[[[13, 13]], [], [[7]]]``; a row may have none). A list
                whose items are all empty lists is per row.
            batch: ``B``, the rows.
            window: ``W``, the longest sequence allowed (a static shape);
                default the longest given.
            max_sequences: ``S``, the slots per row (a static shape); default
                the most any row has.

        Raises:
            ValueError: a sequence is empty or longer than ``window``, a row
                has more than ``max_sequences``, or the per-row list does not
                have ``B`` rows.
            TypeError: an item is not a token id.
        """
        _checks.check_count("batch", batch)
        _checks.check_count("window", window, optional=True)
        _checks.check_count("max_sequences", max_sequences, optional=True)
        rows = _rows_of_sequences(sequences, batch)
        lengths = [len(s) for row in rows for s in row]
        if 0 in lengths:
            raise ValueError("stop_sequences must be non-empty token-id lists; got [].")
        width = window or max(lengths, default=1)
        if lengths and max(lengths) > width:
            raise ValueError(
                f"stop_sequences: a stop sequence of {max(lengths)} tokens is longer "
                f"than the window of W = {width} tokens it is checked in."
            )
        slots = max_sequences or max((len(row) for row in rows), default=1) or 1
        if any(len(row) > slots for row in rows):
            raise ValueError(
                f"stop_sequences: a row has more than max_sequences = {slots} "
                "sequences."
            )
        array = np.full((batch, slots, width), NO_TOKEN, np.int32)
        for b, row in enumerate(rows):
            for s, sequence in enumerate(row):
                array[b, s, width - len(sequence) :] = sequence
        return cls(jnp.asarray(array))

    def init(self, batch: int) -> jax.Array:
        """``int32 [batch, W]``: the window of generated tokens, empty."""
        return jnp.full((batch, self.sequences.shape[-1]), NO_TOKEN, jnp.int32)

    def update(
        self, carry: jax.Array, tokens: jax.Array, active: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Appends each active row's token to its window; ``ended`` where a
        sequence now ends the window."""
        shifted = jnp.concatenate([carry[:, 1:], tokens[:, None]], axis=1)
        window = jnp.where(active[:, None], shifted, carry)
        given = self.sequences >= 0
        agrees = (window[:, None, :] == self.sequences) | ~given
        ended = jnp.any(jnp.all(agrees, axis=-1) & jnp.any(given, axis=-1), axis=-1)
        return window, active & ended

    def repeat_rows(self, repeats: int) -> "StopSequences":
        return StopSequences(jnp.repeat(self.sequences, repeats, axis=0))

    def check(self, batch: int, vocab_size: int) -> None:
        """Raises ValueError naming ``stop_sequences`` unless ``sequences`` is
        ``[batch, S, W]`` of ids in ``[0, vocab_size)`` (or ``NO_TOKEN`` on
        the left of each slot)."""
        shape = np.shape(self.sequences)
        if len(shape) != 3 or shape[0] != batch or 0 in shape:
            raise ValueError(
                f"stop_sequences must have shape [B, S, W] with B = {batch}; "
                f"got {shape}."
            )
        _checks.check_integer("stop_sequences", self.sequences)
        if _checks.is_traced(self.sequences):
            return
        array = np.asarray(self.sequences)
        _checks.check_in_range(
            "stop_sequences", array[array != NO_TOKEN], low=0, high=vocab_size - 1
        )
        given = array >= 0
        if np.any(given[..., :-1] & ~given[..., 1:]):
            raise ValueError(
                "stop_sequences must be right-aligned in their slots (NO_TOKEN = "
                f"{NO_TOKEN} only on the left)."
            )
