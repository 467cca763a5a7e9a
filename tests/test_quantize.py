"""Quantized unembeddings against numpy written here."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lmhead
from lmhead import head, modules, quantize


def numpy_int8(w):
    """Per-row symmetric int8: scale = max|row| / 127, values = round(w / scale)."""
    w = np.asarray(w, np.float64)
    scales = np.abs(w).max(axis=1) / 127.0
    safe = np.where(scales > 0, scales, 1.0)
    return np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8), scales


def table(v=50, d=16, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, 0.02, (v, d)) * rng.uniform(0.1, 10.0, (v, 1))
    w[3] = 0.0  # a zero row
    return w.astype(np.float32)


class TestQuantize(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_int8_matches_numpy_and_error_bound(self):
        w = table()
        q = self.variant(lambda w: quantize.quantize_unembedding(w, "int8"))(w)
        values, scales = numpy_int8(w)
        self.assertEqual(q.values.dtype, jnp.int8)
        self.assertEqual(q.scales.dtype, jnp.float32)
        # Rounding of exact halves may differ by one level after float32 division.
        assert np.abs(np.asarray(q.values, int) - values).max() <= 1
        np.testing.assert_allclose(q.scales, scales, rtol=1e-6)
        error = np.abs(np.asarray(quantize.dequantize(q)) - w)
        bound = np.abs(w).max(axis=1, keepdims=True) / 254.0
        assert np.all(error <= bound * (1 + 1e-5) + 1e-12)
        assert np.all(np.asarray(quantize.dequantize(q))[3] == 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_unembed_of_int8_table_equals_numpy(self):
        w = table()
        rng = np.random.default_rng(1)
        h = rng.normal(size=(2, 3, 16)).astype(np.float32)
        bias = rng.normal(size=50).astype(np.float32)
        q = quantize.quantize_unembedding(w, "int8")
        values, scales = (
            np.asarray(q.values, np.float64),
            np.asarray(q.scales, np.float64),
        )
        expected = 0.5 * (h.astype(np.float64) @ values.T) * scales + bias
        expected = 20.0 * np.tanh(expected / 20.0)
        got = self.variant(
            lambda h, q, b: head.unembed(h, q, b, scale=0.5, softcap=20.0)
        )(h, q, bias)
        self.assertEqual(got.dtype, jnp.float32)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_half_precision_tables(self):
        w = table()
        h = np.random.default_rng(2).normal(size=(4, 16)).astype(np.float32)
        for dtype, eps in (("bfloat16", 2.0**-8), ("float16", 2.0**-11)):
            half = self.variant(lambda w: quantize.quantize_unembedding(w, dtype))(w)
            self.assertEqual(half.dtype, jnp.dtype(dtype))
            # Round to nearest: relative error at most half an ulp (float16's
            # subnormals below 6e-5 add an absolute 2**-25).
            error = np.abs(np.asarray(half, np.float64) - w)
            assert np.all(error <= eps * np.abs(w) + 2.0**-25)
            expected = h.astype(np.float64) @ np.asarray(half, np.float64).T
            np.testing.assert_allclose(
                head.unembed(h, half), expected, rtol=1e-5, atol=1e-6
            )


@pytest.mark.parametrize("leading", [(), (2, 3)])
def test_int8_unembed_beyond_one_cpu_block_equals_numpy(leading):
    w = table(v=quantize.CPU_BLOCK_ROWS + 3, d=8, seed=3)
    h = np.random.default_rng(4).normal(size=(*leading, 8)).astype(np.float32)
    q = quantize.quantize_unembedding(w, "int8")
    expected = (
        h.astype(np.float64)
        @ (
            np.asarray(q.values, np.float64) * np.asarray(q.scales, np.float64)[:, None]
        ).T
    )
    got = jax.jit(head.unembed)(h, q)
    assert got.shape == (*leading, quantize.CPU_BLOCK_ROWS + 3)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_int8_is_at_most_027_of_float32_bytes_at_d512():
    q = quantize.quantize_unembedding(jnp.ones((1000, 512)), "int8")
    int8_bytes = q.values.nbytes + q.scales.nbytes
    assert int8_bytes == 1000 * (512 + 4)
    assert int8_bytes / (1000 * 512 * 4) <= 0.27


def test_public_names():
    assert lmhead.quantize_unembedding is quantize.quantize_unembedding
    assert lmhead.QuantizedTable is quantize.QuantizedTable


def test_bad_dtype_names_the_argument():
    with pytest.raises(
        ValueError,
        match="dtype must be one of 'bfloat16', 'float16', 'int8'; got 'int4'",
    ):
        quantize.quantize_unembedding(jnp.ones((4, 2)), "int4")


def test_bad_tables():
    with pytest.raises(TypeError, match="w must have a floating-point dtype"):
        quantize.quantize_unembedding(jnp.ones((4, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"w must have shape \[V, D\]"):
        quantize.quantize_unembedding(jnp.ones((4,)))
    with pytest.raises(ValueError, match="beyond float16's largest finite value"):
        quantize.quantize_unembedding(jnp.full((2, 2), 1e5), "float16")
    bad = quantize.QuantizedTable(jnp.ones((4, 2), jnp.int8), jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"scales must have shape \[V\] = \(4,\)"):
        head.unembed(jnp.ones((1, 2)), bad)
    with pytest.raises(ValueError, match="D = w.shape"):
        head.unembed(jnp.ones((1, 3)), quantize.quantize_unembedding(jnp.ones((4, 2))))


def test_lm_head_takes_a_quantized_table_tied_and_untied():
    h = jax.random.normal(jax.random.key(1), (2, 3, 8))
    untied = modules.LMHead(vocab_size=11, tied=False, use_bias=True)
    params = jax.jit(untied.init)(jax.random.key(0), h)["params"]
    w = np.asarray(params["unembedding"], np.float64)
    q = quantize.quantize_unembedding(params["unembedding"], "int8")
    expected = (
        np.asarray(h, np.float64) @ np.asarray(quantize.dequantize(q), np.float64).T
    )
    got = jax.jit(untied.apply)({"params": {**params, "unembedding": q}}, h)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # ... and is close to the float32 head.
    assert np.abs(np.asarray(got) - np.asarray(h) @ w.T).max() < 1e-2
    tied = modules.LMHead(vocab_size=11, tied=True)
    np.testing.assert_allclose(tied.apply({}, h, q), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="QuantizedTable is for inference"):
        tied.apply({}, h, jnp.zeros((2, 3), jnp.int32), q, method="loss")
