"""The service benchmark, experiments/bench/bench_serve.py --quick: a row per
client count (slow)."""

import re

import pytest

from tests.experiments.bench.commands import run_bench


@pytest.mark.slow
def test_bench_serve_quick_table():
    """Trains a tiny run, serves it on loopback, and prints a row per client count."""
    stdout = run_bench("bench_serve.py", "--quick")
    assert re.search(r"float32 matmul \d+ GFLOP/s", stdout)
    rows = re.findall(
        r"^\| (\d+) \| (\S+) \| (\S+) \| (\d+) \| (\S+)x \| (\S+) \|$", stdout, re.M
    )
    assert [r[0] for r in rows] == ["1", "4", "16"] and rows[0][4] == "1.00"
    assert all(float(p50) <= float(p99) for _, p50, p99, *_ in rows)
