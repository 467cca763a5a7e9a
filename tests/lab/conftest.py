"""Fixtures of the sweep tooling's tests."""

import pytest

from tests.lab import synthetic_sweep


@pytest.fixture(scope="session")
def sweep_dir(tmp_path_factory):
    """The synthetic sweep directory of tests/lab/synthetic_sweep.py."""
    return synthetic_sweep.write_sweep(tmp_path_factory.mktemp("sweep"))
