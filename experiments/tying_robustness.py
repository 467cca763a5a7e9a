r"""What the tying study's confirmation holds beside its verdicts
(``studies/tying/robustness.py``): failed runs per arm and rate, the
verdicts without them, one model of the confirmatory runs, and the
profiles' bootstrap calls on fresh seeds, from the committed tables alone:

    python experiments/tying_robustness.py --out=docs/tying_study/robustness
"""

import os

import cli  # experiments/cli.py, beside this file
from absl import app, flags

from lmhead.lm import configuration
from studies.tying import confirm, robustness

flags.DEFINE_string(
    "tables",
    "docs/tying_study",
    "The folder whose profiles/, confirm/ and compute/ hold the runs.csv read.",
)
flags.DEFINE_string("out", "docs/tying_study/robustness", "Where REPORT.md goes.")
flags.DEFINE_string(
    "sweep", "configs/sweeps/tying_study.py", "The sweep file with the hypotheses."
)


def main(argv):
    f = cli.start(argv)
    sweep = configuration.load_module(f.sweep)
    args = sweep.parse("compute")
    robustness.report_from_csv(
        {n: os.path.join(f.tables, n, "runs.csv") for n in robustness.TABLES},
        f.out,
        [confirm.Hypothesis(*h) for h in sweep.HYPOTHESES[args["base"]]],
        sweep.EQUIVALENCE_MARGIN,
        sweep.compute_cell(args),
    )
    print(os.path.join(f.out, "REPORT.md"))


if __name__ == "__main__":
    app.run(main)
