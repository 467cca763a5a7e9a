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
rates past the grid's ends) is planned again once its runs are done, and the
new runs run, until the plan stops growing.

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
``--parallel`` above 1 helps only when one run cannot keep the cores busy.
"""

import collections
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time

from absl import app
from absl import flags

from lmhead import sweeps

EXPERIMENTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(EXPERIMENTS)
CONFIG_FILE = os.path.join(ROOT, "configs", "default.py")
LOG_TAIL_LINES = 20

_SWEEP = flags.DEFINE_string(
    "sweep", None, "Sweep file and argument: path.py[:arg], e.g. "
    "configs/sweeps/tying_study.py:small,stage=tune.", required=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Sweep directory; each run gets a subdirectory.", required=True)
_PARALLEL = flags.DEFINE_integer(
    "parallel", 1, "Runs at a time, as separate processes.", lower_bound=1)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Print the commands of the runs still to do, one a line, "
    "and run nothing.")
_REPORT = flags.DEFINE_bool(
    "report", True, "Write REPORT.md and the plots when the runs are done.")
_TRAIN_SCRIPT = flags.DEFINE_string(
    "train_script", os.path.join(EXPERIMENTS, "train.py"),
    "Program each run executes with --config, --workdir and --config.* flags.")


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
            base, workdir, run_overrides, python=sys.executable,
            script=display_path(train_script), config_file=display_path(CONFIG_FILE),
            shared=shared)
        runs.append(dict(name=name, workdir=workdir, overrides=run_overrides,
                         command=command))
    return runs


def describe_machine() -> str:
    """Operating system, architecture, CPU model and count: where the runs ran."""
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"
            + (f" ({cpu})" if cpu else ""))


def is_finished(run: dict) -> bool:
    return os.path.exists(os.path.join(run["workdir"], "summary.json"))


def start(run: dict) -> subprocess.Popen:
    """Launches a run with its output appended to its ``run.log``."""
    os.makedirs(run["workdir"], exist_ok=True)
    status_path = os.path.join(run["workdir"], sweeps.STATUS_FILE)
    if os.path.exists(status_path):
        os.remove(status_path)
    with open(os.path.join(run["workdir"], sweeps.LOG_FILE), "a") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} "
                  f"{shlex.join(run['command'])}\n")
        log.flush()
        return subprocess.Popen(
            run["command"], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def record_exit(run: dict, returncode: int, seconds: float) -> bool:
    """Writes the run's ``status.json``; whether the run finished."""
    with open(os.path.join(run["workdir"], sweeps.STATUS_FILE), "w") as f:
        json.dump(dict(returncode=returncode, seconds=seconds,
                       command=run["command"]), f, indent=2)
    return returncode == 0 and is_finished(run)


class Terminated(Exception):
    """The runner got SIGTERM (``kill``, a scheduler's preemption)."""


def raise_terminated(signum, frame):
    del frame
    raise Terminated(signum)


def run_all(runs: list[dict], parallel: int) -> list[dict]:
    """Runs ``runs``, ``parallel`` at a time; returns the ones that failed."""
    pending, running, failed = collections.deque(runs), {}, []
    done, seconds_done, total = 0, 0.0, len(runs)
    try:
        while pending or running:
            while pending and len(running) < parallel:
                run = pending.popleft()
                resumes = os.path.isdir(os.path.join(run["workdir"], "checkpoints"))
                print(f"[{done + len(running) + 1}/{total}] "
                      f"{'resume' if resumes else 'start'} {run['name']}", flush=True)
                running[start(run)] = (run, time.time())
            for process, (run, started) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[process]
                seconds = time.time() - started
                done, seconds_done = done + 1, seconds_done + seconds
                if record_exit(run, process.returncode, seconds):
                    outcome = f"finished in {seconds:.0f} s"
                else:
                    failed.append(run)
                    outcome = (f"FAILED (exit {process.returncode}) after "
                               f"{seconds:.0f} s; log: {run['workdir']}/{sweeps.LOG_FILE}")
                left = seconds_done / done * (total - done) / parallel / 60
                print(f"[{done}/{total}] {run['name']} {outcome}; "
                      f"about {left:.0f} min left", flush=True)
            time.sleep(0.2)
    except (KeyboardInterrupt, Terminated):
        # The runs get SIGTERM too (train.py saves a checkpoint and exits), so
        # that none outlives the runner and races a rerun for its workdir.
        for process in running:
            process.terminate()
        for process in running:
            process.wait()
        raise
    return failed


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
        json.dump(dict(sweep=_SWEEP.value, command=shlex.join(["python", *sys.argv]),
                       machine=describe_machine(), runs=runs), f, indent=2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    runs = plan_or_exit()
    todo = [run for run in runs if not is_finished(run)]
    if _DRY_RUN.value:
        print(f"# {len(runs) - len(todo)} of {len(runs)} runs already finished",
              file=sys.stderr)
        for run in todo:
            print(shlex.join(run["command"]))
        return
    signal.signal(signal.SIGTERM, raise_terminated)
    started, failed, tried = time.time(), [], set()
    # A sweep may plan from its own results (the tying study's tuning stage
    # extends a cell's rates past the grid when its best is at an end), so it
    # is planned again when its runs are done, until nothing new is planned.
    while True:
        write_sweep_record(runs)
        print(f"{len(runs)} runs in {_WORKDIR.value}: {len(runs) - len(todo)} "
              f"finished before, {len(todo)} to run, {_PARALLEL.value} at a time.",
              flush=True)
        try:
            failed += run_all(todo, _PARALLEL.value)
        except Terminated:
            sys.exit("Stopped by SIGTERM, the running runs with it; the same command "
                     "resumes the sweep.")
        tried.update(run["name"] for run in todo)
        runs = plan_or_exit()
        todo = [run for run in runs if not is_finished(run) and run["name"] not in tried]
        if not todo:
            break
    write_sweep_record(runs)
    print(f"The runs took {(time.time() - started) / 60:.1f} min.", flush=True)
    report_failed = False
    if _REPORT.value:
        report = [sys.executable, os.path.join(EXPERIMENTS, "report.py"),
                  f"--workdir={_WORKDIR.value}"]
        report_failed = subprocess.run(report, check=False).returncode != 0
    for run in failed:
        print(f"\nFAILED: {run['name']}\n  {shlex.join(run['command'])}\n"
              f"  last lines of {run['workdir']}/{sweeps.LOG_FILE}:\n{log_tail(run)}")
    if failed or report_failed:
        print(f"{len(failed)} of {len(tried)} runs failed"
              + ("; the report failed" if report_failed else "") + ".")
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
