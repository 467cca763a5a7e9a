"""Fixtures of the service's tests: the session's tiny run (the top
conftest.py's ``finished_run``), loaded, and its engine, warmed up once; and
a wider engine of a random model for structured output and chat."""

import string

import jax
import jax.numpy as jnp
import pytest

from lmhead.lm import data, generation
from lmhead.lm import model as model_lib
from lmhead.serve import engine as engine_lib
from lmhead.serve import requests
from tests.serve.tiny_run import BUCKETS

WIDE_BUCKETS = requests.Buckets(
    batch_sizes=(1, 4), prompt_lengths=(8, 32, 64), new_tokens=(8,)
)


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


@pytest.fixture(scope="session")
def wide_engine():
    """An engine of a random model of a 64-token context over printable
    characters and the end-of-text token, room enough for structured output
    and chat templates, warmed up once."""
    tokenizer = data.CharTokenizer.train(string.printable, data.END_OF_TEXT)
    model = model_lib.DecoderLM(
        vocab_size=tokenizer.vocab_size, num_layers=1, num_heads=2, d_model=16,
        mlp_dim=32, max_len=64,
    )  # fmt: skip
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64), jnp.int32))
    engine = engine_lib.Engine(model, params["params"], tokenizer, WIDE_BUCKETS)
    engine.warm_up()
    return engine
