"""The ensemble benchmark, experiments/bench/bench_ensemble.py: its quick
member-steps table (whose last column checks that every form computes the
separate steps' parameters), separate steps against a single run, the study
slice's commands, and (slow) the GPU preset and runs per hour on a CPU."""

import doctest
import functools
import json
import os
import re
import sys

import jax
import pytest

from lmhead.lm import configuration, data, train
from lmhead.lm import state as state_lib
from studies.tying import study
from tests import ROOT
from tests.experiments.bench.commands import run_bench

BENCH_DIR = os.path.join(ROOT, "experiments", "bench")
# The largest parameter difference allowed between programs after the same
# few steps: float32 rounding of reductions in another order.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def bench():
    """bench_ensemble.py as a module (its flags defined once per session)."""
    sys.path.insert(0, BENCH_DIR)  # its imports of timing and ensemble_runs
    try:
        yield configuration.load_module(os.path.join(BENCH_DIR, "bench_ensemble.py"))
    finally:
        sys.path.remove(BENCH_DIR)


def table_rows(stdout: str, shape: str) -> list[tuple[str, ...]]:
    """``(M, form, ms, CPU ms, member-steps/s, ratio, difference)`` per row."""
    cell = r" \| ([^|]+?)"
    return re.findall(rf"^\| {re.escape(shape)}{cell * 7} \|$", stdout, re.M)


def test_doctests(bench):
    for module in (bench, bench.ensemble_runs):
        assert doctest.testmod(module).failed == 0


@pytest.mark.slow
def test_quick_table_times_equivalent_programs(bench, capsys):
    """Separate steps, a lax.map and a vmap over M = 2 members, each at the
    same parameters after the same steps."""
    bench.member_steps(bench.QUICK)
    stdout = capsys.readouterr().out
    assert re.search(
        r"V=85, 128 tokens per member-step; float32 matmul \S+ GFLOP/s", stdout
    )
    rows = table_rows(stdout, "tiny")
    assert [row[:2] for row in rows] == [
        ("2", "separate steps"),
        ("2", "lax.map"),
        ("2", "vmap"),
    ]
    separate_ms = float(rows[0][2])
    for members, _, ms, cpu_ms, rate, ratio, difference in rows:
        assert float(ms) > 0 and float(cpu_ms) > 0
        assert float(rate) == pytest.approx(int(members) * 1e3 / float(ms), rel=0.02)
        assert float(ratio) == pytest.approx(separate_ms / float(ms), abs=0.01)
        assert float(difference) <= TOLERANCE
    assert rows[0][5] == "1.00" and float(rows[0][6]) == 0
    assert re.search(
        r"tiny M=2: fastest (lax\.map|vmap), \S+x separate "
        r"steps; the default on cpu: vmap_size=1 \(lax\.map\)(: the measurement "
        r"agrees|, \S+x: the measurement disagrees)",
        stdout,
    )


@pytest.mark.slow
def test_separate_steps_are_single_runs(bench, corpus):
    """Member 1 of the separate steps (seed 1, its own learning rates as
    arguments) against train.train_step of a single run with those values as
    constants, from the single run's initial parameters (up to
    rounding: the members' are initialised under vmap), on its batches and
    dropout key."""
    shape = bench.load_shape("tiny", {"data.path": corpus})
    members = bench.make_members(shape, 2, steps=3)
    separate = bench.separate_program(members, bench.compile_single_run_step(shape))
    separate()
    config = shape.config.copy_and_resolve_references()
    config.train.seed = 1
    config.optim.lr = float(members.values["optim.lr"][1])
    config.optim.min_lr = float(members.values["optim.min_lr"][1])
    assert config.optim.lr == pytest.approx(1.5 * shape.config.optim.lr)
    init_key, dropout_key, _ = jax.random.split(jax.random.key(1), 3)
    state = state_lib.create_train_state(shape.model, config, init_key)
    initial = bench.member_of(members.state, 1)
    assert bench.largest_difference(initial.params, state.params) <= 1e-7
    batches = [
        data.train_batch(shape.tokens, seed=1, step=s, batch_size=8, block_size=16)
        for s in range(3)
    ]
    train_fn = jax.jit(
        functools.partial(
            train.train_step,
            model=shape.model,
            loss_kwargs=train.loss_keywords(config.loss),
            learning_rate_fn=state_lib.learning_rate_schedule(config),
            microbatches=config.train.microbatches,
        )
    )
    for batch in batches:
        state, _ = train_fn(state, batch, dropout_key)
    assert bench.largest_difference(separate.states[1].params, state.params) <= 1e-5
    assert int(separate.states[1].step) == 3
    # The members differ (seed and learning rate): the check can fail.
    assert bench.largest_difference(separate.states[0].params, state.params) > 1e-2


def test_the_slice_as_processes(bench):
    """The quick slice's 4 runs (one rate, 4 seeds): a command each, and 2 programs of 2 whose
    --member flags carry the member keys and whose own flags the rest."""
    runs_lib = bench.ensemble_runs
    base, shared, overrides = runs_lib.slice_runs(bench.QUICK.slice, 10)
    assert base == "tiny" and shared["data.split"] == "works"
    assert len(overrides) == 4 and all(o["train.steps"] == 10 for o in overrides)
    assert [(o["optim.lr"], o["train.seed"]) for o in overrides] == [
        (study.ladder_rate(2), seed) for seed in range(4)
    ]  # the tiny design's one rate without tuning, test seeds 0-3
    runs = dict(zip(runs_lib.sweeps.run_names(overrides), overrides))
    separate = runs_lib.separate_processes(base, shared, runs, "/r")
    assert [p.workdir for p in separate] == [f"/r/separate/{n}" for n in runs]
    assert all("--config.data.split=works" in p.command for p in separate)
    programs = runs_lib.ensemble_processes(base, shared, runs, "/r", 2)
    assert [p.label for p in programs] == ["program 1 of 2", "program 2 of 2"]
    members = {}
    for program in programs:
        flags = [f for f in program.command if f.startswith("--member=")]
        assert len(flags) == 2 and "--config.data.split=works" in program.command
        assert not any(
            "optim.lr" in f or "train.seed" in f
            for f in program.command
            if not f.startswith("--member=")
        )
        for flag in flags:
            spec = json.loads(flag.removeprefix("--member="))
            members[spec.pop("workdir")] = spec
    # The study trains one tokenizer on the whole training split
    # (data.tokenizer_fraction=1), so the data subset is a member's too.
    member_keys = (
        "optim.lr",
        "optim.min_lr",
        "train.seed",
        "train.patience",
        "data.train_fraction",
        "data.train_offset",
    )
    assert members == {
        f"/r/ensembles_of_2/{name}": {k: v for k, v in run.items() if k in member_keys}
        for name, run in runs.items()
    }
    assert [p.label for p in separate] == [f"run {i} of 4" for i in range(1, 5)]


def test_a_slice_of_several_cells_is_refused(bench):
    with pytest.raises(ValueError, match=r"leaves 2 cells"):
        bench.ensemble_runs.slice_runs("tiny,char=true,bpe=,arms=a+b,amounts=1.0", None)


@pytest.mark.slow
def test_gpu_preset_quick_on_a_cpu(bench, capsys):
    bench.gpu_preset(bench.QUICK)
    stdout = capsys.readouterr().out
    rows = table_rows(stdout, "tiny")
    assert [row[:2] for row in rows] == [("2", "separate steps"), ("2", "vmap")]
    assert float(rows[1][6]) <= TOLERANCE
    assert re.search(r"^  M=4: \S+ member-steps/s$", stdout, re.M)
    assert "largest M that fits: 4 (stopped by the cap, --max_members=4)" in stdout


@pytest.mark.slow
def test_runs_per_hour_quick_through_bench_train():
    """bench_train.py --ensemble hands over; 4 tiny runs as 4 processes and
    as 2 programs, with the same test losses to float32 rounding. Each
    program's members share a learning rate, not the base config's: it must
    still be theirs."""
    stdout = run_bench("bench_train.py", "--ensemble", "--runs_per_hour", "--quick")
    assert re.search(r"^  \[6/6\] ", stdout, re.M)
    rows = re.findall(
        r"^\| (separate processes|ensembles of 2) \| (\d+) \| (\S+) \| (\S+) \| (\S+) \|$",
        stdout,
        re.M,
    )
    assert [row[:2] for row in rows] == [
        ("separate processes", "4"),
        ("ensembles of 2", "2"),
    ]
    for _, _, seconds, per_hour, _ in rows:
        assert float(per_hour) == pytest.approx(4 * 3600 / float(seconds), rel=0.02)
    gap = re.search(
        r"ensembles of 2: test bits/char within (\S+) of the separate", stdout
    )
    assert gap and float(gap[1]) < 1e-3
