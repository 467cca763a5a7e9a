"""Fixtures of the service's tests: a tiny run trained once per session, and
its engine, warmed up once."""

import pytest

from configs import default
from lmhead.lm import generation, train
from lmhead.serve import engine as engine_lib
from tests.serve.tiny_run import BUCKETS


@pytest.fixture(scope="session")
def run(corpus, tmp_path_factory):
    """``(model, params, tokenizer)`` of a tiny run, 10 steps."""
    config = default.get_config("tiny")
    config.update_from_flattened_dict(
        {
            "data.path": corpus,
            "train.steps": 10,
            "train.eval_every": 10,
            "train.checkpoint_every": 10,
            "train.eval_batches": 1,
            "optim.warmup_steps": 2,
            "sample.num_samples": 0,
        }
    )
    workdir = str(tmp_path_factory.mktemp("serve") / "run")
    train.train_and_evaluate(config, workdir)
    _, tokenizer, model, params = generation.load_run(workdir)
    return model, params, tokenizer


@pytest.fixture(scope="session")
def engine(run):
    engine = engine_lib.Engine(*run, BUCKETS)
    engine.warm_up()
    return engine
