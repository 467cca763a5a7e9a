"""Tests for lmhead/token_logprobs.py against float64 numpy.

The reference takes the log-softmax of the materialized logits in float64
(tests/post_training_references.py); gradients are central differences of
it. N = 2 x 5 = 10 tokens in chunks of 4 (a ragged last chunk), V = 11 in
vocabulary blocks of 4 when the logits are recomputed (a ragged last block).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmhead import token_logprobs
from tests import post_training_references as refs
from tests.errors import bad_input_test

B, T, D, V, K = 2, 5, 4, 11, 3
CHUNK = 4
BANNED = (2, 7)  # vocabulary rows of bias -inf in the "banned" case

OPTIONS = {
    "plain": dict(),
    "tempered": dict(temperature=0.7, scale=0.8, softcap=2.5),
    "banned": dict(temperature=1.3),
}


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def make_inputs(case="plain", k=None, seed=0):
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal(V)
    allowed = np.arange(V)
    if case == "banned":
        bias[list(BANNED)] = -np.inf
        allowed = np.setdiff1d(allowed, BANNED)
    shape = (B, T) if k is None else (B, T, k)
    return dict(
        h=rng.standard_normal((B, T, D)),
        w=rng.standard_normal((V, D)),
        bias=bias,
        ids=rng.choice(allowed, shape).astype(np.int32),
        # Tokens 3 and 7 are padding.
        weights=np.where(np.isin(np.arange(B * T), (3, 7)), 0.0, 1.0).reshape(B, T),
        cotangents=rng.standard_normal((3,) + shape),
    )


class TokenLogProbsTest(parameterized.TestCase):
    # Compiled only: the sweep runs its scans and custom VJP compiled either
    # way, and the plain JAX around it is stricter under jit than op by op.
    @chex.variants(with_jit=True)
    # Each case with the logits kept and recomputed, the top-k ids taking
    # turns: every pair of the vocabulary's blocks and the ids' form.
    @parameterized.parameters(
        (case, vocab_chunk_size, (None, K)[(i + j) % 2])
        for i, case in enumerate(OPTIONS)
        for j, vocab_chunk_size in enumerate((None, 4))
    )
    def test_values_and_gradients_match_float64(self, case, vocab_chunk_size, k):
        """log p, H and lse of kept tokens equal numpy's; padding gives 0; the
        gradient of sum(a log p) + sum(b H) + sum(c lse) over kept tokens
        w.r.t. h, w and bias equals central differences of numpy's."""
        x = make_inputs(case, k)
        options = OPTIONS[case]
        keep = x["weights"] != 0
        a, b, c = x["cotangents"]
        b, c = (b, c) if k is None else (b[..., 0], c[..., 0])
        keep_ids = keep if k is None else keep[..., None]

        def fused(h, w, bias):
            out = token_logprobs.fused_token_logprobs(
                h,
                w,
                x["ids"],
                bias=bias,
                weights=x["weights"],
                entropy=True,
                chunk_size=CHUNK,
                vocab_chunk_size=vocab_chunk_size,
                **options,
            )
            value = (
                jnp.sum(jnp.where(keep_ids, a * out.logprobs, 0.0))
                + jnp.sum(b * out.entropy)
                + jnp.sum(c * out.log_normalizer)
            )
            return value, out

        def reference(h, w, bias):
            log_p, entropy, lse = refs.token_logprobs(h, w, bias, x["ids"], **options)
            return np.sum(np.where(keep_ids, a * log_p, 0.0)) + np.sum(
                np.where(keep, b * entropy + c * lse, 0.0)
            )

        args = [jnp.asarray(x[n], jnp.float32) for n in ("h", "w", "bias")]
        grad = self.variant(jax.value_and_grad(fused, (0, 1, 2), has_aux=True))
        (value, out), got = grad(*args)
        log_p, entropy, lse = refs.token_logprobs(
            x["h"], x["w"], x["bias"], x["ids"], **options
        )
        for result, want, kept in (
            (out.logprobs, log_p, keep_ids),
            (out.entropy, entropy, keep),
            (out.log_normalizer, lse, keep),
        ):
            np.testing.assert_allclose(result, np.where(kept, want, 0), 1e-5, 1e-5)
        np.testing.assert_allclose(
            value, reference(x["h"], x["w"], x["bias"]), rtol=1e-5
        )
        want = refs.grads(reference, x["h"], x["w"], x["bias"])
        for g, e in zip(got, want):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_an_ignored_token_gets_zeros_and_no_gradient(self):
        """A token whose k ids are all ``ignore_index`` (-100, or another)
        is left out as a weight 0 is: outputs 0, no gradient; the gradient
        of the others' is central differences of numpy's."""
        x = make_inputs(k=K)
        ignored = np.zeros((B, T), bool)
        ignored[0, 1] = ignored[1, 4] = True
        kept = ~ignored
        args = [jnp.asarray(x[n], jnp.float32) for n in ("h", "w", "bias")]

        def reference(h, w, bias):
            log_p, entropy, _ = refs.token_logprobs(h, w, bias, x["ids"])
            weighted = np.sum(x["cotangents"][0] * log_p, -1) + entropy
            return np.sum(np.where(kept, weighted, 0.0))

        for ignore_index in (-100, V):
            ids = np.where(ignored[..., None], ignore_index, x["ids"])

            def fused(h, w, bias, ids=ids, ignore_index=ignore_index):
                out = token_logprobs.fused_token_logprobs(
                    h, w, ids, bias=bias, entropy=True, chunk_size=CHUNK,
                    ignore_index=ignore_index,
                )  # fmt: skip
                value = jnp.sum(x["cotangents"][0] * out.logprobs)
                return value + jnp.sum(out.entropy), out

            grad = self.variant(jax.value_and_grad(fused, (0, 1, 2), has_aux=True))
            (value, out), got = grad(*args)
            log_p, entropy, _ = refs.token_logprobs(x["h"], x["w"], x["bias"], ids % V)
            np.testing.assert_allclose(
                out.logprobs, np.where(kept[..., None], log_p, 0.0), 1e-5, 1e-5
            )
            np.testing.assert_allclose(out.entropy, np.where(kept, entropy, 0.0), 1e-5)
            np.testing.assert_allclose(value, reference(*args), rtol=1e-5)
            want = refs.grads(reference, x["h"], x["w"], x["bias"])
            for g, e in zip(got, want):
                np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)

    def test_ids_partly_ignored_or_out_of_range_inside_jit_drop_their_token(self):
        # Eagerly an error (BAD_INPUTS); compiled, the documented rule.
        x = make_inputs(k=2)
        ids = x["ids"].copy()
        ids[0, 0, 1], ids[1, 2, 0] = -100, V
        out = jax.jit(token_logprobs.fused_token_logprobs)(x["h"], x["w"], ids)
        np.testing.assert_array_equal(out.logprobs[0, 0], 0.0)
        np.testing.assert_array_equal(out.logprobs[1, 2], 0.0)
        self.assertTrue(np.all(out.logprobs[0, 1:] < 0))

    def test_entropy_of_uniform_logits_is_log_v_and_banned_tokens_add_nothing(self):
        """w = 0: every allowed token has logit 0, so p is uniform over the
        V - 2 allowed tokens: H = log 9, log p = -log 9, lse = log 9."""
        bias = np.zeros(V)
        bias[list(BANNED)] = -np.inf
        out = token_logprobs.fused_token_logprobs(
            jnp.ones((3, D)),
            jnp.zeros((V, D)),
            jnp.array([0, 1, 10]),
            bias=jnp.asarray(bias, jnp.float32),
            entropy=True,
            chunk_size=2,
            vocab_chunk_size=4,
        )
        np.testing.assert_allclose(out.entropy, [np.log(9)] * 3, rtol=1e-6)
        np.testing.assert_allclose(out.logprobs, [-np.log(9)] * 3, rtol=1e-6)
        np.testing.assert_allclose(out.log_normalizer, [np.log(9)] * 3, rtol=1e-6)

    def test_no_entropy_asked_gives_none(self):
        x = make_inputs()
        out = token_logprobs.fused_token_logprobs(x["h"], x["w"], x["ids"])
        self.assertIsNone(out.entropy)
        np.testing.assert_allclose(
            out.logprobs,
            refs.token_logprobs(x["h"], x["w"], None, x["ids"])[0],
            rtol=1e-5,
            atol=1e-5,
        )


def _call(**overrides):
    x = make_inputs()
    args = dict(h=x["h"], w=x["w"], ids=x["ids"]) | overrides
    return lambda: token_logprobs.fused_token_logprobs(
        args.pop("h"), args.pop("w"), args.pop("ids"), **args
    )


BAD_INPUTS = [
    ("ids_out_of_range", _call(ids=np.full((B, T), V)), ValueError, "ids"),
    (
        "ids_partly_ignored",
        _call(ids=np.array([[[0, -100]] * T] * B)),
        ValueError,
        "ids",
    ),
    ("ignore_index_float", _call(ignore_index=-100.0), TypeError, "ignore_index"),
    ("ids_float", _call(ids=np.zeros((B, T))), TypeError, "ids"),
    ("ids_wrong_shape", _call(ids=np.zeros((B, T + 1), np.int32)), ValueError, "ids"),
    ("no_ids", _call(ids=np.zeros((B, T, 0), np.int32)), ValueError, "ids"),
    ("weights_shape", _call(weights=np.ones(B)), ValueError, "weights"),
    ("temperature_zero", _call(temperature=0.0), ValueError, "temperature"),
    ("softcap_negative", _call(softcap=-1.0), ValueError, "softcap"),
    ("chunk_size_zero", _call(chunk_size=0), ValueError, "chunk_size"),
    ("entropy_not_bool", _call(entropy=1), TypeError, "entropy"),
    ("w_rank", _call(w=np.ones(V)), ValueError, "w"),
]
test_bad_input_raises_exactly_naming_the_argument = bad_input_test(BAD_INPUTS)
