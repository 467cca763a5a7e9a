"""Tests for lmhead/lab/ensembles.py: a sweep's runs grouped into ensemble
programs by :meth:`lmhead.lab.runner.Sweep.plan_jobs` (by program part, at
most M, stable across plans, new runs in new programs, finished runs and
runs started alone left out), the split on each run's own config, and the
refusals. Running the programs is tests/lab/test_runner.py's."""

import json
import pathlib
import textwrap

import pytest

from lmhead.lab import ensembles, runner
from tests.lab.sweep_helpers import FAKE_SWEEP

# Three seeds for each head; two more seeds for both once tied=True,seed=1
# has finished (a sweep that plans from its results, as the tying study's
# tuning stage does).
GROWING_SWEEP = textwrap.dedent("""\
    import os
    from lmhead.lab import sweeps

    def get_sweep(arg=None, workdir=None):
        seeds = [0, 1, 2]
        if os.path.exists(os.path.join(workdir, "tied=True,seed=1", "summary.json")):
            seeds += [3, 4]
        return "tiny", sweeps.product(sweeps.sweep("model.tied", [True, False]),
                                      sweeps.sweep("train.seed", seeds))
    """)


def make_sweep(tmp_path, source=GROWING_SWEEP, ensemble=2):
    (tmp_path / "sweep_file.py").write_text(source)
    return runner.Sweep(
        f"{tmp_path}/sweep_file.py",
        str(tmp_path / "sweep"),
        str(tmp_path / "train.py"),
        ensemble=ensemble,
    )


def finish(sweep, name):
    workdir = pathlib.Path(sweep.sweep_dir, name)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "summary.json").write_text("{}")


def programs_of(jobs):
    """``{job name: member run names}``; a run alone maps to ``None``."""
    return {
        job["name"]: [m["name"] for m in job["members"]] if "members" in job else None
        for job in jobs
    }


def run_name(tied, seed):
    return f"tied={tied},seed={seed}"


def test_programs_group_runs_by_program_part_at_most_m_and_never_move(tmp_path):
    sweep = make_sweep(tmp_path)
    finish(sweep, run_name(True, 0))  # finished before: in no program
    runs, jobs = sweep.plan_jobs()
    assert [r["name"] for r in runs] == [
        run_name(tied, seed) for tied in (True, False) for seed in range(3)
    ]
    first = {
        "tied=True,ensemble=0": [run_name(True, 1), run_name(True, 2)],
        "tied=False,ensemble=0": [run_name(False, 0), run_name(False, 1)],
        "tied=False,ensemble=1": [run_name(False, 2)],
    }
    assert programs_of(jobs) == first
    assert list(programs_of(jobs)) == list(first)  # in plan order
    program = jobs[1]
    assert program["workdir"] == f"{sweep.sweep_dir}/ensembles/tied=False,ensemble=0"
    assert program["overrides"] == {"model.tied": False}
    assert [m["workdir"] for m in program["members"]] == [
        f"{sweep.sweep_dir}/{run_name(False, seed)}" for seed in (0, 1)
    ]
    record = json.loads((tmp_path / "sweep" / ensembles.ASSIGNMENT_FILE).read_text())
    assert record["tied=False,ensemble=0"] == {
        run_name(False, 0): {"train.seed": 0},
        run_name(False, 1): {"train.seed": 1},
    }

    # Planning again gives the same programs, commands included.
    assert sweep.plan_jobs()[1] == jobs

    # The plan grows once tied=True,seed=1 finishes: the new runs form new
    # programs, although tied=False,ensemble=1 has room for one more, and
    # the program of the finished run still runs for its other member.
    finish(sweep, run_name(True, 1))
    _, jobs = sweep.plan_jobs()
    assert programs_of(jobs) == {
        **first,
        "tied=True,ensemble=1": [run_name(True, 3), run_name(True, 4)],
        "tied=False,ensemble=2": [run_name(False, 3), run_name(False, 4)],
    }


def test_a_run_started_alone_resumes_alone_and_ensemble_one_is_off(tmp_path):
    sweep = make_sweep(tmp_path, source=FAKE_SWEEP.replace("arg or 2", "arg or 3"))
    (tmp_path / "sweep" / run_name(False, 1) / "checkpoints").mkdir(parents=True)
    runs, jobs = sweep.plan_jobs()
    assert programs_of(jobs) == {
        "tied=True,ensemble=0": [run_name(True, 0), run_name(True, 1)],
        "tied=True,ensemble=1": [run_name(True, 2)],
        "tied=False,ensemble=0": [run_name(False, 0), run_name(False, 2)],
        run_name(False, 1): None,
    }
    assert list(programs_of(jobs))[2:] == ["tied=False,ensemble=0", run_name(False, 1)]
    assert jobs[3] == runs[4]
    for size in (0, 1):
        (tmp_path / f"off{size}").mkdir()
        off = make_sweep(tmp_path / f"off{size}", ensemble=size)
        assert (
            off.plan_jobs()[1] == off.plan()
            and not (tmp_path / f"off{size}" / "sweep").exists()
        )


def test_split_runs_uses_each_runs_config():
    runs = [
        {"name": "a", "overrides": {"model.d_model": 64, "optim.lr": 0.01}},
        {"name": "b", "overrides": {"data.train_fraction": 0.5, "train.seed": 3}},
    ]
    parts = ensembles.split_runs(runs, "tiny", {}, runner.configuration.CONFIG_FILE)
    assert parts == {
        "a": ({"model.d_model": 64}, {"optim.lr": 0.01}),
        "b": ({}, {"data.train_fraction": 0.5, "train.seed": 3}),
    }
    # A BPE tokenizer trained on the run's own fraction: the fraction is the
    # program's (the shared overrides are part of the run's config).
    bpe = {"data.tokenizer": "bpe", "data.vocab_size": 300}
    parts = ensembles.split_runs(
        runs[1:], "tiny", bpe, runner.configuration.CONFIG_FILE
    )
    assert parts == {"b": ({"data.train_fraction": 0.5}, {"train.seed": 3})}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train.stpes": 3}, "run r: config.train.stpes is not a config key"),
        ({"train.steps": "many"}, "run r: "),
    ],
)
def test_split_runs_refuses_a_bad_override_naming_the_run(overrides, message):
    runs = [{"name": "r", "overrides": overrides}]
    with pytest.raises(ValueError, match=message):
        ensembles.split_runs(runs, "tiny", {}, runner.configuration.CONFIG_FILE)


def test_a_run_whose_overrides_changed_under_its_program_is_refused(tmp_path):
    sweep = make_sweep(tmp_path)
    sweep.plan_jobs()
    path = tmp_path / "sweep" / ensembles.ASSIGNMENT_FILE
    record = json.loads(path.read_text())
    record["tied=True,ensemble=0"][run_name(True, 0)] = {"train.seed": 7}
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="Remove tied=True,ensemble=0 from"):
        sweep.plan_jobs()
    # A running sweep reports it and goes on with the jobs it has.
    assert sweep.unfinished_jobs() == []


def test_assign_refuses_a_size_below_one():
    with pytest.raises(ValueError, match="size must be an integer >= 1; got 0"):
        ensembles.assign([], {}, {}, 0)
