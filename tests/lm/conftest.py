"""Helpers and fixtures shared by the tests of lmhead/lm: the tiny config, a
run's metrics, and the states and runs that several files read, made once
per worker (session scope)."""

import functools
import json
import os

import jax
import pytest

from configs import default
from lmhead.lm import configuration, monitoring
from lmhead.lm import state as state_lib


def tiny_config(**overrides):
    """``configs/default.py:tiny`` with ``{"section.key": value}`` overrides."""
    config = default.get_config("tiny")
    for name, value in overrides.items():
        section, key = name.split(".")
        config[section][key] = value
    return config


def read_metrics(workdir, drop=monitoring.MEASURED_METRICS):
    """Each line of ``workdir/metrics.jsonl``, without the keys ``drop``
    (by default the measured timings and memory, which differ run to run)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [
            {k: v for k, v in json.loads(line).items() if k not in drop} for line in f
        ]


def init_state(config, key, vocab_size=84):
    """The initial train state of ``config``'s model, compiled."""
    model = configuration.make_model(config, vocab_size=vocab_size)
    return jax.jit(functools.partial(state_lib.create_train_state, model, config))(key)


def without_key_bias(tree):
    """``tree`` (parameters, or a moment of them) with the attention's key
    biases zeroed, for comparing two runs: with learned positions (the tiny
    config's; not RoPE, which rotates it by the key's position) a key bias
    adds ``q . b`` to each of a query's logits, which its softmax ignores, so
    its gradient is 0 but for float32 rounding, which Adam scales to whole
    steps. Two programs that round differently then move it apart however
    equal they are."""

    def zeroed(path, leaf):
        if [getattr(k, "key", None) for k in path[-2:]] != ["qkv", "bias"]:
            return leaf
        width = leaf.shape[-1] // 3  # query, key, value (lmhead/lm/layers.py)
        return leaf.at[..., width : 2 * width].set(0)

    return jax.tree_util.tree_map_with_path(zeroed, tree)


@pytest.fixture(scope="session")
def untied_state():
    """The tiny untied model with a head bias: ``(config, initial state)``."""
    config = tiny_config(**{"model.tied": False, "model.head_bias": True})
    return config, init_state(config, jax.random.key(0))
