"""Tests of lmhead/lm/loop.py, the training loop of every run.

What the loop does over a whole run (logging, evaluation, early stopping,
checkpoints, SIGTERM and SIGKILL resume, the test evaluation) is tested
through the programs that use it, which also check that they go through it:
a single run (a program of one) in test_train.py, test_preemption.py and
test_checkpoints.py, an ensemble's members in test_ensemble.py. Here: its pieces against references
written in the test.
"""

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lmhead.lm import loop


def state_of(step, leaves):
    """A stand-in for a TrainState: ``step`` and floating-point ``params``."""
    return type("State", (), {"step": step, "params": leaves})()


class TestMembersFinite:
    def reference(self, pending, leaves, count):
        """numpy: member k is finite when its losses, gradient norms and
        every element of its leaves are."""
        return np.array(
            [
                all(
                    np.isfinite(m[k][i]) for m in pending for k in ("loss", "grad_norm")
                )
                and all(np.isfinite(np.asarray(x)[i]).all() for x in leaves)
                for i in range(count)
            ]
        )

    def test_stacked_members_against_numpy(self):
        rng = np.random.default_rng(0)
        leaves = [rng.normal(size=(4, 3, 2)).astype(np.float32), np.zeros((4, 5))]
        leaves[0][1, 2, 0] = np.nan
        leaves[1][3, 4] = np.inf
        pending = [
            {"loss": np.array([1.0, 2.0, np.nan, 0.5]), "grad_norm": np.ones(4)},
            {"loss": np.ones(4), "grad_norm": np.array([1.0, 1.0, 1.0, 1.0])},
        ]
        state = {
            "w": jnp.asarray(leaves[0]),
            "v": jnp.asarray(leaves[1]),
            "step": jnp.zeros(4, jnp.int32),
        }
        got = loop.members_finite(pending, state)
        np.testing.assert_array_equal(got, self.reference(pending, leaves, 4))
        np.testing.assert_array_equal(got, [True, False, False, False])

    @pytest.mark.parametrize(
        "value, grad_norm, expected",
        [(1.0, 1.0, True), (np.nan, 1.0, False), (1.0, np.inf, False)],
    )
    def test_a_single_run_is_one_member(self, value, grad_norm, expected):
        state = {"w": jnp.full((1, 3, 2), value), "step": jnp.zeros(1, jnp.int32)}
        pending = [{"loss": np.array([1.0]), "grad_norm": np.array([grad_norm])}]
        got = loop.members_finite(pending, state)
        assert got.shape == (1,) and bool(got[0]) is expected


def test_steps_of_a_single_run_and_of_members():
    assert loop.steps_of(state_of(jnp.array([7]), {})).tolist() == [7]
    assert loop.steps_of(state_of(jnp.array([3, 5]), {})).tolist() == [3, 5]


def test_periodic_actions_against_the_rule():
    config = ml_collections.ConfigDict(
        {
            "train": {
                "steps": 50,
                "log_every": 3,
                "eval_every": 7,
                "checkpoint_every": 20,
            }
        }
    )
    for done in range(1, 51):
        evaluate = done % 7 == 0 or done == 50
        checkpoint = done % 20 == 0 or done == 50
        log = evaluate or checkpoint or done % 3 == 0
        assert loop.periodic_actions(config, done) == (log, evaluate, checkpoint)
