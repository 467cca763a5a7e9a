"""A synthetic sweep directory with known final metrics, for the tests of
the generic report and of reading runs back: 2 vocabularies x tied / untied
x 3 seeds, plus a failed run and one never started."""

import json
import math
import os

from lmhead.lab import sweeps, workdirs

CHARS = "".join(chr(c) for c in range(32, 32 + 84))
D_MODEL = 32
VOCABULARIES = {
    "char": dict(vocab_size=None, label="char (84)", params=1000, chars_per_token=1.0),
    "bpe": dict(vocab_size=512, label="bpe 512", params=2000, chars_per_token=2.5),
}
# Final validation loss by (tokenizer, tied) for seeds 0, 1, 2. Untied - tied:
# char [+0.03, +0.01, +0.07] (interval holds 0), bpe [-0.08, -0.05, -0.10] (not).
LOSS = {
    ("char", True): [1.90, 1.95, 1.88],
    ("char", False): [1.93, 1.96, 1.95],
    ("bpe", True): [4.10, 4.30, 4.05],
    ("bpe", False): [4.02, 4.25, 3.95],
}
ACCURACY = {
    ("char", True): [0.40, 0.42, 0.41],
    ("char", False): [0.39, 0.40, 0.44],
    ("bpe", True): [0.20, 0.22, 0.21],
    ("bpe", False): [0.23, 0.20, 0.22],
}
TOKENS_PER_SEC = [15000.0, 16000.0, 17500.0]
FAILED = "seed=3,tokenizer=char,tied=True"
NOT_STARTED = "seed=3,tokenizer=bpe,vocab_size=512,tied=False"


def overrides(tokenizer, tied, seed):
    vocab = {"data.tokenizer": tokenizer}
    if tokenizer == "bpe":
        vocab["data.vocab_size"] = VOCABULARIES["bpe"]["vocab_size"]
    return {"train.seed": seed, **vocab, "model.tied": tied}


def final_metrics(tokenizer, tied, seed):
    loss = LOSS[tokenizer, tied][seed]
    bits = loss / math.log(2) / VOCABULARIES[tokenizer]["chars_per_token"]
    return {
        "eval/loss": loss,
        "eval/perplexity": math.exp(loss),
        "eval/bits_per_char": bits,
        "eval/accuracy": ACCURACY[tokenizer, tied][seed],
        "eval/ece": 0.01 * (seed + 1) + (0.0 if tied else 0.005),
    }


def write_run(workdir, tokenizer, tied, seed, finished=True):
    os.makedirs(workdir)
    vocab = VOCABULARIES[tokenizer]
    config = {
        "data": {"tokenizer": tokenizer, "vocab_size": vocab["vocab_size"]},
        "model": {"tied": tied, "d_model": D_MODEL},
        "train": {"seed": seed, "steps": 20},
    }
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config, f)
    if tokenizer == "char":  # the BPE runs leave the size to config.json
        with open(os.path.join(workdir, "tokenizer.json"), "w") as f:
            json.dump({"kind": "char", "chars": CHARS}, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 10, "train/loss": 9.0}) + "\n")
        f.write(json.dumps({"step": 10, "eval/loss": 5.0 + seed}) + "\n")
        if finished:
            f.write(
                json.dumps({"step": 20, **final_metrics(tokenizer, tied, seed)}) + "\n"
            )
    if not finished:
        with open(os.path.join(workdir, workdirs.LOG_FILE), "w") as f:
            f.write("Traceback ...\nValueError: simulated\n")
        with open(os.path.join(workdir, workdirs.STATUS_FILE), "w") as f:
            json.dump({"returncode": 1, "seconds": 1.0, "command": []}, f)
        return
    head_params = 0 if tied else (84 if tokenizer == "char" else 512) * D_MODEL
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(
            {
                "num_params": vocab["params"] + head_params,
                "num_head_params": head_params,
                "final": final_metrics(tokenizer, tied, seed),
                "tokens_per_sec": TOKENS_PER_SEC[seed],
                "steps": 20,
                "wall_seconds": 3.0,
            },
            f,
        )


def write_sweep(root):
    """Writes the runs of the grid and its ``sweep.json`` into ``root``; returns it."""
    grid = [
        overrides(t, tied, seed)
        for seed in range(3)
        for t in VOCABULARIES
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
