"""The synthetic study directory (``synthetic_study.py`` here), reported once
through ``experiments/report.py`` for every test file of the study."""

import os
import subprocess
import sys

import pytest

from tests import ROOT
from tests.studies.tying import synthetic_study


@pytest.fixture(scope="package")
def study_dir(tmp_path_factory):
    """``(design, sweep directory)`` of the synthetic study."""
    root = tmp_path_factory.mktemp("study") / "runs"
    root.mkdir()
    return synthetic_study.write_study(root), root


@pytest.fixture(scope="package")
def study_report(study_dir):
    """``(design, the report's directory, REPORT.md's text, the command's
    stdout)`` of the synthetic study, reported by the report command."""
    design, runs = study_dir
    docs = runs.parent / "docs"
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "experiments", "report.py"),
            f"--workdir={runs}",
            f"--out={docs}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return design, docs, (docs / "REPORT.md").read_text(), result.stdout
