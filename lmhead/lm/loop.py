"""The training loop of every run: a single run and an ensemble's members
are a program (:class:`lmhead.lm.program.Program`, of one member or ``M``)
and go through the same code.

:func:`train_loop` steps a program's members to ``train.steps`` with each
member's periodic actions: logging, finiteness checks, evaluation, early
stopping, the best states, checkpoints and SIGTERM; :func:`finish` writes
each member's final and test evaluations and ``summary.json``.
docs/training.md, "One loop, one run class", gives the design.
"""

import json
import os

import jax
import ml_collections
import numpy as np

from lmhead.lm import (
    checkpoints,
    data,
    evaluation,
    monitoring,
    preemption,
    sharding,
)
from lmhead.lm.members import SUMMARY_FILE
from lmhead.lm.program import Program


def steps_of(state) -> np.ndarray:
    """``[M]``: each member's step."""
    return np.asarray(jax.device_get(state.step))


def periodic_actions(
    config: ml_collections.ConfigDict, done: int
) -> tuple[bool, bool, bool]:
    """``(log, evaluate, checkpoint)`` after ``done`` steps: every
    ``train.log_every`` / ``eval_every`` / ``checkpoint_every`` steps and at
    ``train.steps``; an evaluation or a checkpoint is logged too.

    Examples:
        >>> config = ml_collections.ConfigDict({"train": {"steps": 30,
        ...     "log_every": 5, "eval_every": 10, "checkpoint_every": 20}})
        >>> [periodic_actions(config, s) for s in (5, 7, 10, 20, 30)]  # doctest: +NORMALIZE_WHITESPACE
        [(True, False, False), (False, False, False), (True, True, False),
         (True, True, True), (True, True, True)]
    """
    steps = config.train.steps
    evaluate = done % config.train.eval_every == 0 or done == steps
    checkpoint = done % config.train.checkpoint_every == 0 or done == steps
    log = evaluate or checkpoint or done % config.train.log_every == 0
    return log, evaluate, checkpoint


def _active(run: Program, state) -> np.ndarray:
    """The members still training: not stopped early, not failed, not
    finished before, and not at ``train.steps``."""
    steps = steps_of(state)
    return np.array(
        [
            not run.stoppings[i].should_stop
            and i not in run.failed
            and i not in run.finished
            and steps[i] < run.config.train.steps
            for i in range(run.count)
        ]
    )


def train_loop(run: Program, state, best=None):
    """Steps from the run's step to ``train.steps`` (or until every member
    has stopped), with each member's periodic actions. The host reads metrics
    only at those steps and on SIGTERM; between them it waits for each step
    once the next one is queued, to time it without idling the device.
    Returns the state, the best states (where the run keeps them) and the
    step timer."""
    config, steps = run.config, run.config.train.steps
    # A member that had stopped early before an interruption stays stopped.
    active = _active(run, state)
    first = int(np.max(steps_of(state)))
    timer, pending = monitoring.StepTimer(), []
    timer.start()
    with preemption.sigterm_flag() as terminated:
        for step in range(first, steps):
            if not active.any():
                break
            if preemption.stop_requested(run.manager, step, terminated):
                if pending:
                    _log_training(run, timer, pending, step, active, state)
                run.save(step, state, best)
                raise preemption.Preempted(step, str(run.manager.directory))
            state, metrics = run.train_step(state, step, active)
            pending.append(metrics)
            if len(pending) > 1:  # step `step` is queued: time the one before
                jax.block_until_ready(pending[-2])
                timer.step_done()
            done = step + 1
            log_now, evaluate_now, checkpoint_now = periodic_actions(config, done)
            if not log_now:
                continue
            _log_training(run, timer, pending, done, active, state)
            pending = []
            if evaluate_now:
                best = _log_evaluation(run, done, active, state, best)
            stopped = active & ~_active(run, state)
            if checkpoint_now or stopped.any():
                run.save(done, state, best)
            active = active & ~stopped
            timer.start()
    return state, best, timer


def _log_training(run: Program, timer, pending, done: int, active, state) -> None:
    """Waits for the ``pending`` steps' metrics (the last at step ``done``),
    checks them and ``state`` (``train.stop_on_nonfinite``), writes each
    active member's lap record (``monitoring.training_record``) and prints
    one progress line."""
    pending = [
        {k: np.reshape(v, (run.count,)) for k, v in m.items()}
        for m in jax.device_get(pending)
    ]
    timer.step_done()
    seconds = timer.lap(len(pending))
    config = run.config
    finite = members_finite(pending, state) if config.train.stop_on_nonfinite else None
    records = []
    for index in np.flatnonzero(active):
        own = [{k: v[index] for k, v in m.items()} for m in pending]
        if finite is not None and not finite[index]:
            run.fail(int(index), done, own, state)
            continue
        record = monitoring.training_record(timer, own, seconds, config)
        run.writers[index].write(done, record)
        records.append(record)
    losses = [r["train/loss"] for r in records]
    tokens = len(pending) * config.train.batch_size * config.data.block_size
    percentiles = timer.percentiles_ms(len(pending))
    memory = records[-1] if records else monitoring.memory_metrics()
    peak = memory.get("memory/device_peak_bytes", memory["memory/host_peak_rss_bytes"])
    members = (
        f" (min {min(losses, default=np.nan):.4f}, max "
        f"{max(losses, default=np.nan):.4f}; {len(losses)}/{run.count} members "
        "training)"
        if run.count > 1
        else ""
    )
    monitoring.log(
        f"step {done}/{config.train.steps}  loss "
        f"{np.mean(losses) if losses else np.nan:.4f}{members}  "
        f"{tokens * len(losses) / seconds:,.0f} tokens/s  "
        f"{1e3 * seconds / len(pending):.1f} ms/step (p50 "
        f"{percentiles['step_ms_p50']:.1f}, p90 {percentiles['step_ms_p90']:.1f})  "
        f"peak memory {peak / 2**20:,.0f} MiB  "
        f"ETA {(config.train.steps - done) * timer.wall / timer.steps:.0f} s"
    )


def members_finite(pending: list[dict], state) -> np.ndarray:
    """``[M]`` bool: whether each member's logged losses and gradient norms
    (``pending``: host metrics, each leaf ``[M]``) and every floating-point
    leaf of its state (``checkpoints.all_finite``, leaves ``[M, ...]``) are
    finite."""
    logged = np.stack(
        [np.asarray(m[k]) for m in pending for k in ("loss", "grad_norm")]
    )
    return np.isfinite(logged).all(axis=0) & np.asarray(
        checkpoints.all_finite(state, stacked=True)
    )


def _log_evaluation(run: Program, done: int, active, state, best):
    """Each active member's evaluation, written and counted for its early
    stopping; the members with a new best get their state kept
    (:meth:`Program.keep_best`). Returns ``best``."""
    results = run.evaluate(state.params)
    improved = np.zeros(run.count, bool)
    evaluated = []
    for index in np.flatnonzero(active):
        if index in run.failed:
            continue
        metrics, stopping = results[index], run.stoppings[index]
        run.writers[index].write(done, metrics)
        evaluated.append(metrics["eval/loss"])
        improved[index] = stopping.update(done, metrics["eval/loss"])
        if stopping.should_stop:
            monitoring.log(
                f"{run.member_name(index)} stopped early at step {done}: "
                f"{run.configs[index].train.patience} evaluations without a "
                f"lower eval/loss than step {stopping.best_step}'s."
            )
    if run.count == 1 and evaluated:
        line = "  ".join(f"{k} {v:.4f}" for k, v in results[0].items())
        monitoring.log(f"step {done}/{run.config.train.steps}  {line}")
    elif evaluated:
        monitoring.log(
            f"step {done}/{run.config.train.steps}  eval/loss "
            f"{np.mean(evaluated):.4f} (min {min(evaluated):.4f}, max "
            f"{max(evaluated):.4f}) over {len(evaluated)} members"
        )
    if improved.any():
        best = run.keep_best(improved, state, best)
    return best


def finish(run: Program, state, best, timer, wall_start: float) -> list[dict | None]:
    """Each member's final and test evaluations, what it keeps
    (:meth:`Program.end_members`) and its summary, also written to its
    ``summary.json``: ``monitoring.run_summary``'s and
    ``monitoring.best_summary``'s keys, ``test`` (with ``train.test_eval``)
    and :meth:`Program.summary_extra`'s. None for a failed or finished member."""
    steps_run = [int(s) for s in steps_of(state)]
    finals = _final_evaluations(run, state, steps_run)
    tests = (
        _test_evaluations(run, state, best, steps_run)
        if evaluation.wants_test_evaluation(run.config)
        else None
    )
    summaries = []
    for index, params in enumerate(run.end_members(state, best)):
        if params is None:
            summaries.append(None)
            continue
        member_config = run.configs[index]
        summary = {
            **monitoring.run_summary(
                member_config,
                params,
                run.dataset.vocab_size,
                finals[index],
                timer,
                run.compile_seconds,
                wall_start,
            ),
            **monitoring.best_summary(
                member_config, run.writers[index].records, steps_run[index]
            ),
            **({"test": tests[index]} if tests else {}),
            **run.summary_extra(index),
        }
        if sharding.is_main_process():
            with open(os.path.join(run.workdirs[index], SUMMARY_FILE), "w") as f:
                json.dump(summary, f, indent=2)
        summaries.append(summary)
    return summaries


def _done(run: Program, index: int) -> bool:
    return index in run.failed or index in run.finished


def _final_evaluations(run: Program, state, steps_run) -> list[dict | None]:
    """Each member's evaluation at its last step: the logged one, or (a
    member without one) a new one, logged."""
    finals, results = [], None
    for index, writer in enumerate(run.writers):
        if _done(run, index):
            finals.append(None)
            continue
        final = next((r for r in reversed(writer.records) if "eval/loss" in r), None)
        if final is None or final["step"] != steps_run[index]:
            results = results or run.evaluate(state.params)
            final = {"step": steps_run[index], **results[index]}
            writer.write(steps_run[index], results[index])
        finals.append(final)
    return finals


def _test_evaluations(run: Program, state, best, steps_run) -> list[dict | None]:
    """The whole test split, read now (nothing reads it before), evaluated
    once per member with :meth:`Program.best_params`; logged as ``test/...``."""
    test_set = evaluation.make_test_set(
        data.load_test_tokens(run.config.data, run.dataset.tokenizer),
        run.config,
        run.dataset.tokenizer,
    )
    params, steps = run.best_params(state, best)
    results = []
    for index, metrics in enumerate(run.evaluate_test(params, test_set)):
        if _done(run, index):
            results.append(None)
            continue
        metrics = {f"test/{k.split('/', 1)[1]}": v for k, v in metrics.items()}
        run.writers[index].write(steps_run[index], metrics)
        if run.count == 1:
            monitoring.log(
                "test  " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            )
        results.append(
            {
                **{k.split("/", 1)[1]: v for k, v in metrics.items()},
                "num_tokens": test_set.num_tokens,
                "num_chars": test_set.num_chars,
                "step": steps[index],
            }
        )
    return results
