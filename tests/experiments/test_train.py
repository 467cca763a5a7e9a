"""Tests for experiments/train.py's flags: a bad flag or config value fails
before the workdir is made, with status 1 and a message that names it.

The program's runs themselves are tested in test_commands.py.
"""

import os

import pytest

from tests import run_experiment
from tests.errors import cases, names


def run_train(*args):
    return run_experiment("train.py", *args)


# The program exits with 1 and names the flag (and the closest key).
CLI = [
    ("unknown key", ["--config.trian.steps=3"],
     ("config.trian.steps", "config.train.steps")),
    ("not an int", ["--config.train.steps=ten"], ("config.train.steps", "ten")),
    ("lr out of range", ["--config.optim.lr=-0.001"],
     ("ValueError", "config.optim.lr")),
]  # fmt: skip
# Every other value a run refuses is test_configuration.py's, in process.


@pytest.mark.parametrize("args,named", cases(CLI))
def test_train_command_line(tmp_path, args, named):
    workdir = str(tmp_path / "run")
    result = run_train(
        "--config=configs/default.py:tiny", f"--workdir={workdir}", *args
    )
    assert result.returncode == 1
    for name in named:
        assert names(result.stderr, name), (name, result.stderr[-2000:])
    assert not os.path.exists(workdir)


def test_a_config_is_needed_unless_converting(tmp_path):
    """--config is required to train; --convert_checkpoints reads none."""
    workdir = str(tmp_path / "run")
    result = run_train(f"--workdir={workdir}")
    assert result.returncode == 1 and names(result.stderr, "--config")
    assert not os.path.exists(workdir)
    converted = run_train(f"--workdir={workdir}", "--convert_checkpoints")
    assert converted.returncode == 0, converted.stderr[-2000:]
    assert f"Converted nothing in {workdir}." in converted.stdout
