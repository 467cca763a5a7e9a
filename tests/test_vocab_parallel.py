"""Tests for lmhead/vocab_parallel.py.

On a one-device mesh the vocabulary-parallel loss must be the materialized
loss of ``losses.cross_entropy``, value and gradient, for every option. Its
behaviour split over several devices (every mesh shape of 8 simulated CPU
devices, tied and untied training steps, memory per device) is checked in
``tests/lm/test_sharding.py``, whose subprocess has those devices. Every
other rule of the sweep -- the token log-probs, a token loss on them, the
distillation -- split over 4 devices of a (2, 4) mesh must give what it
gives on one device: this file run as a script in a subprocess with 8
simulated devices (:func:`split_rules`).
"""

import functools
import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead import head, losses, vocab_parallel
from tests import ROOT, devices_environment
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


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_ignored_label_drops_its_token(mesh, jit):
    labels = LABELS.copy()
    labels[1, :2] = -100
    kept = labels != -100

    def loss(h, w):
        return vocab_parallel.vocab_parallel_cross_entropy(
            h, w, labels, mesh=mesh, weights=WEIGHTS, chunk_size=5
        )[0]

    grad = jax.value_and_grad(loss, (0, 1))
    got, (dh, dw) = (jax.jit(grad) if jit else grad)(H, W)
    want, (want_dh, want_dw) = jax.value_and_grad(
        lambda h, w: materialized(
            h, w, LABELS[kept], bias=None, softcap=None, weights=WEIGHTS[kept]
        )[0],
        (0, 1),
    )(H[kept], W)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(dh[kept], want_dh, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(dh[~kept], 0.0)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------
# Every rule split over several devices: run in a subprocess of 8 devices.
# ----------------------------------------------------------------------------


def split_rules():
    """Each rule's value and gradients w.r.t. ``h``, ``w`` and ``bias``, its
    vocabulary split over the 4 devices of the ``"model"`` axis (tokens over
    the 2 of ``"data"``) and on one device: ``{rule: max relative
    difference}``. Blocks of 4 rows (10 per device) and chunks of 5 tokens
    (12 per device) make every loop ragged."""
    from lmhead import distillation, fused, policy_gradient, token_logprobs

    fused.VOCAB_BLOCK_ROWS[jax.default_backend()] = 4
    mesh = jax.make_mesh(
        (2, 4),
        (vocab_parallel.DATA_AXIS, vocab_parallel.MODEL_AXIS),
        (jax.sharding.AxisType.Auto,) * 2,
    )
    rng = np.random.default_rng(1)
    v, d, shape = 40, 8, (4, 6)
    h = rng.normal(size=shape + (d,)).astype(np.float32)
    w = rng.normal(size=(v, d)).astype(np.float32)
    bias = rng.normal(size=v).astype(np.float32)
    ids = rng.integers(0, v, shape + (2,))
    weights = (rng.uniform(size=shape) > 0.25).astype(np.float32)
    teacher = rng.normal(size=shape + (v,)).astype(np.float32)
    h_t, w_t = rng.normal(size=shape + (5,)), rng.normal(size=(v, 5))
    cotangents = rng.normal(size=(3,) + shape)
    objective = policy_gradient.TokenObjective(0.2, 0.2, None, 0.1, 0.01)
    operands = tuple(rng.normal(size=(3, 24)).astype(np.float32))

    def logprobs(h, w, bias, shards):
        out = token_logprobs.fused_token_logprobs(
            h, w, ids, bias=bias, weights=weights, entropy=True, softcap=5.0,
            temperature=0.8, chunk_size=5, vocab_shards=shards,
        )  # fmt: skip
        a, b, c = cotangents
        return (
            jnp.sum(a[..., None] * out.logprobs)
            + jnp.sum(b * out.entropy)
            + jnp.sum(c * out.log_normalizer)
        )

    def token_loss(h, w, bias, shards):
        return token_logprobs.token_loss_sweep(
            h, w, ids[..., 0], weights, token_logprobs.SweepOptions(chunk_size=5),
            bias=bias, entropy=True, token_loss=objective, operands=operands,
            vocab_shards=shards,
        )[0]  # fmt: skip

    def distill(h, w, bias, shards):
        return distillation.fused_distillation_loss(
            h, w, teacher, labels=ids[..., 0], bias=bias, weights=weights,
            divergence="jsd", beta=0.3, temperature=2.0, hard_weight=0.4,
            chunk_size=5, vocab_shards=shards,
        )[0]  # fmt: skip

    def distill_head(h, w, bias, shards):
        return jnp.sum(
            distillation.fused_distillation_loss(
                h, w, (h_t, w_t), bias=bias, divergence="reverse_kl",
                reduction="none", chunk_size=5, vocab_shards=shards,
            )[0]
        )  # fmt: skip

    results = {}
    for name, fn in dict(
        logprobs=logprobs, token_loss=token_loss, distill=distill,
        distill_head=distill_head,
    ).items():  # fmt: skip
        grads = lambda shards, fn=fn: jax.jit(
            jax.value_and_grad(functools.partial(fn, shards=shards), (0, 1, 2))
        )(h, w, bias)
        split = grads(vocab_parallel.vocab_shards(mesh))
        single = grads(None)
        results[name] = max(
            float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))
            for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(single))
        )
    return results


@pytest.fixture(scope="module")
def split_differences():
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        cwd=ROOT,
        env=devices_environment(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-5000:]
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.mark.parametrize("rule", ["logprobs", "token_loss", "distill", "distill_head"])
def test_every_rule_splits_the_vocabulary(split_differences, rule):
    assert split_differences[rule] < 1e-5, split_differences


if __name__ == "__main__":
    print("RESULTS " + json.dumps(split_rules()))
