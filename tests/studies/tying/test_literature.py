"""Tests for studies/tying/literature.py: synthetic runs.csv rows with
known paired differences (three cells, four seeds) read back as the section
"Against published results", checked against numpy and scipy computed here;
and the published data (literature.toml) read and internally consistent."""

import fnmatch
import importlib.resources
import math
import os
import tomllib

import numpy as np
import pytest
from scipy import stats as scipy_stats

from studies.tying import literature
from tests import ROOT
from tests.lab.markdown import table_rows
from tests.studies.tying.synthetic_rows import holm_by_hand

SEEDS = (0, 1, 2, 3)
JITTER = np.array([0.004, -0.003, 0.001, -0.002])  # per seed, so std > 0
# Test bits/char = a cell base + a per-seed effect every arm shares + the
# arm's effect (below) + the arm's jitter. Tied a better at characters 1%
# (b - a > 0), worse at 100% (< 0), about even at BPE 2048 1% (the b jitter
# there is large, so no interval excludes zero).
BASE = {("char", 0.01): 2.4, ("char", 1.0): 1.9, ("2048", 0.01): 2.6}
EFFECT = {
    ("char", 0.01): {"a": 0.0, "b": 0.05, "c": 0.03, "e": 0.02},
    ("char", 1.0): {"a": 0.0, "b": -0.04, "c": 0.01, "e": -0.03},
    ("2048", 0.01): {"a": 0.0, "b": 0.002, "c": 0.02, "d": -0.01, "e": 0.0},
}
NOISY = {("2048", 0.01, "b"): 10.0}  # that arm's jitter is multiplied
CHARS_PER_WORD = 5.5


def bpc(vocab, amount, arm, seed):
    jitter = JITTER[(seed + "abcde".index(arm)) % 4]
    scale = NOISY.get((vocab, amount, arm), 1.0)
    return (
        BASE[vocab, amount] + 0.1 * seed + EFFECT[vocab, amount][arm] + scale * jitter
    )


def row(role, vocab, amount, arm, seed, value):
    return {
        "run": f"{role} {vocab} {amount} {arm} {seed}",
        "status": "failed" if value is None else "finished",
        "table_lr_multiplier": None,
        "role": role,
        "vocab": vocab,
        "amount": amount,
        "arm": arm,
        "seed": seed,
        "lr": 0.001,
        "val_loss": None,
        "val_bpc": None,
        "test_bpc": value,
        "train_bpc": None if value is None else value - 0.5,
        "test_word_ppl": None if value is None else 2 ** (value * CHARS_PER_WORD),
        "test_chars": None if value is None else round(1000 * CHARS_PER_WORD),
        "test_words": None if value is None else 1000,
    }


@pytest.fixture(scope="module")
def rows():
    found = [
        row("test", vocab, amount, arm, s, bpc(vocab, amount, arm, s))
        for (vocab, amount), arms in EFFECT.items()
        for arm in arms
        for s in SEEDS
    ]
    # Never read: tuning and ablation runs, and a failed test run (its seed
    # drops out of its pairs).
    found.append(row("tune", "char", 0.01, "b", 100, 9.0))
    found.append(row("ablation", "char", 0.01, "a", 0, 9.0))
    found.append(row("test", "char", 1.0, "c", 4, None))
    return found


def reference(vocab, amount, x, y, shift=0.0, seeds=SEEDS):
    """numpy/scipy: mean, 95% t-interval and paired p of x - y over ``seeds``."""
    d = np.array([bpc(vocab, amount, x, s) - bpc(vocab, amount, y, s) for s in seeds])
    d = d + shift
    half = scipy_stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    p = scipy_stats.ttest_1samp(d, 0.0).pvalue
    return d.mean(), d.mean() - half, d.mean() + half, p


def primary_holm(cells=tuple(BASE)):
    """Holm over the study's primary family, b - a and c - a in every cell
    (the failed seed 4 of c at characters, 100% out of its pair):
    ``{(vocab, amount, arm): adjusted p}``."""
    keys = [(v, a, x) for v, a in cells for x in "bc"]
    p = [
        reference(v, a, x, "a", seeds=[s for s in SEEDS if (v, a, x, s) != FAILED])[3]
        for v, a, x in keys
    ]
    return dict(zip(keys, holm_by_hand(np.array(p))))


FAILED = ("char", 1.0, "c", 4)


def section(text, number):
    start = text.index(f"### {number}.")
    end = text.find("### ", start + 4)
    return text[start : end if end != -1 else None]


def test_compare_reads_finished_test_runs_only(rows):
    cells = {
        (c.vocab, c.amount): c for c in literature.compare(rows, "c", "a", "test_bpc")
    }
    assert set(cells) == set(EFFECT)
    assert cells["char", 1.0].difference.n == len(SEEDS)  # the failed seed 4 is out
    # The tuning and ablation rows (9.0 bits/char) are not read.
    assert cells["char", 0.01].difference.mean == pytest.approx(
        np.mean([bpc("char", 0.01, "c", s) - bpc("char", 0.01, "a", s) for s in SEEDS])
    )


def test_compare_refuses_repeated_runs(rows):
    repeated = dict(rows[0], run="another run")
    with pytest.raises(ValueError, match="both test runs of .* at seed 0"):
        literature.compare(rows + [repeated], "b", "a", "test_bpc")


def test_compare_matches_scipy_and_a_written_out_holm(rows):
    cells = literature.compare(rows, "b", "a", "test_bpc")
    assert [(c.vocab, c.amount) for c in cells] == [
        ("char", 0.01),
        ("char", 1.0),
        ("2048", 0.01),
    ]
    expected = [reference(c.vocab, c.amount, "b", "a") for c in cells]
    # A primary contrast: Holm over the study's family, as the report's.
    family = primary_holm()
    adjusted = [family[c.vocab, c.amount, "b"] for c in cells]
    for cell, (mean, low, high, p), holm_p in zip(cells, expected, adjusted):
        assert cell.difference.n == len(SEEDS)
        np.testing.assert_allclose(
            [cell.difference.mean, cell.difference.low, cell.difference.high],
            [mean, low, high],
            rtol=1e-9,
        )
        np.testing.assert_allclose([cell.p, cell.holm_p], [p, holm_p], rtol=1e-9)
    # The designed outcome: significant both ways, and one cell that is not.
    assert [literature.verdict(c, +1) for c in cells] == [
        "agrees",
        "disagrees",
        "cannot tell",
    ]
    assert [literature.verdict(c, 0) for c in cells] == [
        "disagrees",
        "disagrees",
        "cannot tell",
    ]
    # d exists at BPE 2048 only: d - b has that one cell, its Holm p unadjusted.
    (only,) = literature.compare(rows, "d", "b", "test_bpc")
    assert (only.vocab, only.amount, only.p) == ("2048", 0.01, only.holm_p)


def test_verdict_refuses_a_prediction_that_is_not_a_sign(rows):
    cell = literature.compare(rows, "b", "a", "test_bpc")[0]
    with pytest.raises(ValueError, match="predicted must be -1, 0 or 1"):
        literature.verdict(cell, 2)


def test_word_ppl_change_is_the_bpc_difference_on_the_word_scale(rows):
    """ln(P_a / P_b) = (bpc_a - bpc_b) * ln 2 * chars per word, seed by seed:
    the change and its interval are exp of a - b's, on that scale, minus 1."""
    change, low, high = literature.word_ppl_change(rows, "char", 0.01)
    mean, lo, hi, _ = reference("char", 0.01, "a", "b")
    scale = math.log(2) * CHARS_PER_WORD
    np.testing.assert_allclose(
        [change, low, high], np.expm1(np.array([mean, lo, hi]) * scale), rtol=1e-9
    )
    assert change < 0  # the tied arm is the better there
    assert all(math.isnan(v) for v in literature.word_ppl_change(rows, "8192", 1.0))


def test_section_tables_hold_the_hand_computed_numbers(rows):
    text = literature.literature_text(rows)
    first = table_rows(section(text, 1), "vocabulary")
    assert [(r["vocabulary"], r["amount"]) for r in first] == [
        ("characters", "1%"),
        ("characters", "100%"),
        ("BPE 2048", "1%"),
    ]
    expected = [reference(v, a, "b", "a") for v, a in BASE]
    adjusted = [primary_holm()[v, a, "b"] for v, a in BASE]
    scale = math.log(2) * CHARS_PER_WORD
    for line, (mean, low, high, _), holm_p in zip(first, expected, adjusted):
        assert line["pairs"] == "4"
        assert line["b - a [95%]"] == f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"
        assert line["p (Holm)"] == f"{holm_p:.3g}"
        ends = np.expm1(-np.array([mean, high, low]) * scale)
        assert line["per-word ppl b -> a [95%]"] == (
            f"{ends[0]:+.2%} [{ends[1]:+.2%}, {ends[2]:+.2%}]"
        )
    # Training bits/char are test bits/char - 0.5 here: a - b is -(b - a).
    train = table_rows(section(text, 2), "vocabulary")
    assert [r["a - b [95%]"] for r in train] == [
        f"{-m:+.4f} [{-h:+.4f}, {-lo:+.4f}]" for m, lo, h, _ in expected
    ]


def test_section_verdicts(rows):
    text = literature.literature_text(rows)
    tail = "of 3 (Holm over the study's 6 primary contrasts)."
    assert (
        "Verdict (b - a > 0 predicted): **differs by cell where it can tell (2 of "
        "3 cells)**; cells: agrees at 1 "
        f"(characters 1%), disagrees at 1 (characters 100%), cannot tell at 1, {tail}"
    ) in section(text, 1)
    # Chung et al.'s "about zero": any significant cell contradicts it.
    assert (
        "Verdict (b - a about 0 predicted): **disagrees where it can tell (2 of 3 "
        "cells)**; cells: agrees at 0"
    ) in (section(text, 3))
    assert "the table of point 1" in section(text, 3)
    # MobileLLM's sign is the other way round.
    assert (
        "Verdict (b - a < 0 predicted): **differs by cell where it can tell (2 of "
        "3 cells)**; cells: agrees at 1 "
        "(characters 100%), disagrees at 1 (characters 1%)"
    ) in section(text, 5)
    # Claims whose setting does not carry over are "cannot tell", with why.
    for number in (4, 6, 7):
        claim = literature.CLAIMS[number - 1]
        assert f"**cannot tell**: {claim.not_comparable}." in section(text, number)
    assert section(text, 7).count("**cannot tell**") == 2  # e - a and e - b
    # An exploratory contrast (training bits/char) only leans, corrected over
    # its own cells.
    assert (
        "Verdict (a - b < 0 predicted): **differs by cell where it can tell (2 "
        "of 3 cells)**; cells: leans toward "
        "at 1 (characters 1%), leans against at 1 (characters 100%), cannot tell "
        "at 1, of 3 (exploratory: Holm over these 3 cells only)."
    ) in section(text, 2)


def test_an_about_zero_claim_with_no_significant_cell_cannot_tell(rows):
    noisy = [r for r in rows if (r["vocab"], r["amount"]) == ("2048", 0.01)]
    text = section(literature.literature_text(noisy), 3)
    (cell,) = literature.compare(noisy, "b", "a", "test_bpc")
    width = cell.difference.high - cell.difference.low
    margin = math.log(114.5 / 112.4) / (math.log(2) * CHARS_PER_WORD)
    assert (
        f"**cannot tell**: no cell is shown inside ±{margin:.4f} bits/char, nor "
        f"outside it (95% intervals up to {width:.4f} wide); cells: agrees at 0, "
        "disagrees at 0, cannot tell at 1, of 1 (Holm over the study's 2 primary "
        "contrasts; equivalence: Holm over these 1 cell)."
    ) in text


def test_about_zero_agrees_where_two_one_sided_tests_put_it_inside_the_margin():
    """Two cells of b - a near zero, one with a small spread (shown inside
    the margin) and one with a wide one (not shown): the margin is
    ln(114.5 / 112.4) of per-word perplexity over ln 2 and the characters per
    word, and the TOST p is scipy's larger one-sided p, Holm over the cells."""
    small = [0.0004, -0.0003, 0.0001, -0.0002]
    wide = [0.008, -0.006, 0.004, -0.004]
    # Each cell's own characters per word (the median of its runs).
    per_word = {"char": 5.5, "2048": 4.0}
    found = [
        row("test", vocab, 0.01, arm, s, 2.0 + 0.1 * s + (arm == "b") * d[s])
        | {"test_chars": round(1000 * per_word[vocab])}
        for vocab, d in (("char", small), ("2048", wide))
        for arm in "ab"
        for s in SEEDS
    ]
    margins = [math.log(114.5 / 112.4) / (math.log(2) * per_word[v]) for v in per_word]
    raw = [
        max(
            scipy_stats.ttest_1samp(d, -margin, alternative="greater").pvalue,
            scipy_stats.ttest_1samp(d, margin, alternative="less").pvalue,
        )
        for d, margin in zip((small, wide), margins)
    ]
    holm = [min(1.0, 2 * min(raw)), min(1.0, max(raw))]  # two tests, Holm by hand
    assert raw[0] < raw[1]
    text = section(literature.literature_text(found), 3)
    lines = table_rows(text, "vocabulary")
    assert [r["margin (bits/char)"] for r in lines] == [f"±{m:.4f}" for m in margins]
    assert [r["TOST p"] for r in lines] == [f"{p:.3g}" for p in raw]
    assert [r["(Holm)"] for r in lines] == [f"{p:.3g}" for p in holm]
    assert holm[0] < 0.05 < holm[1]
    assert (
        "**agrees where it can tell (1 of 2 cells)**; cells: agrees at 1 "
        "(characters 1%), disagrees at 0, cannot tell at 1"
    ) in text


def test_no_rows_no_tables():
    text = literature.literature_text([])
    contrasts = sum(len(c.contrasts) for c in literature.CLAIMS)
    assert text.count("no cell has both arms with test runs yet") == contrasts
    assert text.count("### ") == len(literature.CLAIMS)
    assert "|" not in text


def test_published_pairs_are_consistent():
    for pair in literature.PTB_PAIRS:
        assert pair.change == pytest.approx(pair.tied / pair.untied - 1, abs=1e-15)
        assert pair.change < 0  # every published pair favours tying on test
        assert pair.where in literature.CLAIMS[0].source
        assert f"{pair.untied} -> {pair.tied} ({pair.change:+.1%})" in (
            literature.CLAIMS[0].published
        )
    # The changes as published, rounded to a tenth of a percent.
    assert [round(100 * p.change, 1) for p in literature.PTB_PAIRS] == [
        -1.8,
        -5.2,
        -2.5,
        -4.9,
        -5.0,
    ]
    small, large = literature.PTB_PAIRS[:2]
    assert small.train_tied < small.train_untied  # no dropout: lower too
    assert large.train_tied > large.train_untied  # dropout: higher
    for p in (small, large):
        assert f"{p.train_untied} -> {p.train_tied}" in literature.CLAIMS[1].published
    assert all(p.train_untied is None for p in literature.PTB_PAIRS[2:])


def test_published_claims_are_consistent():
    for claim in literature.CLAIMS:
        assert claim.contrasts
        for x, y, column, predicted in claim.contrasts:
            assert {x, y} <= set("abcde") and x != y
            assert column in literature.COLUMN_NAMES and predicted in (-1, 0, 1)
    chung_same, chung_reinvested = literature.CLAIMS[2:4]
    assert "62.3" in chung_same.published and "62.7" in chung_same.published
    assert f"(+{66.2 - 62.3:.1f})" in chung_reinvested.published
    assert "(+3.9)" in chung_reinvested.published
    retie, untie = literature.CLAIMS[5:7]
    # modded-nanogpt: 1995 + 40 steps tied against 2050 + 40 untied; the
    # untie step is ceil(2/3 * 1880) of 1880 + 40.
    assert f"{1995 + 40} steps" in retie.published
    assert f"{2050 + 40}-step" in retie.published
    assert f"{(2050 + 40) - (1995 + 40)} steps sooner" in retie.published
    assert f"step {math.ceil(2 / 3 * 1880)} of {1880 + 40}" in untie.published


def test_the_data_file_is_read_as_published():
    """The claims come from literature.toml: a PTB claim's numbers and
    source from the pairs, every other claim's text as the file has it."""
    text = (
        importlib.resources.files("studies.tying")
        .joinpath(literature.DATA_FILE)
        .read_text("utf-8")
    )
    assert literature.load(text) == (literature.PTB_PAIRS, literature.CLAIMS)
    data = tomllib.loads(text)
    for claim, found in zip(data["claims"], literature.CLAIMS):
        for key in ("published", "source", "not_comparable"):
            assert claim.get(key, getattr(found, key)) == getattr(found, key)
    assert literature.CLAIMS[0].setting.endswith(literature.PER_WORD)
    bad = text.replace('ptb = "train"', 'ptb = "validation"')
    with pytest.raises(ValueError, match="ptb must be 'test' or 'train'"):
        literature.load(bad)


def test_the_data_files_ship_with_the_package():
    """studies/pyproject.toml's package data names the data files (the
    published results and the report's prose), so an installed copy (not
    only this checkout) has them beside the modules that read them."""
    with open(os.path.join(ROOT, "studies", "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    package = literature.__name__.rpartition(".")[0]
    for name in (literature.DATA_FILE, "prose.toml"):
        assert any(fnmatch.fnmatch(name, p) for p in package_data[package]), name
