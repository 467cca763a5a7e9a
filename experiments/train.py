r"""Trains a language model: parses flags, then calls the library.

    python experiments/train.py --config=configs/default.py:nanogpt,tied \
        --workdir=runs/nanogpt_tied [--config.train.steps=500 ...]

Several runs that differ only in member keys (the seed, the learning rates,
the loss weights, the text trained on; ``lmhead/lm/members.py``) train as
one program, each in its own workdir, with one ``--member`` flag each::

    python experiments/train.py --config=configs/default.py:nanogpt \
        --workdir=runs/seeds --member='{"workdir": "runs/seeds/seed=0"}' \
        --member='{"workdir": "runs/seeds/seed=1", "train.seed": 1}'

Rerunning with the same --workdir resumes from its newest checkpoint; a
workdir made by another config is refused (see
``configuration.check_resumable``).
SIGTERM saves a checkpoint at the next step boundary and exits with status
143 (128 + SIGTERM); the same command then resumes.

Several processes (hosts), each started with the same flags plus::

    --coordinator_address=HOST0:PORT --num_processes=N --process_id=I

or ``--distributed`` where JAX finds the cluster itself (Cloud TPU slices,
SLURM, Open MPI). See ``lmhead/lm/sharding.py`` and docs/scale_out.md for
the device mesh; docs/training.md for what the run writes and how it
resumes.

On a CPU, ``--cpu_devices=N`` (e.g. the number of cores) gives the process
N devices and splits each batch over them (data parallel): XLA runs a small
model's many small operations on one core at a time, and a device per core
keeps every core busy (docs/nanogpt_parity.md, "Microbatches and CPU
devices", measures it). Results then differ from a single device's by
float32 rounding, and a run killed and resumed may differ from an
uninterrupted one in the last bits, which with one device it never does.
An ensemble (``--member``) gets one CPU device per CPU it may use unless
``--cpu_devices`` says otherwise, and splits its members over them
(``config.mesh.members``, docs/training.md, "Ensembles"); a member's step
is the same computation on one device and many, and its results agree to
float32 rounding.
"""

import re
import signal
import sys

import cli  # experiments/cli.py, beside this file
import jax
from absl import app, flags
from ml_collections import config_flags

from lmhead.lm import configuration, ensemble, preemption, sharding, train
from lmhead.lm import members as ensemble_members

config_flags.DEFINE_config_file(
    "config", None, "A configs/*.py file[:args].", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory of the run's outputs.")
flags.DEFINE_bool(
    "distributed", False, "Start jax.distributed and let JAX detect the cluster."
)
flags.DEFINE_string(
    "coordinator_address",
    None,
    "host:port of process 0, for a run over several processes.",
)
flags.DEFINE_integer("num_processes", None, "Processes in the run.")
flags.DEFINE_integer("process_id", None, "This process's index, 0 to N - 1.")
flags.DEFINE_integer(
    "cpu_devices",
    None,
    "Devices of the CPU backend (default: JAX's, one; for an ensemble "
    "(--member), one per CPU the process may use); with the default "
    "config.mesh a single run splits each batch over them (data parallel), "
    "an ensemble its members. No effect on GPU or TPU.",
    lower_bound=1,
)
flags.DEFINE_multi_string(
    "member",
    None,
    "An ensemble member, as JSON: its workdir and the member keys it sets, e.g. "
    '\'{"workdir": "runs/s/seed=1", "train.seed": 1, "optim.lr": 0.002}\'. '
    "Repeated: the members train as one program in --workdir "
    "(lmhead/lm/ensemble.py); a member without a workdir gets "
    "--workdir/members/<index>.",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    cli.start(argv)
    # Before any backend starts. An ensemble's members split over the CPU
    # devices (config.mesh.members None), one device per core: a lax.map over
    # members on one device keeps about one core busy.
    cpu_devices = flags.FLAGS.cpu_devices or (
        sharding.available_cpus() if flags.FLAGS.member else None
    )
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    if flags.FLAGS.distributed or flags.FLAGS.coordinator_address:
        sharding.initialize_distributed(
            flags.FLAGS.coordinator_address,
            flags.FLAGS.num_processes,
            flags.FLAGS.process_id,
        )
    try:
        if flags.FLAGS.member:
            train_members(flags.FLAGS.config, flags.FLAGS.member, flags.FLAGS.workdir)
        else:
            train.train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
    except preemption.Preempted as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGTERM)


def train_members(config, specs: list[str], workdir: str) -> None:
    """The ``--member`` flags' ensemble; exits with status 1 when a member
    stopped without a summary (a non-finite loss)."""
    try:
        members = ensemble_members.make_members(
            [ensemble_members.parse_member(s, i) for i, s in enumerate(specs)], workdir
        )
    except ValueError as e:
        sys.exit(f"FATAL Flags parsing error: --member: {e}")
    summaries = ensemble.train_ensemble(config, members, workdir)
    failed = [m.workdir for m, s in zip(members, summaries) if s is None]
    if failed:
        sys.exit(f"{len(failed)} members stopped without a summary: {failed}")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing. The locked config refuses an override of no config key
    (``--config.trian.steps``) with a traceback naming one part of it; this
    names the whole key and the closest valid ones instead."""
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError):
        overrides = [
            m[1] for arg in argv if (m := re.match(r"--?(?:no)?config\.([\w.]+)", arg))
        ]
        try:
            configuration.check_config_keys(overrides, configuration.default_types())
        except ValueError as e:
            sys.exit(f"FATAL Flags parsing error: {e}")
        raise


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
