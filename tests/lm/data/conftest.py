"""Fixtures of the data tests: the embedded corpus, text files and
``config.data`` sections."""

import ml_collections
import pytest

from lmhead.lm import data


@pytest.fixture(scope="session")
def shakespeare():
    return data.shakespeare_text()


@pytest.fixture(scope="session")
def works():
    return data.shakespeare_works()


@pytest.fixture
def text_file(tmp_path):
    """Writes a UTF-8 file in the test's folder; returns its path."""

    def write(text, name="corpus.txt"):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return str(path)

    return write


@pytest.fixture(scope="session")
def data_config():
    """Makes a ``config.data`` section: the embedded corpus, ``split="tail"``,
    characters, block size 8, with ``overrides``."""

    def make(**overrides):
        values = dict(
            path="",
            split="tail",
            tokenizer="char",
            vocab_size=None,
            val_fraction=0.1,
            test_fraction=0.1,
            train_fraction=1.0,
            block_size=8,
        )
        values.update(overrides)
        return ml_collections.ConfigDict(values)

    return make
