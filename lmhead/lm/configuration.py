"""The experiment's config: loading it, checking it, flattening it, and the
model it describes.

``configs/default.py`` is the one list of config keys, each typed by its
default (a ``None`` placeholder also allows ``None``). :func:`validate_config`
refuses another key (naming the closest, :func:`check_config_keys`), a
missing one, a wrong type or a value out of range, before anything is read or
compiled; :func:`check_resumable` refuses to resume a workdir with another
config than its own, up to :data:`RESUMABLE_CHANGES`. :func:`load_config`
runs a config file's ``get_config(arg)``, :func:`flatten` gives dotted keys,
and :func:`make_model` builds the ``DecoderLM`` of ``config.model``. (The
head library's argument checks are ``lmhead/_checks.py``'s.)
"""

import difflib
import functools
import importlib.util
import json
import math
import os
from typing import Any

import jax.numpy as jnp
import ml_collections

from lmhead import fused, modules
from lmhead.lm import attention, checkpoints, mtp
from lmhead.lm import model as model_lib
from lmhead.lm.data import corpus

# The config file beside the package (lmhead/lm/ -> the repository); the
# repository is the installation (pip install -e .), as experiments/ and
# configs/ are not packaged.
REPOSITORY = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
CONFIG_FILE = os.path.join(REPOSITORY, "configs", "default.py")

# config.model.dtype: the compute dtype's name.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# The values of the string keys.
CHOICES = {
    "data.tokenizer": ("char", "bpe"),
    "data.split": ("tail", "works"),
    "model.positions": model_lib.POSITIONS,
    "model.dtype": tuple(DTYPES),
    "model.activation": model_lib.ACTIVATIONS,
    "model.attention_implementation": attention.IMPLEMENTATIONS,
    "model.mtp_design": mtp.DESIGNS,
    "model.mtp_unembedding": mtp.UNEMBEDDINGS,
    "loss.loss_impl": modules.LOSS_IMPLS,
    "loss.smoothing": ("uniform", "normalized"),
    "loss.filter_target": fused.FILTER_TARGETS,
    "loss.vocab_order": (None, "frequency", "mean_logit"),
}


def _ranges(config) -> dict[str, tuple[Any, Any, str]]:
    """Each number's ``(low, high, brackets)``; ``None`` is unbounded. Counts
    come first, since later bounds are made of them."""
    counts = (
        "model.num_layers",
        "model.num_heads",
        "model.d_model",
        "model.mlp_dim",
        "train.steps",
        "train.batch_size",
        "train.log_every",
        "train.eval_every",
        "train.checkpoint_every",
        "train.eval_batches",
        "train.microbatches",
        "train.vmap_members",
        "mesh.members",
        "sample.max_new_tokens",
        "sample.top_k",
        "loss.chunk_size",
    )
    return {
        **{name: (1, None, "[)") for name in counts},
        "data.block_size": (2, None, "[)"),
        "data.val_fraction": (0.0, 1.0, "()"),
        "data.test_fraction": (0.0, 1.0 - config.data.val_fraction, "()"),
        "data.train_fraction": (0.0, 1.0, "(]"),
        "data.tokenizer_fraction": (0.0, 1.0, "(]"),
        "data.train_offset": (0.0, 1.0, "[)"),
        "data.holdout_fraction": (0.0, 0.5, "[)"),
        "data.holdout_chunk": (1, None, "[)"),
        "train.eval_train_batches": (0, None, "[)"),
        "train.patience": (0, None, "[)"),
        "model.dropout_rate": (0.0, 1.0, "[)"),
        "model.mtp_heads": (0, None, "[)"),
        "loss.mtp_weight": (0.0, None, "[)"),
        "model.head_rank": (1, config.model.d_model, "[]"),
        "model.head_scale": (0.0, None, "()"),
        "model.logits_softcap": (0.0, None, "()"),
        "loss.label_smoothing": (0.0, 1.0, "[)"),
        "loss.z_loss": (0.0, None, "[)"),
        "mesh.data": (-1, None, "[)"),
        "mesh.model": (-1, None, "[)"),
        "optim.lr": (0.0, None, "()"),
        "optim.warmup_steps": (0, None, "[)"),
        "optim.min_lr": (0.0, config.optim.lr, "[]"),
        "optim.weight_decay": (0.0, None, "[)"),
        "optim.grad_clip": (0.0, None, "[)"),
        "optim.table_lr_multiplier": (0.0, None, "()"),
        "model.untie_step": (1, None, "[)"),
        "optim.b1": (0.0, 1.0, "[)"),
        "optim.b2": (0.0, 1.0, "[)"),
        "train.seed": (0, 2**31 - 1, "[]"),
        "sample.num_samples": (0, None, "[)"),
        "sample.temperature": (0.0, None, "[)"),
        "sample.top_p": (0.0, 1.0, "()"),
    }


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError/TypeError naming the first bad ``config`` value.

    Keys first: one that is not a config key (a typo in a config file) is a
    ValueError that names the closest valid keys. Then each value's type (as
    ``configs/default.py`` has it; floats must be finite), range and choices,
    and the rules between values.

    Examples:
        >>> validate_config(ml_collections.ConfigDict({"data": {}}))
        Traceback (most recent call last):
        ...
        ValueError: config.data.block_size is missing; configs/default.py has every key.
    """
    values = flatten(config)
    types = default_types()
    check_config_keys(values, types)
    for name, (kind, optional) in types.items():
        if name not in values:
            raise ValueError(
                f"config.{name} is missing; configs/default.py has every key."
            )
        if kind is not object:  # placeholder(object): a rule of its own below
            _check_type(name, values[name], kind, optional)
    for name, (low, high, brackets) in _ranges(config).items():
        if values[name] is not None:
            _check_range(name, values[name], low, high, brackets)
    for name, choices in CHOICES.items():
        if values[name] not in choices:
            raise ValueError(
                f"config.{name} must be one of "
                f"{', '.join(map(repr, choices))}; got {values[name]!r}."
            )
    _check_rules_between_values(config)


def _check_rules_between_values(config) -> None:
    """What one value allows of another, and values no range describes."""
    corpus.check_train_range(config.data.train_offset, config.data.train_fraction)
    if config.data.tokenizer == "bpe":
        _check_type("data.vocab_size", config.data.vocab_size, int, False)
        _check_range("data.vocab_size", config.data.vocab_size, 256, 2**31 - 1, "[]")
    elif config.data.vocab_size is not None:
        raise ValueError(
            "config.data.vocab_size is for tokenizer='bpe' only; "
            "the character vocabulary comes from the text."
        )
    if config.train.test_eval and config.data.split == "tail":
        raise ValueError(
            "config.train.test_eval needs a test split: config.data.split='works'."
        )
    if config.model.untie_step is not None and config.model.tied:
        raise ValueError(
            "config.model.untie_step unties a head that starts tied, which "
            "needs the untied model's own head: config.model.tied=False; got "
            f"untie_step={config.model.untie_step} with tied=True."
        )
    if config.model.untie_step is not None and config.model.head_rank is not None:
        raise ValueError(
            "config.model.untie_step copies a [V, D] table into the head, and "
            "a factorized head (config.model.head_rank) has none; got "
            f"untie_step={config.model.untie_step} with "
            f"head_rank={config.model.head_rank}."
        )
    if config.optim.warmup_steps >= config.train.steps:
        raise ValueError(
            f"config.optim.warmup_steps ({config.optim.warmup_steps}) must end "
            f"before config.train.steps ({config.train.steps}): set "
            "--config.optim.warmup_steps below it, or give the steps as "
            "configs/default.py's steps=N, which shortens the warmup to N // 2."
        )
    if config.model.d_model % config.model.num_heads:
        raise ValueError(
            "config.model.num_heads must divide config.model."
            f"d_model; got {config.model.num_heads} and "
            f"{config.model.d_model}."
        )
    head_dim = config.model.d_model // config.model.num_heads
    if config.model.attention_implementation == "cudnn" and not attention.cudnn_takes(
        DTYPES[config.model.dtype], head_dim
    ):
        raise ValueError(
            "config.model.attention_implementation='cudnn' needs "
            "config.model.dtype='bfloat16' and a head size (d_model / "
            f"num_heads) that is a multiple of 8 up to "
            f"{attention.CUDNN_MAX_HEAD_DIM}; got dtype="
            f"{config.model.dtype!r}, head size {head_dim}. 'auto' picks "
            "cuDNN's where it runs."
        )
    if config.loss.chunk_size is not None and config.loss.loss_impl == "materialized":
        raise ValueError(
            "config.loss.chunk_size is not used by loss_impl="
            "'materialized'; leave it unset."
        )
    _check_filter_eps(config.loss)
    _check_vocab_order(config.loss)
    for name in ("data", "model"):
        if config.mesh[name] == 0:
            raise ValueError(
                f"config.mesh.{name} must be a number of devices "
                ">= 1, or -1 for all the others; got 0."
            )
    if config.train.batch_size % config.train.microbatches:
        raise ValueError(
            "config.train.microbatches must divide config.train."
            f"batch_size; got {config.train.microbatches} and "
            f"{config.train.batch_size}."
        )
    if not config.sample.prompt:
        raise ValueError("config.sample.prompt must not be empty.")


def _check_filter_eps(loss) -> None:
    """``loss.filter_eps``: None, a finite number >= 0 or "auto", and only
    for the fused loss (the one whose sweep filters)."""
    eps = loss.filter_eps
    if eps is None:
        return
    if eps != "auto" and (isinstance(eps, bool) or not isinstance(eps, (int, float))):
        raise TypeError(
            "config.loss.filter_eps must be None, a number >= 0 or 'auto'; "
            f"got {eps!r}."
        )
    if eps != "auto":
        _check_range("loss.filter_eps", eps, 0.0, None, "[)")
        if not math.isfinite(eps):
            raise ValueError(f"config.loss.filter_eps must be finite; got {eps!r}.")
    if loss.loss_impl != "fused":
        raise ValueError(
            "config.loss.filter_eps filters the gradient of loss_impl='fused' "
            f"only; got filter_eps={eps!r} with loss_impl={loss.loss_impl!r}."
        )


def _check_vocab_order(loss) -> None:
    """``loss.vocab_order`` orders the sweep of ``loss_impl="fused"`` only."""
    if loss.get("vocab_order") is not None and loss.loss_impl != "fused":
        raise ValueError(
            "config.loss.vocab_order orders the sweep of loss_impl='fused' only; "
            f"got vocab_order={loss.vocab_order!r} with "
            f"loss_impl={loss.loss_impl!r}."
        )


def _check_type(name: str, value: Any, kind: type, optional: bool) -> None:
    """``kind`` or, when ``optional``, None; an int is a float, a bool is
    not an int; a float is finite."""
    if value is None and optional:
        return
    kinds = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kinds):
        raise TypeError(
            f"config.{name} must be {kind.__name__}"
            f"{' or None' if optional else ''}; got {value!r}."
        )
    if kind is float and not math.isfinite(value):
        raise ValueError(f"config.{name} must be finite; got {value!r}.")


def _check_range(name: str, value, low, high, brackets: str) -> None:
    """``value`` in the interval ``brackets[0] low, high brackets[1]``."""
    too_low = low is not None and (value <= low if brackets[0] == "(" else value < low)
    too_high = high is not None and (
        value >= high if brackets[1] == ")" else value > high
    )
    if too_low or too_high:
        interval = (
            f"{brackets[0]}{'-inf' if low is None else low}, "
            f"{'inf' if high is None else high}{brackets[1]}"
        )
        raise ValueError(f"config.{name} must be in {interval}; got {value!r}.")


def load_config(
    arg: str | None = None, path: str = CONFIG_FILE
) -> ml_collections.ConfigDict:
    """``get_config(arg)`` of the config file ``path``, as ``--config=path:arg``
    gives it.

    Examples:
        >>> load_config("tiny").train.steps
        40
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: no such config file (lmhead reads "
            "configs/default.py from its repository)."
        )
    return load_module(path).get_config(arg)


def load_module(path: str):
    """Imports the Python file ``path`` (a config or sweep file) as a module."""
    module_spec = importlib.util.spec_from_file_location(
        os.path.splitext(os.path.basename(path))[0], path
    )
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@functools.cache
def default_types() -> dict[str, tuple[type, bool]]:
    """Every config key, dotted, with ``(type, optional)`` from the defaults
    of ``configs/default.py``: optional keys default to ``None``.

    Examples:
        >>> {k: v for k, v in default_types().items() if k.startswith("mesh.")}
        {'mesh.data': (<class 'int'>, False), 'mesh.members': (<class 'int'>, True), 'mesh.model': (<class 'int'>, False)}
        >>> default_types()["sample.top_k"]
        (<class 'int'>, True)
    """
    config = load_config()
    types = {}
    for name, value in flatten(config).items():
        *sections, key = name.split(".")
        parent = functools.reduce(lambda c, k: c[k], sections, config)
        types[name] = (parent.get_type(key), value is None)
    return types


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
            hint = (
                "valid keys: "
                + ", ".join(same_section or sorted({k.split(".")[0] for k in valid}))
                + "."
            )
        raise ValueError(f"config.{name} is not a config key; {hint}")


def flatten(nested, prefix: str = "") -> dict[str, Any]:
    """A nested dict or ConfigDict as ``{dotted key: leaf}``.

    Examples:
        >>> flatten({"model": {"tied": True, "d_model": 64}, "seed": 0})
        {'model.tied': True, 'model.d_model': 64, 'seed': 0}
    """
    flat = {}
    for key, value in nested.items():
        if isinstance(value, (dict, ml_collections.ConfigDict)):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# What a resumed run may change: how often it logs, evaluates, checkpoints,
# what it samples, the devices, and how (not what) the loss and the attention
# are computed. Every
# other key -- the data, the model, the objective, the optimizer, the batch,
# the seed and train.steps (the cosine schedule ends there) -- is part of
# what the run's checkpoints mean.
RESUMABLE_CHANGES = (
    "train.log_every",
    "train.eval_every",
    "train.checkpoint_every",
    "train.eval_batches",
    "train.eval_train_batches",
    "train.test_eval",
    "train.stop_on_nonfinite",
    "train.microbatches",
    "train.vmap_members",
    "model.attention_implementation",
    "loss.loss_impl",
    "loss.chunk_size",
    "loss.vocab_order",
    "mesh.data",
    "mesh.model",
    "mesh.members",
    "sample.num_samples",
    "sample.max_new_tokens",
    "sample.temperature",
    "sample.top_k",
    "sample.top_p",
    "sample.prompt",
)


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
    if not (os.path.isfile(path) and checkpoints.has_saved_step(workdir)):
        return
    with open(path) as f:
        saved = flatten(json.load(f))
    current = flatten(json.loads(config.to_json()))
    changed = [
        f"{key}: {saved[key]!r} there, {current[key]!r} now"
        for key in sorted(saved.keys() & current.keys())
        if saved[key] != current[key] and key not in RESUMABLE_CHANGES
    ]
    if changed:
        raise ValueError(
            f"{workdir} holds checkpoints of another config, so it cannot be "
            f"resumed with this one ({'; '.join(changed)}). A resumed run "
            "continues the same run; only "
            f"{', '.join(RESUMABLE_CHANGES)} may change. Use a fresh --workdir, "
            f"or the values in {path}."
        )


def make_model(
    config: ml_collections.ConfigDict, vocab_size: int
) -> model_lib.DecoderLM:
    """The ``DecoderLM`` of ``config.model``; its ``max_len`` is the block size.

    ``model.untie_step`` is the training step's, not the model's: the model
    is the untied one throughout (``train.train_step`` ties it before then).
    """
    values = {k: v for k, v in config.model.to_dict().items() if k != "untie_step"}
    return model_lib.DecoderLM(
        vocab_size=vocab_size,
        max_len=config.data.block_size,
        **{**values, "dtype": DTYPES[config.model.dtype]},
    )
