"""Tests for lmhead/lab/runner.py, through its command (experiments/sweep.py)
with stand-in train programs (tests/lab/sweep_helpers.py and below): skipping
finished runs, resuming interrupted ones, failures, the report, SIGTERM, CPU
pinning and planning again from the results."""

import itertools
import json
import os
import pathlib
import subprocess
import textwrap
import time

import pytest

from lmhead.lab import runner, workdirs
from tests import ROOT
from tests.lab.sweep_helpers import FAKE_SWEEP, calls, run_sweep, sweep_command

# FAKE_SWEEP with a report, which plots nothing.
REPORTING_SWEEP = FAKE_SWEEP + textwrap.dedent("""\

    def write_report(arg, sweep_dir, out_dir):
        text = f"The report of {len(sweeps.run_names(get_sweep(arg)[1]))} runs."
        with open(out_dir + "/REPORT.md", "w") as f:
            f.write(text)
        return text, []
    """)


def test_runner_skips_finished_resumes_interrupted_and_reports_failures(tmp_path):
    """A run that exits with an error, and one that exits cleanly without a
    summary, are failures; the same command again runs only those."""
    sweep_dir = tmp_path / "sweep"
    (sweep_dir / "tied=True,seed=0").mkdir(parents=True)
    (sweep_dir / "tied=True,seed=0" / "summary.json").write_text("{}")
    (sweep_dir / "tied=True,seed=1" / "checkpoints").mkdir(parents=True)
    failing, empty = "tied=False,seed=0", "tied=False,seed=1"
    env = {"FAIL_RUN": failing, "EMPTY_RUN": empty}
    result = run_sweep(
        tmp_path, "--parallel=2", "--noreport", env=env, sweep=REPORTING_SWEEP
    )
    assert result.returncode == 1
    assert calls(tmp_path, "tied=True,seed=0") == []
    assert calls(tmp_path, "tied=True,seed=1") == ["resume"]
    assert calls(tmp_path, failing) == calls(tmp_path, empty) == ["start"]
    for name in (failing, empty):
        assert f"FAILED: {name}" in result.stdout
    # The logs' tails.
    assert f"simulated failure in {failing}" in result.stdout
    assert "did nothing" in result.stdout
    assert "2 of 3 runs failed" in result.stdout
    for name, code in ((failing, 1), (empty, 0)):
        status = json.loads((sweep_dir / name / workdirs.STATUS_FILE).read_text())
        assert status["returncode"] == code
    statuses = [r.status for r in workdirs.read_sweep(str(sweep_dir))]
    assert statuses == ["finished", "finished", "failed", "failed"]

    # The same command again runs only the failed runs, which now succeed.
    result = run_sweep(tmp_path, "--report", sweep=REPORTING_SWEEP)
    assert result.returncode == 0, result.stdout + result.stderr
    # Neither had saved a checkpoint.
    assert calls(tmp_path, failing) == calls(tmp_path, empty) == ["start", "start"]
    log = (sweep_dir / failing / workdirs.LOG_FILE).read_text()
    assert log.count("=== ") == 2 and "simulated failure" in log
    status = json.loads((sweep_dir / failing / workdirs.STATUS_FILE).read_text())
    assert status["returncode"] == 0
    assert (sweep_dir / "REPORT.md").read_text() == "The report of 4 runs."
    assert "The report of 4 runs.\n\nReport: " in result.stdout


def test_a_sweep_file_without_a_report_ends_without_one(tmp_path):
    result = run_sweep(tmp_path, "--report", arg=":1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Report:" not in result.stdout
    assert not (tmp_path / "sweep" / "REPORT.md").exists()


SLOW_TRAIN = textwrap.dedent("""\
    import os, signal, sys, time
    workdir = dict(a.split("=", 1) for a in sys.argv[1:])["--workdir"]
    os.makedirs(workdir, exist_ok=True)

    def on_term(signum, frame):
        open(os.path.join(workdir, "terminated"), "w").close()
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(workdir, "started"), "w").close()
    time.sleep(120)
    """)


def test_sigterm_stops_the_runner_and_its_runs(tmp_path):
    """``kill`` of the runner must not leave a run behind to race a rerun."""
    process = subprocess.Popen(
        sweep_command(tmp_path, "--noreport", train=SLOW_TRAIN, arg=":1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    run = tmp_path / "sweep" / "tied=True,seed=0"
    # However slow the machine, the run is started before the runner is
    # stopped: the run waits for the signal (SLOW_TRAIN), the test for it.
    while not (run / "started").exists():
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.1)
    process.terminate()
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 1 and "Stopped by SIGTERM" in output, output
    assert (run / "terminated").exists()
    assert not (
        run / workdirs.STATUS_FILE
    ).exists()  # no exit recorded: a rerun resumes it


PINNED_TRAIN = textwrap.dedent("""\
    import json, os, sys, time
    workdir = dict(a.split("=", 1) for a in sys.argv[1:])["--workdir"]
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "cpus.json"), "w") as f:
        json.dump(sorted(os.sched_getaffinity(0)), f)
    time.sleep(0.5)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({}, f)
    """)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs 2 CPUs (Linux)",
)
def test_cpus_per_run_pins_concurrent_runs_to_cpus_of_their_own(tmp_path):
    result = run_sweep(
        tmp_path, "--parallel=2", "--cpus_per_run=1", "--noreport", train=PINNED_TRAIN
    )
    assert result.returncode == 0, result.stdout + result.stderr
    seen = []
    for run in workdirs.read_sweep(str(tmp_path / "sweep")):
        cpus = json.loads(pathlib.Path(run.workdir, "cpus.json").read_text())
        status = json.loads(pathlib.Path(run.workdir, workdirs.STATUS_FILE).read_text())
        assert len(cpus) == 1 and status["cpus"] == cpus
        assert (
            status["started"]
            < status["ended"]
            == pytest.approx(status["started"] + status["seconds"])
        )
        seen.append((run.interval, cpus[0]))
    # Runs that overlap in time ran on different CPUs.
    for (a, cpu_a), (b, cpu_b) in itertools.combinations(seen, 2):
        if a[0] < b[1] and b[0] < a[1]:
            assert cpu_a != cpu_b
    assert len({cpu for _, cpu in seen}) == 2


GROWING_SWEEP = textwrap.dedent("""\
    import os
    from lmhead.lab import sweeps

    def get_sweep(arg=None, workdir=None):
        # Seed 2 is planned once seeds 0 and 1 have finished.
        runs = [{"model.tied": True, "train.seed": seed} for seed in (0, 1)]
        if workdir and all(os.path.exists(os.path.join(workdir, name, "summary.json"))
                           for name in sweeps.run_names(runs)):
            runs.append({"model.tied": True, "train.seed": 2})
        return "tiny", runs
    """)


def test_runner_plans_again_from_the_results_until_the_plan_stops_growing(tmp_path):
    """The run planned once two have finished runs, and fails, once."""
    failing = "tied=True,seed=2"
    env = {"FAIL_RUN": failing}
    result = run_sweep(tmp_path, "--noreport", sweep=GROWING_SWEEP, env=env)
    assert result.returncode == 1 and "1 of 3 runs failed" in result.stdout
    names = [f"tied=True,seed={seed}" for seed in range(3)]
    assert [calls(tmp_path, name) for name in names] == [["start"]] * 3
    assert "2 runs in" in result.stdout and f"[3/3] {failing} FAILED" in result.stdout
    record = json.loads((tmp_path / "sweep" / workdirs.SWEEP_FILE).read_text())
    assert [run["name"] for run in record["runs"]] == names


def test_cpu_slots_are_disjoint_and_refuse_too_many():
    assert runner.cpu_slots(3, 0) == [None] * 3
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs os.sched_getaffinity (Linux)")
    available = sorted(os.sched_getaffinity(0))
    slots = runner.cpu_slots(len(available), 1)
    assert [sorted(s) for s in slots] == [[cpu] for cpu in available]
    with pytest.raises(ValueError, match=f"need {2 * len(available)} CPUs"):
        runner.cpu_slots(2, len(available))


# --- Ensembles (--ensemble=M) --------------------------------------------------


def read_json(path):
    return json.loads(pathlib.Path(path).read_text())


def test_ensemble_programs_run_once_each_rerun_failed_members_and_time_them(tmp_path):
    """Programs of at most 2 members, one process each; a program whose
    member failed runs again with the same members, skipping the finished
    one; then the same command runs nothing."""
    sweep_dir, failing = tmp_path / "sweep", "tied=False,seed=1"
    flags_ = ("--ensemble=2", "--noreport", "--parallel=2")
    result = run_sweep(tmp_path, *flags_, env={"FAIL_RUN": failing}, arg=":3")
    assert result.returncode == 1
    assert "6 runs in" in result.stdout
    assert "in 4 processes (4 programs of at most 2 members)" in result.stdout
    assert "start tied=True,ensemble=0 (2 members)" in result.stdout
    assert "FAILED: tied=False,ensemble=0 (2 members)" in result.stdout
    assert f"members not finished: {failing}\n" in result.stdout
    assert "trained 2 members" in result.stdout  # the program log's tail
    assert "1 of 4 processes failed" in result.stdout
    programs = {
        "tied=True,ensemble=0": [(True, 0), (True, 1)],
        "tied=True,ensemble=1": [(True, 2)],
        "tied=False,ensemble=0": [(False, 0), (False, 1)],
        "tied=False,ensemble=1": [(False, 2)],
    }
    for name, members in programs.items():
        program = sweep_dir / "ensembles" / name
        trained = [f"train tied={t},seed={s}" for t, s in members]
        assert calls(tmp_path, name, program=True) == ["start", *trained]
        assert (program / workdirs.LOG_FILE).read_text().startswith("=== ")
        status = read_json(program / workdirs.STATUS_FILE)
        assert status["returncode"] == int(name == "tied=False,ensemble=0")
        member_flags = [f for f in status["command"] if f.startswith("--member=")]
        assert len(member_flags) == len(members)
        assert not any(
            "train.seed" in f for f in status["command"] if f not in member_flags
        )
        for tied, seed in members:
            member = read_json(sweep_dir / f"tied={tied},seed={seed}" / "status.json")
            assert member == {
                **status,
                "ensemble": str(program),
                "members": len(members),
            }
    statuses = {r.name: r.status for r in workdirs.read_sweep(str(sweep_dir))}
    assert [name for name, s in statuses.items() if s != "finished"] == [failing]
    finished_member = read_json(sweep_dir / "tied=False,seed=0" / "status.json")

    assignment = (sweep_dir / "ensembles.json").read_text()
    result = run_sweep(tmp_path, *flags_, arg=":3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls(tmp_path, "tied=False,ensemble=0", program=True) == [
        "start",
        "train tied=False,seed=0",
        f"train {failing}",
        "resume",
        "skip tied=False,seed=0",
        f"train {failing}",
    ]
    # The member the rerun skipped keeps its own process's record.
    assert read_json(sweep_dir / "tied=False,seed=0" / "status.json") == finished_member
    rerun = read_json(sweep_dir / failing / "status.json")
    assert rerun["returncode"] == 0 and rerun["started"] > finished_member["ended"]
    runs = workdirs.read_sweep(str(sweep_dir))
    assert [r.status for r in runs] == ["finished"] * 6
    intervals = {r.name: r.interval for r in runs}
    assert intervals["tied=True,seed=0"] == intervals["tied=True,seed=1"]
    assert intervals["tied=True,seed=0"] != intervals["tied=True,seed=2"]
    # Each program's 30 s once, not each member's (the reports' total).
    assert workdirs.wall_seconds(runs) == 4 * 30.0

    result = run_sweep(tmp_path, *flags_, arg=":3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 finished before, 0 to run" in result.stdout
    assert calls(tmp_path, "tied=True,ensemble=0", program=True) == [
        "start",
        "train tied=True,seed=0",
        "train tied=True,seed=1",
    ]
    assert (sweep_dir / "ensembles.json").read_text() == assignment
