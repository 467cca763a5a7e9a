r"""How precisely the tying study's validation windows tell a chosen
learning rate from the next best one.

The report's selection noise (:func:`~lmhead.studies.tying.cells.selection_noise`)
is the tuning *seeds'* noise in a margin: the next best rate's mean
validation loss minus the chosen rate's. The other source is the finite
validation set: the tuning read each run's loss on ``train.eval_batches *
train.batch_size`` evenly spaced windows (384 in the study), and a margin
measured on other windows of the same text would differ. Both rates are read
on the same windows, so what matters is the spread of the *per-window
differences*: for a tuning seed with per-window losses :math:`\ell_w` at the
chosen rate and :math:`\ell'_w` at the next, :math:`\delta_w = \ell'_w -
\ell_w`, the margin on those windows is :math:`\bar\delta` with standard
error :math:`s_\delta / \sqrt{W}` (the windows are evenly spaced over the
split, and this treats them as independent draws of its text). Over ``n``
tuning seeds the margin is the mean of theirs, with standard error
:math:`\sqrt{\sum_s \mathrm{SE}_s^2} / n`.

:func:`window_losses` evaluates one run on its own validation windows, at
the parameters its early stopping kept; :func:`rate_noise` does it for the
chosen and next rate of every tuned arm; :func:`markdown` writes the table.
``experiments/tying_rate_noise.py`` is the command.
"""

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lmhead.lab import report
from lmhead.lm import checkpoints, data
from lmhead.studies.tying import cells, diagnostics_report

MARKDOWN_FILE = "rate_noise.md"


def window_losses(workdir: str, batch_size: int = 16) -> np.ndarray:
    """``float [W]``: the mean loss (nats/token) of each validation window of
    the run in ``workdir``, at ``best_checkpoint``'s parameters (else its
    newest; ``diagnostics_report.load_parameters``). The windows are the ones
    its evaluations read (``data.eval_batches`` with the run's
    ``train.eval_batches`` and ``train.batch_size``), so their mean is the
    run's validation loss at its best step to float rounding.
    """
    config, model, params, _, _ = diagnostics_report.load_parameters(workdir)
    dataset = data.load_dataset(config.data, workdir)
    batches = data.eval_batches(
        dataset.val_tokens,
        num_batches=config.train.eval_batches,
        batch_size=config.train.batch_size,
        block_size=config.data.block_size,
    )
    windows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    positions = diagnostics_report.position_statistics(
        model, params, windows, batch_size
    )
    shape = (-1, config.data.block_size)
    count = len(windows["inputs"])
    nll = positions["nll"].reshape(shape)[:count]
    weights = positions["weights"].reshape(shape)[:count]
    return (nll * weights).sum(1) / weights.sum(1)


def paired_windows(chosen: np.ndarray, following: np.ndarray) -> tuple[float, float]:
    r"""``(mean, standard error)`` of the per-window differences
    :math:`\delta_w = \ell'_w - \ell_w` (``following - chosen``, both
    ``[W]``, ``W >= 2``): :math:`\bar\delta` and :math:`s_\delta/\sqrt W`.

    Examples:
        >>> mean, error = paired_windows(np.array([1.0, 2.0, 3.0]),
        ...                              np.array([1.5, 2.0, 3.7]))
        >>> round(mean, 4), round(error, 4)  # differences 0.5, 0, 0.7
        (0.4, 0.2082)
    """
    if chosen.shape != following.shape or chosen.ndim != 1 or len(chosen) < 2:
        raise ValueError(
            "chosen and following must be [W] losses of the same W >= 2 "
            f"windows; got shapes {chosen.shape} and {following.shape}."
        )
    d = following - chosen
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


def combine_seeds(per_seed: Sequence[tuple[float, float]]) -> tuple[float, float]:
    r"""``(mean, standard error)`` over tuning seeds of their ``(mean,
    standard error)`` pairs: the mean of the means, and
    :math:`\sqrt{\sum_s \mathrm{SE}_s^2} / n` (independent windows' errors).

    Examples:
        >>> combine_seeds([(0.01, 0.003), (0.03, 0.004)])
        (0.02, 0.0025)
    """
    n = len(per_seed)
    mean = sum(m for m, _ in per_seed) / n
    return mean, math.sqrt(sum(e**2 for _, e in per_seed)) / n


def _tuning_runs(rows: Sequence[Mapping[str, Any]], key: tuple) -> dict:
    """``{(lr, seed): run name}`` of an arm's finished tuning runs."""
    return {
        (row["lr"], row["seed"]): row["run"]
        for row in rows
        if row["role"] == "tune"
        and row["status"] == cells.FINISHED
        and (row["vocab"], row["amount"], row["arm"]) == key
    }


def _has_parameters(workdir: str) -> bool:
    return checkpoints.has_saved_step(workdir) or checkpoints.has_saved_step(
        workdir, checkpoints.BEST_CHECKPOINT
    )


def rate_noise(
    study_dir: str, rows: Sequence[Mapping[str, Any]], batch_size: int = 16
) -> list[dict[str, Any]]:
    """For each arm whose chosen rate was tuned (``cells.selection_noise``),
    the margin of the next best rate measured on the validation windows of
    each tuning seed's two runs, and its standard error over the windows.

    Returns one dict per arm, in the report's order: ``vocab``, ``amount``,
    ``arm``, ``chosen_lr``, ``next_lr``, ``margin`` (the report's, from
    ``runs.csv``), ``seed_error`` (the report's standard error of that
    margin from the seeds' spread), ``seeds`` (those whose two runs have
    parameters under ``study_dir``: a run restored from ``runs.csv`` alone
    has none) and, over them, ``window_margin`` and ``window_error``
    (:func:`combine_seeds`; None without a seed).
    """
    noise = cells.selection_noise(cells.tunings(rows))
    found = []
    for key, margin in noise.margins.items():
        runs = _tuning_runs(rows, key)
        seeds, per_seed = [], []
        for seed in sorted({seed for _, seed in runs}):
            pair = [
                os.path.join(study_dir, runs[(lr, seed)])
                for lr in (margin.chosen, margin.following)
                if (lr, seed) in runs
            ]
            if len(pair) == 2 and all(map(_has_parameters, pair)):
                seeds.append(seed)
                losses = [window_losses(workdir, batch_size) for workdir in pair]
                per_seed.append(paired_windows(*losses))
        window = combine_seeds(per_seed) if per_seed else (None, None)
        found.append(
            {
                "vocab": key[0],
                "amount": key[1],
                "arm": key[2],
                "chosen_lr": margin.chosen,
                "next_lr": margin.following,
                "margin": margin.margin,
                "seed_error": noise.standard_error(margin.seeds),
                "seeds": seeds,
                "window_margin": window[0],
                "window_error": window[1],
            }
        )
    return found


def markdown(found: Sequence[Mapping[str, Any]]) -> str:
    """The table of :func:`rate_noise`, with what its columns mean."""
    number = lambda x, sign="": report.DASH if x is None else f"{x:{sign}.4f}"
    lines = [
        [
            cells.cell_label((r["vocab"], r["amount"])),
            r["arm"],
            f"{r['chosen_lr']:.3g}",
            f"{r['next_lr']:.3g}",
            number(r["margin"], "+"),
            number(r["seed_error"]),
            ", ".join(map(str, r["seeds"])) or report.DASH,
            number(r["window_margin"], "+"),
            number(r["window_error"]),
        ]
        for r in found
    ]
    return "\n\n".join(
        [
            "# How precisely the validation windows choose a rate",
            "For each arm whose chosen learning rate was tuned: the next best "
            "rate's mean validation loss minus the chosen one's (margin, "
            "nats/token, from `runs.csv`), its standard error from the tuning "
            "seeds' spread (pooled over the arms, as in `REPORT.md`), and the "
            "same margin measured again on the validation windows the tuning "
            "read, with its standard error over those windows (paired by "
            "window, combined over the seeds whose runs are on this machine; "
            "`lmhead/studies/tying/rate_noise.py`).",
            report.markdown_table(
                [
                    "cell",
                    "arm",
                    "chosen lr",
                    "next lr",
                    "margin",
                    "seeds' SE",
                    "seeds read",
                    "margin on the windows",
                    "windows' SE",
                ],  # fmt: skip
                lines,
            ),
        ]
    )
