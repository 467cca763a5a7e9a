"""Scoring a text: per-token log-probabilities, the strided scorer, score.py."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lmhead
from lmhead import decoding
from lmhead.lm import data, inference, scoring
from lmhead.lm import model as model_lib
from tests import references
from tests.experiments.test_commands import run

# A Markov chain over 3 tokens: row i is p(next | i).
CHAIN = np.array([[0.1, 0.6, 0.3], [0.2, 0.1, 0.7], [0.5, 0.3, 0.2]])


def chain_logits(params, tokens):
    """A bigram ``logits_fn``: the next-token logits depend on the last token."""
    return params[tokens]


@pytest.fixture(scope="module")
def tiny_model():
    model = model_lib.DecoderLM(
        vocab_size=13, num_layers=1, num_heads=2, d_model=8, mlp_dim=16, max_len=8
    )
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))[
        "params"
    ]
    return model, params


def test_markov_chain_by_hand():
    tokens = np.array([0, 1, 2, 0, 2])
    by_hand = math.log(0.6) + math.log(0.7) + math.log(0.5) + math.log(0.3)
    logits = jnp.log(CHAIN)[tokens[None, :-1]]
    np.testing.assert_allclose(
        lmhead.sequence_log_prob(logits, jnp.asarray(tokens[None, 1:])),
        [by_hand],
        rtol=1e-6,
    )
    for window, stride in ((4, 4), (2, 1), (2, 2), (3, 2), (1, 1)):
        scores = scoring.strided_log_probs(
            chain_logits,
            jnp.log(CHAIN),
            tokens,
            window=window,
            stride=stride,
            batch_size=2,
        )
        np.testing.assert_allclose(
            scores,
            np.log([0.6, 0.7, 0.5, 0.3]),
            rtol=1e-6,
            err_msg=f"window={window}, stride={stride}",
        )


def test_strided_scores_use_the_context_each_window_gives(tiny_model):
    """Each token against the model run on exactly the context that the
    strided method gives it: from the start of the first window that
    reaches it (the whole text when it fits one window)."""
    model, params = tiny_model
    window = model.max_len
    tokens = np.random.default_rng(1).integers(0, 13, 21).astype(np.int32)
    for text, stride in (
        (tokens[: window + 1], 3),
        (tokens, 1),
        (tokens, 3),
        (tokens, window),
    ):
        scores = scoring.strided_log_probs(
            scoring.ModelLogits(model),
            params,
            text,
            window=window,
            stride=stride,
            batch_size=3,
        )
        targets = np.arange(1, len(text))
        starts = np.maximum(0, -(-(targets - window) // stride)) * stride
        contexts = np.stack(
            [
                np.pad(text[s : s + window], (0, s + window - len(text)))
                if s + window > len(text)
                else text[s : s + window]
                for s in starts
            ]
        )
        logits = jax.jit(model.apply)({"params": params}, jnp.asarray(contexts))
        rows = references.log_softmax(logits)[
            np.arange(len(targets)), targets - starts - 1
        ]
        np.testing.assert_allclose(
            scores,
            rows[np.arange(len(targets)), text[1:]],
            rtol=1e-5,
            atol=1e-5,
            err_msg=f"stride={stride}",
        )
    fits = tokens[: window + 1]
    single = scoring.strided_log_probs(
        scoring.ModelLogits(model), params, fits, window=window, stride=1
    )
    strided = scoring.strided_log_probs(
        scoring.ModelLogits(model), params, fits, window=window, stride=window
    )
    np.testing.assert_array_equal(single, strided)


def test_scores_of_samples_are_the_log_probs_generate_returned(tiny_model):
    model, params = tiny_model
    prompt = jnp.array([[3, 1, 4]], jnp.int32)
    logits, cache = inference.prefill(model, params, prompt)
    tokens, log_probs, *_ = decoding.generate(
        inference.make_step_fn(model),
        params,
        logits,
        cache,
        key=jax.random.key(7),
        max_new_tokens=5,
        temperature=1.0,
    )
    text = np.concatenate([prompt[0], tokens[0]])
    scores = scoring.strided_log_probs(
        scoring.ModelLogits(model), params, text, window=model.max_len
    )
    np.testing.assert_allclose(scores[-5:], log_probs[0], rtol=1e-5, atol=1e-5)


def test_score_text_summary_and_bad_input(tiny_model, tmp_path):
    model, params = tiny_model
    tokenizer = data.CharTokenizer("abcdefghij klm")
    score = scoring.score_text(
        model, params, tokenizer, "abc defgh ijk a", name="s", stride=2
    )
    assert len(score.log_probs) == 14 and score.num_characters == 14
    assert score.token_texts[:3] == ["b", "c", " "]
    summary = score.summary()
    nats = -float(np.sum(score.log_probs, dtype=np.float64))
    np.testing.assert_allclose(
        [
            summary["nats"],
            summary["bits_per_character"],
            summary["perplexity_per_token"],
        ],
        [nats, nats / 14 / math.log(2), math.exp(nats / 14)],
        rtol=1e-9,
    )
    path = tmp_path / "tokens.tsv"
    tab = scoring.TextScore("t", ["a\tb", "\n"], np.array([-1.0, -2.0]), 3)
    scoring.write_token_table(str(path), [tab])
    assert (
        path.read_text()
        == "name\ttoken\tlog_prob\nt\ta\\tb\t-1.000000\nt\t\\n\t-2.000000\n"
    )
    with pytest.raises(ValueError, match="the text is empty"):
        scoring.score_text(model, params, tokenizer, "")
    with pytest.raises(ValueError, match=r"Characters outside the vocabulary: \['z'\]"):
        scoring.score_text(model, params, tokenizer, "abz")
    with pytest.raises(ValueError, match="at least 2 tokens"):
        scoring.score_text(model, params, tokenizer, "a")
    with pytest.raises(ValueError, match=r"stride must be in \[1, window=8\]; got 9"):
        scoring.score_text(model, params, tokenizer, "abc", stride=9)
    with pytest.raises(ValueError, match="token scores are not finite"):
        scoring.strided_log_probs(
            scoring.ModelLogits(model), params, np.array([0, 1, 13]), window=8
        )
    with pytest.raises(FileNotFoundError, match="no such file"):
        scoring.read_texts([str(tmp_path / "missing.txt")], [])


def test_score_text_with_the_end_of_text_token(tiny_model):
    """Its log-loss counts, its characters do not; ``prefix_eos`` scores
    the first token after it (the harness's rolling windows' prefix)."""
    model, params = tiny_model
    tokenizer = data.CharTokenizer("abcdefghij k", data.END_OF_TEXT)
    text = "abc<|endoftext|>de"
    ids = tokenizer.encode_array(text)
    assert ids.tolist() == [0, 1, 2, 12, 3, 4]
    plain = scoring.score_text(model, params, tokenizer, text)
    prefixed = scoring.score_text(model, params, tokenizer, text, prefix_eos=True)
    reference = scoring.strided_log_probs(
        scoring.ModelLogits(model), params, np.array([12, *ids]), window=8
    )
    np.testing.assert_array_equal(prefixed.log_probs, reference)
    np.testing.assert_array_equal(
        plain.log_probs,
        scoring.strided_log_probs(scoring.ModelLogits(model), params, ids, window=8),
    )
    assert len(plain.log_probs) == 5 and len(prefixed.log_probs) == 6
    assert prefixed.token_texts == ["a", "b", "c", data.END_OF_TEXT, "d", "e"]
    # Characters: b c d e after "a", and a b c d e after the prefix.
    assert (plain.num_characters, prefixed.num_characters) == (4, 5)
    nats = -float(np.sum(prefixed.log_probs, dtype=np.float64))
    assert prefixed.summary()["bits_per_character"] == pytest.approx(
        nats / math.log(2) / 5, rel=1e-12
    )
    with pytest.raises(ValueError, match="prefix_eos needs a tokenizer with an"):
        scoring.score_text(
            model, params, data.CharTokenizer("abc"), "ab", prefix_eos=True
        )


@pytest.mark.slow
def test_score_script_end_to_end(tmp_path):

    workdir = str(tmp_path / "run")
    run(
        "train.py",
        "--config=configs/default.py:tiny",
        f"--workdir={workdir}",
        "--config.train.steps=4",
        "--config.optim.warmup_steps=1",
        "--config.train.eval_every=4",
        "--config.train.checkpoint_every=4",
        "--config.sample.max_new_tokens=2",
    )
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(data.shakespeare_text()[:300], encoding="utf-8")
    second.write_text("ROMEO:\nWhat light.\n", encoding="utf-8")
    stdout = run(
        "score.py",
        f"--workdir={workdir}",
        f"--file={first}",
        f"--file={second}",
        "--text=To be, or not to be",
        "--json",
        f"--per_token={tmp_path / 'tokens.tsv'}",
    )
    scores = json.loads(stdout)
    assert [s["name"] for s in scores] == [str(first), str(second), "text1"]
    assert [s["tokens"] for s in scores] == [299, 18, 18]
    rows = (tmp_path / "tokens.tsv").read_text().splitlines()[1:]
    assert len(rows) == 299 + 18 + 18
    nats = -sum(float(r.split("\t")[2]) for r in rows if r.startswith("text1\t"))
    assert abs(nats - scores[2]["nats"]) < 1e-3
    assert scores[0]["nats_per_token"] < math.log(84)  # it learned something
    plain = run("score.py", f"--workdir={workdir}", "--text=To be, or not to be")
    assert plain.startswith("text1: ") and "bits/char" in plain
    (prefixed,) = json.loads(
        run(
            "score.py",
            f"--workdir={workdir}",
            f"--file={second}",
            "--prefix_eos",
            "--json",
        )
    )
    assert (prefixed["tokens"], prefixed["characters"]) == (19, 19)
