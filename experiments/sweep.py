r"""The sweep command: runs a sweep file (``configs/sweeps/*.py``), one
``experiments/train.py`` process per run (or per ensemble program with
``--ensemble=M``), then the report (``lmhead/lab/runner.py``).

    python experiments/sweep.py --sweep=configs/sweeps/tying_study.py:small,stage=tune \
        --workdir=runs/compare

Finished runs are skipped and interrupted ones resume, so the same command
continues a sweep; a failed run does not stop the others (exit status 1 at
the end, with the end of its log). ``--dry_run`` prints the remaining
commands, one a line, for a cluster::

    python experiments/sweep.py --sweep=... --workdir=DIR --dry_run > runs.txt
    sbatch --array=1-$(wc -l < runs.txt) --wrap='sed -n "${SLURM_ARRAY_TASK_ID}p" runs.txt | bash'
    python experiments/report.py --workdir=DIR

docs/sweeps.md describes the runner, ensemble programs, the progress lines,
``--cpus_per_run`` and ``--restore_from``.
"""

import os
import shlex
import sys

import cli  # experiments/cli.py, beside this file
from absl import app, flags

from lmhead.lab import progress, runner, sweeps

EXPERIMENTS = os.path.dirname(os.path.abspath(__file__))

_SWEEP = flags.DEFINE_string(
    "sweep",
    None,
    "Sweep file and argument: path.py[:arg], e.g. "
    "configs/sweeps/tying_study.py:small,stage=tune.",
    required=True,
)
_WORKDIR = cli.workdir_flag()
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
_ENSEMBLE = flags.DEFINE_integer(
    "ensemble",
    0,
    "Train runs that differ only in member keys (lmhead/lm/members.py) as "
    "one program of at most this many members; 0 or 1: one process per run.",
    lower_bound=0,
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Print the commands of the runs (or programs) still to do, one a line, and "
    "run nothing.",
)
_RESTORE_FROM = flags.DEFINE_multi_string(
    "restore_from",
    [],
    "A table of runs that the sweep file's report wrote (the tying study's "
    "docs/tying_study/runs.csv): its finished runs that --workdir lacks are "
    "recreated from their rows first, so that a sweep resumes on another "
    "machine where its committed table stands. Repeat the flag to restore "
    "from several tables, in order.",
)
_PROGRESS_EVERY_S = flags.DEFINE_float(
    "progress_every_s",
    progress.PROGRESS_EVERY_S,
    "Print each running run's or program's progress (step, best eval/loss, "
    "members still training, ETA) every this many seconds; 0: never.",
    lower_bound=0.0,
)
_REPORT = flags.DEFINE_bool(
    "report",
    True,
    "When the runs are done, write the report of a sweep file that has one "
    "(its write_report): REPORT.md and the plots.",
)
_TRAIN_SCRIPT = flags.DEFINE_string(
    "train_script",
    os.path.join(EXPERIMENTS, "train.py"),
    "Program each run executes with --config, --workdir and --config.* flags "
    "(and a --member flag per member with --ensemble).",
)


def main(argv):
    cli.start(argv, quiet=False)
    sweep = runner.Sweep(
        _SWEEP.value, _WORKDIR.value, _TRAIN_SCRIPT.value, ensemble=_ENSEMBLE.value
    )
    try:
        for table in _RESTORE_FROM.value:
            restored = sweeps.restore_runs(_SWEEP.value, table, _WORKDIR.value)
            print(f"Restored {len(restored)} finished runs from {table}.", flush=True)
        runs, jobs = sweep.plan_jobs()
        if _DRY_RUN.value:
            runner.print_commands(runs, jobs)
            return
        try:
            slots = runner.cpu_slots(_PARALLEL.value, _CPUS_PER_RUN.value)
        except ValueError as e:
            sys.exit(str(e))
        report = [
            sys.executable,
            os.path.join(EXPERIMENTS, "report.py"),
            f"--workdir={_WORKDIR.value}",
        ]
        status = runner.run_sweep(
            sweep,
            runs,
            slots,
            command=shlex.join(["python", *sys.argv]),
            report_command=(
                report if _REPORT.value and sweeps.has_report(_SWEEP.value) else None
            ),
            jobs=jobs,
            progress_every_s=_PROGRESS_EVERY_S.value,
        )
    except runner.Terminated:
        sys.exit(
            "Stopped by SIGTERM, the running runs with it; the same command "
            "resumes the sweep."
        )
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"--sweep={_SWEEP.value}: {e}")
    sys.exit(status)


if __name__ == "__main__":
    app.run(main)
