r"""Trains a language model: parses flags, then calls the library.

    python experiments/train.py --config=configs/default.py:nanogpt,tied \
        --workdir=runs/nanogpt_tied [--config.train.steps=500 ...]

Runs that differ only in member keys (``lmhead/lm/members.py``) train as
one program with a ``--member`` flag each; the same --workdir resumes;
SIGTERM saves and exits with status 143. ``--convert_checkpoints`` rewrites
a workdir's checkpoints of the single-run layout written before a single run
became a program of one, in place. Several processes take
``--coordinator_address=HOST0:PORT --num_processes=N --process_id=I`` or
``--distributed``; ``--cpu_devices=N`` splits each batch over N CPU devices.
docs/training.md describes each (ensembles, resuming, reliability,
determinism), docs/scale_out.md the mesh and the hosts.
"""

import re
import signal
import sys

import cli  # experiments/cli.py, beside this file
import jax
from absl import app, flags
from ml_collections import config_flags

from lmhead.lm import checkpoints, configuration, preemption, sharding, train
from lmhead.lm import members as ensemble_members

config_flags.DEFINE_config_file(
    "config", None, "A configs/*.py file[:args].", lock_config=True
)
cli.workdir_flag()
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
    "(lmhead/lm/program.py); a member without a workdir gets "
    "--workdir/members/<index>.",
)
flags.DEFINE_bool(
    "convert_checkpoints",
    False,
    "Rewrite --workdir's checkpoints of the single-run layout written before "
    "a single run became a program of one (lmhead/lm/checkpoints.py) in the "
    "one layout, in place, then exit; --config is not read.",
)
flags.register_multi_flags_validator(
    ["config", "convert_checkpoints"],
    lambda values: values["config"] is not None or values["convert_checkpoints"],
    "Flag --config must have a value other than None.",
)


def main(argv):
    cli.start(argv)
    if flags.FLAGS.convert_checkpoints:
        converted = checkpoints.convert_single_run(flags.FLAGS.workdir)
        print(
            f"Converted {', '.join(converted) or 'nothing'} in {flags.FLAGS.workdir}.",
            flush=True,
        )
        return
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
    summaries = train.train_program(config, members, workdir)
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
