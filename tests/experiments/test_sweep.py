"""Tests for experiments/sweep.py, the sweep command: --dry_run's commands,
of runs and of ensemble programs (the runner behind it is tested in
tests/lab/test_runner.py, the grouping in tests/lab/test_ensembles.py), and, slow, a
real tiny sweep of the tying study trained and reported end to end."""

import os
import shlex
import subprocess
import sys

import pytest

from lmhead.lab import workdirs
from lmhead.lm import members
from tests import ROOT
from tests.lab.sweep_helpers import SWEEP_SCRIPT, run_sweep


def test_dry_run_prints_one_command_per_remaining_run(tmp_path):
    finished = tmp_path / "sweep" / "tied=True,seed=1"
    finished.mkdir(parents=True)
    (finished / "summary.json").write_text("{}")
    result = run_sweep(tmp_path, "--dry_run")
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    names = ["tied=True,seed=0", "tied=False,seed=0", "tied=False,seed=1"]
    assert [c[3] for c in commands] == [
        f"--workdir={tmp_path}/sweep/{n}" for n in names
    ]
    assert all(
        c[0] == sys.executable and c[1].endswith("fake_train.py") for c in commands
    )
    assert commands[1][2] == "--config=configs/default.py:tiny"
    assert commands[1][4:] == ["--config.model.tied=False", "--config.train.seed=0"]
    assert "1 of 4 runs already finished" in result.stderr
    assert sorted(os.listdir(tmp_path / "sweep")) == ["tied=True,seed=1"]  # ran nothing


def test_dry_run_with_ensembles_prints_one_command_per_program(tmp_path):
    sweep_dir = tmp_path / "sweep"
    finished = sweep_dir / "tied=True,seed=1"
    finished.mkdir(parents=True)
    (finished / "summary.json").write_text("{}")
    result = run_sweep(tmp_path, "--dry_run", "--ensemble=2", arg=":3")
    assert result.returncode == 0, result.stderr
    assert "# 1 of 6 runs already finished; the others in 3 processes" in result.stderr
    programs = {
        "tied=True,ensemble=0": (True, [0, 2]),
        "tied=False,ensemble=0": (False, [0, 1]),
        "tied=False,ensemble=1": (False, [2]),
    }
    lines = result.stdout.splitlines()
    assert len(lines) == len(programs)
    for line, (name, (tied, seeds)) in zip(lines, programs.items()):
        command = shlex.split(line)
        assert command[:4] == [
            sys.executable,
            f"{tmp_path}/fake_train.py",
            "--config=configs/default.py:tiny",
            f"--workdir={sweep_dir}/ensembles/{name}",
        ]
        flags_ = [flag for flag in command[4:] if not flag.startswith("--member=")]
        assert flags_ == [f"--config.model.tied={tied}"]
        member_flags = [flag for flag in command[4:] if flag not in flags_]
        assert [
            members.parse_member(flag.removeprefix("--member="), index)
            for index, flag in enumerate(member_flags)
        ] == [
            {"workdir": f"{sweep_dir}/tied={tied},seed={seed}", "train.seed": seed}
            for seed in seeds
        ]
    # Nothing ran; the grouping is kept, so the commands stay the same.
    assert sorted(os.listdir(sweep_dir)) == ["ensembles.json", "tied=True,seed=1"]
    again = run_sweep(tmp_path, "--dry_run", "--ensemble=2", arg=":3")
    assert again.stdout == result.stdout


def test_a_sweep_file_that_does_not_load_exits_naming_the_flag(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            SWEEP_SCRIPT,
            f"--sweep={tmp_path}/missing.py",
            f"--workdir={tmp_path}/sweep",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 1
    assert f"--sweep={tmp_path}/missing.py: " in result.stderr
    assert "no sweep file" in result.stderr
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_real_tiny_sweep_trains_and_reports(tmp_path):
    """The tying study's tiny preset, characters only, arms a and b, two
    seeds, no tuning stage: four real runs, then runs.csv and REPORT.md."""
    sweep_dir = tmp_path / "sweep"
    spec = (
        "--sweep=configs/sweeps/tying_study.py:tiny,bpe=,arms=a+b,amounts=1.0,"
        "seeds=2,tune=false,ablation=false"
    )
    command = [sys.executable, SWEEP_SCRIPT, spec, f"--workdir={sweep_dir}"]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = workdirs.read_sweep(str(sweep_dir))
    assert sorted(r.overrides["model.tied"] for r in runs) == [False, False, True, True]
    assert all(r.status == "finished" for r in runs)
    tied = next(r for r in runs if r.overrides["model.tied"])
    untied = next(r for r in runs if not r.overrides["model.tied"])
    assert (
        untied.summary["num_params"] - tied.summary["num_params"]
        == 84 * tied.config["model"]["d_model"]
    )
    assert all(0 < r.summary["test"]["bits_per_char"] < 10 for r in runs)
    assert len((sweep_dir / "runs.csv").read_text().splitlines()) == 1 + len(runs)
    report = (sweep_dir / "REPORT.md").read_text()
    assert "| a (tied) |" in report and "| b − a |" in report


@pytest.mark.slow
def test_a_sweep_with_ensembles_makes_the_same_runs(tmp_path, corpus):
    """The same tiny sweep (two seeds x two rates) run as four processes and
    with --ensemble=4 as one: the same run directories, and summaries equal
    to float32 rounding."""
    sweep_file = tmp_path / "seeds.py"
    sweep_file.write_text(
        "from lmhead.lab import sweeps\n"
        "def get_sweep(arg=None):\n"
        "    return 'tiny,steps=10', sweeps.product(\n"
        "        sweeps.zipped(sweeps.sweep('optim.lr', [0.003, 0.002]),\n"
        "                      sweeps.sweep('optim.min_lr', [0.0003, 0.0002])),\n"
        "        sweeps.sweep('train.seed', [0, 1])), {\n"
        f"        'data.path': {corpus!r}, 'sample.num_samples': 0,\n"
        "        'train.eval_batches': 1, 'train.eval_every': 5}\n"
    )
    summaries = {}
    for name, flags in (("separate", []), ("ensemble", ["--ensemble=4"])):
        sweep_dir = tmp_path / name
        command = [
            sys.executable,
            SWEEP_SCRIPT,
            f"--sweep={sweep_file}",
            f"--workdir={sweep_dir}",
            "--noreport",
            *flags,
        ]
        result = subprocess.run(
            command, capture_output=True, text=True, cwd=ROOT, timeout=600
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        summaries[name] = {
            r.name: r.summary for r in workdirs.read_sweep(str(sweep_dir))
        }
    assert summaries["separate"].keys() == summaries["ensemble"].keys()
    assert len(summaries["separate"]) == 4
    assert os.listdir(tmp_path / "ensemble" / "ensembles") == ["ensemble=0"]
    for run, separate in summaries["separate"].items():
        together = summaries["ensemble"][run]
        assert together["ensemble"]["members"] == 4
        for key in ("eval/loss", "train_eval/loss", "eval/accuracy"):
            if key in separate["final"]:
                assert together["final"][key] == pytest.approx(
                    separate["final"][key], rel=1e-5
                )
        assert together["num_params"] == separate["num_params"]
