"""Tests of ensembles (lmhead/lm/train.py's train_program, lmhead/lm/program.py):
members trained as one program equal the single runs with their values, stop
early on their own, resume exactly, and leave the files a single run leaves.

One 5-member program of the shared short config (10 steps, an evaluation
every 2) serves most tests; the references are single runs of
``train.train_and_evaluate`` with a member's values.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmhead.lm import data, generation, loop, train
from lmhead.lm import members as members_lib
from lmhead.lm import program as program_lib
from tests import ROOT
from tests.lm.conftest import without_key_bias
from tests.lm.test_preemption import HOLD_AFTER, signal_after

# Every member sets warmup_steps=3, not the program config's 2: a value the
# members share but the program's config does not.
SPECS = [
    {"optim.warmup_steps": 3},  # otherwise the config's values, seed 0
    {
        "optim.warmup_steps": 3,
        "train.seed": 1,
        "optim.lr": 2e-3,
        "optim.min_lr": 2e-4,
        "loss.label_smoothing": 0.1,
        "loss.z_loss": 1e-4,
    },
    # Too high a rate: the loss rises after the first evaluation and the
    # member stops at its second.
    {
        "optim.warmup_steps": 3,
        "train.seed": 2,
        "optim.lr": 0.1,
        "optim.min_lr": 0.0,
        "train.patience": 1,
    },
    {
        "train.seed": 3,
        "optim.lr": 1e-3,
        "optim.weight_decay": 0.0,
        "optim.warmup_steps": 3,
        "train.patience": 2,
    },
    # A rate that overflows float32 within the first steps: the member fails
    # at the first log (step 2, the first evaluation's), without a summary,
    # and the others go on.
    {"train.seed": 4, "optim.lr": 1e30, "optim.min_lr": 0.0},
]
FAILED = 4
TRAINED = [i for i in range(len(SPECS)) if i != FAILED]
PROGRAM = {"train.eval_every": 2, "data.split": "works", "train.test_eval": True}
# float32 rounding over 10 steps: the members' steps are compiled as one
# program, the single run's alone. Adam divides by the gradient's root mean
# square, which turns rounding in a near-zero gradient into a visible step:
# hence the absolute tolerance on the parameters (ten times it for the member
# at rate 0.1), and the key biases, whose gradient is rounding alone, left out
# (tests/lm/conftest.py).
RTOL, ATOL = 1e-5, 1e-5


def make_members(workdir):
    return members_lib.make_members(
        [{"workdir": os.path.join(workdir, f"m{i}"), **s} for i, s in enumerate(SPECS)],
        workdir,
    )


@pytest.fixture(scope="module")
def program(short_config, tmp_path_factory):
    """The 4 members trained as one program, with the (seed, step) of every
    training batch each member drew."""
    workdir = str(tmp_path_factory.mktemp("ensemble") / "program")
    drawn, original = [], data.train_batch
    loops, original_loop = [], loop.train_loop

    def recording(tokens, *, seed, step, batch_size, block_size):
        drawn.append((seed, step, len(tokens)))
        return original(
            tokens, seed=seed, step=step, batch_size=batch_size, block_size=block_size
        )

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(data, "train_batch", recording)
        monkeypatch.setattr(
            loop,
            "train_loop",
            lambda run, *a: (
                loops.append((type(run), run.count)) or original_loop(run, *a)
            ),
        )
        summaries = train.train_program(
            short_config(**PROGRAM), make_members(workdir), workdir
        )
    return dict(workdir=workdir, summaries=summaries, drawn=drawn, loops=loops)


@pytest.fixture(scope="module")
def single_runs(short_config, tmp_path_factory):
    """Members 1 and 2 as single runs."""
    root = tmp_path_factory.mktemp("single")
    runs = {}
    for index in (1, 2):
        workdir = str(root / str(index))
        config = short_config(**PROGRAM, **SPECS[index])
        runs[index] = (workdir, train.train_and_evaluate(config, workdir))
    return runs


def member_dir(program, index):
    return os.path.join(program["workdir"], f"m{index}")


def read_records(workdir, key):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


class TestMembersAreRuns:
    @pytest.mark.parametrize("index", [1, 2])
    def test_equals_the_single_run(self, program, single_runs, index):
        workdir, single = single_runs[index]
        member = program["summaries"][index]
        for key in ("train/loss", "eval/loss", "test/loss", "test/word_perplexity"):
            got = read_records(member_dir(program, index), key)
            want = read_records(workdir, key)
            assert got.keys() == want.keys() and got
            np.testing.assert_allclose(
                list(got.values()), list(want.values()), rtol=RTOL
            )
        for key in ("best_step", "steps_run", "stopped_early", "num_params"):
            assert member[key] == single[key]
        assert member["test"]["step"] == single["test"]["step"]
        got_params = generation.load_run(member_dir(program, index))[3]
        want_params = generation.load_run(workdir)[3]
        # Adam's steps, and the rounding they scale, grow with the rate.
        atol = ATOL * max(1.0, SPECS[index]["optim.lr"] / 1e-2)
        jax.tree.map(
            lambda g, w: np.testing.assert_allclose(g, w, rtol=RTOL, atol=atol),
            without_key_bias(got_params),
            without_key_bias(want_params),
        )

    def test_the_program_is_the_one_loop_over_its_members(self, program):
        assert program["loops"] == [(program_lib.Program, len(SPECS))]

    def test_batches_are_the_single_runs(self, program):
        by_member = {}
        for seed, step, num_tokens in program["drawn"]:
            by_member.setdefault(seed, []).append((step, num_tokens))
        for index in TRAINED:
            summary = program["summaries"][index]
            seed = SPECS[index].get("train.seed", 0)
            steps = [s for s, _ in by_member[seed]]
            # Step 0 is drawn once more, to compile the step.
            assert steps == [0, *range(summary["steps_run"])]

    def test_writes_what_a_single_run_writes(self, program, single_runs):
        def files(workdir):
            return {n for n in os.listdir(workdir) if not n.startswith("events.")}

        single = files(single_runs[2][0])
        for index in TRAINED:
            own = files(member_dir(program, index))
            if "train.patience" not in SPECS[index]:
                own.add("best_checkpoint")
            assert own == single
            assert any(
                n.startswith("events.") for n in os.listdir(member_dir(program, index))
            )
        with open(os.path.join(member_dir(program, 1), "config.json")) as f:
            config = json.load(f)
        assert config["optim"]["lr"] == 2e-3 and config["train"]["seed"] == 1
        assert program["summaries"][1]["ensemble"]["members"] == len(SPECS)
        with open(os.path.join(program["workdir"], members_lib.ENSEMBLE_FILE)) as f:
            assert len(json.load(f)["members"]) == len(SPECS)


def test_a_non_finite_member_fails_alone(program):
    """The member whose rate overflows is stopped at its first log (step 2) with a
    ``failed.json`` and no summary; the others finish (their equality with
    single runs is checked above)."""
    assert program["summaries"][FAILED] is None
    workdir = member_dir(program, FAILED)
    assert not os.path.exists(os.path.join(workdir, "summary.json"))
    with open(os.path.join(workdir, members_lib.FAILED_FILE)) as f:
        assert json.load(f) == {"step": 2}
    # Its first log is where it failed: nothing of it is logged.
    assert read_records(workdir, "train/loss") == {}
    assert all(program["summaries"][i] is not None for i in TRAINED)


class TestEarlyStopping:
    def test_members_stop_on_their_own(self, program):
        stopped = program["summaries"][2]
        assert stopped["stopped_early"] and stopped["steps_run"] == 4
        assert stopped["best_step"] == 2 and stopped["test"]["step"] == 2
        assert max(read_records(member_dir(program, 2), "train/loss")) == 4
        for index in (0, 1):
            assert program["summaries"][index]["steps_run"] == 10

    def test_a_stopped_member_keeps_its_best_state(self, program):
        workdir = member_dir(program, 2)
        assert os.listdir(os.path.join(workdir, "best_checkpoint")) == ["2"]
        assert os.listdir(os.path.join(workdir, "checkpoints")) == ["4"]


class TestResume:
    def test_a_crashed_program_resumes_exactly(self, short_config, program, tmp_path):
        workdir = str(tmp_path / "program")
        config, original = short_config(**PROGRAM), program_lib.Program.batch

        def crash_at_7(self, step, active):
            if step == 7:
                raise KeyboardInterrupt  # as if killed after the checkpoint of 5
            return original(self, step, active)

        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(program_lib.Program, "batch", crash_at_7)
            with pytest.raises(KeyboardInterrupt):
                train.train_program(config, make_members(workdir), workdir)
        assert not os.path.exists(os.path.join(workdir, "m0", "summary.json"))
        resumed = train.train_program(config, make_members(workdir), workdir)
        assert resumed[FAILED] is None
        for index in TRAINED:
            jax.tree.map(
                np.testing.assert_array_equal,
                generation.load_run(os.path.join(workdir, f"m{index}"))[3],
                generation.load_run(member_dir(program, index))[3],
            )
            assert resumed[index]["final"] == program["summaries"][index]["final"]

    def test_a_finished_program_is_not_trained_again(
        self, short_config, program, monkeypatch
    ):
        # Finished members and the failed one: nothing is built or trained.
        monkeypatch.setattr(program_lib, "make_program", None)
        again = train.train_program(
            short_config(**PROGRAM),
            make_members(program["workdir"]),
            program["workdir"],
        )
        assert again == program["summaries"]

    def test_other_members_are_refused(self, short_config, program, tmp_path):
        workdir = str(tmp_path / "copy")
        shutil.copytree(program["workdir"], workdir)
        for index in TRAINED:
            os.remove(os.path.join(workdir, f"m{index}", "summary.json"))
        members = make_members(workdir)[:3]
        with pytest.raises(ValueError, match="other members"):
            train.train_program(short_config(**PROGRAM), members, workdir)


@pytest.mark.slow
def test_sigkill_then_the_same_command_resumes_bitwise(tmp_path):
    """The command killed with SIGKILL at step 20, after its first checkpoint
    (10) and before its second, then run again: every member's parameters
    equal an uninterrupted program's. The killed command waits once it has
    logged step 20 (test_preemption's wrapper of train.py), so it is killed
    there however fast the machine."""

    def command(workdir, hold_after=()):
        return [
            sys.executable,
            *hold_after,
            os.path.join(ROOT, "experiments", "train.py"),
            "--config=configs/default.py:tiny",
            f"--workdir={workdir}",
            "--config.sample.num_samples=0",
            "--config.train.checkpoint_every=10",
            '--member={"train.seed": 0}',
            '--member={"train.seed": 1, "optim.lr": 0.002, "optim.min_lr": 0.0002}',
        ]

    killed, whole = str(tmp_path / "killed"), str(tmp_path / "whole")
    with open(tmp_path / "killed.log", "w") as log:
        process = subprocess.Popen(
            command(killed, ["-c", HOLD_AFTER, "20"]),
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        signal_after(process, 20, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    kept = os.listdir(os.path.join(killed, "checkpoints"))
    assert [name for name in kept if name.isdigit()] == ["10"]
    subprocess.run(command(killed), cwd=ROOT, check=True, capture_output=True)
    subprocess.run(command(whole), cwd=ROOT, check=True, capture_output=True)
    for index in range(2):
        jax.tree.map(
            np.testing.assert_array_equal,
            generation.load_run(os.path.join(killed, "members", str(index)))[3],
            generation.load_run(os.path.join(whole, "members", str(index)))[3],
        )


# --- Errors, before anything is compiled ------------------------------------------


# A key that all members share (the program's), set by one member.
SHARED = [
    ("model.d_model", 64, "shapes or structure"),
    ("model.tied", False, r"owns a \[V, D\] table"),
    ("data.block_size", 32, "batches' shape"),
    ("data.tokenizer", "bpe", "tokenizer"),
    ("train.batch_size", 4, "batches' shape"),
    ("train.steps", 20, "how many steps"),
    ("loss.loss_impl", "materialized", "code path"),
]


@pytest.mark.parametrize(
    "specs, message",
    [
        *(([{}, {k: v}], rf"member 1 sets {k}, .*{why}") for k, v, why in SHARED),
        ([], "at least one member"),
        ([{"train.seed": 1}, {"train.seed": 1}], "members 0 and 1 have the same"),
        ([{"workdir": "p/a"}, {"workdir": "p/a", "train.seed": 1}], "same workdir"),
        ([{"workdir": "p", "train.seed": 1}], "is the program's"),
        ([{"train.sed": 1}], "not a config key; did you mean config.train.seed"),
    ],
)
def test_bad_member_lists_are_refused(specs, message):
    with pytest.raises(ValueError, match=message):
        members_lib.make_members(specs, "p")


@pytest.mark.parametrize(
    "spec, error, message",
    [
        ({"optim.lr": -1e-3}, ValueError, r"member 1 \(p/members/1\): config.optim.lr"),
        ({"optim.min_lr": 1.0}, ValueError, "member 1 .*config.optim.min_lr"),
        ({"train.seed": "one"}, TypeError, "member 1 .*train.seed"),
        ({"loss.label_smoothing": 1.5}, ValueError, "member 1 .*label_smoothing"),
        # The vocabulary split is for single runs.
        ({"mesh.model": 2}, ValueError, "config.mesh.model must be 1"),
    ],
)
def test_bad_values_are_refused_before_training(
    short_config, tmp_path, monkeypatch, spec, error, message
):
    monkeypatch.setattr(program_lib, "make_program", None)
    workdir = str(tmp_path / "p")
    # mesh.model is the program's key: a member may not set it.
    program = {k: spec.pop(k) for k in list(spec) if k.startswith("mesh.")}
    members = members_lib.make_members([{}, {"train.seed": 1, **spec}], "p")
    with pytest.raises(error, match=message):
        train.train_program(short_config(**program), members, workdir)
    assert not os.path.exists(workdir)


@pytest.mark.parametrize(
    "parts, covering, member_key",
    [
        # With offsets 0, the largest fraction's text covers the others'.
        ([{"data.train_fraction": 0.5}, {"data.train_fraction": 1.0}], 1.0,
         "data.train_fraction"),
        ([{"data.train_fraction": 0.25, "data.train_offset": 0.5},
          {"data.train_fraction": 0.25}], 0.75, "data.train_offset"),
    ],
)  # fmt: skip
def test_the_shared_tokenizer_is_recorded(short_config, parts, covering, member_key):
    base = short_config(**{"data.tokenizer": "bpe", "data.vocab_size": 300})
    configs = members_lib.member_configs(base, members_lib.make_members(parts, "p"))
    assert [c.data.tokenizer_fraction for c in configs] == [covering, covering]
    # A key that moves the tokenizer's text is the program's, unless the
    # tokenizer's text is fixed.
    value = parts[0][member_key]
    program, member = members_lib.split_overrides(
        {member_key: value, "train.seed": 1}, base
    )
    assert program == {member_key: value} and member == {"train.seed": 1}
    shared = short_config(**{"data.tokenizer": "bpe", "data.tokenizer_fraction": 1.0})
    assert members_lib.split_overrides({member_key: value}, shared) == (
        {},
        {member_key: value},
    )


@pytest.mark.parametrize("vmap_size", [1, 2, 3, 5])
def test_over_members_is_a_map(vmap_size):
    xs = {"a": jnp.arange(15.0).reshape(5, 3), "b": jnp.arange(5.0)}
    got = train.over_members(lambda x: jnp.sum(x["a"]) * x["b"], xs, vmap_size)
    want = np.arange(15.0).reshape(5, 3).sum(axis=1) * np.arange(5.0)
    np.testing.assert_array_equal(got, want)


def test_a_program_of_one_calls_its_member():
    """One member: ``fn`` of the member itself (no vmap, no map), its result
    given a members axis of one."""
    calls = []

    def fn(x):
        calls.append(x.shape)
        return {"sum": jnp.sum(x), "twice": 2 * x}

    got = train.over_members(fn, jnp.arange(3.0)[None], vmap_size=1)
    assert calls == [(3,)]
    assert got["sum"].tolist() == [3.0] and got["twice"].tolist() == [[0.0, 2.0, 4.0]]
