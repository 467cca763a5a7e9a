"""What the commands of ``experiments/`` do first (each imports it as
``import cli``: the folder of the running script is on ``sys.path``)."""

from collections.abc import Sequence

from absl import app, flags, logging


def start(argv: Sequence[str], *, quiet: bool = True) -> flags.FlagValues:
    """Refuses positional arguments and returns the parsed flags; ``quiet``
    (unless ``--verbosity`` is given) keeps absl's INFO logs out, where
    orbax logs every checkpoint it saves or restores."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if quiet and not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    return flags.FLAGS
