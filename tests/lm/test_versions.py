"""Tests for lmhead/lm/versions.py: the record of the software and devices."""

import importlib.metadata
import json
import os
import platform

import jax

from lmhead.lm import versions


def test_versions_are_the_installed_ones():
    record = versions.versions()
    assert record["python"] == platform.python_version()
    for name in versions.PACKAGES:
        assert record[name] == importlib.metadata.version(name)
    assert record["backend"] == jax.default_backend()
    assert record["device_count"] == jax.device_count()


def test_write_versions(tmp_path):
    versions.write_versions(str(tmp_path))
    with open(os.path.join(tmp_path, versions.VERSIONS_FILE)) as f:
        assert json.load(f) == versions.versions()
