r"""Diagnostics of trained heads (row norms against frequency, an untied
head's alignment with its table, the logit scale, the loss by frequency
bucket) for runs side by side, or for the tying study's diagnosed cells:

    python experiments/tying_diagnostics.py --workdir=runs/tied \
        --workdir=runs/untied --out=docs/tying_study/diagnostics --split=test
    python experiments/tying_diagnostics.py --study_dir=runs/tying_study \
        --study_csv=docs/tying_study/runs.csv --out=docs/tying_study/diagnostics

Writes the plots, ``diagnostics.json`` and ``diagnostics.md`` into ``--out``
(``studies/tying/diagnostics_report.py``; docs/tying_study/README.md,
"Diagnostics of the trained heads").
"""

import cli  # experiments/cli.py, beside this file
from absl import app, flags

from studies.tying import diagnostics_report, table

cli.workdir_flag(repeatable=True)
flags.DEFINE_string(
    "study_dir", None, "Instead of --workdir: the tying study's sweep directory."
)
flags.DEFINE_string(
    "study_csv", None, "With --study_dir: the study's runs.csv, which names the runs."
)
flags.DEFINE_string("out", None, "Where to write the plots and tables.", required=True)
flags.DEFINE_enum(
    "split", "test", list(diagnostics_report.SPLITS), "The evaluation windows' split."
)
flags.DEFINE_integer(
    "max_windows",
    None,
    "At most this many evenly spaced windows; default: the whole split.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "num_buckets",
    diagnostics_report.NUM_BUCKETS,
    "Frequency buckets of equal training-token mass.",
    lower_bound=1,
)
flags.DEFINE_integer("batch_size", 16, "Windows per model call.", lower_bound=1)


def main(argv):
    f = cli.start(argv)
    if bool(f.workdir) == bool(f.study_dir) or bool(f.study_dir) != bool(f.study_csv):
        raise app.UsageError(
            "Give --workdir (repeatable), or --study_dir with --study_csv."
        )
    if f.workdir:
        labels = dict(zip(f.workdir, diagnostics_report.run_names(f.workdir)))
    else:
        labels = diagnostics_report.study_workdirs(
            f.study_dir, table.read_rows(f.study_csv)
        )
    if not labels:
        print(f"No test run of the diagnosed cells in {f.study_dir} yet.")
        return
    runs = [
        diagnostics_report.diagnose_run(
            workdir,
            split=f.split,
            max_windows=f.max_windows,
            num_buckets=f.num_buckets,
            batch_size=f.batch_size,
            name=name,
        )
        for workdir, name in labels.items()
    ]
    for path in diagnostics_report.write_diagnostics(runs, f.out):
        print(path)


if __name__ == "__main__":
    app.run(main)
