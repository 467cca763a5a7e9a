"""Tests for lmhead/lab/progress.py: the progress lines of running jobs, read
from the files the test writes, on a clock the test drives (so no line
depends on the machine's speed); and the lines on the runner's terminal
(experiments/sweep.py), which the test waits for while the stand-in program
waits for the test."""

import json
import subprocess
import textwrap

import pytest

from lmhead.lab import progress
from tests import ROOT
from tests.errors import bad_input_test
from tests.lab.sweep_helpers import FAKE_SWEEP, sweep_command


@pytest.fixture
def writer():
    """Writes a file as a train process would: appending (``"a"``) or anew."""

    def write(path, text, mode="a"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, mode, encoding="utf-8") as f:
            f.write(text)

    return write


def metrics_line(step, **values):
    return json.dumps({"step": step, **values}) + "\n"


def eta(budget, first, last, now):
    """The expected ETA: the budget's steps left at the rate from the first
    logged step to the last, less the time since the last."""
    (t0, s0), (t1, s1) = first, last
    return max(0.0, (budget - s1) / ((s1 - s0) / (t1 - t0)) - (now - t1))


def test_a_programs_line_has_its_step_best_loss_members_and_eta(tmp_path, writer):
    program = tmp_path / "ensembles" / "p"
    members = [tmp_path / f"seed={seed}" for seed in range(3)]
    job = dict(
        name="tied=True,ensemble=0",
        workdir=str(program),
        members=[dict(name=m.name, workdir=str(m)) for m in members],
    )
    watch = progress.Progress(every_s=30)
    assert watch.poll([job], now=100.0) == []  # starts; the first report at 130
    assert watch.poll([job], now=129.0) == []
    assert watch.poll([job], now=130.0) == [
        "  tied=True,ensemble=0: no step logged yet, 30 s after its start"
    ]
    # The program's config first, then each member's: patience 0, 1, 0.
    writer(program / "config.json", json.dumps({"train": {"steps": 400}}), "w")
    for member, patience in zip(members, (0, 1, 0)):
        config = {"train": {"steps": 200, "patience": patience}}
        writer(member / "config.json", json.dumps(config), "w")
    losses = {10: (3.0, 2.9, 3.1), 20: (2.5, 3.5, 2.6)}  # member 1 stops at 20
    writer(members[0] / "metrics.jsonl", metrics_line(10, **{"train/loss": 3.2}))
    assert watch.poll([job], now=140.0) == []  # the first step: the rate starts
    for member, loss in zip(members, losses[10]):
        writer(member / "metrics.jsonl", metrics_line(10, **{"eval/loss": loss}))
    for member, loss in zip(members, losses[20]):
        writer(member / "metrics.jsonl", metrics_line(20, **{"train/loss": 3.0}))
        assert watch.poll([job], now=150.0) == []  # step 20 first seen at 150
        writer(member / "metrics.jsonl", metrics_line(20, **{"eval/loss": loss}))
    [line] = watch.poll([job], now=160.0)
    left = eta(200, (140.0, 10), (150.0, 20), now=160.0)
    assert left == 170.0
    assert line == (
        "  tied=True,ensemble=0: step 20/200, best eval/loss 2.5000 (members' "
        "bests up to 2.9000), 2/3 members training, ETA 2.8 min at 1.00 steps/s"
    )
    # A member finishes (its summary), another fails (failed.json): the one
    # left has no patience, and the ETA no caveat.
    writer(members[0] / "summary.json", "{}", "w")
    writer(members[2] / "failed.json", json.dumps({"step": 20}), "w")
    assert watch.poll([job], now=189.0) == []
    [line] = watch.poll([job], now=190.0)
    assert line.endswith("0/3 members training, final evaluations")


def test_the_eta_names_early_stopping_and_the_rate_skips_records_left_before(
    tmp_path, writer
):
    """A resumed run's ``metrics.jsonl`` holds steps past its checkpoint
    until the process writes it anew; the rate starts at the first step
    logged past them."""
    run = tmp_path / "seed=0"
    writer(run / "config.json", json.dumps({"train": {"steps": 100, "patience": 2}}))
    writer(run / "metrics.jsonl", "".join(metrics_line(s) for s in (10, 20, 30)))
    job = dict(name="seed=0", workdir=str(run))
    watch = progress.Progress(every_s=10)
    assert watch.poll([job], now=0.0) == []
    writer(run / "metrics.jsonl", metrics_line(10) + metrics_line(20), "w")
    assert watch.poll([job], now=1.0) == []
    writer(run / "metrics.jsonl", metrics_line(30, **{"eval/loss": 4.0}))
    assert watch.poll([job], now=2.0) == []
    [line] = watch.poll([job], now=10.0)
    assert line == (
        "  seed=0: step 30/100, best eval/loss 4.0000, ETA after the next logged step"
    )
    writer(run / "metrics.jsonl", metrics_line(40))
    assert watch.poll([job], now=12.0) == []
    writer(run / "metrics.jsonl", metrics_line(50))
    [line] = watch.poll([job], now=20.0)
    left = eta(100, (12.0, 40), (20.0, 50), now=20.0)
    assert left == 40.0
    assert line == (
        "  seed=0: step 50/100, best eval/loss 4.0000, ETA 40 s at 1.25 steps/s "
        "(early stopping may end it sooner)"
    )
    # At its train.steps the run no longer trains: its final evaluations.
    writer(run / "metrics.jsonl", metrics_line(100))
    assert watch.poll([job], now=30.0) == [
        "  seed=0: step 100/100, best eval/loss 4.0000, final evaluations"
    ]
    # A job that ends is forgotten; one that starts is watched from then.
    other = dict(name="seed=1", workdir=str(tmp_path / "seed=1"))
    assert watch.poll([other], now=35.0) == []
    assert watch.poll([other], now=40.0) == [
        "  seed=1: no step logged yet, 5 s after its start"
    ]


test_bad_interval_is_refused = bad_input_test(
    [
        ("zero", lambda: progress.Progress(every_s=0), ValueError, "every_s"),
        ("negative", lambda: progress.Progress(every_s=-1), ValueError, "every_s"),
    ]
)


# The stand-in of an ensemble program that logs step 10 of 40 for each
# member, then waits for the file "go" in its workdir (the test creates it
# once the runner has printed the program's progress) and finishes; after
# 300 s without it, it exits 1, so that a missing line fails the test.
WAITING_ENSEMBLE_TRAIN = textwrap.dedent("""\
    import json, os, sys, time
    flags = [a.split("=", 1) for a in sys.argv[1:]]
    workdir = dict(flags)["--workdir"]
    members = [json.loads(v)["workdir"] for k, v in flags if k == "--member"]
    os.makedirs(workdir, exist_ok=True)
    for index, member in enumerate(members):
        os.makedirs(member, exist_ok=True)
        with open(os.path.join(member, "config.json"), "w") as f:
            json.dump({"train": {"steps": 40, "patience": 0}}, f)
        with open(os.path.join(member, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 10, "eval/loss": 2.0 + index / 10}) + "\\n")
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(workdir, "go")):
        if time.time() > deadline:
            sys.exit("no go")
        time.sleep(0.05)
    for member in members:
        with open(os.path.join(member, "summary.json"), "w") as f:
            json.dump({}, f)
    """)


def test_the_runner_prints_each_programs_progress(tmp_path):
    command = sweep_command(
        tmp_path,
        "--ensemble=2",
        "--noreport",
        "--progress_every_s=0.5",
        sweep=FAKE_SWEEP,
        train=WAITING_ENSEMBLE_TRAIN,
    )
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    # A line may catch the program between its writes (a member's file not
    # yet written); the one the test waits for has both members' files read.
    released, output = set(), []
    for line in process.stdout:
        output.append(line)
        for tied in (True, False):
            name = f"tied={tied},ensemble=0"
            expected = (
                f"  {name}: step 10/40, best eval/loss 2.0000 (members' bests up "
                "to 2.1000), 2/2 members training, "
            )
            if line.startswith(expected) and name not in released:
                released.add(name)
                (tmp_path / "sweep" / "ensembles" / name / "go").touch()
    assert process.wait(timeout=60) == 0, "".join(output)
    assert len(released) == 2, "".join(output)
