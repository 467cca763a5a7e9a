"""Tests for experiments/report.py, the report command: what it prints (the
reports themselves are tested in tests/lab/test_report.py and
tests/studies/tying/test_analysis.py; the committed reports rebuilt from
their runs.csv, byte for byte, in tests/studies/tying/test_results.py)."""

from tests import run_experiment
from tests.lab import synthetic_sweep


def test_the_command_prints_the_table_and_the_paths(tmp_path):
    sweep_dir = synthetic_sweep.write_sweep(tmp_path)
    result = run_experiment("report.py", f"--workdir={sweep_dir}", timeout=120)
    assert result.returncode == 0, result.stderr
    stdout = result.stdout
    assert stdout.startswith("| head | vocabulary |")
    assert f"\n\nReport: {sweep_dir / 'REPORT.md'}\n" in stdout
    for name in ("loss_curves.png", "loss_vs_vocab.png", "loss_vs_params.png"):
        assert f"Plot:   {sweep_dir / name}" in stdout


def test_unexpected_arguments_are_refused(tmp_path):
    result = run_experiment("report.py", f"--workdir={tmp_path}", "extra", timeout=120)
    assert result.returncode != 0 and "Unexpected arguments" in result.stderr
