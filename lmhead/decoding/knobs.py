"""The sampling knobs, defined once: :class:`SamplingKnobs` (each knob's
default, range, dtype, per-row or per-token layout and neutral value), taken
by :func:`~lmhead.decoding.process_logits`, :func:`~lmhead.decoding.generate`,
:func:`~lmhead.decoding.beam_search`, the slots and the service. A new knob is
a new field here (``docs/decoding.md``)."""

import dataclasses
import math
from collections.abc import Mapping, Sequence
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
    high_open: bool = False,
    per_row: bool = False,
    per_token: bool = False,
    neutral: float,
) -> Any:
    """A traced knob's field: its range ``low..high`` (``low_open``,
    ``high_open``: that end excluded), its dtype, whether it may be ``[B]``
    (``per_row``), whether it holds one value per token, ``[V]`` or ``[B, V]``
    (``per_token``), and the ``neutral`` value at which it changes nothing."""
    spec = dict(
        dtype=dtype,
        low=low,
        high=high,
        low_open=low_open,
        high_open=high_open,
        per_row=per_row or per_token,
        per_token=per_token,
        neutral=neutral,
    )
    return dataclasses.field(default=default, metadata=spec)


_STATIC = dict(static=True)
# Any finite real: (-inf, inf) with both ends open also refuses NaN.
_FINITE = dict(low=-math.inf, high=math.inf, low_open=True, high_open=True)
_POSITIVE = dict(low=0.0, high=math.inf, low_open=True, high_open=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class SamplingKnobs:
    """What turns next-token logits into the distribution a token is drawn from.

    The traced knobs (the first ten) are arrays inside the compiled loop:
    changing their values does not recompile. A *per-row* knob is a scalar or
    one value per row, shape ``[B]``, so one batch serves requests with
    different settings; ``logit_bias`` and ``stop_tokens`` are one value
    per token, ``[V]`` shared by the rows or ``[B, V]``. None turns a processor off, which is
    static (switching it on recompiles). The last two knobs are static: part
    of the compiled program, one value for the batch. The class is a pytree
    whose leaves are the traced knobs that are not None.

    Attributes:
        temperature: finite ``T >= 0``, per row, default 1 (neutral); 0 is
            greedy.
        top_k: integer ``k >= 0``, per row; 0 keeps every token (neutral).
            Default None: off.
        top_p: ``0 < p <= 1``, per row; 1 keeps every token (neutral).
            Default None: off.
        min_p: ``0 <= m <= 1``, per row; 0 keeps every token (neutral).
            Default None: off.
        repetition_penalty: finite ``theta > 0``, per row; 1 changes nothing
            (neutral). Default None: off. Reads the token history.
        min_new_tokens: integer ``>= 0``, per row: EOS is removed before
            that many tokens, and no stop condition (a stop string or
            sequence) ends the row before it holds that many (vLLM's
            ``min_tokens``). Default 0 (neutral).
        presence_penalty: any finite real, per row, subtracted from the
            logit of every token generated at least once; 0 is neutral.
            Default None: off. Reads the generated tokens' counts.
        frequency_penalty: any finite real, per row, subtracted once per
            time a token was generated; 0 is neutral. Default None: off.
            Reads the counts.
        logit_bias: finite, ``[V]`` added to every row's logits or
            ``[B, V]`` one per row; 0 is neutral. Default None: off.
        stop_tokens: integer 0 or 1, ``[V]`` or ``[B, V]`` one per row; 1
            marks a token that ends its row when drawn (it is emitted,
            finish reason ``FINISHED_STOP``) and that, like EOS, cannot be
            drawn before ``min_new_tokens`` (vLLM's ``stop_token_ids``);
            0 is neutral. Default None: off. Read by the decoding step
            (:func:`~lmhead.decoding.step.decode_step`: ``generate`` and the
            slots); ``process_logits`` does not end rows, and beam search
            refuses it as every active knob.
        no_repeat_ngram_size: static integer ``n >= 1``, or None (off).
            Reads the token history.
        suppress_tokens: static ids in ``[0, V)`` never produced, or None;
            a tuple where the knobs are an argument of a jitted function
            (static fields must be hashable; :meth:`as_arrays` makes one).

    Examples:
        >>> knobs = SamplingKnobs(temperature=0.8, top_k=40)
        >>> knobs.active()
        ('temperature', 'top_k')
        >>> knobs.as_arrays().repeat_rows(2).top_k
        Array(40, dtype=int32)
    """

    temperature: jax.typing.ArrayLike = _knob(
        1.0, np.float32, low=0.0, high=math.inf, high_open=True, per_row=True,
        neutral=1.0,
    )  # fmt: skip
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
        None, np.float32, **_POSITIVE, per_row=True, neutral=1.0
    )
    min_new_tokens: jax.typing.ArrayLike = _knob(
        0, np.int32, low=0, per_row=True, neutral=0
    )
    presence_penalty: jax.typing.ArrayLike | None = _knob(
        None, np.float32, **_FINITE, per_row=True, neutral=0.0
    )
    frequency_penalty: jax.typing.ArrayLike | None = _knob(
        None, np.float32, **_FINITE, per_row=True, neutral=0.0
    )
    logit_bias: jax.typing.ArrayLike | None = _knob(
        None, np.float32, **_FINITE, per_token=True, neutral=0.0
    )
    stop_tokens: jax.typing.ArrayLike | None = _knob(
        None, np.int32, low=0, high=1, per_token=True, neutral=0
    )
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

    def active(self) -> tuple[str, ...]:
        """The knobs that may change the distribution: not None and, where
        concrete, not every value neutral (a traced value counts as active)."""
        names = []
        for name in KNOBS:
            value, spec = getattr(self, name), knob_spec(name)
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

    @property
    def reads_counts(self) -> bool:
        """True when a processor reads how often each token was generated
        (``presence_penalty`` or ``frequency_penalty`` is not None)."""
        return self.presence_penalty is not None or self.frequency_penalty is not None

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
                ``logit_bias``'s is neither ``[V]`` nor ``[B, V]``, or a value
                is out of its range (or not finite where it must be).
            TypeError: an integer knob is not an integer.
        """
        for name in KNOBS:
            if knob_spec(name).get("per_token"):
                check_per_token(name, getattr(self, name), rows, vocab_size)
            elif _per_row(name):
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
            else jnp.asarray(getattr(self, name), knob_spec(name)["dtype"])
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
        rows ``b * repeats ... b * repeats + repeats - 1``; scalars and a
        shared ``[V]`` ``logit_bias`` stay."""
        values = {}
        for name in TRACED_KNOBS:
            value = getattr(self, name)
            # The rank a per-row value has: [B], or [B, V] for a per-token one.
            rank = 2 if knob_spec(name).get("per_token") else 1
            if value is not None and jnp.ndim(value) == rank:
                value = jnp.repeat(value, repeats, axis=0)
            values[name] = value
        return dataclasses.replace(self, **values)


KNOBS = tuple(field.name for field in dataclasses.fields(SamplingKnobs))
TRACED_KNOBS = tuple(
    field.name
    for field in dataclasses.fields(SamplingKnobs)
    if "dtype" in field.metadata
)


def knob_spec(name: str) -> Mapping[str, Any]:
    """The metadata of knob ``name``'s field: ``dtype``, the range,
    ``per_row``/``per_token`` and ``neutral`` (see ``_knob``).

    Examples:
        >>> knob_spec("top_k")["neutral"], knob_spec("logit_bias").get("per_token")
        (0, True)
    """
    return SamplingKnobs.__dataclass_fields__[name].metadata


def _per_row(name: str) -> bool:
    return bool(knob_spec(name).get("per_row"))


def neutral_value(name: str) -> Any:
    """The value of a traced knob that changes nothing (``top_k`` 0, ...)."""
    return knob_spec(name)["neutral"]


def knob_range(name: str, within: tuple[float, float] | None = None) -> dict[str, Any]:
    """The range of the traced knob ``name``, as ``low``, ``high``,
    ``low_open`` and ``high_open`` (:func:`check_knob`'s): its field's, an
    integer knob's upper end at most its dtype's largest value, narrowed to
    ``within = (low, high)`` (both ends included) where that is narrower: a
    caller's policy on top of the knob's own range, as the service's
    OpenAI ranges (``temperature`` at most 2, the penalties in ``[-2, 2]``).

    Examples:
        >>> knob_range("temperature", within=(0.0, 2.0))
        {'low': 0.0, 'high': 2.0, 'low_open': False, 'high_open': False}
        >>> knob_range("top_k")["high"]
        2147483647
    """
    spec = knob_spec(name)
    bounds = {bound: spec[bound] for bound in ("low", "high", "low_open", "high_open")}
    if np.issubdtype(spec["dtype"], np.integer):
        largest = int(np.iinfo(spec["dtype"]).max)
        if bounds["high"] is None or bounds["high"] > largest:
            bounds.update(high=largest, high_open=False)
    if within is not None:
        low, high = within
        if low > bounds["low"]:
            bounds.update(low=low, low_open=False)
        if bounds["high"] is None or high < bounds["high"]:
            bounds.update(high=high, high_open=False)
    return bounds


def check_knob(
    name: str,
    value: jax.typing.ArrayLike | None,
    *,
    within: tuple[float, float] | None = None,
) -> None:
    """Raises unless ``value`` (None passes) suits the traced knob ``name``.

    An integer knob must have an integer dtype (TypeError); a concrete value
    must lie in the knob's range, :func:`knob_range` (``within`` narrows
    it), else ValueError names the knob and the range; traced values are
    not checked. Every check of a knob's value, the service's and the
    command line's included, is this one.

    Examples:
        >>> check_knob("top_p", 1.5)
        Traceback (most recent call last):
        ...
        ValueError: top_p must be in (0, 1]; got 1.5.
        >>> check_knob("presence_penalty", 3.0, within=(-2.0, 2.0))
        Traceback (most recent call last):
        ...
        ValueError: presence_penalty must be in [-2, 2]; got 3.0.
    """
    if value is None:
        return
    if np.issubdtype(knob_spec(name)["dtype"], np.integer):
        _checks.check_integer(name, value)
    _checks.check_in_range(name, value, **knob_range(name, within))


def check_per_row(
    name: str, value: jax.typing.ArrayLike | None, rows: tuple[int, ...]
) -> None:
    """Raises ValueError unless the knob is a scalar or has shape ``rows``."""
    if np.shape(value) not in ((), tuple(rows)):
        raise ValueError(
            f"{name} must be a scalar or have one value per row, shape "
            f"{tuple(rows)}; got shape {np.shape(value)}."
        )


def check_per_token(
    name: str, value: jax.typing.ArrayLike | None, rows: int, vocab_size: int
) -> None:
    """Raises ValueError unless the per-token knob (None passes) has shape
    ``[V]`` or ``[B, V]``, ``B = rows``, ``V = vocab_size``."""
    if value is not None and np.shape(value) not in (
        (vocab_size,),
        (rows, vocab_size),
    ):
        raise ValueError(
            f"{name} must have shape [V] = ({vocab_size},) or [B, V] = "
            f"({rows}, {vocab_size}); got shape {np.shape(value)}."
        )


def logit_bias_vector(mapping: Mapping[int, float], vocab_size: int) -> np.ndarray:
    r"""The ``logit_bias`` knob from OpenAI's ``{token id: bias}`` map.

    .. math::
        b_i = \text{mapping}[i] \text{ if } i \in \text{mapping}
        \text{ else } 0

    Args:
        mapping: integer token ids in ``[0, V)`` to finite real biases (an
            empty map gives zeros). The caller turns JSON's string keys
            into integers.
        vocab_size: ``V >= 1``.

    Returns:
        ``float32 [V]``.

    Raises:
        TypeError: ``mapping`` is not a mapping, or an id is not an integer
            or a bias not a real number (naming ``logit_bias`` and the id).
        ValueError: an id is outside ``[0, V)`` or a bias is not finite.

    Examples:
        >>> logit_bias_vector({2: -100.0, 0: 1.5}, vocab_size=4)
        array([   1.5,    0. , -100. ,    0. ], dtype=float32)
    """
    _checks.check_count("vocab_size", vocab_size)
    if not isinstance(mapping, Mapping):
        raise TypeError(
            "logit_bias must be a mapping from token ids to biases; got "
            f"{type(mapping).__name__}."
        )
    bias = np.zeros(vocab_size, np.float32)
    for token_id, value in mapping.items():
        if isinstance(token_id, (bool, np.bool_)) or not isinstance(
            token_id, (int, np.integer)
        ):
            raise TypeError(
                f"logit_bias: token ids must be integers; got {token_id!r}."
            )
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"logit_bias: token id {token_id} is outside [0, V) = "
                f"[0, {vocab_size})."
            )
        if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)
        ):
            raise TypeError(
                f"logit_bias: the bias of token id {token_id} must be a real "
                f"number; got {value!r}."
            )
        if not math.isfinite(value):
            raise ValueError(
                f"logit_bias: the bias of token id {token_id} must be finite; "
                f"got {value}."
            )
        bias[token_id] = value
    return bias


def stop_token_mask(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    r"""The ``stop_tokens`` knob from a list of token ids.

    .. math::
        m_i = 1 \text{ if } i \in \text{ids} \text{ else } 0

    Args:
        ids: integer token ids in ``[0, V)`` (repeats allowed; an empty list
            gives zeros).
        vocab_size: ``V >= 1``.

    Returns:
        ``int32 [V]``.

    Raises:
        ValueError: an id is not an integer in ``[0, V)`` (naming
            ``stop_tokens``).

    Examples:
        >>> stop_token_mask([3, 0], vocab_size=5)
        array([1, 0, 0, 1, 0], dtype=int32)
    """
    _checks.check_count("vocab_size", vocab_size)
    mask = np.zeros(vocab_size, np.int32)
    for token_id in ids:
        _loop.check_token_id("stop_tokens", token_id, vocab_size)
        mask[token_id] = 1
    return mask
