"""Problem files on disk: the DAPO Parquet schema and flat question/answer tables.

Two formats (spec, "Data"):

- ``dapo``: ``prompt`` is a list of {role, content} chat messages, the answer is
  ``reward_model.ground_truth``, ``data_source`` picks the verifier; ``ability`` and
  ``extra_info`` are optional, and ``extra_info.index`` names the problem. The official
  DAPO-Math-17k and AIME 2024 files use it.
- ``flat``: a question column and an answer column (names configurable), and optionally a
  ``data_source`` column.

Either is read from Parquet (pyarrow) or JSON Lines. ``load_problems`` validates every row
(:mod:`dapo.data.rows`), merges repeated rows into one Problem (the official AIME file holds
each of its 30 problems 32 times, for avg@32) and records the rows it could not use.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from dapo.data.jsonl_read import MAX_LINE_BYTES, json_lines, json_record, json_schema
from dapo.data.parquet_read import ParquetRefused, read_parquet
from dapo.data.problems import Problem
from dapo.data.progress import EVERY_ROWS, Progress, tracked
from dapo.data.rows import BadRow, check_keys, parse_rows
from dapo.data.usable import Screen, TruthRules

FORMATS = ("dapo", "flat")
ON_BAD_ROW = ("error", "skip")
# ".json" is read as JSON Lines too (one object per line), as Hugging Face datasets write it.
SUFFIXES = (".parquet", ".jsonl", ".json")
DEFAULT_DATA_SOURCE = "math_dapo"
SKIP_HINT = "pass data.on_bad_row=skip (--on-bad-row skip) to skip and count such rows"
# DAPO-Math-17k's answers all match this (its SOURCE.md); anything else is graded only
# as well as the verifier's normalisation allows, so ``check`` counts it.
INTEGER_RE = re.compile(r"-?[0-9]+")
GZIP_MAGIC = b"\x1f\x8b"


class DataError(ValueError):
    """A data file that cannot be used as it is; the message names the file, row and field."""


@dataclass
class LoadedData:
    path: Path
    fmt: str
    """The format the rows were read as: "dapo" or "flat"."""
    problems: list[Problem]
    """Distinct problems in first-seen order (every row, when loaded with dedup=False)."""
    copies: dict[str, int]
    """uid -> how many rows of the file hold that problem."""
    rows: int
    """Rows in the file, bad ones included."""
    skipped: list[BadRow] = field(default_factory=list)
    first_row: dict[str, int] = field(default_factory=dict)
    """uid -> the row its problem was first seen at."""
    checked: dict[str, int] = field(default_factory=dict)
    """data_source -> problems whose ground truth ``truth_rules`` checked (bad ones too)."""

    def check_usable(self) -> None:
        """Refuse a file of which no row is usable (every row skipped with
        ``on_bad_row="skip"``), naming its first bad row."""
        if not self.problems:
            raise DataError(
                f"{self.path}: none of its {self.rows} rows is usable ({len(self.skipped)} bad; "
                f"the first: {self.skipped[0]}); fix the file, or run `dapo data check "
                f"{self.path}` to list them"
            )


@dataclass(frozen=True)
class Table:
    path: Path
    records: list[Any]  # dicts; a str (why) for a JSON line that could not be read as one
    columns: list[str]
    schema: list[tuple[str, str]]  # (column, type) as pyarrow infers it


def read_table(path: str | os.PathLike[str]) -> Table:
    """Every record of a Parquet or JSON Lines file, with its columns and schema."""
    path = Path(path).expanduser()
    check_regular(path)  # before its suffix: a directory named x.parquet is no Parquet file
    if is_gzip(path):  # before its suffix: x.jsonl.gz is no unknown type, but compressed
        raise DataError(gzip_error(path))
    if path.suffix.lower() not in SUFFIXES:
        raise DataError(
            f"{path}: unknown data file type {path.suffix or '(no extension)'!r}; "
            f"accepted: {', '.join(SUFFIXES)} (.json is read as JSON Lines, one object per line)"
        )
    if not path.is_file():
        cwd = "" if path.is_absolute() else f" (a relative path is read from {Path.cwd()})"
        raise DataError(f"{path}: no such data file{cwd}")
    if path.suffix.lower() == ".parquet":
        try:  # in batches, each measured before it becomes Python objects
            return Table(path, *read_parquet(path, MAX_LINE_BYTES))
        except ParquetRefused as exc:  # too large, or a value Python cannot hold
            raise DataError(f"{path}: {exc}") from None
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{path}: cannot be read as Parquet: {exc}") from None
    return _read_jsonl(path)


def check_regular(path: Path) -> None:
    """Refuse a ``path`` that exists but is no regular file (a directory, a FIFO, a device),
    saying what it is: "no such data file" would send the user looking for a typo."""
    if path.is_dir():
        raise DataError(
            f"{path}: is a directory; give a file (one of its {_data_files(path)}, say): a "
            "data file is one Parquet or JSON Lines file"
        )
    if path.exists() and not path.is_file():
        mode = path.stat().st_mode
        kind = next((k for test, k in _SPECIAL if test(mode)), "special file")
        raise DataError(f"{path}: is not a regular file (a {kind}); give a data file")


_SPECIAL = (
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "device"),
    (stat.S_ISBLK, "device"),
)


def _data_files(path: Path) -> str:
    """A name or pattern of the data files in directory ``path`` (part-*.parquet if none)."""
    try:
        names = sorted(p.name for p in path.iterdir() if p.suffix.lower() in SUFFIXES)
    except OSError:
        names = []
    if len(names) > 1 and all(n.startswith("part-") for n in names):
        return f"part-*{Path(names[0]).suffix}"
    return names[0] if names else "part-*.parquet"


def is_gzip(path: Path) -> bool:
    """Whether ``path`` is a file that starts with gzip's magic bytes (whatever its name)."""
    if not path.is_file():  # a FIFO would block the open; the reader refuses it
        return False
    try:
        with path.open("rb") as f:
            return f.read(2) == GZIP_MAGIC
    except OSError:  # unreadable: the reader says why
        return False


def gunzip_hint(path: Path) -> str:
    """How to decompress the gzip-compressed ``path``, and which file to give then."""
    if path.suffix.lower() == ".gz":
        return f"gunzip -k {path}, then give {path.with_suffix('')}"
    plain = path.with_name(f"{path.stem}.plain{path.suffix or '.jsonl'}")
    return f"gunzip -c {path} > {plain}, then give that file"


def gzip_error(path: Path) -> str:
    """Why a gzip-compressed ``path`` is not read, and how to decompress it."""
    return (
        f"{path}: is gzip-compressed; decompress it first ({gunzip_hint(path)}): data files "
        "are read as plain Parquet or JSON Lines (HumanEval.jsonl.gz: `dapo data convert` "
        "reads it, into code rows)"
    )


def _read_jsonl(path: Path) -> Table:
    records: list[Any] = []
    progress = Progress(f"reading {path.name}", path.stat().st_size, "bytes")
    with path.open("rb") as f:
        for lineno, data in json_lines(f):
            if lineno % EVERY_ROWS == 0:
                progress.update(f.tell())
            if not data:
                records.append(
                    f"line {lineno} is over {MAX_LINE_BYTES // 2**20} MiB, longer than any "
                    "problem; split or shorten it"
                )
                continue
            if not records and data.lstrip().startswith(b"["):
                raise DataError(
                    f"{path}: holds a JSON array; write one JSON object per line (JSON Lines)"
                )
            records.append(json_record(data, lineno))
    return records_table(path, records)


def records_table(path: Path, records: list[Any]) -> Table:
    """A Table of JSON records already in memory, its columns and schema as a JSON Lines file
    of them would have (``dapo data check`` of HumanEval's code rows)."""
    return Table(path, records, *json_schema(records))


def resolve_format(
    table: Table, fmt: str, *, question_key: str, answer_key: str
) -> tuple[str, list[str]]:
    """The format to read ``table`` as, and the columns every row needs for it."""
    if fmt not in ("auto", *FORMATS):
        raise ValueError(f"data format must be one of auto, {', '.join(FORMATS)}; got {fmt!r}")
    check_keys(question_key, answer_key)
    columns = set(table.columns)
    if fmt == "auto":
        # A chat prompt without a question column is a DAPO file, whatever else it lacks:
        # its error should name reward_model, not the flat format's columns.
        dapo_like = "prompt" in columns and question_key not in columns
        fmt = "dapo" if {"prompt", "reward_model"} <= columns or dapo_like else "flat"
    need = ["prompt", "reward_model"] if fmt == "dapo" else [question_key, answer_key]
    missing = [c for c in need if c not in columns]
    # A file none of whose lines is a JSON object has no columns at all: its rows then say
    # what is wrong with each line (too deep, a huge integer), not a missing column.
    if missing and any(isinstance(r, dict) for r in table.records):
        fix = (
            "name the columns with --question-key/--answer-key (data.question_key/answer_key)"
            if fmt == "flat"
            else "the DAPO format holds each row's answer in reward_model.ground_truth; or is "
            "it a flat question/answer file? then use --format flat (data.format=flat)"
        )
        raise DataError(
            f"{table.path}: read as {fmt} format, it has no column {', '.join(map(repr, missing))}"
            f" (columns: {', '.join(table.columns) or 'none'}); {fix}"
        )
    return fmt, need


def load_problems(
    path: str | os.PathLike[str],
    *,
    fmt: str = "auto",
    question_key: str = "question",
    answer_key: str = "answer",
    data_source: str = DEFAULT_DATA_SOURCE,
    wrap_template: bool = False,
    dedup: bool = True,
    on_bad_row: str = "error",
    truth_rules: TruthRules | None = None,
) -> LoadedData:
    """Read a problem file (Parquet or JSON Lines, in the dapo or flat format).

    Args:
        fmt: "dapo", "flat", or "auto": dapo when the file has ``prompt`` and ``reward_model``
            columns, flat otherwise.
        question_key, answer_key: the flat format's columns.
        data_source: for rows that name none (flat files without the column, a null or "").
        wrap_template: wrap each problem (flat: the question; dapo: the last user message) in
            the DAPO instruction template, unless it already starts with it.
        dedup: rows with the same ``extra_info.index`` or the same prompt messages are one
            problem; ``copies`` counts them (an index two prompts share: a bad row). With
            False every row is its own Problem, uid suffixed ``#k`` (the k-th copy, from 0),
            for users who want repeats to weigh more.
        on_bad_row: "error" raises DataError at the first bad row; "skip" skips each one and
            records it in ``skipped``.
        truth_rules: a row's data_source -> the rule its ground truth must follow to be
            graded (:func:`dapo.reward.tasks.truth_rules`); a row that breaks it is a bad
            row. None: any ground truth is kept.

    A repeated problem whose ground truth differs from its first copy's is a bad row either
    way: one of the two answers is wrong, and grading against either would be a guess.

    Example:
        >>> data = load_problems("aime-2024.parquet")  # 960 rows
        >>> len(data.problems), set(data.copies.values())
        (30, {32})
    """
    return load_table(
        read_table(path),
        fmt=fmt,
        question_key=question_key,
        answer_key=answer_key,
        data_source=data_source,
        wrap_template=wrap_template,
        dedup=dedup,
        on_bad_row=on_bad_row,
        truth_rules=truth_rules,
    )


def bad_row_error(path: Path, bad: BadRow, hint: str) -> DataError:
    return DataError(f"{path}: row {bad.row}, field {bad.field!r}: {bad.reason}; fix it, or {hint}")


def load_table(
    table: Table,
    *,
    fmt: str,
    question_key: str,
    answer_key: str,
    data_source: str,
    wrap_template: bool,
    dedup: bool,
    on_bad_row: str,
    truth_rules: TruthRules | None = None,
) -> LoadedData:
    """``load_problems`` of a table already read; with ``truth_rules``, a row whose ground
    truth breaks its task's rules is a bad row too (:class:`dapo.data.usable.Screen`)."""
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be one of {', '.join(ON_BAD_ROW)}; got {on_bad_row!r}")
    if not table.records:
        raise DataError(f"{table.path}: holds no rows (an empty file?); give a file of problems")
    fmt, _ = resolve_format(table, fmt, question_key=question_key, answer_key=answer_key)
    out = LoadedData(path=table.path, fmt=fmt, problems=[], copies={}, rows=len(table.records))
    screen = Screen(truth_rules)
    repeats = screen.repeats
    rows = parse_rows(
        table.records,
        fmt,
        question_key=question_key,
        answer_key=answer_key,
        data_source=data_source,
        wrap=wrap_template,
    )
    for r in tracked(rows, f"checking the rows of {table.path.name}", len(table.records)):
        seen = screen(r)
        if isinstance(seen, BadRow):
            if on_bad_row == "error":
                raise bad_row_error(table.path, seen, SKIP_HINT)
            out.skipped.append(seen)
            continue
        uid = seen
        if not dedup:
            uid_k = f"{uid}#{repeats.seen[uid] - 1}"
            out.problems.append(Problem(uid_k, r.messages, r.answer, r.data_source))
            out.copies[uid_k] = 1
            out.first_row[uid_k] = r.row
        elif repeats.seen[uid] == 1:
            out.problems.append(Problem(uid, r.messages, r.answer, r.data_source))
            out.first_row[uid] = r.row
    if dedup:
        out.copies = {p.uid: repeats.seen[p.uid] for p in out.problems}
    out.checked = dict(screen.checked)
    return out
