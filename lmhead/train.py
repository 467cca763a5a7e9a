"""Training and evaluation of a ``DecoderLM``: one loop, driven by a config.

``train_and_evaluate(config, workdir)`` reads and encodes the corpus, builds
the model and an AdamW optimizer, resumes from the newest checkpoint in
``workdir`` if there is one, trains, evaluates, checkpoints, and ends with
decoded samples. ``train_step`` and ``eval_step`` are pure functions;
:func:`compile_steps` is the one place that jits them.

Weight decay applies to the kernels of dense layers (attention and MLP
projections) and to nothing else: not to LayerNorm scales, biases, the
position table, or the ``[V, D]`` tables of the input embedding and of the
untied unembedding. A tied table is shared by the input and the head and gets
no decay; for an even comparison the untied head's own ``[V, D]`` -- one
vector per token, like the embedding -- gets none either, so tied and untied
runs differ by the tying alone.

A run's workdir holds ``config.json``, ``tokenizer.json``, ``tokens.npz``,
``checkpoints/`` (orbax), ``metrics.jsonl``, TensorBoard events,
``samples.txt`` and, once the run has finished, ``summary.json``. The batch
and the dropout key of step ``s`` depend only on ``(seed, s)``, so a
checkpoint's step is the whole data position: a resumed run continues
exactly as an uninterrupted one would have.

Reliability. A workdir is resumed only by the config that made it, up to
the keys in ``config_checks.RESUMABLE_CHANGES``
(:func:`config_checks.check_resumable`). A checkpoint that does not restore
(truncated or garbled files) is set aside with a warning and the previous
one is used (:func:`restore_or_init`). A non-finite loss, gradient norm or
parameter stops the run before it saves (``config.train.stop_on_nonfinite``),
and SIGTERM saves a checkpoint at the next step boundary and raises
:class:`Preempted`.

Determinism. On CPU, the same config and seed give bitwise-identical
metrics and parameters, run to run and across a kill and resume. On GPU,
XLA may choose different reduction orders (atomics in scatter-adds such as
the embedding gradient, autotuned matmul and fused-reduction kernels), so
two runs agree to rounding only; ``XLA_FLAGS=--xla_gpu_deterministic_ops=true``
asks for deterministic kernels at some cost in speed. A resume is exact on
any platform only up to the same caveat.
"""

import contextlib
import functools
import json
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import tensorboardX
from flax.training import train_state

from lmhead import checkpoints
from lmhead import config_checks
from lmhead import data
from lmhead import generation
from lmhead import losses
from lmhead import model as model_lib
from lmhead import sharding

TrainState = train_state.TrainState


def make_model(config: ml_collections.ConfigDict,
               vocab_size: int) -> model_lib.DecoderLM:
    """The ``DecoderLM`` of ``config.model``; its ``max_len`` is the block size."""
    return model_lib.DecoderLM(
        vocab_size=vocab_size, max_len=config.data.block_size,
        **{**config.model.to_dict(),
           "dtype": config_checks.DTYPES[config.model.dtype]})


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    r"""nanoGPT's schedule: linear warmup, then cosine to ``min_lr`` at ``steps``.

    With peak :math:`\eta`, floor :math:`\eta_{min}`, :math:`W` warmup steps
    and :math:`S` steps, step :math:`s` (0-based) uses

    .. math::
        \eta_s = \eta \frac{s + 1}{W + 1} \quad (s < W), \qquad
        \eta_s = \eta_{min} + \tfrac12 (1 + \cos(\pi r)) (\eta - \eta_{min}),
        \quad r = \frac{s - W}{S - W} \quad (s \ge W).

    Examples:
        >>> config = ml_collections.ConfigDict({"train": {"steps": 10},
        ...     "optim": {"lr": 1.0, "min_lr": 0.0, "warmup_steps": 4}})
        >>> [round(float(learning_rate_schedule(config)(s)), 2) for s in (0, 3, 4, 7, 10)]
        [0.2, 0.8, 1.0, 0.5, 0.0]
    """
    peak, floor = config.optim.lr, config.optim.min_lr
    warmup, steps = config.optim.warmup_steps, config.train.steps

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        ratio = jnp.clip((step - warmup) / max(steps - warmup, 1), 0.0, 1.0)
        cosine = floor + 0.5 * (1.0 + jnp.cos(jnp.pi * ratio)) * (peak - floor)
        return jnp.where(step < warmup, peak * (step + 1) / (warmup + 1), cosine)
    return schedule


def weight_decay_mask(params: Any) -> Any:
    """True for the parameters that decay: those named ``kernel`` (dense layers).

    Examples:
        >>> weight_decay_mask({"embed": {"embedding": 0}, "mlp": {"kernel": 0,
        ...                    "bias": 0}, "head": {"unembedding": 0}})
        {'embed': {'embedding': False}, 'head': {'unembedding': False}, 'mlp': {'bias': False, 'kernel': True}}
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


def make_optimizer(config: ml_collections.ConfigDict
                   ) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the masked weight decay."""
    adamw = optax.adamw(
        learning_rate_schedule(config), b1=config.optim.b1, b2=config.optim.b2,
        weight_decay=config.optim.weight_decay, mask=weight_decay_mask)
    if not config.optim.grad_clip:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.optim.grad_clip), adamw)


def create_train_state(model: model_lib.DecoderLM,
                       config: ml_collections.ConfigDict,
                       key: jax.Array) -> TrainState:
    """Initial parameters and optimizer state; ``step`` is an int32 array."""
    tokens = jnp.zeros((1, config.data.block_size), jnp.int32)
    params = model.init(key, tokens)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params,
                              tx=make_optimizer(config))
    return state.replace(step=jnp.zeros((), jnp.int32))


def loss_keywords(loss_config: ml_collections.ConfigDict) -> dict[str, Any]:
    """``DecoderLM.loss`` keywords of ``config.loss`` (chunk_size only if set)."""
    keywords = loss_config.to_dict()
    if keywords["chunk_size"] is None:
        del keywords["chunk_size"]
    return keywords


def train_step(state: TrainState, batch: dict[str, jax.Array], key: jax.Array,
               *, model: model_lib.DecoderLM, loss_kwargs: dict[str, Any],
               learning_rate_fn: optax.Schedule
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW step on ``batch = {"inputs": [B, T], "labels": [B, T]}``.

    The dropout key is ``fold_in(key, state.step)``: a function of the step.
    Returns the new state and scalar metrics: loss (the objective), nll,
    accuracy, grad_norm (before clipping) and learning_rate.
    """
    dropout_key = jax.random.fold_in(key, state.step)

    def loss_fn(params):
        return model.apply({"params": params}, batch["inputs"], batch["labels"],
                           train=True, rngs={"dropout": dropout_key},
                           method=model_lib.DecoderLM.loss, **loss_kwargs)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    new_state = state.apply_gradients(grads=grads)
    return new_state, {"loss": loss, "nll": metrics["nll"],
                       "accuracy": metrics["accuracy"],
                       "grad_norm": optax.tree.norm(grads),
                       "learning_rate": learning_rate_fn(state.step)}


def eval_step(params: Any, batch: dict[str, jax.Array], *,
              model: model_lib.DecoderLM) -> dict[str, jax.Array]:
    """Sums over one validation batch, to add up over the whole set.

    ``batch`` is ``data.eval_batches``'s: inputs, labels and weights (0 on
    the padding windows of a last, partial batch), each ``[B, T]``. Returns
    ``nll_sum``, ``correct_sum``, ``count`` (the weight sum) and ``bins``
    (``losses.calibration_bins``, ``[15, 3]``).
    """
    logits = model.apply({"params": params}, batch["inputs"])
    _, metrics = losses.cross_entropy(logits, batch["labels"],
                                      weights=batch["weights"])
    count = metrics["weight_sum"]
    return {"nll_sum": metrics["nll"] * count,
            "correct_sum": metrics["accuracy"] * count, "count": count,
            "bins": losses.calibration_bins(logits, batch["labels"],
                                            batch["weights"])}


def compile_steps(model: model_lib.DecoderLM, config: ml_collections.ConfigDict,
                  state: TrainState, batch: dict[str, np.ndarray], key: jax.Array,
                  mesh: jax.sharding.Mesh | None = None):
    """Jits ``train_step`` (state donated, compiled ahead of time) and ``eval_step``.

    With a ``mesh``, the state is sharded by ``sharding.tree_shardings``, the
    batch over ``"data"``, the metrics replicated, and the step is traced
    under ``jax.set_mesh(mesh)`` (which ``loss_impl="vocab_parallel"`` uses).
    Returns ``(train_fn, eval_fn, compile_seconds)``; ``train_fn(state, batch,
    key)`` and ``eval_fn(params, batch)`` take the shapes of the examples.
    """
    step = functools.partial(
        train_step, model=model, loss_kwargs=loss_keywords(config.loss),
        learning_rate_fn=learning_rate_schedule(config))
    train_shardings, eval_shardings = {}, {}
    if mesh is not None:
        state_shardings = sharding.tree_shardings(state, mesh)
        replicated = sharding.replicated(mesh)
        train_shardings = dict(
            in_shardings=(state_shardings, sharding.batch_sharding(mesh),
                          replicated),
            out_shardings=(state_shardings, replicated))
        eval_shardings = dict(out_shardings=replicated)
    start = time.perf_counter()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        train_fn = jax.jit(step, donate_argnums=0, **train_shardings).lower(
            state, batch, key).compile()
    compile_seconds = time.perf_counter() - start
    eval_fn = jax.jit(functools.partial(eval_step, model=model), **eval_shardings)
    return train_fn, eval_fn, compile_seconds


def evaluate(eval_fn, params: Any, batches: list[dict[str, np.ndarray]],
             chars_per_token: float) -> dict[str, float]:
    """Validation metrics over ``batches``: loss (nll, nats per token),
    perplexity, bits per character, accuracy and ECE."""
    sums = jax.device_get([eval_fn(params, batch) for batch in batches])
    total = {k: np.sum([s[k] for s in sums], axis=0) for k in sums[0]}
    nll = total["nll_sum"] / total["count"]
    return {"eval/loss": float(nll),
            "eval/perplexity": float(losses.perplexity(nll)),
            "eval/bits_per_char": float(
                losses.bits_per_character(nll, chars_per_token)),
            "eval/accuracy": float(total["correct_sum"] / total["count"]),
            "eval/ece": float(losses.calibration_error_from_bins(total["bins"]))}


class MetricWriter:
    """Appends metrics to ``metrics.jsonl`` and TensorBoard events.

    On resume at step ``s``, lines after ``s`` (written after the checkpoint
    by an interrupted run) are dropped, so the file reads as one run. Every
    process keeps the records; only process 0 writes them.
    """

    def __init__(self, workdir: str, resume_step: int):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.records = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.records = [r for r in map(json.loads, f)
                                if r["step"] <= resume_step]
        self.tensorboard = None
        if sharding.is_main_process():
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)
            self.tensorboard = tensorboardX.SummaryWriter(workdir)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        self.records.append(record)
        if self.tensorboard is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for name, value in metrics.items():
            self.tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def restore_or_init(manager: ocp.CheckpointManager, model: model_lib.DecoderLM,
                    config: ml_collections.ConfigDict, key: jax.Array,
                    mesh: jax.sharding.Mesh | None = None) -> TrainState:
    """The newest checkpoint's state, or a fresh one initialised from ``key``,
    sharded over ``mesh`` (default: the first device) whatever mesh saved it.

    A checkpoint that does not restore (truncated, garbled or missing files)
    is moved to ``workdir/corrupt_checkpoints/STEP`` with a warning that
    names the step, and the next older one is tried, so a run never starts
    over from step 0 while it has a checkpoint. Orbax keeps no checksum of
    the array data: bytes changed inside a compressed chunk may restore
    without an error, as different numbers.

    Raises:
        ValueError: a checkpoint holds other arrays or shapes than this
            config's model and optimizer (it belongs to another config).
        RuntimeError: there are checkpoints and none restores; the message
            names the directory and each step's error.
    """
    if mesh is None:
        mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    init = functools.partial(create_train_state, model, config)
    abstract = jax.eval_shape(init, key)
    shardings = sharding.tree_shardings(abstract, mesh)
    target = sharding.abstract_state(abstract, shardings)
    state = checkpoints.restore_newest(manager, target)
    if state is None:
        state = jax.jit(init, out_shardings=shardings)(key)
    return state


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains ``config`` in ``workdir`` (resuming if it holds a checkpoint).

    Returns:
        The summary also written to ``summary.json``: ``num_params``,
        ``num_head_params`` (owned by the head: the untied ``[V, D]`` and the
        bias; a tied table counts as the embedding's), ``final`` (the last
        evaluation, keys as in ``metrics.jsonl``), ``vocab_size``,
        ``tokens_per_sec``, ``ms_per_step`` and ``cpu_ms_per_step`` (the
        process's CPU time, all threads; other processes on a shared machine
        do not inflate it) over the training steps of this process, without
        compilation, evaluation or checkpoints; ``compile_seconds``, ``steps``
        and ``wall_seconds`` (this process).

    Raises:
        ValueError, TypeError: a bad config, corpus or prompt, or a workdir
            of another config; before anything is compiled.
        FloatingPointError: a non-finite loss, gradient norm or state, with
            ``train.stop_on_nonfinite``; nothing after it is saved.
        Preempted: SIGTERM; a checkpoint of the step it stopped at is saved.
    """
    wall_start = time.perf_counter()
    config_checks.validate_config(config)
    config_checks.check_resumable(config, workdir)
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.model)
    dataset = _load_dataset(config, workdir)
    model = make_model(config, dataset.vocab_size)
    init_key, dropout_key, sample_key = jax.random.split(
        jax.random.key(config.train.seed), 3)
    init_key, dropout_key = sharding.replicate((init_key, dropout_key), mesh)
    manager = checkpoints.checkpoint_manager(workdir)
    state = restore_or_init(manager, model, config, init_key, mesh)
    summary_path = os.path.join(workdir, "summary.json")
    if int(state.step) >= config.train.steps and os.path.exists(summary_path):
        _log(f"{workdir} has finished {int(state.step)} steps.")
        manager.close()
        with open(summary_path) as f:
            return json.load(f)
    if sharding.is_main_process():
        if os.path.exists(summary_path):
            os.remove(summary_path)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))
    writer = MetricWriter(workdir, resume_step=int(state.step))
    example = sharding.shard_batch(data.train_batch(
        dataset.train_tokens, seed=config.train.seed, step=0,
        batch_size=config.train.batch_size,
        block_size=config.data.block_size), mesh)
    train_fn, eval_fn, compile_seconds = compile_steps(
        model, config, state, example, dropout_key, mesh)
    _log(f"{_count(state.params):,} parameters; train step compiled in "
         f"{compile_seconds:.1f} s; starting at step {int(state.step)}.")
    eval_set = [sharding.shard_batch(batch, mesh) for batch in data.eval_batches(
        dataset.val_tokens, num_batches=config.train.eval_batches,
        batch_size=config.train.batch_size, block_size=config.data.block_size)]
    run_eval = functools.partial(evaluate, eval_fn, batches=eval_set,
                                 chars_per_token=dataset.val_chars_per_token)
    try:
        state, timing = _train_loop(config, state, train_fn, run_eval, dataset,
                                    manager, writer, dropout_key, mesh)
        final = _final_evaluation(config, writer, run_eval, state)
    finally:
        writer.close()
        manager.close()
    if config.sample.num_samples:
        params = sharding.to_host(state.params)  # every process takes part
        if sharding.is_main_process():
            generation.write_samples(config, model, params, dataset.tokenizer, sample_key,
                           workdir)
    summary = _summary(config, state, dataset.vocab_size, final, timing,
                       compile_seconds, wall_start)
    if sharding.is_main_process():
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _load_dataset(config, workdir) -> data.Dataset:
    """The encoded corpus (read or made by process 0 first) once the prompt
    is known to encode: unknown characters fail now, not after training."""
    os.makedirs(workdir, exist_ok=True)
    dataset = sharding.main_process_first(
        lambda: data.load_dataset(config.data, workdir))
    try:
        dataset.tokenizer.encode(config.sample.prompt)
    except ValueError as e:
        raise ValueError(f"config.sample.prompt={config.sample.prompt!r}: {e}") from e
    return dataset


def _final_evaluation(config, writer, run_eval, state) -> dict[str, float]:
    """The evaluation at ``train.steps``: the logged one, or a new one, logged."""
    final = next((r for r in reversed(writer.records) if "eval/loss" in r), None)
    if final is None or final["step"] != config.train.steps:
        final = {"step": config.train.steps, **run_eval(state.params)}
        writer.write(final["step"], {k: v for k, v in final.items() if k != "step"})
    return final


def _summary(config, state, vocab_size, final, timing, compile_seconds,
             wall_start) -> dict:
    """``train_and_evaluate``'s summary (see its Returns)."""
    tokens_per_step = config.train.batch_size * config.data.block_size
    return {
        "num_params": _count(state.params),
        "num_head_params": _count(state.params.get("head", {})),
        "vocab_size": vocab_size,
        "final": {k: v for k, v in final.items() if k != "step"},
        "tokens_per_sec": timing["steps"] * tokens_per_step / max(timing["wall"], 1e-9),
        "ms_per_step": 1e3 * timing["wall"] / max(timing["steps"], 1),
        "cpu_ms_per_step": 1e3 * timing["cpu"] / max(timing["steps"], 1),
        "compile_seconds": compile_seconds,
        "steps": config.train.steps,
        "wall_seconds": time.perf_counter() - wall_start}


class Preempted(Exception):
    """``train_and_evaluate`` stopped on SIGTERM; a checkpoint of ``step`` is saved."""

    def __init__(self, step: int, directory: str):
        super().__init__(f"Stopped by SIGTERM at step {step}; its checkpoint is "
                         f"in {directory}. Rerun the same command to resume.")
        self.step = step


def _train_loop(config, state, train_fn, run_eval, dataset, manager, writer,
                dropout_key, mesh):
    """Steps from ``state.step`` to ``train.steps``; the host waits for the
    device only at log, evaluation and checkpoint steps, and on SIGTERM."""
    steps = config.train.steps
    pending, timing = [], {"wall": 0.0, "cpu": 0.0, "steps": 0}
    clock = [time.perf_counter(), time.process_time()]
    flush = functools.partial(_flush_metrics, config, manager, writer, timing,
                              clock)
    with _sigterm_flag() as terminated:
        for step in range(int(state.step), steps):
            if _stop_requested(manager, step, terminated):
                if pending:
                    flush(pending, step, state)
                if manager.latest_step() != step:
                    manager.save(step, args=ocp.args.StandardSave(state))
                raise Preempted(step, str(manager.directory))
            batch = sharding.shard_batch(data.train_batch(
                dataset.train_tokens, seed=config.train.seed, step=step,
                batch_size=config.train.batch_size,
                block_size=config.data.block_size), mesh)
            state, metrics = train_fn(state, batch, dropout_key)
            pending.append(metrics)
            done = step + 1
            evaluate_now = done % config.train.eval_every == 0 or done == steps
            checkpoint_now = done % config.train.checkpoint_every == 0 or done == steps
            if not (evaluate_now or checkpoint_now
                    or done % config.train.log_every == 0):
                continue
            flush(pending, done, state)
            pending = []
            if evaluate_now:
                metrics = run_eval(state.params)
                writer.write(done, metrics)
                _log(f"step {done}/{steps}  " + "  ".join(
                    f"{k} {v:.4f}" for k, v in metrics.items()))
            if checkpoint_now:
                manager.save(done, args=ocp.args.StandardSave(state))
            clock[:] = time.perf_counter(), time.process_time()
    return state, timing


def _flush_metrics(config, manager, writer, timing, clock, pending, done,
                   state):
    """Waits for the ``pending`` steps' metrics (the last at step ``done``),
    checks them and ``state`` (``train.stop_on_nonfinite``), logs their mean
    and adds to ``timing``."""
    pending = jax.device_get(pending)
    seconds = time.perf_counter() - clock[0]
    timing["wall"] += seconds
    timing["cpu"] += time.process_time() - clock[1]
    timing["steps"] += len(pending)
    if config.train.stop_on_nonfinite:
        _check_finite(pending, done, state, manager)
    tokens = len(pending) * config.train.batch_size * config.data.block_size
    logged = {f"train/{k}": float(np.mean([m[k] for m in pending]))
              for k in pending[0]}
    logged["train/tokens_per_sec"] = tokens / seconds
    writer.write(done, logged)
    steps = config.train.steps
    eta = (steps - done) * timing["wall"] / timing["steps"]
    _log(f"step {done}/{steps}  loss {logged['train/loss']:.4f}  "
         f"{logged['train/tokens_per_sec']:,.0f} tokens/s  "
         f"{1e3 * seconds / len(pending):.1f} ms/step  ETA {eta:.0f} s")


def _check_finite(pending, done, state, manager) -> None:
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
                + _newest_checkpoint(manager))
    if not bool(_all_finite(state)):
        raise FloatingPointError(
            f"The parameters or optimizer state are not finite after step "
            f"{done}; stopped without saving. " + _newest_checkpoint(manager))


def _newest_checkpoint(manager) -> str:
    step = manager.latest_step()
    if step is None:
        return (f"{manager.directory} holds no checkpoint. (A lower optim.lr "
                "or optim.grad_clip may help; train.stop_on_nonfinite=False "
                "trains on.)")
    return (f"The newest checkpoint, step {step} in {manager.directory}, is "
            "kept; a rerun resumes from it.")


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    """True when every floating-point leaf of ``tree`` is finite."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                              if jnp.issubdtype(x.dtype, jnp.inexact)]))


@contextlib.contextmanager
def _sigterm_flag():
    """A ``threading.Event`` that SIGTERM sets while the block runs.

    Only in the main thread of a single process: a signal handler can only be
    installed there, and several processes must stop at the same step, which
    JAX's preemption sync point decides (see ``_stop_requested``).
    """
    event = threading.Event()
    if (jax.process_count() > 1
            or threading.current_thread() is not threading.main_thread()):
        yield event
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: event.set())
    try:
        yield event
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_requested(manager, step: int, terminated: threading.Event) -> bool:
    """SIGTERM seen: by this process, or (several processes) by JAX's
    preemption notifier, at a step that every process agrees on."""
    if jax.process_count() > 1:
        return manager.reached_preemption(step)
    return terminated.is_set()


def _log(message: str) -> None:
    """A progress line, from process 0 only."""
    if sharding.is_main_process():
        print(message, flush=True)


def _count(params: Any) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(params)))
