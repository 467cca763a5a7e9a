"""Tests for studies/tying/study.py and its sweep file,
configs/sweeps/tying_study.py: the designed grid with matched counts, the
learning-rate choice on the mean of the tuning seeds, the edge extensions on
the sqrt(2) ladder, arm e's untie step, the ablation, the presets, and the
commands parsed as experiments/train.py parses them."""

import dataclasses
import json
import statistics

import pytest

from lmhead.lab import sweeps, workdirs
from lmhead.lm import configuration
from studies.tying import results, shapes, study, table
from tests.lab.sweep_helpers import (
    DEFAULT_CONFIG,
    parsed_train_config,
)
from tests.studies.tying.sweep_file import STUDY, study_module

TINY = "tiny,char=false"  # one vocabulary (BPE 300), two amounts, arms a-e


def model_param_count(base, run, vocab_size):
    """Parameters of the model train.py builds for a run's overrides, from its init."""
    import jax
    import jax.numpy as jnp

    config = configuration.load_module(DEFAULT_CONFIG).get_config(base)
    for key, value in run.items():
        if key.startswith("model."):
            config.model[key.removeprefix("model.")] = value
    model = configuration.make_model(config, vocab_size)
    tokens = jnp.zeros((1, config.data.block_size), jnp.int32)
    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
    return sum(x.size for x in jax.tree.leaves(abstract))


def shape_of(run) -> shapes.Shape:
    return shapes.Shape(
        *(run[f"model.{k}"] for k in ("tied", "d_model", "num_layers", "mlp_dim"))
    )


def test_the_full_tuning_stage_is_the_designed_grid():
    """Characters and BPE 512, 2048, 8192 (each tokenizer reaching its size
    on the whole training split); four amounts, the subsets at two places by
    seed; arms a, b, c; three sqrt(2)-spaced rates per cell on tuning seeds
    100 and 101; c within 2% of a's count (the closed form, checked against
    the model train.py builds at BPE 8192)."""
    base, overrides, shared = sweeps.load_sweep(f"{STUDY}:stage=tune")
    design = study_module().get_study("stage=tune")
    assert base == "nanogpt" and shared["data.tokenizer_fraction"] == 1.0
    assert shared["data.holdout_fraction"] > 0 and shared["train.test_eval"] is True
    assert design.vocab_sizes == {None: 84, 512: 512, 2048: 2048, 8192: 8192}
    assert {o.get("data.vocab_size", "char") for o in overrides} == {
        "char",
        512,
        2048,
        8192,
    }
    assert {o["data.train_fraction"] for o in overrides} == {0.003, 0.01, 0.03, 1.0}
    assert {o["train.seed"] for o in overrides} == set(study.TUNING_SEEDS)
    assert all(o["train.patience"] == 3 for o in overrides)
    for o in overrides:
        subset = o["data.train_fraction"] < 1
        expected = study.SUBSET_OFFSETS[o["train.seed"] % 2] if subset else 0.0
        assert o["data.train_offset"] == expected
        assert o["train.steps"] == (3000 if subset else 1000)
        assert o["optim.min_lr"] == pytest.approx(o["optim.lr"] / 10)
    assert len(overrides) == 4 * 4 * 3 * 3 * 2
    for vocab, size in design.vocab_sizes.items():
        runs = [
            o
            for o in overrides
            if o.get("data.vocab_size") == vocab
            and o["data.train_fraction"] == 0.01
            and o["train.seed"] == 100
        ]
        rates = sorted({o["optim.lr"] for o in runs})
        assert len(rates) == 3
        assert rates[1] / rates[0] == pytest.approx(2**0.5, rel=0.01)
        assert rates[2] / rates[1] == pytest.approx(2**0.5, rel=0.01)
        counts = {
            shape_of(o): shapes.count_params(size, shape_of(o), design.arch)
            for o in runs
        }
        a = counts.pop(shapes.Shape(True, 128, 4, 512))
        b = counts.pop(shapes.Shape(False, 128, 4, 512))
        ((c_shape, c),) = counts.items()
        assert not c_shape.tied and c_shape.d_model <= 128
        assert b - a == size * 128 and abs(c - a) <= shapes.MATCH_TOLERANCE * a
        if vocab == 8192:
            for o in runs[:3]:
                assert shapes.count_params(
                    size, shape_of(o), design.arch
                ) == model_param_count(base, o, size)


def test_arm_d_only_where_a_whole_block_fits_and_e_is_bs_shape():
    design = study_module().get_study("stage=tune")
    arch, base = design.arch, design.base_shape
    block = shapes.block_params(base, arch)
    for size in design.vocab_sizes.values():
        arms = shapes.arm_shapes(size, base, arch)
        assert arms["e"] == arms["b"]
        if size * base.d_model < block:
            assert "d" not in arms
        else:
            extra = arms["d"].num_layers - base.num_layers
            assert arms["d"].tied and extra == size * base.d_model // block >= 1
            assert (
                shapes.count_params(size, arms["d"], arch)
                <= shapes.count_params(size, arms["b"], arch)
                < shapes.count_params(size, arms["d"], arch) + block
            )
    assert {c.vocab for c in design.cells(("d",))} == {2048, 8192}
    assert {c.vocab for c in design.cells(("e",))} == {2048, 8192}


def write_run(sweep_dir, name, loss, best_step):
    workdir = sweep_dir / name
    workdir.mkdir(parents=True)
    summary = {"best": {"eval/loss": loss}, "best_step": best_step, "num_params": 1}
    (workdir / "summary.json").write_text(json.dumps(summary))


@pytest.fixture(scope="module")
def tiny_design():
    return study_module().get_study(TINY)


def tuning_losses(planned):
    """Seed 100 alone prefers the lowest rate, the mean of both seeds the
    middle one (arm a, amount 0.2); elsewhere the middle rate wins."""
    rank = sorted(set(study.ladder_rate(2 + k) for k in (-1, 0, 1))).index(planned.lr)
    if planned.cell.arm == "a" and planned.cell.amount.fraction == 0.2:
        return {100: [1.0, 1.1, 2.0], 101: [3.0, 1.5, 2.0]}[planned.seed][rank]
    return [2.0, 1.0, 2.0][rank]


def test_the_test_stage_chooses_on_the_mean_of_the_tuning_seeds(tmp_path, tiny_design):
    design = tiny_design
    tuning = design.tuning_runs()
    with pytest.raises(ValueError, match=f"{len(tuning)} of {len(tuning)} tuning"):
        sweeps.load_sweep(f"{STUDY}:{TINY}", str(tmp_path))
    for index, (planned, name) in enumerate(zip(tuning, design.names(tuning))):
        write_run(tmp_path, name, tuning_losses(planned), best_step=10 + index % 3)
    _, overrides, _ = sweeps.load_sweep(f"{STUDY}:{TINY}", str(tmp_path))
    assert overrides[: len(tuning)] == [design.overrides(p) for p in tuning]
    test = overrides[len(tuning) :]
    middle = study.ladder_rate(2)
    assert {o["optim.lr"] for o in test} == {middle}  # seed 100 alone: not this
    tuning_seeds = {o["train.seed"] for o in overrides[: len(tuning)]}
    assert tuning_seeds.isdisjoint({o["train.seed"] for o in test})
    assert {o["train.seed"] for o in test} == {0, 1}
    # Test seeds sample both subset places; the whole split has one.
    assert {
        (o["train.seed"], o["data.train_offset"])
        for o in test
        if o["data.train_fraction"] < 1
    } == {(0, 0.0), (1, 0.5)}
    arms = [
        ("d" if o["model.num_layers"] > 1 else "e" if "model.untie_step" in o else "")
        for o in test
    ]
    assert arms.count("d") == arms.count("e") == 2 * 2  # 2 amounts x 2 seeds
    # e unties at two thirds of the tied arm's tuning runs' median best step.
    for o in test:
        if "model.untie_step" in o:
            tied = [
                (p, 10 + i % 3)
                for i, p in enumerate(tuning)
                if p.cell.arm == "a"
                and p.cell.amount.fraction == o["data.train_fraction"]
                and p.lr == middle
            ]
            median = statistics.median(step for _, step in tied)
            assert o["model.untie_step"] == round(2 / 3 * median)
            assert o["model.tied"] is False
    ablation = [o for o in test if "optim.table_lr_multiplier" in o]
    assert sorted({o["optim.table_lr_multiplier"] for o in ablation}) == [3.0, 10.0]
    assert len(ablation) == 2 * 2 * 2  # multipliers x arms a, b x seeds
    assert {o["data.train_fraction"] for o in ablation} == {0.2}


def test_tuning_walks_the_ladder_past_an_end_while_the_best_is_there(tmp_path):
    arg = "tiny,char=false,amounts=1.0,arms=a,extend=2,ablation=false"
    design = study_module().get_study(f"{arg},stage=tune")
    top = study.ladder_rate(3)
    losses = {study.ladder_rate(k): 5.0 - k for k in range(1, 5)}  # best: highest
    losses[study.ladder_rate(5)] = 4.0  # worse than the rung below

    def plan_and_finish():
        tuning = study.read_tuning(design, str(tmp_path))
        _, overrides, _ = sweeps.load_sweep(f"{STUDY}:{arg},stage=tune", str(tmp_path))
        assert overrides == [design.overrides(p) for p in tuning]
        for planned, name in zip(tuning, design.names(list(tuning))):
            if tuning[planned].status == "not started":
                write_run(tmp_path, name, losses[planned.lr], 10)
        return sorted({p.lr for p in tuning})

    rounds = [plan_and_finish() for _ in range(4)]
    grid = [study.ladder_rate(k) for k in (1, 2, 3)]
    assert rounds[0] == grid and top == grid[-1]
    assert rounds[1] == grid + [study.ladder_rate(4)]
    assert rounds[2] == rounds[3] == grid + [study.ladder_rate(k) for k in (4, 5)]
    tuning = study.read_tuning(design, str(tmp_path))
    assert study.choose_learning_rates(design, tuning) == {
        design.cells()[0]: study.ladder_rate(4)
    }


def test_a_clear_choice_keeps_a_rung_below_every_failed_tuning_run(tmp_path):
    """Arm a's mean loss is lowest at ladder index 4 and one of its tuning
    seeds fails from index 5 up: "clear" chooses index 3, "best" index 4;
    arm b fails nowhere and both rules choose its best. The ladder grows
    around the best and the clear choice alike."""
    arg = "past_tiny,stage=tune,extend=4"
    design = study_module().get_study(arg)
    assert design.choice == "clear" and design.rates(design.cells()[0]) == [
        study.ladder_rate(3),
        study.ladder_rate(4),
    ]
    index = {study.ladder_rate(k): k for k in range(-2, 10)}

    def finish(planned, name):
        k, arm = index[planned.lr], planned.cell.arm
        loss = 2.0 + 0.1 * abs(k - (4 if arm == "a" else 3))
        spiked = arm == "a" and k >= 5 and planned.seed == 101
        summary = {
            "best": {"eval/loss": loss},
            "best_step": 60,
            "train_at_best": {"train_eval/bits_per_char": 2.5 + 0.1 * spiked},
        }
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))

    for _ in range(4):
        tuning = study.read_tuning(design, str(tmp_path))
        for planned, name in zip(tuning, design.names(list(tuning))):
            if tuning[planned].status == "not started":
                finish(planned, name)
    tuning = study.read_tuning(design, str(tmp_path))
    assert sorted({p.lr for p in tuning}) == [
        study.ladder_rate(k) for k in (2, 3, 4, 5)
    ]
    a, b = design.cells()
    assert study.choose_learning_rates(design, tuning) == {
        a: study.ladder_rate(3),
        b: study.ladder_rate(3),
    }
    best = dataclasses.replace(design, choice="best")
    assert study.choose_learning_rates(best, tuning)[a] == study.ladder_rate(4)
    # A run restored from a table fails by its row's train_bpc alike.
    row = dict.fromkeys(table.COLUMNS) | {"train_bpc": 2.7, "val_loss": 2.0}
    run = workdirs.Run("r", "r", {}, {}, [], results.restored_summary(row), "finished")
    assert study.train_bpc(run) == 2.7
    with pytest.raises(ValueError, match="choice='worst'"):
        dataclasses.replace(design, choice="worst")


def test_the_cells_past_early_training_are_fixed_as_their_section_says():
    module = study_module()
    bpe, char = module.get_study("past_2048"), module.get_study("past_char")
    assert study.PAST_SEEDS == tuple(range(300, 316))
    for design, vocab, steps, rates in (
        (bpe, 2048, 10000, (0.000707, 0.004)),
        (char, None, 3000, (0.00141, 0.008)),
    ):
        assert design.choice == "clear" and design.test_seeds == study.PAST_SEEDS
        assert design.tuning_seeds == study.PROFILE_SEEDS and design.margin == 2
        assert [(c.vocab, c.amount.steps, c.arm) for c in design.cells()] == [
            (vocab, steps, "a"),
            (vocab, steps, "b"),
        ]
        grid = design.rates(design.cells()[0])
        assert (grid[0], grid[-1]) == rates and len(grid) == 6
    assert bpe.shared["train.eval_every"] == 200
    assert char.shared["train.eval_every"] == 100
    hypotheses = module.PAST_HYPOTHESES["nanogpt"]
    assert [h[:6] for h in hypotheses] == [
        ("2048", 1.0, 10000, "b", "a", -1),
        ("char", 1.0, 3000, "b", "a", +1),
    ]


def test_the_edges_preset_is_the_full_designs_cells_with_a_longer_ladder():
    """``make study-edges`` restores the full study's runs by name: its grid
    must be exactly the full grid's runs of its cells."""
    module = study_module()
    edges = module.get_study("edges,stage=tune")
    assert edges.extend_edges == 8 and module.get_study("stage=tune").extend_edges == 2
    assert {(c.vocab, c.amount.fraction, c.arm) for c in edges.cells()} == {
        (v, 1.0, arm) for v in (2048, 8192) for arm in "abc"
    }
    _, full, _ = sweeps.load_sweep(f"{STUDY}:stage=tune")
    _, own, _ = sweeps.load_sweep(f"{STUDY}:edges,stage=tune")
    want = [
        o
        for o in full
        if o.get("data.vocab_size") in (2048, 8192) and o["data.train_fraction"] == 1
    ]
    assert len(own) == 2 * 3 * 3 * 2 and own == want
    full_names = dict(zip(sweeps.run_names(full), map(str, full)))
    assert [full_names[n] for n in sweeps.run_names(own)] == list(map(str, own))


def test_presets_and_argument_errors():
    module = study_module()
    small = module.get_study("small")
    assert [c.arm for c in small.cells()] == ["a", "b", "c"]
    assert small.vocabularies == (2048,) and small.amounts[0].fraction == 0.01
    base, overrides, _ = sweeps.load_sweep(f"{STUDY}:small")
    assert len(overrides) == 3 * 8 and {o["train.seed"] for o in overrides} == set(
        range(8)
    )
    assert len({o["optim.lr"] for o in overrides}) == 1
    with pytest.raises(ValueError, match="Unknown preset 'huge'"):
        module.get_study("huge")
    with pytest.raises(ValueError, match="stage=tune or stage=test"):
        module.get_study("stage=all")
    with pytest.raises(ValueError, match="Unknown arms"):
        module.get_study("arms=a+f")
    with pytest.raises(ValueError, match="tune=true"):
        module.get_study("small,arms=a+e")
    with pytest.raises(ValueError, match="sweep directory"):
        module.get_sweep("tiny")
    with pytest.raises(ValueError, match="overlap"):
        study.Design("tiny", {}, (None,), (), ("a",), {None: 0}, test_seeds=(0, 100))


def test_study_commands_parse_as_train_flags(monkeypatch, tmp_path, tiny_design):
    """Shared and per-run overrides name config keys that exist, with their
    types: the full design's tuning runs, and the tiny design's test runs
    (arm e's untie step, the ablation's multiplier)."""
    base, overrides, shared = sweeps.load_sweep(f"{STUDY}:stage=tune")
    tuning = tiny_design.tuning_runs()
    for index, (planned, name) in enumerate(zip(tuning, tiny_design.names(tuning))):
        write_run(tmp_path, name, tuning_losses(planned), best_step=10 + index % 3)
    tiny_base, tiny_runs, tiny_shared = sweeps.load_sweep(
        f"{STUDY}:{TINY}", str(tmp_path)
    )
    untie = next(o for o in tiny_runs if "model.untie_step" in o)
    table = next(o for o in tiny_runs if "optim.table_lr_multiplier" in o)
    for run_base, run, run_shared in (
        ("nanogpt", overrides[0], shared),
        ("nanogpt", overrides[-1], shared),
        (tiny_base, untie, tiny_shared),
        (tiny_base, table, tiny_shared),
    ):
        argv = sweeps.train_command(
            run_base,
            "unused",
            run,
            python="python",
            script="x",
            config_file=DEFAULT_CONFIG,
            shared=run_shared,
        )[2:]
        flat = parsed_train_config(argv, monkeypatch)
        assert {k: flat[k] for k in {**run_shared, **run}} == {**run_shared, **run}
