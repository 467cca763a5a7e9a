"""Runs a benchmark of experiments/bench/ as a command, from the repository's
root, for the benchmarks' slow tests."""

from tests import run_experiment


def run_bench(script, *args):
    """The stdout of ``python experiments/bench/<script> <args>``; it must succeed."""
    result = run_experiment(f"bench/{script}", *args, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
