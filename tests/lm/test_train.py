"""Tests for lmhead/lm/train.py: a single run end to end (a program of one),
the train step, early stopping and the test evaluation.

One tiny run of the default config (``runs``) serves the end-to-end tests;
that a run is deterministic and resumes exactly is test_preemption.py's,
through the command killed and run again, and that a finished one is not
trained again test_configuration.py's, with harmless changes to its config.
"""

import functools
import json
import math
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import default
from lmhead.lm import (
    checkpoints,
    configuration,
    data,
    evaluation,
    generation,
    loop,
    monitoring,
    program,
    train,
)
from lmhead.lm import state as state_lib
from tests.lm.conftest import read_metrics, tiny_config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    first = str(tmp_path_factory.mktemp("runs") / "first")
    loops, original = [], loop.train_loop
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(
            loop,
            "train_loop",
            lambda run, *a: (
                loops.append((type(run), run.count, run.single)) or original(run, *a)
            ),
        )
        summary = train.train_and_evaluate(tiny_config(), first)
    return dict(loops=loops, first=first, summary=summary)


class TestTraining:
    def test_a_single_run_is_the_one_loop_over_a_program_of_one(self, runs):
        assert runs["loops"] == [(program.Program, 1, True)]

    def test_loss_falls(self, runs):
        records = read_metrics(runs["first"])
        train_losses = [r["train/loss"] for r in records if "train/loss" in r]
        eval_losses = [r["eval/loss"] for r in records if "eval/loss" in r]
        assert len(train_losses) == 4 and len(eval_losses) == 2
        assert train_losses[-1] < train_losses[0] - 0.5
        assert eval_losses[-1] < math.log(84) - 0.8

    def test_summary(self, runs):
        summary = runs["summary"]
        final = summary["final"]
        assert summary["steps"] == 40 and summary["tokens_per_sec"] > 0
        assert final == {
            k: v for k, v in read_metrics(runs["first"])[-1].items() if k != "step"
        }
        assert final["eval/perplexity"] == pytest.approx(
            math.exp(final["eval/loss"]), rel=1e-5
        )
        # One character per label, none for an end-of-text label.
        config = tiny_config()
        dataset = data.load_dataset(config.data, workdir=runs["first"])
        (eval_set,) = [
            s
            for s in evaluation.periodic_eval_sets(config, dataset)
            if s.name == "eval"
        ]
        labels = np.concatenate(
            [b["labels"][np.asarray(b["weights"]) > 0] for b in eval_set.batches]
        )
        chars = np.sum(labels != dataset.tokenizer.eos_id)
        assert final["eval/bits_per_char"] == pytest.approx(
            final["eval/loss"] / math.log(2) * len(labels) / chars, rel=1e-5
        )
        assert 0 <= final["eval/ece"] <= 1 and 0 <= final["eval/accuracy"] <= 1
        with open(os.path.join(runs["first"], "summary.json")) as f:
            assert json.load(f) == summary
        # 84 characters and the end-of-text token.
        V, D, L, F, T = 85, config.model.d_model, 1, config.model.mlp_dim, 16
        per_block = 4 * D + 3 * D * D + 3 * D + D * D + D + D * F + F + F * D + D
        assert summary["num_params"] == V * D + T * D + L * per_block + 2 * D
        assert summary["num_head_params"] == 0  # tied: the table is the embedding's

    def test_monitoring(self, runs):
        logged = [r for r in read_metrics(runs["first"], drop=()) if "train/loss" in r]
        assert len(logged) == 4
        for record in logged:
            assert 0 < record["train/step_ms_p50"] <= record["train/step_ms_p90"]
            assert (
                record["memory/host_peak_rss_bytes"]
                >= record["memory/host_rss_bytes"]
                > 2**20
            )
            # JAX reports device memory on GPU and TPU, not on CPU.
            assert ("memory/device_peak_bytes" in record) == (
                jax.default_backend() != "cpu"
            )
            assert set(record) - {"step"} <= {
                f"train/{k}"
                for k in ("loss", "nll", "accuracy", "grad_norm", "learning_rate")
            } | set(monitoring.MEASURED_METRICS)
        summary = runs["summary"]
        assert 0 < summary["step_ms_p50"] <= summary["step_ms_p90"]
        assert summary["memory"]["host_peak_rss_bytes"] > 2**20

    def test_outputs_in_workdir(self, runs):
        names = set(os.listdir(runs["first"]))
        assert {
            "config.json",
            "metrics.jsonl",
            "summary.json",
            "tokenizer.json",
            "tokens.npz",
            "checkpoints",
            "samples.txt",
        } <= names
        assert any(n.startswith("events.out.tfevents") for n in names)
        with open(os.path.join(runs["first"], "config.json")) as f:
            assert json.load(f) == json.loads(tiny_config().to_json())
        with open(os.path.join(runs["first"], "samples.txt")) as f:
            samples = f.read().split(generation.SAMPLE_SEPARATOR)
        assert len(samples) == 2
        # At most 24 new characters: fewer where a sample ended at end-of-text.
        assert all(
            s.startswith("KING") and len(s.rstrip("\n")) <= 4 + 24 for s in samples
        )


def jitted_train_step(model, config):
    """``train.train_step`` of ``config``, jitted alone, without donating the
    state."""
    return jax.jit(
        functools.partial(
            train.train_step,
            model=model,
            loss_kwargs=train.loss_keywords(config.loss),
            learning_rate_fn=state_lib.learning_rate_schedule(config),
            microbatches=config.train.microbatches,
        )
    )


class TestLossImpl:
    def test_fused_step_matches_materialized(self, untied_state):
        config, state = untied_state
        batch = data.train_batch(
            np.arange(300) % 84, seed=0, step=0, batch_size=8, block_size=16
        )
        results = {}
        for impl, chunk_size in (("materialized", None), ("fused", 24)):
            config = tiny_config(
                **{
                    "model.tied": False,
                    "model.head_bias": True,
                    "loss.loss_impl": impl,
                    "loss.chunk_size": chunk_size,
                    "loss.z_loss": 1e-3,
                }
            )
            configuration.validate_config(config)
            model = configuration.make_model(config, vocab_size=84)
            step = jitted_train_step(model, config)
            results[impl] = step(state, batch, jax.random.key(0))
        (materialized, m_metrics), (fused, f_metrics) = results.values()
        for name in ("loss", "nll", "accuracy", "grad_norm"):
            np.testing.assert_allclose(f_metrics[name], m_metrics[name], rtol=1e-5)
        # Adam's first step is lr * sign(g), so a gradient of about 0 may
        # round to either sign: compare the share of parameters that moved
        # alike, not every one.
        moved_alike = jax.tree.map(
            lambda a, b: np.mean(np.abs(np.asarray(a) - np.asarray(b)) < 1e-6),
            fused.params,
            materialized.params,
        )
        assert min(jax.tree.leaves(moved_alike)) > 0.99, moved_alike


# Validation losses scripted to worsen after step 10 (evaluations every 5).
SCRIPTED_LOSSES = {5: 3.0, 10: 2.0, 15: 2.5, 20: 2.6}


@pytest.fixture(scope="module")
def stopped(corpus, tmp_path_factory):
    """One run with patience 2 on ``SCRIPTED_LOSSES``, a works split (blocks,
    for a plain file) and the test evaluation; ``events`` records the calls
    of the data loaders and of ``evaluate`` (by evaluation set) in order."""
    workdir = str(tmp_path_factory.mktemp("stopped") / "run")
    config = tiny_config(
        **{
            "data.path": corpus,
            "data.split": "works",
            "train.eval_every": 5,
            "train.log_every": 5,
            "train.checkpoint_every": 10,
            "train.patience": 2,
            "train.eval_train_batches": 1,
            "sample.num_samples": 0,
        }
    )
    events, original = [], evaluation.evaluate
    losses = list(SCRIPTED_LOSSES.values())

    def scripted(eval_fn, params, eval_set):
        (metrics,) = original(eval_fn, params, eval_set)
        name = eval_set.sets[0].name
        if name == "eval":
            metrics["eval/loss"] = losses[events.count("eval")]
        events.append(name)
        return [metrics]

    def recording(name, function):
        def record(*args, **kwargs):
            events.append(name)
            return function(*args, **kwargs)

        return record

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(evaluation, "evaluate", scripted)
        monkeypatch.setattr(
            data, "train_batch", recording("train_batch", data.train_batch)
        )
        monkeypatch.setattr(
            data,
            "load_test_tokens",
            recording("load_test_tokens", data.load_test_tokens),
        )
        summary = train.train_and_evaluate(config, workdir)
    return dict(workdir=workdir, summary=summary, events=events, config=config)


class TestEarlyStoppingAndTest:
    def test_stops_and_reports_the_best_step(self, stopped):
        summary = stopped["summary"]
        assert summary["best_step"] == 10 and summary["best"]["eval/loss"] == 2.0
        assert summary["steps_run"] == 20 and summary["stopped_early"] is True
        assert summary["steps"] == 40
        records = read_metrics(stopped["workdir"])
        at_best = next(r for r in records if r["step"] == 10 and "eval/loss" in r)
        assert summary["best"] == {
            k: v for k, v in at_best.items() if k.startswith("eval/")
        }
        assert summary["train_at_best"] == {
            k: v for k, v in at_best.items() if k.startswith("train_eval/")
        }
        assert set(summary["train_at_best"]) >= {
            "train_eval/loss",
            "train_eval/loss_stderr",
        }
        assert max(r["step"] for r in records) == 20

    def test_keeps_the_best_checkpoint(self, stopped):
        workdir = stopped["workdir"]
        assert os.listdir(os.path.join(workdir, "best_checkpoint")) == ["10"]
        assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "20"]
        vocab_size = data.load_tokenizer(
            os.path.join(workdir, data.TOKENIZER_FILE)
        ).vocab_size
        model = configuration.make_model(stopped["config"], vocab_size)
        best = state_lib.restore_or_init(
            checkpoints.best_checkpoint_manager(workdir),
            model,
            stopped["config"],
            jax.random.key(0),
        )
        # The one layout: the state of step 10 is a program of one's.
        manager = checkpoints.checkpoint_manager(workdir)
        stacked = jax.tree.map(lambda x: x[None], best)
        at_10 = manager.restore(
            10, args=ocp.args.StandardRestore({"state": stacked, "best": stacked})
        )
        manager.close()
        assert int(best.step) == 10 and at_10["state"].step.tolist() == [10]
        jax.tree.map(np.testing.assert_array_equal, stacked, at_10["state"])
        # At step 20 the best is still step 10's, kept beside the state.
        last = checkpoints.checkpoint_manager(workdir)
        at_20 = last.restore(
            20, args=ocp.args.StandardRestore({"state": stacked, "best": stacked})
        )
        last.close()
        assert at_20["state"].step.tolist() == [20]
        jax.tree.map(np.testing.assert_array_equal, stacked, at_20["best"])

    def test_test_split_is_read_once_after_training(self, stopped):
        events = stopped["events"]
        assert events.count("load_test_tokens") == 1
        assert events.index("load_test_tokens") > max(
            i for i, e in enumerate(events) if e in ("train_batch", "eval")
        )
        assert events[-1] == "test"

    def test_test_evaluation_of_the_best_parameters(self, stopped, corpus):
        """On the best step's parameters: counts, bits per character and the
        per-word perplexity of the whole test text."""
        test = stopped["summary"]["test"]
        assert test["step"] == 10
        with open(corpus, encoding="utf-8") as f:
            test_text = data.split_blocks(f.read(), 0.1, 0.1)[2]
        T = 16
        assert (
            test["num_tokens"] == test["num_chars"] == T * ((len(test_text) - 1) // T)
        )
        assert test["bits_per_char"] == pytest.approx(test["loss"] / math.log(2))
        assert test["loss_stderr"] > 0
        assert test["words"] == len(test_text.split())
        assert test["word_perplexity"] == pytest.approx(
            math.exp(test["loss"] * test["num_tokens"] / test["words"]), rel=1e-6
        )
        records = read_metrics(stopped["workdir"])
        assert any("test/word_perplexity" in r for r in records)
        assert not any("eval/word_perplexity" in r for r in records)

    def test_a_stopped_run_is_finished(self, stopped, monkeypatch):
        monkeypatch.setattr(train, "compile_steps", None)
        summary = train.train_and_evaluate(stopped["config"], stopped["workdir"])
        assert summary == stopped["summary"]

    def test_a_stopped_run_stays_stopped(self, stopped, tmp_path):
        # As if it had been killed after its last checkpoint, before its summary.
        workdir = str(tmp_path / "copy")
        shutil.copytree(stopped["workdir"], workdir)
        os.remove(os.path.join(workdir, "summary.json"))
        summary = train.train_and_evaluate(stopped["config"], workdir)
        assert (summary["steps_run"], summary["best_step"]) == (20, 10)
        assert summary["stopped_early"] and summary["test"]["step"] == 10
        assert max(r["step"] for r in read_metrics(workdir)) == 20


def test_microbatches_give_the_one_batch_step(corpus):
    """Accumulating over 2 microbatches is the plain step up to rounding (4
    would run the same scan over more pieces); a count that does not divide
    the batch is refused."""
    config = default.get_config("tiny")
    config.data.path = corpus
    dataset = data.load_dataset(config.data)
    model = configuration.make_model(config, dataset.vocab_size)
    state = state_lib.create_train_state(model, config, jax.random.key(0))
    batch = data.train_batch(
        dataset.train_tokens,
        seed=0,
        step=0,
        batch_size=8,
        block_size=config.data.block_size,
    )

    def step(microbatches):
        config.train.microbatches = microbatches
        return jitted_train_step(model, config)(state, batch, jax.random.key(1))

    reference_state, reference = step(1)
    new_state, metrics = step(2)
    for name in ("loss", "nll", "accuracy", "grad_norm"):
        np.testing.assert_allclose(metrics[name], reference[name], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
        new_state.params,
        reference_state.params,
    )
    with pytest.raises(ValueError, match="microbatches=3 must divide the batch"):
        step(3)
