"""Fixtures shared by the test files."""

import pytest

from lmhead.lm import data


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A 20,000-character UTF-8 file cut from the embedded corpus."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(data.shakespeare_text()[:20_000], encoding="utf-8")
    return str(path)
