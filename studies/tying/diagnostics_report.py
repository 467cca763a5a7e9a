"""The tying study's diagnostics of trained runs: :func:`diagnose_run` reads
a run (its parameters at ``best_checkpoint``, else the newest, and its own
training tokens) and computes :mod:`studies.tying.diagnostics` on
evaluation windows; :func:`write_diagnostics` writes ``norms.png``,
``cosines.png`` (untied runs), ``bucket_loss.png``, ``diagnostics.json`` and
``diagnostics.md``. ``experiments/tying_diagnostics.py`` is its command.
"""

import dataclasses
import functools
import json
import math
import os
from typing import Any

import jax
import numpy as np

from lmhead.lab import report
from lmhead.lm import checkpoints, data, generation, scoring
from lmhead.lm import state as state_lib
from studies.tying import cells as cells_lib
from studies.tying import diagnostics, report_text

SPLITS = ("test", "val")
NUM_BUCKETS = 5
JSON_FILE = "diagnostics.json"
MARKDOWN_FILE = "diagnostics.md"
FREQUENCY_SOURCE = (
    "each run's own training tokens (lmhead.lm.data.load_dataset(config.data, "
    "workdir).train_tokens: the tokens.npz it trained on)"
)


@dataclasses.dataclass(frozen=True)
class RunDiagnostics:
    """One run's diagnostics.

    Attributes:
        summary: the numbers, JSON-ready (:func:`diagnose_run` lists them).
        log_frequency: ``[V]`` add-one log training frequency of each token.
        embedding_norms: ``[V]`` row norms of the embedding table.
        head_norms: ``[V]`` row norms of the head's table (a tied run's are
            the embedding's).
        cosines: ``[V]`` cosine of each token's input and output rows;
            None for a tied run.
    """

    summary: dict[str, Any]
    log_frequency: np.ndarray
    embedding_norms: np.ndarray
    head_norms: np.ndarray
    cosines: np.ndarray | None


def load_parameters(workdir: str):
    """``(config, model, params, checkpoint folder, step)`` of a run:
    ``best_checkpoint``'s parameters where it holds one, else the newest of
    ``checkpoints/`` (``generation.load_run``)."""
    config, _, model, params = generation.load_run(workdir)
    manager = checkpoints.checkpoint_manager(workdir)
    folder, step = "checkpoints", manager.latest_step()
    manager.close()
    if os.path.isdir(os.path.join(workdir, checkpoints.BEST_CHECKPOINT)):
        best = checkpoints.best_checkpoint_manager(workdir)
        if best.latest_step() is not None:
            state = state_lib.restore_or_init(best, model, config, jax.random.key(0))
            folder, step, params = (
                checkpoints.BEST_CHECKPOINT,
                int(state.step),
                state.params,
            )
        best.close()
    return config, model, params, folder, step


def has_parameters(workdir: str) -> bool:
    """Whether the run in ``workdir`` has parameters that
    :func:`load_parameters` can read: a saved step in ``checkpoints/`` or
    ``best_checkpoint/`` (a run restored from ``runs.csv`` alone has none)."""
    return checkpoints.has_saved_step(workdir) or checkpoints.has_saved_step(
        workdir, checkpoints.BEST_CHECKPOINT
    )


def evaluation_windows(
    tokens: np.ndarray, block_size: int, max_windows: int | None
) -> dict[str, np.ndarray]:
    """``{"inputs", "labels", "weights"}``, each ``[W, T]``: the consecutive
    windows of the whole split that an evaluation reads
    (``data.eval_batches``), or ``max_windows`` evenly spaced ones where
    that is fewer."""
    whole = (len(tokens) - 1) // block_size
    count = None if max_windows is None or max_windows >= whole else max_windows
    batches = data.eval_batches(
        tokens, num_batches=count, batch_size=1, block_size=block_size
    )
    return concatenated(batches)


def concatenated(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``data.eval_batches``' batches as one: each key's ``[B, T]`` arrays
    stacked into ``[W, T]``."""
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


@functools.partial(jax.jit, static_argnums=0)
def _window_statistics(logits_fn, params, inputs, labels):
    return diagnostics.logit_statistics(logits_fn(params, inputs), labels)


def position_statistics(
    model, params, windows: dict[str, np.ndarray], batch_size: int
) -> dict[str, np.ndarray]:
    """The nll, logit std and max logit (:func:`diagnostics.logit_statistics`)
    and the label and weight of every position of ``windows``, flattened
    to ``[W * T]``; ``batch_size`` windows per call (one compile), the last
    call padded with windows of weight 0."""
    padding = -len(windows["inputs"]) % batch_size
    padded = {k: np.pad(v, [(0, padding), (0, 0)]) for k, v in windows.items()}
    parts = [
        _window_statistics(
            scoring.ModelLogits(model),
            params,
            padded["inputs"][i : i + batch_size],
            padded["labels"][i : i + batch_size],
        )
        for i in range(0, len(padded["inputs"]), batch_size)
    ]
    found = {
        name: np.concatenate([np.asarray(getattr(p, name)) for p in parts]).ravel()
        for name in diagnostics.LogitStatistics._fields
    }
    return {
        **found,
        "labels": padded["labels"].ravel(),
        "weights": padded["weights"].ravel(),
    }


def diagnose_run(
    workdir: str,
    *,
    split: str = "test",
    max_windows: int | None = None,
    num_buckets: int = NUM_BUCKETS,
    batch_size: int = 16,
    name: str | None = None,
) -> RunDiagnostics:
    """The diagnostics of the run in ``workdir`` on ``split``'s windows.

    The summary holds: ``run``, ``workdir``, ``tied``, ``checkpoint`` and
    ``step`` (what was loaded), ``vocab_size``, ``train_tokens``, ``split``,
    ``windows``, ``positions`` (evaluated tokens), ``nll`` (their mean, nats),
    ``logit_std`` and ``logit_max`` (means over positions),
    ``embedding_norm_spearman`` and ``head_norm_spearman`` (Spearman's rho of
    the row norms with log training frequency), ``cosine_mean`` and
    ``cosine_weighted`` (untied only: plain, and weighted by training
    counts), and ``buckets``: per bucket its ``types``, ``train_share`` of
    the training tokens, ``min_count``/``max_count`` training counts,
    ``tokens`` evaluated and their ``mean_nll`` (None where empty).

    Raises:
        ValueError: ``split`` is not ``"test"`` or ``"val"``, or the run has
            no such split (``data.split="tail"`` has no test split).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}.")
    config, model, params, folder, step = load_parameters(workdir)
    dataset = data.load_dataset(config.data, workdir)
    counts = diagnostics.token_counts(dataset.train_tokens, model.vocab_size)
    tokens = (
        dataset.val_tokens
        if split == "val"
        else data.load_test_tokens(config.data, dataset.tokenizer)
    )
    windows = evaluation_windows(tokens, config.data.block_size, max_windows)
    positions = position_statistics(model, params, windows, batch_size)
    embedding = params["embed"]["embedding"]
    unembedding = embedding if model.tied else params["head"]["unembedding"]
    tables = jax.device_get(_table_statistics(embedding, unembedding, counts))
    buckets = diagnostics.frequency_buckets(counts, num_buckets)
    means = jax.device_get(
        _position_means(
            *(positions[k] for k in ("nll", "std", "max", "labels", "weights")),
            buckets,
            num_buckets,
        )
    )
    cosines = None if model.tied else tables["cosines"]
    summary = {
        "run": name or os.path.basename(os.path.normpath(workdir)),
        "workdir": os.path.abspath(workdir),
        "tied": bool(model.tied),
        "checkpoint": folder,
        "step": step,
        "vocab_size": int(model.vocab_size),
        "train_tokens": int(counts.sum()),
        "split": split,
        "windows": int(len(windows["inputs"])),
        "positions": int(positions["weights"].sum()),
        **{k: float(means[k]) for k in ("nll", "logit_std", "logit_max")},
        **{
            f"{table}_norm_spearman": _number(
                diagnostics.rank_correlation(
                    tables[f"{table}_norms"], tables["log_frequency"]
                )
            )
            for table in ("embedding", "head")
        },
        "cosine_mean": None if model.tied else float(np.mean(cosines)),
        "cosine_weighted": None if model.tied else float(tables["cosine_weighted"]),
        "buckets": _bucket_summary(counts, buckets, *means["buckets"]),
    }
    return RunDiagnostics(
        summary,
        tables["log_frequency"],
        tables["embedding_norms"],
        tables["head_norms"],
        cosines,
    )


@jax.jit
def _table_statistics(embedding, unembedding, counts):
    """The table diagnostics in one program (op by op, each would compile)."""
    cosines = diagnostics.row_cosines(embedding, unembedding)
    return {
        "log_frequency": diagnostics.log_frequency(counts),
        "embedding_norms": diagnostics.row_norms(embedding),
        "head_norms": diagnostics.row_norms(unembedding),
        "cosines": cosines,
        "cosine_weighted": diagnostics.weighted_mean(cosines, counts),
    }


@functools.partial(jax.jit, static_argnums=6)
def _position_means(nll, std, maximum, labels, weights, buckets, num_buckets):
    """The means over weighted positions and by bucket, in one program."""
    return {
        "nll": diagnostics.weighted_mean(nll, weights),
        "logit_std": diagnostics.weighted_mean(std, weights),
        "logit_max": diagnostics.weighted_mean(maximum, weights),
        "buckets": diagnostics.bucket_losses(
            nll, labels, weights, buckets, num_buckets
        ),
    }


def _bucket_summary(counts, buckets, mean_nll, tokens) -> list[dict[str, Any]]:
    rows = []
    for k in range(len(tokens)):
        members = counts[buckets == k]
        rows.append(
            {
                "bucket": k,
                "types": int(len(members)),
                "train_share": float(members.sum() / counts.sum()),
                "min_count": int(members.min()) if len(members) else None,
                "max_count": int(members.max()) if len(members) else None,
                "tokens": int(tokens[k]),
                "mean_nll": _number(float(mean_nll[k])),
            }
        )
    return rows


def _number(value: float) -> float | None:
    """``value``, or None for NaN (JSON has no NaN)."""
    return None if math.isnan(value) else value


# --- Outputs -----------------------------------------------------------------


def _text(value: float | None, digits: int = 3) -> str:
    return report.DASH if value is None else f"{value:.{digits}f}"


def plot_norms(runs: list[RunDiagnostics], path: str) -> None:
    """Row norms against log training frequency, one panel per run."""
    with report.panels(path, len(runs), (4.0, 3.2)) as axes:
        for axis, run in zip(axes, runs):
            s = run.summary
            if s["tied"]:
                axis.scatter(
                    run.log_frequency, run.embedding_norms, s=6, label="tied table"
                )
            else:
                axis.scatter(
                    run.log_frequency, run.embedding_norms, s=6, label="embedding"
                )
                axis.scatter(
                    run.log_frequency, run.head_norms, s=6, marker="x", label="head"
                )
            axis.set_title(
                f"{s['run']}\nρ embedding {_text(s['embedding_norm_spearman'], 2)}, "
                f"head {_text(s['head_norm_spearman'], 2)}",
                fontsize=9,
            )
            axis.set_xlabel("log training frequency (add-one)")
            axis.set_ylabel("row norm")
            axis.legend(fontsize=8)


def plot_cosines(runs: list[RunDiagnostics], path: str) -> bool:
    """For each untied run, the histogram of its cosines and the cosines
    against log frequency; False (no file) when every run is tied."""
    untied = [run for run in runs if run.cosines is not None]
    if not untied:
        return False
    with report.panels(path, 2 * len(untied), (3.6, 3.0)) as axes:
        for i, run in enumerate(untied):
            name = run.summary["run"]
            histogram, scatter = axes[2 * i], axes[2 * i + 1]
            histogram.hist(run.cosines, bins=40, range=(-1.0, 1.0))
            histogram.set_title(f"{name}\ncos(embedding, head)", fontsize=9)
            histogram.set_xlabel("cosine")
            histogram.set_ylabel("tokens")
            scatter.scatter(run.log_frequency, run.cosines, s=6)
            scatter.set_title(f"{name}\ncosine by frequency", fontsize=9)
            scatter.set_xlabel("log training frequency (add-one)")
            scatter.set_ylabel("cosine")
    return True


def plot_bucket_losses(runs: list[RunDiagnostics], path: str) -> None:
    """Mean loss by frequency bucket, runs overlaid."""
    with report.panels(path, 1, (5.5, 3.8)) as (axis,):
        for run in runs:
            rows = run.summary["buckets"]
            values = [np.nan if r["mean_nll"] is None else r["mean_nll"] for r in rows]
            axis.plot(
                [r["bucket"] for r in rows], values, "o-", label=run.summary["run"]
            )
        split = runs[0].summary["split"]
        axis.set_xticks(range(len(runs[0].summary["buckets"])))
        axis.set_xlabel("frequency bucket (equal training mass; 0 = most frequent)")
        axis.set_ylabel(f"mean {split} nll (nats/token)")
        axis.legend(fontsize=8)


def markdown(runs: list[RunDiagnostics]) -> str:
    """The numbers as markdown: one row per run, then the bucket losses."""
    rows = [
        [
            s["run"],
            "tied" if s["tied"] else "untied",
            f"{s['checkpoint']} ({s['step']})",
            str(s["vocab_size"]),
            str(s["positions"]),
            _text(s["nll"], 4),
            _text(s["logit_std"]),
            _text(s["logit_max"]),
            _text(s["embedding_norm_spearman"]),
            _text(s["head_norm_spearman"]),
            _text(s["cosine_weighted"]),
            _text(s["cosine_mean"]),
        ]  # fmt: skip
        for s in (run.summary for run in runs)
    ]
    num_buckets = len(runs[0].summary["buckets"])
    buckets = [
        [run.summary["run"]]
        + [
            f"{_text(b['mean_nll'])} ({b['tokens']}; {b['types']} types, "
            f"{b['train_share']:.0%})"
            for b in run.summary["buckets"]
        ]
        for run in runs
    ]
    split = runs[0].summary["split"]
    return "\n\n".join(
        [
            "# Head diagnostics",
            report_text.prose("diagnostics", split=split, source=FREQUENCY_SOURCE),
            report.markdown_table(
                report_text.column_names("diagnostics_columns"), rows
            ),
            report_text.prose("diagnostics_buckets", split=split, buckets=num_buckets),
            report.markdown_table(
                ["run", *(f"bucket {k}" for k in range(num_buckets))], buckets
            ),
        ]
    )


def write_diagnostics(runs: list[RunDiagnostics], out_dir: str) -> list[str]:
    """Writes the plots, ``diagnostics.json`` and ``diagnostics.md`` of
    ``runs`` (one split, one bucket count) into ``out_dir``; returns the
    paths written."""
    if not runs:
        raise ValueError("runs must hold at least one RunDiagnostics.")
    if len({(r.summary["split"], len(r.summary["buckets"])) for r in runs}) > 1:
        raise ValueError("runs must share one split and one number of buckets.")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f) for f in ("norms.png", "bucket_loss.png")]
    plot_norms(runs, paths[0])
    plot_bucket_losses(runs, paths[1])
    cosines = os.path.join(out_dir, "cosines.png")
    if plot_cosines(runs, cosines):
        paths.append(cosines)
    summaries = {
        "frequency_source": FREQUENCY_SOURCE,
        "runs": [r.summary for r in runs],
    }
    paths.append(os.path.join(out_dir, JSON_FILE))
    with open(paths[-1], "w") as f:
        json.dump(summaries, f, indent=1)
    paths.append(os.path.join(out_dir, MARKDOWN_FILE))
    with open(paths[-1], "w", encoding="utf-8") as f:
        f.write(markdown(runs) + "\n")
    return paths


# The study's diagnosed cells: the smallest and the largest head share at
# the whole training split, and the largest at a small subset.
STUDY_CELLS = (("char", 1.0), ("8192", 1.0), ("8192", 0.03))
STUDY_ARMS = ("a", "b", "e")


def study_runs(
    rows: list[dict[str, Any]],
    cells: tuple[tuple[str, float], ...] = STUDY_CELLS,
    arms: tuple[str, ...] = STUDY_ARMS,
    seed: int = 0,
) -> dict[str, str]:
    """The run names (``runs.csv``'s ``run``) of the finished test runs of
    test seed ``seed`` in ``cells`` x ``arms``, in that order, each mapped to
    a label that names its cell, arm and seed: the runs the study's
    diagnostics read (``make study``). A cell or arm without such a run is
    left out.

    Examples:
        >>> row = lambda arm, status="finished": dict(
        ...     role="test", vocab="char", amount=1.0, arm=arm, seed=0,
        ...     status=status, table_lr_multiplier=None, run=f"char-{arm}")
        >>> for name, label in study_runs([row("b"), row("a"), row("e", "no")]).items():
        ...     print(name, "|", label)
        char-a | characters at 100%, a (tied), seed 0
        char-b | characters at 100%, b (untied), seed 0
    """
    chosen = {
        (r["vocab"], r["amount"], r["arm"]): r["run"]
        for r in rows
        if r["role"] == "test" and r["status"] == "finished" and r["seed"] == seed
    }
    return {
        chosen[(*cell, arm)]: (
            f"{cells_lib.cell_label(cell)}, {arm} "
            f"({cells_lib.ARM_NAMES.get(arm, arm)}), seed {seed}"
        )
        for cell in cells
        for arm in arms
        if (*cell, arm) in chosen
    }


def study_workdirs(study_dir: str, rows: list[dict[str, Any]]) -> dict[str, str]:
    """The directories under ``study_dir`` of :func:`study_runs` ``(rows)``
    that hold a saved step (a run restored from ``runs.csv`` alone has none),
    each mapped to its label."""
    return {
        workdir: label
        for workdir, label in (
            (os.path.join(study_dir, name), label)
            for name, label in study_runs(rows).items()
        )
        if has_parameters(workdir)
    }


def run_names(workdirs: list[str]) -> list[str]:
    """A short, distinct name per run directory: its last path component, or
    as many of its last components as tell it apart from the others.

    Examples:
        >>> run_names(["runs/a/seed0", "runs/b/seed0", "runs/c"])
        ['a/seed0', 'b/seed0', 'c']
    """
    parts = [os.path.normpath(os.path.abspath(w)).split(os.sep) for w in workdirs]
    names = []
    for i, path in enumerate(parts):
        depth = 1
        while depth < len(path) and any(
            other[-depth:] == path[-depth:] for j, other in enumerate(parts) if j != i
        ):
            depth += 1
        names.append("/".join(path[-depth:]))
    return names
