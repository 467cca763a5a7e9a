"""The training benchmark, experiments/bench/bench_train.py, on the tiny
config: its lines per device count and its --profile tables (slow)."""

import re

import pytest

from tests.experiments.bench.commands import run_bench


@pytest.mark.slow
def test_bench_train_times_each_device_count():
    stdout = run_bench(
        "bench_train.py", "--quick", "--config=tiny", "--devices=1", "--devices=2"
    )
    assert "nanoGPT skipped: no --nanogpt checkout" in stdout
    assert "lmhead fused, 1 device " in stdout
    assert "lmhead fused, 2 devices " in stdout
    assert "tokens/s" in stdout and "GFLOP/s" in stdout


@pytest.mark.slow
def test_bench_train_profile_tables():
    """nanogpt,tiny: the tiny model with nanoGPT's 2 microbatches, whose
    loop runs every dot of the gradient twice."""
    stdout = run_bench(
        "bench_train.py", "--quick", "--config=nanogpt,tiny", "--devices=1", "--profile"
    )
    step = float(re.search(r"lmhead fused, 1 device +(\S+) ms/step", stdout)[1])
    stages = dict(
        re.findall(
            r"^\| (forward \+ backward|forward|train step|"
            r"backward|optimizer)\b.*? \| (\S+) \| \S+ \| "
            r"-?\d+% \|$",
            stdout,
            re.M,
        )
    )
    assert len(stages) == 5 and float(stages["train step"]) == step
    assert all(float(stages[s]) > 0 for s in ("forward", "forward + backward"))
    dots = re.findall(
        r"^\| (f32\[.*?\)) \| (\d+) \| (\S+) \| (\S+) \| (\S+) "
        r"\| (\S+) \|$",
        stdout,
        re.M,
    )
    assert dots and len(set(dot[0] for dot in dots)) == len(dots)
    assert all(int(count) % 2 == 0 for _, count, *_ in dots)
    assert all(float(x) > 0 for dot in dots for x in dot[2:])
    total = sum(int(count) for _, count, *_ in dots)
    assert re.search(
        rf"^  {total} dots per step, \S+ GFLOP: \S+ ms at their "
        r"own shapes",
        stdout,
        re.M,
    )
    summary = re.search(
        r"matmuls at this step's own shapes: (\S+) ms of the "
        r"step's (\S+) ms \((\d+)%\)",
        stdout,
    )
    assert summary and float(summary[2]) == step
    assert float(summary[1]) == pytest.approx(
        sum(float(dot[4]) for dot in dots), abs=0.01 * len(dots)
    )
