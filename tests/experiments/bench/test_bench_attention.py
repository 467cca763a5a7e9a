"""The attention benchmark, experiments/bench/bench_attention.py --quick: the
model's XLA attention against jax.nn.dot_product_attention's, in both dtypes
(slow)."""

import jax
import pytest

from tests.experiments.bench.commands import run_bench


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU adds the cuDNN rows")
def test_bench_attention_quick_table():
    stdout = run_bench("bench_attention.py", "--quick")
    assert "B 1, T 64, H 2, Dh 64" in stdout and "GFLOP/s" in stdout
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in stdout.splitlines()
        if line.startswith(("| float32", "| bfloat16"))
    ]
    # No GPU here: no cuDNN row.
    assert [row[:2] for row in rows] == [
        ["float32", "xla"],
        ["float32", "jax xla"],
        ["bfloat16", "xla"],
        ["bfloat16", "jax xla"],
    ]
    for row in rows:
        milliseconds, ratio, difference = (
            float(row[2]),
            float(row[3][:-1]),
            float(row[4]),
        )
        assert milliseconds > 0 and ratio > 0
        assert difference <= (1e-6 if row[0] == "float32" else 1e-2)
