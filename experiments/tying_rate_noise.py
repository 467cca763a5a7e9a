r"""How precisely the tying study's validation windows tell each chosen
learning rate from the next best one (``studies/tying/rate_noise.py``):

    python experiments/tying_rate_noise.py --study_dir=runs/tying_study \
        --study_csv=docs/tying_study/runs.csv --out=docs/tying_study

Reads the tuning runs under ``--study_dir`` that hold parameters and writes
``rate_noise.md`` and ``rate_noise.json`` into ``--out``, keeping an earlier
reading there where it read more seeds.
"""

import json
import os

import cli  # experiments/cli.py, beside this file
from absl import app, flags

from studies.tying import rate_noise, table

flags.DEFINE_string(
    "study_dir", None, "The tying study's sweep directory.", required=True
)
flags.DEFINE_string("study_csv", None, "The study's runs.csv.", required=True)
flags.DEFINE_string(
    "out", None, "Where to write rate_noise.md and rate_noise.json.", required=True
)
flags.DEFINE_integer("batch_size", 16, "Windows per model call.", lower_bound=1)


def main(argv):
    f = cli.start(argv)
    path = os.path.join(f.out, rate_noise.JSON_FILE)
    previous = None
    if os.path.exists(path):
        with open(path) as file:
            previous = {entry["key"]: entry for entry in json.load(file)}
    found = rate_noise.rate_noise(
        f.study_dir, table.read_rows(f.study_csv), previous, batch_size=f.batch_size
    )
    os.makedirs(f.out, exist_ok=True)
    with open(path, "w") as file:
        json.dump(found, file, indent=1)
    markdown = os.path.join(f.out, rate_noise.MARKDOWN_FILE)
    with open(markdown, "w") as file:
        file.write(rate_noise.markdown(found) + "\n")
    print(markdown)
    print(path)


if __name__ == "__main__":
    app.run(main)
