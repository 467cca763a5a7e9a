"""Tests for lmhead/vocab_parallel.py on the one device a test process has.

On a one-device mesh the vocabulary-parallel loss must be the materialized
loss of ``losses.cross_entropy``, value and gradient, for every option. Its
behaviour split over several devices (every mesh shape of 8 simulated CPU
devices, tied and untied training steps, memory per device) is checked in
``tests/lm/test_sharding.py``, whose subprocess has those devices.
"""

import functools

import chex
import jax
import numpy as np
import pytest

from lmhead import head, losses, vocab_parallel
from tests.errors import assert_raises_exactly

RNG = np.random.default_rng(0)
H = RNG.normal(size=(3, 4, 8)).astype(np.float32)
W = RNG.normal(size=(12, 8)).astype(np.float32)
BIAS = RNG.normal(size=(12,)).astype(np.float32)
LABELS = RNG.integers(0, 12, (3, 4))
WEIGHTS = RNG.uniform(0.0, 1.0, (3, 4)).astype(np.float32)
OPTIONS = dict(
    weights=WEIGHTS, label_smoothing=0.1, smoothing="normalized", z_loss=1e-3
)
SOFTCAP = 5.0


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh(
        (1, 1),
        (vocab_parallel.DATA_AXIS, vocab_parallel.MODEL_AXIS),
        (jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:1],
    )


def materialized(h, w, labels, *, bias, softcap, **options):
    return losses.cross_entropy(
        head.unembed(h, w, bias, softcap=softcap), labels, **options
    )


def test_equals_the_materialized_loss_and_its_gradient(mesh):
    parallel = functools.partial(
        vocab_parallel.vocab_parallel_cross_entropy, mesh=mesh, chunk_size=5
    )

    def value_and_grads(loss_fn):
        def loss(h, w, bias):
            return loss_fn(h, w, LABELS, bias=bias, softcap=SOFTCAP, **OPTIONS)

        grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
        return jax.jit(grad)(H, W, BIAS)

    (loss, metrics), grads = value_and_grads(parallel)
    (want, want_metrics), want_grads = value_and_grads(materialized)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for name in ("nll", "z_loss", "accuracy"):
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-5)
    for got, expected in zip(grads, want_grads):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)

    # label_smoothing and z_loss traced (one value per ensemble member, as
    # test_modules.py checks under vmap) get the materialized gradients.
    def scalar_grads(loss_fn):
        def loss(label_smoothing, z_loss):
            options = dict(OPTIONS, label_smoothing=label_smoothing, z_loss=z_loss)
            return loss_fn(H, W, LABELS, bias=BIAS, softcap=SOFTCAP, **options)[0]

        return jax.jit(jax.grad(loss, (0, 1)))(np.float32(0.1), np.float32(1e-2))

    chex.assert_trees_all_close(
        scalar_grads(parallel), scalar_grads(materialized), rtol=1e-5
    )


def test_takes_the_mesh_set_by_set_mesh(mesh):
    with jax.set_mesh(mesh):
        loss, _ = jax.jit(
            lambda h, w: vocab_parallel.vocab_parallel_cross_entropy(h, w, LABELS)
        )(H, W)
    want, _ = losses.cross_entropy(head.unembed(H, W), LABELS)
    np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_refuses_a_missing_mesh_and_bad_options(mesh):
    assert_raises_exactly(
        lambda: vocab_parallel.vocab_parallel_cross_entropy(H, W, LABELS),
        ValueError,
        "mesh",
    )
    assert_raises_exactly(
        lambda: vocab_parallel.vocab_parallel_cross_entropy(
            H, W, LABELS, mesh=mesh, chunk_size=0
        ),
        ValueError,
        "chunk_size",
    )
