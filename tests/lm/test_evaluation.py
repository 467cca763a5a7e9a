"""Tests for lmhead/lm/evaluation.py: metrics against numpy, bits per
character against a hand computation, early stopping."""

import math

import jax
import numpy as np
import pytest

from configs import default
from lmhead.lm import configuration, data, evaluation, train
from tests import references
from tests.lm.conftest import init_state


def evaluate_one(eval_fn, params, eval_set):
    """``evaluation.evaluate`` of one set, as a program of one reads it:
    every sum with a members axis of one."""
    (metrics,) = evaluation.evaluate(
        lambda p, b: jax.tree.map(lambda x: np.asarray(x)[None], eval_fn(p, b)),
        params,
        evaluation.MemberEvalSet(eval_set.batches, False, [eval_set]),
    )
    return metrics


class TestEvaluate:
    @pytest.mark.parametrize("num_batches", [3, None])
    def test_against_numpy(self, num_batches):
        config = default.get_config("tiny")
        model = configuration.make_model(config, vocab_size=84)
        params = init_state(config, jax.random.key(1)).params
        tokens = np.random.default_rng(0).integers(0, 84, 500)
        batches = data.eval_batches(
            tokens, num_batches=num_batches, batch_size=4, block_size=16
        )
        eval_fn = jax.jit(lambda p, b: train.eval_step(p, b, model=model))
        num_tokens = sum(int(b["weights"].sum()) for b in batches)
        got = evaluate_one(
            eval_fn,
            params,
            evaluation.EvalSet(
                "eval", batches, num_tokens=num_tokens, num_chars=2.5 * num_tokens
            ),
        )

        # The whole split: 31 windows of 16, so every label but the last 3.
        windows = np.stack([tokens[i : i + 17] for i in range(0, 496, 16)])
        if num_batches:
            windows = np.stack(
                [tokens[i : i + 17] for i in np.linspace(0, 483, 12).astype(int)]
            )
        apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
        logits = np.asarray(apply(params, windows[:, :-1]), np.float64).reshape(-1, 84)
        labels = windows[:, 1:].reshape(-1)
        log_p = references.log_softmax(logits)
        _, want = references.cross_entropy(logits, labels)
        nll = want["nll"]
        ece = references.expected_calibration_error(logits, labels, None, 15)
        # Equal windows: the standard error of the mean of the window means.
        window_nll = -log_p[np.arange(len(labels)), labels].reshape(len(windows), -1)
        stderr = window_nll.mean(1).std(ddof=1) / np.sqrt(len(windows))
        np.testing.assert_allclose(
            [
                got["eval/loss"],
                got["eval/perplexity"],
                got["eval/bits_per_char"],
                got["eval/accuracy"],
                got["eval/ece"],
                got["eval/loss_stderr"],
            ],
            [nll, np.exp(nll), nll / np.log(2) / 2.5, want["accuracy"], ece, stderr],
            rtol=1e-4,
            atol=1e-6,
        )


class TestBitsPerCharacter:
    """Hand computations on a text of two-line works: an end-of-text token
    between them counts its nats and adds no characters."""

    @pytest.mark.parametrize("end_of_text", [False, True], ids=["plain", "eot"])
    @pytest.mark.parametrize("kind", ["char", "bpe"])
    def test_against_a_hand_computation(self, kind, end_of_text):
        end = data.END_OF_TEXT if end_of_text else "\n"
        text = ("the cat sat on the mat,\nthe dog sat." + end) * 30
        size = 300 if kind == "bpe" else None
        tokenizer = data.make_tokenizer(kind, text, text, size, end_of_text)
        tokens = tokenizer.encode_array(text)
        assert np.sum(tokens == tokenizer.eos_id) == 30 * end_of_text
        config = default.get_config("tiny")
        eval_set = evaluation.make_eval_set("eval", tokens, None, config, tokenizer)
        got = evaluate_one(TestWordPerplexity.nats_by_label, None, eval_set)
        # Consecutive windows of 16 predict tokens 1 .. 16k; their characters
        # are the text less the first token's and the tail's, and less 13 for
        # each end-of-text label.
        k = (len(tokens) - 1) // 16
        labels = tokens[1 : 1 + 16 * k]
        nats = np.sum(0.1 * (labels % 5 + 1))  # end-of-text labels' included
        chars = (
            len(text)
            - len(tokenizer.decode(tokens[:1]))
            - len(tokenizer.decode(tokens[1 + 16 * k :]))
            - len(data.END_OF_TEXT) * np.sum(labels == tokenizer.eos_id)
        )
        if kind == "char":
            assert chars == np.sum(labels != tokenizer.eos_id)
        else:
            assert chars > 2 * 16 * k  # several characters per token
        assert eval_set.num_tokens == 16 * k and eval_set.num_chars == chars
        assert got["eval/bits_per_char"] == pytest.approx(
            nats / (math.log(2) * chars), rel=1e-5
        )

    def test_end_of_text_adds_no_words(self):
        text = "the cat sat on the mat,\nthe dog sat.<|endoftext|>" * 30
        tokenizer = data.make_tokenizer("char", "", text, None, True)
        tokens = tokenizer.encode_array(text)
        test_set = evaluation.make_test_set(
            tokens, default.get_config("tiny"), tokenizer
        )
        assert test_set.num_words == 9 * 30  # "sat.<|endoftext|>the": two words


class TestWordPerplexity:
    @staticmethod
    def nats_by_label(params, batch):  # a stand-in for eval_step
        nats = 0.1 * (batch["labels"] % 5 + 1) * batch["weights"]
        return {
            "window_nll": nats.sum(-1),
            "window_count": batch["weights"].sum(-1),
            "correct_sum": 0.0,
            "bins": np.zeros((15, 3)),
        }

    @pytest.mark.parametrize("kind", ["char", "bpe"])
    def test_against_a_hand_computation(self, kind):
        text = "the cat sat on the mat, the dog  sat on the log.\n" * 30
        tokenizer = data.make_tokenizer(
            kind, text, text, 300 if kind == "bpe" else None
        )
        tokens = tokenizer.encode_array(text)
        config = default.get_config("tiny")
        test_set = evaluation.make_test_set(tokens, config, tokenizer)
        got = evaluate_one(self.nats_by_label, None, test_set)

        assert test_set.name == "test" and test_set.num_words == 12 * 30
        # The labels are tokens 1 .. 16k, each predicted once.
        k = (len(tokens) - 1) // 16
        nats = np.sum(0.1 * (tokens[1 : 1 + 16 * k] % 5 + 1))
        assert got["test/words"] == 360
        assert got["test/word_perplexity"] == pytest.approx(
            math.exp(nats / 360), rel=1e-5
        )
        assert got["test/word_perplexity"] == pytest.approx(
            math.exp(got["test/loss"] * test_set.num_tokens / 360), rel=1e-6
        )

    def test_only_a_set_with_words_has_word_metrics(self):
        text = "to be or not to be " * 20
        tokenizer = data.CharTokenizer.train(text)
        tokens = tokenizer.encode_array(text)
        config = default.get_config("tiny")
        periodic = evaluation.make_eval_set("eval", tokens, 2, config, tokenizer)
        assert periodic.num_words is None
        got = evaluate_one(self.nats_by_label, None, periodic)
        assert not any("word" in k for k in got)
        whole = evaluation.make_test_set(tokens, config, tokenizer)
        assert whole.num_words == 120
        same = evaluation.make_eval_set("test", tokens, None, config, tokenizer)
        assert (whole.num_tokens, whole.num_chars) == (same.num_tokens, same.num_chars)
        for mine, theirs in zip(whole.batches, same.batches, strict=True):
            np.testing.assert_array_equal(mine["labels"], theirs["labels"])


class TestEarlyStopping:
    @pytest.mark.parametrize("patience,stops_at", [(1, 30), (2, 40), (3, None)])
    def test_counts_evaluations_since_the_best(self, patience, stops_at):
        losses = {10: 3.0, 20: 2.0, 30: 2.0, 40: 2.1, 50: 1.0}
        stopping = evaluation.EarlyStopping(patience)
        stopped = None
        for step, loss in losses.items():
            stopping.update(step, loss)
            if stopping.should_stop and stopped is None:
                stopped = step
        if stops_at is None:
            assert stopped is None and stopping.best_step == 50
        else:  # a tie is not an improvement
            assert stopped == stops_at

    def test_never_with_patience_0_and_nan_never_improves(self):
        stopping = evaluation.EarlyStopping(0)
        for step, loss in enumerate([1.0, math.nan, 2.0, 3.0]):
            assert stopping.update(step, loss) == (step == 0)
        assert not stopping.should_stop and stopping.best_step == 0

    def test_resumes_from_the_records(self):
        records = [
            {"step": 5, "train/loss": 9.0},
            {"step": 5, "eval/loss": 3.0},
            {"step": 10, "eval/loss": 2.0},
            {"step": 15, "eval/loss": 2.5},
        ]
        stopping = evaluation.EarlyStopping.from_records(2, records)
        assert (
            stopping.best_step,
            stopping.best_loss,
            stopping.evaluations_since_best,
        ) == (10, 2.0, 1)
