"""Training and evaluation of a ``DecoderLM``, driven by a config: the
steps, their map over a program's members, the one place that jits them, and
the run that drives them.

``train_and_evaluate(config, workdir)`` trains a single run, a program of one
member; ``train_program(config, members, workdir)`` trains several runs that
differ only in member keys (:mod:`lmhead.lm.members`) as one program, each
equal to its single run up to float32 rounding. Both read and encode the
corpus, build the model and an AdamW optimizer, resume from the newest
checkpoint in ``workdir`` if there is one, and run the loop of every run
(:mod:`lmhead.lm.loop`) over the program (:mod:`lmhead.lm.program`).
``train_step`` and ``eval_step`` are pure functions of one member;
:func:`program_train_step` maps them over the members (:func:`over_members`,
optionally split over devices: :func:`split_over_devices`), and
:func:`compile_steps` is the one place that jits them. docs/training.md
describes what a workdir holds, what is evaluated when, how a run resumes and
stops, and what is deterministic where.
"""

import contextlib
import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from lmhead import fused, losses, metrics
from lmhead.lm import (
    checkpoints,
    configuration,
    data,
    loop,
    monitoring,
    sharding,
)
from lmhead.lm import members as members_lib
from lmhead.lm import model as model_lib
from lmhead.lm import program as program_lib
from lmhead.lm import state as state_lib

# What a finished run leaves in its workdir; a workdir with one is not trained again.
SUMMARY_FILE = members_lib.SUMMARY_FILE


def loss_keywords(
    loss_config: ml_collections.ConfigDict, dataset: data.Dataset | None = None
) -> dict[str, Any]:
    """``DecoderLM.loss`` keywords of ``config.loss``: chunk_size and
    vocab_order only if set, filter_eps and filter_target only with a
    filter_eps (so an exact run compiles the program it did before they
    existed). ``vocab_order="frequency"`` becomes the order of ``dataset``'s
    training tokens counted (``fused.frequency_order``), most frequent first.

    Examples:
        >>> loss = ml_collections.ConfigDict(dict(
        ...     loss_impl="fused", chunk_size=None, filter_eps=None,
        ...     filter_target="both"))
        >>> loss_keywords(loss)
        {'loss_impl': 'fused'}
        >>> loss.filter_eps = "auto"
        >>> loss_keywords(loss)
        {'filter_eps': 'auto', 'filter_target': 'both', 'loss_impl': 'fused'}
    """
    keywords = loss_config.to_dict()
    for name in ("chunk_size", "filter_eps", "vocab_order"):
        if keywords.get(name, None) is None:
            keywords.pop(name, None)
    if "filter_eps" not in keywords:
        keywords.pop("filter_target", None)
    if keywords.get("vocab_order") == "frequency":
        if dataset is None:
            raise ValueError(
                "config.loss.vocab_order='frequency' counts the training split's "
                "tokens, which this program is not given; use 'mean_logit' or None."
            )
        counts = np.bincount(dataset.train_tokens, minlength=dataset.vocab_size)
        keywords["vocab_order"] = fused.frequency_order(counts)
    return keywords


def train_loss(
    params: Any,
    batch: dict[str, jax.Array],
    key: jax.Array,
    *,
    model: model_lib.DecoderLM,
    loss_kwargs: dict[str, Any],
    tied: jax.typing.ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective that ``train_step`` differentiates: ``DecoderLM.loss``
    of ``batch`` with ``train=True`` and dropout key ``key``. Returns the
    loss and ``{"nll", "accuracy"}``, with MTP heads also each depth's
    ``depth{i}_loss``, ``depth{i}_nll`` and ``depth{i}_accuracy``.

    ``tied`` (an untied model's boolean scalar, traced): where True the
    embedding table is the head (``state.table_as_head``), so the loss, and
    the table's gradient, are the tied model's, and the head's own
    unembedding gets a zero gradient."""
    if tied is not None:
        params = state_lib.table_as_head(params, tied)
    loss, metrics = model.apply(
        {"params": params},
        batch["inputs"],
        batch["labels"],
        train=True,
        rngs={"dropout": key},
        method=model_lib.DecoderLM.loss,
        **loss_kwargs,
    )
    logged = ("nll", "accuracy")
    return loss, {
        name: value
        for name, value in metrics.items()
        if name in logged or name.startswith("depth")
    }


def train_step(
    state: state_lib.TrainState,
    batch: dict[str, jax.Array],
    key: jax.Array,
    *,
    model: model_lib.DecoderLM,
    loss_kwargs: dict[str, Any],
    learning_rate_fn: optax.Schedule,
    microbatches: int = 1,
    untie_step: int | None = None,
) -> tuple[state_lib.TrainState, dict[str, jax.Array]]:
    """One AdamW step on ``batch = {"inputs": [B, T], "labels": [B, T]}``.

    The dropout key is ``fold_in(key, state.step)``: a function of the step.
    The gradient is that of :func:`train_loss`, over ``microbatches``
    microbatches with :func:`accumulate`: the same step up to float32
    rounding, with ``1/n`` of the activations alive at a time. On a CPU,
    where they then stay in cache, that is faster (docs/nanogpt_parity.md,
    "Microbatches and CPU devices", has the measurement and its command).
    Returns the new state and scalar metrics: loss (the objective), nll,
    accuracy, grad_norm (before clipping) and learning_rate.

    ``untie_step = U`` (an untied model, ``model.untie_step``): a step
    ``s < U`` is the tied model's step (:func:`train_loss` with ``tied``),
    and after it the head and its AdamW moments are set to the table's
    (``state.copy_table_to_head``), as ``state.create_train_state`` does at
    step 0; so step ``U`` starts the head from the table, with the table's
    moments, and from then on the two train apart. One compiled step, one
    parameter tree: checkpoints and resume are a plain run's.
    """
    dropout_key = jax.random.fold_in(key, state.step)
    tied = None if untie_step is None else state.step < untie_step
    grad_fn = jax.value_and_grad(
        functools.partial(train_loss, model=model, loss_kwargs=loss_kwargs, tied=tied),
        has_aux=True,
    )
    (loss, metrics), grads = accumulate(
        grad_fn, state.params, batch, dropout_key, microbatches
    )
    new_state = state.apply_gradients(grads=grads)
    if untie_step is not None:
        new_state = state_lib.copy_table_to_head(
            new_state, new_state.step <= untie_step
        )
    return new_state, {
        "loss": loss,
        **metrics,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": learning_rate_fn(state.step),
    }


def accumulate(
    fn, params: Any, batch: dict[str, jax.Array], key: jax.Array, microbatches: int = 1
) -> Any:
    """``fn(params, batch, key)`` in ``microbatches`` pieces, as
    ``train_step`` computes its gradient (``fn``: the ``value_and_grad`` of
    :func:`train_loss`).

    With ``microbatches = n > 1``, the mean of ``fn``'s results over ``n``
    microbatches of ``B / n`` rows (rows ``i, i + n, ...``; key
    ``fold_in(key, i)``), computed one after the other in a ``lax.scan``;
    with ``n = 1``, ``fn(params, batch, key)`` itself.
    """
    if microbatches == 1:
        return fn(params, batch, key)
    size = batch["inputs"].shape[0]
    if size % microbatches:
        raise ValueError(
            f"train.microbatches={microbatches} must divide the batch size {size}."
        )
    # [B, ...] -> [n, B / n, ...] without moving rows across data shards.
    split = jax.tree.map(
        lambda x: jnp.swapaxes(
            x.reshape(size // microbatches, microbatches, *x.shape[1:]), 0, 1
        ),
        batch,
    )

    def add(total, index_and_batch):
        index, microbatch = index_and_batch
        result = fn(params, microbatch, jax.random.fold_in(key, index))
        return jax.tree.map(jnp.add, total, result), None

    zeros = jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype),
        jax.eval_shape(fn, params, jax.tree.map(lambda x: x[0], split), key),
    )
    total, _ = jax.lax.scan(add, zeros, (jnp.arange(microbatches), split))
    return jax.tree.map(lambda x: x / microbatches, total)


def eval_step(
    params: Any, batch: dict[str, jax.Array], *, model: model_lib.DecoderLM
) -> dict[str, jax.Array]:
    """Sums over one evaluation batch, to add up over the whole set.

    ``batch`` is ``data.eval_batches``'s: inputs, labels and weights (0 on
    the padding windows of a last, partial batch), each ``[B, T]``. Returns
    ``window_nll`` and ``window_count`` (``[B]``: each window's summed nll
    and weight, for the standard error over windows), ``correct_sum`` and
    ``bins`` (``metrics.calibration_bins``, ``[15, 3]``). The logits are
    built whatever ``loss_impl`` says: the calibration bins need them (see
    ``configs/default.py``).
    """
    logits = model.apply({"params": params}, batch["inputs"])
    token_nll, stats = losses.cross_entropy(
        logits, batch["labels"], weights=batch["weights"], reduction="none"
    )
    return {
        "window_nll": jnp.sum(token_nll, axis=-1),
        "window_count": jnp.sum(batch["weights"], axis=-1),
        "correct_sum": stats["accuracy"] * stats["weight_sum"],
        "bins": metrics.calibration_bins(logits, batch["labels"], batch["weights"]),
    }


def over_members(fn, xs: Any, vmap_size: int) -> Any:
    """``fn`` applied to each member's slice of ``xs`` (leading axis ``M``):
    ``jax.vmap`` over groups of ``vmap_size`` members, the groups one after
    another in a ``lax.map``. ``vmap_size >= M``: one ``vmap``; ``1``: a
    ``lax.map`` over single members. A program of one (``M = 1``) calls
    ``fn`` on its member, without a ``vmap``.

    Examples:
        >>> xs = jnp.arange(6.0).reshape(3, 2)
        >>> [over_members(jnp.sum, xs, v).tolist() for v in (1, 2, 3)]
        [[1.0, 5.0, 9.0], [1.0, 5.0, 9.0], [1.0, 5.0, 9.0]]
        >>> over_members(jnp.sum, xs[:1], 1).tolist()
        [1.0]
    """
    count = jax.tree.leaves(xs)[0].shape[0]
    if count == 1:
        result = fn(jax.tree.map(lambda x: x[0], xs))
        return jax.tree.map(lambda x: x[None], result)
    if vmap_size >= count:
        return jax.vmap(fn)(xs)
    return jax.lax.map(fn, xs, batch_size=vmap_size if vmap_size > 1 else None)


def split_over_devices(fn, mesh: jax.sharding.Mesh, in_specs: Any = None):
    """``fn`` run by each device of ``mesh`` on its share of the members
    (``shard_map`` over :data:`~lmhead.lm.sharding.MEMBERS_AXIS`), with no
    collectives: the members never meet. ``in_specs``: by default every
    argument split over the members (leading axis ``M``); the outputs are.

    Examples:
        >>> mesh = sharding.members_mesh(jax.devices()[:1])
        >>> split_over_devices(lambda x: 2 * x, mesh)(jnp.arange(3.0)).tolist()
        [0.0, 2.0, 4.0]
    """
    members = P(sharding.MEMBERS_AXIS)
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
    freeze: str | None = "where",
    dataset: data.Dataset | None = None,
) -> tuple[state_lib.TrainState, dict[str, jax.Array]]:
    """One member's :func:`train_step`, with ``values`` (``{config key:
    scalar}``, those of ``members.TRACED_KEYS`` that differ between members)
    in place of ``config``'s; ``dataset``: the one the members share, whose
    training tokens ``loss.vocab_order="frequency"`` counts.

    ``freeze``: how a stopped member (``active`` False) keeps its state and
    gets zero metrics. ``"where"``: the step's result is masked, which costs
    a stopped member its step and the others nothing; ``"cond"``: a
    ``lax.cond`` skips a stopped member's step (under a ``lax.map``; a
    ``vmap`` turns it into a select), for programs whose members stop early
    (docs/training.md, "Speed of an ensemble", compares the two); None: the
    step itself, for a program of one, which ends when its member stops.
    """
    optim = {k.split(".")[1]: v for k, v in values.items() if k.startswith("optim.")}
    loss = {k.split(".")[1]: v for k, v in values.items() if k.startswith("loss.")}

    def step(operands):
        state, batch, key = operands
        new_state, metrics = train_step(
            state.replace(tx=state_lib.make_optimizer(config, optim)),
            batch,
            key,
            model=model,
            loss_kwargs={**loss_keywords(config.loss, dataset), **loss},
            learning_rate_fn=state_lib.learning_rate_schedule(config, optim),
            microbatches=config.train.microbatches,
            untie_step=config.model.untie_step,
        )
        return new_state.replace(tx=state.tx), metrics

    if freeze is None:
        return step((state, batch, key))
    if freeze == "where":
        new_state, metrics = step((state, batch, key))
        keep = functools.partial(jnp.where, active)
        return jax.tree.map(keep, new_state, state), jax.tree.map(
            lambda m: jnp.where(active, m, 0), metrics
        )

    def frozen(operands):
        shapes = jax.eval_shape(step, operands)[1]
        return operands[0], jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    return jax.lax.cond(active, step, frozen, (state, batch, key))


def program_train_step(states, batches, keys, values, active, *, vmap_size, **kw):
    """:func:`member_train_step` over a program's members
    (:func:`over_members`): every argument has a leading members axis ``M``
    (``values``' leaves too); returns the stacked new states and ``[M]``
    metrics."""
    return over_members(
        lambda args: member_train_step(*args, **kw),
        (states, batches, keys, values, active),
        vmap_size,
    )


def program_eval_step(params, batch, *, model, vmap_size, stacked: bool):
    """:func:`eval_step` of each member's ``params``, on its own batch
    (``stacked``: ``[M, B, T]``) or on one batch shared by all (``[B, T]``)."""
    if stacked:
        return over_members(
            lambda pb: eval_step(pb[0], pb[1], model=model), (params, batch), vmap_size
        )
    return over_members(lambda p: eval_step(p, batch, model=model), params, vmap_size)


def compile_steps(
    model: model_lib.DecoderLM,
    configs: Sequence[ml_collections.ConfigDict],
    state: state_lib.TrainState,
    batch: dict[str, jax.Array],
    keys: jax.Array,
    values: dict[str, jax.Array],
    mesh: jax.sharding.Mesh,
    *,
    vmap_size: int = 1,
    dataset: data.Dataset | None = None,
):
    """Jits a program's steps: :func:`program_train_step` (state donated,
    compiled ahead of time on these arguments, traced under
    ``jax.set_mesh(mesh)``, which ``loss_impl="vocab_parallel"`` uses) and
    :func:`program_eval_step` for shared and stacked batches.

    ``configs``: each member's (the values they share are constants of the
    step: member 0's, not the program config's, which a member key may
    override for all); ``state``, ``batch`` (``[M, B, T]``), ``keys`` (the
    dropout keys, ``[M]``) and ``values`` are placed on ``mesh``. On a
    members mesh the steps are split over its devices
    (:func:`split_over_devices`); elsewhere the metrics come back
    replicated, so that every process reads them. ``dataset``: the one the
    members share, if they do.

    Returns ``(train_fn, eval_fns, compile_seconds)``: ``train_fn(state,
    batch, keys, values, active)`` gives the new state and ``[M]`` metrics
    (``active``: ``[M]`` bool, the members that step); ``eval_fns[stacked]
    (params, batch)`` each member's sums of :func:`eval_step`.
    """
    count = len(configs)
    freeze = None if count == 1 else "where"
    if count > 1 and any(c.train.patience for c in configs):
        freeze = "cond"
    common = dict(model=model, vmap_size=vmap_size)
    step = functools.partial(
        program_train_step, config=configs[0], freeze=freeze, dataset=dataset, **common
    )
    in_members_mesh = sharding.MEMBERS_AXIS in mesh.axis_names
    if in_members_mesh:
        step = split_over_devices(step, mesh)
    metrics_sharding = None if in_members_mesh else sharding.replicated(mesh)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    active = sharding.replicate(np.ones(count, bool), mesh)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        train_fn = (
            jax.jit(
                step,
                donate_argnums=0,
                out_shardings=(state_shardings, metrics_sharding),
            )
            .lower(state, batch, keys, values, active)
            .compile()
        )
    compile_seconds = time.perf_counter() - start
    eval_fns = {}
    for stacked in (False, True):
        evaluate = functools.partial(program_eval_step, stacked=stacked, **common)
        if in_members_mesh:
            members = P(sharding.MEMBERS_AXIS)
            evaluate = split_over_devices(
                evaluate, mesh, (members, members if stacked else P())
            )
        eval_fns[stacked] = jax.jit(evaluate, out_shardings=metrics_sharding)
    return train_fn, eval_fns, compile_seconds


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains ``config`` in ``workdir`` (resuming if it holds a checkpoint):
    a program of one member, whose workdir is the program's
    (:func:`train_program`).

    A run that has already finished is not trained again: its
    ``summary.json`` is returned.

    Returns:
        The summary also written to ``summary.json``: the model's size, the
        last evaluation (``final``) and the time and memory of this process's
        training steps (:func:`monitoring.run_summary`), the best evaluation
        (:func:`monitoring.best_summary`), and with ``train.test_eval``
        ``test``: the whole test split's ``loss``, ``loss_stderr``,
        ``bits_per_char``, ``perplexity``, ``accuracy``, ``ece``, ``words``,
        ``word_perplexity`` (``evaluation.make_test_set``), ``num_tokens``,
        ``num_chars`` and ``step`` (of the parameters evaluated).

    Raises:
        ValueError, TypeError: a bad config, corpus or prompt, or a workdir
            of another config; before anything is compiled.
        FloatingPointError: a non-finite loss, gradient norm or state, with
            ``train.stop_on_nonfinite``; nothing after it is saved.
        preemption.Preempted: SIGTERM; a checkpoint of the step it stopped at is saved.
    """
    (summary,) = train_program(config, [members_lib.Member(workdir, {})], workdir)
    return summary


def train_program(
    config: ml_collections.ConfigDict,
    members: Sequence[members_lib.Member],
    workdir: str,
) -> list[dict | None]:
    """Trains ``members`` (each ``config`` with its overrides) as one program
    in ``workdir``, resuming from its newest checkpoint: an ensemble, or,
    with one member whose workdir is ``workdir``, a single run
    (:func:`train_and_evaluate`).

    A member with a ``summary.json`` has finished: it is left out of a
    program that has not started, and not trained again in one that has.

    Returns:
        Each member's summary (also its ``summary.json``: the keys of
        :func:`train_and_evaluate`'s, plus ``ensemble`` for an ensemble's
        member), or ``None`` for a member stopped by a non-finite loss or
        state.

    Raises:
        ValueError, TypeError: a bad config or member (naming it), other
            members than the checkpoint's, an unsupported mesh; before
            anything is compiled.
        FloatingPointError: a single run's non-finite loss, gradient norm or
            state, with ``train.stop_on_nonfinite``.
        preemption.Preempted: SIGTERM; a checkpoint of the step it stopped at is saved.
    """
    wall_start = time.perf_counter()
    configuration.validate_config(config)
    members = list(members)
    configs = members_lib.member_configs(config, members)
    program_lib.check_mesh(config, len(members))
    configuration.check_resumable(config, workdir)
    summaries = members_lib.finished_summaries(members)
    started = checkpoints.has_saved_step(workdir)
    # A failed member is one of this program's only: a new program trains it.
    failed = members_lib.failed_members(members) if started else set()
    if len(summaries) + len(failed) == len(members):
        return [summaries.get(m.workdir) for m in members]
    if not started:
        # Not started: the finished members are left out, never trained again.
        kept = [i for i, m in enumerate(members) if m.workdir not in summaries]
        members, configs = [members[i] for i in kept], [configs[i] for i in kept]
        for member in members:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(member.workdir, members_lib.FAILED_FILE))
    else:
        members_lib.check_same_members(workdir, members)
    program = program_lib.make_program(config, members, configs, workdir)
    program.finished = {i for i, m in enumerate(members) if m.workdir in summaries}
    program.failed = {i for i, m in enumerate(members) if m.workdir in failed}
    try:
        state, best = _restore_or_init(program)
        program.start(int(np.max(loop.steps_of(state))))
        _compile(program, state)
        state, best, timer = loop.train_loop(program, state, best)
        results = loop.finish(program, state, best, timer, wall_start)
    finally:
        program.close()
    summaries.update(
        (m.workdir, r)
        for i, (m, r) in enumerate(zip(members, results))
        if i not in program.finished
    )
    return [summaries.get(m.workdir) for m in members]


def _restore_or_init(program: program_lib.Program):
    """The program's state and best states (None unless kept): restored from
    its newest checkpoint, or initialised from each member's key."""
    init = functools.partial(
        over_members,
        functools.partial(state_lib.create_train_state, program.model, program.config),
        vmap_size=program.count,
    )
    abstract = jax.eval_shape(init, program.keys["init"])
    shardings = sharding.stacked_shardings(abstract, program.mesh)
    target = {"state": sharding.abstract_state(abstract, shardings)}
    if program.keeps_best:
        target["best"] = target["state"]
    restored = checkpoints.restore_newest(program.manager, target)
    if restored is not None:
        return restored["state"], restored.get("best")
    state = jax.jit(init, out_shardings=shardings)(program.keys["init"])
    # A copy: the train step donates the state's buffers.
    return state, jax.tree.map(jnp.copy, state) if program.keeps_best else None


def _compile(program: program_lib.Program, state) -> None:
    """:func:`compile_steps` of the program, on its first batch."""
    shared = all(t is program.train_tokens[0] for t in program.train_tokens)
    program.train_fn, program.eval_fns, program.compile_seconds = compile_steps(
        program.model,
        program.configs,
        state,
        program.batch(0, np.ones(program.count, bool)),
        program.keys["dropout"],
        program.values,
        program.mesh,
        vmap_size=program.vmap_size,
        dataset=program.dataset if shared else None,
    )
    devices = program.mesh.shape.get(sharding.MEMBERS_AXIS, 1)
    member_params = monitoring.count_params(state.params) // program.count
    monitoring.log(
        f"{program.count} member(s) of {member_params:,} parameters; train step "
        f"compiled in {program.compile_seconds:.1f} s ({program.vmap_size} "
        f"member(s) per vmap, split over {devices} device(s)); starting at step "
        f"{int(np.max(loop.steps_of(state)))}."
    )
