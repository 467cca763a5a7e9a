"""A synthetic sweep directory, for the tests of reading runs back: 2
vocabularies x tied / untied x 3 seeds, plus a failed run and one never
started."""

import json
import os

from lmhead.lab import sweeps, workdirs

VOCAB_SIZES = {"char": None, "bpe": 512}
FAILED = "seed=3,tokenizer=char,tied=True"
NOT_STARTED = "seed=3,tokenizer=bpe,vocab_size=512,tied=False"


def overrides(tokenizer, tied, seed):
    vocab = {"data.tokenizer": tokenizer}
    if tokenizer == "bpe":
        vocab["data.vocab_size"] = VOCAB_SIZES["bpe"]
    return {"train.seed": seed, **vocab, "model.tied": tied}


def write_run(workdir, tokenizer, tied, seed, finished=True):
    """A run's config.json and metrics.jsonl (an evaluation at step 10 of
    loss 5 + seed), then its summary.json, or for a run that failed its log
    and exit status."""
    os.makedirs(workdir)
    config = {
        "data": {"tokenizer": tokenizer, "vocab_size": VOCAB_SIZES[tokenizer]},
        "model": {"tied": tied, "d_model": 32},
        "train": {"seed": seed, "steps": 20},
    }
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 10, "train/loss": 9.0}) + "\n")
        f.write(json.dumps({"step": 10, "eval/loss": 5.0 + seed}) + "\n")
    if not finished:
        with open(os.path.join(workdir, workdirs.LOG_FILE), "w") as f:
            f.write("Traceback ...\nValueError: simulated\n")
        with open(os.path.join(workdir, workdirs.STATUS_FILE), "w") as f:
            json.dump({"returncode": 1, "seconds": 1.0, "command": []}, f)
        return
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({"final": {"eval/loss": 4.0 + seed}, "steps": 20}, f)


def write_sweep(root):
    """Writes the runs of the grid and its ``sweep.json`` into ``root``; returns it."""
    grid = [
        overrides(t, tied, seed)
        for seed in range(3)
        for t in VOCAB_SIZES
        for tied in (True, False)
    ]
    grid += [overrides("char", True, 3), overrides("bpe", False, 3)]
    names = sweeps.run_names(grid)
    assert FAILED in names and NOT_STARTED in names
    for name, run in zip(names, grid):
        if name != NOT_STARTED:
            write_run(
                root / name,
                run["data.tokenizer"],
                run["model.tied"],
                run["train.seed"],
                finished=name != FAILED,
            )
    with open(root / workdirs.SWEEP_FILE, "w") as f:
        json.dump(
            {"runs": [{"name": n, "overrides": o} for n, o in zip(names, grid)]}, f
        )
    return root
