r"""Runs a sweep: one ``experiments/train.py`` process per run, then the report.

    python experiments/sweep.py --sweep=configs/sweeps/tying_study.py:small,stage=tune \
        --workdir=runs/compare

Each run gets the workdir ``<--workdir>/<name>``, named from its overrides
(e.g. ``tokenizer=bpe,vocab_size=2048,tied=False,...,seed=1``), with the train
process's output in ``run.log`` there. Runs with a ``summary.json`` are
skipped; others start again in the same workdir, where ``train.py`` resumes
from the newest checkpoint, so rerunning the same command continues an
interrupted sweep. A failed run does not stop the others; the command exits
with status 1 at the end and lists the failed runs with the end of their logs.
A sweep that plans from its own results (the tying study's tuning stage adds
rates past the grid's ends) is planned again whenever a run ends, and the new
runs join the queue, until the plan stops growing.

On a cluster, ``--dry_run`` prints the remaining runs' commands, one a line,
for a Slurm array or GNU parallel; afterwards ``experiments/report.py`` reads
the same directory (a sweep in stages, like the tying study, runs each
stage's commands in turn: a later stage plans from the earlier one's
results)::

    python experiments/sweep.py --sweep=... --workdir=DIR --dry_run > runs.txt
    parallel -j 8 < runs.txt      # or a Slurm array, one line per task:
    sbatch --array=1-$(wc -l < runs.txt) --wrap='sed -n "${SLURM_ARRAY_TASK_ID}p" runs.txt | bash'
    python experiments/report.py --workdir=DIR

Each train process uses every core it sees; on a CPU-only machine
``--parallel`` above 1 helps only when one run cannot keep the cores busy,
and then with ``--cpus_per_run``, which gives each running run CPUs of its
own (Linux), so that concurrent runs do not contend for cores. The nanogpt
config's small matmuls keep one core busier than two: on a 2-core CPU,
``--parallel=2 --cpus_per_run=1`` trains two runs at 58 ms/step each, 1.25x
the steps per second of one run at a time on both cores (36 ms/step);
without pinning, two runs manage 65-67 ms/step each.

Each run's ``status.json`` records its process's exit code, start and end
times and CPUs; the report counts overlapping runs' time once.
"""

import collections
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from absl import app, flags

from lmhead.lab import sweeps

EXPERIMENTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(EXPERIMENTS)
CONFIG_FILE = os.path.join(ROOT, "configs", "default.py")
LOG_TAIL_LINES = 20

_SWEEP = flags.DEFINE_string(
    "sweep",
    None,
    "Sweep file and argument: path.py[:arg], e.g. "
    "configs/sweeps/tying_study.py:small,stage=tune.",
    required=True,
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Sweep directory; each run gets a subdirectory.", required=True
)
_PARALLEL = flags.DEFINE_integer(
    "parallel", 1, "Runs at a time, as separate processes.", lower_bound=1
)
_CPUS_PER_RUN = flags.DEFINE_integer(
    "cpus_per_run",
    0,
    "With --parallel, pin each running run to this many CPUs "
    "of its own (Linux); 0: every run sees every CPU.",
    lower_bound=0,
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Print the commands of the runs still to do, one a line, and run nothing.",
)
_REPORT = flags.DEFINE_bool(
    "report", True, "Write REPORT.md and the plots when the runs are done."
)
_TRAIN_SCRIPT = flags.DEFINE_string(
    "train_script",
    os.path.join(EXPERIMENTS, "train.py"),
    "Program each run executes with --config, --workdir and --config.* flags.",
)


def display_path(path: str) -> str:
    """``path`` relative to the current directory when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def plan(sweep_spec: str, sweep_dir: str, train_script: str) -> list[dict]:
    """The sweep's runs: ``name``, ``workdir``, ``overrides`` and ``command``."""
    base, overrides, shared = sweeps.load_sweep(sweep_spec, sweep_dir)
    runs = []
    for name, run_overrides in zip(sweeps.run_names(overrides), overrides):
        workdir = os.path.join(sweep_dir, name)
        command = sweeps.train_command(
            base,
            workdir,
            run_overrides,
            python=sys.executable,
            script=display_path(train_script),
            config_file=display_path(CONFIG_FILE),
            shared=shared,
        )
        runs.append(
            dict(name=name, workdir=workdir, overrides=run_overrides, command=command)
        )
    return runs


def describe_machine() -> str:
    """Operating system, architecture, CPU model and count: where the runs ran."""
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in f
                    if line.startswith("model name")
                ),
                cpu,
            )
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs" + (
        f" ({cpu})" if cpu else ""
    )


def is_finished(run: dict) -> bool:
    return os.path.exists(os.path.join(run["workdir"], "summary.json"))


def cpu_slots(parallel: int, cpus_per_run: int) -> list[frozenset[int] | None]:
    """``parallel`` disjoint sets of ``cpus_per_run`` CPUs that this process
    may use, one per concurrent run; ``None`` each without pinning."""
    if cpus_per_run == 0:
        return [None] * parallel
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--cpus_per_run needs os.sched_setaffinity (Linux).")
    cpus = sorted(os.sched_getaffinity(0))
    if parallel * cpus_per_run > len(cpus):
        raise ValueError(
            f"--parallel={parallel} runs of --cpus_per_run={cpus_per_run} "
            f"need {parallel * cpus_per_run} CPUs; this process may use "
            f"{len(cpus)}."
        )
    return [
        frozenset(cpus[i * cpus_per_run : (i + 1) * cpus_per_run])
        for i in range(parallel)
    ]


def start(run: dict, cpus: frozenset[int] | None = None) -> subprocess.Popen:
    """Launches a run with its output appended to its ``run.log``, on
    ``cpus`` only when given."""
    os.makedirs(run["workdir"], exist_ok=True)
    status_path = os.path.join(run["workdir"], sweeps.STATUS_FILE)
    if os.path.exists(status_path):
        os.remove(status_path)
    with open(os.path.join(run["workdir"], sweeps.LOG_FILE), "a") as log:
        log.write(
            f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(run['command'])}\n"
        )
        log.flush()
        return subprocess.Popen(
            run["command"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )


def record_exit(
    run: dict,
    returncode: int,
    started: float,
    ended: float,
    cpus: frozenset[int] | None,
) -> bool:
    """Writes the run's ``status.json`` (exit code, start and end times in
    seconds since the epoch, CPUs); whether the run finished."""
    with open(os.path.join(run["workdir"], sweeps.STATUS_FILE), "w") as f:
        json.dump(
            dict(
                returncode=returncode,
                seconds=ended - started,
                started=started,
                ended=ended,
                cpus=None if cpus is None else sorted(cpus),
                command=run["command"],
            ),
            f,
            indent=2,
        )
    return returncode == 0 and is_finished(run)


class Terminated(Exception):
    """The runner got SIGTERM (``kill``, a scheduler's preemption)."""


def run_all(
    runs: list[dict],
    slots: list[frozenset[int] | None],
    replan: Callable[[], list[dict]] | None = None,
    stop: threading.Event | None = None,
) -> tuple[list[dict], int]:
    """Runs ``runs``, one per slot at a time (a slot: the CPUs a run is
    pinned to, or ``None``); returns the ones that failed and how many ran.

    ``replan``: called whenever a run ends; the unfinished runs it returns
    that have not been queued yet join the queue (a sweep that plans from its
    own results). ``stop`` (set by SIGTERM): the running runs get SIGTERM too
    (train.py saves a checkpoint and exits) and are waited for, so that none
    outlives the runner and races a rerun for its workdir; then
    :class:`Terminated`.
    """
    pending, running, failed = collections.deque(runs), {}, []
    queued = {run["name"] for run in runs}
    free, parallel = collections.deque(slots), len(slots)
    done, seconds_done = 0, 0.0
    try:
        while pending or running:
            if stop is not None and stop.is_set():
                raise Terminated()
            while pending and free:
                run, cpus = pending.popleft(), free.popleft()
                resumes = os.path.isdir(os.path.join(run["workdir"], "checkpoints"))
                print(
                    f"[{done + len(running) + 1}/{done + len(running) + len(pending) + 1}]"
                    f" {'resume' if resumes else 'start'} {run['name']}"
                    + (f" on CPUs {sorted(cpus)}" if cpus else ""),
                    flush=True,
                )
                running[start(run, cpus)] = (run, time.time(), cpus)
            for process, (run, started, cpus) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[process]
                free.append(cpus)
                ended = time.time()
                seconds = ended - started
                done, seconds_done = done + 1, seconds_done + seconds
                if record_exit(run, process.returncode, started, ended, cpus):
                    outcome = f"finished in {seconds:.0f} s"
                else:
                    failed.append(run)
                    outcome = (
                        f"FAILED (exit {process.returncode}) after "
                        f"{seconds:.0f} s; log: {run['workdir']}/{sweeps.LOG_FILE}"
                    )
                for new in replan() if replan else []:
                    if new["name"] not in queued:
                        queued.add(new["name"])
                        pending.append(new)
                total = done + len(running) + len(pending)
                left = seconds_done / done * (total - done) / parallel / 60
                print(
                    f"[{done}/{total}] {run['name']} {outcome}; "
                    f"about {left:.0f} min left",
                    flush=True,
                )
            time.sleep(0.2)
    except (KeyboardInterrupt, Terminated):
        for process in running:
            process.terminate()
        for process in running:
            process.wait()
        raise
    return failed, done


def log_tail(run: dict, lines: int = LOG_TAIL_LINES) -> str:
    path = os.path.join(run["workdir"], sweeps.LOG_FILE)
    with open(path, errors="replace") as f:
        return "".join(collections.deque(f, maxlen=lines))


def plan_or_exit() -> list[dict]:
    """:func:`plan` of the flags' sweep; a bad sweep exits with its message."""
    try:
        return plan(_SWEEP.value, _WORKDIR.value, _TRAIN_SCRIPT.value)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"--sweep={_SWEEP.value}: {e}")


def write_sweep_record(runs: list[dict]) -> None:
    """``sweep.json``: the sweep, the command, the machine and the planned runs."""
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, sweeps.SWEEP_FILE), "w") as f:
        json.dump(
            dict(
                sweep=_SWEEP.value,
                command=shlex.join(["python", *sys.argv]),
                machine=describe_machine(),
                runs=runs,
            ),
            f,
            indent=2,
        )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    runs = plan_or_exit()
    todo = [run for run in runs if not is_finished(run)]
    if _DRY_RUN.value:
        print(
            f"# {len(runs) - len(todo)} of {len(runs)} runs already finished",
            file=sys.stderr,
        )
        for run in todo:
            print(shlex.join(run["command"]))
        return
    try:
        slots = cpu_slots(_PARALLEL.value, _CPUS_PER_RUN.value)
    except ValueError as e:
        sys.exit(str(e))
    # SIGTERM only sets a flag, which run_all reads between steps: an
    # exception raised wherever the signal lands could lose a run just started.
    # (preemption.sigterm_flag would start a JAX backend in the runner.)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())

    def replan() -> list[dict]:
        # A sweep may plan from its own results (the tying study's tuning stage
        # extends a cell's rates past the grid when its best is at an end).
        try:
            return [
                run
                for run in plan(_SWEEP.value, _WORKDIR.value, _TRAIN_SCRIPT.value)
                if not is_finished(run)
            ]
        except (ValueError, FileNotFoundError) as e:
            print(f"Planning again failed, so no runs were added: {e}", flush=True)
            return []

    write_sweep_record(runs)
    print(
        f"{len(runs)} runs in {_WORKDIR.value}: {len(runs) - len(todo)} finished "
        f"before, {len(todo)} to run, {_PARALLEL.value} at a time.",
        flush=True,
    )
    started = time.time()
    try:
        failed, ran = run_all(todo, slots, replan, stop)
    except Terminated:
        sys.exit(
            "Stopped by SIGTERM, the running runs with it; the same command "
            "resumes the sweep."
        )
    write_sweep_record(plan_or_exit())
    print(f"The runs took {(time.time() - started) / 60:.1f} min.", flush=True)
    report_failed = False
    if _REPORT.value:
        report = [
            sys.executable,
            os.path.join(EXPERIMENTS, "report.py"),
            f"--workdir={_WORKDIR.value}",
        ]
        report_failed = subprocess.run(report, check=False).returncode != 0
    for run in failed:
        print(
            f"\nFAILED: {run['name']}\n  {shlex.join(run['command'])}\n"
            f"  last lines of {run['workdir']}/{sweeps.LOG_FILE}:\n{log_tail(run)}"
        )
    if failed or report_failed:
        print(
            f"{len(failed)} of {ran} runs failed"
            + ("; the report failed" if report_failed else "")
            + "."
        )
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
