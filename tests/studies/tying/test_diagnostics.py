"""Tests for studies/tying/diagnostics.py against numpy written here,
on small random arrays, jitted and not."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from scipy import stats

from studies.tying import diagnostics
from tests import errors

V, D = 11, 5


def _tables(seed=0):
    rng = np.random.default_rng(seed)
    embedding = rng.normal(size=(V, D)).astype(np.float32)
    unembedding = rng.normal(size=(V, D)).astype(np.float32)
    counts = rng.integers(0, 50, size=V)
    counts[3] = 0  # a token the training text never holds
    return embedding, unembedding, counts


class JittableTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_row_norms_and_log_frequency(self):
        embedding, _, counts = _tables()
        np.testing.assert_allclose(
            self.variant(diagnostics.row_norms)(embedding),
            np.sqrt((embedding.astype(np.float64) ** 2).sum(1)),
            rtol=1e-6,
        )
        np.testing.assert_allclose(
            self.variant(diagnostics.log_frequency)(counts),
            np.log((counts + 1) / (counts.sum() + V)),
            rtol=1e-6,
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_row_cosines(self):
        embedding, unembedding, _ = _tables()
        unembedding[2] = 0.0  # a zero row: cosine 0 by the rule
        want = [
            0.0 if not np.any(u) else e @ u / np.linalg.norm(e) / np.linalg.norm(u)
            for e, u in zip(embedding.astype(np.float64), unembedding)
        ]
        got = self.variant(diagnostics.row_cosines)(embedding, unembedding)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        tied = self.variant(diagnostics.row_cosines)(embedding, embedding)
        np.testing.assert_allclose(tied, np.ones(V), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_weighted_mean(self):
        embedding, unembedding, counts = _tables()
        values = embedding[:, 0]
        got = self.variant(diagnostics.weighted_mean)(values, counts)
        np.testing.assert_allclose(got, np.average(values, weights=counts), rtol=1e-5)

    def test_weighted_mean_of_zero_weights_inside_jit_is_zero(self):
        got = jax.jit(diagnostics.weighted_mean)(jnp.ones(3), jnp.zeros(3))
        self.assertEqual(float(got), 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_logit_statistics(self):
        rng = np.random.default_rng(1)
        logits = rng.normal(size=(2, 3, V)).astype(np.float32) * 4
        labels = rng.integers(0, V, size=(2, 3))
        got = self.variant(diagnostics.logit_statistics)(logits, labels)
        x = logits.astype(np.float64)
        log_z = np.log(np.exp(x).sum(-1))
        np.testing.assert_allclose(
            got.nll,
            log_z - np.take_along_axis(x, labels[..., None], -1)[..., 0],
            rtol=1e-5,
        )
        np.testing.assert_allclose(got.std, x.std(-1), rtol=1e-5)
        np.testing.assert_allclose(got.max, x.max(-1), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_bucket_losses(self):
        rng = np.random.default_rng(2)
        nll = rng.uniform(0, 5, size=40).astype(np.float32)
        labels = rng.integers(0, V, size=40)
        weights = (rng.uniform(size=40) > 0.2).astype(np.float32)
        nll[weights == 0] = np.inf  # padding's scores never count
        buckets = np.array([0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2])
        fn = self.variant(functools.partial(diagnostics.bucket_losses, num_buckets=4))
        mean, tokens = fn(nll, labels, weights, buckets)
        for k in range(3):
            chosen = (buckets[labels] == k) & (weights > 0)
            self.assertEqual(float(tokens[k]), chosen.sum())
            np.testing.assert_allclose(mean[k], nll[chosen].mean(), rtol=1e-5)
        self.assertEqual(float(tokens[3]), 0.0)  # empty: NaN, and 0 says why
        self.assertTrue(np.isnan(mean[3]))


def test_token_counts_against_bincount():
    tokens = np.random.default_rng(3).integers(0, V, size=100)
    np.testing.assert_array_equal(
        diagnostics.token_counts(tokens, V + 2),
        [np.sum(tokens == v) for v in range(V + 2)],
    )


def test_rank_correlation_against_ranks():
    embedding, _, counts = _tables()
    x, y = embedding[:, 0], np.log(counts + 1.0)  # y has ties
    ranks = np.corrcoef(stats.rankdata(x), stats.rankdata(y))[0, 1]
    np.testing.assert_allclose(diagnostics.rank_correlation(x, y), ranks, rtol=1e-10)
    assert np.isnan(diagnostics.rank_correlation(x, np.ones(V)))


@pytest.mark.parametrize("num_buckets", [1, 2, 3, 5, 8])
def test_frequency_buckets_against_brute_force(num_buckets):
    counts = np.random.default_rng(num_buckets).integers(0, 30, size=23)
    counts[[4, 9]] = counts[2]  # ties go by id
    got = diagnostics.frequency_buckets(counts, num_buckets)
    # Brute force: walk the tokens, most frequent first, and put each where
    # the middle of its mass falls.
    order = sorted(range(len(counts)), key=lambda v: (-counts[v], v))
    seen, want = 0, np.zeros(len(counts), int)
    for v in order:
        middle = (seen + counts[v] / 2) / counts.sum()
        want[v] = min(num_buckets - 1, int(middle * num_buckets))
        seen += counts[v]
    np.testing.assert_array_equal(got, want)
    # Buckets go from frequent to rare, and each holds about 1/K of the mass.
    assert np.all(np.diff(got[order]) >= 0)
    shares = np.bincount(got, weights=counts, minlength=num_buckets) / counts.sum()
    assert np.all(np.abs(shares - 1 / num_buckets) <= counts.max() / counts.sum())


def test_a_dominant_token_leaves_a_bucket_empty():
    buckets = diagnostics.frequency_buckets(np.array([90, 5, 5]), 4)
    np.testing.assert_array_equal(buckets, [1, 3, 3])


def _bucket_losses(labels, buckets):
    return lambda: diagnostics.bucket_losses(
        np.ones(2), np.array(labels), np.ones(2), np.array(buckets), 2
    )


BAD_INPUTS = [
    ("id past V", lambda: diagnostics.token_counts(np.array([0, 5]), 5), ValueError,
     "vocab_size"),
    ("float ids", lambda: diagnostics.token_counts(np.array([0.5]), 5), ValueError,
     "tokens"),
    ("zero counts", lambda: diagnostics.frequency_buckets(np.zeros(3), 2), ValueError,
     "counts"),
    ("negative count", lambda: diagnostics.frequency_buckets(np.array([-1, 2]), 2),
     ValueError, "counts"),
    ("no buckets", lambda: diagnostics.frequency_buckets(np.ones(3), 0), ValueError,
     "num_buckets"),
    ("zero weights", lambda: diagnostics.weighted_mean(np.ones(2), np.zeros(2)),
     ValueError, "weights"),
    ("negative weight",
     lambda: diagnostics.weighted_mean(np.ones(2), np.array([1, -1])), ValueError,
     "weights"),
    ("lengths", lambda: diagnostics.rank_correlation(np.ones(3), np.ones(2)),
     ValueError, ("x", "y")),
    ("label past V", _bucket_losses([0, 7], [0, 1]), ValueError, "labels"),
    ("bucket past K", _bucket_losses([0, 1], [0, 2]), ValueError, "buckets"),
    ("int table", lambda: diagnostics.row_norms(np.ones((3, 2), np.int32)),
     TypeError, "table"),
]  # fmt: skip
test_bad_arguments_raise_exactly_naming_them = errors.bad_input_test(BAD_INPUTS)


def test_shapes_are_checked():
    with pytest.raises(AssertionError):
        diagnostics.row_cosines(np.ones((3, 2)), np.ones((4, 2)))
    with pytest.raises(AssertionError):
        diagnostics.row_norms(np.ones(3))


if __name__ == "__main__":
    absltest.main()
