r"""Trains a language model: parses flags, then calls the library.

    python experiments/train.py --config=configs/default.py:nanogpt,tied \
        --workdir=runs/nanogpt_tied [--config.train.steps=500 ...]

Rerunning with the same --workdir resumes from its newest checkpoint.
"""

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from lmhead import train

config_flags.DEFINE_config_file("config", None, "A configs/*.py file[:args].",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory of the run's outputs.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    train.train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
