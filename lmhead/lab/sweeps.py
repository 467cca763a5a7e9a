"""Sweeps: grids of config overrides, run names, train commands, run statistics.

A sweep is a config file whose ``get_sweep(arg=None)`` returns the argument
of ``configs/default.py`` that every run starts from and a list of override
dicts, one per run, built with :func:`sweep`, :func:`product` and
:func:`zipped` (as in big_vision and T5X)::

    def get_sweep(arg=None):
        return "nanogpt,steps=500", sweeps.product(
            sweeps.sweep("model.tied", [True, False]),
            sweeps.sweep("train.seed", [0, 1, 2]))

``get_sweep`` may also return a third item, overrides shared by every run
(flags of every command, left out of the run names), and may take a second
parameter, ``workdir``: the sweep directory, for a sweep whose later stage
depends on the results of an earlier one (``configs/sweeps/tying_study.py``).

Each run is an ordinary ``experiments/train.py`` command whose
``--config.KEY=VALUE`` flags are the overrides (:func:`train_command`), in
its own workdir named from them (:func:`run_names`). The second half reads
finished runs back (:func:`read_run`, :func:`read_sweep`) and compares them
over seeds (``stats.mean_std``, ``stats.paired_difference``), for
``experiments/sweep.py`` and ``experiments/report.py``.
"""

import dataclasses
import hashlib
import inspect
import itertools
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from lmhead.lm.configuration import flatten, load_module

SWEEP_FILE = "sweep.json"  # in the sweep directory: the runs and their commands
STATUS_FILE = "status.json"  # in a run's workdir: how its last process exited
LOG_FILE = "run.log"  # in a run's workdir: the train process's stdout and stderr
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
    return [_merge(combination) for combination in itertools.product(*axes)]


def zipped(*axes: Sequence[Overrides]) -> list[Overrides]:
    """Entry ``i`` of every axis together; the axes must have equal lengths.

    Examples:
        >>> zipped(sweep("model.d_model", [64, 128]), sweep("model.mlp_dim", [256, 512]))
        [{'model.d_model': 64, 'model.mlp_dim': 256}, {'model.d_model': 128, 'model.mlp_dim': 512}]
    """
    lengths = [len(axis) for axis in axes]
    if len(set(lengths)) > 1:
        raise ValueError(f"zipped needs axes of equal length; got lengths {lengths}.")
    return [_merge(entries) for entries in zip(*axes)]


def _merge(entries: Sequence[Overrides]) -> Overrides:
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


# --- Reading runs -------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One run's directory, read back.

    Attributes:
        name: the directory name.
        workdir: its path.
        overrides: the sweep's overrides for it (``{}`` when unknown).
        config: ``config.json`` as a nested dict (``{}`` before it exists).
        metrics: ``metrics.jsonl`` records, one per step and kind, sorted by
            step; a step logged twice (a resumed run) keeps its last record.
        summary: ``summary.json``, or ``None`` for a run that did not finish.
        status: ``"finished"`` (summary present), ``"failed"`` (its process
            exited without a summary), ``"unfinished"`` (started, no exit
            recorded: running, interrupted, or launched elsewhere) or
            ``"not started"``.
        returncode: of the last process, when the sweep runner recorded it.
        interval: that process's start and end, in seconds since the epoch,
            when the runner recorded them.
    """

    name: str
    workdir: str
    overrides: Overrides
    config: dict
    metrics: list[dict]
    summary: dict | None
    status: str
    returncode: int | None = None
    interval: tuple[float, float] | None = None


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_metrics(path: str) -> list[dict]:
    """Reads ``metrics.jsonl``; an unfinished last line (a killed run) is skipped.

    Records with the same step and the same kind of keys (``train/`` or
    ``eval/``) keep the last one, as a resumed run repeats the steps after its
    checkpoint.
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    records = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(f"{path}, line {number}: not JSON ({e}).") from e
        kinds = tuple(sorted({k.split("/")[0] for k in record if k != "step"}))
        records[(record.get("step", 0), kinds)] = record
    return [records[key] for key in sorted(records, key=lambda k: k[0])]


def read_run(workdir: str, overrides: Overrides | None = None) -> Run:
    """Reads a run's ``config.json``, ``metrics.jsonl``, ``summary.json`` and status.

    Examples:
        >>> import tempfile
        >>> workdir = tempfile.mkdtemp()
        >>> with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        ...     _ = f.write('{"step": 10, "eval/loss": 2.5}\\n{"step": 20, "ev')
        >>> run = read_run(workdir)
        >>> run.status, run.metrics
        ('unfinished', [{'step': 10, 'eval/loss': 2.5}])
    """
    config = _read_json(os.path.join(workdir, "config.json")) or {}
    metrics = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    summary = _read_json(os.path.join(workdir, "summary.json"))
    status_record = _read_json(os.path.join(workdir, STATUS_FILE))
    returncode = status_record["returncode"] if status_record else None
    interval = (
        (status_record["started"], status_record["ended"])
        if status_record and "started" in status_record
        else None
    )
    if summary is not None:
        status = "finished"
    elif returncode is not None:
        status = "failed"
    elif config or metrics:
        status = "unfinished"
    else:
        status = "not started"
    return Run(
        os.path.basename(os.path.normpath(workdir)),
        workdir,
        dict(overrides or {}),
        config,
        metrics,
        summary,
        status,
        returncode,
        interval,
    )


def read_sweep_record(sweep_dir: str) -> dict:
    """``sweep.json`` of ``sweep_dir`` (its command, machine and runs), or ``{}``."""
    return _read_json(os.path.join(sweep_dir, SWEEP_FILE)) or {}


def read_sweep(sweep_dir: str) -> list[Run]:
    """Reads every run of a sweep directory, in the sweep's order.

    The runs are those listed in ``sweep.json`` (written by
    ``experiments/sweep.py``; listed runs never started count too) and any
    other subdirectory with a ``config.json`` (runs launched from the
    ``--dry_run`` commands). Runs missing from ``sweep.json`` get as
    overrides the config values that differ between runs.
    """
    listed = read_sweep_record(sweep_dir).get("runs", [])
    runs = [
        read_run(os.path.join(sweep_dir, r["name"]), r["overrides"]) for r in listed
    ]
    known = {r["name"] for r in listed}
    others = [
        read_run(os.path.join(sweep_dir, name))
        for name in sorted(os.listdir(sweep_dir))
        if name not in known
        and os.path.isfile(os.path.join(sweep_dir, name, "config.json"))
    ]
    flat_configs = [flatten(r.config) for r in runs + others if r.config]
    for run in others:
        flat = flatten(run.config)
        run.overrides = {k: flat.get(k) for k in varying_keys(flat_configs)}
    return runs + others


def varying_keys(flat_configs: Sequence[dict[str, Any]]) -> list[str]:
    """The keys whose values are not the same in every config, sorted.

    Examples:
        >>> varying_keys([{"a": 1, "b": 2}, {"a": 1, "b": 3}])
        ['b']
    """
    keys = sorted(set().union(*flat_configs)) if flat_configs else []
    return [
        k
        for k in keys
        if len({json.dumps(c.get(k), sort_keys=True) for c in flat_configs}) > 1
    ]


def is_seed_key(key: str) -> bool:
    """Whether an override key is a random seed (runs differing only there repeat a setting)."""
    return key.rsplit(".", 1)[-1] == "seed"


def group_runs(runs: Sequence[Run], drop: Sequence[str] = ()) -> list[list[Run]]:
    """Groups runs whose overrides agree except on seeds and the keys ``drop``.

    Groups and runs within them keep the order of ``runs``.

    Examples:
        >>> runs = [Run(n, n, o, {}, [], None, "not started") for n, o in [
        ...     ("a", {"model.tied": True, "train.seed": 0}),
        ...     ("b", {"model.tied": False, "train.seed": 0}),
        ...     ("c", {"model.tied": True, "train.seed": 1})]]
        >>> [[r.name for r in group] for group in group_runs(runs)]
        [['a', 'c'], ['b']]
        >>> [[r.name for r in group] for group in group_runs(runs, drop=["model.tied"])]
        [['a', 'b', 'c']]
    """
    groups: dict[str, list[Run]] = {}
    for run in runs:
        setting = {
            k: v
            for k, v in run.overrides.items()
            if not is_seed_key(k) and k not in drop
        }
        groups.setdefault(json.dumps(setting, sort_keys=True), []).append(run)
    return list(groups.values())


def seed_of(run: Run) -> tuple:
    """The run's seed overrides (or its ``train.seed``), to pair runs across settings."""
    seeds = tuple(v for k, v in run.overrides.items() if is_seed_key(k))
    return seeds or (flatten(run.config).get("train.seed"),)


def final_metrics(run: Run) -> dict[str, float]:
    """The final evaluation of a finished run, ``eval/`` prefixes removed.

    Adds ``tokens_per_sec``, ``num_params`` and ``num_head_params`` from
    ``summary.json``. A summary without ``final`` falls back to the last
    ``eval/`` record of ``metrics.jsonl``.
    """
    summary = run.summary or {}
    final = summary.get("final")
    if not final:
        evals = [m for m in run.metrics if any(k.startswith("eval/") for k in m)]
        final = evals[-1] if evals else {}
    values = {k.removeprefix("eval/"): v for k, v in final.items() if k != "step"}
    for key in ("tokens_per_sec", "num_params", "num_head_params"):
        if key in summary:
            values[key] = summary[key]
    return values


def eval_curve(run: Run, metric: str = "loss") -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``eval/<metric>`` over training."""
    key = f"eval/{metric}"
    points = [(m["step"], m[key]) for m in run.metrics if key in m]
    return [s for s, _ in points], [v for _, v in points]
