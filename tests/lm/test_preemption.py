"""A training job that is killed loses nothing.

One config throughout: the tiny model on a short corpus, 60 steps, logging
and checkpointing every 5. The uninterrupted run is a module fixture, in
this process. End to end, ``experiments/train.py`` runs in subprocesses.
Fast: the run is killed with SIGKILL after step 10 and left a partial
``STEP.orbax-checkpoint-tmp`` directory, as a kill during a checkpoint write
leaves; the same command finishes it. Slow: then also SIGTERM after step 25
(a checkpoint at the next step boundary, exit status 143), and a garbled
newest checkpoint (set aside with a warning naming its step; the run resumes
from the one before). Either way the parameters and metrics equal the
uninterrupted run's bit for bit.

In-process, on a finished run's checkpoints: a partial temporary directory
is ignored; a garbled or truncated newest checkpoint falls back to the
previous one. And SIGTERM, sent by the run to itself, saves at the next
step boundary and raises ``preemption.Preempted``.
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings

import jax
import ml_collections
import numpy as np
import pytest

from configs import default
from lmhead.lm import (
    checkpoints,
    configuration,
    data,
    generation,
    monitoring,
    preemption,
    train,
)
from lmhead.lm import state as state_lib
from tests import ROOT
from tests.lm.conftest import read_metrics

STEPS, EVERY = 60, 5
CONFIG = {
    "train.steps": STEPS,
    "train.log_every": EVERY,
    "train.checkpoint_every": EVERY,
    "train.eval_every": 30,
    "train.eval_batches": 1,
    "optim.warmup_steps": 2,
    "sample.num_samples": 0,
}


def tiny_run(corpus, **overrides):
    config = default.get_config("tiny")
    config.update_from_flattened_dict({"data.path": corpus, **CONFIG, **overrides})
    return config


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """The uninterrupted run; it keeps the checkpoints of steps 55 and 60."""
    workdir = str(tmp_path_factory.mktemp("finished") / "run")
    train.train_and_evaluate(tiny_run(corpus), workdir)
    assert checkpoint_steps(workdir) == [55, 60]
    return workdir


# Runs experiments/train.py as the command line does, except that the run
# waits once it has logged the step given first: a SIGKILL finds it there,
# and a SIGTERM reaches the run's own handler there and lets it go on to the
# next step boundary. However fast the machine, the run has not finished.
HOLD_AFTER = """
import os, runpy, signal, sys, threading
from lmhead.lm import monitoring
log, step = monitoring.log, sys.argv.pop(1)
def held(message):
    if not message.startswith(f"step {step}/"):
        return log(message)
    # Caught before the line goes out: a signal sent on reading it is not lost.
    handler, terminated = signal.getsignal(signal.SIGTERM), threading.Event()
    signal.signal(signal.SIGTERM, lambda *args: terminated.set())
    log(message)
    while not terminated.wait(0.1):
        pass
    signal.signal(signal.SIGTERM, handler)
    handler(signal.SIGTERM, None)
monitoring.log = held
sys.argv.pop(0)
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def command(corpus, workdir, hold_after=None):
    held = [] if hold_after is None else ["-c", HOLD_AFTER, str(hold_after)]
    return [
        sys.executable,
        *held,
        os.path.join(ROOT, "experiments", "train.py"),
        "--config=configs/default.py:tiny",
        f"--workdir={workdir}",
        f"--config.data.path={corpus}",
    ] + [f"--config.{key}={value}" for key, value in CONFIG.items()]


def start(corpus, workdir, log, hold_after=None):
    return subprocess.Popen(
        command(corpus, workdir, hold_after),
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=log,
    )


def signal_after(process, step, signum):
    """Sends ``signum`` once the run has logged ``step``; returns its stdout."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(f"step {step}/"):
            process.send_signal(signum)
            break
    lines += process.stdout.readlines()
    process.wait(timeout=300)
    return "".join(lines)


def checkpoint_steps(workdir):
    return sorted(
        int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()
    )


def garble(step_dir):
    """Overwrites every array data file of a checkpoint with junk."""
    paths = glob.glob(os.path.join(step_dir, "**", "d", "*"), recursive=True)
    assert paths
    for path in paths:
        with open(path, "wb") as f:
            f.write(b"\x00junk" * 7)


def finish(corpus, workdir):
    result = subprocess.run(
        command(corpus, workdir), cwd=ROOT, text=True, capture_output=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def assert_same_run(workdir, reference):
    assert read_metrics(workdir) == read_metrics(reference)
    params = [generation.load_run(w)[3] for w in (reference, workdir)]
    jax.tree.map(np.testing.assert_array_equal, *params)


def kill_during_training(corpus, workdir, log):
    """SIGKILL after step 10, where the run waits for it, and a partial write
    of the next checkpoint."""
    signal_after(start(corpus, workdir, log, hold_after=10), 10, signal.SIGKILL)
    kept = checkpoint_steps(workdir)
    assert not os.path.exists(os.path.join(workdir, "summary.json")), (
        "the run finished before the kill",
        kept,
    )
    assert kept and kept[-1] < STEPS, kept
    partial = os.path.join(
        workdir, "checkpoints", f"{kept[-1] + EVERY}.orbax-checkpoint-tmp"
    )
    if not os.path.exists(partial):  # else the kill itself cut a write short
        shutil.copytree(os.path.join(workdir, "checkpoints", str(kept[-1])), partial)
        garble(partial)
    return kept[-1]


def test_sigkill_then_the_same_command_ends_bitwise_equal(corpus, finished, tmp_path):
    workdir = str(tmp_path / "resumed")
    with open(tmp_path / "stderr.txt", "w+") as log:
        resumed_from = kill_during_training(corpus, workdir, log)
    assert f"starting at step {resumed_from}." in finish(corpus, workdir).stdout
    assert_same_run(workdir, finished)


@pytest.mark.slow
def test_kill_term_and_corruption_end_bitwise_equal(corpus, finished, tmp_path):
    workdir = str(tmp_path / "resumed")
    log = open(tmp_path / "stderr.txt", "w+")
    resumed_from = kill_during_training(corpus, workdir, log)

    # SIGTERM after step 25: a checkpoint at the next step boundary, status 143.
    terminated = start(corpus, workdir, log, hold_after=25)
    stdout = signal_after(terminated, 25, signal.SIGTERM)
    log.seek(0)
    stderr = log.read()
    assert terminated.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert f"starting at step {resumed_from}." in stdout
    stopped = int(re.search(r"Stopped by SIGTERM at step (\d+)", stderr)[1])
    assert 25 <= stopped < STEPS and stopped in checkpoint_steps(workdir)

    # The newest checkpoint garbled: the run goes back to the one before.
    garble(os.path.join(workdir, "checkpoints", str(stopped)))
    previous = max(s for s in checkpoint_steps(workdir) if s < stopped)
    completed = finish(corpus, workdir)
    assert re.search(
        rf"checkpoint of step {stopped} in \S+ does not restore", completed.stderr
    )
    assert f"starting at step {previous}." in completed.stdout
    assert os.listdir(os.path.join(workdir, checkpoints.CORRUPT_CHECKPOINTS))
    log.close()
    assert_same_run(workdir, finished)


def restore(workdir):
    """``(state, manager)``: what a resumed run starts from."""
    with open(os.path.join(workdir, "config.json")) as f:
        config = ml_collections.ConfigDict(json.load(f))
    vocab_size = data.load_tokenizer(
        os.path.join(workdir, data.TOKENIZER_FILE)
    ).vocab_size
    manager = checkpoints.checkpoint_manager(workdir)
    state = state_lib.restore_or_init(
        manager, configuration.make_model(config, vocab_size), config, jax.random.key(0)
    )
    return state, manager


def copy_run(finished, tmp_path):
    workdir = str(tmp_path / "copy")
    shutil.copytree(finished, workdir)
    return workdir


def test_a_partial_checkpoint_write_is_ignored(finished, tmp_path):
    workdir = copy_run(finished, tmp_path)
    partial = os.path.join(workdir, "checkpoints", "65.orbax-checkpoint-tmp")
    shutil.copytree(os.path.join(workdir, "checkpoints", "60"), partial)
    os.remove(os.path.join(partial, "default", "_METADATA"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        state, manager = restore(workdir)
    assert int(state.step) == 60
    checkpoints.save(manager, 65, state)  # over the partial one
    assert manager.all_steps() == [60, 65]
    manager.close()


def truncate_metadata(step_dir):
    with open(os.path.join(step_dir, "default", "_METADATA"), "r+") as f:
        f.truncate(10)


@pytest.mark.parametrize("corrupt", [garble, truncate_metadata])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(
    finished, tmp_path, corrupt
):
    workdir = copy_run(finished, tmp_path)
    corrupt(os.path.join(workdir, "checkpoints", "60"))
    with pytest.warns(
        RuntimeWarning, match=r"checkpoint of step 60 in \S+ does not restore"
    ):
        state, manager = restore(workdir)
    assert int(state.step) == 55
    set_aside = os.listdir(os.path.join(workdir, checkpoints.CORRUPT_CHECKPOINTS))
    assert [name.split(".")[0] for name in set_aside] == ["60"]
    # Training saves step 60 again where the corrupt one was.
    checkpoints.save(manager, 60, state)
    assert manager.all_steps() == [55, 60]
    manager.close()


def test_sigterm_saves_at_the_next_step_boundary(corpus, tmp_path, monkeypatch):
    def log_then_terminate(message):
        if message.startswith("step 5/"):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(monitoring, "log", log_then_terminate)
    handler = signal.getsignal(signal.SIGTERM)
    workdir = str(tmp_path / "run")
    with pytest.raises(
        preemption.Preempted, match="Stopped by SIGTERM at step 5; its checkpoint"
    ):
        train.train_and_evaluate(
            tiny_run(corpus, **{"train.checkpoint_every": 10}), workdir
        )
    assert signal.getsignal(signal.SIGTERM) == handler
    assert checkpoint_steps(workdir) == [5]  # not a checkpoint_every step
    state, manager = restore(workdir)
    manager.close()
    assert int(state.step) == 5
