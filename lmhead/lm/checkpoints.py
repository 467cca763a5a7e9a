"""Checkpoints of a run's workdir: the orbax manager, the one layout,
saving, restoring the newest checkpoint that restores, converting the
single-run layout written before it, and keeping non-finite states out.

A checkpoint holds ``{"state": S}``, and with ``train.patience`` also
``{"best": B}``: the train states of a program's members, every leaf with a
leading members axis ``[M, ...]`` (a single run is a program of one, ``M =
1``; ``best_checkpoint/`` holds the best states as ``{"state": B}``). A
checkpoint of the single-run layout written before (a bare ``TrainState``)
is refused with the command that converts it (:func:`convert_single_run`).

Orbax writes a step to ``STEP.orbax-checkpoint-tmp`` and renames it when
complete, so a process killed while saving leaves the previous steps whole.
A checkpoint that still does not restore (truncated or garbled files) is set
aside to ``workdir/corrupt_checkpoints`` with a warning and the previous one
is used; one written by another config (other arrays or shapes) is an error.
:func:`check_finite` stops a run whose loss, gradient norm or state is not
finite before it saves, naming the checkpoint a rerun resumes from.
"""

import functools
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Mapping
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
# The command that converts a workdir's checkpoints of the single-run layout.
CONVERT_COMMAND = (
    "python experiments/train.py --workdir={workdir} --convert_checkpoints"
)


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
    (``{"state": ...}`` and optionally ``"best"``, trees of
    ``jax.ShapeDtypeStruct`` with shardings), or None if there is none. A
    checkpoint's ``best`` that ``target`` does not ask for (a loader's) is
    read and left out.

    A checkpoint that does not restore (truncated, garbled or missing files)
    is moved to ``workdir/corrupt_checkpoints/STEP`` with a warning that
    names the step, and the next older one is tried. Orbax keeps no checksum
    of the array data: bytes changed inside a compressed chunk may restore
    without an error, as different numbers.

    Raises:
        ValueError: a checkpoint holds other arrays or shapes than ``target``,
            or has the single-run layout (the message names the command
            that converts it).
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
        _check_layout(metadata, step, manager.directory)
        wanted = dict(target)
        if "best" in metadata.keys() and "best" not in wanted:
            wanted["best"] = wanted["state"]
        _check_checkpoint_fits(metadata, wanted, step, manager.directory)
        try:
            restored = manager.restore(step, args=ocp.args.StandardRestore(wanted))
        except Exception as e:  # tensorstore raises several kinds
            failures.append((step, e))
            continue
        _set_aside(manager, failures)
        return {name: restored[name] for name in target}
    if failures:
        raise RuntimeError(
            f"No checkpoint in {manager.directory} restores: "
            + "; ".join(
                f"step {step}: {type(e).__name__}: {str(e)[:200]}"
                for step, e in failures
            )
        )
    return None


def is_single_run_layout(metadata: Any) -> bool:
    """Whether a checkpoint's metadata (``manager.item_metadata``) is of the
    single-run layout written before the one layout: a bare ``TrainState``
    (``step``, ``params``, ...) rather than ``{"state": ...}``.

    Examples:
        >>> is_single_run_layout({"step": 0, "params": {}, "opt_state": ()})
        True
        >>> is_single_run_layout({"state": {"step": 0, "params": {}}})
        False
    """
    keys = set(metadata.keys())
    return "state" not in keys and "params" in keys


def _check_layout(metadata, step, directory) -> None:
    """ValueError, naming the command that converts it, for a checkpoint of
    the single-run layout."""
    if is_single_run_layout(metadata):
        workdir = os.path.dirname(str(directory))
        raise ValueError(
            f"The checkpoint of step {step} in {directory} has the single-run "
            "layout written before a single run became a program of one (a "
            'TrainState without a members axis); this version reads {"state": '
            "TrainState with a leading members axis}. Convert the workdir's "
            f"checkpoints in place with: {CONVERT_COMMAND.format(workdir=workdir)}"
        )


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
            key=lambda name: ("params/" not in name, name),
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


def save(
    manager: ocp.CheckpointManager, step: int, state: Any, best: Any = None
) -> None:
    """Saves ``{"state": state}`` (and ``"best": best``) as ``step`` unless
    ``manager`` has that step already (a resumed run redoing the steps after
    its checkpoint).

    ``state`` and ``best``: train states with a leading members axis (their
    ``step`` ``[M]``); one run's state (a scalar ``step``, as an import or a
    test has it) is saved as a program of one.

    With one process, Orbax writes a host copy of the arrays, which it does
    not walk device by device; several processes each write their own
    shards. Either checkpoint restores onto any mesh.
    """
    if step in manager.all_steps():
        return
    item = {"state": _as_program(state)}
    if best is not None:
        item["best"] = _as_program(best)
    if jax.process_count() == 1:
        item = jax.device_get(item)
    manager.save(step, args=ocp.args.StandardSave(item))


def _as_program(state: Any) -> Any:
    step = state["step"] if isinstance(state, Mapping) else state.step
    if jnp.ndim(step):
        return state
    return jax.tree.map(lambda x: jnp.asarray(x)[None], state)


def convert_single_run(workdir: str) -> list[str]:
    """Rewrites ``workdir``'s checkpoints of the single-run layout (a bare
    ``TrainState``, written before a single run became a program of one) in
    the one layout, in place; returns the folders it converted.

    Each step of ``checkpoints/`` becomes ``{"state": S[None]}``, with the
    run's ``train.patience`` (its ``config.json``) also ``"best"``: the
    state of ``best_checkpoint/``, the one the run kept, as the run would
    have resumed with it (its own state where there is none); each step of
    ``best_checkpoint/`` becomes ``{"state": B[None]}``. A folder is written
    beside the old one and then takes its place, so an interrupted
    conversion leaves the old checkpoints whole. The arrays are read onto
    the first device.

    The command is ``python experiments/train.py --workdir=WORKDIR
    --convert_checkpoints``.
    """
    old = {
        folder: _read_single_run(workdir, folder)
        for folder in ("checkpoints", BEST_CHECKPOINT)
    }
    best = None
    if old[BEST_CHECKPOINT]:
        best = old[BEST_CHECKPOINT][max(old[BEST_CHECKPOINT])]
    config_path = os.path.join(workdir, "config.json")
    patience = 0
    if os.path.exists(config_path):
        with open(config_path) as f:
            patience = json.load(f).get("train", {}).get("patience", 0)
    converted = []
    for folder, states in old.items():
        if not states:
            continue
        staging = f"{folder}.converting"
        shutil.rmtree(os.path.join(workdir, staging), ignore_errors=True)
        keep = 1 if folder == BEST_CHECKPOINT else CHECKPOINTS_TO_KEEP
        manager = checkpoint_manager(workdir, staging, max_to_keep=keep)
        for step, state in sorted(states.items()):
            with_best = folder == "checkpoints" and patience
            kept = state if best is None else best
            save(manager, step, state, kept if with_best else None)
        manager.close()
        path = os.path.join(workdir, folder)
        os.rename(path, f"{path}.single-run-layout")
        os.rename(os.path.join(workdir, staging), path)
        shutil.rmtree(f"{path}.single-run-layout")
        converted.append(folder)
    return converted


def _read_single_run(workdir: str, folder: str) -> dict[int, Any]:
    """``{step: state}`` of ``workdir/folder``'s checkpoints of the
    single-run layout (none when it has none, or has the one layout)."""
    if not has_saved_step(workdir, folder):
        return {}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    manager = checkpoint_manager(workdir, folder)
    states = {}
    for step in manager.all_steps():
        metadata = manager.item_metadata(step)
        if not is_single_run_layout(metadata):
            continue
        target = jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
            metadata.tree,
        )
        states[step] = manager.restore(step, args=ocp.args.StandardRestore(target))
    manager.close()
    return states


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
