"""The sweep runner behind ``experiments/sweep.py``: a sweep file's runs
(:class:`Sweep`), one train process per run or per ensemble program
(:mod:`lmhead.lab.ensembles`), a few at a time (:func:`run_all`), each
pinned to CPUs of its own if asked (:func:`cpu_slots`); skipping finished
runs, resuming interrupted ones, planning again as runs end, and stopping
them all on SIGTERM (``docs/sweeps.md``).
"""

import collections
import dataclasses
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from lmhead.lab import ensembles, progress, sweeps, workdirs
from lmhead.lm import configuration

LOG_TAIL_LINES = 20
# How often the runner looks for runs that have ended, in seconds.
POLL_SECONDS = 0.2

Slot = frozenset[int] | None  # the CPUs a run is pinned to; None: every CPU


def display_path(path: str) -> str:
    """``path`` relative to the current directory when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A sweep file (``path.py[:arg]``) planned in a sweep directory, each run
    executing ``train_script`` with ``--config=config_file:BASE``;
    ``ensemble > 1``: runs that differ only in member keys train as programs
    of at most that many members (:mod:`lmhead.lab.ensembles`)."""

    spec: str
    sweep_dir: str
    train_script: str
    config_file: str = configuration.CONFIG_FILE
    ensemble: int = 0

    def plan(self) -> list[dict]:
        """The sweep's runs: ``name``, ``workdir``, ``overrides`` and ``command``.

        Raises:
            ValueError, FileNotFoundError: a sweep file that does not load or
                plan (:func:`lmhead.lab.sweeps.load_sweep`).
        """
        return self._plan()[2]

    def _plan(self) -> tuple[str, dict, list[dict]]:
        base, overrides, shared = sweeps.load_sweep(self.spec, self.sweep_dir)
        runs = []
        for name, run_overrides in zip(sweeps.run_names(overrides), overrides):
            workdir = os.path.join(self.sweep_dir, name)
            command = self._command(base, workdir, run_overrides, shared)
            runs.append(
                dict(
                    name=name, workdir=workdir, overrides=run_overrides, command=command
                )
            )
        return base, shared, runs

    def plan_jobs(self) -> tuple[list[dict], list[dict]]:
        """The sweep's runs (:meth:`plan`) and the jobs that run the
        unfinished ones: the runs, or with ``ensemble > 1`` the programs
        that hold them and the runs that stay single
        (:func:`lmhead.lab.ensembles.group`).

        Raises:
            ValueError, FileNotFoundError: as :meth:`plan`, or a run whose
                overrides do not fit its config or its program.
        """
        base, shared, runs = self._plan()
        todo = [run for run in runs if not is_finished(run)]
        if self.ensemble <= 1:
            return runs, todo
        parts = ensembles.split_runs(todo, base, shared, self.config_file)
        jobs = ensembles.group(
            todo,
            parts,
            self.sweep_dir,
            self.ensemble,
            lambda workdir, part: self._command(base, workdir, part, shared),
        )
        return runs, jobs

    def _command(
        self, base: str, workdir: str, overrides: dict, shared: dict
    ) -> list[str]:
        return sweeps.train_command(
            base,
            workdir,
            overrides,
            python=sys.executable,
            script=display_path(self.train_script),
            config_file=display_path(self.config_file),
            shared=shared,
        )

    def unfinished_jobs(self) -> list[dict]:
        """:meth:`plan_jobs`'s jobs; none (and a message) when planning fails,
        so that a running sweep goes on with the jobs it has."""
        try:
            return self.plan_jobs()[1]
        except (ValueError, FileNotFoundError) as e:
            print(f"Planning again failed, so no runs were added: {e}", flush=True)
            return []


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
    """Whether the run's workdir has a ``summary.json``; for a program
    (``members``), whether every member's has."""
    if "members" in run:
        return all(map(is_finished, run["members"]))
    return os.path.exists(os.path.join(run["workdir"], "summary.json"))


def unfinished_members(job: dict) -> list[dict]:
    """The members of a program that have no ``summary.json``; ``[]`` for a run."""
    return [member for member in job.get("members", []) if not is_finished(member)]


def describe(job: dict) -> str:
    """A job's name, with its member count for a program.

    Examples:
        >>> describe({"name": "tied=True,ensemble=0", "members": [{}, {}]})
        'tied=True,ensemble=0 (2 members)'
    """
    if "members" not in job:
        return job["name"]
    return f"{job['name']} ({len(job['members'])} members)"


def cpu_slots(parallel: int, cpus_per_run: int) -> list[Slot]:
    """``parallel`` disjoint sets of ``cpus_per_run`` CPUs that this process
    may use, one per concurrent run; ``None`` each without pinning.

    Raises:
        ValueError: pinning without ``os.sched_setaffinity``, or more CPUs
            asked for than this process may use.

    Examples:
        >>> cpu_slots(2, 0)
        [None, None]
    """
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


def start(run: dict, cpus: Slot = None) -> subprocess.Popen:
    """Launches a run or a program with its output appended to its
    ``run.log``, on ``cpus`` only when given. The ``status.json`` of the run,
    or of the program and its unfinished members, goes: they are running."""
    os.makedirs(run["workdir"], exist_ok=True)
    for workdir in [run["workdir"], *(m["workdir"] for m in unfinished_members(run))]:
        status_path = os.path.join(workdir, workdirs.STATUS_FILE)
        if os.path.exists(status_path):
            os.remove(status_path)
    with open(os.path.join(run["workdir"], workdirs.LOG_FILE), "a") as log:
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
    cpus: Slot,
    trained: Sequence[dict] = (),
) -> bool:
    """Writes the ``status.json`` of the run, or of the program and each
    member it ``trained`` (with the program's directory and member count);
    whether the run finished."""
    status = dict(
        returncode=returncode,
        seconds=ended - started,
        started=started,
        ended=ended,
        cpus=None if cpus is None else sorted(cpus),
        command=run["command"],
    )
    member_status = dict(status, ensemble=run["workdir"])
    member_status["members"] = len(run.get("members", []))
    records = [(run, status), *((member, member_status) for member in trained)]
    for job, record in records:
        os.makedirs(job["workdir"], exist_ok=True)  # a member that never began
        with open(os.path.join(job["workdir"], workdirs.STATUS_FILE), "w") as f:
            json.dump(record, f, indent=2)
    return returncode == 0 and is_finished(run)


class Terminated(Exception):
    """The runner got SIGTERM (``kill``, a scheduler's preemption)."""


@dataclasses.dataclass
class _Queue:
    """The jobs (runs or programs) to start, those running (process -> job,
    start time, slot, the members it trains), the free slots, and the counts
    the progress lines print."""

    pending: collections.deque
    free: collections.deque
    running: dict = dataclasses.field(default_factory=dict)
    queued: set = dataclasses.field(default_factory=set)
    failed: list = dataclasses.field(default_factory=list)
    done: int = 0
    seconds_done: float = 0.0

    def start_next(self) -> None:
        """Starts the next pending job on the next free slot."""
        run, cpus = self.pending.popleft(), self.free.popleft()
        trained = unfinished_members(run)
        resumes = os.path.isdir(os.path.join(run["workdir"], "checkpoints"))
        position = self.done + len(self.running) + 1
        print(
            f"[{position}/{position + len(self.pending)}]"
            f" {'resume' if resumes else 'start'} {describe(run)}"
            + (f" on CPUs {sorted(cpus)}" if cpus else ""),
            flush=True,
        )
        self.running[start(run, cpus)] = (run, time.time(), cpus, trained)

    def end(self, process: subprocess.Popen) -> str:
        """Records the ended ``process``'s job; its outcome, for the progress line."""
        run, started, cpus, trained = self.running.pop(process)
        self.free.append(cpus)
        ended = time.time()
        seconds = ended - started
        self.done, self.seconds_done = self.done + 1, self.seconds_done + seconds
        if record_exit(run, process.returncode, started, ended, cpus, trained):
            return f"finished in {seconds:.0f} s"
        self.failed.append(run)
        return (
            f"FAILED (exit {process.returncode}) after "
            f"{seconds:.0f} s; log: {run['workdir']}/{workdirs.LOG_FILE}"
        )

    def add(self, runs: Sequence[dict]) -> None:
        """Queues the jobs not queued before."""
        for run in runs:
            if run["name"] not in self.queued:
                self.queued.add(run["name"])
                self.pending.append(run)

    def minutes_left(self, parallel: int) -> float:
        """The jobs left at the mean duration so far, ``parallel`` at a time."""
        total = self.done + len(self.running) + len(self.pending)
        return self.seconds_done / self.done * (total - self.done) / parallel / 60


def run_all(
    runs: list[dict],
    slots: list[Slot],
    replan: Callable[[], list[dict]] | None = None,
    stop: threading.Event | None = None,
    progress_every_s: float = 0.0,
) -> tuple[list[dict], int]:
    """Runs the jobs ``runs`` (runs or programs, one process each), one per
    slot at a time (a slot: the CPUs a job is pinned to, or ``None``);
    returns the ones that failed and how many ran.

    Every ``progress_every_s`` seconds (0: never), each running job's
    progress line (:class:`lmhead.lab.progress.Progress`). ``replan``,
    called whenever a job ends, gives unfinished jobs to queue if they were
    not. Once ``stop`` is set (SIGTERM), the running jobs get SIGTERM, are
    waited for, and :class:`Terminated` is raised.
    """
    queue = _Queue(collections.deque(), collections.deque(slots))
    queue.add(runs)
    watch = progress.Progress(progress_every_s) if progress_every_s > 0 else None
    try:
        while queue.pending or queue.running:
            if stop is not None and stop.is_set():
                raise Terminated()
            while queue.pending and queue.free:
                queue.start_next()
            if watch is not None:
                running = [job for job, *_ in queue.running.values()]
                for line in watch.poll(running, time.monotonic()):
                    print(line, flush=True)
            for process in list(queue.running):
                if process.poll() is not None:
                    name = describe(queue.running[process][0])
                    outcome = queue.end(process)
                    queue.add(replan() if replan else [])
                    total = queue.done + len(queue.running) + len(queue.pending)
                    print(
                        f"[{queue.done}/{total}] {name} {outcome}; "
                        f"about {queue.minutes_left(len(slots)):.0f} min left",
                        flush=True,
                    )
            time.sleep(POLL_SECONDS)
    except (KeyboardInterrupt, Terminated):
        for process in queue.running:
            process.terminate()
        for process in queue.running:
            process.wait()
        raise
    return queue.failed, queue.done


def log_tail(run: dict, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the run's ``run.log``."""
    path = os.path.join(run["workdir"], workdirs.LOG_FILE)
    with open(path, errors="replace") as f:
        return "".join(collections.deque(f, maxlen=lines))


def write_sweep_record(sweep: Sweep, runs: list[dict], command: str) -> None:
    """``sweep.json``: the sweep, the ``command`` that ran it, the machine and
    the planned runs."""
    os.makedirs(sweep.sweep_dir, exist_ok=True)
    with open(os.path.join(sweep.sweep_dir, workdirs.SWEEP_FILE), "w") as f:
        json.dump(
            dict(
                sweep=sweep.spec,
                command=command,
                machine=describe_machine(),
                runs=runs,
            ),
            f,
            indent=2,
        )


def print_commands(runs: list[dict], jobs: list[dict] | None = None) -> None:
    """The commands of the unfinished ``jobs`` (default: ``runs``), one a
    line on stdout, and how many runs are done on stderr."""
    todo = [run for run in runs if not is_finished(run)]
    jobs = todo if jobs is None else [job for job in jobs if not is_finished(job)]
    print(
        f"# {len(runs) - len(todo)} of {len(runs)} runs already finished"
        + (
            ""
            if jobs == todo
            else f"; the others in {len(jobs)} process{'es' * (len(jobs) != 1)}"
        ),
        file=sys.stderr,
    )
    for job in jobs:
        print(shlex.join(job["command"]))


def run_sweep(
    sweep: Sweep,
    runs: list[dict],
    slots: list[Slot],
    *,
    command: str,
    report_command: list[str] | None = None,
    jobs: list[dict] | None = None,
    progress_every_s: float = progress.PROGRESS_EVERY_S,
) -> int:
    """Runs the unfinished ``runs`` of ``sweep`` (:func:`run_all` of
    ``jobs``, default the runs; :meth:`Sweep.plan_jobs` groups them into
    programs), planning again as jobs end, writes ``sweep.json`` (with the
    runner's ``command``), then runs ``report_command`` and lists the
    failed jobs with the end of their logs.

    Returns:
        0 when every job finished and the report succeeded, else 1.

    Raises:
        Terminated: on SIGTERM, once the running jobs have stopped.
        ValueError, FileNotFoundError: the sweep no longer plans at the end.
    """
    todo = [run for run in runs if not is_finished(run)]
    jobs = todo if jobs is None else jobs
    # A flag, read between polls (docs/sweeps.md); preemption.sigterm_flag
    # would start a JAX backend in the runner.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    write_sweep_record(sweep, runs, command)
    programs = sum("members" in job for job in jobs)
    print(
        f"{len(runs)} runs in {sweep.sweep_dir}: {len(runs) - len(todo)} finished "
        f"before, {len(todo)} to run"
        + (
            f" in {len(jobs)} process{'es' * (len(jobs) != 1)} ({programs} "
            f"program{'s' * (programs != 1)} of at most {sweep.ensemble} members)"
            if programs
            else ""
        )
        + f", {len(slots)} at a time.",
        flush=True,
    )
    started = time.time()
    failed, ran = run_all(
        jobs, slots, sweep.unfinished_jobs, stop, progress_every_s=progress_every_s
    )
    write_sweep_record(sweep, sweep.plan(), command)
    print(f"The runs took {(time.time() - started) / 60:.1f} min.", flush=True)
    report_failed = (
        report_command is not None
        and subprocess.run(report_command, check=False).returncode != 0
    )
    print_failures(
        failed, ran, report_failed, "processes" if sweep.ensemble > 1 else "runs"
    )
    return 1 if failed or report_failed else 0


def print_failures(
    failed: list[dict], ran: int, report_failed: bool, noun: str = "runs"
) -> None:
    """The ``failed`` jobs, each with its command, its unfinished members (a
    program) and the end of its log; then how many of the ``ran`` ``noun``
    (runs, or processes: runs and programs) failed."""
    for job in failed:
        unfinished = [member["name"] for member in unfinished_members(job)]
        print(
            f"\nFAILED: {describe(job)}\n  {shlex.join(job['command'])}\n"
            + (
                f"  members not finished: {', '.join(unfinished)}\n"
                if unfinished
                else ""
            )
            + f"  last lines of {job['workdir']}/{workdirs.LOG_FILE}:\n{log_tail(job)}"
        )
    if failed or report_failed:
        print(
            f"{len(failed)} of {ran} {noun} failed"
            + ("; the report failed" if report_failed else "")
            + "."
        )
