"""The committed reports under docs/tying_study are what their report
functions write today from the committed tables alone."""

import os

from tests import ROOT


def assert_regenerates(name, report_from_csv, tmp_path):
    """``report_from_csv(docs/tying_study/<name>/runs.csv, tmp_path)`` gives
    that folder's REPORT.md and each figure it writes, byte for byte; returns
    the figures' file names."""
    folder = os.path.join(ROOT, "docs", "tying_study", name)
    text, plots = report_from_csv(os.path.join(folder, "runs.csv"), str(tmp_path))
    with open(os.path.join(folder, "REPORT.md"), encoding="utf-8") as f:
        assert text == f.read()
    for plot in plots:
        with open(os.path.join(folder, os.path.basename(plot)), "rb") as f:
            assert open(plot, "rb").read() == f.read(), plot
    return [os.path.basename(p) for p in plots]
