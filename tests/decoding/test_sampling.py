"""Tests for lmhead/decoding/sampling.py (generate) on a Markov chain,
against numpy greedy decoding and the processed distribution."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from lmhead import decoding
from tests.decoding.references import (
    CALLS,
    UNIFORM_LOGITS,
    UNIFORM_TABLE,
    MarkovChain,
    assert_greedy,
    counted_markov_step,
    generate_greedy,
    markov_step,
    np_sampling_probs,
    run_chain,
    uniform_markov,
)
from tests.errors import bad_input_test, keyword_rows


def test_greedy_matches_numpy_and_stops_when_every_row_has_ended():
    chain = MarkovChain(3, vocab_size=4, batch=5, eos_boost=1.5)
    CALLS.clear()
    outputs = generate_greedy(chain, 10, step_fn=counted_markov_step)
    jax.effects_barrier()
    assert_greedy(chain, outputs)
    assert len(CALLS) == 9  # the last token's logits are never computed

    CALLS.clear()
    outputs = generate_greedy(
        chain, 10, step_fn=counted_markov_step, eos_id=0, pad_id=3
    )
    jax.effects_barrier()
    assert_greedy(chain, outputs, eos_id=0, pad_id=3)
    lengths = np.asarray(outputs[2])
    assert lengths.max() < 10 and len(set(lengths)) > 1, lengths
    assert len(CALLS) == lengths.max() - 1


def test_num_samples_orders_rows_prompt_major_and_top_k_one_is_greedy():
    chain = MarkovChain(11, vocab_size=4, batch=5)
    greedy = generate_greedy(chain, 10)[0]
    sample = lambda **kwargs: run_chain(
        chain, key=jax.random.key(1), max_new_tokens=10, num_samples=3, **kwargs
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
        tokens, log_probs, *_ = run_chain(
            chain,
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
    a greedy row equals greedy decoding, and every sampled token's log-prob
    is its probability under that row's own processed distribution
    (process_logits' rows equal row-by-row calls: test_processors.py)."""
    chain = MarkovChain(16, vocab_size=6, batch=4)
    knobs = dict(
        temperature=np.array([0.0, 0.7, 1.0, 1.5], np.float32),
        top_k=np.array([0, 3, 0, 5], np.int32),
        top_p=np.array([1.0, 1.0, 0.8, 0.95], np.float32),
        min_p=np.array([0.0, 0.0, 0.0, 0.2], np.float32),
    )
    tokens, log_probs, *_ = run_chain(
        chain, key=jax.random.key(2), max_new_tokens=5, **knobs
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
    tokens, log_probs, lengths, *_ = decoding.generate(
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
        assert_greedy(
            chain,
            outputs,
            lambda row: dict(prompt=prompt[row]),
            repetition_penalty=penalty,
            ngram=2,
        )


def test_min_new_tokens_suppress_and_fallback_in_the_loop():
    chain = MarkovChain(10, vocab_size=4, batch=4, eos_boost=4.0)
    settings = dict(eos_id=0, min_new_tokens=3)
    outputs = generate_greedy(chain, 5, suppress_tokens=[2], **settings)
    assert_greedy(chain, outputs, suppress=[2], **settings)
    assert (outputs[2] >= 3).all()
    outputs = generate_greedy(chain, 5, suppress_tokens=[0, 1, 2, 3], **settings)
    assert_greedy(chain, outputs, suppress=[0, 1, 2, 3], **settings)
    np.testing.assert_array_equal(outputs[1], 0.0)


# ---------------------------------------------------------------------------
# bad input: each case raises exactly the expected type with a message that
# names the argument, and what is allowed where that is the point
# (tests/errors.py).


def uniform_generate(logits=UNIFORM_LOGITS, state=(), **kwargs):
    return decoding.generate(
        uniform_markov,
        UNIFORM_TABLE,
        logits,
        state,
        key=jax.random.key(0),
        **{"max_new_tokens": 2, **kwargs},
    )


# The knobs' ranges are SamplingKnobs.check's (test_knobs.py); here, that
# generate checks them, and its own arguments.
STATE = {"cache": jnp.zeros((2, 4)), "scale": jnp.float32(1.0)}
PROMPT = jnp.zeros((3, 2), jnp.int32)
BAD_INPUTS = keyword_rows(
    "generate",
    uniform_generate,
    [
        ("logits rank 3", dict(logits=UNIFORM_LOGITS[None]), ValueError, "logits"),
        ("logits rank 1", dict(logits=UNIFORM_LOGITS[0]), ValueError, "[B, V]"),
        ("max_new_tokens 0", dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        ("max_new_tokens 2.0", dict(max_new_tokens=2.0), TypeError, "max_new_tokens"),
        ("num_samples 0", dict(num_samples=0), ValueError, "num_samples"),
        ("temperature < 0", dict(temperature=-0.5), ValueError, "temperature"),
        ("top_k float", dict(top_k=2.0), TypeError, "top_k"),
        ("top_p of 3 rows", dict(top_p=jnp.full(3, 0.9)), ValueError, "top_p"),
        ("min_p > 1", dict(min_p=1.5), ValueError, ("min_p", "[0, 1]")),
        ("ngram 0", dict(no_repeat_ngram_size=0), ValueError, "no_repeat_ngram_size"),
        ("eos_id = V", dict(eos_id=5), ValueError, "eos_id"),
        ("suppress_tokens", dict(suppress_tokens=[7]), ValueError, "suppress_tokens"),
        ("state's batch", dict(state=PROMPT), ValueError, ("state", "B = 2")),
        ("state scalar leaf", dict(state=STATE), ValueError, "state['scale']"),
        (
            "prompt_tokens batch",
            dict(repetition_penalty=1.2, prompt_tokens=PROMPT),
            ValueError,
            "prompt_tokens",
        ),
    ],
)


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


class KeyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_greedy_steps_leave_the_key_and_sampled_ones_split_it(self):
        """A step whose every row is greedy draws nothing and hands its one key
        on unsplit; with one sampled row it splits it, as every step did."""
        logits = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
        key = jax.random.key(0)
        rows = decoding.DecodeRows(
            logits=logits, key=key, generated=jnp.array([0, 0]),
            limits=jnp.array([4, 4]), finish_reasons=jnp.array([0, 0]),
            history=None, counts=None, stop_carry=(),
        )  # fmt: skip
        config = decoding.StepConfig()

        def step(temperature):
            knobs = decoding.SamplingKnobs(temperature=temperature).as_arrays()
            return decoding.decode_step(rows, knobs, (), config, step=jnp.int32(0))

        split = jax.random.key_data(jax.random.split(key)[0])
        greedy_rows, greedy = self.variant(step)(jnp.array([0.0, 0.0]))
        np.testing.assert_array_equal(greedy.tokens, [1, 0])
        np.testing.assert_array_equal(
            jax.random.key_data(greedy_rows.key), jax.random.key_data(key)
        )
        mixed_rows, mixed = self.variant(step)(jnp.array([0.0, 1.0]))
        assert mixed.tokens[0] == 1  # the greedy row's argmax
        np.testing.assert_array_equal(jax.random.key_data(mixed_rows.key), split)
