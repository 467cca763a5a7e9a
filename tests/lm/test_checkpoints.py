"""Tests for lmhead/lm/checkpoints.py: saving, restoring the newest
checkpoint that restores, refusing one of another model, and keeping
non-finite states out of the checkpoints.

Interrupted writes and a corrupt newest checkpoint during a run are tested
with the kill-and-resume runs in test_preemption.py.
"""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead.lm import checkpoints, generation, train
from tests.errors import assert_raises_exactly


def tree(value=1.0):
    return {"params": {"w": jnp.full((2, 3), value)}, "step": jnp.int32(0)}


def target_of(tree):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
    )


class TestSaveAndRestore:
    def test_newest_and_a_step_saved_once(self, tmp_path):
        manager = checkpoints.checkpoint_manager(str(tmp_path))
        assert checkpoints.restore_newest(manager, target_of(tree())) is None
        checkpoints.save(manager, 1, tree(1.0))
        checkpoints.save(manager, 2, tree(2.0))
        checkpoints.save(manager, 2, tree(9.0))  # a resumed run redoing step 2
        restored = checkpoints.restore_newest(manager, target_of(tree()))
        manager.close()
        np.testing.assert_array_equal(restored["params"]["w"], np.full((2, 3), 2.0))

    def test_keeps_the_newest_two_and_the_best_one(self, tmp_path):
        manager = checkpoints.checkpoint_manager(str(tmp_path))
        best = checkpoints.best_checkpoint_manager(str(tmp_path))
        for step in (1, 2, 3):
            checkpoints.save(manager, step, tree(step))
            checkpoints.save(best, step, tree(step))
        assert manager.all_steps() == [2, 3] and best.all_steps() == [3]
        assert os.path.basename(str(best.directory)) == checkpoints.BEST_CHECKPOINT
        manager.close()
        best.close()

    def test_a_checkpoint_of_other_shapes_is_refused(self, tmp_path):
        manager = checkpoints.checkpoint_manager(str(tmp_path))
        checkpoints.save(manager, 4, tree())
        other = {"params": {"w": jnp.zeros((3, 3))}, "step": jnp.int32(0)}
        with pytest.raises(ValueError, match=r"params/w: \(2, 3\) in the checkpoint"):
            checkpoints.restore_newest(manager, target_of(other))
        manager.close()


class TestCheckFinite:
    def test_names_the_first_non_finite_step(self, tmp_path):
        manager = checkpoints.checkpoint_manager(str(tmp_path))
        pending = [
            {"loss": 2.0, "grad_norm": 1.0},
            {"loss": float("nan"), "grad_norm": 1.0},
            {"loss": 2.0, "grad_norm": float("inf")},
        ]
        with pytest.raises(FloatingPointError, match="at step 9: loss nan") as raised:
            checkpoints.check_finite(pending, 10, tree(), manager)
        assert "holds no checkpoint" in str(raised.value)
        checkpoints.check_finite(pending[:1], 8, tree(), manager)  # all finite

    def test_a_non_finite_state_names_the_checkpoint_kept(self, tmp_path):
        manager = checkpoints.checkpoint_manager(str(tmp_path))
        checkpoints.save(manager, 5, tree())
        with pytest.raises(FloatingPointError, match="step 5 in") as raised:
            checkpoints.check_finite(
                [{"loss": 1.0, "grad_norm": 1.0}], 6, tree(float("nan")), manager
            )
        assert "not finite after step 6" in str(raised.value)
        manager.close()


def drop_config_json(workdir):
    os.remove(os.path.join(workdir, "config.json"))


def edit_config_json(workdir, section, key, value):
    path = os.path.join(workdir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config[section][key] = value
    with open(path, "w") as f:
        json.dump(config, f)


def garble_checkpoints(workdir):
    for step in ("5", "10"):
        for root, _, files in os.walk(os.path.join(workdir, "checkpoints", step)):
            if os.path.basename(root) == "d":
                for name in files:
                    with open(os.path.join(root, name), "wb") as f:
                        f.write(b"junk")


# A workdir that cannot be restored, with exactly this error. The message
# names the step and the array, or the file, that failed.
WORKDIRS = [
    (
        "checkpoint of an untied model, tied config",
        lambda w: drop_config_json(w),
        lambda w, make: train.train_and_evaluate(make(**{"model.tied": False}), w),
        ValueError,
        "step 10",
    ),
    (
        "checkpoint of another width",
        lambda w: edit_config_json(w, "model", "d_model", 64),
        lambda w, make: generation.load_run(w),
        ValueError,
        ("step 10", "params/blocks_0/attention/out/kernel"),
    ),
    (
        "no checkpoint restores",
        garble_checkpoints,
        lambda w, make: generation.load_run(w),
        RuntimeError,
        ("checkpoints", "step 10"),
    ),
    (
        "load_run of an empty directory",
        lambda w: shutil.rmtree(w) or os.mkdir(w),
        lambda w, make: generation.load_run(w),
        FileNotFoundError,
        "config.json",
    ),
]


@pytest.mark.parametrize(
    "spoil,call,error,named", [pytest.param(*case[1:], id=case[0]) for case in WORKDIRS]
)
def test_a_workdir_that_cannot_be_restored(
    short_config, copy_of_finished_run, monkeypatch, spoil, call, error, named
):
    monkeypatch.setattr(train, "compile_steps", None)
    spoil(copy_of_finished_run)
    assert_raises_exactly(
        lambda: call(copy_of_finished_run, short_config), error, named
    )


def test_incompatible_checkpoint_names_the_arrays(short_config, copy_of_finished_run):
    drop_config_json(copy_of_finished_run)
    with pytest.raises(ValueError) as raised:
        train.train_and_evaluate(
            short_config(**{"model.d_model": 64}), copy_of_finished_run
        )
    message = str(raised.value)
    assert (
        "params/blocks_0/attention/out/kernel: (32, 32) in the checkpoint, "
        "(64, 64) in the model"
    ) in message
    assert re.search(r"\(and \d+ more\)", message)
