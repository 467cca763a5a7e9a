"""The experiment's two tokenizers, saving and loading them, and choosing one
by ``config.data.tokenizer``.

:class:`CharTokenizer` has one token per character (the sorted distinct
characters of the whole text, so that every split encodes);
:class:`BPETokenizer` is byte-level BPE from the ``tokenizers`` library,
trained on training text only. With ``config.data.end_of_text`` both give
GPT-2's ``<|endoftext|>`` (:data:`END_OF_TEXT`) the last id, and its literal
encodes to that one id (docs/training.md, "The end-of-text token"). Neither
has a padding token; :func:`text_length` counts the characters that bits per
character divide by, and :func:`token_bytes` gives each token's bytes (what
stop strings and constraints are matched on).
"""

import json
from collections.abc import Iterator

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from lmhead.decoding.stop_strings import token_bytes_from_decode

# GPT-2's end-of-text token, placed between (after each of) the corpus's works.
END_OF_TEXT = "<|endoftext|>"


class CharTokenizer:
    """One token per character; id ``i`` is the ``i``-th sorted character.

    With ``eos_token`` (:data:`END_OF_TEXT`), that token is one more id after
    the characters, ``eos_id = len(chars)``: the literal ``<|endoftext|>``
    in a text is that one token, never its 13 characters (whose ids, if the
    text has them, stand for themselves elsewhere), as GPT-2's tokenizer
    reads it. Without (``None``), ``eos_id`` is ``None``. Encoding a
    character outside the vocabulary raises ``ValueError``.

    Examples:
        >>> tok = CharTokenizer.train("hello world")
        >>> tok.vocab_size, tok.encode("hello"), tok.eos_id
        (8, [3, 2, 4, 4, 5], None)
        >>> tok = CharTokenizer.train("hello world", END_OF_TEXT)
        >>> tok.vocab_size, tok.encode("he<|endoftext|>"), tok.eos_id
        (9, [3, 2, 8], 8)
        >>> tok.decode([3, 2, 8])
        'he<|endoftext|>'
    """

    kind = "char"

    def __init__(self, chars: str, eos_token: str | None = None):
        if not chars or len(set(chars)) != len(chars):
            raise ValueError("chars must be non-empty and without repeats.")
        if eos_token not in (None, END_OF_TEXT):
            raise ValueError(
                f"eos_token must be None or {END_OF_TEXT!r}; got {eos_token!r}."
            )
        self.chars = chars
        self.eos_token = eos_token
        self.eos_id = None if eos_token is None else len(chars)
        self._pieces = list(chars) + ([] if eos_token is None else [eos_token])
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.int64)
        self._order = np.argsort(self._codepoints)

    @classmethod
    def train(cls, text: str, eos_token: str | None = None) -> "CharTokenizer":
        """The sorted distinct characters of ``text`` (less the
        ``eos_token`` literals it holds), with ``eos_token`` after them."""
        if eos_token is not None:
            text = text.replace(eos_token, "")
        return cls("".join(sorted(set(text))), eos_token)

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def encode_array(self, text: str) -> np.ndarray:
        """Encodes ``text`` into an int32 array, vectorised over characters."""
        if self.eos_token is None or self.eos_token not in text:
            return self._encode_chars(text)
        parts = text.split(self.eos_token)
        eos = np.array([self.eos_id], np.int32)
        pieces = [self._encode_chars(parts[0])]
        for part in parts[1:]:
            pieces += [eos, self._encode_chars(part)]
        return np.concatenate(pieces)

    def _encode_chars(self, text: str) -> np.ndarray:
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        sorted_codepoints = self._codepoints[self._order]
        where = np.searchsorted(sorted_codepoints, codepoints)
        where = np.minimum(where, len(sorted_codepoints) - 1)
        unknown = sorted_codepoints[where] != codepoints
        if unknown.any():
            bad = sorted({chr(c) for c in codepoints[unknown][:20]})
            raise ValueError(f"Characters outside the vocabulary: {bad!r}.")
        return self._order[where].astype(np.int32)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids) -> str:
        return "".join(self._pieces[i] for i in np.asarray(ids).reshape(-1))

    def to_json(self) -> str:
        """What :meth:`save` writes: equal strings, equal tokenizers (one
        without ``eos_token`` writes what it always has)."""
        saved = {"kind": self.kind, "chars": self.chars}
        if self.eos_token is not None:
            saved["eos_token"] = self.eos_token
        return json.dumps(saved)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())


class BPETokenizer:
    """Byte-level BPE from the ``tokenizers`` library.

    Text is pre-tokenized GPT-2 style on bytes (no prefix space), so every
    string round-trips. Training and encoding go line by line (each line keeps
    its newline), so no token spans a line break. A tokenizer with a
    post-processor -- Hugging Face's GPT-2 files, whose ``ByteLevel`` one adds
    no token, as ``gpt2_import`` writes them -- was not trained here and
    encodes each text whole, as GPT-2 does (``"\\n\\n\\n"`` before a word is
    GPT-2's tokens ``"\\n\\n"`` and ``"\\n"``, not three ``"\\n"`` of three
    lines); one trained here has none. The
    end-of-text token is the ``tokenizers`` special token :data:`END_OF_TEXT`
    when the tokenizer has it (a trained one with ``eos_token``, or GPT-2's own
    ``tokenizer.json``): ``eos_id`` is its id, else ``None``. A trained one
    learns its merges from the text between the literals, and gets the token
    last, after ``vocab_size - 1`` learned ones.

    Examples:
        >>> tok = BPETokenizer.train("the cat sat on the mat\\n" * 50, 270)
        >>> tok.vocab_size, tok.eos_id  # at most the size asked for: the text runs out of pairs
        (268, None)
        >>> tok.decode(tok.encode("the bat")) == "the bat"
        True
        >>> tok = BPETokenizer.train("the cat<|endoftext|>the mat\\n" * 50, 270, END_OF_TEXT)
        >>> tok.eos_id == tok.vocab_size - 1, tok.encode("<|endoftext|>") == [tok.eos_id]
        (True, True)
    """

    kind = "bpe"

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self.tokenizer = tokenizer
        special = {
            t.content: i
            for i, t in tokenizer.get_added_tokens_decoder().items()
            if t.special
        }
        self.eos_id = special.get(END_OF_TEXT)
        self.eos_token = None if self.eos_id is None else END_OF_TEXT
        self.by_lines = tokenizer.post_processor is None

    @classmethod
    def train(
        cls, text: str, vocab_size: int, eos_token: str | None = None
    ) -> "BPETokenizer":
        """Byte-level BPE of at most ``vocab_size`` tokens learned on
        ``text``; with ``eos_token`` (:data:`END_OF_TEXT`), ``vocab_size -
        1`` learned on the text between its literals, and it last."""
        if eos_token not in (None, END_OF_TEXT):
            raise ValueError(
                f"eos_token must be None or {END_OF_TEXT!r}; got {eos_token!r}."
            )
        tokenizer = tokenizers.Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - (eos_token is not None),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator(_line_batches(text, eos_token), trainer=trainer)
        if eos_token is not None:
            tokenizer.add_special_tokens([eos_token])
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_array(self, text: str) -> np.ndarray:
        if not self.by_lines:
            return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int32)
        encodings = self.tokenizer.encode_batch(text.splitlines(keepends=True))
        ids = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
        return np.concatenate(ids) if ids else np.zeros([0], np.int32)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids) -> str:
        """The text of ``ids``; the end-of-text token gives its literal, so
        that decoding inverts encoding (not skipped, as ``tokenizers`` would)."""
        ids = np.asarray(ids).reshape(-1).tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        """The ``tokenizers`` JSON: equal strings, equal tokenizers."""
        return self.tokenizer.to_str()

    def save(self, path: str) -> None:
        self.tokenizer.save(path)


Tokenizer = CharTokenizer | BPETokenizer


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, the ``tokenizers`` ``ByteLevel`` one: the
    character that stands for each byte in a token's string."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + n): b for n, b in enumerate(others)})
    return chars


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each token's bytes, ``[V]`` byte strings: what
    ``decoding.StopStrings.build`` matches stop strings on.

    ``CharTokenizer``: the character's UTF-8 bytes (the end-of-text token's:
    those of its literal ``<|endoftext|>``, what it decodes to). ``BPETokenizer``
    (byte-level): the bytes its vocabulary string stands for, which may be
    part of a character; decoding the token alone would give U+FFFD instead.
    Either way the text of a row is the UTF-8 decoding of its tokens' bytes
    joined, so text stop strings are matched exactly (see
    ``lmhead.decoding.stop_strings``). Another tokenizer with a ``decode``
    method gets ``decode([v])``'s UTF-8 bytes, exact only when its ``decode``
    joins its tokens' texts.

    Examples:
        >>> token_bytes(CharTokenizer("aé"))
        [b'a', b'\\xc3\\xa9']
    """
    if isinstance(tokenizer, CharTokenizer):
        return [
            tokenizer.decode([v]).encode("utf-8") for v in range(tokenizer.vocab_size)
        ]
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and isinstance(inner.decoder, decoders.ByteLevel):
        chars = _byte_level_chars()
        return [
            bytes(chars[c] for c in inner.id_to_token(v))
            for v in range(tokenizer.vocab_size)
        ]
    return token_bytes_from_decode(tokenizer.decode, tokenizer.vocab_size)


def _line_batches(
    text: str, eos_token: str | None = None, lines_per_batch: int = 4096
) -> Iterator[list[str]]:
    """Batches of ``text``'s lines (each with its newline); with
    ``eos_token``, cut at each of its literals too, which are left out."""
    lines = text.splitlines(keepends=True)
    if eos_token is not None:
        lines = [p for line in lines for p in line.split(eos_token) if p]
    for start in range(0, len(lines), lines_per_batch):
        yield lines[start : start + lines_per_batch]


def load_tokenizer(path: str) -> Tokenizer:
    """Reads a tokenizer written by ``save`` (either kind).

    Examples:
        >>> import os, tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...   CharTokenizer.train("to be").save(os.path.join(folder, "t.json"))
        ...   load_tokenizer(os.path.join(folder, "t.json")).chars
        ' beot'
    """
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    if saved.get("kind") == CharTokenizer.kind:
        return CharTokenizer(saved["chars"], saved.get("eos_token"))
    return BPETokenizer(tokenizers.Tokenizer.from_file(path))


def make_tokenizer(
    kind: str,
    train_text: str,
    text: str,
    vocab_size: int | None,
    end_of_text: bool = False,
) -> Tokenizer:
    """Builds a tokenizer: characters of the whole ``text``, or BPE on
    ``train_text`` (nothing is learned from held-out text); with
    ``end_of_text``, either has the token :data:`END_OF_TEXT`, last.

    Args:
        kind: ``"char"`` or ``"bpe"`` (``config.data.tokenizer``).
        train_text: what BPE learns from: the used training text, or the
            first ``tokenizer_fraction`` of the training split
            (``corpus.Splits.tokenizer_train``).
        text: the whole corpus, whose characters are the character vocabulary.
        vocab_size: BPE's size (at most, the token included); unused for
            ``"char"``.
        end_of_text: ``config.data.end_of_text``.

    Raises:
        ValueError: ``kind`` is neither.

    Examples:
        >>> make_tokenizer("char", "abc", "abcde", None).vocab_size
        5
        >>> make_tokenizer("char", "abc", "abcde", None, end_of_text=True).eos_id
        5
    """
    eos_token = END_OF_TEXT if end_of_text else None
    if kind == "char":
        return CharTokenizer.train(text, eos_token)
    if kind == "bpe":
        return BPETokenizer.train(train_text, vocab_size, eos_token)
    raise ValueError(f"config.data.tokenizer must be 'char' or 'bpe', got {kind!r}.")


def text_length(tokenizer: Tokenizer, ids) -> int:
    r"""The characters of the text that ``ids`` (``int [N]``) stand for, the
    end-of-text token counting none: the denominator of bits per character.

    Bits per character of a text is :math:`\sum_j -\log_2 p(y_j) /` this
    count: every token's log-loss counts, the end-of-text token's too (a
    model must say where a work ends as it must say each character), but
    the token adds no characters, as it stands for none of the corpus's
    text. So the characters are those of the works alone, the same with and
    without the token, and bits per character compare across the two.

    Examples:
        >>> tok = CharTokenizer.train("to be", END_OF_TEXT)
        >>> ids = tok.encode("to be<|endoftext|>be")
        >>> len(tok.decode(ids)), text_length(tok, ids)
        (20, 7)
    """
    ids = np.asarray(ids).reshape(-1)
    if tokenizer.eos_id is not None:
        ids = ids[ids != tokenizer.eos_id]
    return len(tokenizer.decode(ids))
