"""The import benchmark, experiments/bench/bench_import_gpt2.py --quick: a
random checkpoint imported, loaded, and its int8 head measured (slow)."""

import re

import pytest

from tests.experiments.bench.commands import run_bench


@pytest.mark.slow
def test_bench_import_gpt2_quick():
    stdout = run_bench("bench_import_gpt2.py", "--quick")
    assert re.search(r"^import: [\d.]+ s$", stdout, re.M)
    match = re.search(
        r"int8 ([\d.]+) MiB \(([\d.]+) x\); int8 top-1 agreement ([\d.]+)% over "
        r"512 positions",
        stdout,
    )
    assert match, stdout
    # (D + 4) / 4D of float32's bytes at D = 64, and an argmax mostly kept.
    assert float(match[2]) == pytest.approx(68 / 256, abs=1e-3)
    assert 80 <= float(match[3]) <= 100
