"""Runs finished per hour: a slice of the tying study trained as separate
``experiments/train.py`` processes and as ensemble programs, fixed costs
included, interleaved; ``bench_ensemble.py --runs_per_hour`` (beside this
file) runs it, and ``docs/benchmarks.md`` says how.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

import numpy as np
import timing  # experiments/bench/timing.py, beside this file

from lmhead.lab import sweeps
from lmhead.lm import configuration, train
from lmhead.lm import members as members_lib
from studies.tying import study as study_lib

SWEEP_FILE = os.path.join(
    configuration.REPOSITORY, "configs", "sweeps", "tying_study.py"
)
TRAIN_SCRIPT = os.path.join(configuration.REPOSITORY, "experiments", "train.py")
SEPARATE_PROCESSES = "separate processes"
# Issue 22's target: runs finished per hour against separate processes.
TARGET_RATIO = 1.5


def slice_runs(
    study_arg: str, slice_steps: int | None
) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """``(base, shared, overrides)`` of the tying study's runs of the one cell
    that ``study_arg`` leaves (every rate of its grid x every test seed), as
    ``experiments/sweep.py`` gives them; ``train.steps = slice_steps`` when set.

    Raises:
        ValueError: ``study_arg`` leaves more than one cell.
    """
    design = configuration.load_module(SWEEP_FILE).get_study(study_arg)
    cells = design.cells()
    if len(cells) != 1:
        raise ValueError(
            f"--slice={study_arg!r} leaves {len(cells)} cells of the study; "
            "name one vocabulary, amount and arm (bpe=, char=, amounts=, arms=)."
        )
    overrides = [
        design.overrides(study_lib.PlannedRun(cells[0], lr, seed))
        for lr in design.rates(cells[0])
        for seed in design.test_seeds
    ]
    if slice_steps is not None:
        for run in overrides:
            run["train.steps"] = slice_steps
    return design.base, design.shared, overrides


class Process(NamedTuple):
    """One ``experiments/train.py`` process of a way of training the slice."""

    label: str
    command: list[str]
    workdir: str
    runs: dict[str, str]  # run name -> the run's workdir


def train_command(base, workdir, overrides, shared) -> list[str]:
    return sweeps.train_command(
        base,
        workdir,
        overrides,
        python=sys.executable,
        script=TRAIN_SCRIPT,
        config_file=configuration.CONFIG_FILE,
        shared=shared,
    )


def separate_processes(base, shared, runs: dict, root: str) -> list[Process]:
    """A process per run (``runs``: name -> overrides), in ``root/separate``."""
    processes = []
    for index, (name, overrides) in enumerate(runs.items(), 1):
        workdir = os.path.join(root, "separate", name)
        command = train_command(base, workdir, overrides, shared)
        label = f"run {index} of {len(runs)}"
        processes.append(Process(label, command, workdir, {name: workdir}))
    return processes


def ensemble_processes(base, shared, runs: dict, root: str, size: int) -> list[Process]:
    """Programs of ``size`` members, in order (the member keys split off by
    ``members.split_overrides``), in ``root/ensembles_of_<size>``.

    Raises:
        ValueError: two runs differ in a key that is not a member key.
    """
    folder = os.path.join(root, f"ensembles_of_{size}")
    parts = {}
    for name, overrides in runs.items():
        config = configuration.load_config(base)
        config.update_from_flattened_dict({**shared, **overrides})
        parts[name] = members_lib.split_overrides(overrides, config)
    programs = {json.dumps(p, sort_keys=True) for p, _ in parts.values()}
    if len(programs) > 1:
        raise ValueError(
            f"The slice's runs differ in program keys: {sorted(programs)}."
        )
    names = list(runs)
    processes = []
    for start in range(0, len(names), size):
        chunk = names[start : start + size]
        workdir = os.path.join(folder, f"program={start // size}")
        member_dirs = {name: os.path.join(folder, name) for name in chunk}
        command = train_command(base, workdir, parts[chunk[0]][0], shared) + [
            f"--member={members_lib.Member(member_dirs[n], parts[n][1]).to_json()}"
            for n in chunk
        ]
        label = f"program {start // size + 1} of {-(-len(names) // size)}"
        processes.append(Process(label, command, workdir, member_dirs))
    return processes


def run_process(process: Process) -> float:
    """Runs ``process`` (its output in its workdir's ``run.log``): its wall seconds.

    Raises:
        RuntimeError: it failed; with the end of its log.
    """
    os.makedirs(process.workdir, exist_ok=True)
    log_path = os.path.join(process.workdir, "run.log")
    with open(log_path, "w") as log:
        start = time.perf_counter()
        result = subprocess.run(
            process.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=configuration.REPOSITORY,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        seconds = time.perf_counter() - start
    if result.returncode:
        with open(log_path) as log:
            tail = "".join(log.readlines()[-20:])
        raise RuntimeError(
            f"{process.label} exited with {result.returncode}; {log_path} ends:\n{tail}"
        )
    return seconds


def run_interleaved(ways: dict[str, list[Process]]) -> dict[str, float]:
    """Runs every way's processes one after another, each way's spread evenly
    over the time; returns each way's summed wall seconds."""
    order = sorted(
        ((index + 0.5) / len(processes), position, way, process)
        for position, (way, processes) in enumerate(ways.items())
        for index, process in enumerate(processes)
    )
    totals = dict.fromkeys(ways, 0.0)
    for done, (_, _, way, process) in enumerate(order, 1):
        seconds = run_process(process)
        totals[way] += seconds
        print(
            f"  [{done}/{len(order)}] {way}, {process.label}: {seconds:.1f} s",
            flush=True,
        )
    return totals


def read_test_bits(processes: list[Process]) -> dict[str, float]:
    """Each run's test bits/char (its ``summary.json``), by run name."""
    bits = {}
    for process in processes:
        for name, workdir in process.runs.items():
            with open(os.path.join(workdir, train.SUMMARY_FILE)) as f:
                bits[name] = json.load(f)["test"]["bits_per_char"]
    return bits


def print_runs_table(ways: dict, totals: dict, bits: dict, count: int) -> None:
    """Wall time, runs/hour and ratio of each way; each ensemble way's
    largest test bits/char difference from the separate runs."""
    separate = totals[SEPARATE_PROCESSES]
    header = ["way", "processes", "wall s", "runs/hour", "x separate processes"]
    rows = [
        (way, len(processes), f"{totals[way]:.1f}",
         f"{3600 * count / totals[way]:.1f}", f"{separate / totals[way]:.2f}")
        for way, processes in ways.items()
    ]  # fmt: skip
    print("\n" + timing.table(header, rows))
    for way in list(ways)[1:]:  # the ensembles, after the separate processes
        gaps = [abs(bits[way][n] - bits[SEPARATE_PROCESSES][n]) for n in bits[way]]
        met = separate / totals[way] >= TARGET_RATIO
        print(
            f"  {way}: test bits/char within {np.nanmax(gaps):.2g} of the separate "
            f"runs'; target >= {TARGET_RATIO}x: {'met' if met else 'not met'}"
        )


def runs_per_hour(study_arg: str, slice_steps: int | None, sizes) -> None:
    """The slice of ``study_arg`` (:func:`slice_runs`) as separate processes
    and as ensembles of each of ``sizes`` members, interleaved; prints the
    progress and the table."""
    base, shared, overrides = slice_runs(study_arg, slice_steps)
    runs = dict(zip(sweeps.run_names(overrides), overrides))
    print(
        f"{len(runs)} runs of the tying study (--slice={study_arg}), "
        f"{overrides[0]['train.steps']} steps each, as processes one after another:",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench_ensemble_") as root:
        ways = {SEPARATE_PROCESSES: separate_processes(base, shared, runs, root)}
        for size in sizes:
            ways[f"ensembles of {size}"] = ensemble_processes(
                base, shared, runs, root, size
            )
        totals = run_interleaved(ways)
        bits = {way: read_test_bits(processes) for way, processes in ways.items()}
    print_runs_table(ways, totals, bits, len(runs))
