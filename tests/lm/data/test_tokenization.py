"""Tests for lmhead/lm/data/tokenization.py: the character and BPE
tokenizers, saving and loading them."""

import pytest
import tokenizers

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


EOT = data.END_OF_TEXT


class TestEndOfText:
    """GPT-2's ``<|endoftext|>``: one id, the last, for both tokenizers."""

    def test_char_token_is_one_id_after_the_characters(self):
        tok = data.CharTokenizer.train("to be" + EOT + "or not" + EOT, EOT)
        assert tok.chars == " benort" and tok.eos_token == EOT
        assert tok.eos_id == 7 == tok.vocab_size - 1
        lookup = {c: i for i, c in enumerate(" benort")}
        text = "be" + EOT + EOT + "not" + EOT
        expected = [lookup["b"], lookup["e"], 7, 7] + [lookup[c] for c in "not"] + [7]
        assert tok.encode(text) == expected
        assert tok.decode(expected) == text
        assert data.text_length(tok, expected) == len("be" + "not")

    def test_char_literal_characters_stay_characters(self):
        # A text with '<' and '|' of its own: they are characters; only the
        # whole literal is the token, as GPT-2 reads it.
        tok = data.CharTokenizer.train("a<b|c>", EOT)
        assert tok.chars == "<>abc|" and tok.eos_id == 6
        assert tok.encode("<|" + EOT) == [0, 5, 6]

    def test_char_without_the_token_is_as_before(self, tmp_path):
        tok = data.CharTokenizer.train("ab" + EOT)
        assert tok.eos_id is None and tok.eos_token is None
        assert tok.chars == "".join(sorted(set("ab" + EOT)))
        assert tok.decode(tok.encode(EOT)) == EOT and len(tok.encode(EOT)) == 13
        assert tok.to_json() == '{"kind": "char", "chars": "' + tok.chars + '"}'
        (tmp_path / "old.json").write_text('{"kind": "char", "chars": "ab"}')
        old = data.load_tokenizer(str(tmp_path / "old.json"))
        assert old.eos_id is None and old.vocab_size == 2

    def test_char_save_load_keeps_the_token(self, tmp_path):
        tok = data.CharTokenizer.train("hello", EOT)
        tok.save(str(tmp_path / "t.json"))
        loaded = data.load_tokenizer(str(tmp_path / "t.json"))
        assert (loaded.eos_id, loaded.eos_token) == (tok.eos_id, EOT)
        assert loaded.to_json() == tok.to_json()

    def test_other_eos_tokens_are_refused(self):
        for make in (
            lambda: data.CharTokenizer("ab", "</s>"),
            lambda: data.BPETokenizer.train("ab\n" * 10, 260, "</s>"),
        ):
            with pytest.raises(ValueError, match="eos_token must be None or"):
                make()

    def test_bpe_token_is_the_last_id_and_never_learned(self, shakespeare):
        text = EOT.join([shakespeare[:40_000], shakespeare[50_000:90_000]]) + EOT
        tok = data.BPETokenizer.train(text, 400, EOT)
        assert tok.vocab_size == 400 and tok.eos_id == 399 and tok.eos_token == EOT
        assert tok.encode(EOT) == [399] and tok.encode("a" + EOT + "b")[1] == 399
        ids = tok.encode(text)
        assert ids.count(399) == 2 and tok.decode(ids) == text
        # The merges come from the works, not from the literal's pieces.
        assert not any("endof" in t for t in tok.tokenizer.get_vocab(False))
        assert data.text_length(tok, ids) == len(text) - 2 * len(EOT)

    def test_bpe_save_load_and_old_files(self, bpe, tmp_path):
        tok = data.BPETokenizer.train("the cat" + EOT + "sat\n" * 20, 270, EOT)
        tok.save(str(tmp_path / "new.json"))
        loaded = data.load_tokenizer(str(tmp_path / "new.json"))
        assert (loaded.eos_id, loaded.eos_token) == (tok.eos_id, EOT)
        bpe.save(str(tmp_path / "old.json"))  # trained without the token
        old = data.load_tokenizer(str(tmp_path / "old.json"))
        assert old.eos_id is None and old.eos_token is None
        assert len(old.encode(EOT)) > 1

    def test_bpe_reads_gpt2s_special_token_wherever_it_stands(self):
        # GPT-2's tokenizer.json has it as an added special token (id 50256);
        # here at id 258 of a small byte-level model.
        inner = data.BPETokenizer.train("abab\n" * 20, 258).tokenizer
        inner.add_special_tokens([EOT])
        tok = data.BPETokenizer(tokenizers.Tokenizer.from_str(inner.to_str()))
        assert tok.eos_id == inner.token_to_id(EOT) and tok.eos_token == EOT
        inner.add_tokens(["<|pad|>"])  # an added token that is not special
        assert data.BPETokenizer(inner).eos_id == tok.eos_id

    def test_pinned_tokenizers_equal_the_old_recipe(self, shakespeare):
        """``end_of_text=False`` makes bitwise what the code made before the
        token existed: the same vocabulary and ids (recipes written here)."""
        text = shakespeare[:60_000]
        char = data.make_tokenizer("char", text, text, None, end_of_text=False)
        assert char.chars == "".join(sorted(set(text))) and char.eos_id is None
        bpe = data.make_tokenizer("bpe", text, text, 300, end_of_text=False)
        old = tokenizers.Tokenizer(tokenizers.models.BPE())
        old.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        old.decoder = tokenizers.decoders.ByteLevel()
        old.train_from_iterator(
            [text.splitlines(keepends=True)],
            trainer=tokenizers.trainers.BpeTrainer(
                vocab_size=300,
                show_progress=False,
                initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            ),
        )
        assert bpe.to_json() == old.to_str() and bpe.eos_id is None
