"""experiments/bench/gpu_checks.sh, the GPU measurements in one command:
at --quick sizes on this CPU, every benchmark runs and leaves its output."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@pytest.mark.slow
def test_quick_checks_run_and_leave_their_outputs(tmp_path):
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "experiments", "bench", "gpu_checks.sh")],
        cwd=ROOT,
        env=dict(os.environ, OUT=str(tmp_path), QUICK="1", PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== 0 of 7 failed" in done.stdout
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "attention.txt",
        "decode.txt",
        "ensemble_gpu.txt",
        "head_filter.txt",
        "head_gemma2.txt",
        "head_post_training.txt",
        "machine.txt",
        "speculative.txt",
    ]
    assert "| tiles skipped |" in (tmp_path / "head_filter.txt").read_text()
    assert "Post-training, grpo" in (tmp_path / "head_post_training.txt").read_text()
    assert "member-steps/s" in (tmp_path / "ensemble_gpu.txt").read_text()
    assert "| stream k=16 |" in (tmp_path / "decode.txt").read_text()
    assert "jax" in (tmp_path / "machine.txt").read_text()
    assert "| float32 | jax xla |" in (tmp_path / "attention.txt").read_text()
    assert (
        "| GPT-2 small layout, random |" in (tmp_path / "speculative.txt").read_text()
    )


@pytest.mark.slow
def test_a_failing_check_is_counted_and_the_next_still_runs(tmp_path):
    # A python that fails every benchmark: the script reports each.
    fake = tmp_path / "python"
    fake.write_text(
        '#!/bin/sh\ncase "$1" in -c) exec "$REAL" "$@";; *) exit 3;; esac\n'
    )
    fake.chmod(0o755)
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "experiments", "bench", "gpu_checks.sh")],
        cwd=ROOT,
        env=dict(
            os.environ, OUT=str(tmp_path / "out"), PYTHON=str(fake), REAL=sys.executable
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 7
    assert "== head_gemma2: exit 3" in done.stdout
    assert "== head_post_training: exit 3" in done.stdout
    assert "== head_filter: exit 3" in done.stdout
    assert "== ensemble_gpu: exit 3" in done.stdout
    assert "== decode: exit 3" in done.stdout
    assert "== speculative: exit 3" in done.stdout
    assert "== attention: exit 3" in done.stdout


def run_checks(tmp_path, checks, python):
    return subprocess.run(
        ["bash", os.path.join(ROOT, "experiments", "bench", "gpu_checks.sh")],
        cwd=ROOT,
        env=dict(os.environ, OUT=str(tmp_path), CHECKS=checks, PYTHON=python),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_checks_runs_the_named_ones_and_refuses_an_unknown_name(tmp_path):
    # A python that fails every benchmark: only the named checks are tried.
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$1" in -c) exit 0;; *) exit 3;; esac\n')
    fake.chmod(0o755)
    done = run_checks(tmp_path / "out", "head_filter decode", str(fake))
    assert done.returncode == 2
    tried = [line for line in done.stdout.splitlines() if ": exit 3" in line]
    assert [line.split(":")[0] for line in tried] == ["== head_filter", "== decode"]
    unknown = run_checks(tmp_path / "out", "head_filter nope", str(fake))
    assert unknown.returncode == 2
    assert "CHECKS: no check nope" in unknown.stderr
    assert not unknown.stdout
