"""Runs a benchmark of experiments/bench/ as a command, from the repository's
root, for the benchmarks' slow tests."""

import os
import subprocess
import sys

from tests import ROOT


def run_bench(script, *args):
    """The stdout of ``python experiments/bench/<script> <args>``; it must succeed."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "bench", script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
