"""Checkpoints of a run's workdir: the orbax manager, saving, restoring the
newest checkpoint that restores, and keeping non-finite states out of them.

Orbax writes a step to ``STEP.orbax-checkpoint-tmp`` and renames it when
complete, so a process killed while saving leaves the previous steps whole.
A checkpoint that still does not restore (truncated or garbled files) is set
aside to ``workdir/corrupt_checkpoints`` with a warning and the previous one
is used; one written by another config (other arrays or shapes) is an error.
:func:`check_finite` stops a run whose loss, gradient norm or state is not
finite before it saves, naming the checkpoint a rerun resumes from.
"""

import functools
import math
import os
import shutil
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from lmhead.lm import sharding

CHECKPOINTS_TO_KEEP = 2
# Where restore_newest moves a checkpoint that fails to restore, in the workdir.
CORRUPT_CHECKPOINTS = "corrupt_checkpoints"
# Where training keeps the best evaluation's state when train.patience is set.
BEST_CHECKPOINT = "best_checkpoint"


def checkpoint_manager(
    workdir: str, folder: str = "checkpoints", max_to_keep: int = CHECKPOINTS_TO_KEEP
) -> ocp.CheckpointManager:
    """Synchronous orbax manager of ``workdir/folder``; the newest
    ``max_to_keep`` steps are kept.

    Orbax writes a step to ``STEP.orbax-checkpoint-tmp`` and renames it when
    complete, so a process killed while saving leaves the previous steps
    whole; the next save of that step replaces the partial directory.
    """
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(workdir, folder)),
        item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
        ),
    )


def has_saved_step(workdir: str, folder: str = "checkpoints") -> bool:
    """Whether ``workdir/folder`` holds a completed step (orbax names each
    step's folder by the step; a partial save ends in ``-tmp``). Reads the
    directory only: unlike a manager, it creates nothing.

    Examples:
        >>> import tempfile
        >>> workdir = tempfile.mkdtemp()
        >>> os.makedirs(os.path.join(workdir, "checkpoints", "500"))
        >>> has_saved_step(workdir), has_saved_step(workdir, BEST_CHECKPOINT)
        (True, False)
    """
    path = os.path.join(workdir, folder)
    return os.path.isdir(path) and any(name.isdigit() for name in os.listdir(path))


def best_checkpoint_manager(workdir: str) -> ocp.CheckpointManager:
    """The manager of ``workdir/best_checkpoint``: the state of the best
    evaluation so far, one step (training saves there only on a new best)."""
    return checkpoint_manager(workdir, BEST_CHECKPOINT, max_to_keep=1)


def restore_newest(manager: ocp.CheckpointManager, target: Any) -> Any | None:
    """The newest of ``manager``'s checkpoints that restores into ``target``
    (a tree of ``jax.ShapeDtypeStruct`` with shardings), or None if there is none.

    A checkpoint that does not restore (truncated, garbled or missing files)
    is moved to ``workdir/corrupt_checkpoints/STEP`` with a warning that
    names the step, and the next older one is tried. Orbax keeps no checksum
    of the array data: bytes changed inside a compressed chunk may restore
    without an error, as different numbers.

    Raises:
        ValueError: a checkpoint holds other arrays or shapes than ``target``.
        RuntimeError: there are checkpoints and none restores; the message
            names the directory and each step's error.
    """
    failures = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            metadata = manager.item_metadata(step)
        except Exception as e:  # any unreadable file
            failures.append((step, e))
            continue
        _check_checkpoint_fits(metadata, target, step, manager.directory)
        try:
            state = manager.restore(step, args=ocp.args.StandardRestore(target))
        except Exception as e:  # tensorstore raises several kinds
            failures.append((step, e))
            continue
        _set_aside(manager, failures)
        return state
    if failures:
        raise RuntimeError(
            f"No checkpoint in {manager.directory} restores: "
            + "; ".join(
                f"step {step}: {type(e).__name__}: {str(e)[:200]}"
                for step, e in failures
            )
        )
    return None


def _check_checkpoint_fits(metadata, target, step, directory) -> None:
    """ValueError unless the checkpoint's arrays have the target's paths and shapes."""

    def shapes(tree):
        return {
            sharding.leaf_path(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        }

    saved, wanted = shapes(metadata), shapes(target)
    differences = [
        f"{name}: {saved.get(name, 'absent')} in the checkpoint, "
        f"{wanted.get(name, 'absent')} in the model"
        for name in sorted(
            saved.keys() | wanted.keys(),
            key=lambda name: (not name.startswith("params/"), name),
        )
        if saved.get(name) != wanted.get(name)
    ]
    if differences:
        more = len(differences) - 3
        raise ValueError(
            f"The checkpoint of step {step} in {directory} does not fit this "
            f"config's model: {'; '.join(differences[:3])}"
            f"{f' (and {more} more)' if more > 0 else ''}. It was written by "
            "another config; use that config or a fresh workdir."
        )


def _set_aside(manager, failures) -> None:
    """Moves the checkpoints that failed to restore out of ``manager``'s
    directory, so that training can save those steps again."""
    if not failures:
        return
    if sharding.is_main_process():
        corrupt = os.path.join(
            os.path.dirname(str(manager.directory)), CORRUPT_CHECKPOINTS
        )
        os.makedirs(corrupt, exist_ok=True)
        for step, error in failures:
            warnings.warn(
                f"The checkpoint of step {step} in {manager.directory} does "
                f"not restore ({type(error).__name__}: {str(error)[:200]}); "
                f"moved it to {corrupt} and resumed from an older one.",
                RuntimeWarning,
                stacklevel=4,
            )
            path = os.path.join(str(manager.directory), str(step))
            if os.path.isdir(path):  # not deleted meanwhile by a running job
                shutil.move(path, os.path.join(corrupt, f"{step}.{time.time_ns()}"))
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("lmhead: corrupt checkpoints moved")
    manager.reload()


def save(manager: ocp.CheckpointManager, step: int, state: Any) -> None:
    """Saves ``state`` as ``step`` unless ``manager`` has that step already
    (a resumed run redoing the steps after its checkpoint)."""
    if step not in manager.all_steps():
        manager.save(step, args=ocp.args.StandardSave(state))


def check_finite(
    pending: list[dict], done: int, state: Any, manager: ocp.CheckpointManager
) -> None:
    """Raises FloatingPointError at the first pending step (the last is
    ``done``) whose loss or gradient norm is not finite, or when ``state``
    (after step ``done``) is not."""
    for offset, metrics in enumerate(pending):
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            step = done - len(pending) + offset + 1
            raise FloatingPointError(
                f"Non-finite training at step {step}: loss {loss}, gradient "
                f"norm {grad_norm}. Stopped at step {done} without saving. "
                + _newest_checkpoint(manager)
            )
    if not bool(all_finite(state)):
        raise FloatingPointError(
            f"The parameters or optimizer state are not finite after step "
            f"{done}; stopped without saving. " + _newest_checkpoint(manager)
        )


def _newest_checkpoint(manager) -> str:
    """Where a rerun resumes from, for the error message."""
    step = manager.latest_step()
    if step is None:
        return (
            f"{manager.directory} holds no checkpoint. (A lower optim.lr "
            "or optim.grad_clip may help; train.stop_on_nonfinite=False "
            "trains on.)"
        )
    return (
        f"The newest checkpoint, step {step} in {manager.directory}, is "
        "kept; a rerun resumes from it."
    )


@functools.partial(jax.jit, static_argnames="stacked")
def all_finite(tree: Any, stacked: bool = False) -> jax.Array:
    """True when every floating-point leaf of ``tree`` is finite; with
    ``stacked`` (leaves with a leading members axis ``M``), ``[M]``: each
    member's. One compiled reduction over the tree.

    Examples:
        >>> tree = {"w": jnp.array([[1.0, jnp.nan], [2.0, 3.0]]), "step": jnp.zeros(2)}
        >>> bool(all_finite(tree)), all_finite(tree, stacked=True).tolist()
        (False, [False, True])
    """

    def finite(x):
        if stacked:
            return jnp.isfinite(x).reshape(x.shape[0], -1).all(axis=1)
        return jnp.isfinite(x).all()

    return jnp.stack(
        [
            finite(x)
            for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)
        ]
    ).all(axis=0)
