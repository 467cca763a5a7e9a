"""The benchmarks' one timing helper and one matmul-rate probe.

Every benchmark here (``bench_head.py``, ``bench_decode.py``,
``bench_serve.py``, ``bench_train.py``, ``bench_ensemble.py``) times its programs with
:func:`call_seconds` and prints the machine's float32 matmul rate from
:class:`Matmul`, measured in the same run, so that its ratios can be read
against how fast the machine was at the time. A benchmark that alternates
its programs with the matmul (so that all see the same load on a shared
machine) times them in rounds with the matmul's calls (:func:`alternate`);
the others take :func:`matmul_rate` once.

The benchmarks import this file as ``timing``: run as
``python experiments/bench/bench_X.py``, their folder is first on
``sys.path``.
"""

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks


def wall_and_cpu() -> np.ndarray:
    """A clock of two readings, in seconds: the wall time
    (``time.perf_counter``) and this process's CPU time, all threads
    (``time.process_time``), which other processes do not inflate."""
    return np.array([time.perf_counter(), time.process_time()])


def call_seconds(
    fn: Callable[..., Any],
    args: tuple = (),
    *,
    repeats: int = 1,
    setup: Callable[[], tuple] | None = None,
    clock: Callable[[], Any] = time.perf_counter,
    reduce: Callable[..., Any] = np.median,
) -> float | np.ndarray:
    """Seconds that ``fn(*args)`` takes, its outputs waited for
    (``jax.block_until_ready``): ``reduce`` over ``repeats`` timed calls, the
    median by default (``np.min``: the fastest call, the one least disturbed
    on a shared machine).

    Args:
        fn: the program (a compiled function, or any callable).
        args: its arguments, the same at every call.
        repeats: the timed calls, an integer >= 1.
        setup: instead of ``args``, a function called before each call,
            untimed, that returns them (e.g. a fresh copy of a cache that
            ``fn`` donates); its outputs are waited for before the clock starts.
        clock: ``time.perf_counter`` (wall time), ``time.process_time`` (CPU
            time), or :func:`wall_and_cpu` (both; the result is then the
            array ``[wall, cpu]``).
        reduce: ``reduce(times, axis=0)`` of the calls' times.

    Returns:
        Seconds (a float), or an array for a clock of several readings.

    Raises:
        ValueError, TypeError: ``repeats`` is not an integer >= 1.

    Examples:
        >>> ticks = iter([0.0, 1.0, 5.0, 7.0, 10.0, 13.0])
        >>> call_seconds(jnp.ones, (3,), repeats=3, clock=lambda: next(ticks))
        2.0
        >>> ticks = iter([0.0, 1.0, 5.0, 7.0, 10.0, 13.0])
        >>> call_seconds(jnp.ones, (3,), repeats=3, clock=lambda: next(ticks),
        ...              reduce=np.min)
        1.0
    """
    _checks.check_count("repeats", repeats)
    times = []
    for _ in range(repeats):
        call_args = args if setup is None else jax.block_until_ready(setup())
        start = clock()
        jax.block_until_ready(fn(*call_args))
        times.append(clock() - start)
    result = reduce(np.asarray(times), axis=0)
    return float(result) if np.ndim(result) == 0 else result


class Matmul:
    """The probe of the machine's matmul rate: a compiled float32
    ``[size, size] @ [size, size]`` on the default device, warmed up.

    It is the rate a matmul-bound program approaches on this machine: what a
    benchmark's FLOP rates are read against.

    Attributes:
        size: the side of the matrices.
        flops: ``2 size^3``, the FLOPs of one call.

    Raises:
        ValueError, TypeError: ``size`` is not an integer >= 1.

    Examples:
        >>> matmul = Matmul(64)
        >>> matmul.flops, matmul.seconds() > 0, matmul.rate(repeats=3) > 0
        (524288.0, True, True)
    """

    def __init__(self, size: int):
        _checks.check_count("size", size)
        self.size = size
        self.flops = 2.0 * size**3
        a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
        self._operands = (a, a)
        self._compiled = jax.jit(jnp.dot).lower(a, a).compile()
        jax.block_until_ready(self._compiled(a, a))

    def seconds(
        self,
        repeats: int = 1,
        *,
        clock: Callable[[], Any] = time.perf_counter,
        reduce: Callable[..., Any] = np.median,
    ) -> float:
        """:func:`call_seconds` of the matmul."""
        return call_seconds(
            self._compiled, self._operands, repeats=repeats, clock=clock, reduce=reduce
        )

    def rate(
        self, repeats: int = 10, *, clock: Callable[[], float] = time.perf_counter
    ) -> float:
        """FLOP/s now: ``2 size^3 / t``, with ``t`` the median of ``repeats``
        timed calls (by ``clock``)."""
        return self.flops / self.seconds(repeats, clock=clock)


def matmul_rate(
    size: int = 1024, repeats: int = 10, clock: Callable[[], float] = time.perf_counter
) -> float:
    """FLOP/s of a float32 ``[size, size] @ [size, size]`` on the default
    device, now: ``2 size^3 / t``, with ``t`` the median over ``repeats``
    timed runs (by ``clock``: e.g. ``time.process_time`` for CPU time) after
    one that compiles and warms up (:class:`Matmul`).

    Raises:
        ValueError, TypeError: ``size`` or ``repeats`` is not an integer >= 1.

    Examples:
        >>> matmul_rate(64, repeats=3) > 0
        True
    """
    _checks.check_count("repeats", repeats)
    return Matmul(size).rate(repeats, clock=clock)


# The matmul's time in a round of :func:`alternate`: the fastest of this many
# calls (one short call is easily preempted on a shared machine).
MATMUL_CALLS = 5


def alternate(
    programs: dict[str, Callable[[], Any]],
    matmul: Matmul,
    rounds: int,
    *,
    matmul_calls: int = MATMUL_CALLS,
) -> dict[str, np.ndarray]:
    """Times ``programs`` (``{name: run}``, ``run()`` the call to time) in
    alternation with ``matmul``: in each of ``rounds`` rounds every program
    once (:func:`call_seconds` by :func:`wall_and_cpu`), then the matmul's
    fastest of ``matmul_calls`` calls, so that all see the same load on a
    shared machine.

    Returns:
        ``{name: [wall, cpu]}``, each program's median seconds per call over
        the rounds, and ``"matmul"``: ``[wall, nan]``, the median of the
        matmul's fastest time per round.

    Raises:
        ValueError, TypeError: ``rounds`` is not an integer >= 1.

    Examples:
        >>> times = alternate({"ones": lambda: jnp.ones(3)}, Matmul(32), rounds=2)
        >>> sorted(times), times["ones"].shape, bool(times["matmul"][0] > 0)
        (['matmul', 'ones'], (2,), True)
    """
    _checks.check_count("rounds", rounds)
    times = {name: [] for name in [*programs, "matmul"]}
    for _ in range(rounds):
        for name, run in programs.items():
            times[name].append(call_seconds(run, clock=wall_and_cpu))
        fastest = matmul.seconds(matmul_calls, reduce=np.min)
        times["matmul"].append((fastest, float("nan")))
    return {name: np.median(np.array(t), axis=0) for name, t in times.items()}
