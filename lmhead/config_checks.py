"""Checks of a training config: its keys, each value's type and range, and
whether a workdir may be resumed with it.

:func:`validate_config` refuses a bad config before anything is read or
compiled; a key that is not a config key (a typo in a config file) names the
closest valid keys (:func:`check_config_keys`). :func:`check_resumable`
refuses to resume a workdir with another config than the one that made it,
up to the keys in ``RESUMABLE_CHANGES``.
"""

import dataclasses
import difflib
import functools
import json
import math
import os
from typing import Any

import jax.numpy as jnp
import ml_collections

from lmhead import model as model_lib
from lmhead import modules

# config.model.dtype: the compute dtype's name.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError/TypeError naming the first bad ``config`` value.

    Keys first: one that is not a config key (a typo in a config file) is a
    ValueError that names the closest valid keys. Then each value's type and
    range; floats must be finite.

    Examples:
        >>> validate_config(ml_collections.ConfigDict({"data": {}}))
        Traceback (most recent call last):
        ...
        ValueError: config.data.path is missing; configs/default.py has every key.
    """
    check_config_keys(flat_keys(config), config_keys())
    check = functools.partial(_check_value, config)
    _check_data_model_and_counts(config, check)
    _check_loss_and_mesh(config, check)
    _check_optim_train_and_sample(config, check)


def _check_data_model_and_counts(config, check) -> None:
    """``data.*``, ``model.*`` and every count that must be >= 1; the counts
    come first because later checks divide by or compare with them."""
    check("data.path", str)
    check("data.tokenizer", str, choices=("char", "bpe"))
    if config.data.tokenizer == "bpe":
        check("data.vocab_size", int, low=256, high=2**31 - 1)
    elif config.data.vocab_size is not None:
        raise ValueError("config.data.vocab_size is for tokenizer='bpe' only; "
                         "the character vocabulary comes from the text.")
    check("data.val_fraction", float, low=0.0, high=1.0, open_range=True)
    check("data.block_size", int, low=2)
    for name in ("model.num_layers", "model.num_heads",
                 "model.d_model", "model.mlp_dim", "train.steps",
                 "train.batch_size", "train.log_every", "train.eval_every",
                 "train.checkpoint_every",
                 "sample.max_new_tokens"):
        check(name, int, low=1)
    if config.model.d_model % config.model.num_heads:
        raise ValueError("config.model.num_heads must divide config.model."
                         f"d_model; got {config.model.num_heads} and "
                         f"{config.model.d_model}.")
    check("model.dropout_rate", float, low=0.0, high=1.0, high_open=True)
    check("model.tied", bool)
    check("model.positions", str, choices=model_lib.POSITIONS)
    check("model.head_bias", bool)
    check("model.head_scale", float, low=0.0, open_range=True, optional=True)
    check("model.logits_softcap", float, low=0.0, open_range=True, optional=True)
    check("model.dtype", str, choices=tuple(DTYPES))


def _check_loss_and_mesh(config, check) -> None:
    """``loss.*`` and the mesh's axis sizes."""
    check("loss.loss_impl", str, choices=modules.LOSS_IMPLS)
    check("loss.label_smoothing", float, low=0.0, high=1.0, high_open=True)
    check("loss.smoothing", str, choices=("uniform", "normalized"))
    check("loss.z_loss", float, low=0.0)
    check("loss.chunk_size", int, low=1, optional=True)
    if config.loss.chunk_size is not None and config.loss.loss_impl == "materialized":
        raise ValueError("config.loss.chunk_size is not used by loss_impl="
                         "'materialized'; leave it unset.")
    for name in ("mesh.data", "mesh.model"):
        check(name, int, low=-1)
        if config.mesh[name.split(".")[1]] == 0:
            raise ValueError(f"config.{name} must be a number of devices >= 1, "
                             "or -1 for all the others; got 0.")


def _check_optim_train_and_sample(config, check) -> None:
    """``optim.*``, the rest of ``train.*`` and ``sample.*``."""
    check("optim.lr", float, low=0.0, open_range=True)
    check("optim.warmup_steps", int, low=0, high=config.train.steps - 1)
    check("optim.min_lr", float, low=0.0, high=config.optim.lr)
    for name in ("optim.weight_decay", "optim.grad_clip"):
        check(name, float, low=0.0)
    for name in ("optim.b1", "optim.b2"):
        check(name, float, low=0.0, high=1.0, high_open=True)
    check("train.eval_batches", int, low=1, optional=True)
    check("train.microbatches", int, low=1)
    if config.train.batch_size % config.train.microbatches:
        raise ValueError("config.train.microbatches must divide config.train."
                         f"batch_size; got {config.train.microbatches} and "
                         f"{config.train.batch_size}.")
    check("train.seed", int, low=0, high=2**31 - 1)
    check("train.stop_on_nonfinite", bool)
    check("sample.num_samples", int, low=0)
    check("sample.temperature", float, low=0.0)
    check("sample.top_k", int, low=1, optional=True)
    check("sample.top_p", float, low=0.0, high=1.0, open_range=True,
          optional=True)
    check("sample.prompt", str)
    if not config.sample.prompt:
        raise ValueError("config.sample.prompt must not be empty.")


def _check_value(config, name: str, kind: type, *, choices=None, low=None,
                 high=None, open_range: bool = False, high_open: bool = False,
                 optional: bool = False) -> None:
    """One value's type, choices and range; ``open_range`` opens both ends."""
    value = config
    for key in name.split("."):
        if key not in value:
            raise ValueError(f"config.{name} is missing; configs/default.py "
                             "has every key.")
        value = value[key]
    if value is None and optional:
        return
    kinds = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kinds):
        raise TypeError(f"config.{name} must be {kind.__name__}"
                        f"{' or None' if optional else ''}; got {value!r}.")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"config.{name} must be finite; got {value!r}.")
    if choices is not None and value not in choices:
        raise ValueError(f"config.{name} must be one of "
                         f"{', '.join(map(repr, choices))}; got {value!r}.")
    high_open = high_open or open_range
    too_low = low is not None and (value <= low if open_range else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        interval = (f"{'(' if open_range else '['}{low if low is not None else '-inf'}"
                    f", {high if high is not None else 'inf'}"
                    f"{')' if high_open or high is None else ']'}")
        raise ValueError(f"config.{name} must be in {interval}; got {value!r}.")


# The keys of each config section; "model" holds DecoderLM's attributes but
# vocab_size and max_len (the tokenizer's and data.block_size).
CONFIG_SECTIONS = {
    "data": ("path", "tokenizer", "vocab_size", "val_fraction", "block_size"),
    "loss": ("loss_impl", "label_smoothing", "smoothing", "z_loss", "chunk_size"),
    "optim": ("lr", "warmup_steps", "min_lr", "weight_decay", "b1", "b2",
              "grad_clip"),
    "mesh": ("data", "model"),
    "train": ("steps", "batch_size", "microbatches", "seed", "log_every",
              "eval_every", "checkpoint_every", "eval_batches",
              "stop_on_nonfinite"),
    "sample": ("num_samples", "max_new_tokens", "temperature", "top_k", "top_p",
               "prompt"),
}
# What a resumed run may change: how often it logs, evaluates, checkpoints,
# what it samples, the devices, and how (not what) the loss is computed. Every
# other key -- the data, the model, the objective, the optimizer, the batch,
# the seed and train.steps (the cosine schedule ends there) -- is part of
# what the run's checkpoints mean.
RESUMABLE_CHANGES = (
    "train.log_every", "train.eval_every", "train.checkpoint_every",
    "train.eval_batches", "train.stop_on_nonfinite", "loss.loss_impl",
    "loss.chunk_size", "train.microbatches", "mesh.data", "mesh.model",
    "sample.num_samples",
    "sample.max_new_tokens", "sample.temperature", "sample.top_k",
    "sample.top_p", "sample.prompt")


def config_keys() -> set[str]:
    """Every valid dotted config key, e.g. ``"model.tied"``.

    Examples:
        >>> sorted(k for k in config_keys() if k.startswith("mesh."))
        ['mesh.data', 'mesh.model']
    """
    model_keys = {f.name for f in dataclasses.fields(model_lib.DecoderLM)
                  if f.init} - {"vocab_size", "max_len", "parent", "name"}
    return {f"{section}.{key}" for section, keys in
            {**CONFIG_SECTIONS, "model": model_keys}.items() for key in keys}


def check_config_keys(names, valid) -> None:
    """Raises ValueError for the first of ``names`` not in ``valid``.

    The message names the closest valid keys (``difflib``), or the keys of
    the section when none is close.

    Examples:
        >>> check_config_keys(["train.stpes"], {"train.steps", "train.seed"})
        Traceback (most recent call last):
        ...
        ValueError: config.train.stpes is not a config key; did you mean config.train.steps or config.train.seed?
    """
    valid = sorted(valid)
    for name in names:
        if name in valid:
            continue
        close = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
        if close:
            hint = "did you mean " + " or ".join(f"config.{k}" for k in close) + "?"
        else:
            section = name.split(".")[0] + "."
            same_section = [k for k in valid if k.startswith(section)]
            hint = "valid keys: " + ", ".join(
                same_section or sorted({k.split(".")[0] for k in valid})) + "."
        raise ValueError(f"config.{name} is not a config key; {hint}")


def flat_keys(config) -> list[str]:
    """Dotted names of the leaves of a (nested) ConfigDict or dict.

    Examples:
        >>> flat_keys({"train": {"steps": 10, "seed": 0}, "name": "x"})
        ['train.steps', 'train.seed', 'name']
    """
    names = []
    for key, value in config.items():
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            names += [f"{key}.{name}" for name in flat_keys(value)]
        else:
            names.append(key)
    return names


def _flat_values(config: dict) -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in _flat_values(value).items()})
        else:
            flat[key] = value
    return flat


def check_resumable(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Refuses to resume ``workdir`` with a config other than its own.

    Only a workdir with a checkpoint is checked, against its ``config.json``.
    Keys in ``RESUMABLE_CHANGES`` may differ; so may keys that only one of
    the two configs has (a config written by older code): the checkpoint's
    own shapes are checked when it is restored.

    Raises:
        ValueError: naming each changed key with both values.
    """
    path = os.path.join(workdir, "config.json")
    checkpoints = os.path.join(workdir, "checkpoints")
    if not (os.path.isfile(path) and os.path.isdir(checkpoints) and any(
            name.isdigit() for name in os.listdir(checkpoints))):
        return
    with open(path) as f:
        saved = _flat_values(json.load(f))
    current = _flat_values(json.loads(config.to_json()))
    changed = [f"{key}: {saved[key]!r} there, {current[key]!r} now"
               for key in sorted(saved.keys() & current.keys())
               if saved[key] != current[key] and key not in RESUMABLE_CHANGES]
    if changed:
        raise ValueError(
            f"{workdir} holds checkpoints of another config, so it cannot be "
            f"resumed with this one ({'; '.join(changed)}). A resumed run "
            "continues the same run; only "
            f"{', '.join(RESUMABLE_CHANGES)} may change. Use a fresh --workdir, "
            f"or the values in {path}.")
