"""The sweep-file API: grids of config overrides (:func:`sweep`,
:func:`product`, :func:`zipped`), a sweep file's argument
(:func:`parse_arg`) and plan (:func:`load_sweep`), run names
(:func:`run_names`) and train commands (:func:`train_command`). What a
sweep file (``configs/sweeps/*.py``) defines is in ``docs/sweeps.md``.
"""

import hashlib
import inspect
import itertools
import os
import re
from collections.abc import Sequence
from typing import Any

from lmhead.lm.configuration import load_module

# Directory names stay below common 255-byte file name limits.
MAX_NAME_LENGTH = 160

Overrides = dict[str, Any]


# --- Building a sweep ------------------------------------------------------


def sweep(name: str, values: Sequence[Any]) -> list[Overrides]:
    """One axis: a run per value of the config key ``name``.

    Examples:
        >>> sweep("model.tied", [True, False])
        [{'model.tied': True}, {'model.tied': False}]
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a config key like 'model.tied'; got {name!r}.")
    return [{name: value} for value in values]


def product(*axes: Sequence[Overrides]) -> list[Overrides]:
    """Every combination of one entry per axis; the last axis varies fastest.

    Args:
        *axes: lists of override dicts (from :func:`sweep`, :func:`zipped`, or
            written out); the axes must not set the same key.

    Examples:
        >>> product(sweep("model.tied", [True, False]),
        ...         [{"data.tokenizer": "char"},
        ...          {"data.tokenizer": "bpe", "data.vocab_size": 512}])  # doctest: +NORMALIZE_WHITESPACE
        [{'model.tied': True, 'data.tokenizer': 'char'},
         {'model.tied': True, 'data.tokenizer': 'bpe', 'data.vocab_size': 512},
         {'model.tied': False, 'data.tokenizer': 'char'},
         {'model.tied': False, 'data.tokenizer': 'bpe', 'data.vocab_size': 512}]
    """
    return [
        _merge_axis_entries(combination) for combination in itertools.product(*axes)
    ]


def zipped(*axes: Sequence[Overrides]) -> list[Overrides]:
    """Entry ``i`` of every axis together; the axes must have equal lengths.

    Examples:
        >>> zipped(sweep("model.d_model", [64, 128]), sweep("model.mlp_dim", [256, 512]))
        [{'model.d_model': 64, 'model.mlp_dim': 256}, {'model.d_model': 128, 'model.mlp_dim': 512}]
    """
    lengths = [len(axis) for axis in axes]
    if len(set(lengths)) > 1:
        raise ValueError(f"zipped needs axes of equal length; got lengths {lengths}.")
    return [_merge_axis_entries(entries) for entries in zip(*axes)]


def _merge_axis_entries(entries: Sequence[Overrides]) -> Overrides:
    merged = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise TypeError(
                f"An axis entry must be a dict of overrides; got {entry!r}."
            )
        for key in entry.keys() & merged.keys():
            raise ValueError(
                f"Two axes both set {key!r}; each key belongs to one axis."
            )
        merged.update(entry)
    return merged


def parse_arg(arg: str | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """Parses a sweep argument ``"k=v,k=v"``; each value takes its default's type.

    Tuple defaults take ``+``-separated values (``vocab=256+2048``, or
    ``vocab=`` for none); a tuple of
    strings joined back with commas gives a config argument with several words
    (``base=nanogpt+tied``).

    Examples:
        >>> parse_arg("steps=300,vocab=512+2048", {"steps": 1000, "vocab": (2048,), "base": "tiny"})
        {'steps': 300, 'vocab': (512, 2048), 'base': 'tiny'}
    """
    values = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, sep, text = item.partition("=")
        if key not in defaults or not sep:
            allowed = ", ".join(f"{k}={v!r}" for k, v in defaults.items())
            raise ValueError(
                f"Sweep argument {item!r}: write key=value with a key among: {allowed}."
            )
        values[key] = _parse_value(key, text, defaults[key])
    return values


def _parse_value(key: str, text: str, default: Any) -> Any:
    if isinstance(default, tuple):
        element = default[0] if default else ""
        return tuple(_parse_value(key, t, element) for t in text.split("+") if t)
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"Sweep argument {key}={text!r}: write true or false.")
        return text.lower() == "true"
    try:
        return type(default)(text)
    except ValueError as e:
        raise ValueError(
            f"Sweep argument {key}={text!r}: expected {type(default).__name__}."
        ) from e


def load_sweep(
    spec: str, workdir: str | None = None
) -> tuple[str, list[Overrides], Overrides]:
    """Runs ``get_sweep(arg)`` of the sweep file ``spec = "path.py[:arg]"``.

    Args:
        spec: the sweep file and its argument.
        workdir: the sweep directory, passed on to a ``get_sweep(arg, workdir)``.

    Returns:
        ``(base, overrides, shared)``: the ``configs/default.py`` argument every
        run starts from, one override dict per run, and the overrides every run
        shares (``{}`` when ``get_sweep`` returns two items).
    """
    path, arg = split_spec(spec)
    module = load_module(path)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"Sweep file {path!r} has no get_sweep(arg=None).")
    if "workdir" in inspect.signature(module.get_sweep).parameters:
        result = module.get_sweep(arg or None, workdir=workdir)
    else:
        result = module.get_sweep(arg or None)
    base, overrides, shared = (*result, {}) if len(result) == 2 else result
    if (
        not isinstance(base, str)
        or not overrides
        or not all(isinstance(o, dict) for o in overrides)
        or not isinstance(shared, dict)
    ):
        raise ValueError(
            f"get_sweep in {path!r} must return (config argument "
            "string, non-empty list of override dicts[, dict of "
            "shared overrides])."
        )
    for key in shared.keys() & set().union(*overrides):
        raise ValueError(
            f"get_sweep in {path!r} sets {key!r} both per run and for every run."
        )
    return base, list(overrides), shared


def restore_runs(spec: str, csv_path: str, workdir: str) -> list[str]:
    """Runs ``restore_runs(csv_path, workdir)`` of the sweep file of ``spec``
    (``path.py[:arg]``): the names of the finished runs it recreated.

    Raises:
        ValueError: a sweep file without ``restore_runs``.
        FileNotFoundError: no sweep file, or no ``csv_path``.
    """
    path, _ = split_spec(spec)
    module = load_module(path)
    if not hasattr(module, "restore_runs"):
        raise ValueError(
            f"Sweep file {path!r} has no restore_runs(csv_path, workdir): it "
            "cannot restore runs from a table."
        )
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"No table of runs {csv_path!r} to restore from.")
    return module.restore_runs(csv_path, workdir)


def has_report(spec: str) -> bool:
    """Whether the sweep file of ``spec`` (``path.py[:arg]``) writes a report:
    defines ``write_report(arg, sweep_dir, out_dir)``."""
    return hasattr(load_module(split_spec(spec)[0]), "write_report")


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"path.py:arg"`` -> ``(path.py, arg)``; the file must exist.

    Examples:
        >>> split_spec("lmhead/lab/sweeps.py:small,seeds=2")
        ('lmhead/lab/sweeps.py', 'small,seeds=2')
    """
    path, _, arg = spec.partition(".py:")
    path = path if path.endswith(".py") else path + ".py"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--sweep: no sweep file {path!r}.")
    return path, arg or None


# --- Run names and commands -------------------------------------------------


def run_names(overrides: Sequence[Overrides]) -> list[str]:
    """Readable, unique directory names, ``key=value`` joined by commas.

    A key is shortened to its last component (``model.tied`` -> ``tied``)
    unless that makes two runs' names equal. Characters outside
    ``[A-Za-z0-9._+=,-]`` become ``_``; an over-long name keeps its start and
    a hash of the whole.

    Raises:
        ValueError: when two runs have the same overrides.

    Examples:
        >>> run_names([{"model.tied": True, "train.seed": 0},
        ...            {"model.tied": False, "train.seed": 0}])
        ['tied=True,seed=0', 'tied=False,seed=0']
        >>> run_names([{"model.seed": 1}, {"train.seed": 1}])
        ['model.seed=1', 'train.seed=1']
    """
    for shorten in (True, False):
        names = [_run_name(o, shorten) for o in overrides]
        if len(set(names)) == len(names):
            return names
    repeated = sorted({n for n in names if names.count(n) > 1})
    raise ValueError(f"The sweep lists the same run more than once: {repeated}.")


def _run_name(overrides: Overrides, shorten: bool) -> str:
    parts = []
    for key, value in overrides.items():
        label = key.rsplit(".", 1)[-1] if shorten else key
        text = f"{value:g}" if isinstance(value, float) else str(value)
        parts.append(f"{label}={text}")
    name = re.sub(r"[^A-Za-z0-9._+=,-]", "_", ",".join(parts)) or "base"
    if len(name) > MAX_NAME_LENGTH:
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME_LENGTH - 11]}-{digest}"
    return name


def override_flags(overrides: Overrides) -> list[str]:
    """``--config.KEY=VALUE`` flags for ml_collections' config_flags.

    Raises:
        ValueError: for ``None`` (no flag can set it: leave the key out).

    Examples:
        >>> override_flags({"model.tied": False, "optim.lr": 0.001, "data.tokenizer": "bpe"})
        ['--config.model.tied=False', '--config.optim.lr=0.001', '--config.data.tokenizer=bpe']
    """
    flags = []
    for key, value in overrides.items():
        if value is None:
            raise ValueError(
                f"Override {key}=None: a command-line flag cannot set "
                "None; leave the key out of the run's overrides."
            )
        text = repr(value) if isinstance(value, (float, tuple, list)) else str(value)
        flags.append(f"--config.{key}={text}")
    return flags


def train_command(
    base: str,
    workdir: str,
    overrides: Overrides,
    *,
    python: str,
    script: str,
    config_file: str,
    shared: Overrides | None = None,
) -> list[str]:
    """The argv of one run: ``python script --config=FILE:BASE --workdir=DIR``,
    then the ``shared`` overrides and the run's own.

    Examples:
        >>> train_command("tiny", "runs/s/tied=False", {"model.tied": False},
        ...               python="python", script="experiments/train.py",
        ...               config_file="configs/default.py")  # doctest: +NORMALIZE_WHITESPACE
        ['python', 'experiments/train.py', '--config=configs/default.py:tiny',
         '--workdir=runs/s/tied=False', '--config.model.tied=False']
    """
    config = f"{config_file}:{base}" if base else config_file
    return [
        python,
        script,
        f"--config={config}",
        f"--workdir={workdir}",
        *override_flags({**(shared or {}), **overrides}),
    ]
