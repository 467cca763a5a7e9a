"""Tests of the width axis (configs/sweeps/tying_study.py:width_128,
width_256, width_512, the GPU recipe's): each width's cells, step budget
(about 20 tokens per parameter, against the parameters of the model that
train.py builds and a hand computation), first rungs and fresh test seeds;
and the tiny width trained end to end by the sweep command, its report
written again from its runs.csv."""

import math
import os

import pytest

from studies.tying import compute, study, table
from tests import ROOT
from tests.studies.tying.sweep_file import run_sweep, study_module
from tests.studies.tying.test_study import model_param_count

# (d_model, step budget, lowest first rung): the budgets the README states.
WIDTHS = ((128, 30800, 0.0005), (256, 102600, 0.00025), (512, 369400, 0.000125))
STEP_TOKENS = 12 * 64  # nanogpt's batch x block


def params(width: int, tied: bool) -> int:
    """BPE 2048, block 64, 4 blocks of MLP 4 x width, no biases: the tables,
    the positions, per block qkv, out, the MLP and two LayerNorm scales, and
    the final LayerNorm."""
    return (
        2048 * width * (1 if tied else 2)
        + 64 * width
        + 4 * (12 * width**2 + 2 * width)
        + width
    )


def test_the_width_presets_plan_their_cells_budgets_and_seeds():
    module = study_module()
    committed = table.read_rows(f"{ROOT}/docs/tying_study/compute/runs.csv")
    assert {(r["arm"], r["params"]) for r in committed} == {
        ("a", params(128, True)),
        ("b", params(128, False)),
    }
    assert study.WIDTH_SEEDS == tuple(range(400, 416))
    for use, seeds in study.SEEDS_USED.items():
        if use != "test (width axis)":
            assert set(seeds).isdisjoint(study.WIDTH_SEEDS), use
    names = set()
    for width, steps, lowest in WIDTHS:
        a, b = params(width, True), params(width, False)
        assert steps == 200 * round(20 * math.sqrt(a * b) / STEP_TOKENS / 200)
        assert 20 < steps * STEP_TOKENS / a < 23 and 17 < steps * STEP_TOKENS / b < 20
        design = module.get_study(f"width_{width}")
        assert [
            (c.vocab, c.amount.fraction, c.amount.steps, c.arm) for c in design.cells()
        ] == [
            (2048, 1.0, steps, "a"),
            (2048, 1.0, steps, "b"),
        ]
        assert design.choice == "clear" and design.margin == 2
        assert design.extend_edges == 8
        assert design.tuning_seeds == study.PROFILE_SEEDS
        assert design.test_seeds == study.WIDTH_SEEDS
        assert design.shared["train.eval_every"] == 200
        assert design.shared["train.test_eval"] is True
        runs = design.tuning_runs()
        assert len(runs) == 2 * 6 * 3
        assert sorted({p.lr for p in runs}) == [
            study.ladder_rate(study._ladder_index(lowest) + k) for k in range(6)
        ]
        overrides = [design.overrides(p) for p in runs]
        for run in overrides:
            assert run["train.steps"] == steps and run["train.patience"] == 0
            assert run["data.vocab_size"] == 2048 and run["data.train_fraction"] == 1
            assert (run["model.d_model"], run["model.num_layers"]) == (width, 4)
            assert run["model.mlp_dim"] == 4 * width
        arms = {o["model.tied"]: o for o in overrides}  # one run of each arm
        built = {t: model_param_count("nanogpt", o, 2048) for t, o in arms.items()}
        assert built == {True: a, False: b}
        args = module.parse(f"width_{width}")
        assert (args["full_steps"], args["budgets"]) == (steps, (steps,))
        assert module.compute_cell(args) == ("2048", 1.0)
        names |= set(design.names(runs))
    assert len(names) == 3 * 2 * 6 * 3  # no run is another width's
    past = module.get_study("past_2048")
    assert names.isdisjoint(past.names(past.tuning_runs()))
    with pytest.raises(ValueError, match="not a multiple of the 4 attention heads"):
        module.get_study("width_128,d_model=130")
    with pytest.raises(ValueError, match="one profiled cell's"):
        module.parse("width_128,char=true")
    with pytest.raises(ValueError, match="width axis"):
        module.get_study("width_256,first_seed=300,seeds=17")


@pytest.mark.slow
def test_the_tiny_width_axis_runs_end_to_end(tmp_path):
    """width_tiny (characters, d_model 16, about one token per parameter:
    40 steps) profiled and tested by the sweep command on two of the width
    axis's seeds, then its report through the sweep file, and the same
    report written again from its runs.csv."""
    args = study_module().parse("width_tiny")
    assert (args["full_steps"], args["budgets"]) == (40, (40,))
    for arg in ("width_tiny,stage=tune", "width_tiny"):
        run_sweep(tmp_path, arg)
    module = study_module()
    out = tmp_path / "report"
    text, plots = module.write_report("width_tiny", str(tmp_path), str(out))
    rows = table.read_rows(str(out / "runs.csv"))
    assert {(r["d_model"], r["mlp_dim"], r["steps_run"]) for r in rows} == {
        (16, 64, 40)
    }
    tested = [r for r in rows if r["role"] == "test"]
    assert len(tested) == 4 and all(r["status"] == "finished" for r in tested)
    assert {r["seed"] for r in tested} == set(study.WIDTH_SEEDS[:2])
    point = compute.point(rows, "char", 1.0, 40)
    assert point.status == "" and point.difference.n == 2
    assert "| 40 | 4 finished |" in text
    assert [os.path.basename(p) for p in plots] == [
        "compute_axis.png",
        "profile_char_1_40steps.png",
    ]
    again, _ = module.report_from_csv("width_tiny")(
        str(out / "runs.csv"), str(tmp_path / "again")
    )
    assert again == text
