"""The head benchmark, experiments/bench/bench_head.py --quick: fused vs
materialized at two small shapes, and --quantized's speed and accuracy
tables on random tables (slow)."""

import re

import pytest

from tests.experiments.bench.commands import run_bench


@pytest.mark.slow
def test_bench_head_quick_table():
    stdout = run_bench("bench_head.py", "--quick")
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in stdout.splitlines()
        if re.match(r"\| \d", line)
    ]
    assert [row[:3] for row in rows] == [["512", "64", "1024"], ["1000", "96", "3000"]]
    for row in rows:
        fused, materialized, ratio = (float(x) for x in row[3:6])
        assert fused > 0 and materialized > 0
        assert ratio == pytest.approx(fused / materialized, rel=0.02, abs=0.02)
        assert float(row[11]) > 0  # the matmul's GFLOP/s, measured in the run


@pytest.mark.slow
def test_bench_head_quantized_quick_tables():
    stdout = run_bench("bench_head.py", "--quantized", "--quick")
    speed = re.findall(r"^\| (\d+) \| 64 \| (\d+) \| (\w+) \| .*\|$", stdout, re.M)
    assert len(speed) == 2 * 2 * 4  # V 4096, 8192 x B 1, 8 x four tables
    accuracy = re.findall(
        r"^\| random-normal, not trained \| (\d+) \| 64 \| 512 \| (\w+) \| (\S+) "
        r"\| (\S+)% \| (\S+) \|$",
        stdout,
        re.M,
    )
    assert len(accuracy) == 2 * 3  # V 4096, 8192 x the three smaller tables
    for _, _, bytes_ratio, agreement, kl in accuracy:
        assert 0 < float(bytes_ratio) < 1 and 0 <= float(agreement) <= 100
        assert float(kl) >= 0


@pytest.mark.slow
def test_bench_head_skipping_and_entropy_table():
    stdout = run_bench(
        "bench_head.py", "--quick", "--zero_fraction=0.5,0.9", "--entropy"
    )
    rows = re.findall(
        r"^\| 512 \| 64 \| 1024 \| ([^|]+) \| (\d+) \| (\S+) \| (\S+) \| \d+ \|$",
        stdout,
        re.M,
    )
    names = [name for name, *_ in rows]
    assert names == [
        "fused fwd+bwd, all weighted",
        "fused fwd+bwd, 50% weight 0",
        "fused fwd+bwd, 90% weight 0",
        "fused fwd",
        "fused fwd + entropy",
    ]
    assert [int(zeros) for _, zeros, *_ in rows] == [0, 256, 461, 0, 0]
    assert float(rows[0][3]) == 1.0 and float(rows[3][3]) == 1.0
    assert all(float(seconds) > 0 for _, _, seconds, _ in rows)


@pytest.mark.slow
def test_bench_head_distillation_tables():
    stdout = run_bench("bench_head.py", "--quick", "--distillation=forward_kl,jsd")
    assert stdout.count("Distillation, ") == 2
    rows = re.findall(
        r"^\| 512 \| 64 \| 1024 \| (\S+) \| (\S+) \| (\S+) \|", stdout, re.M
    )
    assert len(rows) == 2
    for fused, materialized, ratio in rows:
        assert float(ratio) == pytest.approx(
            float(fused) / float(materialized), rel=0.02, abs=0.02
        )


@pytest.mark.slow
def test_bench_head_post_training_tables():
    """DPO and GRPO, fused and materialized, at the first quick shape: the
    ratio is that of the two times, and the fused one needs less memory."""
    stdout = run_bench("bench_head.py", "--quick", "--post_training=dpo,grpo")
    assert stdout.count("Post-training, ") == 2
    rows = re.findall(
        r"^\| 512 \| 64 \| 1024 \| (\S+) \| (\S+) \| (\S+) \| (\S+) MiB \| "
        r"(\S+) MiB \|",
        stdout,
        re.M,
    )
    assert len(rows) == 2
    for fused, materialized, ratio, fused_temp, materialized_temp in rows:
        assert float(ratio) == pytest.approx(
            float(fused) / float(materialized), rel=0.02, abs=0.02
        )
        assert float(fused_temp) < float(materialized_temp)


@pytest.mark.slow
def test_bench_head_preset_table_at_a_small_shape():
    """The gemma2 preset's code path at a small shape; without torch and a
    CUDA device the peers are named as not timed."""
    stdout = run_bench(
        "bench_head.py", "--preset=gemma2", "--shapes=256,64,4096", "--repeats=1"
    )
    rows = re.findall(
        r"^\| (fused|materialized) \| (\S+) \| (\S+) \| (\S+) \| .* \| (\S+) \|$",
        stdout,
        re.M,
    )
    assert [row[0] for row in rows] == ["fused", "materialized"]
    assert rows[0][3] == "1.00"
    assert rows[0][4] == rows[1][4]  # the same loss, to 4 decimals
    assert "Liger" in stdout and "CCE" in stdout


@pytest.mark.slow
def test_bench_head_filter_and_accumulation_tables():
    """--filter_eps: the exact row first, each ratio that of the times, the
    bound that of the fraction skipped; --dw_accumulation: each mode's error
    against float64."""
    stdout = run_bench("bench_head.py", "--quick", "--filter_eps=auto,1", "--peaked")
    rows = re.findall(
        r"^\| 512 \| 64 \| 1024 \| peaked \(synthetic\) \| ([^|]+) \| (\S+)% \| "
        r"(\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| \d+ \|$",
        stdout,
        re.M,
    )
    assert [row[0].split()[0] for row in rows] == ["exact", "auto", "1.0"]
    exact_seconds = float(rows[0][3])
    for _, skipped, bound, seconds, ratio, _, dh_error, dw_error in rows:
        f = float(skipped) / 100
        assert float(bound) == pytest.approx(1 / 3 + 2 / 3 * (1 - f), abs=0.01)
        assert float(ratio) == pytest.approx(
            float(seconds) / exact_seconds, rel=0.02, abs=0.02
        )
        assert float(dh_error) >= 0 and float(dw_error) >= 0
    assert float(rows[0][1]) == 0 and float(rows[2][1]) > 0  # 1 skips the tile
    stdout = run_bench("bench_head.py", "--quick", "--dw_accumulation")
    modes = re.findall(
        r"^\| 512 \| 64 \| 1024 \| float32 \| (\w+) \| (\S+) \|", stdout, re.M
    )
    assert [mode for mode, _ in modes] == ["float32", "kahan", "input_dtype"]
    assert all(float(error) < 1e-4 for _, error in modes)
