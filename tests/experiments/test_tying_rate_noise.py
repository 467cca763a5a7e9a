"""experiments/tying_rate_noise.py end to end, in subprocesses, on a small
study of copies of the session's tiny run with perturbed parameters (half of
them in best_checkpoint, which must be preferred), checked against losses
and standard errors computed here with numpy; run again without the runs,
the earlier reading stands."""

import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

from lmhead.lm import checkpoints, data, generation
from lmhead.lm import state as state_lib
from studies.tying import rate_noise, table
from tests import references, run_experiment

CHOSEN, FOLLOWING, SEEDS = 0.001, 0.002, (100, 101)


def _perturbed_copy(finished_run, workdir, index):
    """``finished_run`` with its parameters moved by seeded noise (index 0:
    left as they are): odd indices save them as best_checkpoint at step 5,
    even ones as the newest checkpoint. Returns the parameters to read."""
    shutil.copytree(finished_run, workdir)
    config, _, model, params = generation.load_run(workdir)
    if index:
        leaves = len(jax.tree.leaves(params))
        keys = iter(jax.random.split(jax.random.key(index), leaves))
        params = jax.tree.map(
            lambda p: p + 0.05 * jax.random.normal(next(keys), p.shape), params
        )
        state = state_lib.create_train_state(model, config, jax.random.key(0))
        if index % 2:
            manager, step = checkpoints.best_checkpoint_manager(workdir), 5
        else:
            shutil.rmtree(os.path.join(workdir, "checkpoints"))
            manager, step = checkpoints.checkpoint_manager(workdir), 10
        checkpoints.save(manager, step, state.replace(params=params, step=step))
        manager.close()
    return config, model, params


def _window_nll(config, model, params, val_tokens):
    """``[W]`` mean nll of each evaluation window, from the logits with
    numpy, and the windows' label tokens as text lengths."""
    batches = data.eval_batches(
        val_tokens,
        num_batches=config.train.eval_batches,
        batch_size=config.train.batch_size,
        block_size=config.data.block_size,
    )
    inputs = np.concatenate([b["inputs"] for b in batches])
    labels = np.concatenate([b["labels"] for b in batches])
    logits = jax.jit(model.apply)({"params": params}, inputs)
    log_p = references.log_softmax(np.asarray(logits, np.float64))
    return -np.take_along_axis(log_p, labels[..., None], -1)[..., 0].mean(-1), labels


def _row(**values):
    return dict.fromkeys(table.COLUMNS) | dict(vocab="char", amount=0.01, **values)


@pytest.fixture(scope="module")
def measured(finished_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("rate_noise")
    study = root / "study"
    _, tokenizer, _, _ = generation.load_run(finished_run)
    with np.load(os.path.join(finished_run, "tokens.npz")) as cached:
        val = cached["val"]
    rows, nll = [], {}
    for index, (lr, seed) in enumerate(
        (lr, seed) for lr in (CHOSEN, FOLLOWING) for seed in SEEDS
    ):
        name = f"lr={lr},seed={seed}"
        read = _perturbed_copy(finished_run, str(study / name), index)
        nll[(lr, seed)], labels = _window_nll(*read, val)
        chars = sum(len(tokenizer.decode(window)) for window in labels)
        bits_per_nat = labels.size / (chars * math.log(2))
        loss = float(nll[(lr, seed)].mean())
        rows.append(
            _row(role="tune", arm="a", seed=seed, lr=lr, status="finished",
                 run=name, val_loss=loss, val_bpc=loss * bits_per_nat)
        )  # fmt: skip
    # The chosen rate is the test runs'; arm b's runs are not on this machine.
    rows.append(_row(role="test", arm="a", seed=0, lr=CHOSEN, status="not started"))
    for lr, loss in ((CHOSEN, 1.0), (FOLLOWING, 1.2)):
        rows += [
            _row(role="tune", arm="b", seed=seed, lr=lr, status="finished",
                 run=f"b-{lr}-{seed}", val_loss=loss, val_bpc=loss + 0.01 * seed)
            for seed in SEEDS
        ]  # fmt: skip
    rows.append(_row(role="test", arm="b", seed=0, lr=CHOSEN, status="not started"))
    csv_path = str(root / "runs.csv")
    table.write_rows(csv_path, rows)
    out = root / "out"
    flags = (f"--study_dir={study}", f"--study_csv={csv_path}", f"--out={out}")
    done = run_experiment("tying_rate_noise.py", *flags, "--batch_size=3")
    assert done.returncode == 0, done.stderr[-3000:]
    first = (out / rate_noise.MARKDOWN_FILE).read_text()
    # Again with the runs gone: the earlier reading stands.
    shutil.rmtree(study)
    study.mkdir()
    done = run_experiment("tying_rate_noise.py", *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    again = (out / rate_noise.MARKDOWN_FILE).read_text()
    return nll, bits_per_nat, first, again


def _table_lines(text):
    lines = [line for line in text.splitlines() if line.startswith("| characters")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_the_window_margin_and_its_error_against_numpy(measured):
    nll, bits_per_nat, first, again = measured
    (tuned, elsewhere) = _table_lines(first)
    assert tuned[:4] == ["characters at 1%", "a", f"{CHOSEN:.3g}", f"{FOLLOWING:.3g}"]
    # The seeds share the windows: their differences are averaged window by window.
    d = np.mean([nll[(FOLLOWING, s)] - nll[(CHOSEN, s)] for s in SEEDS], 0)
    margin = d.mean() * bits_per_nat
    error = d.std(ddof=1) / np.sqrt(len(d)) * bits_per_nat
    assert tuned[6] == "100, 101"
    assert float(tuned[4]) == pytest.approx(margin, abs=6e-5)  # runs.csv's margin
    assert float(tuned[7]) == pytest.approx(margin, abs=6e-5)
    assert float(tuned[8]) == pytest.approx(error, abs=6e-5)
    assert error > 1e-3  # the perturbed runs differ window by window
    # No parameters under the study directory: the CSV's numbers only.
    assert elsewhere[1] == "b" and elsewhere[6:] == ["—", "—", "—"]
    assert float(elsewhere[4]) == pytest.approx(0.2)
    assert _table_lines(again) == _table_lines(first)


def test_window_losses_average_to_the_runs_validation_loss(finished_run):
    with open(os.path.join(finished_run, "summary.json")) as f:
        final = json.load(f)["final"]
    windows = rate_noise.window_losses(finished_run, batch_size=3)
    assert windows.nll.shape == (8,)  # eval_batches 1 of batch 8
    np.testing.assert_allclose(windows.nll.mean(), final["eval/loss"], rtol=1e-5)
    np.testing.assert_allclose(
        windows.nll.mean() * windows.bits_per_nat,
        final["eval/bits_per_char"],
        rtol=1e-5,
    )
