r"""The report command: writes a sweep directory's REPORT.md and plots, and
prints the answer and the paths (``lmhead/lab/report.py``).

    python experiments/report.py --workdir=runs/tying_study --out=docs/tying_study

The sweep file's ``write_report`` (``configs/sweeps/tying_study.py``'s)
writes the report into ``--out``; a sweep file without one has no report
(docs/sweeps.md, "Reports"). ``--restore_from`` first recreates the finished runs
of committed tables, so that a committed report is rewritten from its
``runs.csv`` alone (docs/tying_study/README.md, "Commands").
"""

import sys

import cli  # experiments/cli.py, beside this file
from absl import app, flags

from lmhead.lab import report, sweeps

_WORKDIR = cli.workdir_flag()
_SWEEP = flags.DEFINE_string(
    "sweep",
    None,
    "Sweep file and argument (path.py[:arg]); default: the one in "
    "the sweep directory's sweep.json.",
)
_OUT = flags.DEFINE_string(
    "out", None, "Where a study's report goes; default: the sweep directory."
)
_RESTORE_FROM = flags.DEFINE_multi_string(
    "restore_from",
    [],
    "A committed runs.csv whose finished runs are recreated in --workdir "
    "before the report (needs --sweep); repeat it for several tables.",
)


def main(argv):
    cli.start(argv, quiet=False)
    if _RESTORE_FROM.value and _SWEEP.value is None:
        raise app.UsageError("--restore_from needs --sweep, the study's file.")
    for table in _RESTORE_FROM.value:
        restored = sweeps.restore_runs(_SWEEP.value, table, _WORKDIR.value)
        print(f"Restored {len(restored)} finished runs from {table}.", flush=True)
    try:
        text, report_path, plots = report.write_sweep_report(
            _WORKDIR.value, out_dir=_OUT.value, spec=_SWEEP.value
        )
    except ValueError as e:
        sys.exit(str(e))
    print(text.rstrip("\n") + "\n")
    print(f"Report: {report_path}")
    for path in plots:
        print(f"Plot:   {path}")


if __name__ == "__main__":
    app.run(main)
