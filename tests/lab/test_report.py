"""Tests for lmhead/lab/report.py: the dispatch to a sweep file's own report,
and the sweeps it refuses (the pieces of a report are checked by their
doctests and by the study's tests)."""

import pytest

from lmhead.lab import report as report_lib
from lmhead.lab import workdirs


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


def test_a_sweep_without_a_report_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no sweep.json naming its sweep file"):
        report_lib.write_sweep_report(str(tmp_path))
    (tmp_path / "no_report.py").write_text("def get_sweep(arg=None):\n    pass\n")
    with pytest.raises(ValueError, match="no_report.py defines no write_report"):
        report_lib.write_sweep_report(str(tmp_path), spec=f"{tmp_path}/no_report.py")
