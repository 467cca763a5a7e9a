r"""How precisely the tying study's validation windows tell a chosen
learning rate from the next best one.

A margin (:func:`~studies.tying.cells.selection_noise`) is read again
window by window: for tuning seed ``s`` with per-window losses
:math:`\ell_{s,w}` at the chosen rate and :math:`\ell'_{s,w}` at the next,

.. math::
    \bar\delta_w = \frac{1}{n}\sum_s (\ell'_{s,w} - \ell_{s,w}),

with standard error :math:`s_{\bar\delta} / \sqrt{W}` over the ``W``
windows (the seeds share the windows, so they are averaged first). Why and
what it assumes: ``docs/tying_study/README.md`` ("The code").
``experiments/tying_rate_noise.py`` is the command.
"""

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from lmhead.lab import report, stats
from lmhead.lm import data
from studies.tying import cells, diagnostics_report, report_text

MARKDOWN_FILE = "rate_noise.md"
JSON_FILE = "rate_noise.json"


class ValidationWindows(NamedTuple):
    """A run's losses on its validation windows.

    Attributes:
        nll: ``float [W]``, each window's mean loss (nats/token).
        bits_per_nat: the windows' tokens / (characters ln 2): a mean
            nats/token over all of them times this is their bits/char.
    """

    nll: np.ndarray
    bits_per_nat: float


def window_losses(workdir: str, batch_size: int = 16) -> ValidationWindows:
    """The run in ``workdir`` on its validation windows, at
    ``best_checkpoint``'s parameters (else its newest;
    ``diagnostics_report.load_parameters``). The windows are the ones its
    evaluations read (``data.eval_batches`` with the run's
    ``train.eval_batches`` and ``train.batch_size``), so the mean of ``nll``
    is the run's validation loss at that step to float rounding.
    """
    config, model, params, _, _ = diagnostics_report.load_parameters(workdir)
    dataset = data.load_dataset(config.data, workdir)
    batches = data.eval_batches(
        dataset.val_tokens,
        num_batches=config.train.eval_batches,
        batch_size=config.train.batch_size,
        block_size=config.data.block_size,
    )
    windows = diagnostics_report.concatenated(batches)
    positions = diagnostics_report.position_statistics(
        model, params, windows, batch_size
    )
    shape = (-1, config.data.block_size)
    count = len(windows["inputs"])
    nll = positions["nll"].reshape(shape)[:count]
    weights = positions["weights"].reshape(shape)[:count]
    chars = data.label_chars(dataset.tokenizer, batches)
    return ValidationWindows(
        (nll * weights).sum(1) / weights.sum(1),
        float(weights.sum() / (chars * math.log(2))),
    )


def window_margin(
    chosen: Sequence[np.ndarray], following: Sequence[np.ndarray]
) -> tuple[float, float]:
    r"""``(mean, standard error)`` over windows of :math:`\bar\delta_w`, the
    per-window difference ``following[s] - chosen[s]`` averaged over the
    seeds ``s`` (each ``[W]``, the same ``W >= 2`` windows).

    Examples:
        >>> mean, error = window_margin([np.array([1.0, 2.0, 3.0])],
        ...                             [np.array([1.5, 2.0, 3.7])])
        >>> round(mean, 4), round(error, 4)  # differences 0.5, 0, 0.7
        (0.4, 0.2082)
    """
    shapes = {np.shape(x) for x in (*chosen, *following)}
    if len(chosen) != len(following) or not chosen or len(shapes) != 1:
        raise ValueError(
            "chosen and following must be one [W] array per seed, as many of "
            f"each, all of one shape; got {len(chosen)} and {len(following)} "
            f"arrays of shapes {sorted(shapes)}."
        )
    (shape,) = shapes
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"each array must be [W] with W >= 2; got shape {shape}.")
    d = np.mean(following, 0, dtype=np.float64) - np.mean(chosen, 0, dtype=np.float64)
    mean, std, count = stats.mean_std(d.tolist())
    return mean, std / math.sqrt(count)


def _tuning_runs(rows: Sequence[Mapping[str, Any]], key: tuple) -> dict:
    """``{(lr, seed): run name}`` of an arm's finished tuning runs."""
    return {
        (row["lr"], row["seed"]): row["run"]
        for row in rows
        if row["role"] == "tune"
        and row["status"] == cells.FINISHED
        and (row["vocab"], row["amount"], row["arm"]) == key
    }


def _key(vocab: str, amount: float, arm: str) -> str:
    return f"{vocab} {amount:g} {arm}"


def rate_noise(
    study_dir: str,
    rows: Sequence[Mapping[str, Any]],
    previous: Mapping[str, Mapping[str, Any]] | None = None,
    batch_size: int = 16,
) -> list[dict[str, Any]]:
    """For each arm whose chosen rate was tuned (``cells.selection_noise``),
    its margin re-read on the validation windows of its tuning seeds' runs,
    with the standard error over the windows (:func:`window_margin`).

    Args:
        study_dir: the study's sweep directory; a run whose folder holds no
            parameters there (one restored from ``runs.csv`` alone) is not read.
        rows: ``runs.csv``'s rows.
        previous: an earlier result, ``{key: entry}`` as
            :func:`rate_noise` returns them: an arm's earlier entry (same chosen
            and next rate) stands where it read more seeds than can be read now.
        batch_size: windows per model call.

    Returns:
        One dict per arm, in the report's order: ``key``, ``vocab``,
        ``amount``, ``arm``, ``chosen_lr``, ``next_lr``, ``margin`` (the
        report's, bits/char, from ``runs.csv``), ``seed_error`` (the report's
        standard error of that margin, from the seeds' spread), ``seeds``
        (those whose two runs were read) and, over them, ``window_margin``
        and ``window_error`` in bits/char (None without a seed).
    """
    noise = cells.selection_noise(cells.tunings(rows))
    found = []
    for (vocab, amount, arm), margin in noise.margins.items():
        runs = _tuning_runs(rows, (vocab, amount, arm))
        read = {}
        for seed in margin.seeds:
            pair = [
                os.path.join(study_dir, runs[(lr, seed)])
                for lr in (margin.chosen, margin.following)
            ]
            if all(map(diagnostics_report.has_parameters, pair)):
                read[seed] = [window_losses(workdir, batch_size) for workdir in pair]
        entry = {
            "key": _key(vocab, amount, arm),
            "vocab": vocab,
            "amount": amount,
            "arm": arm,
            "chosen_lr": margin.chosen,
            "next_lr": margin.following,
            "margin": margin.margin,
            "seed_error": noise.standard_error(vocab, len(margin.seeds)),
            "seeds": sorted(read),
            "window_margin": None,
            "window_error": None,
        }
        if read:
            bits = next(iter(read.values()))[0].bits_per_nat
            mean, error = window_margin(
                [pair[0].nll for pair in read.values()],
                [pair[1].nll for pair in read.values()],
            )
            entry.update(window_margin=mean * bits, window_error=error * bits)
        earlier = (previous or {}).get(entry["key"])
        if (
            earlier is not None
            and (earlier["chosen_lr"], earlier["next_lr"])
            == (margin.chosen, margin.following)
            and len(earlier["seeds"]) > len(entry["seeds"])
        ):
            entry.update(
                {k: earlier[k] for k in ("seeds", "window_margin", "window_error")}
            )
        found.append(entry)
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
            report_text.prose("rate_noise"),
            report.markdown_table(
                report_text.column_names("rate_noise_columns"), lines
            ),
        ]
    )
