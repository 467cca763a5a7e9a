"""Tests for lmhead/lab/sweeps.py and experiments/sweep.py.

The runner is exercised end to end through its command line with a stand-in
train program (written below) that writes a run's files, fails on request and
records whether it resumed, so skip / resume / failure handling needs no
training. One slow test runs the real experiments/train.py on a tiny sweep.
"""

import itertools
import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import textwrap
import time

import pytest
from absl import flags
from ml_collections import config_flags

from lmhead.lab import sweeps
from lmhead.lm import configuration
from lmhead.studies.tying import study
from tests import ROOT

SWEEP_SCRIPT = os.path.join(ROOT, "experiments", "sweep.py")
SWEEP_CONFIGS = os.path.join(ROOT, "configs", "sweeps")
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "default.py")

# Writes the files of a finished run unless its workdir's name is $FAIL_RUN;
# appends "start" or "resume" (a checkpoints/ folder exists) to calls.txt.
FAKE_TRAIN = textwrap.dedent("""\
    import json, math, os, sys
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    workdir = args["--workdir"]
    name = os.path.basename(workdir)
    os.makedirs(workdir, exist_ok=True)
    checkpoints = os.path.join(workdir, "checkpoints")
    with open(os.path.join(workdir, "calls.txt"), "a") as f:
        f.write("resume\\n" if os.path.isdir(checkpoints) else "start\\n")
    print("training", name, args["--config"])
    if name == os.environ.get("FAIL_RUN"):
        sys.exit("simulated failure in " + name)
    os.makedirs(checkpoints, exist_ok=True)
    seed = int(args["--config.train.seed"])
    tied = args["--config.model.tied"] == "True"
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"model": {"tied": tied, "d_model": 8},
                   "data": {"tokenizer": "char", "vocab_size": None},
                   "train": {"seed": seed}}, f)
    loss = 2.0 + 0.1 * seed + (0.0 if tied else 0.05)
    final = {"eval/loss": loss, "eval/perplexity": math.exp(loss),
             "eval/bits_per_char": loss / math.log(2), "eval/accuracy": 0.4,
             "eval/ece": 0.01}
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 5, "eval/loss": loss + 1}) + "\\n")
        f.write(json.dumps({"step": 10, **final}) + "\\n")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({"num_params": 100 if tied else 120, "num_head_params": 20,
                   "final": final, "tokens_per_sec": 1000.0, "steps": 10,
                   "wall_seconds": 0.1}, f)
    """)

FAKE_SWEEP = textwrap.dedent("""\
    from lmhead.lab import sweeps

    def get_sweep(arg=None):
        seeds = int(arg or 2)
        return "tiny", sweeps.product(sweeps.sweep("model.tied", [True, False]),
                                      sweeps.sweep("train.seed", list(range(seeds))))
    """)


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


def parsed_train_config(argv, monkeypatch) -> dict:
    """The flat config that experiments/train.py's flags give for ``argv``."""
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values)
    flags.DEFINE_string("workdir", None, "", flag_values=flag_values)
    # config_flags finds the --config.* overrides in sys.argv.
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    flag_values(sys.argv)
    return sweeps.flatten(flag_values.config.to_dict())


@pytest.mark.parametrize("sweep_file,num_runs", [("tied_vs_untied_large.py", 60)])
def test_sweep_files_set_existing_knobs_and_parse_as_train_flags(
    sweep_file, num_runs, monkeypatch
):
    """Runs' command lines parse with config_flags into the intended configs."""
    base, overrides, _ = sweeps.load_sweep(os.path.join(SWEEP_CONFIGS, sweep_file))
    assert len(overrides) == num_runs == len(set(sweeps.run_names(overrides)))
    assert {o["model.tied"] for o in overrides} == {True, False}
    assert len({o["train.seed"] for o in overrides}) == 3
    assert {o["data.tokenizer"] for o in overrides} == {"char", "bpe"}
    for run in (overrides[0], overrides[-1]):
        argv = sweeps.train_command(
            base, "unused", run, python="python", script="x", config_file=DEFAULT_CONFIG
        )[2:]
        flat = parsed_train_config(argv, monkeypatch)
        assert {k: flat[k] for k in run} == run
        assert flat["train.steps"] == int(base.rsplit("steps=", 1)[1])


def test_sweep_arguments_size_the_sweep():
    base, overrides, shared = sweeps.load_sweep(
        os.path.join(
            SWEEP_CONFIGS,
            "tied_vs_untied_large.py:base=tiny,steps=7,seeds=2,bpe=300+600,d_model=32",
        )
    )
    assert base == "tiny,steps=7" and shared == {}
    assert len(overrides) == 2 * 3 * 2
    assert sorted({o.get("data.vocab_size") for o in overrides}, key=str) == [
        300,
        600,
        None,
    ]


def test_load_sweep_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no sweep file"):
        sweeps.load_sweep(str(tmp_path / "missing.py"))
    (tmp_path / "empty.py").write_text(
        "def get_sweep(arg=None):\n    return 'tiny', []\n"
    )
    with pytest.raises(ValueError, match="non-empty list"):
        sweeps.load_sweep(str(tmp_path / "empty.py"))


# --- The tying study's design ------------------------------------------------------

STUDY = os.path.join(SWEEP_CONFIGS, "tying_study.py")


def study_module():
    return configuration.load_module(STUDY)


def model_param_count(base, shape_overrides, vocab_size):
    """Parameters of the model train.py builds for these overrides, from its init."""
    import jax
    import jax.numpy as jnp

    from lmhead.lm import configuration

    config = configuration.load_module(DEFAULT_CONFIG).get_config(base)
    config.unlock()
    for key, value in shape_overrides.items():
        section, name = key.split(".")
        config[section][name] = value
    model = configuration.make_model(config, vocab_size)
    tokens = jnp.zeros((1, config.data.block_size), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)
    return sum(x.size for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize(
    "arch",
    [
        study.Architecture(4, 64, use_bias=False),
        study.Architecture(2, 16, positions="rope", use_bias=True, head_bias=True),
    ],
)
@pytest.mark.parametrize(
    "shape", [study.Shape(True, 24, 2, 40), study.Shape(False, 16, 3, 7)]
)
def test_count_params_matches_the_models_init(arch, shape):
    import jax
    import jax.numpy as jnp

    from lmhead.lm import model

    decoder = model.DecoderLM(
        vocab_size=37,
        num_heads=arch.num_heads,
        max_len=arch.max_len,
        positions=arch.positions,
        use_bias=arch.use_bias,
        head_bias=arch.head_bias,
        tied=shape.tied,
        d_model=shape.d_model,
        num_layers=shape.num_layers,
        mlp_dim=shape.mlp_dim,
    )
    shapes = jax.eval_shape(
        decoder.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32)
    )
    assert study.count_params(37, shape, arch) == sum(
        x.size for x in jax.tree.leaves(shapes)
    )


def run_vocab_size(base, shared, run):
    """The tokens of the tokenizer train.py trains for this run (its data,
    loaded as the run loads it)."""
    from lmhead.lm import data

    config = configuration.load_module(DEFAULT_CONFIG).get_config(base)
    for key, value in {**shared, **run}.items():
        section, name = key.split(".")
        if section == "data":
            config.data[name] = value
    return data.load_dataset(config.data).tokenizer.vocab_size


@pytest.mark.parametrize("preset,base", [("", "nanogpt"), ("tiny", "tiny")])
def test_study_expands_to_the_designed_grid_with_matched_counts(preset, base):
    """Every arm at every vocabulary, regime and rate; c matches a and d matches
    b within 2% at the vocabulary size the run's tokenizer has, counted from the
    model train.py builds for the run's config (at the largest vocabulary;
    elsewhere by the closed form that the test above checks against the
    model's init). The limited regime's tokenizer is loaded as train.py loads
    it (BPE on one play stops short of 8192); the whole training text reaches
    every size asked, as the design measured."""
    spec = f"{STUDY}:{preset + ',' if preset else ''}stage=tune"
    got_base, overrides, shared = sweeps.load_sweep(spec)
    assert got_base == base
    assert shared["data.split"] == "works" and shared["train.test_eval"] is True
    design = study_module().get_study(preset or None)
    vocabularies = {o.get("data.vocab_size", "char") for o in overrides}
    rates = sorted({o["optim.lr"] for o in overrides})
    regimes = sorted(
        {(o["data.train_fraction"], o["train.patience"]) for o in overrides}
    )
    if not preset:
        assert vocabularies == {"char", 512, 1024, 2048, 8192}
        assert len(rates) == 3 and len(regimes) == 2
        assert regimes[0][0] < 1 and regimes[0][1] > 0 and regimes[1] == (1.0, 0)
    assert len(overrides) == len(vocabularies) * 4 * len(rates) * len(regimes)
    assert {o["train.seed"] for o in overrides} == {0}
    assert all(
        o["optim.min_lr"] == pytest.approx(o["optim.lr"] / 10) for o in overrides
    )
    largest = max(vocabularies, key=lambda v: 0 if v == "char" else v)
    shares, short = [], []
    for (fraction, patience), vocab in itertools.product(regimes, vocabularies):
        runs = [
            o
            for o in overrides
            if o.get("data.vocab_size", "char") == vocab
            and o["optim.lr"] == rates[0]
            and o["data.train_fraction"] == fraction
        ]
        asked = 84 if vocab == "char" else vocab
        # The data-limited regime's short text is where a tokenizer falls short.
        vocab_size = run_vocab_size(base, shared, runs[0]) if patience else asked
        regime = next(r for r in design.regimes if r.train_fraction == fraction)
        assert (
            design.vocab_size(regime, None if vocab == "char" else vocab) == vocab_size
        )
        if vocab_size < asked:
            short.append(vocab)
        counts = {}
        for run in runs:
            model_keys = {k: v for k, v in run.items() if k.startswith("model.")}
            shape = study.Shape(
                *(
                    model_keys[f"model.{k}"]
                    for k in ("tied", "d_model", "num_layers", "mlp_dim")
                )
            )
            count = study.count_params(vocab_size, shape, design.arch)
            if vocab == largest:
                assert count == model_param_count(base, model_keys, vocab_size)
            counts[len(counts)] = (
                count,
                run["model.tied"],
                run["model.d_model"],
                run["model.num_layers"],
            )
        (
            (a, tied_a, d_a, l_a),
            (b, tied_b, d_b, l_b),
            (c, tied_c, d_c, l_c),
            (d, tied_d, d_d, l_d),
        ) = counts.values()
        assert (tied_a, tied_b, tied_c, tied_d) == (True, False, False, True)
        assert (
            (d_a, l_a)
            == (d_b, l_b)
            == (design.base_shape.d_model, design.base_shape.num_layers)
        )
        assert b - a == vocab_size * d_a
        assert d_c <= d_a and d_c % design.arch.num_heads == 0 and l_c == l_a
        assert d_d == d_a and l_d >= l_a
        assert abs(c - a) <= 0.02 * a and abs(d - b) <= 0.02 * b
        shares.append(vocab_size * d_a / a)
    if not preset:
        assert min(shares) < 0.02 and max(shares) > 0.5
        assert short == [8192]  # 6,911 tokens: the case the design must match at


def write_tuning_run(sweep_dir, name, final_loss, best_loss=None):
    """A finished tuning run: summary.json with a final and a best evaluation."""
    workdir = sweep_dir / name
    workdir.mkdir(parents=True)
    summary = {"final": {"eval/loss": final_loss}, "num_params": 1}
    if best_loss is not None:
        summary["best"] = {"eval/loss": best_loss}
    (workdir / "summary.json").write_text(json.dumps(summary))


def test_seeds_stage_picks_each_cells_best_validation_rate(tmp_path):
    """Fixed regime: the last evaluation decides; limited: the best one. A
    diverged (NaN) run is never chosen; the chosen run is reused as seed 0."""
    arg = "tiny,bpe=,arms=a+b,lrs=0.001+0.002+0.004,seeds=3"
    design = study_module().get_study(arg)
    tuning = design.tuning_runs()
    with pytest.raises(ValueError, match="12 of 12 tuning runs have not finished"):
        sweeps.load_sweep(f"{STUDY}:{arg}", str(tmp_path))
    # Fixed regime: final losses prefer 0.004 for a (0.002's NaN is skipped)
    # and 0.001 for b; their "best" values, which must be ignored, disagree.
    # Limited regime: best losses prefer 0.002 for both; finals disagree.
    final = {
        ("fixed", "a"): [2.0, math.nan, 1.5],
        ("fixed", "b"): [1.0, 2.0, 3.0],
        ("limited", "a"): [1.0, 1.0, 1.0],
        ("limited", "b"): [0.5, 3.0, 3.0],
    }
    best = {
        ("fixed", "a"): [0.1, 5.0, 5.0],
        ("fixed", "b"): [5.0, 0.1, 5.0],
        ("limited", "a"): [2.0, 1.5, 1.7],
        ("limited", "b"): [2.0, 1.0, 1.5],
    }
    rates = list(design.learning_rates)
    for planned, name in zip(tuning, design.names(tuning)):
        key = (planned.cell.regime.name, planned.cell.arm)
        index = rates.index(planned.lr)
        write_tuning_run(tmp_path, name, final[key][index], best[key][index])
    _, overrides, _ = sweeps.load_sweep(f"{STUDY}:{arg}", str(tmp_path))
    assert overrides[: len(tuning)] == [
        p.overrides(design.min_lr_ratio) for p in tuning
    ]
    expected = {
        ("fixed", True): 0.004,
        ("fixed", False): 0.001,
        ("limited", True): 0.002,
        ("limited", False): 0.002,
    }
    added = overrides[len(tuning) :]
    assert len(added) == 2 * 4 and {o["train.seed"] for o in added} == {1, 2}
    for run in added:
        regime = "fixed" if run["train.patience"] == 0 else "limited"
        assert run["optim.lr"] == expected[regime, run["model.tied"]], run
        seed0 = dict(run, **{"train.seed": 0})
        assert seed0 in overrides[: len(tuning)]  # seed 0 is the chosen tuning run


def test_tuning_extends_a_cells_rates_past_the_grid_while_its_best_is_at_an_end(
    tmp_path,
):
    """Fixed regime, characters, grid 1e-3, 2e-3, 4e-3, extend=2. Cell a keeps
    improving upward: 8e-3, then 1.6e-2, then no more (the limit); 8e-3 is
    chosen. Cell b is best at the bottom: 5e-4 is worse, so 1e-3 is chosen.
    Cell c is best inside the grid and never extends."""
    arg = "tiny,bpe=,arms=a+b+c,regimes=fixed,lrs=0.001+0.002+0.004,extend=2,seeds=2"
    design = study_module().get_study(arg)
    losses = {
        "a": {1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.8, 8e-3: 1.7, 1.6e-2: 1.75},
        "b": {5e-4: 1.6, 1e-3: 1.5, 2e-3: 1.9, 4e-3: 2.0},
        "c": {1e-3: 2.0, 2e-3: 1.0, 4e-3: 2.0},
    }

    def plan_and_finish():
        """The tuning stage's plan now; then its runs finish."""
        tuning = study.read_tuning(design, str(tmp_path))
        _, overrides, _ = sweeps.load_sweep(f"{STUDY}:{arg},stage=tune", str(tmp_path))
        assert overrides == [p.overrides(design.min_lr_ratio) for p in tuning]
        for planned, name in zip(tuning, design.names(list(tuning))):
            if tuning[planned].status == "not started":
                write_tuning_run(tmp_path, name, losses[planned.cell.arm][planned.lr])
        return [(p.cell.arm, p.lr) for p in tuning]

    rounds = [plan_and_finish() for _ in range(4)]
    grid = [(arm, lr) for lr in (1e-3, 2e-3, 4e-3) for arm in "abc"]
    assert rounds[0] == grid  # nothing to read back yet
    assert rounds[1] == grid + [("a", 8e-3), ("b", 5e-4)]
    assert rounds[2] == rounds[3] == grid + [("a", 8e-3), ("a", 1.6e-2), ("b", 5e-4)]
    _, overrides, _ = sweeps.load_sweep(f"{STUDY}:{arg}", str(tmp_path))
    added = overrides[len(rounds[-1]) :]
    assert [o["train.seed"] for o in added] == [1, 1, 1]
    assert [o["optim.lr"] for o in added] == [8e-3, 1e-3, 2e-3]  # arms a, b, c
    assert added[0]["optim.min_lr"] == pytest.approx(8e-4)


def test_seeds_stage_waits_for_the_edge_extensions(tmp_path):
    arg = "tiny,bpe=,arms=a,regimes=fixed,lrs=0.001+0.002,extend=1,seeds=2"
    design = study_module().get_study(arg)
    for planned, name in zip(design.tuning_runs(), design.names(design.tuning_runs())):
        write_tuning_run(tmp_path, name, {1e-3: 2.0, 2e-3: 1.5}[planned.lr])
    with pytest.raises(ValueError, match="1 of 3 tuning runs have not finished"):
        sweeps.load_sweep(f"{STUDY}:{arg}", str(tmp_path))
    _, overrides, _ = sweeps.load_sweep(f"{STUDY}:{arg},stage=tune", str(tmp_path))
    assert [o["optim.lr"] for o in overrides] == [1e-3, 2e-3, 4e-3]


def test_study_presets_and_argument_errors():
    module = study_module()
    small = module.get_study("small")
    assert [c.arm for c in small.cells()] == ["a", "b", "c"]
    assert small.vocabularies == (2048,) and [r.name for r in small.regimes] == [
        "limited"
    ]
    assert small.cells()[2].shape.tied is False and small.cells()[2].shape.d_model < 128
    assert len(module.get_study("small,seeds=2,arms=a+c").cells()) == 2
    with pytest.raises(ValueError, match="Unknown preset 'huge'"):
        module.get_study("huge")
    with pytest.raises(ValueError, match="stage=tune or stage=seeds"):
        module.get_study("stage=all")
    with pytest.raises(ValueError, match="Unknown regime or arm"):
        module.get_study("arms=a+e")
    with pytest.raises(ValueError, match="sweep directory"):
        module.get_sweep("tiny")


def test_study_commands_parse_as_train_flags(monkeypatch):
    """Shared and per-run overrides name config keys that exist, with their types."""
    config = configuration.load_module(DEFAULT_CONFIG).get_config("nanogpt")
    if "split" not in config.data:
        pytest.skip(
            "configs/default.py has no data.split yet (training-loop features)."
        )
    base, overrides, shared = sweeps.load_sweep(f"{STUDY}:stage=tune")
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
        assert {k: flat[k] for k in {**shared, **run}} == {**shared, **run}


# --- Reading runs -------------------------------------------------------------


def test_read_metrics_keeps_the_last_record_of_a_repeated_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 10, "train/loss": 3.0},
        {"step": 10, "eval/loss": 2.9},
        {"step": 20, "train/loss": 2.5},
        {"step": 20, "train/loss": 2.4},
        {"step": 15, "train/loss": 2.7},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3')
    assert sweeps.read_metrics(str(path)) == [
        records[0],
        records[1],
        records[4],
        records[3],
    ]
    path.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 1"):
        sweeps.read_metrics(str(path))


# --- The runner, with a stand-in train program --------------------------------


def sweep_command(tmp_path, *flags_, sweep=FAKE_SWEEP, train=FAKE_TRAIN, arg=""):
    """sweep.py on ``sweep`` (a sweep file's source; ``arg`` its argument),
    each run executing ``train`` (a program's source) instead of train.py."""
    (tmp_path / "fake_sweep.py").write_text(sweep)
    (tmp_path / "fake_train.py").write_text(train)
    return [
        sys.executable,
        SWEEP_SCRIPT,
        f"--sweep={tmp_path}/fake_sweep.py{arg}",
        f"--workdir={tmp_path}/sweep",
        f"--train_script={tmp_path}/fake_train.py",
        *flags_,
    ]


def run_sweep(tmp_path, *flags_, env=None, **sources):
    return subprocess.run(
        sweep_command(tmp_path, *flags_, **sources),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def calls(tmp_path, name):
    path = tmp_path / "sweep" / name / "calls.txt"
    return path.read_text().split() if path.exists() else []


def test_dry_run_prints_one_command_per_remaining_run(tmp_path):
    finished = tmp_path / "sweep" / "tied=True,seed=1"
    finished.mkdir(parents=True)
    (finished / "summary.json").write_text("{}")
    result = run_sweep(tmp_path, "--dry_run")
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    names = ["tied=True,seed=0", "tied=False,seed=0", "tied=False,seed=1"]
    assert [c[3] for c in commands] == [
        f"--workdir={tmp_path}/sweep/{n}" for n in names
    ]
    assert all(
        c[0] == sys.executable and c[1].endswith("fake_train.py") for c in commands
    )
    assert commands[1][2] == "--config=configs/default.py:tiny"
    assert commands[1][4:] == ["--config.model.tied=False", "--config.train.seed=0"]
    assert "1 of 4 runs already finished" in result.stderr
    assert sorted(os.listdir(tmp_path / "sweep")) == ["tied=True,seed=1"]  # ran nothing


def test_runner_skips_finished_resumes_interrupted_and_reports_failures(tmp_path):
    sweep_dir = tmp_path / "sweep"
    (sweep_dir / "tied=True,seed=0").mkdir(parents=True)
    (sweep_dir / "tied=True,seed=0" / "summary.json").write_text("{}")
    (sweep_dir / "tied=True,seed=1" / "checkpoints").mkdir(parents=True)

    failing = "tied=False,seed=0"
    result = run_sweep(
        tmp_path, "--parallel=2", "--noreport", env={"FAIL_RUN": failing}
    )
    assert result.returncode == 1
    assert calls(tmp_path, "tied=True,seed=0") == []
    assert calls(tmp_path, "tied=True,seed=1") == ["resume"]
    assert calls(tmp_path, failing) == ["start"]
    assert calls(tmp_path, "tied=False,seed=1") == ["start"]
    assert f"FAILED: {failing}" in result.stdout
    assert f"simulated failure in {failing}" in result.stdout  # the log's tail
    assert "1 of 3 runs failed" in result.stdout
    status = json.loads((sweep_dir / failing / sweeps.STATUS_FILE).read_text())
    assert status["returncode"] == 1
    assert [r.status for r in sweeps.read_sweep(str(sweep_dir))] == [
        "finished",
        "finished",
        "failed",
        "finished",
    ]

    # The same command again runs only the failed run, which now succeeds.
    result = run_sweep(tmp_path, "--report")
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls(tmp_path, failing) == [
        "start",
        "start",
    ]  # it failed before a checkpoint
    assert calls(tmp_path, "tied=False,seed=1") == ["start"]
    log = (sweep_dir / failing / sweeps.LOG_FILE).read_text()
    assert log.count("=== ") == 2 and "simulated failure" in log
    assert (
        not (sweep_dir / failing / sweeps.STATUS_FILE).exists()
        or json.loads((sweep_dir / failing / sweeps.STATUS_FILE).read_text())[
            "returncode"
        ]
        == 0
    )
    assert (sweep_dir / "REPORT.md").exists()
    assert "Plot:" in result.stdout


def test_a_run_that_exits_cleanly_without_a_summary_counts_as_failed(tmp_path):
    result = run_sweep(tmp_path, "--noreport", train="print('did nothing')\n", arg=":1")
    assert result.returncode == 1
    assert "2 of 2 runs failed" in result.stdout and "did nothing" in result.stdout


SLOW_TRAIN = textwrap.dedent("""\
    import os, signal, sys, time
    workdir = dict(a.split("=", 1) for a in sys.argv[1:])["--workdir"]
    os.makedirs(workdir, exist_ok=True)

    def on_term(signum, frame):
        open(os.path.join(workdir, "terminated"), "w").close()
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    open(os.path.join(workdir, "started"), "w").close()
    time.sleep(120)
    """)


def test_sigterm_stops_the_runner_and_its_runs(tmp_path):
    """``kill`` of the runner must not leave a run behind to race a rerun."""
    runner = subprocess.Popen(
        sweep_command(tmp_path, "--noreport", train=SLOW_TRAIN, arg=":1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    run = tmp_path / "sweep" / "tied=True,seed=0"
    deadline = time.time() + 60
    while not (run / "started").exists() and time.time() < deadline:
        time.sleep(0.1)
    runner.terminate()
    output, _ = runner.communicate(timeout=60)
    assert runner.returncode == 1 and "Stopped by SIGTERM" in output, output
    assert (run / "terminated").exists()
    assert not (
        run / sweeps.STATUS_FILE
    ).exists()  # no exit recorded: a rerun resumes it


PINNED_TRAIN = textwrap.dedent("""\
    import json, os, sys, time
    workdir = dict(a.split("=", 1) for a in sys.argv[1:])["--workdir"]
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "cpus.json"), "w") as f:
        json.dump(sorted(os.sched_getaffinity(0)), f)
    time.sleep(0.5)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({}, f)
    """)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs 2 CPUs (Linux)",
)
def test_cpus_per_run_pins_concurrent_runs_to_cpus_of_their_own(tmp_path):
    result = run_sweep(
        tmp_path, "--parallel=2", "--cpus_per_run=1", "--noreport", train=PINNED_TRAIN
    )
    assert result.returncode == 0, result.stdout + result.stderr
    seen = []
    for run in sweeps.read_sweep(str(tmp_path / "sweep")):
        cpus = json.loads(pathlib.Path(run.workdir, "cpus.json").read_text())
        status = json.loads(pathlib.Path(run.workdir, sweeps.STATUS_FILE).read_text())
        assert len(cpus) == 1 and status["cpus"] == cpus
        assert (
            status["started"]
            < status["ended"]
            == pytest.approx(status["started"] + status["seconds"])
        )
        seen.append((run.interval, cpus[0]))
    # Runs that overlap in time ran on different CPUs.
    for (a, cpu_a), (b, cpu_b) in itertools.combinations(seen, 2):
        if a[0] < b[1] and b[0] < a[1]:
            assert cpu_a != cpu_b
    assert len({cpu for _, cpu in seen}) == 2
    too_many = len(os.sched_getaffinity(0)) + 1
    result = run_sweep(tmp_path, "--parallel=2", f"--cpus_per_run={too_many}")
    assert result.returncode != 0 and f"need {2 * too_many} CPUs" in result.stderr


GROWING_SWEEP = textwrap.dedent("""\
    import os
    from lmhead.lab import sweeps

    def get_sweep(arg=None, workdir=None):
        # Seed 2 is planned once seeds 0 and 1 have finished.
        runs = [{"model.tied": True, "train.seed": seed} for seed in (0, 1)]
        if workdir and all(os.path.exists(os.path.join(workdir, name, "summary.json"))
                           for name in sweeps.run_names(runs)):
            runs.append({"model.tied": True, "train.seed": 2})
        return "tiny", runs
    """)


def test_runner_plans_again_from_the_results_until_the_plan_stops_growing(tmp_path):
    result = run_sweep(tmp_path, "--noreport", sweep=GROWING_SWEEP)
    assert result.returncode == 0, result.stdout + result.stderr
    names = [f"tied=True,seed={seed}" for seed in range(3)]
    assert [calls(tmp_path, name) for name in names] == [["start"]] * 3
    assert (
        "2 runs in" in result.stdout and f"[3/3] {names[2]} finished" in result.stdout
    )
    record = json.loads((tmp_path / "sweep" / sweeps.SWEEP_FILE).read_text())
    assert [run["name"] for run in record["runs"]] == names


def test_a_replanned_run_that_fails_runs_once(tmp_path):
    failing = "tied=True,seed=2"
    result = run_sweep(
        tmp_path, "--noreport", sweep=GROWING_SWEEP, env={"FAIL_RUN": failing}
    )
    assert result.returncode == 1 and "1 of 3 runs failed" in result.stdout
    assert calls(tmp_path, failing) == ["start"]


@pytest.mark.slow
def test_real_tiny_sweep_trains_and_reports(tmp_path):
    sweep_dir = tmp_path / "sweep"
    spec = (
        "--sweep=configs/sweeps/tying_study.py:tiny,bpe=,arms=a+b,"
        "regimes=fixed,lrs=0.003,seeds=1"
    )
    for stage in (",stage=tune", ""):
        command = [sys.executable, SWEEP_SCRIPT, spec + stage, f"--workdir={sweep_dir}"]
        result = subprocess.run(
            command, capture_output=True, text=True, cwd=ROOT, timeout=600
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = sweeps.read_sweep(str(sweep_dir))
    assert [r.overrides["model.tied"] for r in runs] == [True, False]
    assert all(r.status == "finished" for r in runs)
    tied, untied = (r.summary for r in runs)
    assert (
        untied["num_params"] - tied["num_params"]
        == 84 * runs[0].config["model"]["d_model"]
    )
    assert all(0 < r.summary["test"]["bits_per_char"] < 10 for r in runs)
    report = (sweep_dir / "REPORT.md").read_text()
    assert "| char (84) | a: tied |" in report and "| char (84) | b: untied" in report
    assert (sweep_dir / "delta_vs_head_share.png").stat().st_size > 0
