"""The tying study's runs read back as rows of ``runs.csv``
(``table.py`` here), and the report written from those rows alone
(``analysis.py`` here).

:func:`collect_rows` reads every run the design plans so far (the tuning
stage, and the test stage for the cells whose tuning has finished) from the
sweep directory; :func:`write_report` writes ``runs.csv`` into the report's
directory and regenerates the report from that file, so that the committed
CSV is all a reader needs to re-pair arms, re-choose rates or apply another
analysis.
"""

import functools
import json
import os

import numpy as np

from lmhead.lab import ensembles, workdirs
from lmhead.lm import configuration, data
from studies.tying import analysis, literature, profiles, shapes, study, table

RUNS_CSV = "runs.csv"
VERSION_KEYS = ("jax", "flax", "optax")


@functools.cache
def _train_chars(base: str, overrides: tuple) -> int:
    return len(data.read_splits(study.data_config(base, dict(overrides))).train)


def train_chars(design: study.Design, planned: study.PlannedRun) -> int:
    """The characters of the run's training text (its subset, held-out
    chunks removed), cut as the run cuts it."""
    keys = {**design.shared, **design.overrides(planned)}
    items = tuple(sorted((k, v) for k, v in keys.items() if k.startswith("data.")))
    return _train_chars(design.base, items)


@functools.cache
def _step_tokens(base: str, overrides: tuple) -> int:
    config = configuration.load_config(base)
    config.update_from_flattened_dict(dict(overrides))
    return config.train.batch_size * config.data.block_size


def step_tokens(design: study.Design) -> int:
    """The tokens of one training step of every run of ``design``: batch
    size x block size of its base config with its shared overrides."""
    keys = ("train.batch_size", "data.block_size")
    return _step_tokens(
        design.base, tuple((k, v) for k, v in design.shared.items() if k in keys)
    )


def _train_tokens(workdir: str) -> int | None:
    path = os.path.join(workdir, "tokens.npz")
    if not os.path.isfile(path):
        return None
    with np.load(path) as tokens:
        return int(tokens["train"].shape[0])


def _versions(workdir: str) -> str | None:
    path = os.path.join(workdir, "versions.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        found = json.load(f)
    found = found.get("packages", found)
    return " ".join(f"{k}={found[k]}" for k in VERSION_KEYS if k in found) or None


def _integer(value: float | None) -> int | None:
    """A count that a summary may hold as a float (metrics are floats)."""
    return None if value is None else int(value)


def _program(summary: dict) -> str | None:
    """The directory name of the ensemble program a member trained in."""
    program = (summary.get("ensemble") or {}).get("program")
    return None if program is None else os.path.basename(os.path.normpath(program))


def _at_best(summary: dict, record: str, name: str) -> float | None:
    """``name`` of the summary's ``record`` (``best``, ``train_at_best`` or
    ``heldout_at_best``: all at the best validation step), or None. A run
    without the record has no value: one from another step (the summary's
    ``final``) would pair the best step's validation with another step's
    training numbers."""
    return (summary.get(record) or {}).get(name)


def row(design: study.Design, planned: study.PlannedRun, run: workdirs.Run) -> dict:
    """One ``runs.csv`` row of a planned run (``table.COLUMNS``); a run
    restored from a committed table (:func:`restore_runs`) gives its row back.

    ``eval_every`` and ``step_tokens`` are the design's (only an amount's
    own cadence overrides the evaluation interval; no run the batch or the
    block); a restored row from a
    table written before those columns existed gets them from the design,
    and one whose values differ from the design's is refused."""
    cell, summary = planned.cell, run.summary or {}
    from_design = {
        "eval_every": cell.amount.eval_every or design.shared.get("train.eval_every"),
        "step_tokens": step_tokens(design),
    }
    if study.RESTORED in summary:
        restored = _checked_restored(planned, run.name, summary[study.RESTORED])
        differ = {
            k: (restored[k], v)
            for k, v in from_design.items()
            if restored.get(k) is not None and restored[k] != v
        }
        if differ:
            raise ValueError(
                f"Run {run.name} was restored from a table of another design "
                f"(column: (row, design)): {differ}."
            )
        # A table written before a column existed: the design's value.
        return {**restored, **from_design}
    test = summary.get("test") or {}
    params = summary.get("num_params") or shapes.count_params(
        cell.vocab_size, cell.shape, design.arch
    )
    train = study.train_bpc(run)
    heldout = _at_best(summary, "heldout_at_best", "heldout/bits_per_char")
    tokens = _train_tokens(run.workdir)
    steps_run = summary.get("steps_run")
    return {
        **identity(planned),
        "vocab_size": cell.vocab_size,
        "offset": cell.amount.offset(planned.seed),
        "d_model": cell.shape.d_model,
        "num_layers": cell.shape.num_layers,
        "mlp_dim": cell.shape.mlp_dim,
        "params": int(params),
        "head_share": shapes.head_share(cell.vocab_size, cell.shape.d_model, params),
        "flops_per_token": shapes.flops_per_token(
            cell.vocab_size, cell.shape, design.arch
        ),
        "train_chars": train_chars(design, planned),
        "train_tokens": tokens,
        "tokens_per_param": None if tokens is None else tokens / params,
        "steps_run": _integer(steps_run),
        "steps_to_best": _integer(summary.get("best_step")),
        **from_design,
        "reached_cap": None
        if steps_run is None
        else not summary.get("stopped_early", False) and steps_run >= cell.amount.steps,
        "train_bpc": train,
        "val_bpc": _at_best(summary, "best", "eval/bits_per_char"),
        "val_loss": _at_best(summary, "best", "eval/loss"),
        "heldout_bpc": heldout,
        "gap_bpc": None if heldout is None or train is None else heldout - train,
        "test_bpc": test.get("bits_per_char"),
        "test_word_ppl": test.get("word_perplexity"),
        "test_words": _integer(test.get("words")),
        "test_chars": _integer(test.get("num_chars")),
        "status": run.status,
        "wall_seconds": summary.get("wall_seconds"),
        "versions": _versions(run.workdir),
        "run": run.name,
        "ensemble": _program(summary),
    }


def identity(planned: study.PlannedRun) -> dict:
    """The ``runs.csv`` columns that say which run a row is, from the plan:
    a row restored under a run's name must agree with them."""
    cell = planned.cell
    return {
        "role": planned.role,
        "vocab": study.vocabulary_label(cell.vocab),
        "amount": cell.amount.fraction,
        "arm": cell.arm,
        "seed": planned.seed,
        "lr": planned.lr,
        "table_lr_multiplier": planned.table_lr,
        "untie_step": planned.untie_step,
        "steps_cap": cell.amount.steps,
    }


def _checked_restored(planned: study.PlannedRun, name: str, restored: dict) -> dict:
    expected = identity(planned)
    differ = {k: (restored[k], v) for k, v in expected.items() if restored[k] != v}
    if differ:
        raise ValueError(
            f"Run {name} was restored from a table whose row differs from the "
            f"run the design plans under that name (column: (row, planned)): "
            f"{differ}. Remove its directory to train it again."
        )
    return dict(restored)


def restored_summary(row: dict) -> dict:
    """The ``summary.json`` of a finished run recreated from its row: the
    values the sweep plans from (the best validation loss and step, the
    steps run, the program's time) and the row itself (:data:`study.RESTORED`).

    Examples:
        >>> row = dict.fromkeys(table.COLUMNS) | {"val_loss": 2.5,
        ...     "steps_to_best": 300, "steps_run": 600, "ensemble": "p0"}
        >>> summary = restored_summary(row)
        >>> summary["best"], summary["best_step"], summary["ensemble"]
        ({'eval/loss': 2.5, 'eval/bits_per_char': None}, 300, {'program': 'p0'})
    """
    summary = {
        "best": {"eval/loss": row["val_loss"], "eval/bits_per_char": row["val_bpc"]},
        "best_step": row["steps_to_best"],
        "steps_run": row["steps_run"],
        "stopped_early": row["reached_cap"] is False,
        "wall_seconds": row["wall_seconds"],
        "ensemble": {"program": row["ensemble"]},
    }
    # An empty cell is no value: readers default a missing key, not None.
    summary = {k: v for k, v in summary.items() if v not in (None, {"program": None})}
    return summary | {study.RESTORED: dict(row)}


def restore_runs(csv_path: str, sweep_dir: str) -> list[str]:
    """Recreates in ``sweep_dir`` each finished run of the table ``csv_path``
    (a ``runs.csv`` that :func:`write_report` wrote) whose workdir has no
    ``summary.json``: the workdir (its ``run`` column) with the
    :func:`restored_summary`. The sweep runner then counts the run as
    finished, the plan reads its validation loss and best step, and the
    report its row, unchanged (checked against the run the design plans
    under its name). A workdir that holds a summary already (the run
    finished here) is left alone. The programs the restored runs trained in
    are recorded in ``ensembles.json`` (:func:`lmhead.lab.ensembles.reserve`),
    so that no new program takes one of their names. Returns the restored
    runs' names.

    Raises:
        ValueError: a row's ``run`` that is not a plain directory name.

    Examples:
        >>> import tempfile
        >>> out, sweep_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> row = dict.fromkeys(table.COLUMNS) | {"role": "tune", "arm": "a",
        ...     "status": "finished", "run": "lr=0.001,seed=100", "val_loss": 2.5}
        >>> table.write_rows(os.path.join(out, RUNS_CSV),
        ...     [row, row | {"run": "lr=0.002,seed=100", "status": "unfinished"}])
        >>> restore_runs(os.path.join(out, RUNS_CSV), sweep_dir)
        ['lr=0.001,seed=100']
        >>> workdirs.read_run(os.path.join(sweep_dir, "lr=0.001,seed=100")).status
        'finished'
        >>> restore_runs(os.path.join(out, RUNS_CSV), sweep_dir)
        []
    """
    restored, programs = [], {}
    for index, entry in enumerate(table.read_rows(csv_path)):
        name = entry["run"]
        if entry["status"] != "finished":
            continue
        if not name or os.path.basename(name) != name or name in (".", ".."):
            raise ValueError(
                f"{csv_path} row {index}: run {name!r} is not a directory name."
            )
        workdir = os.path.join(sweep_dir, name)
        summary_path = os.path.join(workdir, "summary.json")
        if os.path.exists(summary_path):
            continue
        os.makedirs(workdir, exist_ok=True)
        with open(summary_path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(restored_summary(entry), f, indent=1)
        os.replace(summary_path + ".tmp", summary_path)
        restored.append(name)
        if entry["ensemble"] is not None:
            programs.setdefault(entry["ensemble"], []).append(name)
    ensembles.reserve(sweep_dir, programs)
    return restored


def collect_rows(
    design: study.Design, sweep_dir: str, *, test: bool = True
) -> list[dict]:
    """The rows of every run the design plans so far
    (:func:`~studies.tying.study.read_plan`; ``test`` False: the
    tuning stage's only)."""
    return [
        row(design, p, r)
        for p, r in study.read_plan(design, sweep_dir, test=test, strict=False).items()
    ]


def write_report(
    design: study.Design,
    sweep_dir: str,
    out_dir: str,
    *,
    test: bool = True,
    from_csv=None,
):
    """``out_dir/runs.csv`` from ``sweep_dir`` (:func:`collect_rows`), then
    the report from that file alone: ``from_csv(path, out_dir)`` where
    given (the confirmatory or mechanism tests'), else
    :func:`report_from_csv`'s, or for a design of shared ladders the
    learning-rate profiles' (:func:`studies.tying.profiles.
    report_from_csv`). Returns ``(REPORT.md's text, plot paths)``."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, RUNS_CSV)
    table.write_rows(path, collect_rows(design, sweep_dir, test=test))
    if from_csv is None:
        from_csv = profiles.report_from_csv if design.shared_ladder else report_from_csv
    return from_csv(path, out_dir)


def report_from_csv(path: str, out_dir: str):
    """``out_dir/REPORT.md`` and its plots from the rows in ``path`` alone
    (``analysis.write_report``), with the comparison to published results:
    ``(REPORT.md's text, plot paths)``."""
    return analysis.write_report(
        table.read_rows(path), out_dir, literature=literature.literature_text
    )
