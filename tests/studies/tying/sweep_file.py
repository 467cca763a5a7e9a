"""The tying study's sweep file, configs/sweeps/tying_study.py, as its tests
load it and run it through the sweep command."""

import os
import subprocess
import sys

from lmhead.lm import configuration
from tests import ROOT

STUDY = os.path.join(ROOT, "configs", "sweeps", "tying_study.py")


def study_module():
    """The sweep file, loaded as ``experiments/sweep.py`` loads it."""
    return configuration.load_module(STUDY)


def run_sweep(workdir, arg: str) -> None:
    """``experiments/sweep.py --sweep=STUDY:arg`` into ``workdir``, in
    ensemble programs of 6, without a report or progress lines."""
    command = [
        sys.executable,
        os.path.join(ROOT, "experiments", "sweep.py"),
        f"--sweep={STUDY}:{arg}",
        f"--workdir={workdir}",
        "--ensemble=6",
        "--noreport",
        "--progress_every_s=0",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run(command, check=True, cwd=ROOT, env=env, capture_output=True)
