"""Fixtures of the service's tests: the session's tiny run (the top
conftest.py's ``finished_run``), loaded, and its engine, warmed up once."""

import pytest

from lmhead.lm import generation
from lmhead.serve import engine as engine_lib
from tests.serve.tiny_run import BUCKETS


@pytest.fixture(scope="session")
def run(finished_run):
    """``(model, params, tokenizer)`` of the tiny run, 10 steps."""
    _, tokenizer, model, params = generation.load_run(finished_run)
    return model, params, tokenizer


@pytest.fixture(scope="session")
def engine(run):
    engine = engine_lib.Engine(*run, BUCKETS)
    engine.warm_up()
    return engine
