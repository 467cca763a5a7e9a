"""Numerics under stress, and the training option that stops on non-finite values.

The three loss paths of ``LMHead.loss`` -- materialized
(``losses.cross_entropy(head.unembed(...))``), fused and vocabulary-parallel
(on a one-device mesh) -- get hidden states that make logits of +-1e4, in
float32, bfloat16 and float16, with all tokens weighted, all but one masked,
or none, with both label smoothing and the z-loss. With ``w`` the identity
the logits are ``h`` itself, so the loss and its gradient with respect to
``h`` are checked against the float64 numpy references of the (rounded)
inputs (tests/references.py). A mean over zero weight is 0.

The training tests inject a NaN into a tiny run through ``train.train_step``
and check that the run stops with the step named, before it saves, both when
the loss shows it and when only the parameters do (NaN after the last step
before a checkpoint); with ``train.stop_on_nonfinite=False`` (slow) it trains
on.
"""

import functools
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmhead import fused, head, losses
from lmhead.lm import generation, train
from lmhead.vocab_parallel import vocab_parallel_cross_entropy
from tests import references

EPS, Z_LOSS = 0.1, 1e-4
# Row by row: confident and right, confident and wrong (nll 2e4), every
# logit -1e4, every logit +1e4 (lse near 1e4, z-loss term near 1e4), moderate.
LOGITS = np.array(
    [
        [1e4, -1e4, 0.0, 0.0, 0.0],
        [1e4, -1e4, 0.0, 0.0, 0.0],
        [-1e4, -1e4, -1e4, -1e4, -1e4],
        [1e4, 1e4, 1e4, 1e4, 1e4],
        [0.5, -1.5, 2.0, 0.0, -0.25],
    ],
    np.float32,
)
LABELS = np.array([0, 1, 2, 3, 4], np.int32)
V = LOGITS.shape[1]
MASKS = {
    "all": np.ones(5, np.float32),
    "all_but_one": np.array([0.0, 1.0, 0.0, 0.0, 0.0], np.float32),
    "none": np.zeros(5, np.float32),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def vocab_parallel(h, w, labels, **kwargs):
    mesh = jax.make_mesh(
        (1, 1),
        ("data", "model"),
        (jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:1],
    )
    return vocab_parallel_cross_entropy(h, w, labels, mesh=mesh, chunk_size=2, **kwargs)


IMPLS = {
    "materialized": lambda h, w, labels, **kwargs: losses.cross_entropy(
        head.unembed(h, w), labels, **kwargs
    ),
    "fused": functools.partial(fused.fused_cross_entropy, chunk_size=2),
    "vocab_parallel": vocab_parallel,
}


class StressTest(parameterized.TestCase):
    def check_stress(self, impl, dtype):
        h = jnp.asarray(LOGITS, DTYPES[dtype])
        w = jnp.eye(V, dtype=DTYPES[dtype])  # logits = h, rounded to dtype

        def objective(h, weights):
            return IMPLS[impl](
                h,
                w,
                LABELS,
                weights=weights,
                label_smoothing=EPS,
                smoothing="normalized",
                z_loss=Z_LOSS,
            )

        value_and_grad = self.variant(jax.value_and_grad(objective, has_aux=True))
        # Float32 logits near 1e4 are exact to half an ulp (5e-4), so lse and p
        # are good to about 1e-4; bf16 and fp16 gradients are rounded to dtype.
        tolerance = 1e-4 if dtype == "float32" else 1e-2
        for mask, weights in MASKS.items():
            (loss, metrics), grad = value_and_grad(h, weights)
            logits = np.asarray(h, np.float32)
            options = (weights, EPS, "normalized", Z_LOSS)
            _, want = references.cross_entropy(logits, LABELS, *options)
            want_grad = references.cross_entropy_gradient(logits, LABELS, *options)
            self.assertEqual(grad.dtype, h.dtype)
            grad = np.asarray(grad, np.float64)
            self.assertTrue(np.all(np.isfinite(grad)), mask)
            np.testing.assert_allclose(
                float(loss), want["loss"], rtol=1e-6, err_msg=mask
            )
            np.testing.assert_allclose(grad, want_grad, atol=tolerance, err_msg=mask)
            # Masked rows get exactly no gradient, whatever their logits.
            np.testing.assert_array_equal(grad[weights == 0], 0.0)
            if mask == "none":
                self.assertEqual(float(loss), 0.0)
                for name in ("loss", "nll", "z_loss", "accuracy", "weight_sum"):
                    self.assertEqual(float(metrics[name]), 0.0, name)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*DTYPES)
    def test_materialized_gives_the_float64_loss_and_gradient(self, dtype):
        self.check_stress("materialized", dtype)

    # Compiled only: the blocked losses compile their scans and custom VJP
    # either way, and an eager shard_map takes seconds per call.
    @chex.variants(with_jit=True)
    @parameterized.product(impl=("fused", "vocab_parallel"), dtype=tuple(DTYPES))
    def test_blocked_losses_give_the_float64_loss_and_gradient(self, impl, dtype):
        self.check_stress(impl, dtype)


def poison_params_after(monkeypatch, step_index):
    """``train_step`` whose new parameters are NaN after step ``step_index``
    (0-based), as an overflow in the update would leave them."""
    original = train.train_step

    def poisoned(state, batch, key, **kwargs):
        new_state, metrics = original(state, batch, key, **kwargs)
        poison = jnp.where(state.step == step_index, jnp.nan, 0.0)
        return new_state.replace(
            params=jax.tree.map(lambda p: p + poison, new_state.params)
        ), metrics

    monkeypatch.setattr(train, "train_step", poisoned)


@pytest.mark.parametrize(
    "step_index,message",
    [
        # NaN parameters after step 7: the loss of step 8 is NaN.
        (
            6,
            r"Non-finite training at step 8: loss nan, gradient norm nan\. "
            r"Stopped at step 10 without saving",
        ),
        # NaN parameters after step 10, whose own loss was finite.
        (9, r"not finite after step 10; stopped without saving"),
    ],
)
def test_nonfinite_training_stops_and_keeps_the_last_good_checkpoint(
    short_config, tmp_path, monkeypatch, step_index, message
):
    poison_params_after(monkeypatch, step_index)
    workdir = str(tmp_path / "run")
    with pytest.raises(FloatingPointError, match=message) as raised:
        train.train_and_evaluate(short_config(), workdir)
    assert "The newest checkpoint, step 5" in str(raised.value)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["5"]
    assert not os.path.exists(os.path.join(workdir, "summary.json"))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [5]  # no NaN logged
    monkeypatch.undo()
    _, _, _, params = generation.load_run(workdir)
    assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(params))


@pytest.mark.slow
def test_nonfinite_training_goes_on_when_asked(short_config, tmp_path, monkeypatch):
    poison_params_after(monkeypatch, 6)
    workdir = str(tmp_path / "run")
    summary = train.train_and_evaluate(
        short_config(**{"train.stop_on_nonfinite": False}), workdir
    )
    # losses.py's rule: a NaN logit gives a loss that is not finite (which of
    # inf and NaN depends on where the NaN meets the reduction).
    assert not np.isfinite(summary["final"]["eval/loss"])
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "5"]
