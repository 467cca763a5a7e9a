"""Tests for experiments/report.py and the statistics in lmhead/lab/sweeps.py.

A synthetic sweep directory with known final metrics (2 vocabularies x tied /
untied x 3 seeds, plus a failed run and one never started) goes through the
report's command line; the table's means and stds are checked against numpy
and the paired intervals against scipy's Student t.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from lmhead.lab import stats as stats_lib
from lmhead.lab import sweeps
from lmhead.lm import configuration
from lmhead.studies.tying import study
from tests import ROOT

REPORT_SCRIPT = os.path.join(ROOT, "experiments", "report.py")
CHARS = "".join(chr(c) for c in range(32, 32 + 84))
D_MODEL = 32
VOCABULARIES = {
    "char": dict(vocab_size=None, label="char (84)", params=1000, chars_per_token=1.0),
    "bpe": dict(vocab_size=512, label="bpe 512", params=2000, chars_per_token=2.5),
}
# Final validation loss by (tokenizer, tied) for seeds 0, 1, 2. Untied - tied:
# char [+0.03, +0.01, +0.07] (interval holds 0), bpe [-0.08, -0.05, -0.10] (not).
LOSS = {
    ("char", True): [1.90, 1.95, 1.88],
    ("char", False): [1.93, 1.96, 1.95],
    ("bpe", True): [4.10, 4.30, 4.05],
    ("bpe", False): [4.02, 4.25, 3.95],
}
ACCURACY = {
    ("char", True): [0.40, 0.42, 0.41],
    ("char", False): [0.39, 0.40, 0.44],
    ("bpe", True): [0.20, 0.22, 0.21],
    ("bpe", False): [0.23, 0.20, 0.22],
}
TOKENS_PER_SEC = [15000.0, 16000.0, 17500.0]
FAILED = "seed=3,tokenizer=char,tied=True"
NOT_STARTED = "seed=3,tokenizer=bpe,vocab_size=512,tied=False"


def overrides(tokenizer, tied, seed):
    vocab = {"data.tokenizer": tokenizer}
    if tokenizer == "bpe":
        vocab["data.vocab_size"] = VOCABULARIES["bpe"]["vocab_size"]
    return {"train.seed": seed, **vocab, "model.tied": tied}


def final_metrics(tokenizer, tied, seed):
    loss = LOSS[tokenizer, tied][seed]
    bits = loss / math.log(2) / VOCABULARIES[tokenizer]["chars_per_token"]
    return {
        "eval/loss": loss,
        "eval/perplexity": math.exp(loss),
        "eval/bits_per_char": bits,
        "eval/accuracy": ACCURACY[tokenizer, tied][seed],
        "eval/ece": 0.01 * (seed + 1) + (0.0 if tied else 0.005),
    }


def write_run(workdir, tokenizer, tied, seed, finished=True):
    os.makedirs(workdir)
    vocab = VOCABULARIES[tokenizer]
    config = {
        "data": {"tokenizer": tokenizer, "vocab_size": vocab["vocab_size"]},
        "model": {"tied": tied, "d_model": D_MODEL},
        "train": {"seed": seed, "steps": 20},
    }
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config, f)
    if tokenizer == "char":  # the BPE runs leave the size to config.json
        with open(os.path.join(workdir, "tokenizer.json"), "w") as f:
            json.dump({"kind": "char", "chars": CHARS}, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 10, "train/loss": 9.0}) + "\n")
        f.write(json.dumps({"step": 10, "eval/loss": 5.0 + seed}) + "\n")
        if finished:
            f.write(
                json.dumps({"step": 20, **final_metrics(tokenizer, tied, seed)}) + "\n"
            )
    if not finished:
        with open(os.path.join(workdir, sweeps.LOG_FILE), "w") as f:
            f.write("Traceback ...\nValueError: simulated\n")
        with open(os.path.join(workdir, sweeps.STATUS_FILE), "w") as f:
            json.dump({"returncode": 1, "seconds": 1.0, "command": []}, f)
        return
    head_params = 0 if tied else (84 if tokenizer == "char" else 512) * D_MODEL
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(
            {
                "num_params": vocab["params"] + head_params,
                "num_head_params": head_params,
                "final": final_metrics(tokenizer, tied, seed),
                "tokens_per_sec": TOKENS_PER_SEC[seed],
                "steps": 20,
                "wall_seconds": 3.0,
            },
            f,
        )


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    grid = [
        overrides(t, tied, seed)
        for seed in range(3)
        for t in VOCABULARIES
        for tied in (True, False)
    ]
    grid += [overrides("char", True, 3), overrides("bpe", False, 3)]
    names = sweeps.run_names(grid)
    assert FAILED in names and NOT_STARTED in names
    for name, run in zip(names, grid):
        if name != NOT_STARTED:
            write_run(
                root / name,
                run["data.tokenizer"],
                run["model.tied"],
                run["train.seed"],
                finished=name != FAILED,
            )
    with open(root / sweeps.SWEEP_FILE, "w") as f:
        json.dump(
            {"runs": [{"name": n, "overrides": o} for n, o in zip(names, grid)]}, f
        )
    return root


@pytest.fixture(scope="module")
def report(sweep_dir):
    result = subprocess.run(
        [sys.executable, REPORT_SCRIPT, f"--workdir={sweep_dir}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout, (sweep_dir / "REPORT.md").read_text()


def table_rows(markdown, first_header):
    """The rows of the markdown table whose first header cell is ``first_header``."""
    lines = markdown.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |")
    )
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def mean_std_text(values, decimals):
    values = np.asarray(values)
    return f"{values.mean():,.{decimals}f} ± {values.std(ddof=1):,.{decimals}f}"


def test_table_has_mean_and_std_over_seeds_per_setting(report):
    _, markdown = report
    rows = {(r["head"], r["vocabulary"]): r for r in table_rows(markdown, "head")}
    assert len(rows) == 4
    for tokenizer, vocab in VOCABULARIES.items():
        for tied in (True, False):
            row = rows["tied" if tied else "untied", vocab["label"]]
            finals = [final_metrics(tokenizer, tied, s) for s in range(3)]
            for key, title, decimals in [
                ("loss", "val loss (nats/token)", 4),
                ("perplexity", "perplexity", 2),
                ("bits_per_char", "bits/char", 4),
                ("accuracy", "accuracy", 4),
                ("ece", "calibration error (ECE)", 4),
            ]:
                assert row[title] == mean_std_text(
                    [f[f"eval/{key}"] for f in finals], decimals
                ), (tokenizer, tied, key)
            assert row["tokens/s"] == mean_std_text(TOKENS_PER_SEC, 0)
            assert row["d_model"] == str(D_MODEL) and row["n"] == "3"
            head_params = 0 if tied else {"char": 84, "bpe": 512}[tokenizer] * D_MODEL
            assert row["parameters"] == f"{vocab['params'] + head_params:,}"
    assert rows["tied", "char (84)"]["not finished"] == "1"
    assert rows["untied", "bpe 512"]["not finished"] == "1"
    assert rows["untied", "char (84)"]["not finished"] == "0"


def test_paired_differences_and_sentences(report):
    _, markdown = report
    rows = {r["vocabulary"]: r for r in table_rows(markdown, "vocabulary")}
    t = stats.t.ppf(0.975, 2)
    for tokenizer, vocab in VOCABULARIES.items():
        for key, column, short in (
            ("eval/loss", "val loss (nats/token)", "val loss"),
            ("eval/bits_per_char", "bits/char", "bits/char"),
        ):
            diffs = np.array(
                [
                    final_metrics(tokenizer, False, s)[key]
                    - final_metrics(tokenizer, True, s)[key]
                    for s in range(3)
                ]
            )
            mean, std = diffs.mean(), diffs.std(ddof=1)
            half = t * std / np.sqrt(3)
            row = rows[vocab["label"]]
            assert row[f"untied - tied, {column}"] == f"{mean:+.4f} ± {std:.4f}"
            assert (
                row[f"95% interval, {short}"]
                == f"[{mean - half:+.4f}, {mean + half:+.4f}]"
            )
        assert row["seed pairs"] == "3"
    assert "- char (84), d_model 32: untied - tied = +0.0367 nats/token" in markdown
    char_line = next(
        line for line in markdown.splitlines() if line.startswith("- char (84)")
    )
    bpe_line = next(
        line for line in markdown.splitlines() if line.startswith("- bpe 512")
    )
    assert char_line.endswith("not distinguishable from zero.")
    assert (
        "excludes zero: the untied head reaches the lower validation loss" in bpe_line
    )


def test_runs_that_did_not_finish_are_listed(report, sweep_dir):
    _, markdown = report
    assert "2 of 14 runs are not in the means above" in markdown
    assert (
        f"- `{FAILED}`: failed, exit code 1, last evaluation at step 10, log "
        f"`{FAILED}/{sweeps.LOG_FILE}`"
    ) in markdown
    assert f"- `{NOT_STARTED}`: not started" in markdown


def test_plots_are_written_and_printed(report, sweep_dir):
    stdout, markdown = report
    assert stdout.startswith("| head | vocabulary |")
    for name in ("loss_curves.png", "loss_vs_vocab.png", "loss_vs_params.png"):
        path = sweep_dir / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000
        assert f"Plot:   {path}" in stdout and f"![{name}]({name})" in markdown


def test_runs_without_sweep_json_are_found_and_grouped(sweep_dir, tmp_path):
    """Runs launched from --dry_run commands: overrides are the varying config keys."""
    for name in os.listdir(sweep_dir):
        if (sweep_dir / name / "config.json").exists():
            shutil.copytree(sweep_dir / name, tmp_path / name)
    runs = sweeps.read_sweep(str(tmp_path))
    assert len(runs) == 13
    assert set(runs[0].overrides) == {
        "data.tokenizer",
        "data.vocab_size",
        "model.tied",
        "train.seed",
    }
    groups = sweeps.group_runs(runs)
    assert sorted(len(g) for g in groups) == [3, 3, 3, 4]


# --- Statistics ---------------------------------------------------------------


def test_t_critical_values_match_scipy():
    for dof in range(1, 201):
        assert stats_lib.t_critical_95(dof) == pytest.approx(
            stats.t.ppf(0.975, dof), abs=2e-6
        ), dof
    with pytest.raises(ValueError, match="dof"):
        stats_lib.t_critical_95(0)


def test_paired_interval_matches_a_known_t_test():
    # R: t.test(c(1, 2, 3, 4)) gives the 95% interval 0.4457397 .. 4.5542603.
    difference = stats_lib.paired_difference(
        {s: s + 1.0 for s in range(4)}, {s: 0.0 for s in range(4)}
    )
    assert difference.low == pytest.approx(0.4457397, abs=1e-6)
    assert difference.high == pytest.approx(4.5542603, abs=1e-6)
    assert difference.excludes_zero
    single = stats_lib.paired_difference({0: 1.0, 1: 2.0}, {0: 0.5})
    assert single.n == 1 and math.isnan(single.low) and not single.excludes_zero


def test_mean_std_matches_numpy():
    values = [0.3, 1.7, 2.2, 5.0]
    mean, std, n = stats_lib.mean_std(values)
    assert (mean, n) == (pytest.approx(np.mean(values)), 4)
    assert std == pytest.approx(np.std(values, ddof=1))
    assert math.isnan(stats_lib.mean_std([1.0])[1])


# --- The tying study's report -------------------------------------------------

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
        "num_params": study.count_params(cell.vocab_size, cell.shape, design.arch),
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


@pytest.fixture(scope="module")
def study_report(tmp_path_factory):
    """A synthetic study directory (both stages), reported through report.py."""
    root = tmp_path_factory.mktemp("study")
    design = configuration.load_module(STUDY_SPEC.split(":")[0]).get_study(
        "tiny,seeds=3"
    )
    chosen = {c: STUDY_CHOSEN_LR[c.arm] for c in design.cells()}
    planned = design.tuning_runs() + design.seed_runs(chosen)
    for index, (run, name) in enumerate(zip(planned, design.names(planned))):
        write_study_run(root / "runs" / name, run, design)
        if run.seed == 1:  # timed by the runner, two at a time: 16 s overlaps
            started = STUDY_RUNNER_START + 20 * index
            (root / "runs" / name / sweeps.STATUS_FILE).write_text(
                json.dumps({"returncode": 0, "started": started, "ended": started + 36})
            )
    with open(root / "runs" / sweeps.SWEEP_FILE, "w") as f:
        json.dump({"sweep": STUDY_SPEC, "machine": "test machine", "runs": []}, f)
    result = subprocess.run(
        [
            sys.executable,
            REPORT_SCRIPT,
            f"--workdir={root / 'runs'}",
            f"--out={root / 'docs'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return (
        design,
        root / "docs",
        (root / "docs" / "REPORT.md").read_text(),
        result.stdout,
    )


def regime_section(markdown, regime):
    return markdown.split(f"## Regime `{regime}`")[1].split("\n## ")[0]


def study_seeds(cell):
    return [
        s
        for s in range(3)
        if (cell.regime.name, cell.vocab, cell.arm, s) != STUDY_UNFINISHED
    ]


def test_study_table_has_the_known_values(study_report):
    design, _, markdown, _ = study_report
    for regime in design.regimes:
        rows = table_rows(regime_section(markdown, regime.name), "vocabulary")
        cells = [c for c in design.cells() if c.regime == regime]
        assert len(rows) == len(cells) == 8
        for row, cell in zip(rows, cells):
            seeds = study_seeds(cell)
            values = np.array([study_values(cell, s) for s in seeds])
            assert row["arm"].startswith(f"{cell.arm}: ")
            assert row["lr"] == f"{STUDY_CHOSEN_LR[cell.arm]:g}"
            assert row["test bits/char"] == mean_std_text(values[:, 0], 4)
            assert row["val bits/char"] == mean_std_text(values[:, 1], 4)
            assert row["train − val bits/char"] == mean_std_text(
                values[:, 2] - values[:, 1], 4
            )
            assert row["n"] == str(len(seeds))
            assert row["not finished"] == str(3 - len(seeds))
            params = study.count_params(cell.vocab_size, cell.shape, design.arch)
            assert row["parameters"] == f"{params:,}"
            assert (
                row["head share"]
                == f"{cell.vocab_size * cell.shape.d_model / params:.1%}"
            )
            if regime.patience:
                steps = [10 * (s + 1) + "abcd".index(cell.arm) for s in seeds]
                assert row["steps to best"] == mean_std_text(steps, 0)
                assert (
                    row["stopped early"]
                    == f"{sum(s < 2 for s in seeds)} of {len(seeds)}"
                )
            else:
                assert "steps to best" not in row


def test_study_report_states_how_closely_the_arms_match(study_report):
    """The worst |c - a| / a and |d - b| / b over vocabularies, from the runs'
    own counts (here the design's: every run reports its count)."""
    design, _, markdown, _ = study_report
    for regime in design.regimes:
        counts = {
            (c.vocab, c.arm): study.count_params(c.vocab_size, c.shape, design.arch)
            for c in design.cells()
            if c.regime == regime
        }
        worst = {
            x: max(
                abs(counts[v, x] - counts[v, y]) / counts[v, y]
                for v in design.vocabularies
            )
            for x, y in (("c", "a"), ("d", "b"))
        }
        assert (
            f"Parameter counts (the runs' own, else the design's): c is within "
            f"{worst['c']:.2%} of a, d within {worst['d']:.2%} of b.\n\n"
        ) in regime_section(markdown, regime.name)


def test_match_text_reads_the_runs_counts_and_names_pairs_outside_the_tolerance():
    """The runs' num_params decide (the design solved 1,000 for every arm);
    c − a is off by 1.5% (inside 2%), d − b by 3% (outside)."""
    from lmhead.studies.tying import report as report_lib

    regime = study.Regime("limited", 0.03, 100, 3)

    def result(arm, num_params):
        cell = study.Cell(regime, 8192, arm, study.Shape(arm in "ad", 8, 1, 16), 6911)
        run = sweeps.Run("r", "r", {}, {}, [], {"num_params": num_params}, "finished")
        return report_lib.CellResult(cell, 1e-3, {}, {0: run, 1: run}, 1000)

    text = report_lib.match_text(
        [result("a", 2000), result("b", 3000), result("c", 2030), result("d", 2910)]
    )
    assert text.splitlines() == [
        "Parameter counts (the runs' own, else the design's): c is within 1.50% of a, "
        "d within 3.00% of b.",
        "- BPE 8192: d has 2,910 parameters, b 3,000 (-3.0%), outside the design's 2%: "
        "the d − b comparison is not at matched size.",
    ]
    assert report_lib.match_text([result("a", 2000), result("b", 3000)]) == ""


def test_study_provenance_counts_the_runs_the_design_no_longer_plans(tmp_path):
    """Finished runs outside the plan are reported with their cost, apart from
    the totals; unfinished ones and files are not."""
    from lmhead.studies.tying import report as report_lib

    for name, summary in (
        ("planned", {"steps_run": 1000, "wall_seconds": 60.0}),
        ("old_shape", {"steps_run": 400, "wall_seconds": 1800.0}),
        ("old_rate", {"steps": 1000, "wall_seconds": 5400.0}),
        ("old_unfinished", None),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        if summary:
            (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    (tmp_path / sweeps.SWEEP_FILE).write_text("{}")
    planned = [sweeps.read_run(str(tmp_path / "planned"))]
    assert report_lib.other_runs_text(str(tmp_path), planned) == (
        "Not in the plan: 2 more finished runs in the sweep directory (shapes or "
        "rates the design no longer asks for), 1,400 training steps and 2.00 h of "
        "wall time, not counted above."
    )
    assert (
        report_lib.other_runs_text(
            str(tmp_path),
            [
                sweeps.read_run(str(tmp_path / n))
                for n in ("planned", "old_shape", "old_rate")
            ],
        )
        == ""
    )


def t_interval_text(x, y):
    diffs = np.asarray(x) - np.asarray(y)
    mean, half = (
        diffs.mean(),
        stats.t.ppf(0.975, len(diffs) - 1) * diffs.std(ddof=1) / np.sqrt(len(diffs)),
    )
    return f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"


def test_study_paired_differences_and_literature_numbers(study_report):
    design, _, markdown, _ = study_report
    for regime in design.regimes:
        section = regime_section(markdown, regime.name)
        differences = section.split("Paired by seed")[1]
        rows = {r["vocabulary"]: r for r in table_rows(differences, "vocabulary")}
        for vocab in design.vocabularies:
            cells = {
                c.arm: c
                for c in design.cells()
                if c.regime == regime and c.vocab == vocab
            }
            row = rows[study.vocabulary_label(vocab)]
            for label, x_arm, y_arm in (
                ("b − a", "b", "a"),
                ("c − a", "c", "a"),
                ("d − b", "d", "b"),
            ):
                seeds = sorted(
                    set(study_seeds(cells[x_arm])) & set(study_seeds(cells[y_arm]))
                )
                x = [study_values(cells[x_arm], s)[0] for s in seeds]
                y = [study_values(cells[y_arm], s)[0] for s in seeds]
                assert row[f"{label} [95% interval]"] == t_interval_text(x, y), (
                    regime.name,
                    vocab,
                    label,
                )
            train = [[study_values(cells[arm], s)[2] for s in range(3)] for arm in "ab"]
            assert row["training a − b [95% interval]"] == t_interval_text(*train)
            tied_minus_untied = np.mean(
                [
                    study_values(cells["a"], s)[0] - study_values(cells["b"], s)[0]
                    for s in range(3)
                ]
            )
            change = 2 ** (tied_minus_untied * STUDY_CHARS_PER_TOKEN[vocab]) - 1
            line = next(
                text
                for text in section.splitlines()
                if text.startswith(f"- {study.vocabulary_label(vocab)} (head")
            )
            assert f"test perplexity per token {change:+.2%} untied → tied" in line


def test_study_tuning_table_shows_every_rate_and_the_chosen_one(study_report):
    design, _, markdown, _ = study_report
    for regime in design.regimes:
        tuning = regime_section(markdown, regime.name).split("Learning-rate tuning")[1]
        rows = table_rows(tuning, "vocabulary")
        cells = [c for c in design.cells() if c.regime == regime]
        assert len(rows) == len(cells)
        for row, cell in zip(rows, cells):
            assert row["arm"].startswith(f"{cell.arm}: ")
            for lr in design.learning_rates:
                # The synthetic runs at the other rates report 99 bits/char.
                expected = (
                    f"**{study_values(cell, 0)[1]:.4f}**"
                    if lr == STUDY_CHOSEN_LR[cell.arm]
                    else "99.0000"
                )
                assert row[f"lr {lr:g}"] == expected, (regime.name, cell, lr)


def test_study_report_names_the_works_of_each_split_and_the_seeds(study_report):
    _, _, markdown, _ = study_report
    # lmhead/lm/data.py's split_works documents this split of the embedded corpus.
    assert (
        "- test: as_you_like_it, henry_iv_part_1, passionate_pilgrim, "
        "romeo_and_juliet, sonnets (10.1%)"
    ) in markdown
    assert (
        "- validation: comedy_of_errors, coriolanus, hamlet, macbeth (10.5%)"
        in markdown
    )
    training = next(
        line for line in markdown.splitlines() if line.startswith("- training: ")
    )
    assert training.startswith(
        "- training: the other 33 works (79.4%); regime "
        "`limited` trains on their first 50% ("
    )
    assert "over seeds 0, 1, 2 at each cell's learning rate" in markdown


def test_study_report_plots_and_measured_total(study_report):
    design, docs, markdown, stdout = study_report
    for name in ("delta_vs_head_share.png", "curves_fixed.png", "curves_limited.png"):
        assert (docs / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in markdown and f"Plot:   {docs / name}" in stdout
    finished = len(design.tuning_runs()) + len(design.cells()) * 2 - 1
    assert f"{finished} of " in markdown
    assert f"{finished * 36 / 3600:.2f} h of wall time" in markdown
    summaries = [
        json.loads(path.read_text())
        for path in (docs.parent / "runs").glob("*/summary.json")
    ]
    step_hours = sum(summary["steps_run"] * 18.0 for summary in summaries) / 3.6e6
    assert (
        f"median step time, summed over runs, {step_hours:.2f} h ({finished} runs timed"
    ) in markdown
    # The runner's intervals, counted second by second; the rest by wall_seconds.
    statuses = [
        json.loads(path.read_text())
        for path in (docs.parent / "runs").glob(f"*/{sweeps.STATUS_FILE}")
    ]
    covered = {
        second
        for status in statuses
        for second in range(status["started"], status["ended"])
    }
    busy = (len(covered) + 36 * (finished - len(statuses))) / 3600
    assert 0 < len(covered) < 36 * len(statuses)  # the overlaps are counted once
    assert (
        f"{busy:.2f} h of the machine's time with overlapping runs counted once "
        f"({len(statuses)} runs timed by the sweep runner"
    ) in markdown
    assert "Press & Wolf 2017, PTB small" in markdown and "(-1.8%)" in markdown
    predictions = table_rows(markdown.split("What they predict")[1], "source")
    assert [row["source"].split(" (")[0] for row in predictions] == [
        "Press & Wolf 2017; Inan et al. 2017",
        "MobileLLM",
        "Chung et al. 2021",
        "modded-nanogpt",
    ]


def test_study_counts_the_signs_that_test_each_prediction(study_report):
    """ "found here": per regime and comparison, how many vocabularies have a
    positive paired mean and an interval wholly above or below zero, from the
    known values (the unfinished seed drops out of its pairs)."""
    design, _, markdown, _ = study_report
    predictions = table_rows(markdown.split("What they predict")[1], "source")
    column = {"test": 0, "train": 2}

    def found(regime, x_arm, y_arm, key):
        positive = above = below = 0
        for vocab in design.vocabularies:
            cells = {
                c.arm: c
                for c in design.cells()
                if c.regime == regime and c.vocab == vocab
            }
            seeds = sorted(
                set(study_seeds(cells[x_arm])) & set(study_seeds(cells[y_arm]))
            )
            diffs = np.array(
                [
                    study_values(cells[x_arm], s)[column[key]]
                    - study_values(cells[y_arm], s)[column[key]]
                    for s in seeds
                ]
            )
            half = (
                stats.t.ppf(0.975, len(diffs) - 1)
                * diffs.std(ddof=1)
                / np.sqrt(len(diffs))
            )
            positive += diffs.mean() > 0
            above += diffs.mean() - half > 0
            below += diffs.mean() + half < 0
        prefix = "training " if key == "train" else ""
        return (
            f"`{regime.name}` {prefix}{x_arm} − {y_arm}: > 0 at {positive} of "
            f"{len(design.vocabularies)} (interval above 0 at {above}, below at {below})"
        )

    checks = [
        (("b", "a", "test"), ("a", "b", "train")),
        (("d", "b", "test"),),
        (("c", "a", "test"),),
        (("b", "a", "test"),),
    ]
    for row, comparisons in zip(predictions, checks):
        assert row["found here"] == "<br>".join(
            found(regime, *c) for regime in design.regimes for c in comparisons
        )
    # The known values: c − a's interval lies above zero; d − b is negative,
    # its interval spanning zero over 3 seeds, but not over the 2 seeds of the
    # cell with an unfinished run (its two differences are equal).
    assert (
        predictions[2]["found here"].count(
            "c − a: > 0 at 2 of 2 (interval above 0 at 2, below at 0)"
        )
        == 2
    )
    assert predictions[1]["found here"] == (
        "`fixed` d − b: > 0 at 0 of 2 (interval above 0 at 0, below at 0)<br>"
        "`limited` d − b: > 0 at 0 of 2 (interval above 0 at 0, below at 1)"
    )
