"""What a training run reports about itself: metrics, timings, memory, summary.

:class:`MetricWriter` appends to the workdir's ``metrics.jsonl`` and
TensorBoard events, :class:`StepTimer` times the training steps (without
evaluations and checkpoints), :func:`memory_metrics` reads device and host
memory, :func:`training_record` makes a lap's ``metrics.jsonl`` record (the
loop of every run, ``lmhead.lm.loop``, writes it and prints the progress
line), and :func:`run_summary` and :func:`best_summary` make ``summary.json``
(and document its keys).
:data:`MEASURED_METRICS` are the logged metrics that are measured, not
computed, and so differ between two runs of the same config.
"""

import dataclasses
import json
import os
import resource
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
import tensorboardX

from lmhead.lm import evaluation, sharding

# Measured, not computed: they differ from run to run of the same config.
MEASURED_METRICS = (
    "train/tokens_per_sec",
    "train/step_ms_p50",
    "train/step_ms_p90",
    "memory/device_bytes_in_use",
    "memory/device_peak_bytes",
    "memory/host_rss_bytes",
    "memory/host_peak_rss_bytes",
)


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
                self.records = [
                    r for r in map(json.loads, f) if r["step"] <= resume_step
                ]
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


@dataclasses.dataclass
class StepTimer:
    """Time spent in training steps, without evaluations and checkpoints.

    A lap runs from :meth:`start` to :meth:`lap`; ``wall`` and ``cpu`` (the
    process's CPU time, all threads) add up the laps' seconds, ``steps``
    their steps. ``step_seconds`` holds each step's time, from the end of
    the step before (or the lap's start) to its own end: the loop waits for
    step ``s - 1`` once step ``s`` is queued, so the device stays busy while
    the host takes the time (:meth:`step_done`).
    """

    wall: float = 0.0
    cpu: float = 0.0
    steps: int = 0
    started: tuple[float, float] = (0.0, 0.0)
    last_step_end: float = 0.0
    step_seconds: list[float] = dataclasses.field(default_factory=list)

    def start(self) -> None:
        self.started = (time.perf_counter(), time.process_time())
        self.last_step_end = self.started[0]

    def step_done(self) -> None:
        """Records a step that has just ended."""
        now = time.perf_counter()
        self.step_seconds.append(now - self.last_step_end)
        self.last_step_end = now

    def lap(self, num_steps: int) -> float:
        """Ends the lap of ``num_steps`` steps; returns its wall seconds."""
        seconds = time.perf_counter() - self.started[0]
        self.wall += seconds
        self.cpu += time.process_time() - self.started[1]
        self.steps += num_steps
        return seconds

    def percentiles_ms(self, num_steps: int | None = None) -> dict[str, float]:
        """p50 and p90 of the last ``num_steps`` step times (None: all), in ms."""
        recent = self.step_seconds[-num_steps:] if num_steps else self.step_seconds
        if not recent:
            return {}
        p50, p90 = np.percentile(1e3 * np.asarray(recent), [50, 90])
        return {"step_ms_p50": float(p50), "step_ms_p90": float(p90)}


def memory_metrics() -> dict[str, float]:
    """Memory in bytes, for TensorBoard and ``metrics.jsonl``.

    ``memory/device_bytes_in_use`` and ``memory/device_peak_bytes``: of the
    fullest local device, where JAX reports them (``Device.memory_stats()``
    on GPU and TPU; not on CPU). ``memory/host_rss_bytes`` (Linux) and
    ``memory/host_peak_rss_bytes``: this process's resident memory, which
    holds the arrays on CPU.
    """
    metrics = {}
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    if any("bytes_in_use" in s for s in stats):
        metrics["memory/device_bytes_in_use"] = float(
            max(s.get("bytes_in_use", 0) for s in stats)
        )
        metrics["memory/device_peak_bytes"] = float(
            max(s.get("peak_bytes_in_use", s.get("bytes_in_use", 0)) for s in stats)
        )
    if os.path.exists("/proc/self/statm"):
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        metrics["memory/host_rss_bytes"] = float(
            resident_pages * os.sysconf("SC_PAGE_SIZE")
        )
    # ru_maxrss is in KiB on Linux, in bytes on macOS; the kernel updates it
    # lazily, so it can lag the current RSS.
    scale = 1 if sys.platform == "darwin" else 1024
    metrics["memory/host_peak_rss_bytes"] = float(
        max(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
            metrics.get("memory/host_rss_bytes", 0),
        )
    )
    return metrics


def training_record(
    timer: StepTimer, pending: list, seconds: float, config: ml_collections.ConfigDict
) -> dict[str, float]:
    """The ``metrics.jsonl`` record of a lap: the mean of the ``pending``
    steps' metrics (host values), tokens/s over ``seconds``, the step-time
    p50 and p90 (``timer``) and the memory (:func:`memory_metrics`).

    Examples:
        >>> config = ml_collections.ConfigDict(
        ...     {"train": {"batch_size": 2}, "data": {"block_size": 8}})
        >>> record = training_record(StepTimer(), [{"loss": 1.0}, {"loss": 2.0}], 0.5,
        ...                          config)
        >>> record["train/loss"], record["train/tokens_per_sec"]
        (1.5, 64.0)
    """
    tokens = len(pending) * config.train.batch_size * config.data.block_size
    logged = {f"train/{k}": float(np.mean([m[k] for m in pending])) for k in pending[0]}
    logged["train/tokens_per_sec"] = tokens / seconds
    percentiles = timer.percentiles_ms(len(pending))
    logged.update({f"train/{k}": v for k, v in percentiles.items()})
    logged.update(memory_metrics())
    return logged


def run_summary(
    config: ml_collections.ConfigDict,
    params: Any,
    vocab_size: int,
    final: dict,
    timer: StepTimer,
    compile_seconds: float,
    wall_start: float,
) -> dict:
    """A member's summary of the model and the time (``train_and_evaluate``'s).

    Keys: ``num_params``; ``num_head_params`` (owned by the head: the untied
    ``[V, D]`` and the bias; a tied table counts as the embedding's),
    ``num_embedding_params`` (the token table) and ``num_body_params``
    (everything else: positions, blocks, final norm); ``vocab_size``;
    ``final`` (the ``final`` evaluation, keys as in ``metrics.jsonl``);
    ``tokens_per_sec``, ``ms_per_step`` and ``cpu_ms_per_step`` (the
    process's CPU time, all threads; other processes on a shared machine do
    not inflate it) over the training steps of this process (``timer``),
    without compilation, evaluation or checkpoints; ``step_ms_p50`` and
    ``step_ms_p90`` (percentiles of the step times); ``memory``
    (:func:`memory_metrics` now, without the ``memory/`` prefix);
    ``compile_seconds``, ``steps`` (``train.steps``) and ``wall_seconds``
    (since ``wall_start``, a ``time.perf_counter()``).
    """
    tokens_per_step = config.train.batch_size * config.data.block_size
    num_params = count_params(params)
    num_head_params = count_params(params.get("head", {}))
    num_embedding_params = count_params(params.get("embed", {}))
    return {
        "num_params": num_params,
        "num_head_params": num_head_params,
        "num_embedding_params": num_embedding_params,
        "num_body_params": num_params - num_head_params - num_embedding_params,
        "vocab_size": vocab_size,
        "final": {k: v for k, v in final.items() if k != "step"},
        "tokens_per_sec": timer.steps * tokens_per_step / max(timer.wall, 1e-9),
        "ms_per_step": 1e3 * timer.wall / max(timer.steps, 1),
        "cpu_ms_per_step": 1e3 * timer.cpu / max(timer.steps, 1),
        **timer.percentiles_ms(),
        "memory": {k.split("/", 1)[1]: v for k, v in memory_metrics().items()},
        "compile_seconds": compile_seconds,
        "steps": config.train.steps,
        "wall_seconds": time.perf_counter() - wall_start,
    }


def best_summary(
    config: ml_collections.ConfigDict, records: list[dict], steps_run: int
) -> dict:
    """The summary's keys about the best evaluation, from the run's
    ``metrics.jsonl`` ``records``.

    Keys: ``best_step`` and ``best``, the evaluation of lowest ``eval/loss``
    (its ``eval/`` metrics); ``train_at_best`` (its ``train_eval/`` metrics,
    with ``train.eval_train_batches`` only); ``heldout_at_best`` (its
    ``heldout/`` metrics, with ``data.holdout_fraction`` only); ``steps_run``
    (the last step trained) and ``stopped_early`` (by ``train.patience``).

    Examples:
        >>> config = ml_collections.ConfigDict(
        ...     {"train": {"patience": 1, "eval_train_batches": 0, "steps": 30}})
        >>> best_summary(config, [{"step": 10, "eval/loss": 2.0},
        ...                       {"step": 20, "eval/loss": 2.5}], steps_run=20)
        {'best_step': 10, 'best': {'eval/loss': 2.0}, 'steps_run': 20, 'stopped_early': True}
    """
    stopping = evaluation.EarlyStopping.from_records(config.train.patience, records)
    best = next(
        (r for r in records if r["step"] == stopping.best_step and "eval/loss" in r), {}
    )
    summary = {
        "best_step": stopping.best_step,
        "best": {k: v for k, v in best.items() if k.startswith("eval/")},
        "steps_run": steps_run,
        "stopped_early": steps_run < config.train.steps,
    }
    if config.train.eval_train_batches:
        summary["train_at_best"] = {
            k: v for k, v in best.items() if k.startswith("train_eval/")
        }
    if (config.get("data") or {}).get("holdout_fraction"):
        summary["heldout_at_best"] = {
            k: v for k, v in best.items() if k.startswith("heldout/")
        }
    return summary


def log(message: str) -> None:
    """A progress line, from process 0 only."""
    if sharding.is_main_process():
        print(message, flush=True)


def count_params(params: Any) -> int:
    """The number of parameters (array elements) in ``params``.

    Examples:
        >>> count_params({"dense": {"kernel": np.zeros((2, 3))}, "bias": [np.zeros(4)]})
        10
    """
    return int(sum(np.size(x) for x in jax.tree.leaves(params)))
