"""Tests for lmhead/lm/data/dataset.py: encoding the splits, the workdir's
cache, the test split, and data that a run refuses before it compiles."""

import hashlib
import json
import os

import numpy as np
import pytest

from lmhead.lm import configuration, data, train
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


@pytest.mark.parametrize(
    "zyzzyvas,split",
    [(100, dict(val_fraction=0.1)), (300, dict(train_fraction=0.7))],
    ids=["not the validation split", "not the unused training text"],
)
def test_bpe_learns_from_the_used_training_text_only(
    text_file, data_config, zyzzyvas, split
):
    text = "the cat sat on the mat. " * 400 + "zyzzyva " * zyzzyvas + "x " * 100
    dataset = data.load_dataset(
        data_config(path=text_file(text), tokenizer="bpe", vocab_size=300, **split)
    )
    vocab = dataset.tokenizer.tokenizer.get_vocab()
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


def todays_fingerprint(text, data_config):
    """The cache fingerprint as computed before ``tokenizer_fraction``."""
    c = data_config
    settings = (c.tokenizer, c.vocab_size, c.val_fraction)
    if c.split != "tail" or c.train_fraction != 1.0:
        settings += (c.split, c.test_fraction, c.train_fraction)
    digest = hashlib.sha256(text.encode("utf-8"))
    digest.update(repr(settings).encode())
    return digest.hexdigest()


# A text whose last part holds words its first part lacks: BPE trained on a
# longer prefix learns merges of them.
SHIFTING = "the cat sat on the mat. " * 400 + "zyzzyva " * 300 + "x " * 100


def learned_zyz(tokenizer):
    return any("zyz" in t for t in tokenizer.tokenizer.get_vocab())


class TestTokenizerFraction:
    def test_equal_to_train_fraction_is_the_unset_tokenizer(
        self, text_file, data_config
    ):
        settings = dict(
            path=text_file(SHIFTING),
            tokenizer="bpe",
            vocab_size=300,
            train_fraction=0.5,
        )
        unset = data.load_dataset(data_config(**settings))
        equal = data.load_dataset(data_config(**settings, tokenizer_fraction=0.5))
        assert equal.tokenizer.to_json() == unset.tokenizer.to_json()
        np.testing.assert_array_equal(equal.train_tokens, unset.train_tokens)
        np.testing.assert_array_equal(equal.val_tokens, unset.val_tokens)

    def test_larger_fraction_trains_on_the_larger_prefix(self, text_file, data_config):
        settings = dict(
            path=text_file(SHIFTING),
            tokenizer="bpe",
            vocab_size=300,
            train_fraction=0.5,
        )
        dataset = data.load_dataset(data_config(**settings, tokenizer_fraction=0.9))
        training_split = SHIFTING[: int(len(SHIFTING) * 0.9)]
        larger = training_split[: int(len(training_split) * 0.9)]
        used = training_split[: int(len(training_split) * 0.5)]
        expected = data.make_tokenizer("bpe", larger, SHIFTING, 300)
        assert dataset.tokenizer.to_json() == expected.to_json()
        assert learned_zyz(dataset.tokenizer)
        assert not learned_zyz(data.load_dataset(data_config(**settings)).tokenizer)
        np.testing.assert_array_equal(dataset.train_tokens, expected.encode(used))
        assert dataset.tokenizer.decode(dataset.train_tokens) == used

    def test_works_split_of_the_embedded_corpus(self, works, data_config):
        config = data_config(
            split="works",
            tokenizer="bpe",
            vocab_size=300,
            train_fraction=0.004,
            tokenizer_fraction=0.01,
        )
        dataset = data.load_dataset(config)
        training_split = data.split_works(works, 0.1, 0.1)[0]
        cut = training_split[: int(len(training_split) * 0.01)]
        used = training_split[: int(len(training_split) * 0.004)]
        expected = data.make_tokenizer("bpe", cut, "", 300)
        assert dataset.tokenizer.to_json() == expected.to_json()
        np.testing.assert_array_equal(dataset.train_tokens, expected.encode(used))

    def test_char_tokenizer_is_unaffected(self, text_file, data_config):
        text = "abcd" * 200 + "xyz" * 10  # x, y, z only in validation
        settings = dict(path=text_file(text), train_fraction=0.5)
        unset = data.load_dataset(data_config(**settings))
        for fraction in (0.1, 1.0):
            dataset = data.load_dataset(
                data_config(**settings, tokenizer_fraction=fraction)
            )
            assert dataset.tokenizer.chars == unset.tokenizer.chars == "abcdxyz"
            np.testing.assert_array_equal(dataset.train_tokens, unset.train_tokens)

    def test_fingerprint_of_unset_settings_is_unchanged(self, data_config):
        tiny = configuration.load_config("tiny").data  # tokenizer_fraction None
        assert tiny.tokenizer_fraction is None and tiny.end_of_text
        assert dataset_lib._fingerprint("abc", tiny) != todays_fingerprint("abc", tiny)
        for config in (
            data_config(end_of_text=False),
            data_config(),  # no tokenizer_fraction key at all
            data_config(tokenizer_fraction=None),
            data_config(split="works", tokenizer="bpe", vocab_size=512),
            data_config(train_fraction=0.3),
        ):
            assert dataset_lib._fingerprint("abc", config) == todays_fingerprint(
                "abc", config
            )
        for fraction in (0.3, 1.0):
            assert dataset_lib._fingerprint(
                "abc", data_config(train_fraction=0.3, tokenizer_fraction=fraction)
            ) != todays_fingerprint("abc", data_config(train_fraction=0.3))

    def test_an_unset_cache_is_refused_once_it_is_set(
        self, text_file, data_config, tmp_path
    ):
        settings = dict(path=text_file(SHIFTING), train_fraction=0.5)
        workdir = str(tmp_path / "run")
        data.load_dataset(data_config(**settings), workdir)
        with pytest.raises(ValueError, match="fresh --workdir"):
            data.load_dataset(data_config(**settings, tokenizer_fraction=1.0), workdir)

    def test_tokenizer_vocab_size_is_cached_per_fraction(self, text_file, data_config):
        text = "the cat sat on the mat\n" * 50 + "a quick brown fox jumps\n" * 50
        settings = dict(
            path=text_file(text), tokenizer="bpe", vocab_size=1000, train_fraction=0.4
        )
        sizes = [
            data.tokenizer_vocab_size(data_config(**settings, tokenizer_fraction=f))
            for f in (None, 1.0)
        ]
        assert sizes[0] < sizes[1]  # the longer text has more pairs to merge
        assert sizes == [
            data.load_dataset(data_config(**settings, tokenizer_fraction=f)).vocab_size
            for f in (None, 1.0)
        ]


class TestGivenTokenizer:
    def config(self, text_file, data_config, **overrides):
        return data_config(
            path=text_file(SHIFTING),
            tokenizer="bpe",
            vocab_size=300,
            tokenizer_fraction=0.9,
            **overrides,
        )

    def test_is_the_trained_one_written_to_the_workdir(
        self, text_file, data_config, tmp_path, monkeypatch
    ):
        config = self.config(text_file, data_config, train_fraction=0.5)
        data.load_dataset(config, str(tmp_path / "trained"))
        shared = data.train_tokenizer(config)

        def no_training(*args):
            raise AssertionError("the tokenizer was trained again")

        monkeypatch.setattr(tokenization, "make_tokenizer", no_training)
        given = data.load_dataset(config, str(tmp_path / "given"), shared)
        assert given.tokenizer is shared
        for name in (data.TOKENIZER_FILE, data.TOKENS_FILE):
            with open(tmp_path / "trained" / name, "rb") as f:
                expected = f.read()
            with open(tmp_path / "given" / name, "rb") as f:
                assert f.read() == expected, name

    def test_members_share_it_and_encode_their_own_text(
        self, text_file, data_config, tmp_path
    ):
        configs = [
            self.config(text_file, data_config, train_fraction=f) for f in (0.3, 0.9)
        ]
        shared = data.train_tokenizer(configs[1])
        for index, config in enumerate(configs):
            workdir = str(tmp_path / f"member{index}")
            dataset = data.load_dataset(config, workdir, shared)
            used = data.read_splits(config).train
            np.testing.assert_array_equal(dataset.train_tokens, shared.encode(used))
            saved = data.load_tokenizer(os.path.join(workdir, data.TOKENIZER_FILE))
            assert saved.to_json() == shared.to_json()
            resumed = data.load_dataset(config, workdir, shared)
            np.testing.assert_array_equal(resumed.train_tokens, dataset.train_tokens)

    def test_another_tokenizer_than_the_workdirs_is_refused(
        self, text_file, data_config, tmp_path
    ):
        config = self.config(text_file, data_config)
        workdir = str(tmp_path / "run")
        data.load_dataset(config, workdir)
        other = data.BPETokenizer.train(SHIFTING[:2000], 280)
        assert_raises_exactly(
            lambda: data.load_dataset(config, workdir, other), ValueError, "tokenizer"
        )

    def test_of_another_kind_is_refused(self, text_file, data_config):
        config = self.config(text_file, data_config)
        assert_raises_exactly(
            lambda: data.load_dataset(config, None, data.CharTokenizer.train(SHIFTING)),
            ValueError,
            ("tokenizer", "config.data.tokenizer"),
        )


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


class TestEndOfText:
    """New runs have the token between works; a pinned or older config gets
    bitwise the data it had (an old-recipe reference built here)."""

    def test_pinned_run_has_todays_data(self, works, data_config, tmp_path):
        # The tying study's data settings, end_of_text pinned off.
        settings = dict(
            split="works",
            train_fraction=0.03,
            train_offset=0.5,
            holdout_fraction=0.1,
            holdout_chunk=512,
        )
        names = data.assign_works(works, 0.1, 0.1)
        split = np.array(list("".join(works[n] for n in names["train"])))
        positions = np.arange(len(split))
        held = (positions // 512) % 10 == 9
        start = int(len(split) * 0.5)
        in_range = (positions >= start) & (positions < start + int(len(split) * 0.03))
        chars = sorted(set("".join(works.values())))
        lookup = np.zeros(128, np.int64)
        lookup[[ord(c) for c in chars]] = np.arange(len(chars))
        for pinned in (dict(end_of_text=False), {}):
            config = data_config(**settings, **pinned)
            dataset = data.load_dataset(config, str(tmp_path / str(len(pinned))))
            for tokens, mask in (
                (dataset.train_tokens, in_range & ~held),
                (dataset.heldout_tokens, in_range & held),
            ):
                expected = lookup[[ord(c) for c in split[mask]]]
                np.testing.assert_array_equal(tokens, expected)
            assert dataset.tokenizer.to_json() == (
                '{"kind": "char", "chars": ' + json.dumps("".join(chars)) + "}"
            )
            assert dataset.tokenizer.eos_id is None
            assert dataset.val_chars_per_token == 1.0

    def test_new_run_has_it_between_works(self, works, data_config):
        dataset = data.load_dataset(data_config(end_of_text=True))
        tok = dataset.tokenizer
        assert tok.eos_id == tok.vocab_size - 1 == 84
        tokens = np.concatenate([dataset.train_tokens, dataset.val_tokens])
        ends = np.flatnonzero(tokens == tok.eos_id)
        assert len(ends) == 42 and ends[-1] == len(tokens) - 1
        lengths = np.diff(np.concatenate([[-1], ends])) - 1
        np.testing.assert_array_equal(lengths, [len(w) for w in works.values()])
        val = tok.decode(dataset.val_tokens)
        assert dataset.val_chars_per_token == pytest.approx(
            len(val.replace(data.END_OF_TEXT, "")) / len(dataset.val_tokens)
        )

    def test_bpe_vocab_size_counts_the_token(self, text_file, data_config):
        text = ("the cat sat on the mat\n" * 30 + data.END_OF_TEXT) * 4
        config = data_config(
            path=text_file(text), tokenizer="bpe", vocab_size=262, end_of_text=True
        )
        dataset = data.load_dataset(config)
        assert data.tokenizer_vocab_size(config) == dataset.vocab_size == 262
        assert dataset.tokenizer.eos_id == 261
        off = data_config(path=config.path, tokenizer="bpe", vocab_size=262)
        assert data.load_dataset(off).tokenizer.eos_id is None
        assert dataset_lib._fingerprint(text, config) != dataset_lib._fingerprint(
            text, off
        )
