"""The decoding benchmark, experiments/bench/bench_decode.py --quick: its
table of decoders x batch sizes x cache capacities, and the new-knobs and
streaming rows against plain greedy, and the whole-batch loop against the
loop per device on two CPU devices (slow)."""

import re

import pytest

from tests.experiments.bench.commands import run_bench


@pytest.mark.slow
def test_bench_decode_quick_table():
    stdout = run_bench("bench_decode.py", "--quick", "--cpu_devices=2")
    assert re.search(r"float32 matmul \d+ GFLOP/s", stdout)
    rows = re.findall(
        r"^\| (greedy|top-p|beam 4) \| (\d+) \| (\d+) \| 8 \| \d+ \| "
        r"(\S+) \| (\S+)x \|$",
        stdout,
        re.M,
    )
    assert len(rows) == 3 * 2 * 2  # decoders x batch sizes 1, 4 x max_len 64, 128
    for _, _, max_len, ms, ratio in rows:
        assert float(ms) > 0 and (max_len != "64" or ratio == "1.00")
    knobs = re.findall(
        r"^\| (new knobs|stream k=\d+|whole-batch loop) \| 4 \| 64 \| (\S+) \| "
        r"(\S+)x \|$",
        stdout,
        re.M,
    )
    assert [name for name, _, _ in knobs] == [
        "new knobs",
        "stream k=1",
        "stream k=4",
        "stream k=16",
        "whole-batch loop",
    ]
    assert all(float(ms) > 0 and float(ratio) > 0 for _, ms, ratio in knobs)
