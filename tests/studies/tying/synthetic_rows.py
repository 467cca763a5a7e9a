"""Synthetic ``runs.csv`` rows of the tying study with known effects, for the
tests of ``table.py`` and ``analysis.py``: two vocabularies x two data
amounts, arms a..e (d at BPE 2048 only), 8 test seeds per cell, 2 tuning
seeds on a 3-rate grid, and a table learning-rate ablation at one cell.

Test bits/char = cell base + arm effect + a per-(cell, seed) effect shared
by every arm (which pairing removes) + a small per-run noise, all from a
numpy generator with a fixed seed. One run failed (no metrics).
"""

import numpy as np

from studies.tying import table

VOCAB_SIZES = {"char": 84, "2048": 2048}
AMOUNTS = (0.01, 1.0)
TEST_SEEDS = tuple(range(8))
TUNING_SEEDS = (100, 101)
LR_GRID = (0.001 / 2**0.5, 0.001, 0.001 * 2**0.5)
# The tuning losses are lowest at this grid index, per arm.
BEST_LR_INDEX = {"a": 2, "b": 1, "c": 1, "d": 2, "e": 0}
BASE_BPC = {
    ("char", 0.01): 2.40,
    ("char", 1.0): 1.90,
    ("2048", 0.01): 2.60,
    ("2048", 1.0): 2.00,
}
ARM_EFFECT = {"a": 0.0, "b": -0.03, "c": 0.02, "d": -0.01, "e": -0.02}
SEED_SD, RUN_SD = 0.05, 0.01
MULTIPLIERS = (1.0, 3.0, 10.0)
MULTIPLIER_EFFECT = {1.0: 0.0, 3.0: -0.01, 10.0: 0.04}
ABLATION_CELL = ("2048", 0.01)
ABLATION_SEEDS = (0, 1, 2, 3)
# (d_model, num_layers, mlp_dim, params, flops_per_token) per (vocab, arm).
SHAPES = {
    ("char", "a"): (128, 4, 512, 800_000, 4_800_000),
    ("char", "b"): (128, 4, 512, 810_752, 4_800_000),
    ("char", "c"): (128, 4, 492, 800_100, 4_740_000),
    ("char", "e"): (128, 4, 512, 810_752, 4_800_000),
    ("2048", "a"): (128, 4, 512, 1_050_000, 6_488_064),
    ("2048", "b"): (128, 4, 512, 1_312_144, 6_488_064),
    ("2048", "c"): (128, 4, 300, 1_049_000, 5_400_000),
    ("2048", "d"): (128, 5, 512, 1_247_000, 7_700_000),
    ("2048", "e"): (128, 4, 512, 1_312_144, 6_488_064),
}
STEPS_CAP = {0.01: 5000, 1.0: 1000}
FAILED = ("test", "2048", 1.0, "c", 7)  # role, vocab, amount, arm, seed
EVAL_EVERY = 100
STEP_TOKENS = 2048  # batch 32 x block 64
# Runs of this (vocab, amount, arm) are best at their first validation.
FIRST_EVAL = ("char", 0.01, "c")


def arms_of(vocab):
    return [arm for v, arm in SHAPES if v == vocab]


def _row(rng, role, vocab, amount, arm, seed, lr, multiplier, bpc):
    d_model, num_layers, mlp_dim, params, flops = SHAPES[(vocab, arm)]
    vocab_size = VOCAB_SIZES[vocab]
    train_chars = int(4_000_000 * amount)
    train_tokens = train_chars if vocab == "char" else train_chars // 3
    steps_cap = STEPS_CAP[amount]
    reached = amount == 1.0 or (role == "test" and arm == "a" and seed == 0)
    steps_run = steps_cap if reached else int(rng.integers(800, 3000))
    val_bpc = bpc + 0.02 + RUN_SD * rng.normal()
    train_bpc = bpc - 0.1 - 0.2 * (amount < 1.0)
    heldout = train_bpc + 0.05 + (0.03 if arm in "bce" else 0.0)
    failed = (role, vocab, amount, arm, seed) == FAILED
    row = {
        "role": role,
        "vocab": vocab,
        "vocab_size": vocab_size,
        "amount": amount,
        "offset": 0.5 * (seed % 2) if amount < 1.0 else 0.0,
        "arm": arm,
        "seed": seed,
        "lr": lr,
        "table_lr_multiplier": multiplier,
        "untie_step": round(2 / 3 * steps_cap) if arm == "e" else None,
        "d_model": d_model,
        "num_layers": num_layers,
        "mlp_dim": mlp_dim,
        "params": params,
        "head_share": vocab_size * d_model / params,
        "flops_per_token": flops,
        "train_chars": train_chars,
        "train_tokens": train_tokens,
        "tokens_per_param": train_tokens / params,
        "steps_cap": steps_cap,
        "steps_run": steps_run,
        "steps_to_best": EVAL_EVERY
        if (vocab, amount, arm) == FIRST_EVAL
        else steps_run
        if reached
        else steps_run - 200,
        "eval_every": EVAL_EVERY,
        "step_tokens": STEP_TOKENS,
        "reached_cap": reached,
        "train_bpc": train_bpc,
        "val_bpc": val_bpc,
        "val_loss": val_bpc * np.log(2) * _chars_per_token(vocab),
        "heldout_bpc": heldout,
        "gap_bpc": heldout - train_bpc,
        "test_bpc": bpc,
        "test_word_ppl": float(2 ** (bpc * 5.5)),
        "test_words": 50_000,
        "test_chars": 275_000,
        "status": "finished",
        "wall_seconds": float(rng.uniform(100, 300)),
        "versions": "jax 0.0.0, flax 0.0.0, optax 0.0.0",
        "run": f"{role}_{vocab}_{amount}_{arm}_s{seed}_m{multiplier}_lr{lr:.3g}",
        "ensemble": None,
    }
    if failed:
        measured = [k for k in table.COLUMNS if k.endswith(("_bpc", "_ppl"))]
        row |= dict.fromkeys(measured + ["val_loss", "steps_to_best"], None)
        row["status"] = "failed"
    return row


def _chars_per_token(vocab):
    """Characters per token: nats per token are bits per character times
    this and ln 2."""
    return 1.0 if vocab == "char" else 3.0


def tuning_loss(arm, lr_index, seed, rng):
    """The mean validation loss over the tuning seeds is lowest at
    ``BEST_LR_INDEX[arm]``: 1 + 0.05 per grid step away, plus noise."""
    return 1.0 + 0.05 * abs(lr_index - BEST_LR_INDEX[arm]) + 0.005 * rng.normal()


def synthetic_rows(seed=0):
    """The rows, in a fixed order, from ``np.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    rows = []
    for (vocab, amount), base in BASE_BPC.items():
        seed_effect = {s: SEED_SD * rng.normal() for s in TEST_SEEDS}
        for arm in arms_of(vocab):
            for tuning_seed in TUNING_SEEDS:
                for index, lr in enumerate(LR_GRID):
                    row = _row(
                        rng, "tune", vocab, amount, arm, tuning_seed, lr, 1.0, 9.0
                    )
                    row["val_loss"] = tuning_loss(arm, index, tuning_seed, rng)
                    row["val_bpc"] = (
                        row["val_loss"] / np.log(2) / _chars_per_token(vocab)
                    )
                    rows.append(row)
            lr = LR_GRID[BEST_LR_INDEX[arm]]
            for s in TEST_SEEDS:
                bpc = base + ARM_EFFECT[arm] + seed_effect[s] + RUN_SD * rng.normal()
                rows.append(_row(rng, "test", vocab, amount, arm, s, lr, 1.0, bpc))
            if (vocab, amount) == ABLATION_CELL and arm in "ab":
                for m in MULTIPLIERS:
                    for s in ABLATION_SEEDS:
                        bpc = (
                            base
                            + ARM_EFFECT[arm]
                            + MULTIPLIER_EFFECT[m]
                            + seed_effect[s]
                            + RUN_SD * rng.normal()
                        )
                        rows.append(
                            _row(rng, "ablation", vocab, amount, arm, s, lr, m, bpc)
                        )
    return rows


def select(rows, **where):
    """The rows whose columns equal ``where``'s values."""
    return [r for r in rows if all(r[k] == v for k, v in where.items())]


def holm_by_hand(p_values):
    """Holm's step-down adjustment written out: the i-th smallest p times
    (m - i), made monotone, capped at 1."""
    m, order = len(p_values), np.argsort(p_values)
    adjusted, running = np.empty(m), 0.0
    for rank, index in enumerate(order):
        running = max(running, (m - rank) * p_values[index])
        adjusted[index] = min(running, 1.0)
    return adjusted
