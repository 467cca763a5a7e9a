"""experiments/tying_diagnostics.py end to end, in one subprocess, on the
session's tiny tied run and an untied run made from it without training
(its head a known array, with a best_checkpoint that the command must
prefer), checked against numpy on the loaded arrays."""

import json
import os
import shutil

import jax
import ml_collections
import numpy as np
import pytest
from scipy import stats

from lmhead.lm import checkpoints, configuration, generation
from lmhead.lm import state as state_lib
from studies.tying import diagnostics_report, table
from tests import references, run_experiment

MAX_WINDOWS = 6


def _untied_copy(finished_run, tied_run, workdir):
    """``finished_run`` as an untied run: config.json says untied, and its
    checkpoints hold the tied run's parameters plus a random head, one at
    step 10 (newest) and another at step 5 in best_checkpoint; returns the
    best one's head."""
    shutil.copytree(finished_run, workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints"))
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    config["model"]["tied"] = False
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config, f)
    config = ml_collections.ConfigDict(config)
    _, tokenizer, _, tied_params = tied_run
    model = configuration.make_model(config, tokenizer.vocab_size)
    state = state_lib.create_train_state(model, config, jax.random.key(0))
    embedding = tied_params["embed"]["embedding"]
    heads = {}
    for seed, step, manager in (
        (1, 10, checkpoints.checkpoint_manager(workdir)),
        (2, 5, checkpoints.best_checkpoint_manager(workdir)),
    ):
        heads[step] = np.asarray(
            embedding + 0.05 * jax.random.normal(jax.random.key(seed), embedding.shape)
        )
        params = {**tied_params, "head": {"unembedding": heads[step]}}
        checkpoints.save(manager, step, state.replace(params=params, step=step))
        manager.close()
    return heads[5]


@pytest.fixture(scope="module")
def diagnosed(finished_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("diagnostics")
    untied = str(root / "untied")
    tied_run = generation.load_run(finished_run)
    best_head = _untied_copy(finished_run, tied_run, untied)
    out = root / "out"
    result = run_experiment(
        "tying_diagnostics.py",
        f"--workdir={finished_run}",
        f"--workdir={untied}",
        f"--out={out}",
        "--split=val",
        f"--max_windows={MAX_WINDOWS}",
        "--num_buckets=3",
        "--batch_size=4",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out / "diagnostics.json") as f:
        summaries = json.load(f)["runs"]
    return finished_run, tied_run, best_head, out, summaries, result.stdout


def _counts(workdir, vocab_size):
    with np.load(os.path.join(workdir, "tokens.npz")) as cached:
        return np.bincount(cached["train"], minlength=vocab_size)


def _spearman(x, y):
    return np.corrcoef(stats.rankdata(x), stats.rankdata(y))[0, 1]


def test_writes_every_file(diagnosed):
    *_, out, summaries, stdout = diagnosed
    names = {"norms.png", "cosines.png", "bucket_loss.png"}
    names |= {"diagnostics.json", "diagnostics.md"}
    assert set(os.listdir(out)) == names
    assert all(os.path.join(out, name) in stdout for name in names)
    markdown = (out / "diagnostics.md").read_text()
    assert "training tokens" in markdown and "| run | bucket 0 |" in markdown
    assert [s["run"] for s in summaries] == ["run", "untied"]


def test_tied_run_against_numpy(diagnosed):
    finished_run, (_, tokenizer, model, params), *_, summaries, _ = diagnosed
    tied = summaries[0]
    counts = _counts(finished_run, tokenizer.vocab_size)
    norms = np.linalg.norm(np.asarray(params["embed"]["embedding"]), axis=1)
    log_frequency = np.log((counts + 1) / (counts.sum() + len(counts)))
    assert tied["tied"] and tied["checkpoint"] == "checkpoints" and tied["step"] == 10
    assert tied["cosine_weighted"] is None
    assert tied["train_tokens"] == counts.sum()
    np.testing.assert_allclose(
        tied["embedding_norm_spearman"], _spearman(norms, log_frequency), rtol=1e-5
    )
    assert tied["head_norm_spearman"] == tied["embedding_norm_spearman"]
    # The logit scale and the loss on the windows, from the model's logits.
    with np.load(os.path.join(finished_run, "tokens.npz")) as cached:
        val = cached["val"]
    block = model.max_len
    windows = diagnostics_report.evaluation_windows(val, block, MAX_WINDOWS)
    logits = jax.jit(model.apply)({"params": params}, windows["inputs"])
    logits = np.asarray(logits, np.float64)
    labels = windows["labels"]
    log_p = references.log_softmax(logits)
    nll = -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]
    assert tied["windows"] == MAX_WINDOWS and tied["positions"] == MAX_WINDOWS * block
    np.testing.assert_allclose(tied["nll"], nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(tied["logit_std"], logits.std(-1).mean(), rtol=1e-5)
    np.testing.assert_allclose(tied["logit_max"], logits.max(-1).mean(), rtol=1e-5)
    buckets = tied["buckets"]
    assert sum(b["tokens"] for b in buckets) == tied["positions"]
    assert sum(b["types"] for b in buckets) == tokenizer.vocab_size
    np.testing.assert_allclose(sum(b["train_share"] for b in buckets), 1.0)
    assert [b["max_count"] for b in buckets] == sorted(
        (b["max_count"] for b in buckets), reverse=True
    )
    total = sum(b["mean_nll"] * b["tokens"] for b in buckets if b["tokens"])
    np.testing.assert_allclose(total, nll.sum(), rtol=1e-5)


def test_untied_run_reads_its_best_checkpoint(diagnosed):
    finished_run, (_, tokenizer, _, params), best_head, _, summaries, _ = diagnosed
    untied = summaries[1]
    embedding = np.asarray(params["embed"]["embedding"])
    counts = _counts(finished_run, tokenizer.vocab_size)
    cosines = np.sum(embedding * best_head, 1) / (
        np.linalg.norm(embedding, axis=1) * np.linalg.norm(best_head, axis=1)
    )
    assert not untied["tied"]
    assert (untied["checkpoint"], untied["step"]) == ("best_checkpoint", 5)
    np.testing.assert_allclose(untied["cosine_mean"], cosines.mean(), rtol=1e-5)
    np.testing.assert_allclose(
        untied["cosine_weighted"], np.average(cosines, weights=counts), rtol=1e-5
    )
    log_frequency = np.log(counts + 1.0)
    head_norms = np.linalg.norm(best_head, axis=1)
    np.testing.assert_allclose(
        untied["head_norm_spearman"], _spearman(head_norms, log_frequency), rtol=1e-5
    )


def test_bad_splits_are_named(finished_run):
    with pytest.raises(ValueError, match="split must be one of"):
        diagnostics_report.diagnose_run(finished_run, split="train")
    with pytest.raises(ValueError, match="no test split"):
        diagnostics_report.diagnose_run(finished_run, split="test")
    with pytest.raises(ValueError, match="runs must hold"):
        diagnostics_report.write_diagnostics([], "unused")


def _study_csv(path, runs):
    """A runs.csv whose finished test runs (seed 0) are ``{(vocab, amount,
    arm): run name}``."""
    rows = [
        dict.fromkeys(table.COLUMNS)
        | dict(role="test", vocab=vocab, amount=amount, arm=arm, seed=0,
               status="finished", run=name)
        for (vocab, amount, arm), name in runs.items()
    ]  # fmt: skip
    table.write_rows(str(path), rows)
    return str(path)


def test_the_study_diagnoses_its_cells_runs_that_hold_a_checkpoint(
    finished_run, tmp_path
):
    study = tmp_path / "study"
    study.mkdir()
    os.symlink(finished_run, study / "char-a")
    (study / "char-b").mkdir()  # restored from the CSV: no checkpoint
    os.symlink(finished_run, study / "bpe-a")
    csv_path = _study_csv(
        tmp_path / "runs.csv",
        {("8192", 1.0, "a"): "bpe-a", ("char", 1.0, "b"): "char-b",
         ("char", 1.0, "a"): "char-a", ("512", 1.0, "a"): "elsewhere"},
    )  # fmt: skip
    rows = table.read_rows(csv_path)
    assert diagnostics_report.study_workdirs(str(study), rows) == {
        str(study / "char-a"): "characters at 100%, a (tied), seed 0",
        str(study / "bpe-a"): "BPE 8192 at 100%, a (tied), seed 0",
    }


def test_the_study_before_its_test_runs_writes_nothing(tmp_path):
    out = tmp_path / "out"
    done = run_experiment(
        "tying_diagnostics.py",
        f"--study_dir={tmp_path}",
        f"--study_csv={_study_csv(tmp_path / 'runs.csv', {})}",
        f"--out={out}",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "No test run of the diagnosed cells" in done.stdout
    assert not out.exists()
