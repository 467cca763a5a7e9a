"""Tests of speculative decoding in the one decoding step (lmhead/decoding/speculative.py).

References: plain decoding (``generate`` without a proposer) for greedy
tokens, stops and log-probs; for sampling, the exact distribution of short
continuations of a Markov chain, enumerated in numpy with the processors
written here (temperature, top-k, top-p), against 10^5 speculative samples
(chi-square), and a wrong acceptance rule that the same test rejects.
"""

import dataclasses
import itertools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special
from scipy import stats as scipy_stats

from lmhead import decoding
from lmhead.decoding import NGramProposer, ProposalContext
from lmhead.decoding import step as step_lib

VOCAB = 5


def markov_table(seed=0, vocab=VOCAB, concentration=0.7):
    probs = jax.random.dirichlet(
        jax.random.key(seed), jnp.full(vocab, concentration), (vocab,)
    )
    return jnp.log(probs)


def markov(table, tokens, state):
    return table[tokens], state


@dataclasses.dataclass(frozen=True)
class Shifted:
    """Proposes ``(last + shift + j) % V`` for ``j = 0 .. k - 1``: wrong
    where the chain's greedy step is not ``+ shift``, so blocks are rejected
    (tests/lm/test_speculative_generation.py mixes accepted and rejected
    ones on a model's cache)."""

    num_tokens: int
    shift: int = 1
    vocab: int = VOCAB
    reads_history = False

    def propose(self, params, state, context):
        j = jnp.arange(self.num_tokens)
        drafts = (context.last[:, None] + self.shift + j) % self.vocab
        return drafts.astype(jnp.int32), state


@dataclasses.dataclass(frozen=True)
class Oracle:
    """Proposes the greedy continuation of the chain itself: every draft
    is accepted, so whole blocks pass through the stops."""

    num_tokens: int
    reads_history = False

    def propose(self, table, state, context):
        drafts, token = [], context.last
        for _ in range(self.num_tokens):
            token = jnp.argmax(table[token], axis=-1).astype(jnp.int32)
            drafts.append(token)
        return jnp.stack(drafts, axis=1), state


def generate(table, prompt_last, **kwargs):
    options = dict(key=jax.random.key(0), max_new_tokens=12, temperature=0.0)
    return decoding.generate(
        markov, table, table[jnp.asarray(prompt_last)], (), **(options | kwargs)
    )


def assert_same(spec, plain, atol=1e-6):
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    np.testing.assert_array_equal(spec.finish_reasons, plain.finish_reasons)
    np.testing.assert_allclose(spec.log_probs, plain.log_probs, atol=atol)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("proposer", [Shifted, Oracle])
def test_greedy_speculation_gives_plain_greedys_tokens(k, proposer):
    table = markov_table(1)
    prompt = jnp.array([0, 1, 2, 3])
    plain = generate(table, prompt, eos_id=4, top_logprobs=2)
    spec = generate(table, prompt, eos_id=4, top_logprobs=2, speculative=proposer(k))
    assert_same(spec, plain)
    np.testing.assert_array_equal(spec.top_tokens, plain.top_tokens)
    stats = spec.speculation
    tested, accepted = np.asarray(stats.tested), np.asarray(stats.accepted)
    if proposer is Oracle:  # every draft right: fewer calls than tokens
        assert int(stats.calls.sum()) < int(plain.lengths.sum())
        np.testing.assert_array_equal(accepted, tested)
    else:  # drafts rejected: each call still emits the model's token
        assert tested[0] > 0 and (accepted < tested).any(), (tested, accepted)


def test_stops_end_of_text_and_limits_inside_an_accepted_block():
    """An oracle's whole block is accepted; EOS, a stop sequence, a stop token
    and each row's max_new_tokens land inside it, where plain decoding ends."""
    table = markov_table(2)
    prompt = jnp.array([0, 1, 2, 3])
    plain_greedy = generate(table, prompt, max_new_tokens=10)
    row = np.asarray(plain_greedy.tokens[0])
    cases = [
        dict(eos_id=int(row[3])),
        dict(stop_sequences=[[int(row[2]), int(row[3])]]),
        dict(stop_tokens=decoding.stop_token_mask([int(row[4])], VOCAB)),
        dict(row_max_new_tokens=jnp.array([2, 3, 5, 1])),
        dict(min_new_tokens=3, eos_id=int(row[1])),
    ]
    for case in cases:
        plain = generate(table, prompt, max_new_tokens=10, **case)
        spec = generate(table, prompt, max_new_tokens=10, speculative=Oracle(3), **case)
        assert_same(spec, plain)


def test_processors_penalties_and_the_hook_see_each_token_as_plain_decoding():
    table = markov_table(3)
    prompt = jnp.array([[0, 1], [2, 3], [4, 4]])
    hook = _BanLater()
    options = dict(
        prompt_tokens=prompt,
        repetition_penalty=1.5,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logit_bias=decoding.logit_bias_vector({1: 0.5}, VOCAB),
        no_repeat_ngram_size=3,
        processor=hook,
        max_new_tokens=10,
        log_probs_from="model",
    )
    plain = generate(table, prompt[:, -1], **options)
    for proposer in (Shifted(3), Oracle(2), NGramProposer(3, max_ngram=2)):
        assert_same(
            generate(table, prompt[:, -1], speculative=proposer, **options), plain
        )


@dataclasses.dataclass(frozen=True)
class _BanLater:
    """A hook that removes token 2 from a row's fifth token on: it reads the
    per-row context."""

    def __call__(self, logits, context):
        late = jnp.reshape(context.lengths >= 4, (-1, 1))
        return jnp.where(late & (jnp.arange(logits.shape[-1]) == 2), -jnp.inf, logits)


def test_ngram_with_no_match_and_streams_equal_one_call():
    table = markov_table(4)
    prompt = jnp.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    plain = generate(table, prompt[:, -1], eos_id=4)
    # A history of distinct tokens and min_ngram 4: no match until the
    # generated text repeats four tokens.
    never = NGramProposer(3, max_ngram=4, min_ngram=4)
    spec = generate(
        table, prompt[:, -1], eos_id=4, prompt_tokens=prompt, speculative=never
    )
    assert_same(spec, plain)
    chunks = list(
        decoding.generate_stream(
            markov, table, table[prompt[:, -1]], (), chunk_steps=5, key=jax.random.key(0),
            max_new_tokens=12, temperature=0.0, eos_id=4, prompt_tokens=prompt,
            speculative=NGramProposer(2),
        )
    )  # fmt: skip
    whole = generate(
        table,
        prompt[:, -1],
        eos_id=4,
        prompt_tokens=prompt,
        speculative=NGramProposer(2),
    )
    np.testing.assert_array_equal(
        np.concatenate([c.tokens for c in chunks], axis=1), whole.tokens
    )
    np.testing.assert_array_equal(
        np.concatenate([c.log_probs for c in chunks], axis=1), whole.log_probs
    )
    np.testing.assert_array_equal(chunks[-1].lengths, whole.lengths)


@dataclasses.dataclass(frozen=True)
class NoDrafts:
    """No drafts for any row."""

    num_tokens: int
    reads_history = False

    def propose(self, params, state, context):
        none = jnp.full((context.last.shape[0], self.num_tokens), decoding.NO_TOKEN)
        return none, state


@dataclasses.dataclass(frozen=True)
class FirstRowOnly:
    """:class:`Shifted`'s first ``depth`` drafts (all by default) for row 0,
    none for the others."""

    num_tokens: int
    depth: int | None = None
    reads_history = False

    def propose(self, params, state, context):
        drafts, state = Shifted(self.num_tokens).propose(params, state, context)
        first = jnp.arange(drafts.shape[0])[:, None] == 0
        depth = self.num_tokens if self.depth is None else self.depth
        shallow = jnp.arange(self.num_tokens) < depth
        return jnp.where(first & shallow, drafts, decoding.NO_TOKEN), state


def test_tests_that_end_early_split_the_key_as_every_depth_does():
    """One sampling key: the draft tests end at the first depth where no
    row has a draft left (at depth 0 when no row has one), and a call
    leaves the key split ``k + 1`` times (its first step's and ``k`` tests'),
    wherever the tests ended. So a row that never has a draft draws, at its
    ``c``-th token, from the key split ``c (k + 1)`` times, whether another
    row's drafts are tested at every depth, at the first only, or at none:
    its tokens are computed here from ``jax.random`` alone."""
    k, new_tokens = 3, 32
    table = markov_table(5)
    last = jnp.array([0, 3])
    options = dict(temperature=1.0, key=jax.random.key(7), max_new_tokens=new_tokens)
    every = generate(table, last, speculative=FirstRowOnly(k), **options)
    first = generate(table, last, speculative=FirstRowOnly(k, depth=1), **options)
    none = generate(table, last, speculative=NoDrafts(k), **options)
    assert int(every.speculation.tested[k - 1]) > 0  # tested at every depth
    assert int(first.speculation.tested[0]) > 0  # at the first only:
    np.testing.assert_array_equal(first.speculation.tested[1:], 0)
    assert int(none.speculation.tested.sum()) == 0  # at none
    # Row 1: one token per call, drawn as categorical(the batch's logits)
    # draws it (its row of the batch's noise), then k more splits.
    key, previous, expected = options["key"], int(last[1]), []
    for _ in range(new_tokens):
        key, drawn = jax.random.split(key)
        batch_logits = jnp.stack([table[0], table[previous]])
        previous = int(jax.random.categorical(drawn, batch_logits, axis=-1)[1])
        expected.append(previous)
        for _ in range(k):
            key, _ = jax.random.split(key)
    for run in (every, first, none):
        np.testing.assert_array_equal(run.tokens[1], expected)
        np.testing.assert_array_equal(run.log_probs[1], every.log_probs[1])


def test_ngram_proposes_what_followed_the_latest_match():
    history = jnp.array(
        [
            [-1, -1, 7, 1, 2, 3, 9, 1, 2],  # "1 2" last followed by 3 9
            [-1, 4, 5, 6, 4, 5, 6, 4, 5],  # period 3: 6 4 5
            [-1, -1, -1, -1, 1, 2, 3, 4, 5],  # no repeat
        ]
    )
    context = ProposalContext(history[:, -1], jnp.ones(3, bool), history)
    drafts, _ = NGramProposer(3, max_ngram=2).propose(None, (), context)
    np.testing.assert_array_equal(drafts, [[3, 9, 1], [6, 4, 5], [-1, -1, -1]])


# ----------------------------------------------------------------------------
# Sampling keeps the distribution.

SAMPLED = dict(temperature=0.8, top_k=4, top_p=0.9)
NEW_TOKENS = 3
SAMPLES = 100_000


def numpy_processed(logits, temperature, top_k=VOCAB, top_p=1.0):
    """The processed distribution of one row, written here: temperature,
    the top k, then the smallest top set of mass >= p."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape, bool)
    keep[order[:top_k]] = True
    p = special.softmax(np.where(keep, z, -np.inf))
    mass = np.cumsum(p[order])
    crossing = int(np.searchsorted(mass, top_p - 1e-7))
    top = np.zeros(z.shape, bool)
    top[order[: crossing + 1]] = True
    p = np.where(top & keep, p, 0.0)
    return p / p.sum()


def exact_distribution(table, first, knobs):
    table = np.asarray(table)
    probs = {}
    for sequence in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        prob, previous = 1.0, first
        for token in sequence:
            prob *= numpy_processed(table[previous], **knobs)[token]
            previous = token
        probs[sequence] = prob
    return probs


def chi_square_p(table, first, proposer, knobs):
    """The p-value of 10^5 speculative samples of ``NEW_TOKENS`` tokens
    against the exact distribution (0 where a sample has probability 0)."""
    spec = generate(
        table, jnp.full(SAMPLES, first), key=jax.random.key(7),
        max_new_tokens=NEW_TOKENS, speculative=proposer, **knobs,
    )  # fmt: skip
    tokens = np.asarray(spec.tokens)
    codes = tokens @ (VOCAB ** np.arange(NEW_TOKENS)[::-1])
    counts = np.bincount(codes, minlength=VOCAB**NEW_TOKENS)
    probs = exact_distribution(table, first, knobs)
    expected = np.array(
        [probs[s] for s in itertools.product(range(VOCAB), repeat=NEW_TOKENS)]
    )
    if np.any(counts[expected == 0]):  # a continuation the processors remove
        return 0.0, spec.speculation
    expected *= SAMPLES
    big = expected >= 5  # rare sequences pooled into one cell
    rare = (~big) & (expected > 0)
    observed = np.append(counts[big], counts[rare].sum())
    expected = np.append(expected[big], expected[rare].sum())
    if not rare.any():
        observed, expected = observed[:-1], expected[:-1]
    return scipy_stats.chisquare(observed, expected).pvalue, spec.speculation


@pytest.mark.parametrize("knobs", [SAMPLED, dict(temperature=1.0)])
def test_sampling_under_speculation_keeps_the_exact_distribution(knobs):
    table = markov_table(5)
    p, stats = chi_square_p(table, 0, Shifted(2), knobs)
    assert p > 1e-3, p
    # Both outcomes of the test occurred many times.
    assert 0.1 < int(stats.accepted[0]) / int(stats.tested[0]) < 0.9


@pytest.mark.parametrize("knobs", [SAMPLED, dict(temperature=1.0)])
def test_the_chi_square_test_catches_a_rule_that_always_accepts(knobs):
    """With temperature alone every continuation is possible, so only the
    counts tell the wrong rule apart."""
    table = markov_table(5)
    always = lambda processed, draft, uniform, temperature: draft >= 0
    with mock.patch.object(step_lib, "accepts_draft", always):
        # shift=2: another static proposer, so the loop is traced again.
        p, _ = chi_square_p(table, 0, Shifted(2, shift=2), knobs)
    assert p < 1e-3, p


# ----------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: NGramProposer(0), ValueError, "num_tokens"),
        (lambda: NGramProposer(2, max_ngram=1, min_ngram=2), ValueError, "min_ngram"),
    ],
)
def test_bad_proposers_name_their_argument(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_speculation_needs_a_proposer_and_a_step_that_rewinds():
    table = markov_table(0)
    with pytest.raises(TypeError, match="speculative must be a Proposer"):
        generate(table, jnp.array([0]), speculative="ngram")
    stateful = lambda table, tokens, state: (table[tokens], state + 1)
    with pytest.raises(ValueError, match="verify"):
        decoding.generate(
            stateful, table, table[jnp.array([0])], jnp.zeros(1), key=jax.random.key(0),
            max_new_tokens=3, speculative=Shifted(1),
        )  # fmt: skip
