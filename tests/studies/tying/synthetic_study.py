"""A synthetic tying-study directory (both stages of ``tying_study.py:tiny``,
3 seeds) with known test, validation and training bits per char per cell and
seed, for the tests of the study's report, results and literature
comparison; one run is left unfinished, and the seed-1 runs carry the
runner's start and end times, two at a time."""

import json
import os

import numpy as np
from scipy import stats

from lmhead.lab import workdirs
from lmhead.lm import configuration
from lmhead.studies.tying import shapes
from tests import ROOT

STUDY_SPEC = os.path.join(ROOT, "configs", "sweeps", "tying_study.py") + ":tiny,seeds=3"
STUDY_TEST_BASE = {None: 3.0, 300: 2.5}
STUDY_ARM_OFFSET = {"a": 0.0, "b": 0.05, "c": 0.08, "d": -0.02}
STUDY_REGIME_OFFSET = {"fixed": 0.0, "limited": 0.3}
# c's noise follows a's, so that c − a's interval lies above zero.
STUDY_NOISE = [
    {"a": 0.00, "b": 0.01, "c": 0.01, "d": 0.03},
    {"a": 0.02, "b": -0.01, "c": 0.03, "d": 0.01},
    {"a": -0.01, "b": 0.04, "c": -0.01, "d": -0.03},
]
STUDY_GAP = {"a": 0.05, "b": 0.12, "c": 0.10, "d": 0.07}  # val - train at seed 0
STUDY_CHOSEN_LR = {"a": 3e-3, "b": 1e-3, "c": 3e-3, "d": 1e-3}
STUDY_CHARS_PER_TOKEN = {None: 1.0, 300: 2.0}
STUDY_UNFINISHED = ("limited", 300, "d", 2)
STUDY_RUNNER_START = 1_000_000


def study_values(cell, seed):
    """Known test / validation / training bits per char of a cell's run at its rate."""
    test = (
        STUDY_TEST_BASE[cell.vocab]
        + STUDY_ARM_OFFSET[cell.arm]
        + STUDY_REGIME_OFFSET[cell.regime.name]
        + STUDY_NOISE[seed][cell.arm]
    )
    val = test + 0.01
    return test, val, val - STUDY_GAP[cell.arm] - 0.01 * seed


def write_study_run(workdir, planned, design):
    cell, seed = planned.cell, planned.seed
    os.makedirs(workdir)
    chosen = planned.lr == STUDY_CHOSEN_LR[cell.arm]
    test, val, train = study_values(cell, seed) if chosen else (99.0, 99.0, 99.0)
    chosen_loss, other_loss = (1.0, 1.2) if chosen else (1.2, 1.0)
    limited = cell.regime.patience > 0
    step = 10 * (seed + 1) + "abcd".index(cell.arm) if limited else cell.regime.steps
    tested = {"eval/loss": chosen_loss, "eval/bits_per_char": val}
    # The evaluation that is not the tested one says the opposite, so that
    # reading the wrong one shows.
    other = {"eval/loss": other_loss, "eval/bits_per_char": 50.0}
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": step, **tested}) + "\n")
        f.write(json.dumps({"step": step, "train_eval/bits_per_char": train}) + "\n")
        f.write(
            json.dumps(
                {
                    "step": cell.regime.steps + 1,
                    "train_eval/bits_per_char": 40.0,
                    **other,
                }
            )
            + "\n"
        )
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(
            {
                "data": {
                    "split": "works",
                    "path": None,
                    "val_fraction": 0.1,
                    "test_fraction": 0.1,
                }
            },
            f,
        )
    if (cell.regime.name, cell.vocab, cell.arm, seed) == STUDY_UNFINISHED:
        return
    cpt = STUDY_CHARS_PER_TOKEN[cell.vocab]
    summary = {
        "num_params": shapes.count_params(cell.vocab_size, cell.shape, design.arch),
        "vocab_size": cell.vocab_size,
        "wall_seconds": 36.0,
        "step_ms_p50": 18.0,
        "steps_run": step if limited else cell.regime.steps,
        "final": tested if not limited else other,
        "best": tested if limited else other,
        "best_step": step,
        "stopped_early": limited and seed < 2,
        "test": {
            "bits_per_char": test,
            "num_tokens": 1000,
            "num_chars": int(1000 * cpt),
        },
    }
    if limited:
        summary["train_at_best"] = {"train_eval/bits_per_char": train}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f)


def write_study(root):
    """Writes the study's runs into ``root`` (and its ``sweep.json``, which
    names the sweep file); returns the design."""
    design = configuration.load_module(STUDY_SPEC.split(":")[0]).get_study(
        "tiny,seeds=3"
    )
    chosen = {c: STUDY_CHOSEN_LR[c.arm] for c in design.cells()}
    planned = design.tuning_runs() + design.seed_runs(chosen)
    for index, (run, name) in enumerate(zip(planned, design.names(planned))):
        write_study_run(root / name, run, design)
        if run.seed == 1:  # timed by the runner, two at a time: 16 s overlaps
            started = STUDY_RUNNER_START + 20 * index
            (root / name / workdirs.STATUS_FILE).write_text(
                json.dumps({"returncode": 0, "started": started, "ended": started + 36})
            )
    with open(root / workdirs.SWEEP_FILE, "w") as f:
        json.dump({"sweep": STUDY_SPEC, "machine": "test machine", "runs": []}, f)
    return design


def regime_section(markdown, regime):
    """The report's section of one regime."""
    return markdown.split(f"## Regime `{regime}`")[1].split("\n## ")[0]


def study_seeds(cell):
    """The seeds whose runs of ``cell`` finished."""
    return [
        s
        for s in range(3)
        if (cell.regime.name, cell.vocab, cell.arm, s) != STUDY_UNFINISHED
    ]


def t_interval_text(x, y):
    """numpy and scipy's paired difference ``x - y`` and its 95% t-interval,
    as the report writes them."""
    diffs = np.asarray(x) - np.asarray(y)
    mean, half = (
        diffs.mean(),
        stats.t.ppf(0.975, len(diffs) - 1) * diffs.std(ddof=1) / np.sqrt(len(diffs)),
    )
    return f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"
