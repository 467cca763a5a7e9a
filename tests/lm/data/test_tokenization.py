"""Tests for lmhead/lm/data/tokenization.py: the character and BPE
tokenizers, saving and loading them."""

import pytest

from lmhead.lm import data


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

    @pytest.mark.parametrize("chars", ["", "aba"])
    def test_chars_must_be_distinct_and_present(self, chars):
        with pytest.raises(ValueError, match="chars must be non-empty"):
            data.CharTokenizer(chars)

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


class TestMakeTokenizer:
    def test_characters_of_the_whole_text_bpe_of_the_training_text(self):
        char = data.make_tokenizer("char", "ab", "abcd", None)
        assert isinstance(char, data.CharTokenizer) and char.chars == "abcd"
        bpe = data.make_tokenizer("bpe", "zzzz\n" * 20, "abab\n" * 20, 258)
        vocab = bpe.tokenizer.get_vocab()
        assert isinstance(bpe, data.BPETokenizer) and bpe.vocab_size <= 258
        assert "zz" in vocab and "ab" not in vocab

    def test_unknown_kind(self):
        with pytest.raises(ValueError, match="config.data.tokenizer"):
            data.make_tokenizer("word", "ab", "ab", None)
