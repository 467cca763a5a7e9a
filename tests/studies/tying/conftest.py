"""The synthetic rows and their report, built once for the test files that
read them (``synthetic_rows.py``)."""

import pytest

from studies.tying import analysis
from tests.studies.tying import synthetic_rows


@pytest.fixture(scope="session")
def rows():
    return synthetic_rows.synthetic_rows()


@pytest.fixture(scope="session")
def reported(rows, tmp_path_factory):
    """``(text, plot paths, folder)`` of the synthetic rows' report."""
    out = tmp_path_factory.mktemp("report")
    text, plots = analysis.write_report(rows, str(out))
    return text, plots, out
