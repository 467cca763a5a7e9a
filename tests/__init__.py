"""The test suite; its folders mirror ``lmhead/`` and ``experiments/``."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository's root, where the commands of ``experiments/`` are run."""


def run_experiment(
    script: str, *flags: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python experiments/<script> <flags>`` run from :data:`ROOT`, its
    stdout and stderr captured as text; ``script`` may be in a subfolder
    (``"bench/bench_head.py"``)."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", script), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
