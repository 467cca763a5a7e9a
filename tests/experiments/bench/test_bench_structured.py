"""The structured-output benchmark, experiments/bench/bench_structured.py
--quick: its table, every vocabulary's row with no compile across new
constraints and every ended sample valid (slow: it imports a checkpoint)."""

import re

import pytest

from tests.experiments.bench.commands import run_bench


@pytest.mark.slow
def test_bench_structured_quick():
    stdout = run_bench("bench_structured.py", "--quick")
    rows = re.findall(r"^\| (characters|BPE|GPT-2 layout) \| (\d+) \|.*\| (\d+) \| (\d+)/(\d+) \|$",
                      stdout, re.M)  # fmt: skip
    assert [(name, int(v)) for name, v, *_ in rows] == [
        ("characters", 85), ("BPE", 2048), ("GPT-2 layout", 50257)
    ], stdout  # fmt: skip
    for _, _, compiles, valid, ended in rows:
        assert compiles == "0" and valid == ended
