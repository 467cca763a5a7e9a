"""Tests for lmhead/decoding/ against numpy references and brute force.

The decoders run on a second-order Markov chain: the next logits depend on the
token fed in *and* on the one before it, which lives in the state, so a beam
search that reorders the state wrongly gets wrong logits. The chain's table is
the step function's ``params``.
"""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from lmhead import decoding
from lmhead.lm import data
from tests.references import log_softmax as np_log_softmax

# ---------------------------------------------------------------------------
# numpy references (float64)


def np_top_k_mask(z, k):
    keep = np.zeros(z.shape, bool)
    for row, values in enumerate(z):
        keep[row, np.argsort(-values, kind="stable")[:k]] = True
    return keep


def np_top_p_mask(z, p):
    """Walks down the sorted probabilities until the mass reaches p."""
    probs = np.exp(np_log_softmax(z))
    keep = np.zeros(z.shape, bool)
    for row in range(z.shape[0]):
        mass = 0.0
        for token in np.argsort(-z[row], kind="stable"):
            keep[row, token] = True
            mass += probs[row, token]
            if mass >= p:
                break
    return keep


def np_min_p_mask(z, min_p):
    probs = np.exp(np_log_softmax(z))
    return probs >= min_p * probs.max(-1, keepdims=True)


def np_sampling_probs(logits, temperature, top_k, top_p, min_p):
    """The processed distribution: temperature, then top-k, top-p, min-p."""
    z = np.asarray(logits, np.float64) / temperature
    for keep in (
        lambda z: np_top_k_mask(z, top_k) if top_k else np.ones(z.shape, bool),
        lambda z: np_top_p_mask(z, top_p),
        lambda z: np_min_p_mask(z, min_p),
    ):
        z = np.where(keep(z), z, -np.inf)
    return np.exp(np_log_softmax(z))


def np_repetition_penalty(z, history, penalty):
    z = np.array(z, np.float64)
    for row, tokens in enumerate(history):
        for token in {int(t) for t in tokens if t >= 0}:
            value = z[row, token]
            z[row, token] = value * penalty if value < 0 else value / penalty
    return z


def np_ngram_banned(history, n):
    """Tokens t such that (last n-1 tokens, t) already occurs in history."""
    history = [int(t) for t in history if t >= 0]
    prefix = history[len(history) - n + 1 :] if n > 1 else []
    return {
        history[j + n - 1]
        for j in range(len(history) - n + 1)
        if history[j : j + n - 1] == prefix
    }


def np_divisor(length, alpha, penalty):
    return ((5 + length) / 6) ** alpha if penalty == "gnmt" else length**alpha


def markov_step(table, tokens, state):
    """A second-order chain: next logits = table[previous token, token]."""
    return table[state["prev"], tokens], {**state, "prev": tokens}


# Run-time calls of counted_markov_step (a debug callback runs on every call,
# not only when traced). Module-level functions share compiled loops.
CALLS = []


def counted_markov_step(table, tokens, state):
    jax.debug.callback(lambda: CALLS.append(1))
    return markov_step(table, tokens, state)


class MarkovChain:
    """Random logits after each prompt, and a random second-order table."""

    def __init__(self, seed, vocab_size, batch, eos_boost=0.0, eos_id=0):
        rng = np.random.default_rng(seed)
        self.table = 2.0 * rng.standard_normal((vocab_size,) * 3).astype(np.float32)
        self.table[..., eos_id] += eos_boost
        self.logits = (2.0 * rng.standard_normal((batch, vocab_size))).astype(
            np.float32
        )
        self.logits[:, eos_id] += eos_boost
        self.prev = rng.integers(0, vocab_size, batch).astype(np.int32)
        self.vocab_size = vocab_size

    def state(self):
        return {"prev": jnp.asarray(self.prev)}

    def log_probs(self, row, sequence):
        """Per-token log-probs of a continuation of prompt ``row``."""
        out, prev, logits = [], self.prev[row], self.logits[row]
        for token in sequence:
            out.append(np_log_softmax(logits)[token])
            logits, prev = self.table[prev, token], token
        return out


def np_greedy(
    chain,
    row,
    max_new_tokens,
    *,
    eos_id=None,
    pad_id=0,
    prompt=(),
    repetition_penalty=None,
    ngram=None,
    suppress=(),
    min_new_tokens=0,
):
    """Greedy decoding with the raw-logit processors, one row, in numpy."""
    history = [int(t) for t in prompt if t >= 0]
    tokens, log_probs = [], []
    prev, logits = chain.prev[row], chain.logits[row].astype(np.float64)
    for step in range(max_new_tokens):
        z = logits[None]
        if repetition_penalty is not None:
            z = np_repetition_penalty(z, [history], repetition_penalty)
        z = z[0].copy()
        if ngram is not None:
            z[list(np_ngram_banned(history, ngram))] = -np.inf
        z[list(suppress)] = -np.inf
        if eos_id is not None and step < min_new_tokens:
            z[eos_id] = -np.inf
        if np.all(np.isneginf(z)):
            token, log_prob = int(np.argmax(logits)), 0.0
        else:
            token = int(np.argmax(z))
            log_prob = np_log_softmax(z)[token]
        tokens.append(token)
        log_probs.append(log_prob)
        history.append(token)
        if token == eos_id:
            break
        logits, prev = chain.table[prev, token].astype(np.float64), token
    length = len(tokens)
    pad = max_new_tokens - length
    return tokens + [pad_id] * pad, log_probs + [0.0] * pad, length


# ---------------------------------------------------------------------------
# logits processors


class ProcessorTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(0)
        # Rounded to one decimal so that some rows have ties.
        self.logits = np.round(rng.standard_normal((6, 7)) * 2, 1).astype(np.float32)

    @chex.variants(with_jit=True, without_jit=True)
    def test_temperature(self):
        scale = self.variant(decoding.apply_temperature)
        for temperature in (0.3, 1.0, 2.5):
            np.testing.assert_allclose(
                jax.nn.log_softmax(scale(self.logits, temperature)),
                np_log_softmax(self.logits / temperature),
                rtol=1e-5,
                atol=1e-5,
            )
        np.testing.assert_array_equal(scale(self.logits, 0.0), self.logits)
        extreme = scale(jnp.array([[1e4, -1e4, 0.0]]), 1e-36)  # overflows, to -inf only
        np.testing.assert_array_equal(extreme, [[0.0, -np.inf, -np.inf]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_top_k_keeps_exactly_k_and_breaks_ties_to_lower_ids(self):
        top_k = self.variant(decoding.apply_top_k)
        for k in (1, 2, 3, 6):
            kept = np.isfinite(top_k(self.logits, k))
            np.testing.assert_array_equal(kept, np_top_k_mask(self.logits, k))
            np.testing.assert_array_equal(kept.sum(-1), k)
        for k_all in (0, 7, 100):  # 0 is off; more than V keeps all
            np.testing.assert_array_equal(top_k(self.logits, k_all), self.logits)
        tied = top_k(jnp.array([[1.0, 2.0, 2.0, 2.0]]), 2)
        np.testing.assert_array_equal(tied, [[-np.inf, 2.0, 2.0, -np.inf]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_top_p_matches_reference(self):
        top_p = self.variant(decoding.apply_top_p)
        for p in (0.05, 0.3, 0.5, 0.9, 0.99):
            np.testing.assert_array_equal(
                np.isfinite(top_p(self.logits, p)), np_top_p_mask(self.logits, p)
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_top_p_edge_cases(self):
        top_p = self.variant(decoding.apply_top_p)
        dyadic = np.log(np.array([[0.0625, 0.5, 0.125, 0.25, 0.0625]], np.float32))
        for p, kept in [
            (0.75, [1, 3]),  # mass exactly p: no more
            (0.7501, [1, 2, 3]),  # just above: the crossing one too
            (0.875, [1, 2, 3]),
            (1.0, [0, 1, 2, 3, 4]),  # p = 1 keeps all
            (1e-6, [1]),
        ]:  # tiny p keeps the argmax
            self.assertEqual(
                np.flatnonzero(np.isfinite(top_p(dyadic, p))).tolist(),
                kept,
                msg=f"p={p}",
            )
            self.assertEqual(
                np.flatnonzero(np_top_p_mask(dyadic, p)[0]).tolist(),
                kept,
                msg=f"reference, p={p}",
            )
        uniform = top_p(jnp.zeros((1, 4)), 0.5)  # exact in float32; ties to lower ids
        np.testing.assert_array_equal(np.isfinite(uniform), [[1, 1, 0, 0]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_top_k_and_top_p_on_a_wide_vocabulary_with_ties(self):
        """V = 3000 with values from a few levels (long runs of exact ties,
        0.0 and -0.0 among them, which tie) and banned -inf tokens: the cut
        found by halving the key range equals the stable sort's."""
        rng = np.random.default_rng(7)
        levels = np.array([-np.inf, -2.0, -0.0, 0.0, 0.5, 1.25, 3.0], np.float32)
        logits = levels[rng.integers(0, len(levels), (3, 3000))]
        logits[:, :3] = 3.0  # the row's largest value occurs at least thrice
        top_k, top_p = (
            self.variant(decoding.apply_top_k),
            self.variant(decoding.apply_top_p),
        )
        for k in (1, 2, 700, 2999):
            np.testing.assert_array_equal(
                np.isfinite(top_k(logits, k)),
                np_top_k_mask(logits, k) & np.isfinite(logits),
            )
        for p in (0.01, 0.3, 0.9):
            np.testing.assert_array_equal(
                np.isfinite(top_p(logits, p)), np_top_p_mask(logits, p)
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_top_p_with_mass_exactly_p_keeps_exactly_that_set(self):
        """Two-decimal distributions; p = the exact mass of the top j tokens."""
        rng = np.random.default_rng(3)
        probs = rng.integers(1, 30, (200, 5)).astype(np.float64)
        probs = np.round(probs / probs.sum(-1, keepdims=True), 2)
        probs[:, -1] = 1.0 - probs[:, :-1].sum(-1)
        usable = (probs > 0).all(-1) & (
            np.sort(probs, -1)[:, 1:] != np.sort(probs, -1)[:, :-1]
        ).all(-1)
        probs = probs[usable]
        num_top = rng.integers(1, 5, len(probs))
        mass = np.round(
            [np.sort(row)[::-1][:j].sum() for row, j in zip(probs, num_top)], 10
        )
        top_p = self.variant(jax.vmap(decoding.apply_top_p))
        kept = np.isfinite(
            top_p(np.log(probs).astype(np.float32), mass.astype(np.float32))
        )
        np.testing.assert_array_equal(kept.sum(-1), num_top)

    @chex.variants(with_jit=True, without_jit=True)
    def test_min_p(self):
        min_p = self.variant(decoding.apply_min_p)
        for m in (0.0, 0.05, 0.3, 0.9, 1.0):
            np.testing.assert_array_equal(
                np.isfinite(min_p(self.logits, m)), np_min_p_mask(self.logits, m)
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_repetition_penalty(self):
        rng = np.random.default_rng(1)
        history = rng.integers(-1, 7, (6, 5)).astype(np.int32)
        penalize = self.variant(decoding.apply_repetition_penalty)
        for penalty in (0.5, 1.3, 2.0):
            np.testing.assert_allclose(
                penalize(self.logits, history, penalty),
                np_repetition_penalty(self.logits, history, penalty),
                rtol=1e-6,
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_no_repeat_ngram(self):
        rng = np.random.default_rng(2)
        history = rng.integers(0, 3, (6, 9)).astype(np.int32)
        history[:2, :3] = decoding.NO_TOKEN
        for n in (1, 2, 3):
            banned = self.variant(decoding.apply_no_repeat_ngram, static_argnums=2)(
                self.logits, history, n
            )
            expected = np.zeros(self.logits.shape, bool)
            for row in range(6):
                expected[row, list(np_ngram_banned(history[row], n))] = True
            np.testing.assert_array_equal(
                np.isneginf(banned), expected, err_msg=f"n={n}"
            )
            self.assertTrue(expected.any())

    @chex.variants(with_jit=True, without_jit=True)
    def test_suppress_and_min_new_tokens(self):
        suppressed = self.variant(decoding.apply_suppress_tokens, static_argnums=1)(
            self.logits, (1, 4)
        )
        np.testing.assert_array_equal(
            np.isneginf(suppressed).sum(0), [0, 6, 0, 0, 6, 0, 0]
        )
        early = self.variant(
            lambda z, n: decoding.apply_min_new_tokens(z, n, min_new_tokens=3, eos_id=2)
        )(self.logits, jnp.arange(6))
        np.testing.assert_array_equal(np.isneginf(early)[:, 2], [1, 1, 1, 0, 0, 0])
        self.assertEqual(int(np.isneginf(early).sum()), 3)

    @chex.variants(with_jit=True, without_jit=True)
    def test_all_removed_falls_back_to_raw_argmax(self):
        process = self.variant(
            lambda z, history: decoding.process_logits(
                z, repetition_penalty=2.0, history=history, suppress_tokens=(0, 1, 2)
            )
        )
        # The penalty moves the argmax from 0 to 1; the fallback uses the raw one.
        out = process(jnp.array([[3.0, 2.9, 1.0]]), jnp.array([[0]]))
        np.testing.assert_array_equal(out, [[0.0, -np.inf, -np.inf]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_never_nan(self):
        process = self.variant(
            lambda z, t: decoding.process_logits(
                z, temperature=t, top_k=2, top_p=0.5, min_p=0.5
            )
        )
        huge = jnp.array([[1e4, -1e4, 3e38, -3e38], [-np.inf] * 4])
        for temperature in (0.0, 1e-30, 1.0, 1e30):
            out = process(huge, temperature)
            self.assertFalse(np.isnan(out).any())
            self.assertFalse(np.isnan(jax.nn.log_softmax(out)).any())


# ---------------------------------------------------------------------------
# generate


def generate_greedy(chain, max_new_tokens, step_fn=markov_step, **kwargs):
    return decoding.generate(
        step_fn,
        chain.table,
        chain.logits,
        chain.state(),
        key=jax.random.key(0),
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        **kwargs,
    )


def assert_greedy_matches_numpy(chain, outputs, **settings):
    tokens, log_probs, lengths = outputs
    for row in range(tokens.shape[0]):
        ref_tokens, ref_log_probs, ref_length = np_greedy(
            chain, row, tokens.shape[1], **settings
        )
        np.testing.assert_array_equal(tokens[row], ref_tokens, err_msg=str(settings))
        np.testing.assert_allclose(log_probs[row], ref_log_probs, rtol=1e-5, atol=1e-6)
        assert lengths[row] == ref_length


def test_greedy_matches_numpy_and_stops_when_every_row_has_ended():
    chain = MarkovChain(3, vocab_size=4, batch=5, eos_boost=1.5)
    CALLS.clear()
    outputs = generate_greedy(chain, 10, step_fn=counted_markov_step)
    jax.effects_barrier()
    assert_greedy_matches_numpy(chain, outputs)
    assert len(CALLS) == 9  # the last token's logits are never computed

    CALLS.clear()
    outputs = generate_greedy(
        chain, 10, step_fn=counted_markov_step, eos_id=0, pad_id=3
    )
    jax.effects_barrier()
    assert_greedy_matches_numpy(chain, outputs, eos_id=0, pad_id=3)
    lengths = np.asarray(outputs[2])
    assert lengths.max() < 10 and len(set(lengths)) > 1, lengths
    assert len(CALLS) == lengths.max() - 1


def test_greedy_equals_one_beam_without_eos():
    """Without EOS every hypothesis has length N, so one beam is greedy.

    (With EOS they may differ: greedy stops at an EOS argmax, one beam puts
    the ended hypothesis aside and goes on with the best non-EOS token.)
    """
    chain = MarkovChain(5, vocab_size=4, batch=5)
    tokens, log_probs, _ = generate_greedy(chain, 10)
    beam_tokens, beam_scores, beam_lengths = decoding.beam_search(
        markov_step,
        chain.table,
        chain.logits,
        chain.state(),
        num_beams=1,
        max_new_tokens=10,
        eos_id=None,
        length_penalty=0.6,
    )
    np.testing.assert_array_equal(beam_tokens[:, 0], tokens)
    np.testing.assert_allclose(
        beam_scores[:, 0], log_probs.sum(-1) / np_divisor(10, 0.6, "gnmt"), rtol=1e-5
    )
    np.testing.assert_array_equal(beam_lengths[:, 0], 10)


def test_num_samples_orders_rows_prompt_major_and_top_k_one_is_greedy():
    chain = MarkovChain(11, vocab_size=4, batch=5)
    greedy = generate_greedy(chain, 10)[0]
    sample = lambda **kwargs: decoding.generate(
        markov_step,
        chain.table,
        chain.logits,
        chain.state(),
        key=jax.random.key(1),
        max_new_tokens=10,
        num_samples=3,
        **kwargs,
    )[0]
    np.testing.assert_array_equal(
        sample(temperature=1.0, top_k=1), np.repeat(greedy, 3, axis=0)
    )
    varied = sample(temperature=5.0, top_k=0)  # top_k 0: no filter
    assert len({tuple(row) for row in np.asarray(varied[:3])}) > 1


def test_sampled_frequencies_match_processed_distribution():
    chain = MarkovChain(6, vocab_size=8, batch=1)
    num_samples = 20_000
    configs = [
        dict(temperature=0.6, top_k=0, top_p=1.0, min_p=0.0),
        dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0),
        dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
        dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.25),
    ]
    for seed, config in enumerate(configs):
        tokens, log_probs, _ = decoding.generate(
            markov_step,
            chain.table,
            chain.logits,
            chain.state(),
            key=jax.random.key(seed),
            max_new_tokens=1,
            num_samples=num_samples,
            **config,
        )
        expected = np_sampling_probs(chain.logits, **config)[0]
        counts = np.bincount(np.asarray(tokens[:, 0]), minlength=8)
        kept = expected > 0
        filtering = seed > 0  # every config but the first removes some tokens
        assert (1 < kept.sum() < 8) if filtering else kept.all(), (config, expected)
        assert counts[~kept].sum() == 0, config
        statistic = np.sum(
            (counts[kept] - num_samples * expected[kept]) ** 2
            / (num_samples * expected[kept])
        )
        assert stats.chi2.sf(statistic, kept.sum() - 1) > 1e-3, (config, counts)
        np.testing.assert_allclose(
            np.exp(log_probs[:, 0]), expected[np.asarray(tokens[:, 0])], rtol=1e-4
        )


def test_changing_values_does_not_recompile():
    chain = MarkovChain(7, vocab_size=4, batch=2)
    traces = []

    def step_fn(table, tokens, state):
        traces.append(1)
        return markov_step(table, tokens, state)

    def run(**kwargs):
        decoding.generate(
            step_fn,
            chain.table,
            chain.logits,
            chain.state(),
            key=jax.random.key(0),
            max_new_tokens=3,
            eos_id=0,
            **kwargs,
        )[0].block_until_ready()

    run(temperature=0.7, top_k=2, top_p=0.9, min_p=0.1, min_new_tokens=1)
    compiled = len(traces)
    assert compiled > 0
    run(temperature=0.0, top_k=4, top_p=0.3, min_p=0.0, min_new_tokens=2)
    run(temperature=1.9, top_k=0, top_p=1.0, min_p=0.5, min_new_tokens=0)
    assert len(traces) == compiled
    run(temperature=0.7, top_k=2, top_p=None, min_p=0.1)  # turning one off recompiles
    assert len(traces) > compiled


def test_per_row_knobs_equal_row_by_row_decoding():
    """One batch with a greedy row and rows of different sampling settings:
    the processed logits equal each row's with scalar knobs, a greedy row
    equals greedy decoding, and every sampled token's log-prob is its
    probability under that row's own processed distribution."""
    chain = MarkovChain(16, vocab_size=6, batch=4)
    knobs = dict(
        temperature=np.array([0.0, 0.7, 1.0, 1.5], np.float32),
        top_k=np.array([0, 3, 0, 5], np.int32),
        top_p=np.array([1.0, 1.0, 0.8, 0.95], np.float32),
        min_p=np.array([0.0, 0.0, 0.0, 0.2], np.float32),
    )
    processed = decoding.process_logits(chain.logits, **knobs)
    for row in range(4):
        scalar = {name: value[row] for name, value in knobs.items()}
        np.testing.assert_array_equal(
            processed[row],
            decoding.process_logits(chain.logits[row : row + 1], **scalar)[0],
        )
    tokens, log_probs, _ = decoding.generate(
        markov_step,
        chain.table,
        chain.logits,
        chain.state(),
        key=jax.random.key(2),
        max_new_tokens=5,
        **knobs,
    )
    np.testing.assert_array_equal(tokens[0], generate_greedy(chain, 5)[0][0])
    for row in range(1, 4):
        logits, prev = chain.logits[row], chain.prev[row]
        scalar = {name: value[row] for name, value in knobs.items()}
        for step, token in enumerate(np.asarray(tokens[row])):
            expected = np_sampling_probs(logits[None], **scalar)[0]
            assert expected[token] > 0, (row, step)
            np.testing.assert_allclose(
                np.exp(log_probs[row, step]), expected[token], rtol=1e-4
            )
            logits, prev = chain.table[prev, token], token


def test_nonfinite_logits_end_the_row_with_log_prob_minus_inf():
    """The rule for a model that returns NaN (or +inf, or all -inf) logits:
    that row stops with pad_id and log-prob -inf; the others go on."""
    chain = MarkovChain(17, vocab_size=4, batch=3)
    first = generate_greedy(chain, 4)[0]
    table = chain.table.copy()
    table[chain.prev[1], int(first[1, 0])] = np.nan  # row 1, second step
    table[int(first[2, 0]), int(first[2, 1])] = -np.inf  # row 2, third step
    logits = chain.logits.copy()
    tokens, log_probs, lengths = decoding.generate(
        markov_step,
        table,
        logits,
        chain.state(),
        key=jax.random.key(0),
        max_new_tokens=4,
        temperature=0.0,
        pad_id=3,
    )
    np.testing.assert_array_equal(np.isneginf(log_probs).any(-1), [False, True, True])
    np.testing.assert_array_equal(lengths, [4, 1, 2])
    np.testing.assert_array_equal(tokens[0], first[0])
    np.testing.assert_array_equal(tokens[1], [first[1, 0], 3, 3, 3])
    np.testing.assert_array_equal(tokens[2], [first[2, 0], first[2, 1], 3, 3])
    assert not np.isnan(np.asarray(log_probs)).any()


def test_jit_and_no_jit_agree():
    """Eager (jax.disable_jit), the internal jit, and inside an outer jit."""
    chain = MarkovChain(8, vocab_size=4, batch=2)

    def sample(table, logits, state, key, temperature, top_p):
        return decoding.generate(
            markov_step,
            table,
            logits,
            state,
            key=key,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=3,
            eos_id=0,
            num_samples=2,
        )

    args = (chain.table, chain.logits, chain.state(), jax.random.key(3), 1.2, 0.9)
    with jax.disable_jit():
        expected = sample(*args)
    for got in (sample(*args), jax.jit(sample)(*args)):
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[2], expected[2])


def test_history_processors_in_the_loop_match_numpy():
    chain = MarkovChain(9, vocab_size=4, batch=3)
    prompt = np.array([[-1, -1, 1, 2], [3, 1, 3, -1], [2, 2, 2, 2]], np.int32)
    for penalty in (1.0, 3.0, 0.5):  # 1.0: the n-gram filter alone
        outputs = generate_greedy(
            chain,
            6,
            repetition_penalty=penalty,
            no_repeat_ngram_size=2,
            prompt_tokens=prompt,
        )
        for row in range(3):
            ref_tokens, ref_log_probs, _ = np_greedy(
                chain, row, 6, prompt=prompt[row], repetition_penalty=penalty, ngram=2
            )
            np.testing.assert_array_equal(
                outputs[0][row], ref_tokens, err_msg=str(penalty)
            )
            np.testing.assert_allclose(
                outputs[1][row], ref_log_probs, rtol=1e-5, atol=1e-6
            )


def test_min_new_tokens_suppress_and_fallback_in_the_loop():
    chain = MarkovChain(10, vocab_size=4, batch=4, eos_boost=4.0)
    settings = dict(eos_id=0, min_new_tokens=3)
    outputs = generate_greedy(chain, 5, suppress_tokens=[2], **settings)
    assert_greedy_matches_numpy(chain, outputs, suppress=[2], **settings)
    assert (outputs[2] >= 3).all()
    outputs = generate_greedy(chain, 5, suppress_tokens=[0, 1, 2, 3], **settings)
    assert_greedy_matches_numpy(chain, outputs, suppress=[0, 1, 2, 3], **settings)
    np.testing.assert_array_equal(outputs[1], 0.0)


# ---------------------------------------------------------------------------
# beam search


def brute_force_scores(chain, row, max_new_tokens, eos_id, alpha, penalty):
    """{sequence: score} for every hypothesis: ended by EOS, or of length N."""
    scores = {}
    for length in range(1, max_new_tokens + 1):
        for sequence in itertools.product(range(chain.vocab_size), repeat=length):
            ends_with_eos = eos_id is not None and sequence[-1] == eos_id
            if eos_id is not None and eos_id in sequence[:-1]:
                continue
            if length < max_new_tokens and not ends_with_eos:
                continue
            log_prob = sum(chain.log_probs(row, sequence))
            scores[sequence] = log_prob / np_divisor(length, alpha, penalty)
    return scores


def assert_matches_brute_force(
    chain, outputs, max_new_tokens, eos_id, alpha, penalty, pad_id
):
    """The n-best scores are the n largest; each sequence has its score.

    (Sequences with exactly equal scores exist in a Markov chain, e.g. ones
    that make the same transitions in another order; either order is right.)
    """
    tokens, scores, lengths = (np.asarray(x) for x in outputs)
    for row in range(tokens.shape[0]):
        every = brute_force_scores(chain, row, max_new_tokens, eos_id, alpha, penalty)
        best = sorted(every.values(), reverse=True)[: tokens.shape[1]]
        np.testing.assert_allclose(scores[row], best, rtol=1e-5, atol=1e-5)
        found = []
        for rank, length in enumerate(lengths[row]):
            sequence = tuple(tokens[row, rank, :length].tolist())
            np.testing.assert_array_equal(tokens[row, rank, length:], pad_id)
            assert sequence in every, (row, rank, sequence)
            np.testing.assert_allclose(
                every[sequence], scores[row, rank], rtol=1e-5, atol=1e-5
            )
            found.append(sequence)
        assert len(set(found)) == len(found), found


@pytest.mark.parametrize("eos_id", [None, 0])
@pytest.mark.parametrize("penalty", ["gnmt", "hf"])
def test_beam_search_with_enough_beams_is_exhaustive(eos_id, penalty):
    chain = MarkovChain(12, vocab_size=3, batch=2, eos_boost=-0.5)
    for alpha in (0.0, 0.6, 2.0, -0.5):
        outputs = decoding.beam_search(
            markov_step,
            chain.table,
            chain.logits,
            chain.state(),
            num_beams=27,
            max_new_tokens=4,
            eos_id=eos_id,
            length_penalty=alpha,
            penalty=penalty,
            num_return_sequences=6,
            pad_id=7,
        )
        assert_matches_brute_force(chain, outputs, 4, eos_id, alpha, penalty, pad_id=7)


@pytest.mark.parametrize(
    "penalty,alpha", [("gnmt", 0.0), ("gnmt", 0.6), ("gnmt", 1.0), ("hf", 0.5)]
)
def test_beam_search_stops_early_with_the_exact_result(penalty, alpha):
    """EOS is likely, so the n-best is settled before max_new_tokens."""
    for seed in (13, 15):
        chain = MarkovChain(seed, vocab_size=3, batch=2, eos_boost=2.5)
        CALLS.clear()
        outputs = decoding.beam_search(
            counted_markov_step,
            chain.table,
            chain.logits,
            chain.state(),
            num_beams=128,
            max_new_tokens=8,
            eos_id=0,
            length_penalty=alpha,
            penalty=penalty,
            num_return_sequences=4,
        )
        jax.effects_barrier()
        assert len(CALLS) < 7, (seed, len(CALLS))
        assert_matches_brute_force(chain, outputs, 8, 0, alpha, penalty, pad_id=0)


def test_beam_search_goes_on_while_a_longer_hypothesis_can_still_win():
    """[EOS] ends at once with log 0.6 = -0.51; the live beam [1] has log 0.4
    = -0.92 and 1 -> 1 is almost certain. Ended at L = 2 it would score at best
    -0.92 / d(2) = -0.79, but at L = N = 8 it scores -0.92 / d(8) = -0.42
    (gnmt, alpha = 1), so a bound that looks only at the next length (or the
    current one) would stop after one step with the wrong answer.
    """
    chain = MarkovChain(0, vocab_size=3, batch=1)
    chain.logits = np.log(np.array([[0.6, 0.4, 1e-6]], np.float32))
    chain.table[:, 1] = np.log(np.array([1e-4, 1 - 2e-4, 1e-4], np.float32))
    outputs = decoding.beam_search(
        markov_step,
        chain.table,
        chain.logits,
        chain.state(),
        num_beams=2,
        max_new_tokens=8,
        eos_id=0,
        length_penalty=1.0,
        penalty="gnmt",
    )
    np.testing.assert_array_equal(outputs[0][0, 0], [1] * 8)
    assert_matches_brute_force(chain, outputs, 8, 0, 1.0, "gnmt", pad_id=0)


def test_beam_search_with_fewer_hypotheses_than_asked():
    chain = MarkovChain(14, vocab_size=2, batch=1)
    tokens, scores, lengths = decoding.beam_search(
        markov_step,
        chain.table,
        chain.logits,
        chain.state(),
        num_beams=3,
        max_new_tokens=1,
        eos_id=0,
        num_return_sequences=3,
        pad_id=5,
    )
    assert np.isfinite(scores[0, :2]).all() and np.isneginf(scores[0, 2])
    np.testing.assert_array_equal(lengths[0], [1, 1, 0])
    np.testing.assert_array_equal(tokens[0, 2], [5])


# ---------------------------------------------------------------------------
# detokenize


class Letters:
    def decode(self, ids):
        return "".join("abcdefgh"[i] for i in ids)


def test_detokenize_cuts_at_eos_and_drops_padding():
    ids = np.array([[0, 1, 7, 2], [3, 3, 3, 3], [7, 0, 0, 0]])
    assert decoding.detokenize(ids, Letters(), eos_id=7) == ["ab", "dddd", ""]
    assert decoding.detokenize(ids[1], Letters(), pad_id=3) == ""
    assert decoding.detokenize(ids[None], Letters(), eos_id=7) == [["ab", "dddd", ""]]
    assert decoding.detokenize(ids[0], Letters()) == "abhc"


def test_detokenize_with_the_project_and_library_tokenizers():
    import tokenizers
    from tokenizers import models

    char = data.CharTokenizer.train("to be or not")
    ids = char.encode("to be")
    assert decoding.detokenize(jnp.array(ids), char) == "to be"
    words = tokenizers.Tokenizer(
        models.WordLevel({"to": 0, "be": 1, "<eos>": 2}, unk_token="<eos>")
    )
    assert decoding.detokenize([[0, 1, 2, 0]], words, eos_id=2) == ["to be"]


# ---------------------------------------------------------------------------
# bad input

CHAIN = MarkovChain(15, vocab_size=4, batch=2)


def _generate(**kwargs):
    settings = dict(key=jax.random.key(0), max_new_tokens=2)
    logits, state = (
        kwargs.pop("logits", CHAIN.logits),
        kwargs.pop("state", CHAIN.state()),
    )
    return decoding.generate(
        markov_step, CHAIN.table, logits, state, **{**settings, **kwargs}
    )


def _beam(**kwargs):
    settings = dict(num_beams=2, max_new_tokens=2, eos_id=0)
    logits, state = (
        kwargs.pop("logits", CHAIN.logits),
        kwargs.pop("state", CHAIN.state()),
    )
    return decoding.beam_search(
        markov_step, CHAIN.table, logits, state, **{**settings, **kwargs}
    )


@pytest.mark.parametrize(
    "call,error,fragment",
    [
        (lambda: _generate(top_p=0.0), ValueError, "top_p must be in (0, 1]"),
        (lambda: _generate(top_p=1.5), ValueError, "top_p must be in (0, 1]"),
        (lambda: _generate(top_k=-1), ValueError, "top_k must be in [0"),
        (lambda: _generate(top_k=2.5), TypeError, "top_k must have an integer dtype"),
        (lambda: _generate(min_p=1.5), ValueError, "min_p must be in [0, 1]"),
        (lambda: _generate(min_p=-0.1), ValueError, "min_p must be in [0, 1]"),
        (lambda: _generate(temperature=-1.0), ValueError, "temperature must be in [0"),
        (
            lambda: _generate(repetition_penalty=0.0),
            ValueError,
            "repetition_penalty must be in (0",
        ),
        (
            lambda: _generate(max_new_tokens=0),
            ValueError,
            "max_new_tokens must be an integer >= 1",
        ),
        (
            lambda: _generate(num_samples=0),
            ValueError,
            "num_samples must be an integer >= 1",
        ),
        (
            lambda: _generate(no_repeat_ngram_size=0),
            ValueError,
            "no_repeat_ngram_size must",
        ),
        (
            lambda: _generate(eos_id=4),
            ValueError,
            "eos_id must be an integer in [0, V)",
        ),
        (lambda: _generate(suppress_tokens=[4]), ValueError, "suppress_tokens must be"),
        (
            lambda: _generate(min_new_tokens=-1),
            ValueError,
            "min_new_tokens must be in [0",
        ),
        (
            lambda: _generate(
                repetition_penalty=2.0, prompt_tokens=jnp.zeros((3, 2), jnp.int32)
            ),
            ValueError,
            "prompt_tokens must have shape [B, P]",
        ),
        (
            lambda: _generate(logits=CHAIN.logits[0]),
            ValueError,
            "logits must have shape [B, V]",
        ),
        (
            lambda: _generate(logits=CHAIN.logits[None]),
            ValueError,
            "logits must have shape [B, V]",
        ),
        (
            lambda: _generate(state={"prev": jnp.zeros((3,), jnp.int32)}),
            ValueError,
            "every leaf of state must have the batch axis B = 2",
        ),
        (
            lambda: _generate(state={"prev": CHAIN.prev, "scale": jnp.float32(1.0)}),
            ValueError,
            "state['scale'] has shape ()",
        ),
        (lambda: _beam(num_beams=0), ValueError, "num_beams must be an integer >= 1"),
        (
            lambda: _beam(num_return_sequences=3),
            ValueError,
            "num_return_sequences must be <= num_beams",
        ),
        (
            lambda: _beam(max_new_tokens=0),
            ValueError,
            "max_new_tokens must be an integer >= 1",
        ),
        (
            lambda: _beam(penalty="wu"),
            ValueError,
            "penalty must be one of 'gnmt', 'hf'",
        ),
        (lambda: _beam(eos_id=-1), ValueError, "eos_id must be an integer in [0, V)"),
        (
            lambda: _beam(length_penalty=float("nan")),
            ValueError,
            "length_penalty must be finite",
        ),
        (
            lambda: _beam(logits=CHAIN.logits[0]),
            ValueError,
            "logits must have shape [B, V]",
        ),
        (lambda: _beam(state=jnp.zeros((1, 2))), ValueError, "every leaf of state"),
        (
            lambda: decoding.apply_top_p(CHAIN.logits, 0.0),
            ValueError,
            "top_p must be in (0, 1]",
        ),
        (
            lambda: decoding.apply_top_k(CHAIN.logits, -2),
            ValueError,
            "top_k must be in [0",
        ),
        (
            lambda: decoding.apply_min_p(CHAIN.logits, 2.0),
            ValueError,
            "min_p must be in [0, 1]",
        ),
        (
            lambda: decoding.apply_temperature(CHAIN.logits, -0.5),
            ValueError,
            "temperature must be in [0",
        ),
        (
            lambda: decoding.apply_repetition_penalty(
                CHAIN.logits, jnp.zeros((2, 1), jnp.int32), -1.0
            ),
            ValueError,
            "repetition_penalty must be in (0",
        ),
        (
            lambda: decoding.process_logits(CHAIN.logits, no_repeat_ngram_size=2),
            ValueError,
            "history is required",
        ),
        (
            lambda: decoding.apply_top_k(jnp.array([1, 2]), 1),
            TypeError,
            "logits must have a floating-point dtype",
        ),
        (
            lambda: decoding.length_penalty_divisor(3, 0.6, "gnmt2"),
            ValueError,
            "penalty must be one of",
        ),
        (
            lambda: decoding.detokenize(3, Letters()),
            ValueError,
            "ids must have shape [..., N]",
        ),
        (
            lambda: decoding.detokenize([1], object()),
            TypeError,
            "tokenizer must have a decode",
        ),
    ],
)
def test_bad_input_is_named(call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)


# ---------------------------------------------------------------------------
# through model.py's KV cache


def test_beam_search_through_the_kv_cache_matches_recomputing_the_prefix(monkeypatch):
    """Beam search on the model's cache (kv_cache.py; repeated to beams sharing the
    prompt's slots, reordered by moving slot pointers) gives what a step_fn
    that reruns the model on the whole prefix gives. Row 1's prompt is
    shorter than row 0's. MIN_SPAN = 4 makes the attention spans (4, 8, 16,
    19) and the cache's pieces (4, 4, 8, 3) small, so that decoding crosses
    several of them, and max_len 19 makes the last piece a short one.
    (tests/lm/test_kv_cache.py checks the cache's logits step by step and
    tests/lm/test_model.py greedy decoding through it.)"""
    from lmhead.lm import kv_cache
    from lmhead.lm import model as model_lib

    monkeypatch.setattr(kv_cache, "MIN_SPAN", 4)
    model = model_lib.DecoderLM(
        vocab_size=11, num_layers=2, num_heads=2, d_model=16, mlp_dim=32, max_len=19
    )
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, 11, (2, 6)), jnp.int32)
    lengths_prompt = jnp.array([6, 3], jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), prompt)["params"]
    # Away from the near-uniform init, so that rankings are clear-cut.
    params = jax.tree.map(lambda p: p + 0.3 * rng.standard_normal(p.shape), params)
    forward = jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))

    def recompute(params, tokens, state):
        rows = jnp.arange(tokens.shape[0])
        buffer = state["tokens"].at[rows, state["length"]].set(tokens)
        return forward(params, buffer)[rows, state["length"]], {
            "tokens": buffer,
            "length": state["length"] + 1,
        }

    buffer = jnp.zeros((2, 19), jnp.int32).at[:, :6].set(prompt)
    recompute_logits = forward(params, buffer)[jnp.arange(2), lengths_prompt - 1]
    recompute_state = {"tokens": buffer, "length": lengths_prompt}
    cache_logits, cache = model_lib.prefill(
        model, params, prompt, lengths_prompt, max_new_tokens=13
    )
    cached = model_lib.make_step_fn(model)
    np.testing.assert_allclose(cache_logits, recompute_logits, rtol=1e-5, atol=1e-5)

    beams = lambda step_fn, logits, state: decoding.beam_search(
        step_fn,
        params,
        logits,
        state,
        num_beams=4,
        max_new_tokens=13,
        eos_id=None,
        num_return_sequences=3,
    )
    tokens, scores, lengths = beams(cached, cache_logits, cache)
    expected = beams(recompute, recompute_logits, recompute_state)
    np.testing.assert_array_equal(tokens, expected[0])
    np.testing.assert_allclose(scores, expected[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(lengths, expected[2])
    # Each score is its sequence's log-prob under the model, by teacher forcing.
    for row, rank in itertools.product(range(2), range(3)):
        start, length = int(lengths_prompt[row]), int(lengths[row, rank])
        sequence = np.asarray(buffer[row]).copy()
        sequence[start : start + length] = tokens[row, rank, :length]
        log_probs = np_log_softmax(forward(params, jnp.asarray(sequence[None]))[0])
        total = sum(
            log_probs[start - 1 + t, sequence[start + t]] for t in range(length)
        )
        np.testing.assert_allclose(
            scores[row, rank], total / np_divisor(length, 0.6, "gnmt"), rtol=1e-4
        )


def test_beam_search_through_the_kv_cache_equals_brute_force(monkeypatch):
    """With K = V ** (N - 1) beams nothing is pruned, so the n-best from the
    model's cache (in pieces of 2, 2, 3 slots: MIN_SPAN = 2) must be the n-best
    of all V ** N continuations, scored by running the model on each."""
    from lmhead.lm import kv_cache
    from lmhead.lm import model as model_lib

    monkeypatch.setattr(kv_cache, "MIN_SPAN", 2)
    vocab, num_new = 4, 3
    model = model_lib.DecoderLM(
        vocab_size=vocab, num_layers=1, num_heads=2, d_model=8, mlp_dim=16, max_len=7
    )
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(0, vocab, (2, 4)), jnp.int32)
    prompt_lengths = np.array([4, 3])
    params = jax.jit(model.init)(jax.random.key(1), prompt)["params"]
    params = jax.tree.map(lambda p: p + 0.5 * rng.standard_normal(p.shape), params)
    logits, cache = model_lib.prefill(
        model, params, prompt, jnp.asarray(prompt_lengths), max_new_tokens=num_new
    )
    tokens, scores, _ = decoding.beam_search(
        model_lib.make_step_fn(model),
        params,
        logits,
        cache,
        num_beams=vocab**2,
        max_new_tokens=num_new,
        eos_id=None,
        length_penalty=0.0,
        num_return_sequences=3,
    )
    continuations = np.array(list(itertools.product(range(vocab), repeat=num_new)))
    for row, start in enumerate(prompt_lengths):
        sequences = np.concatenate(
            [
                np.tile(np.asarray(prompt[row, :start]), (len(continuations), 1)),
                continuations,
            ],
            1,
        )
        log_probs = np_log_softmax(
            model.apply({"params": params}, jnp.asarray(sequences))
        )
        totals = sum(
            log_probs[np.arange(len(sequences)), start - 1 + t, continuations[:, t]]
            for t in range(num_new)
        )
        best = np.argsort(-totals, kind="stable")[:3]
        np.testing.assert_array_equal(tokens[row], continuations[best])
        np.testing.assert_allclose(scores[row], totals[best], rtol=1e-5, atol=1e-5)
