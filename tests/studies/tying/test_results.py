"""Tests for studies/tying/results.py: the rows of runs.csv read from a
sweep directory of the tiny design (run directories written, not trained),
restored into fresh directories, and the committed reports and plots
regenerated from their runs.csv alone (through the report command, in
tests/experiments/test_report.py)."""

import json
import os
import re

import numpy as np
import pytest

from lmhead.lab import ensembles, runner, sweeps
from lmhead.lm import configuration
from studies.tying import results, shapes, study, table, tuning_text
from tests import ROOT, run_experiment
from tests.lab.sweep_helpers import SWEEP_CONFIGS
from tests.studies.tying.sweep_file import STUDY, study_module

ARG = "tiny,char=false,amounts=0.2,arms=a+b+c+e,ablation=false"


def summary(planned, middle, seed_effect):
    """A finished run's summary: the middle rate is best on validation; arm b
    is 0.01 bits/char worse than a on test, c 0.02, e 0.005."""
    test = 2.0 + {"a": 0.0, "b": 0.01, "c": 0.02, "e": 0.005}[planned.cell.arm]
    test += seed_effect
    return {
        "num_params": shapes.count_params(
            planned.cell.vocab_size, planned.cell.shape, shapes.Architecture(2, 16)
        ),
        "best_step": 40,
        "steps_run": 60 if planned.seed == 1 else 50,
        "stopped_early": planned.seed != 1,
        "wall_seconds": 12.5,
        "best": {
            "eval/loss": 3.0 + abs(np.log(planned.lr / middle)),
            "eval/bits_per_char": test + 0.1,
        },
        "train_at_best": {"train_eval/bits_per_char": test - 0.3},
        "heldout_at_best": {"heldout/bits_per_char": test - 0.1},
        "test": {
            "bits_per_char": test,
            "word_perplexity": 100.0 + test,
            "words": 1000.0,
            "num_chars": 5000.0,
            "loss": 1.0,
        },
        "ensemble": {"program": f"/somewhere/ensembles/p{planned.cell.arm}"},
    }


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """``(design, sweep dir, planned runs)``: every tuning and test run finished."""
    design = study_module().get_study(ARG)
    sweep_dir = tmp_path_factory.mktemp("sweep")
    tuning = design.tuning_runs()
    middle = design.rates(design.cells()[0])[1]
    chosen = dict.fromkeys(design.cells(study.TUNED_ARMS), middle)
    for runs in (tuning, None):
        if runs is None:  # the test stage, planned from the tuning results
            runs = design.test_runs(chosen, study.read_tuning(design, str(sweep_dir)))
        for planned, name in zip(runs, design.names(runs)):
            workdir = sweep_dir / name
            workdir.mkdir()
            (workdir / "summary.json").write_text(
                json.dumps(summary(planned, middle, 0.001 * planned.seed))
            )
            np.savez(workdir / "tokens.npz", train=np.zeros(321, np.int32))
            (workdir / "versions.json").write_text(json.dumps({"jax": "0.1"}))
    return design, sweep_dir, runs


def test_rows_hold_each_runs_design_and_measurements(sweep):
    design, sweep_dir, test_runs = sweep
    rows = results.collect_rows(design, str(sweep_dir))
    assert len(rows) == len(design.tuning_runs()) + len(test_runs)
    test = [r for r in rows if r["role"] == "test"]
    tiny = configuration.load_config("tiny")
    assert {r["arm"] for r in test} == {"a", "b", "c", "e"}
    assert {r["seed"] for r in test} == {0, 1}
    for r in rows:
        table.check_row(r)
        assert r["status"] == "finished" and r["vocab"] == "300"
        assert r["offset"] == study.SUBSET_OFFSETS[r["seed"] % 2]
        assert r["gap_bpc"] == pytest.approx(0.2)  # heldout - train
        assert r["reached_cap"] is (r["seed"] == 1)
        assert r["train_tokens"] == 321
        assert r["tokens_per_param"] == pytest.approx(321 / r["params"])
        assert r["ensemble"] == f"p{r['arm']}" and r["versions"] == "jax=0.1"
        assert r["test_chars"] == 5000 and r["steps_cap"] == 60
        assert r["step_tokens"] == tiny.train.batch_size * tiny.data.block_size
    a = next(r for r in test if r["arm"] == "a" and r["seed"] == 0)
    assert a["head_share"] == pytest.approx(300 * 32 / a["params"])
    assert a["flops_per_token"] == shapes.flops_per_token(
        300, shapes.Shape(True, 32, 1, 64), design.arch
    )
    e = next(r for r in test if r["arm"] == "e")
    assert e["untie_step"] == round(2 / 3 * 40) and e["lr"] == a["lr"]
    # The characters of the subset, held-out chunks removed, as a run cuts them.
    from lmhead.lm import data

    config = configuration.load_config("tiny")
    config.data.update(
        {**{k[5:]: v for k, v in design.shared.items() if k[:5] == "data."}}
    )
    config.data.update(train_fraction=0.2, train_offset=0.5)
    second = next(r for r in test if r["seed"] == 1)
    assert second["train_chars"] == len(data.read_splits(config.data).train)


def test_without_tuning_the_rows_are_the_test_runs(tmp_path):
    """The small preset (no tuning stage): its rows are its test runs, at the
    one rate, not tuning runs that never start."""
    design = study_module().get_study("small")
    runs = design.test_runs(study.choose_learning_rates(design, {}), {})
    for name in design.names(runs):
        (tmp_path / name).mkdir()
    rows = results.collect_rows(design, str(tmp_path))
    assert [r["run"] for r in rows] == design.names(runs)
    assert {r["role"] for r in rows} == {"test"} and len(rows) == 3 * 8
    assert tuning_text.tuning_section(rows).endswith(
        f"every run trained at {rows[0]['lr']:.3g}, chosen before the runs, not "
        "on their results."
    )


def test_a_fresh_sweep_directory_resumes_from_the_committed_table(sweep, tmp_path):
    """The finished runs of runs.csv, restored through the sweep file into an
    empty directory, plan the same runs (the chosen rates and arm e's untie
    step come from them), count as finished for the runner, and give back
    the same rows; an unfinished row is left to train, and a run finished
    here keeps its own summary."""
    design, sweep_dir, _ = sweep
    rows = results.collect_rows(design, str(sweep_dir))
    rows[-1] = rows[-1] | {"status": "unfinished"}
    csv_path = tmp_path / results.RUNS_CSV
    table.write_rows(csv_path, rows)
    fresh = tmp_path / "fresh"
    kept = fresh / rows[0]["run"]
    kept.mkdir(parents=True)
    (kept / "summary.json").write_text(json.dumps({"best": {"eval/loss": 3.0}}))

    restored = sweeps.restore_runs(f"{STUDY}:{ARG}", str(csv_path), str(fresh))

    assert restored == [r["run"] for r in rows[1:-1]]
    assert json.loads((kept / "summary.json").read_text()) == {
        "best": {"eval/loss": 3.0}
    }
    original = study.read_plan(design, str(sweep_dir))
    again = study.read_plan(design, str(fresh), strict=False)
    assert list(again) == list(original)
    assert [r["run"] for r in results.collect_rows(design, str(fresh))[1:-1]] == [
        r["run"] for r in rows[1:-1]
    ]
    assert results.collect_rows(design, str(fresh))[1:-1] == rows[1:-1]
    planned = runner.Sweep(f"{STUDY}:{ARG},stage=test", str(fresh), "train.py")
    assert [run["name"] for run in planned.plan_jobs()[1]] == [rows[-1]["run"]]
    # The restored runs' programs keep their names from new programs.
    reserved = ensembles.read_assignment(str(fresh))
    assert {r["ensemble"] for r in rows[1:-1]} == set(reserved)
    assert sorted(run for p in reserved.values() for run in p) == sorted(restored)


def test_a_run_without_its_best_steps_training_numbers_has_none(sweep):
    """train_bpc and gap_bpc come from the best validation step's records
    only; a summary without ``train_at_best`` leaves them empty rather than
    reading its last step's (``final``)."""
    design, sweep_dir, _ = sweep
    rows = results.collect_rows(design, str(sweep_dir))
    workdir = sweep_dir / rows[1]["run"]
    kept = (workdir / "summary.json").read_text()
    changed = json.loads(kept)
    changed["final"] = changed.pop("train_at_best") | {"eval/loss": 0.5}
    try:
        (workdir / "summary.json").write_text(json.dumps(changed))
        again = results.collect_rows(design, str(sweep_dir))[1]
    finally:
        (workdir / "summary.json").write_text(kept)
    assert again["train_bpc"] is None and again["gap_bpc"] is None
    assert again["val_loss"] == rows[1]["val_loss"] != 0.5
    assert again == rows[1] | {"train_bpc": None, "gap_bpc": None}


def test_a_row_restored_before_a_design_column_existed_gets_the_designs(sweep):
    """A run restored from an older table (its summary's row lacks
    eval_every and step_tokens) reads back with the design's values."""
    design, sweep_dir, _ = sweep
    rows = results.collect_rows(design, str(sweep_dir))
    older = {k: v for k, v in rows[2].items() if k not in ("eval_every", "step_tokens")}
    workdir = sweep_dir / rows[2]["run"]
    kept = (workdir / "summary.json").read_text()
    try:
        (workdir / "summary.json").write_text(
            json.dumps(results.restored_summary(older))
        )
        again = results.collect_rows(design, str(sweep_dir))[2]
    finally:
        (workdir / "summary.json").write_text(kept)
    tiny = configuration.load_config("tiny")
    assert again["eval_every"] == design.shared["train.eval_every"]
    assert again["step_tokens"] == tiny.train.batch_size * tiny.data.block_size
    assert again == rows[2]
    # A value of another design is refused, not kept or overwritten.
    other = rows[2] | {"step_tokens": 2 * rows[2]["step_tokens"]}
    try:
        (workdir / "summary.json").write_text(
            json.dumps(results.restored_summary(other))
        )
        with pytest.raises(ValueError, match="another design.*step_tokens"):
            results.collect_rows(design, str(sweep_dir))
    finally:
        (workdir / "summary.json").write_text(kept)


def test_a_restored_row_must_be_the_run_planned_under_its_name(sweep, tmp_path):
    design, sweep_dir, _ = sweep
    rows = results.collect_rows(design, str(sweep_dir))
    rows[3] = rows[3] | {"lr": 2 * rows[3]["lr"], "wall_seconds": None}
    table.write_rows(tmp_path / results.RUNS_CSV, rows)
    fresh = tmp_path / "fresh"
    results.restore_runs(str(tmp_path / results.RUNS_CSV), str(fresh))
    summary = json.loads((fresh / rows[3]["run"] / "summary.json").read_text())
    assert "wall_seconds" not in summary  # an empty cell is no value
    with pytest.raises(ValueError, match=f"Run {re.escape(rows[3]['run'])} .*'lr'"):
        results.collect_rows(design, str(fresh))


def test_the_sweep_command_restores_from_several_tables_in_order(sweep, tmp_path):
    """``--restore_from`` twice (the study's table, then a check's own): the
    runs of both are restored, a run in both keeps the first table's row, and
    nothing is left to train."""
    design, sweep_dir, _ = sweep
    rows = results.collect_rows(design, str(sweep_dir))
    tuning = [r for r in rows if r["role"] == "tune"]
    test = [r for r in rows if r["role"] == "test"]
    first, second = tmp_path / "first.csv", tmp_path / "second.csv"
    table.write_rows(first, tuning)
    table.write_rows(second, [tuning[0] | {"val_loss": 9.0}] + test)
    fresh = tmp_path / "fresh"
    result = run_experiment(
        "sweep.py",
        f"--sweep={STUDY}:{ARG}",
        f"--workdir={fresh}",
        f"--restore_from={first}",
        f"--restore_from={second}",
        "--dry_run",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        f"Restored {len(tuning)} finished runs from {first}.",
        f"Restored {len(test)} finished runs from {second}.",
    ]
    assert results.collect_rows(design, str(fresh)) == rows


def test_restoring_needs_a_table_and_a_sweep_file_that_can(tmp_path):
    with pytest.raises(FileNotFoundError, match="table of runs"):
        sweeps.restore_runs(STUDY, str(tmp_path / "none.csv"), str(tmp_path))
    (tmp_path / "runs.csv").write_text("")
    other = os.path.join(SWEEP_CONFIGS, "filter_training.py")
    with pytest.raises(ValueError, match="no restore_runs"):
        sweeps.restore_runs(other, str(tmp_path / "runs.csv"), str(tmp_path))
    row = dict.fromkeys(table.COLUMNS) | {
        "role": "tune",
        "arm": "a",
        "status": "finished",
        "run": "../elsewhere",
    }
    table.write_rows(tmp_path / "bad.csv", [row])
    with pytest.raises(ValueError, match="not a directory name"):
        results.restore_runs(str(tmp_path / "bad.csv"), str(tmp_path))


@pytest.mark.parametrize(
    "folder", ["docs/tying_study", "docs/tying_study/edges", "docs/compare"]
)
def test_the_committed_reports_are_what_their_csv_gives_today(folder, tmp_path):
    """A change to the report's code rewrites the committed reports with it:
    each committed REPORT.md and its plots are what ``report_from_csv`` gives,
    byte for byte, from the committed runs.csv beside it."""
    folder = os.path.join(ROOT, folder)
    text, plots = results.report_from_csv(
        os.path.join(folder, results.RUNS_CSV), str(tmp_path)
    )
    with open(os.path.join(folder, "REPORT.md"), encoding="utf-8") as f:
        assert text == f.read()
    assert len(plots) == 2
    for plot in plots:
        with open(os.path.join(folder, os.path.basename(plot)), "rb") as f:
            assert open(plot, "rb").read() == f.read(), plot
