"""What the commands of ``experiments/`` do first (each imports it as
``import cli``: the folder of the running script is on ``sys.path``), and
the flags that several of them share, each defined here once with one help
text (the benchmarks of ``experiments/bench/`` reach them through
``timing.cli``)."""

from collections.abc import Sequence

from absl import app, flags, logging

# The flags that the functions below define belong to the command that calls
# them (its --help lists them), not to this module.
flags.disclaim_key_flags()


def start(argv: Sequence[str], *, quiet: bool = True) -> flags.FlagValues:
    """Refuses positional arguments and returns the parsed flags; ``quiet``
    (unless ``--verbosity`` is given) keeps absl's INFO logs out, where
    orbax logs every checkpoint it saves or restores."""
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if quiet and not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    return flags.FLAGS


def workdir_flag(
    *, required: bool = True, repeatable: bool = False
) -> flags.FlagHolder:
    """``--workdir``: the directory of a run, or of a sweep for
    ``sweep.py`` and ``report.py``. ``repeatable`` makes it a list, empty by
    default, for the commands that read several runs (never required: they
    say what else they take)."""
    help_text = (
        "A run's directory, where train.py writes its config, checkpoints "
        "and logs (for sweep.py and report.py a sweep's, a run in each "
        "subdirectory)."
    )
    if repeatable:
        return flags.DEFINE_multi_string("workdir", [], help_text)
    return flags.DEFINE_string("workdir", None, help_text, required=required)


def quick_flag() -> flags.FlagHolder[bool]:
    """``--quick``: a benchmark at tiny sizes, which a test runs."""
    return flags.DEFINE_bool(
        "quick",
        False,
        "Tiny sizes and few repeats, which measure nothing: a check that the "
        "benchmark runs (its docstring gives the sizes).",
    )


def matmul_size_flag(default: int) -> flags.FlagHolder[int]:
    """``--matmul_size``: the side of a benchmark's reference matmul."""
    return flags.DEFINE_integer(
        "matmul_size",
        default,
        "Side of the timed square float32 matmul, whose rate the benchmark's "
        "ratios are read against (experiments/bench/timing.py).",
        lower_bound=1,
    )
