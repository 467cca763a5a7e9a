"""Tests for experiments/bench/timing.py, the benchmarks' one timing helper
and matmul-rate probe: what is timed, by which clock, reduced how, and the
bad arguments."""

import doctest
import functools
import glob
import os
import time

import numpy as np
import pytest

from lmhead.lm import configuration
from tests import ROOT

timing = configuration.load_module(
    os.path.join(ROOT, "experiments", "bench", "timing.py")
)


def test_doctests():
    assert doctest.testmod(timing, optionflags=doctest.ELLIPSIS).failed == 0


def test_call_seconds_times_the_call_only_and_reduces_over_repeats():
    """The clock is read around each call, not around the setup, whose
    result is what the call gets."""
    readings = iter([0.0, 2.0, 10.0, 11.0, 20.0, 24.0])
    log = []

    def setup():
        log.append("setup")
        return (len(log),)

    def fn(x):
        log.append(f"call {x}")
        return np.float32(x)

    clock = lambda: next(readings)
    median = timing.call_seconds(fn, repeats=3, setup=setup, clock=clock)
    assert median == 2.0
    assert log == ["setup", "call 1", "setup", "call 3", "setup", "call 5"]
    readings = iter([0.0, 2.0, 10.0, 11.0, 20.0, 24.0])
    assert timing.call_seconds(fn, (7,), repeats=3, clock=clock, reduce=np.min) == 1.0
    assert log[-3:] == ["call 7"] * 3


def test_wall_and_cpu_clocks_both_at_once():
    """A sleeping call takes wall time but next to no CPU time."""
    wall, cpu = timing.call_seconds(time.sleep, (0.05,), clock=timing.wall_and_cpu)
    assert wall >= 0.05 and 0 <= cpu < wall / 2


def test_the_matmul_probe():
    matmul = timing.Matmul(32)
    assert matmul.size == 32 and matmul.flops == 2 * 32**3
    seconds = matmul.seconds(3, reduce=np.min)
    assert seconds > 0 and matmul.rate(3) > 0
    assert matmul.rate(2, clock=time.process_time) > 0


def test_alternate_runs_every_program_then_the_matmul_each_round():
    """In each round every program once, in order, then the matmul's
    fastest of its calls; medians over the rounds."""
    log = []

    class FakeMatmul:
        fastest = iter([3.0, 1.0, 2.0])

        def seconds(self, calls, reduce):
            log.append(f"matmul x{calls}, {reduce.__name__}")
            return next(self.fastest)

    programs = {name: functools.partial(log.append, name) for name in ("a", "b")}
    times = timing.alternate(programs, FakeMatmul(), rounds=3, matmul_calls=4)
    assert log == ["a", "b", "matmul x4, min"] * 3
    assert sorted(times) == ["a", "b", "matmul"]
    assert times["matmul"][0] == 2.0 and np.isnan(times["matmul"][1])
    assert all(times[name].shape == (2,) and times[name][0] >= 0 for name in "ab")


@pytest.mark.parametrize(
    "call,error,named",
    [
        (lambda: timing.call_seconds(np.ones, (2,), repeats=0), ValueError, "repeats"),
        (lambda: timing.Matmul(0), ValueError, "size"),
        (lambda: timing.Matmul(8.0), TypeError, "size"),
        (lambda: timing.Matmul(8).rate(repeats=0), ValueError, "repeats"),
        (lambda: timing.alternate({}, None, rounds=0), ValueError, "rounds"),
    ],
    ids=[
        "repeats 0",
        "size 0",
        "size float",
        "rate repeats 0",
        "rounds 0",
    ],
)
def test_bad_arguments_are_refused_by_name(call, error, named):
    with pytest.raises(error, match=rf"\b{named}\b"):
        call()


def test_every_benchmark_says_the_machine_it_ran_on():
    """Each benchmark prints timing.machine(): the CPU's model and features
    beside its ratios, since figures of two machine kinds do not compare."""
    folder = os.path.join(ROOT, "experiments", "bench")
    benchmarks = sorted(glob.glob(os.path.join(folder, "bench_*.py")))
    assert len(benchmarks) >= 7
    silent = [
        os.path.basename(p)
        for p in benchmarks
        if "timing.machine()" not in open(p, encoding="utf-8").read()
    ]
    assert not silent, silent
    assert timing.cpu_kind("model name\t: X\nflags\t\t: amx_tile avx512f\n") == (
        "X (avx512f, amx_tile)"
    )
