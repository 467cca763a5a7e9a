"""experiments/tying_rate_noise.py end to end, in one subprocess, on a small
study of copies of the session's tiny run with perturbed parameters, checked
against losses and standard errors computed here with numpy; and
rate_noise.window_losses against the run's own validation loss."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from lmhead.lm import checkpoints, data, generation
from lmhead.lm import state as state_lib
from lmhead.studies.tying import rate_noise, table
from tests import run_experiment

CHOSEN, FOLLOWING, SEEDS = 0.001, 0.002, (100, 101)


def _perturbed_copy(finished_run, workdir, seed):
    """``finished_run`` with its step-10 parameters moved by seeded noise
    (seed 0: left as they are); returns the parameters."""
    shutil.copytree(finished_run, workdir)
    config, _, model, params = generation.load_run(workdir)
    if seed:
        keys = iter(
            jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
        )
        params = jax.tree.map(
            lambda p: p + 0.05 * jax.random.normal(next(keys), p.shape), params
        )
        shutil.rmtree(os.path.join(workdir, "checkpoints"))
        state = state_lib.create_train_state(model, config, jax.random.key(0))
        manager = checkpoints.checkpoint_manager(workdir)
        checkpoints.save(manager, 10, state.replace(params=params, step=10))
        manager.close()
    return config, model, params


def _window_nll(config, model, params, val_tokens):
    """``[W]`` mean nll of each evaluation window, from the logits with numpy."""
    batches = data.eval_batches(
        val_tokens,
        num_batches=config.train.eval_batches,
        batch_size=config.train.batch_size,
        block_size=config.data.block_size,
    )
    inputs = np.concatenate([b["inputs"] for b in batches])
    labels = np.concatenate([b["labels"] for b in batches])
    logits = np.asarray(jax.jit(model.apply)({"params": params}, inputs), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_p, labels[..., None], -1)[..., 0].mean(-1)


@pytest.fixture(scope="module")
def measured(finished_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("rate_noise")
    study = root / "study"
    rows, nll = [], {}
    with np.load(os.path.join(finished_run, "tokens.npz")) as cached:
        val = cached["val"]
    for index, (lr, seed) in enumerate(
        (lr, seed) for lr in (CHOSEN, FOLLOWING) for seed in SEEDS
    ):
        name = f"lr={lr},seed={seed}"
        nll[(lr, seed)] = _window_nll(
            *_perturbed_copy(finished_run, str(study / name), index), val
        )
        rows.append(
            dict.fromkeys(table.COLUMNS)
            | dict(role="tune", vocab="char", amount=0.01, arm="a", seed=seed,
                   lr=lr, status="finished", run=name,
                   val_loss=float(nll[(lr, seed)].mean()))
        )  # fmt: skip
    # The chosen rate: the test runs'; a second arm restored from the CSV alone.
    rows.append(
        dict.fromkeys(table.COLUMNS)
        | dict(role="test", vocab="char", amount=0.01, arm="a", seed=0, lr=CHOSEN,
               status="not started", run="test")
    )  # fmt: skip
    for lr, loss in ((CHOSEN, 1.0), (FOLLOWING, 1.2)):
        rows += [
            dict.fromkeys(table.COLUMNS)
            | dict(role=role, vocab="char", amount=0.01, arm="b", seed=seed, lr=lr,
                   status="finished" if role == "tune" else "not started",
                   run=f"b-{lr}-{seed}", val_loss=loss + 0.01 * (seed - 100))
            for role, seed in (("tune", 100), ("tune", 101), ("test", 0))
            if role == "tune" or lr == CHOSEN
        ]  # fmt: skip
    csv_path = str(root / "runs.csv")
    table.write_rows(csv_path, rows)
    out = root / "out"
    done = run_experiment(
        "tying_rate_noise.py",
        f"--study_dir={study}",
        f"--study_csv={csv_path}",
        f"--out={out}",
        "--batch_size=3",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return nll, (out / rate_noise.MARKDOWN_FILE).read_text()


def _table_lines(text):
    lines = [line for line in text.splitlines() if line.startswith("| characters")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_the_window_margin_and_its_error_against_numpy(measured):
    nll, text = measured
    (tuned, restored) = _table_lines(text)
    assert tuned[:4] == ["characters at 1%", "a", f"{CHOSEN:.3g}", f"{FOLLOWING:.3g}"]
    d = {seed: nll[(FOLLOWING, seed)] - nll[(CHOSEN, seed)] for seed in SEEDS}
    margin = np.mean([d[s].mean() for s in SEEDS])
    error = np.sqrt(sum(d[s].var(ddof=1) / len(d[s]) for s in SEEDS)) / len(SEEDS)
    assert tuned[6] == "100, 101"
    assert float(tuned[4]) == pytest.approx(margin, abs=6e-5)  # runs.csv's margin
    assert float(tuned[7]) == pytest.approx(margin, abs=6e-5)
    assert float(tuned[8]) == pytest.approx(error, abs=6e-5)
    assert error > 1e-3  # the perturbed runs differ window by window
    # No parameters under the study directory: the CSV's numbers only.
    assert restored[1] == "b" and restored[6:] == ["—", "—", "—"]
    assert float(restored[4]) == pytest.approx(0.2)


def test_window_losses_average_to_the_runs_validation_loss(finished_run):
    with open(os.path.join(finished_run, "summary.json")) as f:
        final = json.load(f)["final"]
    losses = rate_noise.window_losses(finished_run, batch_size=3)
    assert losses.shape == (8,)  # eval_batches 1 of batch 8
    np.testing.assert_allclose(losses.mean(), final["eval/loss"], rtol=1e-5)
