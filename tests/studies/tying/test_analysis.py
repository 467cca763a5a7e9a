"""Tests for studies/tying/analysis.py and its sections (answer.py,
design_text.py, tuning_text.py, report_text.py; and cells.py, contrast_plots.py):
the report of synthetic runs.csv rows with known effects, every number
checked against numpy/scipy (and statsmodels where installed) on the rows
themselves; Holm's adjustment by hand; the report regenerated from a CSV
written and read back; the plots written."""

import math
import re

import numpy as np
import pytest
from scipy import stats

from studies.tying import (
    analysis,
    answer,
    cells,
    design_text,
    tuning_text,
)
from tests.studies.tying import synthetic_rows
from tests.studies.tying.synthetic_rows import holm_by_hand, select

TOLERANCE = 6e-5  # the report prints 4 decimals


def section(text, heading):
    """The text from the line starting with ``heading`` to the next ``## ``."""
    start = text.index("\n" + heading) + 1
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def tables(text):
    """Every markdown table of ``text``: a list of rows, each a dict."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            header = [c.strip() for c in line.strip("|").split("|")]
            body = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                body.append(
                    dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))
                )
            found.append(body)
    return found


def numbers(cell):
    """The numbers of a table cell, in order (``<0.0001`` reads as 0)."""
    return [float(x.replace(",", "")) for x in re.findall(r"[-+]?[\d,]*\.?\d+", cell)]


def finished(rows, **where):
    return [r for r in select(rows, **where) if r["status"] == "finished"]


def by_seed(rows, **where):
    return {r["seed"]: r["test_bpc"] for r in finished(rows, **where)}


def paired(rows, vocab, amount, x, y, role="test"):
    xs = by_seed(rows, role=role, vocab=vocab, amount=amount, arm=x)
    ys = by_seed(rows, role=role, vocab=vocab, amount=amount, arm=y)
    seeds = sorted(set(xs) & set(ys))
    return (
        np.array([xs[s] - ys[s] for s in seeds]),
        [xs[s] for s in seeds],
        [ys[s] for s in seeds],
    )


def assert_close(got, want):
    assert got == pytest.approx(want, abs=TOLERANCE)


def check_interval(text, d):
    """``+mean [low, high]``: the 95% t-interval of the differences ``d``."""
    mean, low, high = numbers(text)
    want_low, want_high = stats.t.interval(
        0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d)
    )
    assert_close(mean, d.mean())
    assert_close(low, want_low)
    assert_close(high, want_high)


def check_p(text, p):
    if p < 1e-4:
        assert text == "<0.0001"
    else:
        assert_close(float(text), p)


def cell_of(line):
    vocab = "char" if line["vocabulary"] == "characters" else line["vocabulary"][4:]
    return vocab, float(line["amount"].rstrip("%")) / 100


def edge_arms(rows, vocab, amount):
    """The cell's arms whose chosen rate (synthetic_rows.BEST_LR_INDEX) is the
    lowest or highest of two or more rates their tuning runs tried."""
    arms = set()
    for arm, index in synthetic_rows.BEST_LR_INDEX.items():
        tune = finished(rows, role="tune", vocab=vocab, amount=amount, arm=arm)
        tried = sorted({r["lr"] for r in tune})
        chosen = synthetic_rows.LR_GRID[index]
        if len(tried) > 1 and chosen in (tried[0], tried[-1]):
            arms.add(arm)
    return arms


class TestResults:
    def test_each_arm_of_each_cell_against_numpy(self, rows, reported):
        (lines,) = tables(section(reported[0], "## Results by cell"))
        expected = {
            (v, a, arm)
            for v, arm in synthetic_rows.SHAPES
            for a in synthetic_rows.AMOUNTS
        }
        assert {(*cell_of(line), line["arm"]) for line in lines} == expected
        for line in lines:
            vocab, amount = cell_of(line)
            runs = finished(
                rows, role="test", vocab=vocab, amount=amount, arm=line["arm"]
            )
            bpc = np.array([r["test_bpc"] for r in runs])
            mean, std, n = numbers(line["test bits/char"])
            assert_close(mean, bpc.mean())
            assert_close(std, bpc.std(ddof=1))
            assert n == len(runs)
            for column, key in [
                ("val bits/char", "val_bpc"),
                ("held-out gap", "gap_bpc"),
            ]:
                assert_close(numbers(line[column])[0], np.mean([r[key] for r in runs]))
            assert numbers(line["steps to best"])[0] == pytest.approx(
                np.mean([r["steps_to_best"] for r in runs]), abs=0.5
            )
            per_param = np.mean([r["train_tokens"] / r["params"] for r in runs])
            assert line["data tokens/param"] == f"{per_param:.3g}"
            trained = [
                r["steps_to_best"] * synthetic_rows.STEP_TOKENS / r["params"]
                for r in runs
            ]
            assert line["trained tokens/param"] == f"{np.mean(trained):.3g}"
            assert numbers(line["word ppl"])[0] == pytest.approx(
                stats.gmean([r["test_word_ppl"] for r in runs]), abs=0.005
            )
            capped = sum(r["reached_cap"] for r in runs)
            assert line["reached cap"] == f"{capped} of {len(runs)}"
            assert float(line["lr"]) == pytest.approx(
                synthetic_rows.LR_GRID[synthetic_rows.BEST_LR_INDEX[line["arm"]]],
                rel=1e-2,
            )

    def test_the_counts_again_without_runs_never_better_than_their_start(
        self, rows, reported
    ):
        primary = section(reported[0], "## Primary contrasts")
        assert "never better than their initial" not in primary
        # One b run per cell made useless: its test value far off.
        marked, seen = [], set()
        for r in rows:
            cell = (r["vocab"], r["amount"])
            if r["role"] == "test" and r["arm"] == "b" and r["status"] == "finished":
                if cell not in seen:
                    seen.add(cell)
                    r = dict(r, steps_to_best=0, test_bpc=r["test_bpc"] + 5.0)
            marked.append(r)
        text = analysis.primary_section(marked)
        without = [r for r in marked if r.get("steps_to_best") != 0]
        counts = answer.family_counts(cells.primary_family(without).contrasts)
        assert text.endswith(
            f"Without the {len(seen)} test runs never better than their initial "
            f"parameters (named under the results by cell): {counts}."
        )
        assert counts != answer.family_counts(cells.primary_family(marked).contrasts)

    def test_a_run_never_better_than_its_start_is_named(self, rows, reported):
        assert "best step 0" not in section(reported[0], "## Results by cell")
        first = next(
            r for r in rows if r["role"] == "test" and r["status"] == "finished"
        )
        text = analysis.results_section(
            [dict(r, steps_to_best=0) if r is first else r for r in rows]
        )
        assert (
            f"so tested untrained, and in their pairs as such: {first['run']}." in text
        )

    def test_the_failed_run_is_left_out_and_capped_runs_are_named(self, reported):
        (lines,) = tables(section(reported[0], "## Results by cell"))
        line = next(r for r in lines if cell_of(r) == ("2048", 1.0) and r["arm"] == "c")
        assert numbers(line["test bits/char"])[-1] == 7
        text = section(reported[0], "## Results by cell")
        assert "budget-limited" in text and "BPE 2048 at 100% c 7" in text


class TestPrimary:
    def test_contrasts_against_scipy_and_holm_by_hand(self, rows, reported):
        primary = section(reported[0], "## Primary contrasts")
        (lines,) = tables(primary)
        cells_ = [(v, a) for v in ("char", "2048") for a in synthetic_rows.AMOUNTS]
        assert [(cell_of(r), r["contrast"]) for r in lines] == [
            (c, label) for c in cells_ for label in ("b − a", "c − a")
        ]
        p_values = []
        for line in lines:
            x, y = line["contrast"][0], line["contrast"][-1]
            d, xs, ys = paired(rows, *cell_of(line), x, y)
            assert int(line["n"]) == len(d)
            check_interval(line["mean [95% t]"], d)
            p_values.append(stats.ttest_rel(xs, ys).pvalue)
            check_p(line["p"], p_values[-1])
            # Bonferroni over the family of 8.
            half = stats.t.ppf(1 - 0.025 / len(lines), len(d) - 1) * stats.sem(d)
            low, high = numbers(line["simultaneous 95%"])
            assert_close(low, d.mean() - half)
            assert_close(high, d.mean() + half)
        holm = holm_by_hand(np.array(p_values))
        for line, want in zip(lines, holm):
            check_p(line["Holm p"], want)
        try:
            from statsmodels.stats import multitest
        except ImportError:
            pass
        else:
            np.testing.assert_allclose(
                holm, multitest.multipletests(p_values, method="holm")[1]
            )

    def test_runs_at_their_step_cap_are_counted_in_each_pair(self, rows, reported):
        (lines,) = tables(section(reported[0], "## Primary contrasts"))
        for line in lines:
            x, y = line["contrast"][0], line["contrast"][-1]
            of = {
                arm: {r["seed"]: r for r in finished(rows, role="test", arm=arm,
                      vocab=cell_of(line)[0], amount=cell_of(line)[1])}
                for arm in (x, y)
            }  # fmt: skip
            shared = of[x].keys() & of[y].keys()
            capped = sum(bool(of[a][s]["reached_cap"]) for a in (x, y) for s in shared)
            assert line["at cap"] == f"{capped} of {2 * len(shared)}"
        assert any(not line["at cap"].startswith("0 ") for line in lines)

    def test_runs_best_at_their_first_validation_are_counted(self, rows):
        (lines,) = tables(analysis.primary_section(rows))
        for line in lines:
            vocab, amount = cell_of(line)
            arms = (line["contrast"][0], line["contrast"][-1])
            runs = [
                finished(rows, role="test", vocab=vocab, amount=amount, arm=arm)
                for arm in arms
            ]
            seeds = {r["seed"] for r in runs[0]} & {r["seed"] for r in runs[1]}
            first = sum(
                (vocab, amount, r["arm"]) == synthetic_rows.FIRST_EVAL
                for of in runs
                for r in of
                if r["seed"] in seeds
            )
            assert line["best at first validation"] == f"{first} of {2 * len(seeds)}"
        assert any(not line["best at first validation"].startswith("0 ")
                   for line in lines)  # fmt: skip

    def test_without_a_tuning_stage_no_edge_is_claimed(self, rows):
        untuned = [r for r in rows if r["role"] != "tune"]
        counts = answer.family_counts(cells.primary_family(untuned).contrasts)
        assert "edge" not in counts and "budget-limited" in counts
        (lines,) = tables(analysis.primary_section(untuned))
        assert {line["rate at edge"] for line in lines} == {"—"}

    def test_arms_at_the_edge_of_their_rates_are_named(self, rows):
        # Arm b's lowest rate left out: its chosen rate becomes the lowest tried.
        low = synthetic_rows.LR_GRID[0]
        trimmed = [
            r
            for r in rows
            if not (r["role"] == "tune" and r["arm"] == "b" and r["lr"] == low)
        ]
        for given in (rows, trimmed):
            (lines,) = tables(analysis.primary_section(given))
            for line in lines:
                at_edge = edge_arms(given, *cell_of(line))
                want = [a for a in (line["contrast"][0], line["contrast"][-1])
                        if a in at_edge]  # fmt: skip
                assert line["rate at edge"] == (", ".join(want) or "—")
        assert {line["rate at edge"] for line in lines} == {"a", "b, a"}

    def test_differences_by_subset_place_against_numpy(self, rows, reported):
        (lines,) = tables(section(reported[0], "## Primary contrasts"))
        for line in lines:
            x, y = line["contrast"][0], line["contrast"][-1]
            vocab, amount = cell_of(line)
            of = {
                arm: {r["seed"]: r for r in finished(rows, role="test", arm=arm,
                      vocab=vocab, amount=amount)}
                for arm in (x, y)
            }  # fmt: skip
            shared = sorted(of[x].keys() & of[y].keys())
            offsets = sorted({of[x][s]["offset"] for s in shared})
            if len(offsets) == 1:
                assert line["by place"] == "—"
                continue
            want, blocks = [], []
            for offset in offsets:
                d = [
                    of[x][s]["test_bpc"] - of[y][s]["test_bpc"]
                    for s in shared
                    if of[x][s]["offset"] == offset
                ]
                want.append(f"{offset:g}: {np.mean(d):+.4f} ({len(d)})")
                blocks.append(np.array(d))
            # Blocked: the mean of the places' means, t on the within spread.
            n, mean = sum(map(len, blocks)), np.mean([b.mean() for b in blocks])
            within = sum(((b - b.mean()) ** 2).sum() for b in blocks) / (n - 2)
            half = (
                stats.t.ppf(0.975, n - 2)
                * np.sqrt(within * sum(1 / len(b) for b in blocks))
                / 2
            )
            want.append(f"blocked {mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]")
            assert line["by place"] == "; ".join(want)
        assert any(line["by place"] != "—" for line in lines)

    def test_the_family_is_the_design_not_the_cells_measured_so_far(self, rows):
        """Without one cell's test runs, Holm and Bonferroni still correct
        for all 8 named contrasts (the missing two as untested)."""
        vocab, amount = synthetic_rows.ABLATION_CELL
        fewer = [
            r
            for r in rows
            if not (
                r["role"] == "test" and (r["vocab"], r["amount"]) == (vocab, amount)
            )
        ]
        family = cells.primary_family(fewer)
        assert family.size == 8 and len(family.contrasts) == 6
        p_values = [c.p for c in family.contrasts]
        want = holm_by_hand(np.array(p_values + [1.0, 1.0]))[:6]
        for c, p in zip(family.contrasts, want):
            assert c.holm_p == pytest.approx(p)
            half = stats.t.ppf(1 - 0.025 / 8, c.difference.n - 1) * (
                c.difference.std / math.sqrt(c.difference.n)
            )
            assert c.simultaneous == pytest.approx(
                (c.difference.mean - half, c.difference.mean + half)
            )

    def test_pooled_intervals_by_hand(self, rows, reported):
        primary = section(reported[0], "## Primary contrasts")
        (lines,) = tables(primary)
        for label in ("b − a", "c − a"):
            of = [r for r in lines if r["contrast"] == label]
            diffs = [paired(rows, *cell_of(r), label[0], "a")[0] for r in of]
            dof = sum(len(d) - 1 for d in diffs)
            pooled = math.sqrt(sum((len(d) - 1) * d.var(ddof=1) for d in diffs) / dof)
            own = [d.std(ddof=1) for d in diffs]
            distances = [np.abs(d - np.median(d)) for d in diffs]
            equal = stats.f_oneway(*distances).pvalue  # Brown-Forsythe
            equal_text = "< 0.0001" if equal < 1e-4 else f"= {equal:.4f}"
            assert (
                f"{label}: {pooled:.4f} ({dof} degrees of freedom; the cells' own "
                f"from {min(own):.4f} to {max(own):.4f}; one spread in every "
                f"cell: Brown-Forsythe p {equal_text})"
            ) in primary
            for line, d in zip(of, diffs):
                half = stats.t.ppf(0.975, dof) * pooled / math.sqrt(len(d))
                low, high = numbers(line["pooled 95%"])
                assert_close(low, d.mean() - half)
                assert_close(high, d.mean() + half)
        assert dof == 4 * 8 - 4 - 1  # c − a at BPE 2048, 100% lost its seed 7

    def test_the_known_effects_are_found_and_counted_beside_holm(self, reported):
        primary = section(reported[0], "## Primary contrasts")
        (lines,) = tables(primary)
        for line in lines:
            mean = numbers(line["mean [95% t]"])[0]
            effect = synthetic_rows.ARM_EFFECT[line["contrast"][0]]
            assert mean == pytest.approx(effect, abs=0.015)
        edges = 0
        for label, arm in (("b − a", "b"), ("c − a", "c")):
            found = [r for r in lines if r["contrast"] == label and _holm(r) < 0.05]
            means = [numbers(r["mean [95% t]"])[0] for r in found]
            lower, higher = sum(m < 0 for m in means), sum(m > 0 for m in means)
            capped = sum(not r["at cap"].startswith("0 ") for r in found)
            first = sum(
                not r["best at first validation"].startswith("0 ") for r in found
            )
            # Counted where the worse arm's rate is at its edge.
            edge = sum(
                (arm if m > 0 else "a") in r["rate at edge"].split(", ")
                for r, m in zip(found, means)
            )
            edges += edge
            assert (
                f"{label}: Holm-adjusted p < 0.05 in {lower + higher} of 4 cells "
                f"({arm} lower in {lower}, higher in {higher}; {capped} of them "
                f"with runs at their step cap, budget-limited; {first} with runs "
                f"best at their first validation; {edge} with the worse arm's "
                "rate at the edge of the rates tried)"
            ) in primary
        assert edges  # the synthetic arm a's rate is at the edge
        # "k of n" appears only in the corrected section.
        assert " of 4 cells" not in reported[0].replace(primary, "").replace(
            section(reported[0], "Over 4 cells"), ""
        )


def _holm(line):
    return 0.0 if line["Holm p"] == "<0.0001" else float(line["Holm p"])


class TestExploratory:
    def test_secondary_contrasts_unadjusted_against_scipy(self, rows, reported):
        secondary = section(reported[0], "## Secondary contrasts (exploratory)")
        assert "Holm" not in secondary and "Unadjusted" in secondary
        (lines,) = tables(secondary)
        want = [
            (cell, label)
            for cell in [
                (v, a) for v in ("char", "2048") for a in synthetic_rows.AMOUNTS
            ]
            for label in ("d − a", "e − b", "e − a")
            if cell[0] == "2048" or label != "d − a"
        ]
        assert [(cell_of(r), r["contrast"]) for r in lines] == want
        for line in lines:
            d, xs, ys = paired(
                rows, *cell_of(line), line["contrast"][0], line["contrast"][-1]
            )
            check_interval(line["mean [95% t]"], d)
            check_p(line["p"], stats.ttest_rel(xs, ys).pvalue)

    def test_the_ablation_against_numpy(self, rows, reported):
        ablation = section(reported[0], "## Table learning-rate ablation (exploratory)")
        groups, contrasts = tables(ablation)
        vocab, amount = synthetic_rows.ABLATION_CELL
        assert [(r["arm"], float(r["multiplier"])) for r in groups] == [
            (arm, m) for arm in "ab" for m in synthetic_rows.MULTIPLIERS
        ]
        for line in groups:
            runs = finished(rows, role="ablation", arm=line["arm"],
                            table_lr_multiplier=float(line["multiplier"]))  # fmt: skip
            bpc = np.array([r["test_bpc"] for r in runs])
            mean, std, n = numbers(line["test bits/char"])
            assert (n, mean) == (len(bpc), pytest.approx(bpc.mean(), abs=TOLERANCE))
            assert_close(std, bpc.std(ddof=1))

        def ablation_seeds(arm, m):
            return {
                r["seed"]: r["test_bpc"]
                for r in finished(rows, role="ablation", arm=arm, table_lr_multiplier=m)
            }

        for line in contrasts:
            label = line["ablation contrast"]
            if label.endswith("b − a"):
                m = float(re.search(r"m = (\d+)", label).group(1))
                x, y = ablation_seeds("b", m), ablation_seeds("a", m)
            else:
                arm, m = re.search(r", (\w): m = (\d+)", label).groups()
                x, y = ablation_seeds(arm, float(m)), ablation_seeds(arm, 1.0)
            d = np.array([x[s] - y[s] for s in sorted(x)])
            check_interval(line["mean [95% t]"], d)
            check_p(line["p"], stats.ttest_1samp(d, 0.0).pvalue)
        assert len(contrasts) == 2 * 2 + 3

    def test_multiplier_1_is_borrowed_from_the_test_runs(self, rows):
        without = [
            r
            for r in rows
            if not (r["role"] == "ablation" and r["table_lr_multiplier"] == 1.0)
        ]
        ablation = analysis.ablation_section(without)
        assert (
            "Multiplier 1 is the cell's test runs (BPE 2048 at 1% a, BPE 2048 at 1% b)"
            in ablation
        )
        groups, _ = tables(ablation)
        assert numbers(groups[0]["test bits/char"])[-1] == len(
            synthetic_rows.TEST_SEEDS
        )


class TestDesignAndTuning:
    def test_the_design_as_the_rows_show_it(self, rows, reported):
        design = section(reported[0], "## Design")
        arms, amounts = tables(design)
        assert [(r["vocabulary"], r["arm"][0]) for r in arms] == [
            ("characters" if v == "char" else f"BPE {v}", arm)
            for v, arm in synthetic_rows.SHAPES
        ]
        untied = next(
            r for r in arms if r["vocabulary"] == "BPE 2048" and r["arm"][0] == "b"
        )
        assert (untied["params"], untied["FLOPs/token"], untied["head share"]) == (
            "1,312,144", "6,488,064", f"{2048 * 128 / 1_312_144:.1%}"
        )  # fmt: skip
        # Arm e's untie step, two thirds of each amount's step cap here.
        amounts_of_e = sorted(
            {r["amount"] for r in finished(rows, role="test", arm="e")}
        )
        assert len(amounts_of_e) > 1
        assert next(r for r in arms if r["arm"][0] == "e")["untie step"] == ", ".join(
            f"{round(2 / 3 * synthetic_rows.STEPS_CAP[amount]):,} at {amount:.0%}"
            for amount in amounts_of_e
        )
        assert [r["amount"] for r in amounts] == ["1%", "100%"]
        assert amounts[0]["offsets"] == "0, 0.5" and amounts[1]["offsets"] == "0"
        assert (
            amounts[0]["test seeds"] == "0..7"
            and amounts[0]["tuning seeds"] == "100, 101"
        )
        assert "No arm d at characters" in design

    def test_runs_at_their_step_cap_counted_by_amount(self, rows, reported):
        done = [r for r in rows if r["status"] == "finished"]
        counts = {
            a: (sum(r["reached_cap"] for r in done if r["amount"] == a),
                sum(r["amount"] == a for r in done))
            for a in (0.01, 1.0)
        }  # fmt: skip
        (said,) = [
            line for line in section(reported[0], "## Design").split("\n\n")
            if line.startswith("Runs that reached their step cap")
        ]  # fmt: skip
        want = [
            f"{label} {k} of {n} ({k / n:.0%})"
            for label, (k, n) in zip(("1%", "100%"), counts.values())
        ]
        assert ", ".join(want) in said
        over = counts[0.01][0] > 0.1 * counts[0.01][1]
        assert ("1% is over that bound" in said) == over
        assert ("none is over it" in said) == (not over)
        # Every run of the subset amount at its cap: over the 10% bound.
        capped = [
            {**r, "reached_cap": True} if r["amount"] == 0.01 else r for r in rows
        ]
        assert "1% is over that bound" in design_text.cap_counts(capped)

    def test_an_arm_that_takes_arm_as_rate_is_not_called_off_its_best(self, rows):
        untuned = [r for r in rows if not (r["role"] == "tune" and r["arm"] == "d")]
        (lines,) = tables(tuning_text.tuning_section(untuned))
        d_lines = [line for line in lines if line["arm"] == "d"]
        assert d_lines and all(
            line["chosen lr"].endswith(" (not tuned: arm a's)")
            and line["mean tuning val loss by rate"] == "—"
            for line in d_lines
        )

    def test_the_chosen_rates_and_mean_tuning_losses(self, rows, reported):
        (lines,) = tables(section(reported[0], "## Learning rates"))
        for line in lines:
            vocab, amount = cell_of(line)
            arm = line["arm"]
            index = synthetic_rows.BEST_LR_INDEX[arm]
            chosen = synthetic_rows.LR_GRID[index]
            edge = index in (0, len(synthetic_rows.LR_GRID) - 1)
            assert line["chosen lr"] == f"{chosen:.3g}" + (
                " (edge of the rates tried)" if edge else ""
            )
            for lr in synthetic_rows.LR_GRID:
                losses = [
                    r["val_loss"]
                    for r in select(
                        rows, role="tune", vocab=vocab, amount=amount, arm=arm, lr=lr
                    )
                ]
                shown = f"{lr:.3g}: {np.mean(losses):.4f}"
                assert (f"**{shown}**" if lr == chosen else shown) in line[
                    "mean tuning val loss by rate"
                ]

    def test_the_margins_and_their_noise_by_hand(self, rows, reported):
        text = section(reported[0], "## Learning rates")
        (lines,) = tables(text)
        differences, margins = {}, {}
        for line in lines:
            vocab, amount = cell_of(line)
            arm = line["arm"]
            chosen = synthetic_rows.LR_GRID[synthetic_rows.BEST_LR_INDEX[arm]]
            runs = {
                lr: select(rows, role="tune", vocab=vocab, amount=amount, arm=arm,
                           lr=lr)
                for lr in synthetic_rows.LR_GRID
            }  # fmt: skip
            # The next rate by mean loss (what chose); the margin in bits/char.
            following = min(
                (lr for lr in runs if lr != chosen),
                key=lambda lr: np.mean([r["val_loss"] for r in runs[lr]]),
            )
            bits = {lr: {r["seed"]: r["val_bpc"] for r in runs[lr]} for lr in runs}
            d = np.array([bits[following][s] - bits[chosen][s] for s in bits[chosen]])
            differences.setdefault(line["vocabulary"], []).append(d)
            name = f"{line['vocabulary']} at {line['amount']} {arm}"
            margins[name] = (line["vocabulary"], d.mean())
            assert numbers(line["margin (next lr)"]) == pytest.approx(
                [d.mean(), following], abs=TOLERANCE
            )
        said = text[text.index("Selection noise") :]
        errors = {}
        for vocabulary, of in differences.items():  # pooled within a vocabulary
            dof = sum(len(d) - 1 for d in of)
            pooled = np.sqrt(sum(((d - d.mean()) ** 2).sum() for d in of) / dof)
            errors[vocabulary] = pooled / np.sqrt(2)
            assert (
                f"{vocabulary} {pooled:.4f} ({dof} degrees of freedom; a margin's "
                f"standard error {errors[vocabulary]:.4f})"
            ) in said
        assert len(errors) > 1
        below = [name for name, (v, m) in margins.items() if m < errors[v]]
        assert f"and {len(below)} below one" in said
        for name in below:
            assert name in said

    def test_a_near_tie_is_named(self, rows):
        arm = dict(role="tune", vocab="2048", amount=0.01, arm="b")
        chosen = synthetic_rows.LR_GRID[synthetic_rows.BEST_LR_INDEX["b"]]
        at_chosen = {r["seed"]: r for r in select(rows, **arm, lr=chosen)}
        # Every other rate of the arm just behind the chosen one, seed by seed.
        tied = [
            r | {k: at_chosen[r["seed"]][k] + 1e-4 for k in ("val_loss", "val_bpc")}
            if r in select(rows, **arm) and r["lr"] != chosen else r
            for r in rows
        ]  # fmt: skip
        said = tuning_text.selection_noise_text(
            cells.selection_noise(cells.tunings(tied))
        )
        assert "and 1 below one: BPE 2048 at 1% b. The tuning cannot tell" in said

    def test_steps_at_the_cap_over_the_bound_in_two_amounts(self, rows):
        capped = [r | {"reached_cap": r["status"] == "finished"} for r in rows]
        said = design_text.cap_counts(capped)
        assert "1%" in said and "are over that bound, so their numbers" not in said
        two = capped + [r | {"amount": 0.03} for r in capped if r["amount"] == 0.01]
        said = design_text.cap_counts(two)
        assert "1%, 3% are over that bound, so their numbers are partly" in said
        assert design_text.cap_counts([]) == (
            "No run has finished yet, so none has reached its step cap."
        )


class TestTotalsAndAnswer:
    def test_measured_totals(self, rows, reported):
        totals = section(reported[0], "## Measured totals")
        wall = sum(r["wall_seconds"] for r in rows)
        assert f"{wall:,.0f} s = {wall / 3600:.2f} h" in totals
        assert f"{sum(r['steps_run'] for r in rows):,} training steps" in totals
        assert f"{len(rows)} runs (tune 108, test 144, ablation 24; failed 1," in totals

    def test_an_ensemble_program_counts_once(self, rows):
        program = [
            dict(r, ensemble="p", wall_seconds=100.0 + i)
            for i, r in enumerate(rows[:3])
        ]
        totals = cells.measured_totals(program + rows[3:])
        assert totals.programs == 1
        assert totals.wall_seconds == pytest.approx(
            102.0 + sum(r["wall_seconds"] for r in rows[3:])
        )

    def test_the_answer_of_one_cell(self, rows):
        vocab, amount = synthetic_rows.ABLATION_CELL
        one_cell = [r for r in rows if (r["vocab"], r["amount"]) == (vocab, amount)]
        text = answer.answer(one_cell)
        sentence, table_text, note = text.split("\n\n")
        assert "family of 2 primary contrasts" in note
        (lines,) = tables(table_text)
        assert [r["arm or contrast"] for r in lines] == [
            "a (tied)", "b (untied)", "c (untied, a's parameters)", "b − a", "c − a"
        ]  # fmt: skip
        p_values, diffs = [], {}
        for x in "bc":
            diffs[x], xs, ys = paired(rows, vocab, amount, x, "a")
            p_values.append(stats.ttest_rel(xs, ys).pvalue)
        holm = holm_by_hand(np.array(p_values))  # a family of 2 here
        checked_edges = 0
        for line, x, p in zip(lines[3:], "bc", holm):
            d = diffs[x]
            half = stats.t.ppf(1 - 0.025 / 2, len(d) - 1) * stats.sem(d)
            mean, low, high = numbers(
                line["test bits/char (n), or difference [simultaneous 95%]"]
            )
            assert_close(mean, d.mean())
            assert_close(low, d.mean() - half)
            assert_close(high, d.mean() + half)
            check_p(line["Holm p"], p)
            of = [finished(one_cell, role="test", arm=arm) for arm in (x, "a")]
            seeds = {r["seed"] for r in of[0]} & {r["seed"] for r in of[1]}
            capped = sum(r["reached_cap"] and r["seed"] in seeds for r in of[0] + of[1])
            # The arms whose edge could change the verdict: the worse one of a
            # difference found, both of one not found.
            worse = ("a" if d.mean() < 0 else x) if p < 0.05 else None
            edge = [
                a
                for a in (x, "a")
                if a in edge_arms(one_cell, vocab, amount) and worse in (None, a)
            ]
            first = sum(
                r["steps_to_best"] == r["eval_every"] and r["seed"] in seeds
                for r in of[0] + of[1]
            )
            notes = []
            if capped:
                notes.append(f"budget-limited: {capped} run{'s' * (capped != 1)} "
                             "at the step cap")  # fmt: skip
            if first:
                notes.append(f"{first} run{'s' * (first != 1)} best at the first "
                             "validation")  # fmt: skip
            if edge:
                whose = " and ".join(f"{a}'s" for a in edge)
                notes.append(f"{whose} rate{'s' * (len(edge) > 1)} at the edge "
                             "of the rates tried")  # fmt: skip
            assert line["what it means"] == (
                f"{x} better than a" if p < 0.05 and d.mean() < 0
                else f"a better than {x}" if p < 0.05
                else f"{x} and a not told apart at {len(d)} seeds"
            ) + (f" ({'; '.join(notes)})" if notes else "")  # fmt: skip
            checked_edges += bool(edge)
        assert checked_edges  # the synthetic cell has an arm at the edge
        bpc = [r["test_bpc"] for r in finished(one_cell, role="test", arm="a")]
        assert numbers(
            lines[0]["test bits/char (n), or difference [simultaneous 95%]"]
        )[0] == (pytest.approx(np.mean(bpc), abs=TOLERANCE))
        assert sentence.startswith("At BPE 2048 at 1%, over 8 seeds, untying the head")
        assert sentence.count("Holm-adjusted p") == 2 and "\n" not in sentence

    def test_the_answer_of_the_whole_study_counts_cells(self, reported):
        opening = section(reported[0], "Over 4 cells")
        assert "b − a: Holm-adjusted p < 0.05 in" in opening.splitlines()[0]
        assert tables(opening)[0][0]["cell"] == "characters at 1%"

    def test_nothing_to_pair_yet(self, rows, tmp_path):
        tuning_only = [r for r in rows if r["role"] == "tune"]
        text, plots = analysis.write_report(tuning_only, str(tmp_path))
        assert "No cell has paired test runs" in text
        assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in plots)


class TestFiles:
    def test_the_plots_are_written_and_linked(self, reported):
        text, plots, out = reported
        assert [p.rsplit("/", 1)[1] for p in plots] == [
            "contrast_vs_amount.png", "contrast_vs_head_share.png"
        ]  # fmt: skip
        for path in plots:
            data = open(path, "rb").read()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
            name = path.rsplit("/", 1)[1]
            assert f"![{name}]({name})" in text
        assert (out / "REPORT.md").read_text() == text

    def test_contrasts_at_the_step_cap_are_hollow_and_not_joined(
        self, rows, tmp_path, monkeypatch
    ):
        import matplotlib.figure

        from studies.tying import contrast_plots

        saved = []
        monkeypatch.setattr(
            matplotlib.figure.Figure,
            "savefig",
            lambda figure, *a, **k: saved.append(figure),
        )
        family = cells.primary_family(rows)
        contrast_plots.plot_contrasts(family, str(tmp_path))
        axes = saved[0].axes  # the amount plot: b − a, then c − a
        for axis, label in zip(axes, ("b − a", "c − a")):
            hollow = set()
            for line in axis.lines:
                if line.get_marker() != "o":
                    continue
                if line.get_markerfacecolor() == "none":
                    assert line.get_linestyle() == "None"
                    hollow |= set(line.get_xdata())
            capped = [c for c in family.contrasts if c.label == label and c.capped]
            # Shifted side by side by at most 5%: compare amounts loosely.
            near = lambda x, pool: any(abs(x / p - 1) < 0.06 for p in pool)  # noqa: E731
            assert all(near(c.amount, hollow) for c in capped)
            assert all(near(x, [c.amount for c in capped]) for x in hollow)
        assert any(c.capped for c in family.contrasts)

    def test_the_literature_hook(self, rows, tmp_path):
        rows = [r for r in rows if r["amount"] == 1.0]  # a smaller report
        seen = []

        def literature(given):
            seen.append(len(given))
            return "## Against published results\n\nSome text."

        text, _ = analysis.write_report(rows, str(tmp_path), literature=literature)
        assert seen == [len(rows)]
        assert text.index("## Against published results") > text.index("## Primary")
        assert text.index("## Against published results") < text.index("## Measured")
        text, _ = analysis.write_report(rows, str(tmp_path), literature="## Lit\n\nx")
        assert "## Lit\n\nx" in text

    def test_bad_rows_are_refused(self, rows, tmp_path):
        with pytest.raises(ValueError, match="row 1 has unknown columns"):
            analysis.write_report([rows[0], {**rows[1], "extra": 1}], str(tmp_path))
        twice = [rows[-1], dict(rows[-1], run="copy")]
        with pytest.raises(
            ValueError, match=r"both test runs of \(.2048., 1.0, .e.\) at seed 7"
        ):
            analysis.write_report(twice, str(tmp_path))
