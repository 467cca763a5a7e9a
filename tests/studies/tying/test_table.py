"""Tests for studies/tying/table.py: runs.csv round-trips every value
exactly (floats by repr, None as an empty cell), and a table or row of
other columns or types is refused with an error that names them."""

import csv
import math

import numpy as np
import pytest

from studies.tying import table
from tests.studies.tying import synthetic_rows


def blank_row(**values):
    return dict.fromkeys(table.COLUMNS) | {"role": "test", "arm": "a"} | values


def test_the_columns_are_the_designed_ones_in_order():
    assert list(table.COLUMNS)[:8] == [
        "role", "vocab", "vocab_size", "amount", "offset", "arm", "seed", "lr"
    ]  # fmt: skip
    assert list(table.COLUMNS)[-5:] == [
        "status", "wall_seconds", "versions", "run", "ensemble"
    ]  # fmt: skip
    assert len(table.COLUMNS) == 39


def test_rows_round_trip_exactly(tmp_path):
    rows = synthetic_rows.synthetic_rows()
    # Floats whose shortest decimal form is long, and a NaN and an infinity.
    rows[0] |= {"lr": 0.1 + 0.2, "test_bpc": math.nan, "val_bpc": math.inf}
    rows[1] |= {"versions": 'jax 0.4, "flax", optax\nnext line'}
    path = tmp_path / "runs.csv"
    table.write_rows(path, rows)
    back = table.read_rows(path)
    assert len(back) == len(rows)
    for row, read in zip(rows[1:], back[1:]):
        assert read == row
        assert [type(v) for v in read.values()] == [
            type(v) if v is None or isinstance(v, (str, bool)) else t
            for v, t in zip(row.values(), table.COLUMNS.values())
        ]
    assert back[0]["lr"] == 0.1 + 0.2 and math.isnan(back[0]["test_bpc"])
    assert back[0]["val_bpc"] == math.inf
    failed = next(r for r in back if r["status"] == "failed")
    assert failed["test_bpc"] is None
    with open(path, newline="") as f:
        cells = list(csv.DictReader(f))
    assert cells[0]["lr"] == repr(0.1 + 0.2) and cells[0]["untie_step"] == ""
    assert {c["reached_cap"] for c in cells} == {"true", "false"}


def test_numpy_values_are_written_as_plain_numbers(tmp_path):
    row = blank_row(seed=np.int64(3), lr=np.float32(0.1), reached_cap=True)
    table.write_rows(tmp_path / "runs.csv", [row])
    read = table.read_rows(tmp_path / "runs.csv")[0]
    assert read["seed"] == 3 and type(read["seed"]) is int
    assert read["lr"] == float(np.float32(0.1)) and read["reached_cap"] is True


def test_bad_rows_are_refused_by_name(tmp_path):
    path = tmp_path / "runs.csv"
    with pytest.raises(ValueError, match=r"row 1 has unknown columns \['speed'\]"):
        table.write_rows(path, [blank_row(), blank_row(speed=1.0)])
    missing = blank_row()
    del missing["test_bpc"]
    with pytest.raises(ValueError, match=r"lacks the columns \['test_bpc'\]"):
        table.write_rows(path, [missing])
    with pytest.raises(TypeError, match="'seed' must be int or None, got 1.5"):
        table.write_rows(path, [blank_row(seed=1.5)])
    with pytest.raises(TypeError, match="'reached_cap' must be bool"):
        table.write_rows(path, [blank_row(reached_cap=1)])
    with pytest.raises(TypeError, match="'steps_run' must be int"):
        table.write_rows(path, [blank_row(steps_run=True)])
    with pytest.raises(ValueError, match="'arm' must be one of"):
        table.write_rows(path, [blank_row(arm="f")])
    with pytest.raises(ValueError, match="'role' must be one of"):
        table.write_rows(path, [blank_row(role="seed")])


def write_csv(path, header, *lines):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(lines)


def test_bad_files_are_refused_by_name(tmp_path):
    path = tmp_path / "runs.csv"
    columns = list(table.COLUMNS)
    write_csv(path, [*columns[:-1], "extra"])
    with pytest.raises(
        ValueError, match=r"unknown \['extra'\], missing \['ensemble'\]"
    ):
        table.read_rows(path)
    path.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        table.read_rows(path)
    cells = ["test", "char", "x", *[""] * (len(columns) - 3)]
    write_csv(path, columns, cells)
    with pytest.raises(
        ValueError, match="line 2 column 'vocab_size': 'x' is not a int"
    ):
        table.read_rows(path)
    cells[2], cells[columns.index("reached_cap")] = "84", "yes"
    write_csv(path, columns, cells)
    with pytest.raises(ValueError, match=r"'reached_cap': 'yes' is not a bool \(true"):
        table.read_rows(path)
    write_csv(path, columns, cells[:5])
    with pytest.raises(ValueError, match="line 2 has 5 cells"):
        table.read_rows(path)


def test_columns_in_another_order_read_the_same(tmp_path):
    row = blank_row(seed=2, lr=0.5, vocab="512")
    write_csv(
        tmp_path / "runs.csv",
        list(table.COLUMNS)[::-1],
        [table._format(row[k]) for k in list(table.COLUMNS)[::-1]],
    )
    assert table.read_rows(tmp_path / "runs.csv") == [row]
