"""From token ids to text: :func:`detokenize` cuts each row at EOS and decodes it.

It needs only an object with a ``decode(ids) -> str`` method
(:class:`TokenDecoder`), so the decoders stay free of any tokenizer library.
"""

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
    eos_id: int | None = None,
    pad_id: int | None = None,
) -> str | list:
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
        raise TypeError(
            "tokenizer must have a decode(ids: list[int]) -> str "
            f"method; got {type(tokenizer).__name__}."
        )
    ids = np.asarray(ids)
    if ids.ndim == 0:
        raise ValueError(f"ids must have shape [..., N]; got shape {ids.shape}.")
    if ids.size:
        _checks.check_integer("ids", ids)
    if ids.ndim > 1:
        return [detokenize(row, tokenizer, eos_id=eos_id, pad_id=pad_id) for row in ids]
    row = ids.tolist()
    if eos_id is not None and eos_id in row:
        row = row[: row.index(eos_id)]
    if pad_id is not None:
        row = [i for i in row if i != pad_id]
    return tokenizer.decode(row)
