"""Tests of the learning-rate profiles' report (studies/tying/
profiles.py): the bootstrap over tuning seeds against a hand computation,
the best rate's rules, and the report written from its runs.csv alone."""

import math
import os

import matplotlib.image
import numpy as np
import pytest

from studies.tying import profiles, table
from tests.studies.tying.committed import assert_regenerates

R1, R2, R3 = 0.001, 0.00141, 0.002


def profile(loss, bpc=None, seeds=(0, 1)):
    return profiles.Profile(
        vocab="512",
        amount=0.003,
        seeds=seeds,
        loss=loss,
        bpc=bpc or loss,
        eval_every=25,
        first_eval_bests=0,
        planned=0,
        finished=0,
    )


def test_the_bootstrap_against_a_hand_computation():
    """Two seeds, two rungs. Arm a ties its rungs on both seeds' mean (the
    lower rate wins) and b prefers R2; resampled, seed 0 twice sends a to R1
    and b to R2, seed 1 twice a to R2 and b to R1. The contrast is in bits
    per character (here half the loss), at the bests chosen on the loss."""
    loss = {
        "a": {R1: {0: 1.0, 1: 3.0}, R2: {0: 2.0, 1: 2.0}},
        "b": {R1: {0: 2.5, 1: 2.5}, R2: {0: 1.5, 1: 3.0}},
    }
    bpc = {arm: {lr: {s: v / 2 for s, v in c.items()} for lr, c in curve.items()}
           for arm, curve in loss.items()}  # fmt: skip
    found = profiles.bootstrap(profile(loss, bpc), "b")
    # All seeds: a at R1 (mean bpc 1.0), b at R2 (mean bpc 1.125).
    assert (found.best, found.reference_best) == (R2, R1)
    assert found.difference == pytest.approx(0.125)
    # The four ordered resamples, by hand:
    # (0, 0): a R1 (bpc 0.5), b R2 (bpc 0.75): +0.25
    # (0, 1), (1, 0): as all seeds: +0.125
    # (1, 1): a R2 (bpc 1.0), b R1 (bpc 1.25): +0.25
    by_hand = [0.25, 0.125, 0.125, 0.25]
    assert found.resamples == 4
    low, high = np.percentile(by_hand, [2.5, 97.5])
    assert (found.low, found.high) == pytest.approx((low, high))
    assert (low, high) == pytest.approx((0.125, 0.25))
    assert found.picks == {"b": {R1: 0.25, R2: 0.75}, "a": {R1: 0.75, R2: 0.25}}


def test_the_best_rate_counts_a_diverged_run_as_worst_and_needs_every_seed():
    curve = {R1: {0: math.inf, 1: 1.0}, R2: {0: 2.0, 1: 2.0}, R3: {0: 1.0}}
    found = profile({"a": curve}, seeds=(0, 1))
    assert found.complete("a") == [R1, R2]
    assert profiles.best_rate(curve, (0, 1), found.complete("a")) == R2
    assert profiles.best_rate(curve, (1, 1), found.complete("a")) == R1
    diverged = {R1: {0: math.inf, 1: math.inf}}
    assert profiles.best_rate(diverged, (0, 1), [R1]) is None
    assert math.isnan(profiles.contrast(profile({"a": curve, "b": diverged}), "b",
                                        "a", (0, 1))[2])  # fmt: skip


def test_more_seeds_than_the_exact_bootstrap_draw_resamples():
    draws = profiles.resamples(tuple(range(7)))
    assert len(draws) == profiles.DRAWS and all(len(d) == 7 for d in draws)
    assert draws == profiles.resamples(tuple(range(7)))  # seeded
    assert len(profiles.resamples((1, 2, 3))) == 27


def synthetic_rows():
    """Two cells, arms a, b and c on four rungs, three seeds; arm b's curve
    sits 0.01 below a's one rung higher; one run diverged, one unfinished."""
    rows = []
    rungs = [0.0005, 0.000707, 0.001, 0.00141]
    for vocab, amount, every in (("512", 0.003, 25), ("char", 1.0, 100)):
        for arm, shift, offset in (("a", 1, 0.0), ("b", 2, -0.01), ("c", 1, 0.02)):
            for k, lr in enumerate(rungs):
                for seed in (100, 101, 102):
                    loss = 2.0 + 0.05 * (k - shift) ** 2 + offset + 0.003 * (seed - 101)
                    row = dict.fromkeys(table.COLUMNS) | {
                        "role": "tune",
                        "vocab": vocab,
                        "amount": amount,
                        "arm": arm,
                        "seed": seed,
                        "lr": lr,
                        "status": "finished",
                        "val_loss": loss,
                        "val_bpc": loss / 1.5,
                        "eval_every": every,
                        "steps_to_best": every if k == 0 and seed == 100 else 4 * every,
                        "steps_cap": 12 * every,
                        "run": f"{vocab},{amount},{arm},{lr},{seed}",
                    }
                    rows.append(row)
    rows[0] |= {"val_loss": None, "val_bpc": None}  # diverged from the start
    rows[-1] |= {"status": "unfinished", "val_loss": None, "val_bpc": None}
    return rows


def test_the_report_is_written_from_its_csv_alone(tmp_path):
    rows = synthetic_rows()
    path = tmp_path / "runs.csv"
    table.write_rows(str(path), rows)
    first, second = tmp_path / "first", tmp_path / "second"
    text, plots = profiles.report_from_csv(str(path), str(first))
    again, plots_again = profiles.report_from_csv(str(path), str(second))
    assert text == again
    assert [os.path.basename(p) for p in plots] == [
        "profiles.png",
        "profile_512_0.003.png",
        "profile_char_1.png",
    ]
    # Both cells in one figure, two 6 x 4.2-inch panels a row at 120 dpi.
    assert matplotlib.image.imread(plots[0]).shape[:2] == (504, 1440)
    assert "![Every profiled cell's curves](profiles.png)" in text
    for plot, other in zip(plots, plots_again):
        assert open(plot, "rb").read() == open(other, "rb").read()
    assert (first / "REPORT.md").read_text() == text
    # b's best is a rung above a's; c's is a's; the contrasts are at them.
    assert "| BPE 512 on 0.3% of the text | b − a | 0.001 | 0.000707 |" in text
    assert "| BPE 512 on 0.3% of the text | c − a | 0.000707 | 0.000707 |" in text
    b_minus_a = -0.01 / 1.5
    assert f"{b_minus_a:+.4f}" in text and f"{0.02 / 1.5:+.4f}" in text
    assert "35 of 36 runs finished" in text and "36 of 36 runs finished" in text
    assert "3 runs best at their first evaluation" in text
    assert "Best evaluations at steps 25–100 (median 100) of 300." in text
    # The diverged run shows in the table; the unfinished rung has no mean.
    assert "inf /" in text
    assert "| 0.00141 |" in text and "- (" in text
    # A cell with no rung finished on every seed has no contrast yet.
    unfinished = [r | {"status": "running"} if r["seed"] == 102 else r for r in rows]
    text, _ = profiles.write_report(unfinished, str(tmp_path / "unfinished"))
    assert "| BPE 512 on 0.3% of the text | b − a | - | - | - | - |" in text
    assert "nan" not in text


def test_the_committed_profiles_report_is_what_its_csv_gives_today(tmp_path):
    """docs/tying_study/profiles: REPORT.md and its figures, byte for byte,
    from the runs.csv beside them."""
    plots = assert_regenerates("profiles", profiles.report_from_csv, tmp_path)
    assert plots[0] == profiles.ALL_PLOT and len(plots) == 5
