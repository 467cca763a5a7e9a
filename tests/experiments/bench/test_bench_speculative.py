"""The speculative decoding benchmark, experiments/bench/bench_speculative.py
--quick: its table of proposers against plain decoding, on a random tiny
model with MTP heads and GPT-2 small's layout (two layers), every greedy row
with plain greedy's tokens."""

import re

import pytest

from tests.experiments.bench.commands import run_bench


@pytest.mark.slow
def test_bench_speculative_quick_table():
    stdout = run_bench("bench_speculative.py", "--quick", "--gpt2")
    rows = re.findall(
        r"^\| (tiny, random|GPT-2 small layout, random) \| (plain|repetitive) \| "
        r"(\d+) \| (greedy|T=1) \| (mtp|ngram) \| \S+ \| \S+ \| (\S+)x \| (\S+) \| "
        r"([\d. ]+) \| (yes|NO|) \|$",
        stdout,
        re.M,
    )
    # tiny: 2 proposers; GPT-2: n-gram only; x 2 prompts x 2 batches x 2 decoders
    assert len(rows) == (2 + 1) * 2 * 2 * 2, stdout
    for _, _, _, decoder, proposer, ratio, per_call, acceptance, same in rows:
        assert float(ratio) > 0 and float(per_call) >= 1.0
        depths = 2 if proposer == "mtp" else 4
        assert len(acceptance.split()) == depths
        assert same == ("yes" if decoder == "greedy" else "")
