"""Tests for lmhead/lm/data/dataset.py: encoding the splits, the workdir's
cache, the test split, and data that a run refuses before it compiles."""

import os

import numpy as np
import pytest

from lmhead.lm import data, train
from lmhead.lm.data import dataset as dataset_lib
from lmhead.lm.data import tokenization
from tests.errors import assert_raises_exactly


class TestDataset:
    def test_char_level(self, text_file, data_config):
        text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))
        dataset = data.load_dataset(data_config(path=text_file(text)))
        tok = dataset.tokenizer
        assert tok.decode(dataset.train_tokens) == text[:900]
        assert tok.decode(dataset.val_tokens) == text[900:]
        assert dataset.val_chars_per_token == 1.0
        assert dataset.vocab_size == 26

    def test_bpe_chars_per_token(self, shakespeare, text_file, data_config):
        text = shakespeare[:200_000]
        dataset = data.load_dataset(
            data_config(path=text_file(text), tokenizer="bpe", vocab_size=400)
        )
        val_text = text[int(len(text) * 0.9) :]
        assert dataset.tokenizer.decode(dataset.val_tokens) == val_text
        assert dataset.val_chars_per_token == pytest.approx(
            len(val_text) / len(dataset.tokenizer.encode(val_text))
        )
        assert dataset.val_chars_per_token > 1.5

    def test_too_short_for_block_size(self, text_file, data_config):
        path = text_file("x" * 100)  # validation: 10 characters
        data.load_dataset(data_config(path=path, block_size=9))
        with pytest.raises(ValueError, match="validation split has 10 tokens"):
            data.load_dataset(data_config(path=path, block_size=10))


class TestWhatTheTokenizerLearnsFrom:
    def test_bpe_is_trained_on_the_training_split_only(self, text_file, data_config):
        text = "the cat sat on the mat. " * 400 + "zyzzyva " * 100
        dataset = data.load_dataset(
            data_config(
                path=text_file(text), tokenizer="bpe", vocab_size=300, val_fraction=0.1
            )
        )
        vocab = dataset.tokenizer.tokenizer.get_vocab()
        assert "Ġmat" in vocab and not any("zyz" in t for t in vocab)

    def test_bpe_learns_from_the_used_training_text_only(self, text_file, data_config):
        text = "the cat sat on the mat. " * 400 + "zyzzyva " * 300 + "x " * 100
        used = data.load_dataset(
            data_config(
                path=text_file(text),
                tokenizer="bpe",
                vocab_size=300,
                train_fraction=0.7,
            )
        )
        vocab = used.tokenizer.tokenizer.get_vocab()
        assert "Ġmat" in vocab and not any("zyz" in t for t in vocab)


class TestCache:
    def test_cache_is_reused(self, text_file, data_config, tmp_path, monkeypatch):
        config = data_config(
            path=text_file("abcdefgh" * 50), tokenizer="bpe", vocab_size=260
        )
        workdir = str(tmp_path / "run")
        first = data.load_dataset(config, workdir)
        assert sorted(os.listdir(workdir)) == ["tokenizer.json", "tokens.npz"]

        def no_training(*args):
            raise AssertionError("the tokenizer was trained again")

        monkeypatch.setattr(tokenization, "make_tokenizer", no_training)
        monkeypatch.setattr(data.BPETokenizer, "encode_array", no_training)
        second = data.load_dataset(config, workdir)
        np.testing.assert_array_equal(first.train_tokens, second.train_tokens)
        np.testing.assert_array_equal(first.val_tokens, second.val_tokens)
        assert second.val_chars_per_token == first.val_chars_per_token

    def test_cache_from_other_settings_is_refused(
        self, text_file, data_config, tmp_path
    ):
        workdir = str(tmp_path / "run")
        data.load_dataset(data_config(path=text_file("abcdefgh" * 50)), workdir)
        with pytest.raises(ValueError, match="fresh --workdir"):
            data.load_dataset(
                data_config(path=text_file("abcdefgh" * 50), val_fraction=0.2), workdir
            )

    def test_fingerprint_of_a_tail_split_is_that_of_earlier_runs(self, data_config):
        # Caches written before the works split and train_fraction existed
        # hashed (tokenizer, vocab_size, val_fraction) only; they stay valid.
        tail = data_config(split="tail", test_fraction=0.3)
        assert dataset_lib._fingerprint("abc", tail) == dataset_lib._fingerprint(
            "abc", data_config(split="tail", test_fraction=0.1)
        )
        assert dataset_lib._fingerprint("abc", tail) != dataset_lib._fingerprint(
            "abc", data_config(split="works", test_fraction=0.3)
        )

    def test_tokenizer_vocab_size_is_the_trained_size(self, text_file, data_config):
        text = "the cat sat on the mat\n" * 50
        path = text_file(text)
        config = data_config(path=path, tokenizer="bpe", vocab_size=300)
        size = data.tokenizer_vocab_size(config)
        assert size < 300  # the text runs out of pairs to merge
        assert size == data.load_dataset(config).vocab_size
        assert data.tokenizer_vocab_size(data_config(path=path)) == len(set(text))


class TestTestSplit:
    def test_tail_has_no_test_split(self, text_file, data_config):
        config = data_config(path=text_file("abcdefgh" * 50))
        assert data.read_splits(config).test is None
        with pytest.raises(ValueError, match="has no test split"):
            data.load_test_tokens(config, data.CharTokenizer.train("abcdefgh"))

    def test_test_tokens_are_not_encoded_with_the_others(
        self, text_file, data_config, tmp_path
    ):
        text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))
        config = data_config(path=text_file(text), split="works")
        workdir = str(tmp_path / "run")
        dataset = data.load_dataset(config, workdir)
        with np.load(os.path.join(workdir, data.TOKENS_FILE)) as cached:
            assert set(cached.files) == {"train", "val", "fingerprint"}
        assert dataset.tokenizer.decode(dataset.val_tokens) == text[800:900]
        test = data.load_test_tokens(config, dataset.tokenizer)
        assert dataset.tokenizer.decode(test) == text[900:]


def write(tmp_path, text, mode="w"):
    path = tmp_path / "corpus.txt"
    with open(path, mode) as f:
        f.write(text)
    return str(path)


# A run refuses bad data before anything compiles, with exactly this error;
# the key and the file are named, with one word for what is wrong.
DATA = [
    (
        "missing corpus",
        lambda tmp: str(tmp / "nowhere.txt"),
        FileNotFoundError,
        ("config.data.path", "nowhere.txt"),
    ),
    (
        "empty corpus",
        lambda tmp: write(tmp, ""),
        ValueError,
        ("config.data.path", "corpus.txt", "empty"),
    ),
    (
        "binary corpus",
        lambda tmp: write(tmp, b"\xff\xfe\x00", "wb"),
        ValueError,
        ("config.data.path", "corpus.txt", "UTF-8"),
    ),
    (
        "corpus shorter than a block",
        lambda tmp: write(tmp, "KING " * 3),
        ValueError,
        "config.data.block_size",
    ),
    (
        "prompt outside the vocabulary",
        None,
        ValueError,
        ("config.sample.prompt", "\u20ac"),
    ),
]


@pytest.mark.parametrize(
    "make_path,error,named", [pytest.param(*case[1:], id=case[0]) for case in DATA]
)
def test_data_is_refused_before_anything_compiles(
    short_config, tmp_path, nothing_compiles, make_path, error, named
):
    config = (
        short_config(**{"sample.prompt": "KING\u20ac"})
        if make_path is None
        else short_config(**{"data.path": make_path(tmp_path)})
    )
    assert_raises_exactly(
        lambda: train.train_and_evaluate(config, str(tmp_path / "run")), error, named
    )
