"""From token ids to text: :func:`detokenize` cuts each row at EOS, decodes it
with any ``decode(ids) -> str`` (:class:`TokenDecoder`), and cuts the text at a
stop string (:func:`find_stop`, :func:`trim_at_stop`: exact for every
tokenizer, where the loop's :class:`~lmhead.decoding.stop_strings.StopStrings`
matches bytes).
"""

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from lmhead import _checks


class TokenDecoder(Protocol):
    """Anything with ``decode(ids: list[int]) -> str``.

    ``lmhead.lm.data``'s tokenizers and ``tokenizers.Tokenizer`` both qualify.
    """

    def decode(self, ids: list[int]) -> str: ...


def detokenize(
    ids: npt.ArrayLike,
    tokenizer: TokenDecoder,
    *,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int | None = None,
    stop: str | Sequence[str] | None = None,
) -> str | list:
    """Token ids to text: each row is cut before its first EOS, then decoded,
    then cut before its first stop string (:func:`trim_at_stop`).

    Args:
        ids: ``int [..., N]``; a single row gives a string, ``[B, N]`` a list
            of strings, ``[B, n, N]`` (beam search) a list of lists.
        tokenizer: a :class:`TokenDecoder`.
        eos_id: an id, or ids (as :func:`~lmhead.decoding.generate` takes
            them): the row ends before the first of them (EOS is not text).
            None: no cut.
        pad_id: every ``pad_id`` is dropped. None: none is, which is right for
            rows cut at EOS and for a ``pad_id`` that is also a real token.
        stop: a stop string or a list of them, shared by every row (for one
            list per row, call :func:`trim_at_stop` on each row's text).
            None: no cut.

    Returns:
        ``str``, or nested lists of ``str`` following the leading axes.

    Examples:
        >>> class Letters:
        ...     def decode(self, ids):
        ...         return "".join("abcd"[i] for i in ids)
        >>> detokenize([[0, 1, 3, 2], [2, 2, 2, 2]], Letters(), eos_id=3)
        ['ab', 'cccc']
        >>> detokenize([[0, 1, 3, 2], [2, 2, 2, 2]], Letters(), stop=["bd", "cc"])
        ['a', '']
    """
    if not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(
            "tokenizer must have a decode(ids: list[int]) -> str "
            f"method; got {type(tokenizer).__name__}."
        )
    eos = _ids("eos_id", eos_id)
    ids = np.asarray(ids)
    if ids.ndim == 0:
        raise ValueError(f"ids must have shape [..., N]; got shape {ids.shape}.")
    if ids.size:
        _checks.check_integer("ids", ids)
    if ids.ndim > 1:
        return [
            detokenize(row, tokenizer, eos_id=eos, pad_id=pad_id, stop=stop)
            for row in ids
        ]
    row = ids.tolist()
    row = row[: next((i for i, token in enumerate(row) if token in eos), len(row))]
    if pad_id is not None:
        row = [i for i in row if i != pad_id]
    text = tokenizer.decode(row)
    return text if stop is None else trim_at_stop(text, stop)


def _ids(name: str, value: int | Sequence[int] | None) -> tuple[int, ...]:
    """``value`` (None, an id or a collection of ids) as a tuple of ids."""
    integer = lambda i: isinstance(i, (int, np.integer)) and not isinstance(i, bool)
    if value is None:
        return ()
    if integer(value):
        return (int(value),)
    if isinstance(value, str) or not isinstance(value, Iterable):
        ids = [value]
    else:
        ids = list(value)
    if not all(map(integer, ids)):
        raise TypeError(f"{name} must be None, an integer id or ids; got {value!r}.")
    return tuple(int(i) for i in ids)


def find_stop(
    text: str, stop: str | Sequence[str], after: int = 0
) -> tuple[int, int] | None:
    """``(start, end)`` of the stop string that ``text`` completes first, or None.

    "First" is by end (the one a token-by-token loop meets first, as
    :class:`~lmhead.decoding.stop_strings.StopStrings` does); of several that
    end at the same place, the longest. Only stop strings that end after the
    first ``after`` characters count (``end > after``): a caller that has
    already searched that text (the service, each time a row grows) finds a
    new one only. The order of ``stop`` does not matter.

    Args:
        text: the generated text (not the prompt: a stop string is matched in
            generated text only).
        stop: a non-empty string, or a list of them.
        after: ``>= 0``, the characters of ``text`` already searched.

    Examples:
        >>> find_stop("xabcd", ["bcd", "ab", "b"])
        (1, 3)
        >>> find_stop("xabcd", ["bcd", "ab", "b"], after=3), find_stop("xabcd", "z")
        ((2, 5), None)
    """
    strings = [stop] if isinstance(stop, str) else list(stop)
    for string in strings:
        if not isinstance(string, str):
            raise TypeError(f"stop strings must be str; got {type(string).__name__}.")
        if not string:
            raise ValueError("stop strings must be non-empty; got ''.")
    found = None
    for string in strings:
        start = text.find(string, max(0, after - len(string) + 1))
        if start < 0:
            continue
        span = (start, start + len(string))
        if found is None or (span[1], span[0]) < (found[1], found[0]):
            found = span
    return found


def trim_at_stop(
    text: str, stop: str | Sequence[str], *, after: int = 0, include_stop: bool = False
) -> str:
    """``text`` up to the stop string it completes first (:func:`find_stop`,
    of those ending after the first ``after`` characters), which is not
    returned, nor anything after it (the OpenAI API's rule); through it with
    ``include_stop`` (vLLM's ``include_stop_str_in_output``); the whole
    ``text`` when it holds none.

    This is the text layer of a row the loop ended at a stop string
    (:class:`~lmhead.decoding.stop_strings.StopStrings`): the loop ends the
    row at the token that completes the string, and this cuts that token's
    text where the string starts. ``after`` is the text of the tokens
    before ``min_new_tokens``, whose stop strings did not end the row.

    Examples:
        >>> trim_at_stop("to be\\n\\nor not", ["\\n\\n", "or"])
        'to be'
        >>> trim_at_stop("ab, cd, ef", ",", after=3, include_stop=True)
        'ab, cd,'
    """
    found = find_stop(text, stop, after)
    if found is None:
        return text
    return text[: found[1] if include_stop else found[0]]
