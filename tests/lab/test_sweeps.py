"""Tests for lmhead/lab/sweeps.py, the sweep-file API: axes, products, run
names, train commands, and the sweep files of configs/sweeps/ parsed as
experiments/train.py parses its flags."""

import csv
import os

import numpy as np
import pytest
import scipy.stats

from lmhead.lab import report, sweeps
from lmhead.lm import configuration
from tests.lab.sweep_helpers import (
    DEFAULT_CONFIG,
    ROOT,
    SWEEP_CONFIGS,
    parsed_train_config,
)

# --- Building sweeps ----------------------------------------------------------


def test_product_is_the_cartesian_product_last_axis_fastest():
    grid = sweeps.product(
        sweeps.sweep("a", [1, 2]),
        sweeps.sweep("b", ["x", "y", "z"]),
        [{"c": 0, "d": 1}],
    )
    expected = [{"a": a, "b": b, "c": 0, "d": 1} for a in (1, 2) for b in "xyz"]
    assert grid == expected
    assert sweeps.product() == [{}]


def test_zipped_pairs_entries_and_rejects_unequal_lengths():
    assert sweeps.zipped(sweeps.sweep("a", [1, 2]), sweeps.sweep("b", [3, 4])) == [
        {"a": 1, "b": 3},
        {"a": 2, "b": 4},
    ]
    with pytest.raises(ValueError, match="equal length"):
        sweeps.zipped(sweeps.sweep("a", [1, 2]), sweeps.sweep("b", [3]))


def test_axes_setting_the_same_key_are_rejected():
    with pytest.raises(ValueError, match="'a'"):
        sweeps.product(sweeps.sweep("a", [1]), sweeps.sweep("a", [2]))
    with pytest.raises(TypeError, match="dict"):
        sweeps.product([1, 2])


def test_parse_arg_types_and_errors():
    defaults = dict(steps=10, lr=0.1, tied=True, base=("tiny",), sizes=(256,))
    assert sweeps.parse_arg(
        "steps=7,lr=0.5,tied=false,base=nanogpt+untied,sizes=1+2", defaults
    ) == dict(steps=7, lr=0.5, tied=False, base=("nanogpt", "untied"), sizes=(1, 2))
    assert sweeps.parse_arg("sizes=", defaults)["sizes"] == ()
    assert sweeps.parse_arg(None, defaults) == defaults
    with pytest.raises(ValueError, match="steps=10"):
        sweeps.parse_arg("step=3", defaults)
    with pytest.raises(ValueError, match="expected int"):
        sweeps.parse_arg("steps=many", defaults)
    with pytest.raises(ValueError, match="true or false"):
        sweeps.parse_arg("tied=yes", defaults)


# --- Names and commands ---------------------------------------------------------


def test_run_names_are_readable_unique_and_safe():
    assert sweeps.run_names(
        [
            {"model.tied": True, "data.path": "/a b/c.txt"},
            {"model.tied": False, "optim.lr": 1e-3},
        ]
    ) == ["tied=True,path=_a_b_c.txt", "tied=False,lr=0.001"]
    # Short names would collide: both runs fall back to full keys.
    assert sweeps.run_names([{"model.seed": 1}, {"train.seed": 1}]) == [
        "model.seed=1",
        "train.seed=1",
    ]
    assert sweeps.run_names([{}]) == ["base"]
    with pytest.raises(ValueError, match="more than once"):
        sweeps.run_names([{"a": 1}, {"a": 1}])


def test_long_run_names_are_cut_with_a_hash():
    names = sweeps.run_names([{"data.path": "x" * 300 + str(i)} for i in range(2)])
    assert all(len(n) == sweeps.MAX_NAME_LENGTH for n in names)
    assert names[0] != names[1] and names[0][:100] == names[1][:100]


def test_override_flags_reject_none():
    with pytest.raises(ValueError, match="data.vocab_size=None"):
        sweeps.override_flags({"data.vocab_size": None})


@pytest.mark.parametrize(
    "sweep_file,num_runs",
    [
        ("tying_study.py:small", 3 * 8),
        ("filter_training.py", 3 * 8),
        ("mtp.py", 4 * 8),
    ],
)
def test_sweep_files_set_existing_knobs_and_parse_as_train_flags(
    sweep_file, num_runs, monkeypatch
):
    """Runs' command lines parse with config_flags into the intended configs."""
    base, overrides, shared = sweeps.load_sweep(os.path.join(SWEEP_CONFIGS, sweep_file))
    assert len(overrides) == num_runs == len(set(sweeps.run_names(overrides)))
    assert len({o["train.seed"] for o in overrides}) == 8
    for run in (overrides[0], overrides[-1]):
        argv = sweeps.train_command(
            base,
            "unused",
            run,
            python="python",
            script="x",
            config_file=DEFAULT_CONFIG,
            shared=shared,
        )[2:]
        flat = parsed_train_config(argv, monkeypatch)
        assert {k: flat[k] for k in run | shared} == run | shared


def test_sweep_arguments_size_the_sweep():
    base, overrides, shared = sweeps.load_sweep(
        os.path.join(
            SWEEP_CONFIGS,
            "filter_training.py:base=tiny,vocab_size=300,steps=7,seeds=2,targets=dh",
        )
    )
    assert base == "tiny,bpe=300" and shared["train.steps"] == 7
    assert len(overrides) == 2 * 2  # exact and one filtered arm, 2 seeds each
    assert {o["train.seed"] for o in overrides} == {0, 1}


def test_load_sweep_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no sweep file"):
        sweeps.load_sweep(str(tmp_path / "missing.py"))
    (tmp_path / "empty.py").write_text(
        "def get_sweep(arg=None):\n    return 'tiny', []\n"
    )
    with pytest.raises(ValueError, match="non-empty list"):
        sweeps.load_sweep(str(tmp_path / "empty.py"))


def test_filter_training_sweep_pairs_each_seed_exact_and_filtered(monkeypatch):
    """configs/sweeps/filter_training.py: 8 seeds, each exact and at 2^-12
    filtering both gradients or dh only, on its recipe at BPE 32768 with a
    test evaluation, as train.py parses it."""
    path = os.path.join(SWEEP_CONFIGS, "filter_training.py")
    base, overrides, shared = sweeps.load_sweep(path)
    assert base == "nanogpt" and len(set(sweeps.run_names(overrides))) == 24
    arms = {
        (o["train.seed"], o.get("loss.filter_eps"), o.get("loss.filter_target"))
        for o in overrides
    }
    eps = 2.0**-12
    assert arms == {
        (s, *arm) for s in range(8) for arm in ((None, None), (eps, None), (eps, "dh"))
    }
    argv = sweeps.train_command(
        base,
        "unused",
        {**shared, **overrides[1]},
        python="python",
        script="x",
        config_file=DEFAULT_CONFIG,
    )[2:]
    flat = parsed_train_config(argv, monkeypatch)
    recipe = configuration.load_module(path).RECIPE
    expected = {
        **recipe,
        "data.vocab_size": 32768,
        "train.steps": 400,
        "train.test_eval": True,
        "loss.filter_eps": 2.0**-12,
        "train.seed": overrides[1]["train.seed"],
    }
    assert {k: flat[k] for k in expected} == expected


def test_filter_training_report_pairs_runs_by_seed():
    """Its report's filtered - exact, for each filter target, is the mean
    per-seed difference with the t-interval of scipy's t quantile."""
    module = configuration.load_module(
        os.path.join(SWEEP_CONFIGS, "filter_training.py")
    )
    # test bits/char of seeds 0-2: exact, filtering both, filtering dh only
    test = {0: (3.10, 3.12, 3.10), 1: (3.00, 3.01, 3.02), 2: (3.20, 3.17, 3.20)}
    arms = (("", ""), ("0.1", "both"), ("0.1", "dh"))
    rows = [
        {
            "run": f"r{s}{target}",
            "seed": s,
            "filter_eps": eps,
            "filter_target": target,
            "steps_run": 9,
            "val_bpc": "1.0",
            "test_bpc": str(values[i]),
            "ms_per_step": "10.0",
            "cpu_ms_per_step": str(10.0 * (i + 1)),
            "ensemble": "",
        }
        for s, values in test.items()
        for i, (eps, target) in enumerate(arms)
    ]
    text = module.report_text(rows)
    for i, target in ((1, "both"), (2, "dh")):
        differences = np.array([v[i] - v[0] for v in test.values()])
        half = scipy.stats.t.ppf(0.975, 2) * differences.std(ddof=1) / np.sqrt(3)
        mean = differences.mean()
        assert (
            f"| test bits/char, filter_target {target} | "
            f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}] | 3 |"
        ) in text
        assert (
            f"| val bits/char, filter_target {target} | +0.0000 [+0.0000, +0.0000] | 3 |"
            in text
        )
    assert "| cpu_ms_per_step | 10.0 | 20.0 (2.00x) | 30.0 (3.00x) |" in text


@pytest.mark.parametrize("name", ["filter_training", "mtp"])
def test_committed_report_regenerates_from_its_csv(name):
    """docs/<name>/REPORT.md is its runs.csv's report, byte for byte."""
    module = configuration.load_module(os.path.join(SWEEP_CONFIGS, f"{name}.py"))
    docs = os.path.join(ROOT, "docs", name)
    with open(os.path.join(docs, report.RUNS_CSV), newline="") as f:
        rows = list(csv.DictReader(f))
    with open(os.path.join(docs, "REPORT.md"), encoding="utf-8") as f:
        committed = f.read()
    assert module.report_text(rows).rstrip("\n") + "\n" == committed


def test_mtp_sweep_pairs_each_seed_over_the_four_arms(monkeypatch):
    """configs/sweeps/mtp.py: 8 seeds of the plain model and of k = 1 and 3
    (shared) and k = 3 (own) MTP heads at lambda 0.3, on its recipe at BPE
    2048 for 1000 steps, as train.py parses it."""
    path = os.path.join(SWEEP_CONFIGS, "mtp.py")
    base, overrides, shared = sweeps.load_sweep(path)
    arms = {
        (o["train.seed"], o.get("model.mtp_heads", 0), o.get("model.mtp_unembedding"))
        for o in overrides
    }
    assert arms == {
        (s, *arm)
        for s in range(8)
        for arm in ((0, None), (1, None), (3, None), (3, "own"))
    }
    argv = sweeps.train_command(
        base, "unused", {**shared, **overrides[-1]}, python="python", script="x",
        config_file=DEFAULT_CONFIG,
    )[2:]  # fmt: skip
    flat = parsed_train_config(argv, monkeypatch)
    expected = {
        **configuration.load_module(path).RECIPE,
        "data.vocab_size": 2048,
        "train.steps": 1000,
        "loss.mtp_weight": 0.3,
        "model.mtp_heads": 3,
        "model.mtp_unembedding": "own",
    }
    assert {k: flat[k] for k in expected} == expected


def test_mtp_report_pairs_arms_by_seed_and_intervals_each_depth():
    module = configuration.load_module(os.path.join(SWEEP_CONFIGS, "mtp.py"))
    test = {0: (3.10, 3.12, 3.08, 3.09), 1: (3.00, 3.01, 2.99, 3.02)}
    accuracy = {0: (0.30, 0.20, 0.10), 1: (0.34, 0.22, 0.16)}
    rows = [
        {
            "run": f"r{s}{i}",
            "arm": name,
            "seed": s,
            "mtp_heads": 0,
            "mtp_unembedding": "shared",
            "params": 10,
            "flops_per_token": 100,
            "steps_run": 9,
            "val_bpc": "1.0",
            "test_bpc": str(values[i]),
            **{
                f"depth{d}_accuracy": "" if name == "plain" else str(accuracy[s][d - 1])
                for d in (1, 2, 3)
            },
            "ms_per_step": "10.0",
            "cpu_ms_per_step": "10.0",
            "ensemble": "",
        }  # fmt: skip
        for s, values in test.items()
        for i, (name, _) in enumerate(module.ARMS)
    ]
    text = module.report_text(rows)
    for i, (name, _) in enumerate(module.ARMS[1:], start=1):
        differences = np.array([v[i] - v[0] for v in test.values()])
        half = scipy.stats.t.ppf(0.975, 1) * differences.std(ddof=1) / np.sqrt(2)
        mean = differences.mean()
        assert f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]" in text, name
    depth1 = np.array([0.30, 0.34])
    half = scipy.stats.t.ppf(0.975, 1) * depth1.std(ddof=1) / np.sqrt(2)
    assert f"| k=1 shared | 0.3200 [{0.32 - half:.4f}, {0.32 + half:.4f}] |" in text
