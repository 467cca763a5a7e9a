"""The experiment's two tokenizers, saving and loading them, and choosing one
by ``config.data.tokenizer``.

* :class:`CharTokenizer`: one token per character; the vocabulary is the
  sorted distinct characters of the whole text, so that every split encodes.
* :class:`BPETokenizer`: byte-level BPE from the ``tokenizers`` library,
  trained on training text only (nothing is learned from held-out text): the
  used training text, or the first ``config.data.tokenizer_fraction`` of the
  training split when that is set.

Neither has an end-of-sequence or padding token: the corpus is one
continuous stream, so ``eos_id`` is ``None`` and decoding runs for a fixed
number of new tokens. Both give ``encode_array`` (int32 ids), ``encode``,
``decode``, ``save`` and ``vocab_size``; ``lmhead.decoding.detokenize``
turns generated ids into text with either.
"""

import json
from collections.abc import Iterator

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers


class CharTokenizer:
    """One token per character; id ``i`` is the ``i``-th sorted character.

    ``eos_id`` is ``None``: there is no end-of-sequence token. Encoding a
    character outside the vocabulary raises ``ValueError``.

    Examples:
        >>> tok = CharTokenizer.train("hello world")
        >>> tok.vocab_size, tok.encode("hello")
        (8, [3, 2, 4, 4, 5])
        >>> tok.decode([3, 2, 4, 4, 5])
        'hello'
    """

    kind = "char"
    eos_id = None

    def __init__(self, chars: str):
        if not chars or len(set(chars)) != len(chars):
            raise ValueError("chars must be non-empty and without repeats.")
        self.chars = chars
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.int64)
        self._order = np.argsort(self._codepoints)

    @classmethod
    def train(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode_array(self, text: str) -> np.ndarray:
        """Encodes ``text`` into an int32 array, vectorised over characters."""
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
        return "".join(self.chars[i] for i in np.asarray(ids).reshape(-1))

    def to_json(self) -> str:
        """What :meth:`save` writes: equal strings, equal tokenizers."""
        return json.dumps({"kind": self.kind, "chars": self.chars})

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())


class BPETokenizer:
    """Byte-level BPE from the ``tokenizers`` library; ``eos_id`` is ``None``.

    Text is pre-tokenized GPT-2 style on bytes (no prefix space), so every
    string round-trips. Training and encoding go line by line (each line keeps
    its newline), so no token spans a line break.

    Examples:
        >>> tok = BPETokenizer.train("the cat sat on the mat\\n" * 50, 270)
        >>> tok.vocab_size  # at most the size asked for: this text runs out of pairs
        268
        >>> tok.decode(tok.encode("the bat")) == "the bat"
        True
    """

    kind = "bpe"
    eos_id = None

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def train(cls, text: str, vocab_size: int) -> "BPETokenizer":
        tokenizer = tokenizers.Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator(_line_batches(text), trainer=trainer)
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_array(self, text: str) -> np.ndarray:
        encodings = self.tokenizer.encode_batch(text.splitlines(keepends=True))
        ids = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
        return np.concatenate(ids) if ids else np.zeros([0], np.int32)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids) -> str:
        return self.tokenizer.decode(np.asarray(ids).reshape(-1).tolist())

    def to_json(self) -> str:
        """The ``tokenizers`` JSON: equal strings, equal tokenizers."""
        return self.tokenizer.to_str()

    def save(self, path: str) -> None:
        self.tokenizer.save(path)


Tokenizer = CharTokenizer | BPETokenizer


def _line_batches(text: str, lines_per_batch: int = 4096) -> Iterator[list[str]]:
    lines = text.splitlines(keepends=True)
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
        return CharTokenizer(saved["chars"])
    return BPETokenizer(tokenizers.Tokenizer.from_file(path))


def make_tokenizer(
    kind: str, train_text: str, text: str, vocab_size: int | None
) -> Tokenizer:
    """Builds a tokenizer: characters of the whole ``text``, or BPE on
    ``train_text`` (nothing is learned from held-out text).

    Args:
        kind: ``"char"`` or ``"bpe"`` (``config.data.tokenizer``).
        train_text: what BPE learns from: the used training text, or the
            first ``tokenizer_fraction`` of the training split
            (``corpus.Splits.tokenizer_train``).
        text: the whole corpus, whose characters are the character vocabulary.
        vocab_size: BPE's size (at most); unused for ``"char"``.

    Raises:
        ValueError: ``kind`` is neither.

    Examples:
        >>> make_tokenizer("char", "abc", "abcde", None).vocab_size
        5
    """
    if kind == "char":
        return CharTokenizer.train(text)
    if kind == "bpe":
        return BPETokenizer.train(train_text, vocab_size)
    raise ValueError(f"config.data.tokenizer must be 'char' or 'bpe', got {kind!r}.")
