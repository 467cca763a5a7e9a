"""Training and evaluation of a ``DecoderLM``, driven by a config.

``train_and_evaluate(config, workdir)`` reads and encodes the corpus, builds
the model and an AdamW optimizer, resumes from the newest checkpoint in
``workdir`` if there is one, and runs the loop of every run
(:mod:`lmhead.lm.loop`) over a run of one member. ``train_step`` and
``eval_step`` are pure functions; :func:`compile_steps` is the one place that
jits them. docs/training.md describes what a workdir holds, what is evaluated
when, how a run resumes and stops, and what is deterministic where.
"""

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from lmhead import fused, losses
from lmhead.lm import (
    checkpoints,
    configuration,
    data,
    evaluation,
    generation,
    loop,
    monitoring,
    sharding,
    versions,
)
from lmhead.lm import model as model_lib
from lmhead.lm import state as state_lib

# What a finished run leaves in its workdir; a workdir with one is not trained again.
SUMMARY_FILE = loop.SUMMARY_FILE


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
    loss and ``{"nll", "accuracy"}``.

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
    return loss, {"nll": metrics["nll"], "accuracy": metrics["accuracy"]}


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
    ``bins`` (``losses.calibration_bins``, ``[15, 3]``). The logits are
    built whatever ``loss_impl`` says: the calibration bins need them (see
    ``configs/default.py``).
    """
    logits = model.apply({"params": params}, batch["inputs"])
    token_nll, metrics = losses.cross_entropy(
        logits, batch["labels"], weights=batch["weights"], reduction="none"
    )
    return {
        "window_nll": jnp.sum(token_nll, axis=-1),
        "window_count": jnp.sum(batch["weights"], axis=-1),
        "correct_sum": metrics["accuracy"] * metrics["weight_sum"],
        "bins": losses.calibration_bins(logits, batch["labels"], batch["weights"]),
    }


def compile_steps(
    model: model_lib.DecoderLM,
    config: ml_collections.ConfigDict,
    state: state_lib.TrainState,
    batch: dict[str, np.ndarray],
    key: jax.Array,
    mesh: jax.sharding.Mesh | None = None,
    dataset: data.Dataset | None = None,
):
    """Jits ``train_step`` (state donated, compiled ahead of time) and ``eval_step``.

    With a ``mesh``, the state is sharded by ``sharding.tree_shardings``, the
    batch over ``"data"``, the metrics replicated, and the step is traced
    under ``jax.set_mesh(mesh)`` (which ``loss_impl="vocab_parallel"`` uses).
    ``dataset``: the run's, whose training tokens ``loss.vocab_order=
    "frequency"`` counts.
    Returns ``(train_fn, eval_fn, compile_seconds)``; ``train_fn(state, batch,
    key)`` and ``eval_fn(params, batch)`` take the shapes of the examples.
    """
    step = functools.partial(
        train_step,
        model=model,
        loss_kwargs=loss_keywords(config.loss, dataset),
        learning_rate_fn=state_lib.learning_rate_schedule(config),
        microbatches=config.train.microbatches,
        untie_step=config.model.untie_step,
    )
    train_shardings, eval_shardings = {}, {}
    if mesh is not None:
        state_shardings = sharding.tree_shardings(state, mesh)
        replicated = sharding.replicated(mesh)
        train_shardings = dict(
            in_shardings=(state_shardings, sharding.batch_sharding(mesh), replicated),
            out_shardings=(state_shardings, replicated),
        )
        eval_shardings = dict(out_shardings=replicated)
    start = time.perf_counter()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        train_fn = (
            jax.jit(step, donate_argnums=0, **train_shardings)
            .lower(state, batch, key)
            .compile()
        )
    compile_seconds = time.perf_counter() - start
    eval_fn = jax.jit(functools.partial(eval_step, model=model), **eval_shardings)
    return train_fn, eval_fn, compile_seconds


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains ``config`` in ``workdir`` (resuming if it holds a checkpoint).

    A run that has already finished is not trained again: its
    ``summary.json`` is returned. The loop is every run's
    (:func:`lmhead.lm.loop.train_loop`), over a run of one member.

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
    wall_start = time.perf_counter()
    configuration.validate_config(config)
    configuration.check_resumable(config, workdir)
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.model)
    dataset = _load_dataset(config, workdir)
    model = configuration.make_model(config, dataset.vocab_size)
    init_key, dropout_key, sample_key = jax.random.split(
        jax.random.key(config.train.seed), 3
    )
    init_key, dropout_key = sharding.replicate((init_key, dropout_key), mesh)
    manager = checkpoints.checkpoint_manager(workdir)
    state = state_lib.restore_or_init(manager, model, config, init_key, mesh)
    summary_path = os.path.join(workdir, SUMMARY_FILE)
    finished = monitoring.finished_summary(summary_path, int(state.step))
    if finished is not None:
        monitoring.log(f"{workdir} has finished {int(state.step)} steps.")
        manager.close()
        return finished
    start_workdir(config, workdir)
    run = _SingleRun(
        config, workdir, dataset, model, state, manager, dropout_key, sample_key, mesh
    )
    try:
        state, _, timer = loop.train_loop(run, state)
        (summary,) = loop.finish(run, state, None, timer, wall_start)
    finally:
        run.close()
    return summary


def _load_dataset(config, workdir) -> data.Dataset:
    """The encoded corpus (read or made by process 0 first) once the prompt
    is known to encode: unknown characters fail now, not after training."""
    os.makedirs(workdir, exist_ok=True)
    dataset = sharding.main_process_first(
        lambda: data.load_dataset(config.data, workdir)
    )
    try:
        dataset.tokenizer.encode(config.sample.prompt)
    except ValueError as e:
        raise ValueError(f"config.sample.prompt={config.sample.prompt!r}: {e}") from e
    return dataset


def start_workdir(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Process 0 writes ``config.json`` and ``versions.json`` and removes the
    ``summary.json`` of a run that is not finished (an older ``train.steps``)."""
    if not sharding.is_main_process():
        return
    summary_path = os.path.join(workdir, SUMMARY_FILE)
    if os.path.exists(summary_path):
        os.remove(summary_path)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json(indent=2))
    versions.write_versions(workdir)


class _SingleRun(loop.Run):
    """A single run as :func:`loop.train_loop` reads it: one member, whose
    state has no members axis. It compiles the steps on ``state`` and the
    first batch and opens the metric writer, the evaluation sets, the
    early-stopping count and, with ``train.patience``, the best checkpoint's
    manager, which keeps the best evaluation's state on disk."""

    stacked = False

    def __init__(
        self,
        config,
        workdir,
        dataset,
        model,
        state,
        manager,
        dropout_key,
        sample_key,
        mesh,
    ):
        self.config, self.configs, self.workdirs = config, [config], [workdir]
        self.dataset, self.model, self.mesh, self.manager = (
            dataset,
            model,
            mesh,
            manager,
        )
        self.dropout_key, self.sample_key = dropout_key, sample_key
        self.failed, self.finished = set(), set()
        self.train_fn, self.eval_fn, self.compile_seconds = compile_steps(
            model, config, state, self.batch(0), dropout_key, mesh, dataset
        )
        monitoring.log(
            f"{monitoring.count_params(state.params):,} parameters; "
            f"train step compiled in {self.compile_seconds:.1f} s; starting "
            f"at step {int(state.step)}."
        )
        self.eval_sets = evaluation.periodic_eval_sets(config, dataset, mesh)
        self.writers = [monitoring.MetricWriter(workdir, int(state.step))]
        self.stoppings = [
            evaluation.EarlyStopping.from_records(
                config.train.patience, self.writers[0].records
            )
        ]
        self.best_manager = (
            checkpoints.best_checkpoint_manager(workdir)
            if config.train.patience
            else None
        )

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The sharded training batch of ``step``."""
        return sharding.shard_batch(
            data.train_batch(
                self.dataset.train_tokens,
                seed=self.config.train.seed,
                step=step,
                batch_size=self.config.train.batch_size,
                block_size=self.config.data.block_size,
            ),
            self.mesh,
        )

    def train_step(self, state, step, active):
        return self.train_fn(state, self.batch(step), self.dropout_key)

    def evaluate(self, params):
        return [
            {
                k: v
                for eval_set in self.eval_sets
                for k, v in evaluation.evaluate(self.eval_fn, params, eval_set).items()
            }
        ]

    def evaluate_test(self, params, test_set):
        batches = [sharding.shard_batch(b, self.mesh) for b in test_set.batches]
        sharded = dataclasses.replace(test_set, batches=batches)
        return [evaluation.evaluate(self.eval_fn, params, sharded)]

    def save(self, step, state, best):
        checkpoints.save(self.manager, step, state)

    def keep_best(self, improved, state, best):
        if self.best_manager is not None:
            checkpoints.save(self.best_manager, int(state.step), state)
        return best

    def best_params(self, state, best):
        if self.best_manager is None:
            return state.params, [int(state.step)]
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        best = checkpoints.restore_newest(self.best_manager, target)
        return best.params, [int(best.step)]

    def fail(self, index, done, pending, state):
        checkpoints.check_finite(pending, done, state, self.manager)

    def end_members(self, state, best):
        """``samples.txt`` from the trained parameters, written by process 0
        (:func:`generation.write_samples`); every process gathers them."""
        if self.config.sample.num_samples:
            params = sharding.to_host(state.params)
            if sharding.is_main_process():
                generation.write_samples(
                    self.config,
                    self.model,
                    params,
                    self.dataset.tokenizer,
                    self.sample_key,
                    self.workdirs[0],
                )
        return [state.params]

    def close(self):
        for closable in (self.writers[0], self.manager, self.best_manager):
            if closable is not None:
                closable.close()
