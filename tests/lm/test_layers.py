"""Tests of the Transformer's layers (lmhead/lm/layers.py) that the model's
own tests (test_model.py, against a float64 numpy forward pass) do not
reach one by one: the exact GELU against scipy, rotary positions against
numpy written here. Attention and the block are tested through the model."""

import chex
import jax.numpy as jnp
import numpy as np
from scipy import special

from lmhead.lm import layers


class LayersTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_gelu_is_the_exact_gelu_in_float32_and_bfloat16(self):
        x = np.linspace(-12, 12, 20001)
        gelu = self.variant(layers.gelu)
        # bfloat16: the rounding of the output (relative 2^-9) and nothing
        # more, also in the negative tail, where 1 + erf cancels.
        for dtype, rtol, atol in (
            (jnp.float32, 0.0, 1.2e-6),
            (jnp.bfloat16, 2**-8, 1e-6),
        ):
            inputs = jnp.asarray(x, dtype)
            got = gelu(inputs)
            assert got.dtype == dtype
            exact = np.asarray(inputs.astype(jnp.float32), np.float64)
            exact = 0.5 * exact * special.erfc(-exact / np.sqrt(2))
            np.testing.assert_allclose(
                np.asarray(got.astype(jnp.float32)),
                exact,
                rtol=rtol,
                atol=atol,
                err_msg=str(dtype),
            )

    @chex.variants(with_jit=True, without_jit=True)
    def test_gelu_tanh_is_gpt2s_formula(self):
        x = np.linspace(-12, 12, 20001)
        got = self.variant(lambda x: layers.gelu(x, approximate=True))(
            jnp.asarray(x, jnp.float32)
        )
        x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
        want = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rotary_turns_each_pair_by_its_angle(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
        positions = rng.integers(0, 50, size=(2, 5))
        got = self.variant(layers.rotary)(jnp.asarray(x), jnp.asarray(positions))
        half = 4
        frequencies = layers.ROPE_BASE ** (-np.arange(half) / half)
        angles = positions[:, :, None, None] * frequencies
        first, second = x[..., :half], x[..., half:]
        expected = np.concatenate(
            [
                first * np.cos(angles) - second * np.sin(angles),
                first * np.sin(angles) + second * np.cos(angles),
            ],
            axis=-1,
        )
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        # A rotated query and key: their dot product depends on the positions'
        # difference only.
        q, k = jnp.asarray(x[:1, :1]), jnp.asarray(x[1:, :1])

        def dot(p, s):
            rq = layers.rotary(q, jnp.array([[p]]))
            rk = layers.rotary(k, jnp.array([[s]]))
            return np.asarray((rq * rk).sum(-1))

        np.testing.assert_allclose(dot(7, 3), dot(24, 20), rtol=1e-4, atol=1e-5)
