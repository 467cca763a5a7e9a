"""Tests of data.train_offset and the held-out chunks (data.holdout_fraction,
data.holdout_chunk) in lmhead/lm/data/corpus.py and dataset.py: the texts cut
against a numpy reference of the documented rule, the refusals, and the
encoded held-out tokens."""

import numpy as np
import pytest

from lmhead.lm import configuration, data
from lmhead.lm.data import dataset as dataset_lib
from tests.errors import assert_raises_exactly, bad_input_test

# 1000 characters, 900 of them the training split of split="tail".
TEXT = "".join(chr(ord("a") + (i * 7 + i // 26) % 26) for i in range(1000))


def reference(offset, fraction, holdout, chunk, tokenizer_fraction=None):
    """The documented rule by position masks over the original training split:
    ``(train, heldout, tokenizer_train)``."""
    split = np.array(list(TEXT[:900]))
    n, positions = len(split), np.arange(len(split))
    if holdout:
        period = round(1 / holdout)
        held = (positions // chunk) % period == period - 1
    else:
        held = np.zeros(n, bool)
    start = int(n * offset)
    in_range = (positions >= start) & (positions < start + int(n * fraction))
    in_prefix = positions < int(n * (tokenizer_fraction or 0))
    train, heldout, prefix = (
        "".join(split[mask])
        for mask in (in_range & ~held, in_range & held, in_prefix & ~held)
    )
    return train, heldout, prefix if tokenizer_fraction else train


CUTS = [
    (0.0, 1.0, 0.0, 1024, None),
    (0.5, 0.25, 0.0, 1024, 1.0),
    (0.5, 0.25, 0.1, 7, None),
    (0.33, 0.6, 0.25, 13, 0.4),
    (0.0, 0.3, 0.1, 1, 1.0),
    (0.9, 0.1, 0.2, 50, 0.05),
    (0.1, 0.5, 0.1, 2048, None),  # one chunk, never held out
]


class TestTheCut:
    @pytest.mark.parametrize("offset,fraction,holdout,chunk,tokenizer_fraction", CUTS)
    def test_is_the_documented_rule(
        self,
        text_file,
        data_config,
        offset,
        fraction,
        holdout,
        chunk,
        tokenizer_fraction,
    ):
        splits = data.read_splits(
            data_config(
                path=text_file(TEXT),
                train_offset=offset,
                train_fraction=fraction,
                holdout_fraction=holdout,
                holdout_chunk=chunk,
                tokenizer_fraction=tokenizer_fraction,
            )
        )
        train, heldout, tokenizer_train = reference(
            offset, fraction, holdout, chunk, tokenizer_fraction
        )
        assert splits.train == train
        assert splits.tokenizer_train == tokenizer_train
        assert splits.heldout == (heldout if holdout else None)
        assert splits.val == TEXT[900:]

    def test_default_keys_are_the_prefix(self, text_file, data_config):
        path = text_file(TEXT)
        without = data.read_splits(data_config(path=path, train_fraction=0.3))
        given = data.read_splits(
            data_config(
                path=path, train_fraction=0.3, train_offset=0.0, holdout_fraction=0.0
            )
        )
        assert without == given
        assert given.train == data.text_prefix(TEXT[:900], 0.3)

    def test_held_out_chunks_are_in_no_training_or_tokenizer_text(
        self, text_file, data_config
    ):
        # The held-out chunks (every 4th of 10 characters) are upper case.
        text = "".join(
            c.upper() if (i // 10) % 4 == 3 else c for i, c in enumerate(TEXT[:900])
        )
        path = text_file(text + TEXT[900:])
        for offset, fraction in ((0.0, 1.0), (0.25, 0.5), (0.61, 0.39)):
            splits = data.read_splits(
                data_config(
                    path=path,
                    train_offset=offset,
                    train_fraction=fraction,
                    holdout_fraction=0.25,
                    holdout_chunk=10,
                    tokenizer_fraction=1.0,
                )
            )
            start, stop = int(900 * offset), int(900 * offset) + int(900 * fraction)
            assert splits.train.islower() and splits.tokenizer_train.islower()
            assert splits.heldout.isupper()
            assert splits.heldout == "".join(c for c in text[start:stop] if c.isupper())
            assert len(splits.train) + len(splits.heldout) == stop - start


def validate(**keys):
    """``validate_config`` of the tiny config with ``config.data`` keys set."""
    config = configuration.load_config("tiny")
    config.data.update(keys)
    configuration.validate_config(config)


OFFSET, FRACTION = "config.data.train_offset", "config.data.train_fraction"
test_refusals_name_the_keys = bad_input_test([
    ("a range past the end", lambda: validate(train_offset=0.6, train_fraction=0.5),
     ValueError, (OFFSET, FRACTION, "0.6", "0.5")),
    ("a range just past the end",
     lambda: validate(train_offset=0.99, train_fraction=0.02),
     ValueError, (OFFSET, FRACTION, "0.99", "0.02")),
    *((f"{key} {value}", lambda k=key, v=value: validate(**{k: v}), ValueError,
       f"config.data.{key}")
      for key, value in (("train_offset", 1.0), ("train_offset", -0.1),
                         ("holdout_fraction", 0.5), ("holdout_fraction", -0.1),
                         ("holdout_chunk", 0))),
])  # fmt: skip


class TestRefusals:
    def test_in_range_passes(self):
        validate(train_offset=0.5, train_fraction=0.5, holdout_fraction=0.1)

    def test_too_short_a_held_out_text(self, text_file, data_config):
        config = data_config(
            path=text_file(TEXT),
            train_fraction=0.05,
            holdout_fraction=0.1,
            holdout_chunk=4,
        )  # 45 characters: one held-out chunk of 4, fewer than block_size + 1 = 9
        assert_raises_exactly(
            lambda: data.load_dataset(config),
            ValueError,
            (
                "config.data.holdout_fraction",
                "config.data.holdout_chunk",
                "config.data.train_fraction",
            ),
        )


class TestHeldOutTokens:
    def settings(self, text_file, **overrides):
        return dict(
            path=text_file(TEXT),
            tokenizer="bpe",
            vocab_size=300,
            train_offset=0.2,
            train_fraction=0.7,
            holdout_fraction=0.2,
            holdout_chunk=30,
            **overrides,
        )

    def test_encode_the_held_out_text_and_are_cached(
        self, text_file, data_config, tmp_path
    ):
        config = data_config(**self.settings(text_file))
        splits = data.read_splits(config)
        workdir = str(tmp_path / "run")
        made = data.load_dataset(config, workdir)
        read = data.load_dataset(config, workdir)
        for dataset in (made, read):
            assert dataset.tokenizer.decode(dataset.heldout_tokens) == splits.heldout
            assert dataset.tokenizer.decode(dataset.train_tokens) == splits.train
        np.testing.assert_array_equal(made.heldout_tokens, read.heldout_tokens)
        assert data.load_dataset(data_config(path=config.path)).heldout_tokens is None

    @pytest.mark.parametrize(
        "key,value",
        [("train_offset", 0.1), ("holdout_fraction", 0.1), ("holdout_chunk", 31)],
    )
    def test_each_key_is_in_the_fingerprint(
        self, text_file, data_config, tmp_path, key, value
    ):
        settings = self.settings(text_file)
        workdir = str(tmp_path / "run")
        data.load_dataset(data_config(**settings), workdir)
        settings[key] = value
        with pytest.raises(ValueError, match="fresh --workdir"):
            data.load_dataset(data_config(**settings), workdir)

    def test_unused_keys_keep_the_fingerprint(self, data_config):
        plain = dataset_lib._fingerprint("abc", data_config())
        assert plain == dataset_lib._fingerprint(
            "abc", data_config(train_offset=0.0, holdout_fraction=0.0, holdout_chunk=7)
        )

    def test_tokenizer_vocab_size_sees_the_held_out_chunks(
        self, text_file, data_config
    ):
        words = " ".join(f"w{i * 7919 % 1000}x" for i in range(300))
        settings = dict(
            path=text_file(words),
            tokenizer="bpe",
            vocab_size=3000,
            holdout_chunk=40,
            tokenizer_fraction=1.0,
        )
        sizes = [
            data.tokenizer_vocab_size(data_config(**settings, holdout_fraction=h))
            for h in (0.0, 0.25)
        ]
        assert sizes[1] < sizes[0]  # less text, fewer pairs to merge
        assert (
            sizes[1]
            == data.train_tokenizer(
                data_config(**settings, holdout_fraction=0.25)
            ).vocab_size
        )
