"""The sampling knobs, defined once: :class:`SamplingKnobs`.

:func:`~lmhead.decoding.process_logits`, :func:`~lmhead.decoding.generate`,
:func:`~lmhead.decoding.beam_search` and the service all take this one
definition: a knob's name, its default, the range its values must lie in,
its dtype inside the loop, whether it may take one value per row, and the
value at which it changes nothing are written here and nowhere else. The
functions also take the knobs as keywords (``generate(..., temperature=0.8,
top_k=40)``), which build a :class:`SamplingKnobs`.

A new knob (a stop sequence, a per-row key, a logit bias) is a new field
here with its metadata; :meth:`SamplingKnobs.check`, the per-row rule, the
service's parsing and batching then cover it.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks
from lmhead.decoding import _loop


def _knob(
    default: Any,
    dtype: Any,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    per_row: bool = False,
    neutral: float,
) -> Any:
    """A traced knob's field: its range ``low..high`` (``low_open``: ``low``
    excluded), its dtype, whether it may be ``[B]``, and the ``neutral``
    value at which it changes nothing."""
    spec = dict(
        dtype=dtype,
        low=low,
        high=high,
        low_open=low_open,
        per_row=per_row,
        neutral=neutral,
    )
    return dataclasses.field(default=default, metadata=spec)


_STATIC = dict(static=True)
# What a padding row of a stacked batch holds where it is not neutral: it is
# greedy, so that it draws nothing.
_PADDING = {"temperature": 0.0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class SamplingKnobs:
    """What turns next-token logits into the distribution a token is drawn from.

    The traced knobs (the first six) are arrays inside the compiled loop:
    changing their values does not recompile. A *per-row* knob is a scalar or
    one value per row, shape ``[B]``, so one batch serves requests with
    different settings; the others are one scalar for the batch. None turns a
    processor off, which is static (switching it on recompiles). The last two
    knobs are static: part of the compiled program. The class is a pytree
    whose leaves are the traced knobs that are not None.

    Attributes:
        temperature: ``T >= 0``, per row, default 1 (neutral); 0 is greedy.
        top_k: integer ``k >= 0``, per row; 0 keeps every token (neutral).
            Default None: off.
        top_p: ``0 < p <= 1``, per row; 1 keeps every token (neutral).
            Default None: off.
        min_p: ``0 <= m <= 1``, per row; 0 keeps every token (neutral).
            Default None: off.
        repetition_penalty: ``theta > 0``, a scalar; 1 changes nothing
            (neutral). Default None: off. Reads the token history.
        min_new_tokens: integer ``>= 0``, a scalar: EOS is removed before
            that many tokens. Default 0 (neutral).
        no_repeat_ngram_size: static integer ``n >= 1``, or None (off).
            Reads the token history.
        suppress_tokens: static ids in ``[0, V)`` never produced, or None;
            a tuple where the knobs are an argument of a jitted function
            (static fields must be hashable; :meth:`as_arrays` makes one).

    Examples:
        >>> knobs = SamplingKnobs(temperature=0.8, top_k=40)
        >>> knobs.active()
        ('temperature', 'top_k')
        >>> SamplingKnobs.stack([knobs, SamplingKnobs(top_k=2)], size=3).top_k
        array([40,  2,  0], dtype=int32)
    """

    temperature: jax.typing.ArrayLike = _knob(
        1.0, np.float32, low=0.0, per_row=True, neutral=1.0
    )
    top_k: jax.typing.ArrayLike | None = _knob(
        None, np.int32, low=0, per_row=True, neutral=0
    )
    top_p: jax.typing.ArrayLike | None = _knob(
        None, np.float32, low=0.0, high=1.0, low_open=True, per_row=True, neutral=1.0
    )
    min_p: jax.typing.ArrayLike | None = _knob(
        None, np.float32, low=0.0, high=1.0, per_row=True, neutral=0.0
    )
    repetition_penalty: jax.typing.ArrayLike | None = _knob(
        None, np.float32, low=0.0, low_open=True, neutral=1.0
    )
    min_new_tokens: jax.typing.ArrayLike = _knob(0, np.int32, low=0, neutral=0)
    no_repeat_ngram_size: int | None = dataclasses.field(default=None, metadata=_STATIC)
    suppress_tokens: Sequence[int] | None = dataclasses.field(
        default=None, metadata=_STATIC
    )

    @classmethod
    def of(cls, knobs: "SamplingKnobs | None", **values: Any) -> "SamplingKnobs":
        """``knobs``, or the knobs given as keywords (not both).

        Raises:
            TypeError: both are given, or a keyword names no knob.
        """
        unknown = [name for name in values if name not in KNOBS]
        if unknown:
            raise TypeError(
                f"{unknown[0]!r} is not a sampling knob; the knobs are "
                f"{', '.join(KNOBS)}."
            )
        if knobs is None:
            return cls(**values)
        if not isinstance(knobs, cls):
            raise TypeError(
                f"knobs must be a SamplingKnobs or None; got {type(knobs).__name__}."
            )
        if values:
            raise TypeError(
                "give the sampling knobs either as knobs= or as keywords, not "
                f"both; got knobs and {', '.join(values)}."
            )
        return knobs

    @classmethod
    def stack(cls, rows: Sequence["SamplingKnobs"], size: int) -> "SamplingKnobs":
        """One batch's knobs from each row's scalar knobs.

        Per-row knobs become ``[size]`` arrays of their dtype; the rows past
        ``len(rows)`` (padding) are greedy with every other knob neutral. A
        knob that is one value per batch must be the same in every row.

        Args:
            rows: ``R <= size`` knobs of scalars, one per row.
            size: ``B``, the batch's rows.

        Raises:
            ValueError: a per-batch knob differs between rows, or a per-row
                knob is None in some rows only.
        """
        first, stacked = rows[0], {}
        for name in KNOBS:
            spec = _field_spec(name)
            values = [getattr(row, name) for row in rows]
            if spec.get("per_row"):
                if all(value is None for value in values):
                    stacked[name] = None
                    continue
                if any(value is None for value in values):
                    raise ValueError(f"{name} must be set in every row or in none.")
                pad = _PADDING.get(name, spec["neutral"])
                values += [pad] * (size - len(rows))
                stacked[name] = np.asarray(values, spec["dtype"])
            elif any(not _equal_values(value, values[0]) for value in values):
                raise ValueError(
                    f"{name} must be one value for the whole batch; got {values}."
                )
            else:
                value = getattr(first, name)
                dtype = spec.get("dtype")
                stacked[name] = (
                    value if value is None or dtype is None else dtype(value)
                )
        return cls(**stacked)

    def active(self) -> tuple[str, ...]:
        """The knobs that may change the distribution: not None and, where
        concrete, not every value neutral (a traced value counts as active)."""
        names = []
        for name in KNOBS:
            value, spec = getattr(self, name), _field_spec(name)
            if value is None or (name == "suppress_tokens" and len(value) == 0):
                continue
            if (
                "neutral" in spec
                and not _checks.is_traced(value)
                and np.all(np.asarray(value) == spec["neutral"])
            ):
                continue
            names.append(name)
        return tuple(names)

    def shared(self) -> tuple:
        """The values that rows of one batch must share (the knobs that are
        not per row): requests with equal ``shared()`` can be batched."""
        return tuple(getattr(self, name) for name in KNOBS if not _per_row(name))

    @property
    def reads_history(self) -> bool:
        """True when a processor reads the tokens so far."""
        return self.repetition_penalty is not None or (
            self.no_repeat_ngram_size is not None
        )

    def check(self, rows: int, vocab_size: int) -> None:
        """Checks shapes always and values when concrete, for ``B = rows``.

        Raises:
            ValueError: a per-row knob's shape is neither ``[]`` nor ``[B]``,
                or a value is out of its range.
            TypeError: an integer knob is not an integer.
        """
        for name in KNOBS:
            if _per_row(name):
                check_per_row(name, getattr(self, name), (rows,))
        for name in TRACED_KNOBS:
            check_knob(name, getattr(self, name))
        if self.no_repeat_ngram_size is not None:
            _checks.check_count("no_repeat_ngram_size", self.no_repeat_ngram_size)
        for token_id in self.suppress_tokens or ():
            _loop.check_token_id("suppress_tokens", token_id, vocab_size)

    def as_arrays(self) -> "SamplingKnobs":
        """The traced knobs as arrays of their dtype (the loop's types), the
        static ones as Python ints (hashable)."""
        values = {
            name: None
            if getattr(self, name) is None
            else jnp.asarray(getattr(self, name), _field_spec(name)["dtype"])
            for name in TRACED_KNOBS
        }
        ngram, suppress = self.no_repeat_ngram_size, self.suppress_tokens
        return SamplingKnobs(
            **values,
            no_repeat_ngram_size=None if ngram is None else int(ngram),
            suppress_tokens=None
            if suppress is None
            else tuple(int(i) for i in suppress),
        )

    def repeat_rows(self, repeats: int) -> "SamplingKnobs":
        """Each per-row value repeated ``repeats`` times, row ``b`` becoming
        rows ``b * repeats ... b * repeats + repeats - 1``; scalars stay."""
        repeat = lambda x: jnp.repeat(x, repeats, axis=0) if jnp.ndim(x) else x
        return jax.tree.map(repeat, self)


KNOBS = tuple(field.name for field in dataclasses.fields(SamplingKnobs))
TRACED_KNOBS = tuple(
    field.name
    for field in dataclasses.fields(SamplingKnobs)
    if "dtype" in field.metadata
)


def _field_spec(name: str) -> dict:
    return SamplingKnobs.__dataclass_fields__[name].metadata


def _per_row(name: str) -> bool:
    return bool(_field_spec(name).get("per_row"))


def _equal_values(a: Any, b: Any) -> bool:
    return (a is None) == (b is None) and (a is None or np.array_equal(a, b))


def knob_range(name: str) -> dict:
    """``low``, ``high`` (None: unbounded) and ``low_open`` of a traced knob."""
    spec = _field_spec(name)
    return dict(low=spec["low"], high=spec["high"], low_open=spec["low_open"])


def is_integer_knob(name: str) -> bool:
    """True for a traced knob whose values are integers (``top_k``, ...)."""
    return np.issubdtype(_field_spec(name)["dtype"], np.integer)


def neutral_value(name: str) -> Any:
    """The value of a traced knob that changes nothing (``top_k`` 0, ...)."""
    return _field_spec(name)["neutral"]


def check_knob(name: str, value: jax.typing.ArrayLike | None) -> None:
    """Raises unless ``value`` (None passes) suits the traced knob ``name``.

    An integer knob must have an integer dtype (TypeError); a concrete value
    must lie in the knob's range (ValueError); traced values are not checked.

    Examples:
        >>> check_knob("top_p", 1.5)
        Traceback (most recent call last):
        ...
        ValueError: top_p must be in (0, 1]; got 1.5.
    """
    if value is None:
        return
    if is_integer_knob(name):
        _checks.check_integer(name, value)
    _checks.check_in_range(name, value, **knob_range(name))


def check_per_row(
    name: str, value: jax.typing.ArrayLike | None, rows: tuple[int, ...]
) -> None:
    """Raises ValueError unless the knob is a scalar or has shape ``rows``."""
    if np.shape(value) not in ((), tuple(rows)):
        raise ValueError(
            f"{name} must be a scalar or have one value per row, shape "
            f"{tuple(rows)}; got shape {np.shape(value)}."
        )
