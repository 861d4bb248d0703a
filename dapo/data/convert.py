"""``dapo data convert`` and ``dapo data make``: the same rows in the other format (dapo <->
flat), HumanEval as code rows, and generated code problems, written as data files."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from dapo.data import code_rows
from dapo.data.files import (
    DEFAULT_DATA_SOURCE,
    FORMATS,
    INTEGER_RE,
    ON_BAD_ROW,
    SUFFIXES,
    DataError,
    Table,
    bad_row_error,
    read_table,
    resolve_format,
)
from dapo.data.output import check_destination, write_records
from dapo.data.progress import tracked
from dapo.data.prompts import PROMPT_PREFIX, dapo_prompt, strip_template
from dapo.data.rows import BadRow, Row, last_user, parse_rows
from dapo.data.usable import Screen, TruthRules

# What the official DAPO files hold in these columns; ``convert_file`` writes the same.
DAPO_ABILITY = "MATH"
DAPO_STYLE = "rule-lighteval/MATH_v2"
_DAPO_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
CODE_ROW_KEYS: dict[str, Any] = {
    "question_key": "question",
    "answer_key": "answer",
    "data_source": DEFAULT_DATA_SOURCE,
    "wrap": False,
}
"""How code rows (DAPO rows, each naming its data_source) are parsed."""


@dataclass(frozen=True)
class ConvertResult:
    src_fmt: str
    to: str
    rows_in: int
    rows_out: int
    wrapped: int
    """Rows whose problem was wrapped in the template here (to dapo)."""
    skipped: list[BadRow]


def _dapo_schema(index_type: pa.DataType) -> pa.Schema:
    # Column and field order as in the official files.
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", index_type), ("raw_problem", pa.string())])),
        ]
    )


def convert_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    fmt: str = "auto",
    question_key: str = "question",
    answer_key: str = "answer",
    data_source: str | None = None,
    on_bad_row: str = "error",
    truth_rules: TruthRules | None = None,
) -> ConvertResult:
    """Write ``src`` to ``dst`` in the ``to`` format (default: the other one), row for row.

    - to dapo: each raw problem is wrapped in the DAPO template (a message that starts with
      it is kept as it is, so nothing is wrapped twice); ``data_source`` is the given one
      or "math_dapo", ability "MATH", style "rule-lighteval/MATH_v2", and ``extra_info`` holds
      the source's index (the row number when it has none; ``row-N`` when another row's own
      index is that number) and the raw problem. Applied to the DAPO-Math-17k copy, whose
      prompts lost the template, this rebuilds the official prompts.
    - to flat: the raw problem (template removed) and the answer, plus ``data_source``.

    Repeated rows are kept: conversion changes the format, not the content (``check`` reports
    repeats). The output type follows ``dst``'s extension; it is written to a temporary file
    beside it and renamed into place, so an error leaves nothing behind. A file none of whose
    rows converts (``on_bad_row`` skip) is a DataError too: nothing is written.

    The rows left out (or stopped at) are those ``dapo data check`` lists, decided by the
    same :class:`dapo.data.usable.Screen`; ``truth_rules`` are the tasks' rules for ground
    truths (``dapo data convert`` passes the registry's), applied by the data_source each
    written row carries. Converting also refuses a row the output format cannot hold.
    """
    src, dst = Path(src), Path(dst)
    if to is not None and to not in FORMATS:
        raise ValueError(f"--to must be one of {', '.join(FORMATS)}; got {to!r}")
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be one of {', '.join(ON_BAD_ROW)}; got {on_bad_row!r}")
    check_destination(src, dst)
    if code_rows.read_as_humaneval(src, fmt):
        return _convert_humaneval(src, None, dst, to, on_bad_row, truth_rules)
    table = read_table(src)
    if fmt == "auto" and code_rows.is_humaneval(table.columns):
        return _convert_humaneval(src, table, dst, to, on_bad_row, truth_rules)
    src_fmt, _ = resolve_format(table, fmt, question_key=question_key, answer_key=answer_key)
    to = to or ("flat" if src_fmt == "dapo" else "dapo")
    parsed = parse_rows(
        table.records,
        src_fmt,
        question_key=question_key,
        answer_key=answer_key,
        data_source=DEFAULT_DATA_SOURCE,
        wrap=False,
    )
    rows = list(tracked(parsed, f"checking the rows of {src.name}", len(table.records)))
    screen = Screen(truth_rules)
    converted = _convert_rows(
        src, rows, to, question_key, answer_key, data_source, on_bad_row, screen
    )
    records, indices, wrapped, skipped = converted
    _check_some_usable(src, records, len(table.records), skipped)
    write_records(records, _schema(records, indices, to, question_key, answer_key), dst)
    return ConvertResult(src_fmt, to, len(table.records), len(records), wrapped, skipped)


def _convert_rows(
    src: Path,
    rows: list[Row | BadRow],
    to: str,
    question_key: str,
    answer_key: str,
    data_source: str | None,
    on_bad_row: str,
    screen: Screen,
) -> tuple[list[dict[str, Any]], list[str], int, list[BadRow]]:
    """(records, the extra_info.index of each (to dapo), rows newly wrapped, rows skipped)."""
    records: list[dict[str, Any]] = []
    skipped: list[BadRow] = []
    indices: list[str] = []
    wrapped = 0
    # A row without an index gets its row number, unless a row's own index is that number
    # (the two would then read as one problem): then "row-N".
    taken = {r.index for r in rows if not isinstance(r, BadRow) and r.index is not None}
    for r in tracked(rows, f"converting the rows of {src.name}", len(rows)):
        # The rules that apply are those of the data_source the row is written with.
        written_source = None if isinstance(r, BadRow) else _written_source(r, to, data_source)
        seen = screen(r, written_source)
        out = seen if isinstance(seen, BadRow) else _convert_row(r, to, question_key, answer_key)
        if _left_out(src, out, on_bad_row, skipped):
            continue
        record, newly_wrapped = out
        record["data_source"] = written_source
        if to == "dapo":
            indices.append(r.index if r.index is not None else _free_index(r.row, taken))
        wrapped += newly_wrapped
        # The official files' column order, data_source first (JSON Lines keeps it).
        order = _DAPO_COLUMNS if to == "dapo" else (question_key, answer_key, "data_source")
        records.append({key: record[key] for key in order})
    return records, indices, wrapped, skipped


def _written_source(r: Row, to: str, data_source: str | None) -> str:
    """The data_source row ``r`` is written with: the given one, else (to flat) its own or
    (to dapo) math_dapo."""
    return data_source or (r.data_source if to == "flat" else DEFAULT_DATA_SOURCE)


def _left_out(src: Path, out: object, on_bad_row: str, skipped: list[BadRow]) -> bool:
    """Whether ``out`` is a bad row, recorded in ``skipped``; raises for on_bad_row error."""
    if not isinstance(out, BadRow):
        return False
    if on_bad_row == "error":
        raise bad_row_error(src, out, "pass --on-bad-row skip to leave such rows out")
    skipped.append(out)
    return True


def _check_some_usable(src: Path, records: list[Any], rows_in: int, skipped: list[BadRow]) -> None:
    if not records:  # every row skipped: an empty file would train on nothing, silently
        raise DataError(
            f"{src}: none of its {rows_in} rows is usable ({len(skipped)} bad; the "
            f"first: {skipped[0]}); nothing written; fix the file, or run `dapo data check "
            f"{src}` to list them"
        )


def _free_index(row: int, taken: set[str]) -> str:
    """An index for row ``row``, which has none: its number, else one no row holds."""
    index, n = str(row), 0
    while index in taken:
        n += 1
        index = f"row-{row}" + (f"-{n}" if n > 1 else "")
    taken.add(index)
    return index


def _convert_humaneval(
    src: Path,
    table: Table | None,
    dst: Path,
    to: str | None,
    on_bad_row: str,
    truth_rules: TruthRules | None,
) -> ConvertResult:
    """HumanEval ``src`` (``table``: its records, when read already) as code rows, less the
    rows ``dapo data check`` lists (a repeated task_id, text that is no text, tests that do
    not parse), which the same Screen finds in the code rows."""
    if to not in (None, "dapo"):
        raise ValueError(f"a humaneval file converts to the dapo format (code rows), not {to}")
    records = code_rows.humaneval_rows(src, table)
    screen = Screen(truth_rules)
    kept: list[dict[str, Any]] = []
    skipped: list[BadRow] = []
    for r in parse_rows(records, "dapo", **CODE_ROW_KEYS):
        if not _left_out(src, screen(r), on_bad_row, skipped):
            kept.append(records[r.row])
    _check_some_usable(src, kept, len(records), skipped)
    write_records(kept, _dapo_schema(pa.string()), dst)
    return ConvertResult("humaneval", "dapo", len(records), len(kept), 0, skipped)


def make_file(
    task: str, dst: str | os.PathLike[str], *, count: int, seed: int, skip: int = 0
) -> int:
    """Write ``count`` generated problems of ``task`` (``code-easy``) to ``dst``, after the
    first ``skip`` of the seed's sequence (so that a held-out file shares no problem, in text
    or in what it computes, with a training file of ``skip`` problems and the same seed).
    Missing parent directories of ``dst`` are created, as ``dapo model import`` creates its
    output's: ``data/`` of a fresh checkout, which the recipes read."""
    if task != "code-easy":
        raise ValueError(f"unknown task {task!r}; dapo data make knows code-easy")
    if count < 1 or skip < 0:
        raise ValueError(f"--count must be >= 1 and --skip >= 0, got {count} and {skip}")
    dst = Path(dst)
    if dst.suffix.lower() in SUFFIXES and not dst.parent.exists():  # an unknown type: refused
        dst.parent.mkdir(parents=True)
    check_destination(Path(os.devnull), dst)
    records = code_rows.easy_code_rows(count, seed, skip=skip)
    for record in records:  # one index type for the column: the schema's string
        record["extra_info"]["index"] = str(record["extra_info"]["index"])
    write_records(records, _dapo_schema(pa.string()), dst)
    return len(records)


def _convert_row(
    r: Row, to: str, question_key: str, answer_key: str
) -> tuple[dict[str, Any], bool] | BadRow:
    """One row in the ``to`` format (its data_source is the caller's), and whether its problem
    was newly wrapped in the template; or why it cannot be converted."""
    k = last_user(r.raw_messages)
    if to == "flat" and (len(r.raw_messages) != 1 or k != 0):
        return BadRow(
            r.row,
            "prompt",
            f"has {len(r.raw_messages)} message(s) "
            f"({', '.join(m['role'] for m in r.raw_messages)}); the flat format holds "
            "exactly one user question",
        )
    if k is None:  # to dapo: nothing to wrap
        return BadRow(r.row, "prompt", "has no user message to wrap in the DAPO template")
    content = r.raw_messages[k]["content"]
    problem = strip_template(content)
    if to == "flat":
        return {question_key: problem, answer_key: r.answer}, False
    # Never wrapped twice: a message that starts with the template keeps it as it is, even
    # when its end is not the template's exactly (a trailing newline).
    wrapped = content.startswith(PROMPT_PREFIX)
    user = {"content": content if wrapped else dapo_prompt(problem), "role": "user"}
    others = [{"content": m["content"], "role": m["role"]} for m in r.raw_messages]
    record = {
        "prompt": others[:k] + [user] + others[k + 1 :],
        "ability": DAPO_ABILITY,
        "reward_model": {"ground_truth": r.answer, "style": DAPO_STYLE},
        "extra_info": {"index": None, "raw_problem": problem},
    }
    return record, not wrapped


def _schema(
    records: list[dict[str, Any]], indices: list[str], to: str, question_key: str, answer_key: str
) -> pa.Schema:
    """The output schema; to dapo, also sets every record's extra_info.index."""
    if to != "dapo":
        return pa.schema(
            [(question_key, pa.string()), (answer_key, pa.string()), ("data_source", pa.string())]
        )
    # One column type for the index: int64 when every index is an integer within its range,
    # else string (a wider one, e.g. a 20-digit id, is kept as written).
    all_int = all(
        INTEGER_RE.fullmatch(i) and str(int(i)) == i and -(2**63) <= int(i) < 2**63 for i in indices
    )
    for rec, index in zip(records, indices, strict=True):
        rec["extra_info"]["index"] = int(index) if all_int else index
    return _dapo_schema(pa.int64() if all_int else pa.string())
