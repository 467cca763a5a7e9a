"""The test suite; its folders mirror ``lmhead/`` and ``experiments/``."""

import os
import re
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


FUSION_EMITTERS = "xla_cpu_use_fusion_emitters"
"""XLA's CPU flag that chooses between its fusion emitters (conftest.py)."""

DEFAULT_EMITTERS = {FUSION_EMITTERS: True}
"""``compiler_options`` that compile a program with XLA's default CPU fusion
emitters, the ones users' programs get, where the suite's flags
(tests/conftest.py) choose faster ones (LLVM's optimizations stay off): for
the tests whose claim is bitwise equality of two programs' results."""


def devices_environment(devices: int) -> dict[str, str]:
    """The environment of a subprocess with ``devices`` simulated CPU devices
    that imports the repository: the suite's own ``XLA_FLAGS`` (conftest.py)
    with its device count in place of any, so that what it computes compares
    with what the suite computes in process."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S*",
        "",
        os.environ.get("XLA_FLAGS", ""),
    )
    return dict(
        os.environ,
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
    )
