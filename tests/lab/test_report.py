"""Tests for lmhead/lab/report.py: the generic report of a synthetic sweep
directory (tests/lab/synthetic_sweep.py) with known final metrics, its means
and stds checked against numpy and its paired intervals against scipy's
Student t; and the dispatch to a sweep file's own report."""

import numpy as np
import pytest
from scipy import stats

from lmhead.lab import report as report_lib
from lmhead.lab import workdirs
from tests.lab.markdown import mean_std_text, table_rows
from tests.lab.synthetic_sweep import (
    D_MODEL,
    FAILED,
    NOT_STARTED,
    TOKENS_PER_SEC,
    VOCABULARIES,
    final_metrics,
)


@pytest.fixture(scope="module")
def report(sweep_dir):
    """``(table, REPORT.md's text, plot paths)`` of the generic report."""
    table, path, plots = report_lib.write_sweep_report(str(sweep_dir))
    assert path == str(sweep_dir / "REPORT.md")
    with open(path, encoding="utf-8") as f:
        return table, f.read(), plots


def test_table_has_mean_and_std_over_seeds_per_setting(report):
    _, markdown, _ = report
    rows = {(r["head"], r["vocabulary"]): r for r in table_rows(markdown, "head")}
    assert len(rows) == 4
    for tokenizer, vocab in VOCABULARIES.items():
        for tied in (True, False):
            row = rows["tied" if tied else "untied", vocab["label"]]
            finals = [final_metrics(tokenizer, tied, s) for s in range(3)]
            for key, title, decimals in [
                ("loss", "val loss (nats/token)", 4),
                ("perplexity", "perplexity", 2),
                ("bits_per_char", "bits/char", 4),
                ("accuracy", "accuracy", 4),
                ("ece", "calibration error (ECE)", 4),
            ]:
                assert row[title] == mean_std_text(
                    [f[f"eval/{key}"] for f in finals], decimals
                ), (tokenizer, tied, key)
            assert row["tokens/s"] == mean_std_text(TOKENS_PER_SEC, 0)
            assert row["d_model"] == str(D_MODEL) and row["n"] == "3"
            head_params = 0 if tied else {"char": 84, "bpe": 512}[tokenizer] * D_MODEL
            assert row["parameters"] == f"{vocab['params'] + head_params:,}"
    assert rows["tied", "char (84)"]["not finished"] == "1"
    assert rows["untied", "bpe 512"]["not finished"] == "1"
    assert rows["untied", "char (84)"]["not finished"] == "0"


def test_paired_differences_and_sentences(report):
    _, markdown, _ = report
    rows = {r["vocabulary"]: r for r in table_rows(markdown, "vocabulary")}
    t = stats.t.ppf(0.975, 2)
    for tokenizer, vocab in VOCABULARIES.items():
        for key, column, short in (
            ("eval/loss", "val loss (nats/token)", "val loss"),
            ("eval/bits_per_char", "bits/char", "bits/char"),
        ):
            diffs = np.array(
                [
                    final_metrics(tokenizer, False, s)[key]
                    - final_metrics(tokenizer, True, s)[key]
                    for s in range(3)
                ]
            )
            mean, std = diffs.mean(), diffs.std(ddof=1)
            half = t * std / np.sqrt(3)
            row = rows[vocab["label"]]
            assert row[f"untied - tied, {column}"] == f"{mean:+.4f} ± {std:.4f}"
            assert (
                row[f"95% interval, {short}"]
                == f"[{mean - half:+.4f}, {mean + half:+.4f}]"
            )
        assert row["seed pairs"] == "3"
    assert "- char (84), d_model 32: untied - tied = +0.0367 nats/token" in markdown
    char_line = next(
        line for line in markdown.splitlines() if line.startswith("- char (84)")
    )
    bpe_line = next(
        line for line in markdown.splitlines() if line.startswith("- bpe 512")
    )
    assert char_line.endswith("not distinguishable from zero.")
    assert (
        "excludes zero: the untied head reaches the lower validation loss" in bpe_line
    )


def test_runs_that_did_not_finish_are_listed(report, sweep_dir):
    _, markdown, _ = report
    assert "2 of 14 runs are not in the means above" in markdown
    assert (
        f"- `{FAILED}`: failed, exit code 1, last evaluation at step 10, log "
        f"`{FAILED}/{workdirs.LOG_FILE}`"
    ) in markdown
    assert f"- `{NOT_STARTED}`: not started" in markdown


def test_plots_are_written_and_linked(report, sweep_dir):
    table, markdown, plots = report
    assert table.startswith("| head | vocabulary |") and table in markdown
    names = ("loss_curves.png", "loss_vs_vocab.png", "loss_vs_params.png")
    assert plots == [str(sweep_dir / name) for name in names]
    for name in names:
        path = sweep_dir / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000
        assert f"![{name}]({name})" in markdown


def test_a_sweep_file_with_its_own_report_writes_it(tmp_path):
    """write_sweep_report hands the sweep file's argument, the sweep directory
    and the output directory to the file's write_report."""
    (tmp_path / "own_report.py").write_text(
        "import os\n"
        "def write_report(arg, sweep_dir, out_dir):\n"
        "    os.makedirs(out_dir, exist_ok=True)\n"
        "    text = f'# {arg} of {os.path.basename(sweep_dir)}\\n'\n"
        "    with open(os.path.join(out_dir, 'REPORT.md'), 'w') as f:\n"
        "        f.write(text)\n"
        "    return text, []\n"
    )
    sweep_dir, out_dir = tmp_path / "sweep", tmp_path / "out"
    sweep_dir.mkdir()
    (sweep_dir / workdirs.SWEEP_FILE).write_text(
        f'{{"sweep": "{tmp_path}/own_report.py:small"}}'
    )
    text, path, plots = report_lib.write_sweep_report(str(sweep_dir), str(out_dir))
    assert (text, path, plots) == ("# small of sweep\n", str(out_dir / "REPORT.md"), [])
    text, path, _ = report_lib.write_sweep_report(
        str(sweep_dir), spec=f"{tmp_path}/own_report.py:other"
    )
    assert text == "# other of sweep\n" and path == str(sweep_dir / "REPORT.md")


def test_a_directory_without_runs_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="No runs in"):
        report_lib.write_sweep_report(str(tmp_path))
