"""Tests for lmhead/lm/checkpoints.py: the one layout, saving, restoring the
newest checkpoint that restores, refusing one of another model, converting
the single-run layout written before the one layout, and keeping non-finite
states out of the checkpoints.

Interrupted writes and a corrupt newest checkpoint during a run are tested
with the kill-and-resume runs in test_preemption.py.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from lmhead.lm import checkpoints, configuration, data, generation, train
from lmhead.lm import state as state_lib
from tests import ROOT
from tests.errors import assert_raises_exactly
from tests.lm.conftest import read_metrics


def tree(value=1.0, members=None):
    """A stand-in for a run's state (``members``: a program's, with a
    leading members axis of that size)."""
    lead = () if members is None else (members,)
    return {
        "params": {"w": jnp.full((*lead, 2, 3), value)},
        "step": jnp.zeros(lead, jnp.int32),
    }


def target_of(tree):
    """``{"state": ...}`` of ``tree``'s shapes on the first device."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {
        "state": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree
        )
    }


class TestSaveAndRestore:
    def test_newest_and_a_step_saved_once(self, tmp_path):
        manager = checkpoints.checkpoint_manager(str(tmp_path))
        assert checkpoints.restore_newest(manager, target_of(tree(members=1))) is None
        checkpoints.save(manager, 1, tree(1.0))
        checkpoints.save(manager, 2, tree(2.0))
        checkpoints.save(manager, 2, tree(9.0))  # a resumed run redoing step 2
        restored = checkpoints.restore_newest(manager, target_of(tree(members=1)))
        manager.close()
        # A run's state is saved as a program of one.
        np.testing.assert_array_equal(
            restored["state"]["params"]["w"], np.full((1, 2, 3), 2.0)
        )

    def test_the_one_layout(self, tmp_path):
        """``{"state"}`` and, where kept, ``{"best"}``, each with a leading
        members axis; a reader that asks for the state alone gets it."""
        manager = checkpoints.checkpoint_manager(str(tmp_path))
        state, best = tree(1.0, members=3), tree(2.0, members=3)
        checkpoints.save(manager, 4, state, best)
        assert set(manager.item_metadata(4).keys()) == {"state", "best"}
        both = {**target_of(state), "best": target_of(best)["state"]}
        restored = checkpoints.restore_newest(manager, both)
        np.testing.assert_array_equal(
            restored["best"]["params"]["w"], best["params"]["w"]
        )
        alone = checkpoints.restore_newest(manager, target_of(state))
        assert set(alone) == {"state"}
        np.testing.assert_array_equal(alone["state"]["step"], np.zeros(3))
        manager.close()

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
        other = {"params": {"w": jnp.zeros((1, 3, 3))}, "step": jnp.zeros(1, jnp.int32)}
        with pytest.raises(
            ValueError, match=r"state/params/w: \(1, 2, 3\) in the checkpoint"
        ):
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
        lambda w: drop_config_json(w) or os.remove(os.path.join(w, "summary.json")),
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
    os.remove(os.path.join(copy_of_finished_run, "summary.json"))  # else finished
    with pytest.raises(ValueError) as raised:
        train.train_and_evaluate(
            short_config(**{"model.d_model": 64}), copy_of_finished_run
        )
    message = str(raised.value)
    assert (
        "state/params/blocks_0/attention/out/kernel: (1, 32, 32) in the "
        "checkpoint, (1, 64, 64) in the model"
    ) in message
    assert re.search(r"\(and \d+ more\)", message)


# --- The single-run layout written before the one layout ---------------------


def write_single_run_layout(workdir, folder, step, state):
    """``workdir/folder/step`` as the code before the one layout wrote a
    single run's checkpoint: the bare ``TrainState``, no members axis."""
    manager = ocp.CheckpointManager(
        os.path.abspath(os.path.join(workdir, folder)),
        item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(create=True),
    )
    manager.save(step, args=ocp.args.StandardSave(state))
    manager.close()


def state_at(workdir, step, config):
    """Member 0 of ``workdir``'s checkpoint of ``step`` (the one layout)."""
    vocab_size = data.load_tokenizer(os.path.join(workdir, "tokenizer.json")).vocab_size
    model = configuration.make_model(config, vocab_size)
    abstract = jax.eval_shape(
        lambda k: state_lib.create_train_state(model, config, k), jax.random.key(0)
    )
    manager = checkpoints.checkpoint_manager(workdir)
    restored = manager.restore(
        step,
        args=ocp.args.StandardRestore(
            {
                "state": jax.tree.map(
                    lambda x: np.zeros((1, *x.shape), x.dtype), abstract
                )
            }
        ),
    )
    manager.close()
    return jax.tree.map(lambda x: x[0], restored["state"])


def test_a_single_run_layout_is_refused_then_converted_and_resumed(
    short_config, finished_run, tmp_path
):
    """A run interrupted after step 5 whose checkpoint has the single-run
    layout: the loaders and the run refuse it, naming the layout and the
    command; the command converts it, and the run then resumes to the
    uninterrupted run's metrics and parameters, bit for bit."""
    workdir = str(tmp_path / "old")
    shutil.copytree(finished_run, workdir)
    state = state_at(workdir, 5, short_config())
    shutil.rmtree(os.path.join(workdir, "checkpoints"))
    os.remove(os.path.join(workdir, "summary.json"))
    write_single_run_layout(workdir, "checkpoints", 5, state)
    command = checkpoints.CONVERT_COMMAND.format(workdir=workdir)
    for call in (
        lambda: generation.load_run(workdir),
        lambda: train.train_and_evaluate(short_config(), workdir),
    ):
        with pytest.raises(ValueError) as raised:
            call()
        assert "single-run layout" in str(raised.value)
        assert str(raised.value).endswith(command)
    program, *arguments = command.split()
    assert program == "python"
    subprocess.run(
        [sys.executable, *arguments], cwd=ROOT, check=True, capture_output=True
    )
    for got, want in zip(
        jax.tree.leaves(state_at(workdir, 5, short_config())),
        jax.tree.leaves(state),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    train.train_and_evaluate(short_config(), workdir)
    assert read_metrics(workdir) == read_metrics(finished_run)
    jax.tree.map(
        np.testing.assert_array_equal,
        generation.load_run(workdir)[3],
        generation.load_run(finished_run)[3],
    )


def test_conversion_keeps_the_best_state_beside_each_step(tmp_path):
    """With ``train.patience`` (the workdir's ``config.json``), each step of
    ``checkpoints/`` gets the state of ``best_checkpoint/`` as its best, and
    ``best_checkpoint/`` is converted too; the single-run layout is gone."""
    workdir = str(tmp_path)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"train": {"patience": 2}}, f)
    for step in (10, 20):
        write_single_run_layout(workdir, "checkpoints", step, tree(float(step)))
    write_single_run_layout(workdir, checkpoints.BEST_CHECKPOINT, 15, tree(15.0))
    assert checkpoints.convert_single_run(workdir) == [
        "checkpoints",
        checkpoints.BEST_CHECKPOINT,
    ]
    assert sorted(os.listdir(workdir)) == sorted(
        ["config.json", "checkpoints", checkpoints.BEST_CHECKPOINT]
    )
    manager = checkpoints.checkpoint_manager(workdir)
    for step in (10, 20):
        restored = manager.restore(step)
        assert restored["state"]["params"]["w"].tolist() == [[[float(step)] * 3] * 2]
        assert restored["best"]["params"]["w"].tolist() == [[[15.0] * 3] * 2]
    manager.close()
    best = checkpoints.best_checkpoint_manager(workdir)
    assert best.all_steps() == [15] and set(best.item_metadata(15).keys()) == {"state"}
    best.close()
    assert checkpoints.convert_single_run(workdir) == []  # nothing left to convert
