"""Speculative decoding of DecoderLM runs (lmhead/decoding/speculative.py on
the model's cache): greedy speculation against plain greedy decoding, token
for token, from the run's MTP heads and from n-gram lookup; the text API's
speculation; and its refusals, each naming its flag."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import decoding
from lmhead.lm import generation, inference
from lmhead.lm.model import DecoderLM

VOCAB = 13


def random_model(design="sequential", heads=3, seed=0, favoured=None):
    """A random model; with ``favoured``, the head's bias raises that token's
    logit by 2, at the main head and every depth, so that runs of it make
    whole blocks of proposals right and others wrong."""
    model = DecoderLM(
        vocab_size=VOCAB, num_layers=2, num_heads=2, d_model=16, mlp_dim=32,
        max_len=48, mtp_heads=heads, mtp_design=design,
        head_bias=favoured is not None,
    )  # fmt: skip
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(seed), tokens)["params"]
    # Larger weights than at init, so that the argmax varies along the text.
    params = jax.tree.map(lambda x: 4.0 * x, params)
    if favoured is not None:
        bias = params["head"]["bias"].at[favoured].add(2.0)
        params = {**params, "head": {**params["head"], "bias": bias}}
    return model, params


def ragged_prompts(rows, seed=1):
    prompt = jax.random.randint(jax.random.key(seed), (rows, 7), 0, VOCAB)
    lengths = jnp.array([7, 4, 6][:rows])
    padded = jnp.where(jnp.arange(7) < lengths[:, None], prompt, -1)
    return prompt, lengths, padded


def decode(model, params, rows, proposer=None, **options):
    prompt, lengths, padded = ragged_prompts(rows)
    mtp = isinstance(proposer, inference.MTPProposer)
    logits, cache = inference.prefill(
        model, params, prompt, lengths, max_new_tokens=30, mtp=mtp
    )
    return decoding.generate(
        inference.make_step_fn(model), params, logits, cache, key=jax.random.key(0),
        max_new_tokens=30, temperature=0.0, prompt_tokens=padded,
        speculative=proposer, top_logprobs=2, **options,
    )  # fmt: skip


@pytest.mark.parametrize("design", ["sequential", "parallel"])
def test_mtp_speculation_gives_plain_greedys_tokens(design):
    """Blocks accepted whole and cut at each depth, through the real cache,
    for one row and for ragged rows, every k: the tokens, top tokens and
    log-probs stay plain greedy's."""
    model, params = random_model(design, favoured=5)
    for rows, ks in ((1, (2,)), (3, (1, 3))):
        plain = decode(model, params, rows, eos_id=3)
        for k in ks:
            spec = decode(
                model, params, rows, inference.MTPProposer(model, k), eos_id=3
            )
            np.testing.assert_array_equal(spec.tokens, plain.tokens)
            np.testing.assert_array_equal(spec.lengths, plain.lengths)
            np.testing.assert_array_equal(spec.top_tokens, plain.top_tokens)
            np.testing.assert_allclose(spec.log_probs, plain.log_probs, atol=1e-5)
            stats = spec.speculation
            tested, accepted = np.asarray(stats.tested), np.asarray(stats.accepted)
            assert (accepted > 0).all() and (accepted < tested).all(), (
                tested,
                accepted,
            )
            assert int(stats.calls.sum()) < int(plain.lengths.sum())


def test_ngram_speculation_gives_plain_greedys_tokens_and_no_match_too():
    model, params = random_model(heads=0)
    plain = decode(model, params, 3)
    for proposer in (
        decoding.NGramProposer(4),
        decoding.NGramProposer(2, max_ngram=7, min_ngram=7),  # no match
    ):
        spec = decode(model, params, 3, proposer)
        np.testing.assert_array_equal(spec.tokens, plain.tokens)
        np.testing.assert_allclose(spec.log_probs, plain.log_probs, atol=1e-5)


def test_trained_run_speculates_the_plain_text(finished_run):
    _, tokenizer, model, params = generation.load_run(finished_run)
    settings = dict(key=jax.random.key(0), num_samples=2, max_new_tokens=30)
    greedy = dict(settings, temperature=0.0, top_logprobs=2, stop="\n\n")
    plain = generation.continuations(model, params, tokenizer, "KING", **greedy)
    spec = generation.continuations(
        model, params, tokenizer, "KING", speculative="ngram",
        num_speculative_tokens=4, **greedy,
    )  # fmt: skip
    assert [c.text for c in spec] == [c.text for c in plain]
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    for a, b in zip(spec, plain, strict=True):
        np.testing.assert_allclose(
            [p for step in a.top_logprobs for _, p in step],
            [p for step in b.top_logprobs for _, p in step],
            atol=1e-5,
        )
    sampled = generation.continuations(
        model,
        params,
        tokenizer,
        "KING",
        speculative="ngram",
        temperature=1.0,
        **settings,
    )
    assert all(len(c.tokens) == 30 or c.finish_reason == "stop" for c in sampled)


def test_refusals_name_the_flag():
    model, _ = random_model(heads=2)
    plain_model, _ = random_model(heads=0)
    cases = [
        (
            lambda: generation.proposer(model, "ngram", 0, None),
            "num_speculative_tokens",
        ),
        (
            lambda: generation.proposer(model, "mtp", 3, None),
            "num_speculative_tokens=3",
        ),
        (lambda: generation.proposer(plain_model, "mtp", 1, None), "speculative='mtp'"),
        (lambda: generation.proposer(model, "ngram", 2, 4), "num_beams"),
        (lambda: generation.proposer(model, "draft", 2, None), "speculative must be"),
    ]
    for make, words in cases:
        with pytest.raises(ValueError, match=words):
            make()
