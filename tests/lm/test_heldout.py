"""Tests of the held-out windows of the training plays in a run
(data.holdout_fraction): the "heldout" evaluation set
(lmhead/lm/evaluation.py), its metrics in metrics.jsonl and summary.json
(lmhead/lm/monitoring.py), and an ensemble member with data.train_offset
against the single run with it (lmhead/lm/program.py, members.py).
"""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from lmhead.lm import data, evaluation, generation, train
from lmhead.lm import members as members_lib
from tests import references
from tests.lm.conftest import read_metrics

# On the 20,000-character corpus (split="tail": 18,000 of training), chunks of
# 256 with every 10th held out: 768 held-out characters in [0, 9000), 1024 in
# [9000, 18000). Both are evaluated whole (47 and 63 windows of 16, no more
# than eval_batches * batch_size = 64), so the members' held-out sets have 6
# and 8 batches and the stacked one is filled up. The training windows
# (train_eval) are stacked as well.
HOLDOUT = {
    "data.holdout_fraction": 0.1,
    "data.holdout_chunk": 256,
    "data.train_fraction": 0.5,
    "train.eval_batches": 8,
    "train.eval_every": 5,
    "train.eval_train_batches": 1,
}
OFFSET = {"data.train_offset": 0.5, "train.seed": 1}
RTOL = 1e-5


def records(workdir):
    return read_metrics(workdir, drop=())


class TestHeldoutEvalSet:
    def config(self, eval_batches):
        return ml_collections.ConfigDict(
            {
                "train": {"eval_batches": eval_batches, "batch_size": 2},
                "data": {"block_size": 4},
            }
        )

    @pytest.mark.parametrize(
        "length,eval_batches,starts",
        [
            (100, 3, np.linspace(0, 95, 6).astype(int)),  # 24 windows > 6
            (25, 3, np.arange(6) * 4),  # 6 windows: all
            (12, 3, np.array([0, 4])),  # fewer than asked: all, no repeats
            (12, None, np.array([0, 4])),
        ],
    )
    def test_windows(self, length, eval_batches, starts):
        tokenizer = data.CharTokenizer.train("abcdefghij")
        tokens = np.arange(length) % 10
        got = evaluation.heldout_eval_set(self.config(eval_batches), tokens, tokenizer)
        inputs = np.concatenate([b["inputs"] for b in got.batches])
        weights = np.concatenate([b["weights"] for b in got.batches])
        want = tokens[starts[:, None] + np.arange(4)]
        np.testing.assert_array_equal(inputs[weights[:, 0] > 0], want)
        assert got.name == "heldout" and got.num_tokens == 4 * len(starts)

    def test_is_a_periodic_set_with_heldout_tokens_only(self, short_config):
        config = short_config()
        tokenizer = data.CharTokenizer.train("abcdefghij")
        tokens = np.arange(200) % 10
        plain = data.Dataset(tokens, tokens, tokenizer, 1.0)
        held = data.Dataset(tokens, tokens, tokenizer, 1.0, heldout_tokens=tokens[:50])
        assert [s.name for s in evaluation.periodic_eval_sets(config, plain)] == [
            "eval"
        ]
        assert [s.name for s in evaluation.periodic_eval_sets(config, held)] == [
            "eval",
            "heldout",
        ]


@pytest.fixture(scope="module")
def single_run(short_config, tmp_path_factory):
    """The offset member's config as a single run."""
    workdir = str(tmp_path_factory.mktemp("heldout") / "single")
    summary = train.train_and_evaluate(short_config(**HOLDOUT, **OFFSET), workdir)
    return workdir, summary


class TestSingleRun:
    def test_every_evaluation_has_heldout_metrics(self, single_run):
        workdir, summary = single_run
        evaluations = [r for r in records(workdir) if "eval/loss" in r]
        assert [r["step"] for r in evaluations] == [5, 10]
        names = {k.split("/", 1)[1] for k in evaluations[0] if k.startswith("eval/")}
        for record in evaluations:
            assert {f"heldout/{n}" for n in names} <= record.keys()
        best = next(r for r in evaluations if r["step"] == summary["best_step"])
        assert summary["heldout_at_best"] == {
            k: v for k, v in best.items() if k.startswith("heldout/")
        }
        assert summary["final"]["heldout/loss"] == evaluations[-1]["heldout/loss"]

    def test_heldout_loss_is_the_held_out_texts(self, single_run):
        """The final heldout/loss, recomputed from the documented text cut:
        every consecutive window of the held-out chunks in [9000, 18000)."""
        workdir, summary = single_run
        config, tokenizer, model, params = generation.load_run(workdir)
        text = data.load_text(config.data.path)[:18_000]
        heldout = "".join(
            text[i : i + 256]
            for i in range(0, 18_000, 256)
            if i >= 9000 and (i // 256) % 10 == 9
        )  # chunks 39, 49, 59 and 69, all inside the range
        assert len(heldout) == 1024
        tokens = tokenizer.encode_array(heldout)
        windows = np.stack([tokens[i : i + 17] for i in range(0, 1008, 16)])
        logits = np.asarray(
            jax.jit(lambda p, x: model.apply({"params": p}, x))(
                params, windows[:, :-1]
            ),
            np.float64,
        )
        _, want = references.cross_entropy(
            logits.reshape(-1, tokenizer.vocab_size), windows[:, 1:].reshape(-1)
        )
        np.testing.assert_allclose(summary["final"]["heldout/loss"], want["nll"], 1e-5)

    def test_without_holdout_there_are_none(self, finished_run):
        assert not any(
            k.startswith("heldout/") for r in records(finished_run) for k in r
        )
        with open(os.path.join(finished_run, train.SUMMARY_FILE)) as f:
            assert "heldout_at_best" not in json.load(f)


def test_a_member_with_an_offset_is_its_single_run(short_config, single_run, tmp_path):
    workdir = str(tmp_path / "program")
    members = members_lib.make_members(
        [
            {"workdir": os.path.join(workdir, "m0")},
            {"workdir": os.path.join(workdir, "m1"), **OFFSET},
        ],
        workdir,
    )
    summaries = train.train_program(short_config(**HOLDOUT), members, workdir)
    single_dir, single = single_run
    for key in (
        "train/loss",
        "eval/loss",
        "train_eval/loss",
        "heldout/loss",
        "heldout/bits_per_char",
    ):
        got = [r[key] for r in records(members[1].workdir) if key in r]
        want = [r[key] for r in records(single_dir) if key in r]
        assert len(got) == len(want) > 0
        np.testing.assert_allclose(got, want, rtol=RTOL)
    np.testing.assert_allclose(
        summaries[1]["heldout_at_best"]["heldout/loss"],
        single["heldout_at_best"]["heldout/loss"],
        rtol=RTOL,
    )
    # The other member's held-out text is another: 768 characters, not 1024.
    other = [r["heldout/loss"] for r in records(members[0].workdir) if "eval/loss" in r]
    assert len(other) == 2 and not np.allclose(other, want)
    with open(os.path.join(members[1].workdir, "config.json")) as f:
        assert json.load(f)["data"]["train_offset"] == 0.5
