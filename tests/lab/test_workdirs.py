"""Tests for lmhead/lab/workdirs.py: runs read back from their directories,
listed in sweep.json or found without it."""

import json
import os
import shutil

import pytest

from lmhead.lab import workdirs
from tests.lab import synthetic_sweep


def test_read_metrics_keeps_the_last_record_of_a_repeated_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 10, "train/loss": 3.0},
        {"step": 10, "eval/loss": 2.9},
        {"step": 20, "train/loss": 2.5},
        {"step": 20, "train/loss": 2.4},
        {"step": 15, "train/loss": 2.7},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3')
    assert workdirs.read_metrics(str(path)) == [
        records[0],
        records[1],
        records[4],
        records[3],
    ]
    path.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 1"):
        workdirs.read_metrics(str(path))


def test_runs_without_sweep_json_are_found(sweep_dir, tmp_path):
    """Runs launched from --dry_run commands: overrides are the varying config keys."""
    for name in os.listdir(sweep_dir):
        if (sweep_dir / name / "config.json").exists():
            shutil.copytree(sweep_dir / name, tmp_path / name)
    runs = workdirs.read_sweep(str(tmp_path))
    assert len(runs) == 13
    assert set(runs[0].overrides) == {
        "data.tokenizer",
        "data.vocab_size",
        "model.tied",
        "train.seed",
    }


def test_a_runs_status_follows_its_files(sweep_dir):
    """finished: a summary; failed: an exit recorded without one; not
    started: nothing; the listed order is the sweep's."""
    runs = workdirs.read_sweep(str(sweep_dir))
    status = {run.name: run.status for run in runs}
    assert status[synthetic_sweep.FAILED] == "failed"
    assert status[synthetic_sweep.NOT_STARTED] == "not started"
    assert sum(s == "finished" for s in status.values()) == 12
    failed = next(r for r in runs if r.name == synthetic_sweep.FAILED)
    assert failed.returncode == 1 and failed.summary is None
    assert workdirs.curve(failed) == ([10], [5.0 + 3])
    listed = json.loads((sweep_dir / workdirs.SWEEP_FILE).read_text())["runs"]
    assert [r.name for r in runs] == [r["name"] for r in listed]
