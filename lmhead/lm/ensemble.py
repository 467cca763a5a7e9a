"""Ensembles: several runs that differ only in values that keep every shape,
trained as one program over a leading *members* axis.

``train_ensemble(config, members, workdir)`` trains the members
(:mod:`lmhead.lm.members`: a workdir and overrides of ``MEMBER_KEYS`` each)
in one jitted step over stacked states and batches (:func:`over_members`,
optionally split over devices: :func:`split_over_devices`), through the loop
of every run (:mod:`lmhead.lm.loop`). Each member behaves as, and writes
what, the single run with its values would, up to float32 rounding; what a
program is made of is :mod:`lmhead.lm.ensemble_program`'s. docs/training.md,
"Ensembles", gives the rules: what may differ, early stopping, checkpoints
and resume, the shared tokenizer, non-finite members and devices.
"""

import contextlib
import functools
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec as P

from lmhead.lm import (
    checkpoints,
    configuration,
    ensemble_program,
    loop,
    monitoring,
    sharding,
    train,
)
from lmhead.lm import members as members_lib
from lmhead.lm import model as model_lib
from lmhead.lm import state as state_lib

# In the program's workdir: its members, as train_ensemble was given them.
ENSEMBLE_FILE = "ensemble.json"
# In a member's workdir: the step at which a non-finite value stopped it.
FAILED_FILE = ensemble_program.FAILED_FILE


def over_members(fn, xs: Any, vmap_size: int) -> Any:
    """``fn`` applied to each member's slice of ``xs`` (leading axis ``M``):
    ``jax.vmap`` over groups of ``vmap_size`` members, the groups one after
    another in a ``lax.map``. ``vmap_size >= M``: one ``vmap``; ``1``: a
    ``lax.map`` over single members.

    Examples:
        >>> xs = jnp.arange(6.0).reshape(3, 2)
        >>> [over_members(jnp.sum, xs, v).tolist() for v in (1, 2, 3)]
        [[1.0, 5.0, 9.0], [1.0, 5.0, 9.0], [1.0, 5.0, 9.0]]
    """
    count = jax.tree.leaves(xs)[0].shape[0]
    if vmap_size >= count:
        return jax.vmap(fn)(xs)
    return jax.lax.map(fn, xs, batch_size=vmap_size if vmap_size > 1 else None)


def default_vmap_members(config: ml_collections.ConfigDict, count: int) -> int:
    """``train.vmap_members``, or when unset 1 on a CPU and ``count`` elsewhere."""
    if config.train.vmap_members is not None:
        return config.train.vmap_members
    return 1 if jax.default_backend() == "cpu" else count


def split_over_devices(fn, mesh: jax.sharding.Mesh, in_specs: Any = None):
    """``fn`` run by each device of ``mesh`` on its share of the members
    (``shard_map`` over :data:`~lmhead.lm.ensemble_program.MEMBERS_AXIS`),
    with no collectives: the members never meet. ``in_specs``: by default
    every argument split over the members (leading axis ``M``); the outputs
    are.

    Examples:
        >>> mesh = ensemble_program.members_mesh(jax.devices()[:1])
        >>> split_over_devices(lambda x: 2 * x, mesh)(jnp.arange(3.0)).tolist()
        [0.0, 2.0, 4.0]
    """
    members = P(ensemble_program.MEMBERS_AXIS)
    # check_vma off: a frozen member's zeros would have to be marked as
    # varying over the members.
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=members if in_specs is None else in_specs,
        out_specs=members,
        check_vma=False,
    )


def member_train_step(
    state: state_lib.TrainState,
    batch: dict[str, jax.Array],
    key: jax.Array,
    values: dict[str, jax.Array],
    active: jax.Array,
    *,
    model: model_lib.DecoderLM,
    config: ml_collections.ConfigDict,
    skip_stopped: bool = False,
) -> tuple[state_lib.TrainState, dict[str, jax.Array]]:
    """One member's ``train.train_step``, with ``values`` (``{config key:
    scalar}``, those of ``members.TRACED_KEYS`` that differ between members)
    in place of ``config``'s; the state unchanged and the metrics zero where
    ``active`` is False (a stopped member).

    ``skip_stopped``: a ``lax.cond`` skips a stopped member's step (under a
    ``lax.map``; a ``vmap`` turns it into a select), for programs whose
    members stop early; else the step's result is masked with ``where``,
    which costs a stopped member its step and the others nothing
    (docs/training.md, "Speed of an ensemble", compares the two).
    """
    optim = {k.split(".")[1]: v for k, v in values.items() if k.startswith("optim.")}
    loss = {k.split(".")[1]: v for k, v in values.items() if k.startswith("loss.")}

    def step(operands):
        state, batch, key = operands
        new_state, metrics = train.train_step(
            state.replace(tx=state_lib.make_optimizer(config, optim)),
            batch,
            key,
            model=model,
            loss_kwargs={**train.loss_keywords(config.loss), **loss},
            learning_rate_fn=state_lib.learning_rate_schedule(config, optim),
            microbatches=config.train.microbatches,
            untie_step=config.model.untie_step,
        )
        return new_state.replace(tx=state.tx), metrics

    if not skip_stopped:
        new_state, metrics = step((state, batch, key))
        keep = functools.partial(jnp.where, active)
        return jax.tree.map(keep, new_state, state), jax.tree.map(
            lambda m: jnp.where(active, m, 0), metrics
        )

    def frozen(operands):
        shapes = jax.eval_shape(step, operands)[1]
        return operands[0], jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    return jax.lax.cond(active, step, frozen, (state, batch, key))


def ensemble_train_step(states, batches, keys, values, active, *, vmap_size, **kw):
    """:func:`member_train_step` over the members (:func:`over_members`):
    every argument has a leading members axis ``M``; returns the stacked new
    states and ``[M]`` metrics."""
    return over_members(
        lambda args: member_train_step(*args, **kw),
        (states, batches, keys, values, active),
        vmap_size,
    )


def ensemble_eval_step(params, batch, *, model, vmap_size, stacked: bool):
    """``train.eval_step`` of each member's ``params``, on its own batch
    (``stacked``: ``[M, B, T]``) or on one batch shared by all (``[B, T]``)."""
    if stacked:
        return over_members(
            lambda pb: train.eval_step(pb[0], pb[1], model=model),
            (params, batch),
            vmap_size,
        )
    return over_members(
        lambda p: train.eval_step(p, batch, model=model), params, vmap_size
    )


def train_ensemble(
    config: ml_collections.ConfigDict,
    members: Sequence[members_lib.Member],
    workdir: str,
) -> list[dict | None]:
    """Trains ``members`` (each ``config`` with its overrides) as one program
    in ``workdir``, resuming from its newest checkpoint.

    Returns:
        Each member's summary (also its ``summary.json``: the keys of
        ``train.train_and_evaluate``'s, plus ``ensemble``), or ``None`` for a
        member stopped by a non-finite loss or state.

    Raises:
        ValueError, TypeError: a bad config or member (naming it), other
            members than the checkpoint's, an unsupported mesh; before
            anything is compiled.
        preemption.Preempted: SIGTERM; a checkpoint of the step it stopped at is saved.
    """
    wall_start = time.perf_counter()
    configuration.validate_config(config)
    members = list(members)
    configs = members_lib.member_configs(config, members)
    _check_mesh(config)
    configuration.check_resumable(config, workdir)
    manager = checkpoints.checkpoint_manager(workdir)
    summaries = _finished_summaries(members)
    started = manager.latest_step() is not None
    # A failed member is one of this program's only: a new program trains it.
    failed = _failed_members(members) if started else set()
    if len(summaries) + len(failed) == len(members):
        manager.close()
        monitoring.log(f"Every member of {workdir} has finished or failed.")
        return [summaries.get(m.workdir) for m in members]
    if not started:
        # Not started: the finished members are left out, never trained again.
        kept = [i for i, m in enumerate(members) if m.workdir not in summaries]
        program_members = [members[i] for i in kept]
        configs = [configs[i] for i in kept]
        for member in program_members:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(member.workdir, FAILED_FILE))
    else:
        _check_same_members(workdir, members)
        program_members = members
    _start_program(config, program_members, workdir)
    program = ensemble_program.make_program(
        config,
        program_members,
        configs,
        workdir,
        manager,
        vmap_size=default_vmap_members(config, len(program_members)),
    )
    program.finished = {
        i for i, m in enumerate(program_members) if m.workdir in summaries
    }
    program.failed = {i for i, m in enumerate(program_members) if m.workdir in failed}
    try:
        state, best, timer = _restore_and_train(program)
        results = loop.finish(program, state, best, timer, wall_start)
    finally:
        program.close()
    summaries.update(
        (m.workdir, r)
        for i, (m, r) in enumerate(zip(program_members, results))
        if i not in program.finished
    )
    return [summaries.get(m.workdir) for m in members]


def _check_mesh(config) -> None:
    if config.mesh.model != 1:
        raise ValueError(
            "config.mesh.model must be 1 in an ensemble; the vocabulary "
            f"split is for single runs. Got {config.mesh.model}."
        )
    if (config.mesh.members or 1) > 1 and config.mesh.data not in (1, -1):
        raise ValueError(
            "config.mesh.members > 1 splits the members over the devices; "
            f"config.mesh.data must then be 1 (or -1); got {config.mesh.data}."
        )
    if jax.process_count() > 1:
        raise ValueError("An ensemble runs in one process; got several.")


def _finished_summaries(members) -> dict[str, dict]:
    summaries = {}
    for member in members:
        path = os.path.join(member.workdir, train.SUMMARY_FILE)
        if os.path.exists(path):
            with open(path) as f:
                summaries[member.workdir] = json.load(f)
            monitoring.log(f"{member.workdir} has finished; it is not trained again.")
    return summaries


def _failed_members(members) -> set[str]:
    """The workdirs of the members that a non-finite value stopped."""
    failed = set()
    for member in members:
        if os.path.exists(os.path.join(member.workdir, FAILED_FILE)):
            failed.add(member.workdir)
            monitoring.log(
                f"{member.workdir} was stopped by a non-finite value "
                f"({FAILED_FILE}); it is not trained again."
            )
    return failed


def _members_record(members) -> list[dict]:
    return [dict(workdir=m.workdir, overrides=m.overrides) for m in members]


def _check_same_members(workdir: str, members) -> None:
    path = os.path.join(workdir, ENSEMBLE_FILE)
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)["members"]
    if json.loads(json.dumps(_members_record(members))) != saved:
        raise ValueError(
            f"{workdir} holds checkpoints of an ensemble of other members "
            f"({path} lists them), so it cannot resume with these; use a "
            "fresh --workdir or the same members."
        )


def _start_program(config, members, workdir) -> None:
    """The program's ``config.json`` and ``ensemble.json``."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    with open(os.path.join(workdir, ENSEMBLE_FILE), "w") as f:
        json.dump(dict(members=_members_record(members)), f, indent=2)


def _restore_and_train(program: ensemble_program.Program):
    """The stacked state (restored or initialised), trained; with the best
    states and the step timer."""
    init = jax.vmap(
        functools.partial(state_lib.create_train_state, program.model, program.config)
    )
    abstract_state = jax.eval_shape(init, program.keys["init"])
    shardings = ensemble_program.state_shardings(program, abstract_state)
    target = {
        "state": sharding.abstract_state(abstract_state, shardings),
        "best": sharding.abstract_state(abstract_state, shardings),
    }
    restored = checkpoints.restore_newest(program.manager, target)
    if restored is None:
        state = jax.jit(init, out_shardings=shardings)(program.keys["init"])
        # Copies: the train step donates the state's buffers.
        restored = {"state": state, "best": jax.tree.map(jnp.copy, state)}
    _compile(program, restored["state"], shardings)
    return loop.train_loop(program, restored["state"], restored["best"])


def _compile(program: ensemble_program.Program, state, shardings) -> None:
    """Jits the mapped train step (state donated, compiled ahead of time)
    and the two mapped eval steps."""
    common = dict(model=program.model, vmap_size=program.vmap_size)
    # The values the members share are constants of the step: member 0's
    # (not the program config's, which a member key may override for all).
    step = functools.partial(
        ensemble_train_step,
        config=program.configs[0],
        skip_stopped=any(c.train.patience for c in program.configs),
        **common,
    )
    in_mesh = ensemble_program.MEMBERS_AXIS in program.mesh.axis_names
    if in_mesh:
        step = split_over_devices(step, program.mesh)
    active = np.ones(program.count, bool)
    args = (
        state,
        program.batch(0, active),
        program.keys["dropout"],
        program.values,
        jnp.asarray(active),
    )
    start = time.perf_counter()
    program.train_fn = (
        jax.jit(step, donate_argnums=0, out_shardings=(shardings, None))
        .lower(*args)
        .compile()
    )
    program.compile_seconds = time.perf_counter() - start
    for stacked in (False, True):
        eval_step = functools.partial(ensemble_eval_step, stacked=stacked, **common)
        if in_mesh:
            members = P(ensemble_program.MEMBERS_AXIS)
            eval_step = split_over_devices(
                eval_step, program.mesh, (members, members if stacked else P())
            )
        program.eval_fns[stacked] = jax.jit(eval_step)
    devices = program.mesh.shape.get(ensemble_program.MEMBERS_AXIS, 1)
    monitoring.log(
        f"{program.count} members of {monitoring.count_params(state.params) // program.count:,} "
        f"parameters; train step compiled in {program.compile_seconds:.1f} s "
        f"({program.vmap_size} member(s) per vmap, split over {devices} "
        f"device(s))."
    )
