r"""The mechanism test of the tying study (``configs/sweeps/tying_study.py:
mechanism``): is tying an embedding learning-rate effect? The untied arm b
of one profiled cell is trained again with the tables' learning rate at
:math:`k` times the rate (``optim.table_lr_multiplier``), each :math:`k`
on a learning-rate profile of its own beside the cell's arms a and b. The
report, from the rows of its ``runs.csv`` alone (:func:`report_from_csv`),
gives for each :math:`k` the contrast :math:`b_k - a` at each one's best
rate with its selection uncertainty (``profiles.bootstrap``), and whether
some :math:`k` closes :math:`b - a` (:func:`closes`).
``docs/tying_study/README.md`` ("The mechanism test") describes it.
"""

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lmhead.lab import report
from studies.tying import profiles, table


def closes(baseline: profiles.Bootstrap, at_k: profiles.Bootstrap) -> bool:
    """Whether ``at_k`` (:math:`b_k - a`) closes ``baseline`` (:math:`b - a`
    at :math:`k = 1`): its interval holds 0 while the baseline's does not.

    Examples:
        >>> def b(low, high):
        ...     return profiles.Bootstrap("b", "a", 1e-3, 1e-3, 0.0, low, high, {}, 27)
        >>> closes(b(0.004, 0.02), b(-0.01, 0.01)), closes(b(-0.01, 0.02), b(-0.01, 0.01))
        (True, False)
        >>> closes(b(0.004, 0.02), b(0.001, 0.01))
        False
    """

    def holds_zero(x):
        return x.low <= 0.0 <= x.high

    finite = all(math.isfinite(v) for x in (baseline, at_k) for v in (x.low, x.high))
    return finite and not holds_zero(baseline) and holds_zero(at_k)


def multipliers(rows: Sequence[Mapping[str, Any]]) -> list[tuple[float, str]]:
    """The table multipliers of arm b among ``rows``' tuning runs, finished
    or not, ``(k, arm label)`` ascending (:func:`profiles.arm_label`'s
    labels).

    Examples:
        >>> multipliers([{"role": "tune", "arm": "b", "table_lr_multiplier": k}
        ...              for k in (4.0, 1.0, 0.5)])
        [(0.5, 'b×0.5'), (4.0, 'b×4')]
    """
    found = {
        (row["table_lr_multiplier"], profiles.arm_label(row))
        for row in rows
        if row["role"] == "tune"
        and row["arm"] == "b"
        and (row["table_lr_multiplier"] or 1.0) != 1.0
    }
    return sorted(found)


def unfinished(rows: Sequence[Mapping[str, Any]], profile: profiles.Profile) -> set:
    """The arm labels of ``profile``'s cell with a tuning run not finished:
    their profile is unfinished."""
    return {
        profiles.arm_label(row)
        for row in rows
        if row["role"] == "tune"
        and (row["vocab"], row["amount"]) == (profile.vocab, profile.amount)
        and row["status"] != "finished"
    }


def _interval(b: profiles.Bootstrap) -> str:
    return report.DASH if math.isnan(b.low) else f"[{b.low:+.4f}, {b.high:+.4f}]"


def _answer(baseline, found, pending) -> str:
    closing = [k for k, b in found if b is not None and closes(baseline, b)]
    waiting = (
        f" (k = {', '.join(f'{k:g}' for k in pending)}: profile unfinished)"
        if pending
        else ""
    )
    if baseline is None or math.isnan(baseline.low):
        return "b − a has no interval yet: a or b's profile is unfinished."
    if baseline.low <= 0.0 <= baseline.high:
        return (
            "b − a's interval at k = 1 holds 0 already: there is no gap for a k "
            "to close."
        )
    if closing:
        return (
            f"k = {', '.join(f'{k:g}' for k in closing)} closes b − a: its "
            f"interval holds 0 where b − a's at k = 1 does not{waiting}."
        )
    if pending:
        return f"No finished k closes b − a so far{waiting}."
    return "No k closes b − a: every b_k − a interval excludes 0 too."


def write_report(rows: Sequence[Mapping[str, Any]], out_dir: str):
    """``out_dir/REPORT.md`` and the cell's figure from ``rows``: each k's
    :math:`b_k - a` beside :math:`b - a`, whether it closes it (a k or an arm
    with a tuning run not finished: profile unfinished), and the profiles.
    Returns ``(REPORT.md's text, plot paths)``."""
    os.makedirs(out_dir, exist_ok=True)
    sections, plots, answers = [], [], []
    ks = multipliers(rows)
    for profile in profiles.profiles(rows):
        waiting = unfinished(rows, profile)
        baseline = None
        if {"a", "b"} <= set(profile.loss) and not {"a", "b"} & waiting:
            baseline = profiles.bootstrap(profile, "b", "a")
        found = [
            (k, None if arm in waiting else profiles.bootstrap(profile, arm, "a"))
            for k, arm in ks
        ]
        body = []
        for k, arm, b in [(1.0, "b", baseline)] + [
            (k, a, b) for (k, a), (_, b) in zip(ks, found)
        ]:
            if b is None:
                body.append(
                    [f"{k:g}", f"{arm} − a"]
                    + [report.DASH] * 4
                    + ["profile unfinished"]
                )
                continue
            shut = report.DASH
            if k != 1.0 and baseline is not None:
                shut = "yes" if closes(baseline, b) else "no"
            body.append(
                [
                    f"{k:g}",
                    f"{b.arm} − a",
                    report.DASH if b.best is None else f"{b.best:g}",
                    report.DASH
                    if b.reference_best is None
                    else f"{b.reference_best:g}",
                    report.DASH if math.isnan(b.difference) else f"{b.difference:+.4f}",
                    _interval(b),
                    shut,
                ]
            )
        pending = [k for k, b in found if b is None]
        answers.append(
            f"{profiles.cell_label(profile)}: {_answer(baseline, found, pending)}"
        )
        header = [
            "k",
            "contrast",
            "best rate",
            "a's best rate",
            "Δ val bits/char",
            f"{profiles.LEVEL:.0%} bootstrap interval",
            "closes b − a",
        ]
        section, path = profiles.cell_section(profile, out_dir)
        sections += [report.markdown_table(header, body), section]
        plots.append(path)
    intro = (
        "# The mechanism test: is tying an embedding learning-rate effect?\n\n"
        "Arm b (untied) trained again with its tables (the embedding and the "
        "head) at k times the learning rate (`optim.table_lr_multiplier`), each "
        "k on a learning-rate profile of its own, on the rungs and tuning seeds "
        "of the cell's profile; written from `runs.csv` alone. b_k − a is in "
        "validation bits per character at each one's best rate (the lowest mean "
        "validation loss over the tuning seeds), its interval the selection "
        "uncertainty of the profiles' report (every ordered resample of the "
        "tuning seeds, each best chosen again). A k closes b − a where its "
        "interval holds 0 while b − a's at k = 1 does not; a k with a tuning "
        "run not finished is left out (profile unfinished)."
    )
    text, _ = report.write_markdown(out_dir, [intro, *answers, *sections])
    return text, plots


def report_from_csv(path: str, out_dir: str):
    """:func:`write_report` of the rows of the ``runs.csv`` at ``path``."""
    return write_report(table.read_rows(path), out_dir)
