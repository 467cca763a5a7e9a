"""Tests for experiments/report.py and the statistics in lmhead/sweeps.py.

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

from lmhead import stats as stats_lib
from lmhead import sweeps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT_SCRIPT = os.path.join(ROOT, "experiments", "report.py")
CHARS = "".join(chr(c) for c in range(32, 32 + 84))
D_MODEL = 32
VOCABULARIES = {"char": dict(vocab_size=None, label="char (84)", params=1000,
                             chars_per_token=1.0),
                "bpe": dict(vocab_size=512, label="bpe 512", params=2000,
                            chars_per_token=2.5)}
# Final validation loss by (tokenizer, tied) for seeds 0, 1, 2. Untied - tied:
# char [+0.03, +0.01, +0.07] (interval holds 0), bpe [-0.08, -0.05, -0.10] (not).
LOSS = {("char", True): [1.90, 1.95, 1.88], ("char", False): [1.93, 1.96, 1.95],
        ("bpe", True): [4.10, 4.30, 4.05], ("bpe", False): [4.02, 4.25, 3.95]}
ACCURACY = {("char", True): [0.40, 0.42, 0.41], ("char", False): [0.39, 0.40, 0.44],
            ("bpe", True): [0.20, 0.22, 0.21], ("bpe", False): [0.23, 0.20, 0.22]}
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
    return {"eval/loss": loss, "eval/perplexity": math.exp(loss),
            "eval/bits_per_char": bits, "eval/accuracy": ACCURACY[tokenizer, tied][seed],
            "eval/ece": 0.01 * (seed + 1) + (0.0 if tied else 0.005)}


def write_run(workdir, tokenizer, tied, seed, finished=True):
    os.makedirs(workdir)
    vocab = VOCABULARIES[tokenizer]
    config = {"data": {"tokenizer": tokenizer, "vocab_size": vocab["vocab_size"]},
              "model": {"tied": tied, "d_model": D_MODEL},
              "train": {"seed": seed, "steps": 20}}
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config, f)
    if tokenizer == "char":  # the BPE runs leave the size to config.json
        with open(os.path.join(workdir, "tokenizer.json"), "w") as f:
            json.dump({"kind": "char", "chars": CHARS}, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 10, "train/loss": 9.0}) + "\n")
        f.write(json.dumps({"step": 10, "eval/loss": 5.0 + seed}) + "\n")
        if finished:
            f.write(json.dumps({"step": 20, **final_metrics(tokenizer, tied, seed)}) + "\n")
    if not finished:
        with open(os.path.join(workdir, sweeps.LOG_FILE), "w") as f:
            f.write("Traceback ...\nValueError: simulated\n")
        with open(os.path.join(workdir, sweeps.STATUS_FILE), "w") as f:
            json.dump({"returncode": 1, "seconds": 1.0, "command": []}, f)
        return
    head_params = 0 if tied else (84 if tokenizer == "char" else 512) * D_MODEL
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({"num_params": vocab["params"] + head_params,
                   "num_head_params": head_params,
                   "final": final_metrics(tokenizer, tied, seed),
                   "tokens_per_sec": TOKENS_PER_SEC[seed], "steps": 20,
                   "wall_seconds": 3.0}, f)


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    grid = [overrides(t, tied, seed) for seed in range(3) for t in VOCABULARIES
            for tied in (True, False)]
    grid += [overrides("char", True, 3), overrides("bpe", False, 3)]
    names = sweeps.run_names(grid)
    assert FAILED in names and NOT_STARTED in names
    for name, run in zip(names, grid):
        if name != NOT_STARTED:
            write_run(root / name, run["data.tokenizer"], run["model.tied"],
                      run["train.seed"], finished=name != FAILED)
    with open(root / sweeps.SWEEP_FILE, "w") as f:
        json.dump({"runs": [{"name": n, "overrides": o} for n, o in zip(names, grid)]}, f)
    return root


@pytest.fixture(scope="module")
def report(sweep_dir):
    result = subprocess.run([sys.executable, REPORT_SCRIPT, f"--workdir={sweep_dir}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout, (sweep_dir / "REPORT.md").read_text()


def table_rows(markdown, first_header):
    """The rows of the markdown table whose first header cell is ``first_header``."""
    lines = markdown.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(f"| {first_header} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
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
                    ("loss", "val loss (nats/token)", 4), ("perplexity", "perplexity", 2),
                    ("bits_per_char", "bits/char", 4), ("accuracy", "accuracy", 4),
                    ("ece", "calibration error (ECE)", 4)]:
                assert row[title] == mean_std_text([f[f"eval/{key}"] for f in finals],
                                                   decimals), (tokenizer, tied, key)
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
        for key, column, short in (("eval/loss", "val loss (nats/token)", "val loss"),
                                   ("eval/bits_per_char", "bits/char", "bits/char")):
            diffs = np.array([final_metrics(tokenizer, False, s)[key]
                              - final_metrics(tokenizer, True, s)[key] for s in range(3)])
            mean, std = diffs.mean(), diffs.std(ddof=1)
            half = t * std / np.sqrt(3)
            row = rows[vocab["label"]]
            assert row[f"untied - tied, {column}"] == f"{mean:+.4f} ± {std:.4f}"
            assert row[f"95% interval, {short}"] == f"[{mean - half:+.4f}, {mean + half:+.4f}]"
        assert row["seed pairs"] == "3"
    assert "- char (84), d_model 32: untied - tied = +0.0367 nats/token" in markdown
    char_line = next(l for l in markdown.splitlines() if l.startswith("- char (84)"))
    bpe_line = next(l for l in markdown.splitlines() if l.startswith("- bpe 512"))
    assert char_line.endswith("not distinguishable from zero.")
    assert "excludes zero: the untied head reaches the lower validation loss" in bpe_line


def test_runs_that_did_not_finish_are_listed(report, sweep_dir):
    _, markdown = report
    assert "2 of 14 runs are not in the means above" in markdown
    assert (f"- `{FAILED}`: failed, exit code 1, last evaluation at step 10, log "
            f"`{FAILED}/{sweeps.LOG_FILE}`") in markdown
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
    assert set(runs[0].overrides) == {"data.tokenizer", "data.vocab_size", "model.tied",
                                      "train.seed"}
    groups = sweeps.group_runs(runs)
    assert sorted(len(g) for g in groups) == [3, 3, 3, 4]


# --- Statistics ---------------------------------------------------------------


def test_t_critical_values_match_scipy():
    for dof in range(1, 201):
        assert stats_lib.t_critical_95(dof) == pytest.approx(stats.t.ppf(0.975, dof),
                                                          abs=2e-6), dof
    with pytest.raises(ValueError, match="dof"):
        stats_lib.t_critical_95(0)


def test_paired_interval_matches_a_known_t_test():
    # R: t.test(c(1, 2, 3, 4)) gives the 95% interval 0.4457397 .. 4.5542603.
    difference = stats_lib.paired_difference({s: s + 1.0 for s in range(4)},
                                          {s: 0.0 for s in range(4)})
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
