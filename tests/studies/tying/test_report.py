"""Tests for lmhead/studies/tying/report.py: the report of a synthetic study
directory (synthetic_study.py here, reported through experiments/report.py
in conftest.py) with known values per cell and seed, checked against numpy
and scipy's Student t."""

import json

import numpy as np

from lmhead.lab import workdirs
from lmhead.studies.tying import report as report_lib
from lmhead.studies.tying import results, shapes, study
from tests.lab.markdown import mean_std_text, table_rows
from tests.studies.tying.synthetic_study import (
    STUDY_CHARS_PER_TOKEN,
    STUDY_CHOSEN_LR,
    regime_section,
    study_seeds,
    study_values,
    t_interval_text,
)


def test_study_table_has_the_known_values(study_report):
    design, _, markdown, _ = study_report
    for regime in design.regimes:
        rows = table_rows(regime_section(markdown, regime.name), "vocabulary")
        cells = [c for c in design.cells() if c.regime == regime]
        assert len(rows) == len(cells) == 8
        for row, cell in zip(rows, cells):
            seeds = study_seeds(cell)
            values = np.array([study_values(cell, s) for s in seeds])
            assert row["arm"].startswith(f"{cell.arm}: ")
            assert row["lr"] == f"{STUDY_CHOSEN_LR[cell.arm]:g}"
            assert row["test bits/char"] == mean_std_text(values[:, 0], 4)
            assert row["val bits/char"] == mean_std_text(values[:, 1], 4)
            assert row["train − val bits/char"] == mean_std_text(
                values[:, 2] - values[:, 1], 4
            )
            assert row["n"] == str(len(seeds))
            assert row["not finished"] == str(3 - len(seeds))
            params = shapes.count_params(cell.vocab_size, cell.shape, design.arch)
            assert row["parameters"] == f"{params:,}"
            assert (
                row["head share"]
                == f"{cell.vocab_size * cell.shape.d_model / params:.1%}"
            )
            if regime.patience:
                steps = [10 * (s + 1) + "abcd".index(cell.arm) for s in seeds]
                assert row["steps to best"] == mean_std_text(steps, 0)
                assert (
                    row["stopped early"]
                    == f"{sum(s < 2 for s in seeds)} of {len(seeds)}"
                )
            else:
                assert "steps to best" not in row


def test_study_report_states_how_closely_the_arms_match(study_report):
    """The worst |c - a| / a and |d - b| / b over vocabularies, from the runs'
    own counts (here the design's: every run reports its count)."""
    design, _, markdown, _ = study_report
    for regime in design.regimes:
        counts = {
            (c.vocab, c.arm): shapes.count_params(c.vocab_size, c.shape, design.arch)
            for c in design.cells()
            if c.regime == regime
        }
        worst = {
            x: max(
                abs(counts[v, x] - counts[v, y]) / counts[v, y]
                for v in design.vocabularies
            )
            for x, y in (("c", "a"), ("d", "b"))
        }
        assert (
            f"Parameter counts (the runs' own, else the design's): c is within "
            f"{worst['c']:.2%} of a, d within {worst['d']:.2%} of b.\n\n"
        ) in regime_section(markdown, regime.name)


def test_match_text_reads_the_runs_counts_and_names_pairs_outside_the_tolerance():
    """The runs' num_params decide (the design solved 1,000 for every arm);
    c − a is off by 1.5% (inside 2%), d − b by 3% (outside)."""
    regime = study.Regime("limited", 0.03, 100, 3)

    def result(arm, num_params):
        cell = study.Cell(regime, 8192, arm, shapes.Shape(arm in "ad", 8, 1, 16), 6911)
        run = workdirs.Run("r", "r", {}, {}, [], {"num_params": num_params}, "finished")
        return results.CellResult(cell, 1e-3, {}, {0: run, 1: run}, 1000)

    text = report_lib.match_text(
        [result("a", 2000), result("b", 3000), result("c", 2030), result("d", 2910)]
    )
    assert text.splitlines() == [
        "Parameter counts (the runs' own, else the design's): c is within 1.50% of a, "
        "d within 3.00% of b.",
        "- BPE 8192: d has 2,910 parameters, b 3,000 (-3.0%), outside the design's 2%: "
        "the d − b comparison is not at matched size.",
    ]
    assert report_lib.match_text([result("a", 2000), result("b", 3000)]) == ""


def test_study_provenance_counts_the_runs_the_design_no_longer_plans(tmp_path):
    """Finished runs outside the plan are reported with their cost, apart from
    the totals; unfinished ones and files are not."""
    for name, summary in (
        ("planned", {"steps_run": 1000, "wall_seconds": 60.0}),
        ("old_shape", {"steps_run": 400, "wall_seconds": 1800.0}),
        ("old_rate", {"steps": 1000, "wall_seconds": 5400.0}),
        ("old_unfinished", None),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        if summary:
            (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    (tmp_path / workdirs.SWEEP_FILE).write_text("{}")
    planned = [workdirs.read_run(str(tmp_path / "planned"))]
    assert report_lib.other_runs_text(str(tmp_path), planned) == (
        "Not in the plan: 2 more finished runs in the sweep directory (shapes or "
        "rates the design no longer asks for), 1,400 training steps and 2.00 h of "
        "wall time, not counted above."
    )
    assert (
        report_lib.other_runs_text(
            str(tmp_path),
            [
                workdirs.read_run(str(tmp_path / n))
                for n in ("planned", "old_shape", "old_rate")
            ],
        )
        == ""
    )


def test_study_paired_differences_and_literature_numbers(study_report):
    design, _, markdown, _ = study_report
    for regime in design.regimes:
        section = regime_section(markdown, regime.name)
        differences = section.split("Paired by seed")[1]
        rows = {r["vocabulary"]: r for r in table_rows(differences, "vocabulary")}
        for vocab in design.vocabularies:
            cells = {
                c.arm: c
                for c in design.cells()
                if c.regime == regime and c.vocab == vocab
            }
            row = rows[study.vocabulary_label(vocab)]
            for label, x_arm, y_arm in (
                ("b − a", "b", "a"),
                ("c − a", "c", "a"),
                ("d − b", "d", "b"),
            ):
                seeds = sorted(
                    set(study_seeds(cells[x_arm])) & set(study_seeds(cells[y_arm]))
                )
                x = [study_values(cells[x_arm], s)[0] for s in seeds]
                y = [study_values(cells[y_arm], s)[0] for s in seeds]
                assert row[f"{label} [95% interval]"] == t_interval_text(x, y), (
                    regime.name,
                    vocab,
                    label,
                )
            train = [[study_values(cells[arm], s)[2] for s in range(3)] for arm in "ab"]
            assert row["training a − b [95% interval]"] == t_interval_text(*train)
            tied_minus_untied = np.mean(
                [
                    study_values(cells["a"], s)[0] - study_values(cells["b"], s)[0]
                    for s in range(3)
                ]
            )
            change = 2 ** (tied_minus_untied * STUDY_CHARS_PER_TOKEN[vocab]) - 1
            line = next(
                text
                for text in section.splitlines()
                if text.startswith(f"- {study.vocabulary_label(vocab)} (head")
            )
            assert f"test perplexity per token {change:+.2%} untied → tied" in line


def test_study_tuning_table_shows_every_rate_and_the_chosen_one(study_report):
    design, _, markdown, _ = study_report
    for regime in design.regimes:
        tuning = regime_section(markdown, regime.name).split("Learning-rate tuning")[1]
        rows = table_rows(tuning, "vocabulary")
        cells = [c for c in design.cells() if c.regime == regime]
        assert len(rows) == len(cells)
        for row, cell in zip(rows, cells):
            assert row["arm"].startswith(f"{cell.arm}: ")
            for lr in design.learning_rates:
                # The synthetic runs at the other rates report 99 bits/char.
                expected = (
                    f"**{study_values(cell, 0)[1]:.4f}**"
                    if lr == STUDY_CHOSEN_LR[cell.arm]
                    else "99.0000"
                )
                assert row[f"lr {lr:g}"] == expected, (regime.name, cell, lr)


def test_study_report_names_the_works_of_each_split_and_the_seeds(study_report):
    _, _, markdown, _ = study_report
    # lmhead/lm/data/corpus.py's split_works documents this split of the embedded corpus.
    assert (
        "- test: as_you_like_it, henry_iv_part_1, passionate_pilgrim, "
        "romeo_and_juliet, sonnets (10.1%)"
    ) in markdown
    assert (
        "- validation: comedy_of_errors, coriolanus, hamlet, macbeth (10.5%)"
        in markdown
    )
    training = next(
        line for line in markdown.splitlines() if line.startswith("- training: ")
    )
    assert training.startswith(
        "- training: the other 33 works (79.4%); regime "
        "`limited` trains on their first 50% ("
    )
    assert "over seeds 0, 1, 2 at each cell's learning rate" in markdown


def test_study_report_plots_and_measured_total(study_report):
    design, docs, markdown, stdout = study_report
    for name in ("delta_vs_head_share.png", "curves_fixed.png", "curves_limited.png"):
        assert (docs / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in markdown and f"Plot:   {docs / name}" in stdout
    finished = len(design.tuning_runs()) + len(design.cells()) * 2 - 1
    assert f"{finished} of " in markdown
    assert f"{finished * 36 / 3600:.2f} h of wall time" in markdown
    summaries = [
        json.loads(path.read_text())
        for path in (docs.parent / "runs").glob("*/summary.json")
    ]
    step_hours = sum(summary["steps_run"] * 18.0 for summary in summaries) / 3.6e6
    assert (
        f"median step time, summed over runs, {step_hours:.2f} h ({finished} runs timed"
    ) in markdown
    # The runner's intervals, counted second by second; the rest by wall_seconds.
    statuses = [
        json.loads(path.read_text())
        for path in (docs.parent / "runs").glob(f"*/{workdirs.STATUS_FILE}")
    ]
    covered = {
        second
        for status in statuses
        for second in range(status["started"], status["ended"])
    }
    busy = (len(covered) + 36 * (finished - len(statuses))) / 3600
    assert 0 < len(covered) < 36 * len(statuses)  # the overlaps are counted once
    assert (
        f"{busy:.2f} h of the machine's time with overlapping runs counted once "
        f"({len(statuses)} runs timed by the sweep runner"
    ) in markdown
    assert "Press & Wolf 2017, PTB small" in markdown and "(-1.8%)" in markdown
    predictions = table_rows(markdown.split("What they predict")[1], "source")
    assert [row["source"].split(" (")[0] for row in predictions] == [
        "Press & Wolf 2017; Inan et al. 2017",
        "MobileLLM",
        "Chung et al. 2021",
        "modded-nanogpt",
    ]
