"""The encoded dataset of a run: its splits tokenized once, cached in the
workdir, and checked against the data settings that made them.

:func:`load_dataset` reads and splits the corpus (:mod:`.corpus`), makes or
takes the tokenizer (:mod:`.tokenization`; :func:`train_tokenizer` trains
one that several runs share) and encodes the training and validation text,
cached in the workdir as ``tokenizer.json`` and ``tokens.npz`` under a
fingerprint of the text and settings. :func:`load_test_tokens` encodes the
test split only when it is evaluated.
"""

import dataclasses
import functools
import hashlib
import os

import ml_collections
import numpy as np

from lmhead.lm.data import corpus, tokenization
from lmhead.lm.data.tokenization import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENS_FILE = "tokens.npz"


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Encoded splits of one corpus.

    Attributes:
        train_tokens: [N_train] token ids of the training split (uint16/int32).
        val_tokens: [N_val] token ids of the validation split.
        tokenizer: what encoded them.
        val_chars_per_token: characters of the validation text per validation
            token (1.0 at character level without the end-of-text token),
            the token counting none (``tokenization.text_length``).
        heldout_tokens: [N_heldout] token ids of the held-out chunks inside
            the run's training range (``data.holdout_fraction``), or None
            without held-out chunks.

    The test split is not here: :func:`load_test_tokens` reads it when it is
    evaluated.
    """

    train_tokens: np.ndarray
    val_tokens: np.ndarray
    tokenizer: Tokenizer
    val_chars_per_token: float
    heldout_tokens: np.ndarray | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def tokenizer_vocab_size(data_config) -> int:
    """The number of tokens ``config.data``'s tokenizer has, trained as a run
    trains it (:func:`train_tokenizer`): the characters of the whole text, or
    byte-level BPE on the first ``tokenizer_fraction`` of the training split
    (else the used training text), without held-out chunks, which stops short of
    ``vocab_size`` when that text runs out of pairs to merge. Cached per
    settings for the life of the process, as training BPE on a whole corpus
    is slow.

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
        data_config.get("tokenizer_fraction"),
        data_config.tokenizer,
        data_config.vocab_size,
        data_config.get("train_offset") or 0.0,
        data_config.get("holdout_fraction") or 0.0,
        data_config.get("holdout_chunk") or 1024,
        bool(data_config.get("end_of_text")),
    )


@functools.cache
def _tokenizer_vocab_size(
    path,
    split,
    val_fraction,
    test_fraction,
    train_fraction,
    tokenizer_fraction,
    tokenizer,
    vocab_size,
    train_offset,
    holdout_fraction,
    holdout_chunk,
    end_of_text,
) -> int:
    settings = dict(
        path=path,
        split=split,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        train_fraction=train_fraction,
        tokenizer_fraction=tokenizer_fraction,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        train_offset=train_offset,
        holdout_fraction=holdout_fraction,
        holdout_chunk=holdout_chunk,
        end_of_text=end_of_text,
    )
    return train_tokenizer(ml_collections.ConfigDict(settings)).vocab_size


def train_tokenizer(data_config) -> Tokenizer:
    """The tokenizer ``config.data`` describes, made as a run makes it
    (:func:`.tokenization.make_tokenizer`): the characters of the whole text,
    or byte-level BPE on the first ``tokenizer_fraction`` of the training
    split, from its start whatever ``train_offset`` is (unset: the used
    training text, ``train_fraction`` of it from ``train_offset``); either
    way without the held-out chunks of ``holdout_fraction``; with the
    end-of-text token when ``end_of_text`` is true (absent: false).

    Runs whose ``data_config`` differ only in ``train_fraction`` and
    ``train_offset`` (and share a ``tokenizer_fraction``) have the same
    tokenizer: train it once and pass it to :func:`load_dataset` for each.

    Examples:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        ...   _ = f.write("to be or not to be")
        ...   f.flush()
        ...   train_tokenizer(ml_collections.ConfigDict(dict(path=f.name,
        ...       split="tail", val_fraction=0.5, train_fraction=1.0,
        ...       tokenizer="char", vocab_size=None))).chars
        ' benort'
    """
    return _make_tokenizer(corpus.read_splits(data_config), data_config)


def _make_tokenizer(splits: corpus.Splits, data_config) -> Tokenizer:
    return tokenization.make_tokenizer(
        data_config.tokenizer,
        splits.tokenizer_train,
        splits.text,
        data_config.vocab_size,
        bool(data_config.get("end_of_text")),
    )


def load_dataset(
    data_config, workdir: str | None = None, tokenizer: Tokenizer | None = None
) -> Dataset:
    """Reads, splits, tokenizes and encodes a corpus, cached in ``workdir``.

    The first call writes ``tokenizer.json`` and ``tokens.npz`` to ``workdir``;
    later calls reuse them (a resumed run never retrains or re-encodes), after
    checking that they come from the same text and data settings.

    Args:
        data_config: ``config.data`` (path, split, tokenizer, vocab_size,
            val_fraction, test_fraction, train_fraction, tokenizer_fraction,
            block_size; optional: train_offset, holdout_fraction,
            holdout_chunk, end_of_text).
        workdir: where to cache; ``None`` keeps everything in memory.
        tokenizer: an already trained tokenizer to encode with, instead of
            training one: the one ``data_config`` describes
            (:func:`train_tokenizer`), shared by several runs. It is written
            to ``workdir`` as a trained one is; one already there must equal
            it. ``None``: train it here, unless ``workdir`` holds it.

    Returns:
        A :class:`Dataset`.

    Raises:
        ValueError: a split, or the held-out text, is too short for one
            window of ``block_size + 1`` tokens, the cache in ``workdir`` belongs to other data settings,
            or ``tokenizer`` is not of the kind ``config.data.tokenizer``
            names or differs from the one in ``workdir``.

    Examples:
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "corpus.txt")
        >>> with open(path, "w") as f:
        ...   _ = f.write("the cat sat on the mat\\n" * 40)
        >>> settings = dict(path=path, split="tail", val_fraction=0.1,
        ...     test_fraction=0.1, tokenizer="bpe", vocab_size=270,
        ...     tokenizer_fraction=1.0, block_size=8)
        >>> configs = [ml_collections.ConfigDict(dict(settings, train_fraction=f))
        ...            for f in (0.5, 1.0)]
        >>> shared = train_tokenizer(configs[1])  # once, on the largest fraction
        >>> runs = [load_dataset(c, os.path.join(folder.name, f"run{i}"), shared)
        ...         for i, c in enumerate(configs)]
        >>> [len(r.train_tokens) for r in runs]  # each its own text
        [126, 252]
        >>> [tokenization.load_tokenizer(os.path.join(folder.name, run, TOKENIZER_FILE))
        ...  .to_json() == shared.to_json() for run in ("run0", "run1")]
        [True, True]
        >>> folder.cleanup()
    """
    splits = corpus.read_splits(data_config)
    if tokenizer is not None and tokenizer.kind != data_config.tokenizer:
        raise ValueError(
            f"tokenizer is a {tokenizer.kind!r} tokenizer but "
            f"config.data.tokenizer={data_config.tokenizer!r}; pass one of that "
            "kind (train_tokenizer(config.data)) or None."
        )
    encoded, tokenizer = _encode_or_read_cache(splits, data_config, workdir, tokenizer)
    for name, tokens in (
        ("training", encoded["train"]),
        ("validation", encoded["val"]),
    ):
        if len(tokens) < data_config.block_size + 1:
            raise ValueError(
                f"The {name} split has {len(tokens)} tokens, fewer than "
                f"config.data.block_size + 1 = {data_config.block_size + 1}; use a "
                "longer text, a smaller block_size or other split fractions."
            )
    heldout = encoded.get("heldout")
    if heldout is not None and len(heldout) < data_config.block_size + 1:
        raise ValueError(
            f"The held-out text has {len(heldout)} tokens, fewer than "
            f"config.data.block_size + 1 = {data_config.block_size + 1}: the "
            f"range of config.data.train_fraction={data_config.train_fraction} "
            "holds too little of the chunks of config.data.holdout_fraction="
            f"{data_config.holdout_fraction} and config.data.holdout_chunk="
            f"{data_config.get('holdout_chunk') or 1024}; use a larger train_fraction or "
            "holdout_fraction, or a smaller holdout_chunk."
        )
    return Dataset(
        encoded["train"],
        encoded["val"],
        tokenizer,
        val_chars_per_token=_characters(splits.val, encoded["val"], tokenizer)
        / len(encoded["val"]),
        heldout_tokens=heldout,
    )


def _encode_or_read_cache(
    splits: corpus.Splits,
    data_config,
    workdir: str | None,
    given: Tokenizer | None,
) -> tuple[dict[str, np.ndarray], Tokenizer]:
    """``({"train": ..., "val": ...[, "heldout": ...]}, tokenizer)``: read
    from ``workdir``'s ``tokens.npz`` and ``tokenizer.json`` when they are
    there (after checking their fingerprint, and that the tokenizer is
    ``given`` if one is), else made now (``given``, or trained) and written
    there. ``"heldout"`` is there with held-out chunks only."""
    text = splits.text
    texts = {"train": splits.train, "val": splits.val}
    if splits.heldout is not None:
        texts["heldout"] = splits.heldout
    fingerprint = _fingerprint(text, data_config)
    tokenizer_path = workdir and os.path.join(workdir, TOKENIZER_FILE)
    tokens_path = workdir and os.path.join(workdir, TOKENS_FILE)
    if given is not None and tokenizer_path and os.path.exists(tokenizer_path):
        _check_same_tokenizer(given, tokenization.load_tokenizer(tokenizer_path))
    if tokens_path and os.path.exists(tokens_path):
        with np.load(tokens_path) as cached:
            if str(cached["fingerprint"]) != fingerprint:
                raise ValueError(
                    f"{tokens_path} was made from other text or data settings than "
                    "config.data; use a fresh --workdir."
                )
            encoded = {name: cached[name] for name in texts}
        return encoded, tokenization.load_tokenizer(tokenizer_path)
    if given is not None:
        tokenizer = given
    elif tokenizer_path and os.path.exists(tokenizer_path):
        tokenizer = tokenization.load_tokenizer(tokenizer_path)
    else:
        tokenizer = _make_tokenizer(splits, data_config)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    encoded = {
        name: tokenizer.encode_array(part).astype(dtype) for name, part in texts.items()
    }
    if workdir:
        os.makedirs(workdir, exist_ok=True)
        if not os.path.exists(tokenizer_path):
            tokenizer.save(tokenizer_path)
        np.savez(tokens_path, **encoded, fingerprint=fingerprint)
    return encoded, tokenizer


def _characters(text: str, tokens: np.ndarray, tokenizer: Tokenizer) -> int:
    """``tokenization.text_length`` of ``tokens``, the encoding of ``text``:
    its characters less the end-of-text literals'."""
    if tokenizer.eos_id is None:
        return len(text)
    return len(text) - len(tokenizer.eos_token) * int(
        np.sum(tokens == tokenizer.eos_id)
    )


def load_test_tokens(data_config, tokenizer: Tokenizer) -> np.ndarray:
    """The test split of ``data_config`` encoded by ``tokenizer``: ``[N_test]``
    int32. Called once, for the final evaluation; nothing else reads it.

    Raises:
        ValueError: ``split="tail"`` (no test split), or the test split is
            shorter than one window.
    """
    test = corpus.read_splits(data_config).test
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


def _check_same_tokenizer(given: Tokenizer, saved: Tokenizer) -> None:
    if given.to_json() != saved.to_json():
        raise ValueError(
            "tokenizer differs from the one already in the workdir "
            f"({TOKENIZER_FILE}); use a fresh --workdir or pass tokenizer=None."
        )


def _fingerprint(text: str, data_config) -> str:
    settings = (data_config.tokenizer, data_config.vocab_size, data_config.val_fraction)
    if data_config.split != "tail" or data_config.train_fraction != 1.0:
        # Only then, so that the caches of earlier runs stay valid.
        settings += (
            data_config.split,
            data_config.test_fraction,
            data_config.train_fraction,
        )
    tokenizer_fraction = data_config.get("tokenizer_fraction")
    if tokenizer_fraction is not None:
        # Only when set, for the same reason.
        settings += (("tokenizer_fraction", tokenizer_fraction),)
    # The same for these: only when they change the text.
    if data_config.get("train_offset"):
        settings += (("train_offset", data_config.train_offset),)
    if data_config.get("holdout_fraction"):
        settings += (
            (
                "holdout",
                data_config.holdout_fraction,
                data_config.get("holdout_chunk") or 1024,
            ),
        )
    if data_config.get("end_of_text"):
        settings += (("end_of_text", True),)
    digest = hashlib.sha256(text.encode("utf-8"))
    digest.update(repr(settings).encode())
    return digest.hexdigest()
