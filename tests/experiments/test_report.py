"""Tests for experiments/report.py, the report command: what it prints, that
--restore_from rewrites a committed report from its table, and what it
refuses (the reports themselves are tested in
tests/studies/tying/test_analysis.py; the committed reports rebuilt from
their runs.csv, byte for byte, in tests/studies/tying/test_results.py)."""

import os

import pytest

from tests import ROOT, run_experiment

COMPARE = os.path.join(ROOT, "docs", "compare")
STUDY = os.path.join(ROOT, "configs", "sweeps", "tying_study.py")


def test_a_sweep_file_without_a_report_is_refused_by_name(tmp_path):
    (tmp_path / "plain.py").write_text("def get_sweep(arg=None):\n    pass\n")
    result = run_experiment(
        "report.py", f"--workdir={tmp_path}", f"--sweep={tmp_path}/plain.py"
    )
    assert result.returncode == 1
    assert "plain.py defines no write_report" in result.stderr


def test_a_committed_report_is_rewritten_from_its_table_alone(tmp_path):
    """--restore_from recreates the table's finished runs in an empty sweep
    directory, and the report written from them is the committed one."""
    out = tmp_path / "out"
    result = run_experiment(
        "report.py",
        f"--workdir={tmp_path / 'runs'}",
        f"--sweep={STUDY}:small",
        f"--restore_from={os.path.join(COMPARE, 'runs.csv')}",
        f"--out={out}",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Restored 24 finished runs from" in result.stdout  # its 24 rows
    assert "b − a" in result.stdout and f"Report: {out / 'REPORT.md'}" in result.stdout
    for name in ("runs.csv", "REPORT.md"):
        with open(os.path.join(COMPARE, name), encoding="utf-8") as f:
            assert (out / name).read_text() == f.read(), name


@pytest.mark.parametrize(
    "argument, error",
    [
        ("extra", "Unexpected arguments"),
        (f"--restore_from={os.path.join(COMPARE, 'runs.csv')}", "needs --sweep"),
    ],
)
def test_bad_command_lines_are_refused(tmp_path, argument, error):
    result = run_experiment("report.py", f"--workdir={tmp_path}", argument, timeout=120)
    assert result.returncode != 0 and error in result.stderr
