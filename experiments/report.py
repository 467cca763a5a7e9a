r"""The report command: writes a sweep directory's REPORT.md and plots
(``lmhead/lab/report.py``; ``experiments/sweep.py`` runs it after a sweep).

    python experiments/report.py --workdir=runs/tying_study --out=docs/tying_study

A sweep whose file defines ``write_report`` (``configs/sweeps/tying_study.py``)
gets its own report in ``--out`` (the tying study's: ``runs.csv``, then
REPORT.md from it alone, ``lmhead/studies/tying/results.py``); the sweep file
is the one ``sweep.json`` names, or ``--sweep`` for runs launched from
``--dry_run`` commands. Any other sweep gets the
generic tied-vs-untied report, in the sweep directory. Prints the study's
answer (the generic report's table) and the paths at the end.

``--restore_from`` first recreates, in the sweep directory, the finished runs
of committed tables (as ``experiments/sweep.py``'s flag does), so that a
study's committed report is rewritten from its committed ``runs.csv`` alone,
without its runs:

    python experiments/report.py --workdir=/tmp/tying_study \
        --sweep=configs/sweeps/tying_study.py \
        --restore_from=docs/tying_study/runs.csv --out=docs/tying_study
"""

import cli  # experiments/cli.py, beside this file
from absl import app, flags

from lmhead.lab import report, sweeps

_WORKDIR = flags.DEFINE_string("workdir", None, "Sweep directory.", required=True)
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
    text, report_path, plots = report.write_sweep_report(
        _WORKDIR.value, out_dir=_OUT.value, spec=_SWEEP.value
    )
    print(text.rstrip("\n") + "\n")
    print(f"Report: {report_path}")
    for path in plots:
        print(f"Plot:   {path}")


if __name__ == "__main__":
    app.run(main)
