"""The encoded dataset of a run: its splits tokenized once, cached in the
workdir, and checked against the data settings that made them.

:func:`load_dataset` reads and splits the corpus (:mod:`.corpus`), makes the
tokenizer (:mod:`.tokenization`) and encodes the training and validation
text; with a workdir it writes ``tokenizer.json`` and ``tokens.npz`` there,
which later calls (a resumed run) reuse after checking their fingerprint of
the text and settings. The test split is never encoded with the others:
:func:`load_test_tokens` reads it when it is evaluated.
:func:`tokenizer_vocab_size` is the size a run's tokenizer will have,
cached per settings in the process.
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


def tokenizer_vocab_size(data_config) -> int:
    """The number of tokens ``config.data``'s tokenizer has, trained as a run
    trains it (:func:`.tokenization.make_tokenizer`): the characters of the
    whole text, or byte-level BPE on the used training text, which stops short
    of ``vocab_size`` when that text runs out of pairs to merge. Cached per
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
        data_config.tokenizer,
        data_config.vocab_size,
    )


@functools.cache
def _tokenizer_vocab_size(
    path, split, val_fraction, test_fraction, train_fraction, tokenizer, vocab_size
) -> int:
    splits = corpus.read_splits(
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
    return tokenization.make_tokenizer(
        tokenizer, splits.train, splits.text, vocab_size
    ).vocab_size


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
    splits = corpus.read_splits(data_config)
    train_tokens, val_tokens, tokenizer = _encode_or_read_cache(
        splits, data_config, workdir
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
        val_chars_per_token=len(splits.val) / len(val_tokens),
    )


def _encode_or_read_cache(
    splits: corpus.Splits, data_config, workdir: str | None
) -> tuple[np.ndarray, np.ndarray, Tokenizer]:
    """``(train_tokens, val_tokens, tokenizer)``: read from ``workdir``'s
    ``tokens.npz`` and ``tokenizer.json`` when they are there (after checking
    their fingerprint), else made now and written there."""
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
        return train_tokens, val_tokens, tokenization.load_tokenizer(tokenizer_path)
    if tokenizer_path and os.path.exists(tokenizer_path):
        tokenizer = tokenization.load_tokenizer(tokenizer_path)
    else:
        tokenizer = tokenization.make_tokenizer(
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
    return train_tokens, val_tokens, tokenizer


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
