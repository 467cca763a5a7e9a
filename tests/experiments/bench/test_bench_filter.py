"""The filtering benchmark on a trained model, experiments/bench/bench_filter.py
--quick: it trains the tiny run, then measures it again from its workdir (slow)."""

import re

import pytest

from tests.experiments.bench.commands import run_bench

ROW = (
    r"^\| (\w+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([^|]+) \| (\w+) \| "
    r"(\S+)% \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| "
    r"(\S+) \|$"
)


def rows(stdout):
    return re.findall(ROW, stdout, re.M)


@pytest.mark.slow
def test_bench_filter_trains_a_run_then_measures_its_hidden_states(tmp_path):
    workdir = str(tmp_path / "tiny_bpe")
    flags = (
        f"--workdir={workdir}",
        "--filter_eps=auto,1",
        "--block_rows=64",
        "--vocab_order=frequency",
    )
    first = rows(run_bench("bench_filter.py", "--quick", "--vocab_size=300", *flags))
    # The engine's default blocks, then 64-row ones; exact first in each,
    # each filter in the table's order and sorted by frequency.
    default = first[0][5]
    assert [(r[5], r[6].split()[0], r[7]) for r in first] == [
        (rows_, eps, order)
        for rows_ in (default, "64")
        for eps in ("exact", "auto", "1.0")
        for order in ("table", "frequency")
    ]
    for i, row in enumerate(first):
        skipped, bound, seconds, ratio, _, cpu, cpu_ratio, dh_error, dw_error = row[8:]
        exact = first[i // 6 * 6]
        f = float(skipped) / 100
        assert float(bound) == pytest.approx(1 / 3 + 2 / 3 * (1 - f), abs=0.01)
        for value, ratio_, reference in ((seconds, ratio, 10), (cpu, cpu_ratio, 13)):
            assert float(ratio_) == pytest.approx(
                float(value) / float(exact[reference]), rel=0.02, abs=0.02
            )
        assert float(dh_error) >= 0 and float(dw_error) >= 0
    for row in (first[0], first[6]):
        assert row[8] == "0.0" and row[15] == row[16] == "0.0e+00"
    # Sorted, the exact gradient is the same up to float32 rounding.
    for row in (first[1], first[7]):
        assert row[8] == "0.0" and float(row[15]) < 1e-5 and float(row[16]) < 1e-5
    # filter_eps = 1 is above every |p - onehot| but that of a label of
    # probability 0: tiles are skipped.
    assert float(first[4][8]) > 0 and float(first[10][8]) > 0
    # A finished run is read back, not trained again: the same fractions.
    second = rows(run_bench("bench_filter.py", "--quick", *flags))
    assert [r[8] for r in second] == [r[8] for r in first]
