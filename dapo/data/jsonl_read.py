"""Reading a JSON Lines problem file: each line one JSON object, measured before it is read
(a line over :data:`MAX_LINE_BYTES` is a bad row), decoded, and checked to name each key
once. Records are dicts; a line that is no object is a str saying why (its row's reason)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from dapo.data.rows import json_type

MAX_LINE_BYTES = 16 * 2**20
"""A JSON line longer than this is a bad row, not read into memory whole; a Parquet value
longer than this is refused before it is decoded (:mod:`dapo.data.parquet_read`)."""


class RepeatedKey(ValueError):
    """A JSON object that names one key twice (``json.loads`` would keep the last value)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object, or RepeatedKey for a key it names
    twice. Which of two ground truths is meant is a guess; pyarrow's reader refuses such a
    row, and a Parquet file cannot hold one."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        raise RepeatedKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def json_record(data: bytes, lineno: int) -> Any:
    """One JSON line's object, or a str saying why it is not one (the row's reason)."""
    try:
        line = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"line {lineno} is not UTF-8 (byte 0x{data[exc.start]:02x} at column {exc.start})"
    try:
        rec = json.loads(line, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        return f"line {lineno} is not valid JSON ({exc.msg})"
    except RepeatedKey as exc:
        return (
            f"line {lineno} names the key {exc.key!r} twice in one object; keep one of its values"
        )
    except RecursionError:
        return f"line {lineno} nests lists or objects too deep to be a problem"
    except ValueError as exc:  # an integer of more digits than Python converts
        return f"line {lineno} is not usable JSON ({str(exc).split(':')[0]}; write it as a string)"
    if not isinstance(rec, dict):
        return f"line {lineno} is a JSON {json_type(rec)}, not an object"
    return rec


def json_lines(f: Any) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of every non-blank line; ``b""`` for a line over MAX_LINE_BYTES,
    whose rest is skipped without being held in memory."""
    lineno = 0
    while True:
        data = f.readline(MAX_LINE_BYTES + 1)
        if not data:
            return
        lineno += 1
        if len(data) > MAX_LINE_BYTES and not data.endswith(b"\n"):
            while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield lineno, b""  # too long: reported by the caller
            continue
        if lineno == 1:
            data = data.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark is no content
        if data.strip():
            yield lineno, data


def json_schema(records: list[Any]) -> tuple[list[str], list[tuple[str, str]]]:
    """The columns (first-seen order) and (column, type) schema of ``records``, the dicts
    among them, as pyarrow infers it."""
    objects = [r for r in records if isinstance(r, dict)]
    columns: dict[str, None] = {}
    for rec in objects:
        columns.update(dict.fromkeys(rec))
    try:
        schema = [(f.name, str(f.type)) for f in pa.Table.from_pylist(objects).schema]
    except (
        pa.ArrowInvalid,
        pa.ArrowTypeError,
        pa.ArrowNotImplementedError,
        UnicodeError,
        OverflowError,
    ):
        # Rows disagree on a column's type (a number here, a string there), or a string is no
        # text (a lone surrogate), or an integer is beyond 64 bits: say what each column holds;
        # the rows say what is wrong.
        schema = []
        for col in columns:
            kinds = sorted({json_type(r.get(col)) for r in objects} - {"null"}) or ["null"]
            schema.append((col, kinds[0] if len(kinds) == 1 else "mixed: " + " | ".join(kinds)))
    return list(columns), schema
