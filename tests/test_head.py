"""Tests for lmhead/head.py against the numpy references in references.py."""

import functools

import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from lmhead import head
from tests import references
from tests.errors import bad_input_test, keyword_rows, rules_test

SETTINGS = hypothesis.settings(max_examples=25, deadline=None)


def random_arrays(seed, *shapes, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


class UnembedTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_numpy_for_leading_axes_and_options(self):
        w, b = random_arrays(0, (11, 8), (11,))
        cases = [  # shape of h, bias, scale, softcap
            ((8,), None, None, None),
            ((3, 8), b, None, None),
            ((2, 1, 3, 8), None, 0.5, None),
            ((2, 3, 8), b, 0.5, 2.0),
        ]
        for shape, bias, scale, softcap in cases:
            (h,) = random_arrays(1, shape)
            fn = functools.partial(head.unembed, scale=scale, softcap=softcap)
            got = self.variant(fn)(h, w, bias)
            self.assertEqual(got.shape, shape[:-1] + (11,))
            self.assertEqual(got.dtype, jnp.float32)
            want = references.unembed(h, w, bias, scale, softcap)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # The cap binds: without it some logits exceed 2 in magnitude.
        self.assertGreater(np.abs(references.unembed(h, w, b, 0.5)).max(), 2.0)
        self.assertLess(np.abs(got).max(), 2.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_half_precision_inputs_give_float32_of_the_rounded_inputs(self):
        h, w, b = random_arrays(3, (4, 64), (9, 64), (9,))
        for dtype in (jnp.bfloat16, jnp.float16):
            hq, wq, bq = (jnp.asarray(x, dtype) for x in (h, w, b))
            got = self.variant(head.unembed)(hq, wq, bq)
            self.assertEqual(got.dtype, jnp.float32)
            # The reference rounds only the inputs, then works in float64.
            want = references.unembed(
                *(np.asarray(x, np.float32) for x in (hq, wq, bq))
            )
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
            # A half-precision accumulation would be visibly worse than this.
            rounded_out = np.asarray(jnp.asarray(want, dtype), np.float64)
            self.assertGreater(
                np.abs(rounded_out - want).max(), np.abs(np.asarray(got) - want).max()
            )
        fn = functools.partial(head.unembed, out_dtype=jnp.bfloat16)
        got = self.variant(fn)(h, w)
        self.assertEqual(got.dtype, jnp.bfloat16)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), references.unembed(h, w), rtol=1e-2, atol=1e-2
        )


class SoftcapTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_formula_and_bound(self):
        z = np.array([-1e4, -30.0, -1.0, 0.0, 0.5, 29.0, 1e4], np.float32)
        got = self.variant(functools.partial(head.apply_softcap, cap=30.0))(z)
        np.testing.assert_allclose(got, 30.0 * np.tanh(z / 30.0), rtol=1e-6)
        self.assertTrue(np.all(np.abs(got) <= 30.0))


class DistributionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_log_probs_and_probs_match_numpy(self):
        (z,) = random_arrays(5, (2, 3, 6))
        cases = [
            (z * 5.0, 0.3),
            (z * 5.0, 4.0),
            (jnp.asarray(z * 5, jnp.bfloat16), 1.0),
        ]
        for logits, temperature in cases:
            lp = self.variant(head.log_probs)(logits, temperature)
            p = self.variant(head.probs)(logits, temperature)
            want = references.log_softmax(np.asarray(logits, np.float32), temperature)
            self.assertEqual((lp.dtype, p.dtype), (jnp.float32, jnp.float32))
            np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(p, np.exp(want), rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_infinite_logits_follow_the_limit_and_keep_gradients_finite(self):
        # The rule (see RULES below): -inf has probability 0,
        # +inf logits share the mass, a row of -inf is all 0. Rows without
        # infinities are untouched, and no NaN reaches any gradient.
        inf = np.inf
        z = np.array(
            [[-inf, -inf, -inf], [0.5, -inf, 2.0], [inf, 1.0, inf], [0.3, -1.0, 2.0]],
            np.float32,
        )
        p = self.variant(head.probs)(z)
        np.testing.assert_array_equal(p[0], 0.0)
        np.testing.assert_allclose(
            p[1], np.exp(references.log_softmax(z[1])), rtol=1e-6
        )
        np.testing.assert_allclose(p[2], [0.5, 0.0, 0.5])
        np.testing.assert_allclose(
            p[3], np.exp(references.log_softmax(z[3])), rtol=1e-6
        )
        cotangent = np.arange(12, dtype=np.float32).reshape(4, 3)
        for fn in (head.probs, head.log_probs):
            grad = np.asarray(
                self.variant(
                    jax.grad(
                        lambda z, fn=fn: jnp.sum(
                            jnp.where(jnp.isfinite(fn(z)), fn(z), 0.0) * cotangent
                        )
                    )
                )(z)
            )
            self.assertTrue(np.all(np.isfinite(grad)))
            np.testing.assert_array_equal(grad[[0, 2]], 0.0)
            np.testing.assert_allclose(
                grad[3],
                jax.grad(lambda row: jnp.sum(fn(row) * cotangent[3]))(z[3]),
                rtol=1e-5,
                atol=1e-6,
            )

    def test_traced_temperature_zero_is_clamped_to_min_temperature(self):
        # Documented rule: inside jit the temperature is clamped at
        # MIN_TEMPERATURE, giving a finite, (near) one-hot distribution.
        z = np.array([[1.0, 2.0, 1.9999], [5.0, -3.0, 5.0]], np.float32)
        lp = jax.jit(head.log_probs)(z, 0.0)
        p = jax.jit(head.probs)(z, 0.0)
        self.assertTrue(np.all(np.isfinite(lp)) and np.all(np.isfinite(p)))
        # z / T is ~2e6 here, where float32's spacing is 0.125 to 0.25: the
        # compiler may divide before or after subtracting the max, so the
        # error allowed is float32's rounding of z / T.
        rounding = 2 * np.abs(z).max() / head.MIN_TEMPERATURE * np.finfo(np.float32).eps
        np.testing.assert_allclose(
            lp,
            references.log_softmax(z, head.MIN_TEMPERATURE),
            rtol=1e-5,
            atol=rounding,
        )
        np.testing.assert_allclose(p, [[0, 1, 0], [0.5, 0, 0.5]], atol=1e-6)


@SETTINGS
@hypothesis.given(
    z=hnp.arrays(np.float32, (3, 5), elements=st.floats(-1e4, 1e4, width=32)),
    temperature=st.floats(0.05, 20.0),
)
def test_probs_rows_sum_to_one(z, temperature):
    p = np.asarray(head.probs(z, temperature), np.float64)
    lp = np.asarray(head.log_probs(z, temperature), np.float64)
    assert np.all(np.isfinite(lp)) and np.all(p >= 0)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(
        lp, references.log_softmax(z, temperature), rtol=1e-4, atol=1e-3
    )


class OutputDistributionTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_each_output(self):
        h, w, b = random_arrays(6, (2, 5), (7, 5), (7,))
        logits = references.unembed(h, w, b, scale=0.7, softcap=3.0)
        want = {
            "logits": logits,
            "log_probs": references.log_softmax(logits, 2.0),
            "probs": np.exp(references.log_softmax(logits, 2.0)),
        }
        for output, expected in want.items():  # "logits" ignore temperature
            fn = functools.partial(
                head.output_distribution,
                output=output,
                temperature=2.0,
                scale=0.7,
                softcap=3.0,
            )
            got = self.variant(fn)(h, w, b)
            self.assertEqual(got.dtype, jnp.float32)
            np.testing.assert_allclose(
                got, expected, rtol=1e-5, atol=1e-5, err_msg=output
            )


class TokenLogProbsTest(chex.TestCase):
    """token_log_probs and sequence_log_prob, the scoring of a given text."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_numpy(self):
        rng = np.random.default_rng(0)
        logits = rng.normal(0.0, 3.0, (2, 5, 7)).astype(np.float32)
        tokens = rng.integers(0, 7, (2, 5)).astype(np.int32)
        weights = rng.uniform(0.0, 1.0, (2, 5)).astype(np.float32)
        weights[0, 1] = 0.0
        logits[0, 1] = np.nan  # a zero-weight position adds exactly 0
        expected = np.take_along_axis(
            references.log_softmax(logits), tokens[..., None], -1
        )[..., 0]
        got = self.variant(head.token_log_probs)(logits, tokens)
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)
        weighted = np.where(weights == 0, 0.0, weights * np.nan_to_num(expected))
        padded = tokens.copy()
        padded[0, 1] = -1  # a padding id outside the vocabulary, of weight 0
        got = self.variant(head.token_log_probs)(logits, padded, weights)
        np.testing.assert_allclose(got, weighted, rtol=1e-5, atol=1e-6)
        total = self.variant(head.sequence_log_prob)(logits, padded, weights)
        np.testing.assert_allclose(total, weighted.sum(-1), rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_bf16_logits_use_a_float32_normalizer(self):
        logits = jnp.array([[8192.0, 0.0, -8192.0]], jnp.bfloat16)
        got = self.variant(head.token_log_probs)(logits, jnp.array([1]))
        self.assertEqual(got.dtype, jnp.float32)
        np.testing.assert_allclose(got, [-8192.0])


class LastPositionsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_numpy_indexing(self):
        (h,) = random_arrays(8, (4, 5, 3))
        lengths = np.array([1, 5, 3, 2], np.int32)
        got = self.variant(head.last_positions)(h, lengths)
        np.testing.assert_array_equal(got, h[np.arange(4), lengths - 1])

    def test_traced_lengths_are_clipped(self):
        # Documented rule: inside jit lengths are clipped to [1, T].
        (h,) = random_arrays(9, (2, 3, 4))
        got = jax.jit(head.last_positions)(h, jnp.array([0, 7]))
        np.testing.assert_array_equal(got, h[[0, 1], [0, 2]])


# Bad input raises exactly its error, naming the argument (tests/errors.py);
# values that cannot be refused inside jit follow a documented rule (RULES).

H = jnp.ones((2, 3, 4))
W = jnp.ones((5, 4))
LOGITS = jnp.zeros((2, 5))
LABELS = jnp.zeros((2,), jnp.int32)
INF, NEG = float("inf"), -float("inf")
GREEDY = ("temperature", "greedy")  # temperature 0 is greedy decoding


def unembed(h=H, w=W, bias=None, **kwargs):
    return head.unembed(h, w, bias, **kwargs)


LENGTHS = jnp.array([1, 1])


def last_positions(h=H, lengths=LENGTHS):
    return head.last_positions(h, lengths)


def token_log_probs(logits=LOGITS[None], tokens=LABELS[None], weights=None):
    return head.token_log_probs(logits, tokens, weights)


TOKEN_LOG_PROBS = [
    ("token = V", dict(tokens=jnp.array([[0, 5]])), ValueError, ("tokens", "[0, 5)")),
    ("tokens shape", dict(tokens=jnp.zeros((1, 3), int)), ValueError, "tokens"),
    ("float tokens", dict(tokens=jnp.zeros((1, 2))), TypeError, "tokens"),
    ("weights shape", dict(weights=jnp.ones(2)), ValueError, ("weights", "tokens")),
]
UNEMBED = [
    ("integer h", dict(h=H.astype(int)), TypeError, "h"),
    ("integer w", dict(w=W.astype(int)), TypeError, "w"),
    ("integer bias", dict(bias=jnp.ones(5, int)), TypeError, "bias"),
    ("scalar h", dict(h=jnp.float32(1.0)), ValueError, "h"),
    ("w rank 1", dict(w=W[0]), ValueError, "w"),
    ("w rank 3", dict(w=W[..., None]), ValueError, "w"),
    ("V = 0", dict(w=W[:0]), ValueError, "w"),
    ("D = 0", dict(h=H[..., :0], w=W[:, :0]), ValueError, "w"),
    ("D mismatch", dict(h=jnp.ones((2, 3))), ValueError, "h"),
    ("bias shape", dict(bias=jnp.zeros(4)), ValueError, "bias"),
    ("bias [1, V]", dict(bias=jnp.zeros((1, 5))), ValueError, "bias"),
    ("scalar bias", dict(bias=jnp.float32(0.0)), ValueError, "bias"),
    ("scale 0", dict(scale=0.0), ValueError, "scale"),
    ("scale < 0", dict(scale=-1.0), ValueError, "scale"),
    ("scale inf", dict(scale=INF), ValueError, "scale"),
    ("softcap 0", dict(softcap=0.0), ValueError, "softcap"),
    ("softcap < 0", dict(softcap=-1.0), ValueError, "softcap"),
    ("softcap inf", dict(softcap=INF), ValueError, "softcap"),  # inf * 0 = NaN
]
DISTRIBUTION = [  # each row for head.probs and head.log_probs
    ("integer logits", dict(logits=LABELS), TypeError, "logits"),
    ("scalar logits", dict(logits=jnp.float32(1.0)), ValueError, "logits"),
    ("V = 0", dict(logits=LOGITS[:, :0]), ValueError, "logits"),
    *(
        (f"temperature {k}", dict(logits=LOGITS, temperature=t), ValueError, GREEDY)
        for k, t in (
            ("0", 0.0),
            ("int 0", 0),
            ("np.float32 0", np.float32(0.0)),
            ("array 0", jnp.array(0.0)),
        )
    ),
    (
        "temperature < 0",
        dict(logits=LOGITS, temperature=-0.5),
        ValueError,
        "temperature",
    ),
]
LAST_POSITIONS = [
    ("h rank", dict(h=H[0]), ValueError, "h"),
    ("T = 0", dict(h=H[:, :0]), ValueError, "h"),
    ("float lengths", dict(lengths=jnp.ones(2)), TypeError, "lengths"),
    ("lengths shape", dict(lengths=jnp.ones(3, int)), ValueError, "lengths"),
    ("length 0", dict(lengths=jnp.array([0, 1])), ValueError, "lengths"),
    ("length < 0", dict(lengths=jnp.array([-1, 1])), ValueError, "lengths"),
    ("length > T", dict(lengths=jnp.array([1, 4])), ValueError, "lengths"),
]
BAD_INPUTS = [
    *keyword_rows("unembed", unembed, UNEMBED),
    *keyword_rows("probs", head.probs, DISTRIBUTION),
    *keyword_rows("log_probs", head.log_probs, DISTRIBUTION),
    *keyword_rows("last_positions", last_positions, LAST_POSITIONS),
    *keyword_rows("token_log_probs", token_log_probs, TOKEN_LOG_PROBS),
    # The message lists what is allowed.
    (
        "output_distribution output",
        lambda: head.output_distribution(H, W, output="softmax"),
        ValueError,
        ("output", "'logits'", "'log_probs'", "'probs'"),
    ),
]


test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)


RULES = [
    # head.log_probs: a -inf logit has probability 0; a row of -inf has no
    # distribution (all 0); +inf logits share the mass.
    ("probs of a row of -inf", head.probs, (jnp.full((2, 3), NEG),), np.zeros((2, 3))),
    (
        "log_probs of a row of -inf",
        head.log_probs,
        (jnp.array([[NEG, NEG], [0.0, NEG]]),),
        np.array([[NEG, NEG], [0.0, NEG]]),
    ),
    (
        "probs with +inf logits",
        head.probs,
        (jnp.array([[INF, 0.0, INF, NEG]]),),
        np.array([[0.5, 0.0, 0.5, 0.0]]),
    ),
    (
        "log_probs with +inf logits",
        head.log_probs,
        (jnp.array([[INF, 1.0]]),),
        np.array([[0.0, NEG]]),
    ),
]


test_documented_rules = rules_test(RULES)


def test_traced_tokens_outside_the_vocabulary_have_log_prob_minus_inf():
    got = jax.jit(head.token_log_probs)(jnp.zeros((1, 2, 3)), jnp.array([[0, 3]]))
    np.testing.assert_allclose(got, [[-np.log(3.0), -np.inf]], rtol=1e-6)
