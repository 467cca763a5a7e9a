"""Failed runs (``study.failures``: training bits/char more than
``study.FAILURE_BPC`` above its group's median) read from a study's table:
which runs, their rate by cell and arm, and a table of them per cell and
budget, for the reports of past early training (``compute.py``) and of
what the confirmation holds beside its verdicts (``robustness.py``)."""

from collections.abc import Mapping, Sequence
from typing import Any

from lmhead.lab import report
from studies.tying import cells, profiles, study

Rows = Sequence[Mapping[str, Any]]


def unique_rows(tables: Sequence[Rows]) -> list[Mapping[str, Any]]:
    """The rows of ``tables``, each run once (the first table that has it):
    the confirmatory table repeats the profiles' runs it was planned from."""
    seen, found = set(), []
    for rows in tables:
        for row in rows:
            if row["run"] not in seen:
                seen.add(row["run"])
                found.append(row)
    return found


def _group_key(row: Mapping[str, Any]) -> tuple:
    return (
        row["vocab"],
        row["amount"],
        row["steps_cap"],
        row["role"],
        profiles.arm_label(row),
        row["lr"],
    )


def failed_runs(rows: Rows) -> set[str]:
    """The names of the finished runs on all of the text that failed
    (``study.failures`` within their group: one cell, budget, role, arm and
    rate). A subset's seeds train on parts of their own: not judged.

    Examples:
        >>> from studies.tying import table
        >>> def row(seed, bpc):
        ...     return dict.fromkeys(table.COLUMNS) | {"role": "tune", "vocab": "char",
        ...         "amount": 1.0, "arm": "a", "lr": 0.004, "seed": seed,
        ...         "status": "finished", "train_bpc": bpc, "run": f"s{seed}"}
        >>> sorted(failed_runs([row(0, 2.30), row(1, 2.31), row(2, 2.40)]))
        ['s2']
    """
    groups: dict[tuple, list] = {}
    for row in rows:
        if row["amount"] >= 1.0 and row["status"] == cells.FINISHED:
            groups.setdefault(_group_key(row), []).append(row)
    failed = set()
    for own in groups.values():
        flags = study.failures([r["train_bpc"] for r in own])
        failed |= {r["run"] for r, f in zip(own, flags) if f}
    return failed


def failure_tables(rows: Rows) -> str:
    """Per cell and budget on all of the text, a table of rates by arm: the
    tuning runs that failed of those run, and the test runs' likewise with
    the failed seeds named."""
    failed = failed_runs(rows)
    counts: dict[tuple, dict[tuple, dict[str, list]]] = {}
    for row in rows:
        if row["amount"] < 1.0 or row["status"] != cells.FINISHED:
            continue
        cell = (row["vocab"], row["steps_cap"])
        entry = counts.setdefault(cell, {}).setdefault(
            (row["lr"], profiles.arm_label(row)), {"tune": [], "test": []}
        )
        if row["role"] in entry:
            entry[row["role"]].append((row["seed"], row["run"] in failed))
    sections = []
    for (vocab, steps), found in sorted(
        counts.items(), key=lambda kv: (cells.vocab_order(kv[0][0]), kv[0][1])
    ):
        arms = sorted({arm for _, arm in found})
        rates = sorted({lr for lr, _ in found})
        lines = []
        for lr in rates:
            line = [f"{lr:g}"]
            for arm in arms:
                line.append(_failure_text(found.get((lr, arm))))
            lines.append(line)
        sections.append(
            f"**{cells.vocab_label(vocab)}, all of the text, {steps} steps**\n\n"
            + report.markdown_table(["rate", *arms], lines)
        )
    return "\n\n".join(sections)


def _failure_text(entry: Mapping[str, list] | None) -> str:
    if entry is None:
        return report.DASH
    parts = []
    for role in ("tune", "test"):
        runs = entry[role]
        if runs:
            seeds = [str(s) for s, f in sorted(runs) if f]
            named = f" ({', '.join(seeds)})" if seeds and role == "test" else ""
            failed = sum(f for _, f in runs)
            text = f"{failed}/{len(runs)}{named}"
            parts.append(f"**{text}**" if failed else text)
        else:
            parts.append(report.DASH)
    return " · ".join(parts)


def failure_rate(rows: Rows) -> tuple[int, int, int, int]:
    """``(failed, runs)`` of the tuning runs, then of the test runs, on all of
    the text."""
    failed = failed_runs(rows)
    judged = [r for r in rows if r["amount"] >= 1.0 and r["status"] == cells.FINISHED]
    tune = [r["run"] in failed for r in judged if r["role"] == "tune"]
    test = [r["run"] in failed for r in judged if r["role"] == "test"]
    return sum(tune), len(tune), sum(test), len(test)
