"""The tying study's runs as one table, ``docs/tying_study/runs.csv``: one
row per run, a dict of :data:`COLUMNS` (each value of its column's type, or
None: not measured), which :func:`write_rows` and :func:`read_rows`
round-trip exactly (floats are written with ``repr``). The columns are
described in ``docs/tying_study/README.md`` ("The code").
"""

import csv
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Each column and its type, in the file's order.
COLUMNS: dict[str, type] = {
    "role": str,
    "vocab": str,
    "vocab_size": int,
    "amount": float,
    "offset": float,
    "arm": str,
    "seed": int,
    "lr": float,
    "table_lr_multiplier": float,
    "untie_step": int,
    "d_model": int,
    "num_layers": int,
    "mlp_dim": int,
    "params": int,
    "head_share": float,
    "flops_per_token": int,
    "train_chars": int,
    "train_tokens": int,
    "tokens_per_param": float,
    "steps_cap": int,
    "steps_run": int,
    "steps_to_best": int,
    "eval_every": int,
    "step_tokens": int,
    "reached_cap": bool,
    "train_bpc": float,
    "val_bpc": float,
    "val_loss": float,
    "heldout_bpc": float,
    "gap_bpc": float,
    "test_bpc": float,
    "test_word_ppl": float,
    "test_words": int,
    "test_chars": int,
    "status": str,
    "wall_seconds": float,
    "versions": str,
    "run": str,
    "ensemble": str,
}

# tune: the learning-rate grid on the tuning seeds; test: the test seeds at
# each cell's chosen rate; ablation: the table learning-rate multipliers.
ROLES = ("tune", "test", "ablation")
ARMS = ("a", "b", "c", "d", "e")
_CHOICES = {"role": ROLES, "arm": ARMS}
_BOOLEANS = {"true": True, "false": False}


def check_row(row: Mapping[str, Any], index: int = 0) -> None:
    """Checks that ``row`` has exactly :data:`COLUMNS` with values of their
    types (or None); ``index`` names the row in the errors.

    Raises:
        ValueError: an unknown or missing column, or a ``role``/``arm``
            outside :data:`ROLES`/:data:`ARMS`.
        TypeError: a value of another type than its column's.

    Examples:
        >>> check_row({"role": "test"})
        Traceback (most recent call last):
        ...
        ValueError: row 0 lacks the columns ['vocab', 'vocab_size', ...
    """
    unknown = [k for k in row if k not in COLUMNS]
    if unknown:
        raise ValueError(
            f"row {index} has unknown columns {unknown}; the columns are "
            f"table.COLUMNS: {list(COLUMNS)}."
        )
    missing = [k for k in COLUMNS if k not in row]
    if missing:
        raise ValueError(f"row {index} lacks the columns {missing}.")
    for name, kind in COLUMNS.items():
        value = row[name]
        if value is not None and not _is_of(value, kind):
            raise TypeError(
                f"row {index} column {name!r} must be {kind.__name__} or None, "
                f"got {value!r} ({type(value).__name__})."
            )
        if name in _CHOICES and value not in _CHOICES[name]:
            raise ValueError(
                f"row {index} column {name!r} must be one of {_CHOICES[name]}, "
                f"got {value!r}."
            )


def write_rows(path: str, rows: Iterable[Mapping[str, Any]]) -> None:
    """Writes ``rows`` (each checked by :func:`check_row`) to the CSV file
    ``path`` with a header of :data:`COLUMNS`; None is an empty cell.

    Examples:
        >>> import os, tempfile
        >>> row = dict.fromkeys(COLUMNS) | {"role": "test", "arm": "a",
        ...                                 "seed": 3, "test_bpc": 1.0 / 3}
        >>> path = os.path.join(tempfile.mkdtemp(), "runs.csv")
        >>> write_rows(path, [row])
        >>> read_rows(path) == [row]
        True
    """
    rows = list(rows)
    for index, row in enumerate(rows):
        check_row(row, index)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow(_format(row[name]) for name in COLUMNS)


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of the CSV file ``path`` (as :func:`write_rows` writes it),
    each a dict of :data:`COLUMNS` in order with typed values (None for an
    empty cell).

    Raises:
        ValueError: a header with unknown or missing columns, a row of
            another length, or a cell that does not parse as its column's type.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path} is empty; it needs a header of COLUMNS.")
        _check_header(path, header)
        rows = []
        for line, cells in enumerate(reader, start=2):
            if len(cells) != len(header):
                raise ValueError(
                    f"{path} line {line} has {len(cells)} cells, the header "
                    f"{len(header)}."
                )
            values = dict(zip(header, cells))
            row = {name: _parse(values[name], name, path, line) for name in COLUMNS}
            check_row(row, line - 2)
            rows.append(row)
    return rows


def _check_header(path: str, header: Sequence[str]) -> None:
    unknown = [k for k in header if k not in COLUMNS]
    missing = [k for k in COLUMNS if k not in header]
    if unknown or missing or len(set(header)) != len(header):
        raise ValueError(
            f"{path}'s header must hold table.COLUMNS once each: unknown "
            f"{unknown}, missing {missing}, header {list(header)}."
        )


def _is_of(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, kind)


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    return value


def _parse(cell: str, name: str, path: str, line: int) -> Any:
    if cell == "":
        return None
    kind = COLUMNS[name]
    try:
        if kind is bool:
            return _BOOLEANS[cell]
        return kind(cell)
    except (KeyError, ValueError):
        raise ValueError(
            f"{path} line {line} column {name!r}: {cell!r} is not a "
            f"{kind.__name__}{' (true or false)' if kind is bool else ''}."
        ) from None
