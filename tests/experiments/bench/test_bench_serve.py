"""The service benchmark, experiments/bench/bench_serve.py --quick: a row per
client count, and the streamed load's row (slow)."""

import re

import pytest

from tests.experiments.bench.commands import run_bench


@pytest.mark.slow
def test_bench_serve_quick_table():
    """Trains a tiny run, serves it on loopback, and prints a row per client count."""
    stdout = run_bench("bench_serve.py", "--quick")
    assert re.search(r"float32 matmul \d+ GFLOP/s", stdout)
    rows = re.findall(
        r"^\| (\d+) \| (\S+) \| (\S+) \| (\d+) \| (\S+)x \|$", stdout, re.M
    )
    assert [r[0] for r in rows] == ["1", "4", "16"] and rows[0][4] == "1.00"
    assert all(float(p50) <= float(p99) for _, p50, p99, *_ in rows)


@pytest.mark.slow
def test_bench_serve_streamed_row():
    """Streamed completions of mixed lengths, with start-up times."""
    stdout = run_bench(
        "bench_serve.py", "--quick", "--streamed", "--requests=24",
        "--clients=4", "--max_tokens=32",
    )  # fmt: skip
    rows = re.findall(
        r"^\| (\d+) \| (\S+) \| (\S+) \| (\S+) \| "
        r"(\S+) / (\S+) \| (\S+) / (\S+) \|$",
        stdout,
        re.M,
    )
    assert len(rows) == 1
    tokens, p50, p99, _, first50, first99, cold, warm = rows[0]
    assert int(tokens) > 0 and float(p50) <= float(p99)
    assert float(first50) <= float(first99) and float(cold) > 0 < float(warm)
