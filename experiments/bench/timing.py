"""The benchmarks' shared timing, machine line and tables.

Every benchmark of this folder times its programs with :func:`call_seconds`
(side by side: :func:`alternate`) and reads its ratios against the float32
matmul rate of :class:`Matmul`, measured in the same run; its first line is
:func:`machine` and its tables :func:`table`. ``docs/benchmarks.md`` says
how each benchmark uses them. The benchmarks import this file as
``timing``: run as ``python experiments/bench/bench_X.py``, their folder is
first on ``sys.path``. The flags they share with each other and with the
commands are defined once in ``experiments/cli.py``, which this file loads
as :data:`cli`.
"""

import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lmhead import _checks
from lmhead.lm import configuration, sharding

# experiments/cli.py: the folder above, which is not on a benchmark's sys.path.
cli = configuration.load_module(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cli.py")
)


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


# The matmul's time in a round of :func:`alternate`: the fastest of this many
# calls (one short call is easily preempted on a shared machine).
MATMUL_CALLS = 5


def alternate(
    programs: dict[str, Callable[..., Any]],
    matmul: Matmul | None,
    rounds: int,
    *,
    setups: dict[str, Callable[[], tuple]] | None = None,
    clock: Callable[[], Any] = wall_and_cpu,
    matmul_calls: int = MATMUL_CALLS,
) -> dict[str, np.ndarray]:
    """Times ``programs`` (``{name: run}``) in alternation with ``matmul``:
    in each of ``rounds`` rounds every program once (:func:`call_seconds`
    by ``clock``, its arguments from ``setups[name]()``, untimed, if given),
    then the matmul's fastest of ``matmul_calls`` calls, so that all see the
    same load on a shared machine.

    Returns:
        ``{name: seconds}``, each program's median per call over the rounds
        (``[wall, cpu]`` by :func:`wall_and_cpu`), and with a ``matmul``,
        ``"matmul"``: ``[wall, nan]``, the median of its fastest time per round.

    Raises:
        ValueError, TypeError: ``rounds`` is not an integer >= 1.

    Examples:
        >>> times = alternate({"ones": lambda: jnp.ones(3)}, Matmul(32), rounds=2)
        >>> sorted(times), times["ones"].shape, bool(times["matmul"][0] > 0)
        (['matmul', 'ones'], (2,), True)
        >>> times = alternate({"ones": jnp.ones}, None, 2,
        ...                   setups={"ones": lambda: (3,)}, clock=lambda: 0.0)
        >>> sorted(times), float(times["ones"])
        (['ones'], 0.0)
    """
    _checks.check_count("rounds", rounds)
    setups = setups or {}
    times = {name: [] for name in [*programs, *["matmul"] * (matmul is not None)]}
    for _ in range(rounds):
        for name, run in programs.items():
            seconds = call_seconds(run, setup=setups.get(name), clock=clock)
            times[name].append(seconds)
        if matmul is not None:
            fastest = matmul.seconds(matmul_calls, reduce=np.min)
            times["matmul"].append((fastest, float("nan")))
    return {name: np.median(np.array(t), axis=0) for name, t in times.items()}


# The CPU features that decide which kernels XLA's CPU backend can use for a
# matmul: AVX-512, its bfloat16 dot products, and AMX's tiles.
CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_kind(cpuinfo: str | None = None) -> str:
    r"""The CPU's model name and which of :data:`CPU_FLAGS` it has, read from
    ``cpuinfo`` (the text of ``/proc/cpuinfo``, read when None; elsewhere
    than Linux, ``platform.processor()`` and no flags). The machines a
    project runs on differ in these (an AMD EPYC without AMX, an Intel Xeon
    with it), and a figure measured on one is not compared with the other's.

    Examples:
        >>> cpu_kind("model name\t: AMD EPYC\nflags\t\t: fpu avx512f avx2\n")
        'AMD EPYC (avx512f)'
        >>> cpu_kind("model name\t: Some CPU\nflags\t\t: fpu sse2\n")
        'Some CPU (none of avx512f, avx512_bf16, amx_tile, amx_bf16)'
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            return platform.processor() or "an unknown CPU"
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in cpuinfo.splitlines())
        if value
    )
    flags = set(fields.get("flags", "").split())
    found = [f for f in CPU_FLAGS if f in flags]
    name = fields.get("model name", platform.processor() or "an unknown CPU")
    return f"{name} ({', '.join(found) or 'none of ' + ', '.join(CPU_FLAGS)})"


def machine() -> str:
    """What a benchmark runs on, for its first line: the first device's kind,
    the backend, the CPU's model and features (:func:`cpu_kind`), the CPUs
    this process may use, the devices and jax's version.

    Examples:
        >>> machine().startswith(jax.devices()[0].device_kind)
        True
    """
    return (
        f"{jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"CPU {cpu_kind()}, {sharding.available_cpus()} CPUs, "
        f"{jax.device_count()} devices, jax {jax.__version__}"
    )


def table(header: Sequence[str], rows: Iterable[Sequence], rule: str = "---") -> str:
    """A Markdown table: the ``header``'s cells, a ``rule`` under each
    (``"---:"`` aligns right), and a line per row of cells.

    Examples:
        >>> print(table(["a", "b"], [(1, "x"), (2, "y")]))
        | a | b |
        |---|---|
        | 1 | x |
        | 2 | y |
    """
    line = lambda cells: "| " + " | ".join(map(str, cells)) + " |"
    return "\n".join([line(header), "|" + f"{rule}|" * len(header), *map(line, rows)])
