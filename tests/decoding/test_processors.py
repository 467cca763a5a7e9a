"""Tests for lmhead/decoding/processors.py (and the sort-free top set of
top_set.py) against numpy references, with and without jit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from lmhead import decoding
from tests.decoding.references import (
    MarkovChain,
    np_counts,
    np_min_p_mask,
    np_ngram_banned,
    np_openai_penalties,
    np_repetition_penalty,
    np_top_k_mask,
    np_top_p_mask,
)
from tests.errors import bad_input_test, keyword_rows
from tests.references import log_softmax as np_log_softmax


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
        # p = 1 keeps a tail lighter than the float32 tolerance too: neutral.
        peaked = jnp.array([[10.0, -10.0, -20.0], [0.0, 0.0, 0.0]])
        np.testing.assert_array_equal(
            top_p(peaked, jnp.array([1.0, 0.5])),
            [[10.0, -10.0, -20.0], [0.0, 0.0, -np.inf]],
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_top_k_and_top_p_on_a_wide_vocabulary_with_ties(self):
        """V = 3000 with values from a few levels (long runs of exact ties,
        0.0 and -0.0 among them, which tie, and the smallest normal float32)
        and banned -inf tokens: the cut
        found by halving the key range equals the stable sort's."""
        rng = np.random.default_rng(7)
        levels = np.array([-np.inf, -2.0, -0.0, 0.0, 1.2e-38, 1.25, 3.0], np.float32)
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
        per_row = np.float32([0.5, 1.0, 1.3, 2.0, 0.8, 3.0])
        for penalty in (0.5, 1.3, 2.0, per_row):
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
    def test_suppress_tokens(self):
        suppressed = self.variant(decoding.apply_suppress_tokens, static_argnums=1)(
            self.logits, (1, 4)
        )
        np.testing.assert_array_equal(
            np.isneginf(suppressed).sum(0), [0, 6, 0, 0, 6, 0, 0]
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_presence_and_frequency_penalties_follow_openais_formula(self):
        """Scalar and per-row penalties, of either sign, against the numpy
        formula over counts taken from generated token lists."""
        rng = np.random.default_rng(4)
        generated = [rng.integers(0, 7, n).tolist() for n in (0, 1, 3, 5, 8, 12)]
        counts = np_counts(generated, 7)
        penalize = self.variant(decoding.apply_presence_frequency)
        for presence, frequency in [
            (0.5, 0.0),
            (0.0, 0.3),
            (-1.5, 2.0),
            (np.float32([0, 0.5, -1, 2, 0.1, 1.7]), np.float32([1, 0, 0.2, -2, 3, 0])),
        ]:
            np.testing.assert_allclose(
                penalize(self.logits, counts, presence, frequency),
                np_openai_penalties(self.logits, generated, presence, frequency),
                rtol=1e-6,
                atol=1e-6,
            )
        self.assertTrue((counts > 1).any() and (counts == 0).any())
        # One penalty off: the other alone.
        np.testing.assert_allclose(
            penalize(self.logits, counts, None, 0.3),
            np_openai_penalties(self.logits, generated, 0.0, 0.3),
            rtol=1e-6,
            atol=1e-6,
        )
        np.testing.assert_array_equal(
            penalize(self.logits, None, None, None), self.logits
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_logit_bias_shared_and_per_row(self):
        rng = np.random.default_rng(5)
        bias = self.variant(decoding.apply_logit_bias)
        for shape in [(7,), (6, 7)]:
            values = rng.uniform(-100, 100, shape).astype(np.float32)
            np.testing.assert_allclose(
                bias(self.logits, values),
                np_openai_penalties(self.logits, [[]] * 6, 0.0, 0.0, values),
                rtol=1e-6,
            )
        removed = np.where(self.logits > 0, self.logits, -np.inf)
        out = bias(removed, np.full(7, 100.0, np.float32))
        np.testing.assert_array_equal(np.isneginf(out), np.isneginf(removed))

    @chex.variants(with_jit=True, without_jit=True)
    def test_min_new_tokens_shared_and_per_row_removes_every_eos_id(self):
        per_row = jnp.array([0, 1, 2, 3, 4, 5])
        for eos_id, num_generated, minimum in [
            (2, jnp.arange(6), 3),
            (2, 3, per_row),
            ((2, 5), 3, per_row),
            ((0, 3, 6), jnp.array([0, 0, 5, 1, 4, 4]), per_row),
        ]:
            early = self.variant(
                lambda z, n, m, eos_id=eos_id: decoding.apply_min_new_tokens(
                    z, n, min_new_tokens=m, eos_id=eos_id
                )
            )(self.logits, num_generated, minimum)
            ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)
            expected = np.zeros(self.logits.shape, bool)
            too_early = np.broadcast_to(num_generated, (6,)) < np.asarray(minimum)
            expected[np.ix_(too_early, ids)] = True
            np.testing.assert_array_equal(np.isneginf(early), expected, str(eos_id))
            np.testing.assert_array_equal(early[~expected], self.logits[~expected])
            self.assertTrue(expected.any() and not expected.all())

    @chex.variants(with_jit=True, without_jit=True)
    def test_process_logits_with_every_raw_processor_matches_numpy(self):
        """The documented order: repetition, then presence/frequency and the
        bias, then the bans; at temperature 0 nothing else changes them."""
        rng = np.random.default_rng(8)
        generated = [rng.integers(0, 7, 4).tolist() for _ in range(6)]
        history = np.array(generated, np.int32)
        knobs = decoding.SamplingKnobs(
            temperature=0.0,
            repetition_penalty=np.float32([1.0, 1.5, 2.0, 0.7, 1.2, 3.0]),
            presence_penalty=np.float32([0.0, 0.4, -0.3, 1.0, 0.2, 0.5]),
            frequency_penalty=0.25,
            logit_bias=rng.uniform(-3, 3, (6, 7)).astype(np.float32),
            min_new_tokens=np.int32([0, 9, 0, 9, 0, 9]),
            suppress_tokens=(3,),
        )
        got = self.variant(
            lambda z, knobs, h, c: decoding.process_logits(
                z, knobs, history=h, counts=c, num_generated=4, eos_id=(1, 5)
            )
        )(self.logits, knobs, history, np_counts(generated, 7))
        z = np_repetition_penalty(self.logits, history, knobs.repetition_penalty)
        z = np_openai_penalties(
            z, generated, knobs.presence_penalty, 0.25, knobs.logit_bias
        )
        z[:, 3] = -np.inf
        z[1::2, 1] = z[1::2, 5] = -np.inf
        np.testing.assert_allclose(got, z, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_per_row_knobs_match_row_by_row_calls_bitwise(self):
        """Row b of a batch with per-row knobs equals row b of a call where
        every row has row b's knobs (same shapes: one compile per variant)."""
        rng = np.random.default_rng(9)
        generated = [rng.integers(0, 7, 5).tolist() for _ in range(3)]
        history, counts = np.array(generated, np.int32), np_counts(generated, 7)
        uniform = lambda low, high, shape=3: rng.uniform(low, high, shape)
        rows = dict(  # one value per row
            temperature=uniform(0.5, 2),
            repetition_penalty=uniform(0.5, 2),
            presence_penalty=uniform(-2, 2),
            frequency_penalty=uniform(-2, 2),
            logit_bias=uniform(-5, 5, (3, 7)),
            min_new_tokens=rng.integers(0, 8, 3).astype(np.int32),
        )
        process = self.variant(
            lambda z, knobs, h, c: decoding.process_logits(
                z, knobs, history=h, counts=c, num_generated=4, eos_id=0
            )
        )
        knobs = lambda **values: decoding.SamplingKnobs(**values).as_arrays()
        batch = process(self.logits[:3], knobs(**rows), history, counts)
        for b in range(3):
            row_b = {name: np.repeat(v[b : b + 1], 3, 0) for name, v in rows.items()}
            alone = process(self.logits[:3], knobs(**row_b), history, counts)
            np.testing.assert_array_equal(batch[b], alone[b], f"row {b}")

    @chex.variants(with_jit=True, without_jit=True)
    def test_neutral_new_knobs_change_nothing_bitwise(self):
        """Penalties 0 and a zero bias give the knobs-off result bit for bit
        (the negative zeros and -inf of the logits included)."""
        logits = self.logits.copy()
        logits[0, :3] = [-0.0, 0.0, -np.inf]
        counts = np.random.default_rng(10).integers(0, 3, logits.shape).astype(np.int32)
        process = self.variant(
            lambda z, c, **knobs: decoding.process_logits(
                z, counts=c, min_p=0.1, temperature=0.7, **knobs
            )
        )
        off = process(logits, counts)
        neutral = process(
            logits,
            counts,
            presence_penalty=0.0,
            frequency_penalty=jnp.zeros(6),
            logit_bias=np.zeros(7, np.float32),
        )
        np.testing.assert_array_equal(
            np.asarray(neutral).view(np.int32), np.asarray(off).view(np.int32)
        )

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

    @chex.variants(with_jit=True)
    def test_traced_out_of_range_knobs_follow_their_rules(self):
        """Inside jit the ranges cannot be checked: a repetition penalty
        outside (0, inf) is no penalty, T = inf keeps every token that is not
        -inf at 0, and a penalty that overflows a logit to +inf puts the
        mass there; never NaN."""
        z = jnp.array([[2.0, 0.0, -1.0, -np.inf]])
        history = jnp.array([[0, 1]])
        penalize = self.variant(
            lambda z, theta: decoding.process_logits(
                z, repetition_penalty=theta, history=history, temperature=1.0
            )
        )
        none = decoding.process_logits(z, temperature=1.0)
        for theta in (0.0, -1.0, np.inf, np.nan):
            np.testing.assert_array_equal(penalize(z, theta), none, err_msg=theta)
        overflow = penalize(jnp.array([[3e38, 1.0, 0.0, -np.inf]]), 1e-30)
        np.testing.assert_array_equal(overflow, [[0.0, -np.inf, -np.inf, -np.inf]])
        hot = self.variant(lambda z, t: decoding.process_logits(z, temperature=t))
        np.testing.assert_array_equal(hot(z, np.inf), [[0.0, 0.0, 0.0, -np.inf]])
        np.testing.assert_array_equal(hot(z, np.nan), z)  # acts as T = 0


# ---------------------------------------------------------------------------
# bad input: each case raises exactly the expected type with a message that
# names the argument, and what is allowed where that is the point
# (tests/errors.py).

Z = MarkovChain(15, vocab_size=4, batch=2).logits  # [B, V] = [2, 4]
COUNTS = jnp.zeros((2, 4), jnp.int32)
HISTORY = jnp.zeros((2, 1), jnp.int32)
ROWS_3 = np.ones(3, np.float32)
PROCESSORS = {  # each knob's processor, on Z
    "temperature": lambda t: decoding.apply_temperature(Z, t),
    "top_k": lambda k: decoding.apply_top_k(Z, k),
    "top_p": lambda p: decoding.apply_top_p(Z, p),
    "min_p": lambda m: decoding.apply_min_p(Z, m),
    "repetition_penalty": lambda r: decoding.apply_repetition_penalty(Z, HISTORY, r),
    "logit_bias": lambda b: decoding.apply_logit_bias(Z, b),
    "min_new_tokens": lambda m: decoding.apply_min_new_tokens(
        Z, 0, min_new_tokens=m, eos_id=0
    ),
    "num_generated": lambda n: decoding.apply_min_new_tokens(
        Z, n, min_new_tokens=1, eos_id=0
    ),
    "presence_penalty": lambda p: decoding.apply_presence_frequency(Z, COUNTS, p, None),
    "frequency_penalty": lambda f: decoding.apply_presence_frequency(
        Z, COUNTS, None, f
    ),
    "counts": lambda c: decoding.apply_presence_frequency(Z, c, 0.5, None),
}


def apply(**knob):
    ((name, value),) = knob.items()
    return PROCESSORS[name](value)


def process(logits=Z, **knobs):
    return decoding.process_logits(logits, **knobs)


INF_ROW = np.float32([0, np.inf])
EMPTY, INTEGERS = jnp.zeros((2, 0)), jnp.ones((2, 4), int)
BAD_INPUTS = keyword_rows(
    "apply",
    apply,
    [
        ("counts of V = 5", dict(counts=jnp.zeros((2, 5), jnp.int32)), ValueError),
        ("counts not integers", dict(counts=jnp.zeros((2, 4))), TypeError),
        ("negative counts", dict(counts=-COUNTS - 1), ValueError),
        ("presence of 3 rows", dict(presence_penalty=ROWS_3), ValueError),
        ("frequency NaN", dict(frequency_penalty=np.nan), ValueError),
        ("presence inf", dict(presence_penalty=INF_ROW), ValueError),
        ("bias of V = 5", dict(logit_bias=np.zeros(5)), ValueError),
        ("bias of B = 3", dict(logit_bias=np.zeros((3, 4))), ValueError),
        ("penalty of 3 rows", dict(repetition_penalty=ROWS_3), ValueError),
        ("penalty < 0", dict(repetition_penalty=-1.0), ValueError),
        (
            "min_new_tokens of 3 rows",
            dict(min_new_tokens=ROWS_3.astype(int)),
            ValueError,
        ),
        ("num_generated of 3 rows", dict(num_generated=jnp.zeros(3, int)), ValueError),
        ("top_k < 0", dict(top_k=-2), ValueError),
        ("temperature < 0", dict(temperature=-0.5), ValueError),
        ("top_p 0", dict(top_p=0.0), ValueError, ("top_p", "(0, 1]")),
        ("min_p > 1", dict(min_p=2.0), ValueError, ("min_p", "[0, 1]")),
        ("T inf", dict(temperature=np.inf), ValueError, ("temperature", "[0, inf)")),
        (
            "penalty inf",
            dict(repetition_penalty=np.inf),
            ValueError,
            ("repetition_penalty", "(0, inf)"),
        ),
    ],
) + keyword_rows(
    "process_logits",
    process,
    [
        ("history missing", dict(repetition_penalty=1.2), ValueError, "history"),
        ("ngram, no history", dict(no_repeat_ngram_size=2), ValueError, "history"),
        (
            "no counts",
            dict(frequency_penalty=0.5),
            ValueError,
            ("counts", "frequency_penalty"),
        ),
        ("bias -inf", dict(logit_bias=-INF_ROW[[0, 1, 0, 0]]), ValueError),
        ("an eos id = V", dict(eos_id=(0, 4)), ValueError),
        ("an eos id 1.0", dict(eos_id=1.0), TypeError),
        ("no vocabulary", dict(logits=EMPTY), ValueError, ("logits", "V >= 1")),
        ("int logits", dict(logits=INTEGERS), TypeError, ("logits", "floating-point")),
    ],
)


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
