"""Fixtures shared by the test files, and one compilation cache for the suite."""

import atexit
import collections
import os
import shutil
import tempfile

from tests import FUSION_EMITTERS

# Many tests build the same programs (the tiny config's train and eval steps,
# the decoding loops), in this process and in the subprocesses that the
# command tests start: with a compilation cache that lasts the session, XLA
# compiles each program once and later builds load it. The cache holds
# compiled code only: tracing, lowering and every result stay what they were.
# Set before jax is imported, so that subprocesses inherit it too.
# Each pytest-xdist worker gets a folder of its own under the session's: JAX
# writes a cache entry in place, so a worker could read another's half-written
# entry ("incomplete or truncated stream"). A worker's command tests run one
# subprocess at a time while it waits, so they share its folder safely.
if "LMHEAD_TEST_XLA_CACHE" not in os.environ:
    os.environ["LMHEAD_TEST_XLA_CACHE"] = os.environ.get(
        "JAX_COMPILATION_CACHE_DIR"
    ) or tempfile.mkdtemp(prefix="lmhead-xla-")
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        atexit.register(shutil.rmtree, os.environ["LMHEAD_TEST_XLA_CACHE"], True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
    os.environ["LMHEAD_TEST_XLA_CACHE"],
    os.environ.get("PYTEST_XDIST_WORKER", "main"),
)
# Only programs that take 0.1 s or more to compile: the many smaller ones (an
# eager operation, a test's own reference) compile in about the time that
# writing and reading their entries takes, so caching them gained nothing.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# Each operation's location in the lowered program is its innermost frame, not
# the Python traceback under it (up to 100 frames, pytest's among them): the
# compiled code is the same, its lowering takes less time.
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")
# The tests' programs are tiny, so compiling them takes most of the suite's
# time: LLVM's optimizations are off, and XLA's loop emitters compile fused
# computations in place of its newer MLIR emitters, which take longer on small
# programs (the README gives the suite's times). XLA's own passes (fusion,
# layout) still run, so the programs tested are the ones users run, compiled by
# a faster backend. A test that two programs give the same bits, which they do
# under the default emitters and not under these, compiles them with the
# default ones (tests.DEFAULT_EMITTERS). Each program's machine code is
# generated in one piece, not split over threads: with a worker per core, the
# split only adds its overhead. A flag the caller set wins.
for flag, value in (
    ("xla_backend_optimization_level", "0"),
    (FUSION_EMITTERS, "false"),
    ("xla_cpu_parallel_codegen_split_count", "1"),
):
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --{flag}={value}"
        ).strip()

import jax  # noqa: E402
import ml_collections  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)

from configs import default  # noqa: E402
from lmhead.lm import checkpoints, data, train  # noqa: E402

# Files of few tests whose fixtures run for tens of seconds (a subprocess of
# 8 devices, the notebook, a trained study): handed out first, so that none
# of them is left to run on one worker at the end while the other idles.
FIRST = (
    "tests/lm/test_sharding_ensemble.py",
    "tests/lm/test_sharding.py",
    "tests/experiments/test_notebook.py",
    "tests/experiments/test_tying_rate_noise.py",
    "tests/experiments/test_dpo_shakespeare.py",
)


def pytest_collection_modifyitems(items):
    """Orders the files as `make test`'s workers take them (pytest-xdist's
    ``--dist loadfile --no-loadscope-reorder``): :data:`FIRST`, then the
    others by their number of tests, most first, as xdist would; a file's
    tests keep their order."""
    path = lambda item: item.nodeid.split("::")[0]
    counts = collections.Counter(map(path, items))
    rank = lambda p: FIRST.index(p) if p in FIRST else len(FIRST)
    items.sort(key=lambda item: (rank(path(item)), -counts[path(item)]))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A 20,000-character UTF-8 file cut from the embedded corpus."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(data.shakespeare_text()[:20_000], encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def short_config(corpus):
    """Makes the tiny config on ``corpus`` for 10 steps (checkpoints at 5 and
    10, no samples): ``short_config(**{"model.tied": False})``. ``None``
    deletes a key, and a key the config lacks is added (the config is an
    unlocked, untyped copy, so that a test can write any bad value)."""

    def make(**overrides):
        config = default.get_config("tiny")
        config.update_from_flattened_dict(
            {
                "data.path": corpus,
                "train.steps": 10,
                "train.log_every": 5,
                "train.checkpoint_every": 5,
                "train.eval_every": 10,
                "train.eval_batches": 1,
                "optim.warmup_steps": 2,
                "sample.num_samples": 0,
            }
        )
        config = ml_collections.ConfigDict(config.to_dict(), type_safe=False)
        for name, value in overrides.items():
            section, key = name.split(".")
            if section not in config:
                config[section] = {}
            if value is None:
                del config[section][key]
            else:
                config[section][key] = value
        return config

    return make


@pytest.fixture(scope="session")
def finished_run(short_config, tmp_path_factory):
    """The workdir of a finished ``short_config()`` run: checkpoints 5 and 10.
    Tests that change it work on a copy (``copy_of_finished_run``)."""
    workdir = str(tmp_path_factory.mktemp("finished") / "run")
    train.train_and_evaluate(short_config(), workdir)
    return workdir


@pytest.fixture
def copy_of_finished_run(finished_run, tmp_path):
    workdir = str(tmp_path / "copy")
    shutil.copytree(finished_run, workdir)
    return workdir


@pytest.fixture
def nothing_compiles(monkeypatch):
    """Fails the test if ``train_and_evaluate`` reaches the compiler or
    restores a state: for errors that must come before either."""

    def compiled(*args, **kwargs):
        raise AssertionError("reached the compiler")

    monkeypatch.setattr(train, "compile_steps", compiled)
    monkeypatch.setattr(checkpoints, "restore_newest", compiled)
