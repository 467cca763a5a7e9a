"""Runs read back from their work directories: one run (:func:`read_run`),
a sweep directory (:func:`read_sweep`), the time they took
(:func:`wall_seconds`) and their curves (:func:`curve`); the files are
listed in ``docs/sweeps.md``.
"""

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from lmhead.lm.configuration import flatten

SWEEP_FILE = "sweep.json"  # in the sweep directory: the runs and their commands
STATUS_FILE = "status.json"  # in a run's workdir: how its last process exited
LOG_FILE = "run.log"  # in a run's workdir: the train process's stdout and stderr

Overrides = dict[str, Any]


@dataclasses.dataclass
class Run:
    """One run's directory, read back.

    Attributes:
        name: the directory name.
        workdir: its path.
        overrides: the sweep's overrides for it (``{}`` when unknown).
        config: ``config.json`` as a nested dict (``{}`` before it exists).
        metrics: ``metrics.jsonl`` records, one per step and kind, sorted by
            step; a step logged twice (a resumed run) keeps its last record.
        summary: ``summary.json``, or ``None`` for a run that did not finish.
        status: ``"finished"`` (summary present), ``"failed"`` (its process
            exited without a summary), ``"unfinished"`` (started, no exit
            recorded: running, interrupted, or launched elsewhere) or
            ``"not started"``.
        returncode: of the last process, when the sweep runner recorded it.
        interval: that process's start and end, in seconds since the epoch,
            when the runner recorded them.
    """

    name: str
    workdir: str
    overrides: Overrides
    config: dict
    metrics: list[dict]
    summary: dict | None
    status: str
    returncode: int | None = None
    interval: tuple[float, float] | None = None


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_metrics(path: str) -> list[dict]:
    """Reads ``metrics.jsonl``; an unfinished last line (a killed run) is skipped.

    Records with the same step and the same kind of keys (``train/`` or
    ``eval/``) keep the last one, as a resumed run repeats the steps after its
    checkpoint.
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    records = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(f"{path}, line {number}: not JSON ({e}).") from e
        kinds = tuple(sorted({k.split("/")[0] for k in record if k != "step"}))
        records[(record.get("step", 0), kinds)] = record
    return [records[key] for key in sorted(records, key=lambda k: k[0])]


def read_run(workdir: str, overrides: Overrides | None = None) -> Run:
    """Reads a run's ``config.json``, ``metrics.jsonl``, ``summary.json`` and status.

    Examples:
        >>> import tempfile
        >>> workdir = tempfile.mkdtemp()
        >>> with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        ...     _ = f.write('{"step": 10, "eval/loss": 2.5}\\n{"step": 20, "ev')
        >>> run = read_run(workdir)
        >>> run.status, run.metrics
        ('unfinished', [{'step': 10, 'eval/loss': 2.5}])
    """
    config = _read_json(os.path.join(workdir, "config.json")) or {}
    metrics = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    summary = _read_json(os.path.join(workdir, "summary.json"))
    status_record = _read_json(os.path.join(workdir, STATUS_FILE))
    returncode = status_record["returncode"] if status_record else None
    interval = (
        (status_record["started"], status_record["ended"])
        if status_record and "started" in status_record
        else None
    )
    if summary is not None:
        status = "finished"
    elif returncode is not None:
        status = "failed"
    elif config or metrics:
        status = "unfinished"
    else:
        status = "not started"
    return Run(
        os.path.basename(os.path.normpath(workdir)),
        workdir,
        dict(overrides or {}),
        config,
        metrics,
        summary,
        status,
        returncode,
        interval,
    )


def read_sweep_record(sweep_dir: str) -> dict:
    """``sweep.json`` of ``sweep_dir`` (its command, machine and runs), or ``{}``."""
    return _read_json(os.path.join(sweep_dir, SWEEP_FILE)) or {}


def read_sweep(sweep_dir: str) -> list[Run]:
    """Reads every run of a sweep directory, in the sweep's order.

    The runs are those listed in ``sweep.json`` (written by the sweep runner;
    listed runs never started count too) and any other subdirectory with a
    ``config.json`` (runs launched from the ``--dry_run`` commands). Runs
    missing from ``sweep.json`` get as overrides the config values that
    differ between runs.
    """
    listed = read_sweep_record(sweep_dir).get("runs", [])
    runs = [
        read_run(os.path.join(sweep_dir, r["name"]), r["overrides"]) for r in listed
    ]
    known = {r["name"] for r in listed}
    others = [
        read_run(os.path.join(sweep_dir, name))
        for name in sorted(os.listdir(sweep_dir))
        if name not in known
        and os.path.isfile(os.path.join(sweep_dir, name, "config.json"))
    ]
    flat_configs = [flatten(r.config) for r in runs + others if r.config]
    for run in others:
        flat = flatten(run.config)
        run.overrides = {k: flat.get(k) for k in varying_keys(flat_configs)}
    return runs + others


def varying_keys(flat_configs: Sequence[dict[str, Any]]) -> list[str]:
    """The keys whose values are not the same in every config, sorted.

    Examples:
        >>> varying_keys([{"a": 1, "b": 2}, {"a": 1, "b": 3}])
        ['b']
    """
    keys = sorted(set().union(*flat_configs)) if flat_configs else []
    return [
        k
        for k in keys
        if len({json.dumps(c.get(k), sort_keys=True) for c in flat_configs}) > 1
    ]


def wall_seconds(runs: Sequence[Run]) -> float:
    """The ``wall_seconds`` of the runs' summaries, summed, with the members
    of an ensemble program counted once: each member's summary reports the
    program's time (its ``ensemble.program``), so a program counts its
    members' largest.

    Examples:
        >>> def run(seconds, program=None):
        ...     summary = {"wall_seconds": seconds}
        ...     if program:
        ...         summary["ensemble"] = {"program": program, "members": 2}
        ...     return Run("r", "r", {}, {}, [], summary, "finished")
        >>> wall_seconds([run(10.0), run(30.0, "p"), run(31.0, "p"), run(5.0, "q")])
        46.0
    """
    single, programs = 0.0, {}
    for run in runs:
        summary = run.summary or {}
        seconds = summary.get("wall_seconds", 0.0)
        program = (summary.get("ensemble") or {}).get("program")
        if program is None:
            single += seconds
        else:
            programs[program] = max(programs.get(program, 0.0), seconds)
    return single + sum(programs.values())


def curve(run: Run, key: str = "eval/loss") -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the metric ``key`` of ``metrics.jsonl`` over training.

    Examples:
        >>> run = Run("r", "r", {}, {}, [{"step": 10, "eval/loss": 2.5},
        ...       {"step": 10, "train/loss": 2.4}, {"step": 20, "eval/loss": 2.0}],
        ...       None, "unfinished")
        >>> curve(run), curve(run, "train/loss")
        (([10, 20], [2.5, 2.0]), ([10], [2.4]))
    """
    points = [(m["step"], m[key]) for m in run.metrics if key in m]
    return [s for s, _ in points], [v for _, v in points]
