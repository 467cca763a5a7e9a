"""Tests for lmhead/lm/data/batches.py: training and evaluation windows and
the characters their labels decode to."""

import numpy as np
import pytest

from lmhead.lm import data


class TestTrainBatch:
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

    def test_the_documented_stream(self):
        # The starts of step s are default_rng([seed, TRAIN_STREAM, s]).
        batch = data.train_batch(
            np.arange(50), seed=3, step=7, batch_size=5, block_size=4
        )
        rng = np.random.default_rng([3, data.TRAIN_STREAM, 7])
        np.testing.assert_array_equal(
            batch["inputs"][:, 0], rng.integers(0, 50 - 4, size=5)
        )

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


class TestEvalBatches:
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
