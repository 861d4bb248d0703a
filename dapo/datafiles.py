"""Problem files on disk: the DAPO Parquet schema and flat question/answer tables.

Two formats (spec, "Data"):

- ``dapo``: ``prompt`` is a list of {role, content} chat messages, the answer is
  ``reward_model.ground_truth``, ``data_source`` picks the verifier; ``ability`` and
  ``extra_info`` are optional, and ``extra_info.index`` names the problem. The official
  DAPO-Math-17k and AIME 2024 files use it.
- ``flat``: a question column and an answer column (names configurable), and optionally a
  ``data_source`` column.

Either is read from Parquet (pyarrow) or JSON Lines. ``load_problems`` validates every row,
merges repeated rows into one Problem (the official AIME file holds each of its 30 problems
32 times, for avg@32) and records the rows it could not use; ``check_file`` computes what
``dapo data check`` prints; ``convert_file`` writes one format as the other.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import statistics
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dapo.data import PROMPT_PREFIX, PROMPT_SUFFIX, Problem, dapo_prompt

__all__ = [
    "DAPO_ABILITY",
    "DAPO_STYLE",
    "DEFAULT_DATA_SOURCE",
    "FORMATS",
    "SUFFIXES",
    "BadRow",
    "CheckStats",
    "ConvertResult",
    "DataError",
    "LoadedData",
    "check_file",
    "convert_file",
    "load_problems",
    "strip_template",
]

FORMATS = ("dapo", "flat")
ON_BAD_ROW = ("error", "skip")
# ".json" is read as JSON Lines too (one object per line), as Hugging Face datasets write it.
SUFFIXES = (".parquet", ".jsonl", ".json")
DEFAULT_DATA_SOURCE = "math_dapo"
# What the official DAPO files hold in these columns; ``convert_file`` writes the same.
DAPO_ABILITY = "MATH"
DAPO_STYLE = "rule-lighteval/MATH_v2"

SKIP_HINT = "pass data.on_bad_row=skip to skip and count such rows"
EMPTY_ANSWER = "empty answer"
_MESSAGE_FIELDS = ("role", "content")
_GROUND_TRUTH = "reward_model.ground_truth"
# DAPO-Math-17k's answers all match this (its SOURCE.md); anything else is graded only
# as well as the verifier's normalisation allows, so ``check`` counts it.
_INTEGER_RE = re.compile(r"-?[0-9]+")


class DataError(ValueError):
    """A data file that cannot be used as it is; the message names the file, row and field."""


@dataclass(frozen=True)
class BadRow:
    row: int
    """0-based position of the row in the file (JSON Lines: among its non-blank lines)."""
    field: str
    reason: str

    def __str__(self) -> str:
        return f"row {self.row}, field {self.field}: {self.reason}"


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


@dataclass(frozen=True)
class _Row:
    row: int
    messages: tuple[dict[str, str], ...]  # as the model will see them
    raw_messages: tuple[dict[str, str], ...]  # as the file has them
    answer: str
    answer_field: str
    data_source: str
    index: str | None  # extra_info.index


@dataclass(frozen=True)
class _Table:
    path: Path
    records: list[Any]  # dicts; a str (why) for a JSON line that could not be read as one
    columns: list[str]
    schema: list[tuple[str, str]]  # (column, type) as pyarrow infers it


# --- reading -----------------------------------------------------------------------------------


def _read_table(path: str | os.PathLike[str]) -> _Table:
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise DataError(
            f"{path}: unknown data file type {path.suffix or '(no extension)'!r}; "
            f"accepted: {', '.join(SUFFIXES)} (.json is read as JSON Lines, one object per line)"
        )
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    if path.suffix.lower() == ".parquet":
        try:
            table = pq.read_table(path)
        except (OSError, pa.ArrowException) as exc:
            raise DataError(f"{path}: cannot be read as Parquet: {exc}") from None
        schema = [(f.name, str(f.type)) for f in table.schema]
        return _Table(path, table.to_pylist(), table.column_names, schema)
    return _read_jsonl(path)


def _read_jsonl(path: Path) -> _Table:
    records: list[Any] = []
    columns: dict[str, None] = {}  # first-seen order
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if not records and line.lstrip().startswith("["):
                    raise DataError(
                        f"{path}: holds a JSON array; write one JSON object per line (JSON Lines)"
                    )
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    records.append(f"line {lineno} is not valid JSON ({exc.msg})")
                    continue
                if not isinstance(rec, dict):
                    records.append(f"line {lineno} is a JSON {_json_type(rec)}, not an object")
                    continue
                records.append(rec)
                columns.update(dict.fromkeys(rec))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text, so not JSON Lines ({exc})") from None
    objects = [r for r in records if isinstance(r, dict)]
    try:
        schema = [(f.name, str(f.type)) for f in pa.Table.from_pylist(objects).schema]
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        # Rows disagree on a column's type (a number here, a string there): say which.
        schema = []
        for col in columns:
            kinds = sorted({_json_type(r.get(col)) for r in objects} - {"null"}) or ["null"]
            schema.append((col, kinds[0] if len(kinds) == 1 else "mixed: " + " | ".join(kinds)))
    return _Table(path, records, list(columns), schema)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "list"
    return {int: "int", float: "float", str: "string"}.get(type(value), type(value).__name__)


def _resolve_format(
    table: _Table, fmt: str, *, question_key: str, answer_key: str
) -> tuple[str, list[str]]:
    """The format to read ``table`` as, and the columns every row needs for it."""
    if fmt not in ("auto", *FORMATS):
        raise ValueError(f"data format must be one of auto, {', '.join(FORMATS)}; got {fmt!r}")
    if fmt == "auto":
        fmt = "dapo" if {"prompt", "reward_model"} <= set(table.columns) else "flat"
    need = ["prompt", "reward_model"] if fmt == "dapo" else [question_key, answer_key]
    missing = [c for c in need if c not in table.columns]
    if missing and table.records:
        fix = (
            "name the columns with --question-key/--answer-key (data.question_key/answer_key)"
            if fmt == "flat"
            else "is it a flat question/answer file? use --format flat (data.format=flat)"
        )
        raise DataError(
            f"{table.path}: read as {fmt} format, it has no column {', '.join(map(repr, missing))}"
            f" (columns: {', '.join(table.columns) or 'none'}); {fix}"
        )
    return fmt, need


# --- one row -----------------------------------------------------------------------------------


def strip_template(content: str) -> str:
    """The raw problem inside a DAPO-templated message; ``content`` itself if it is not one."""
    if (
        content.startswith(PROMPT_PREFIX)
        and content.endswith(PROMPT_SUFFIX)
        and len(content) >= len(PROMPT_PREFIX) + len(PROMPT_SUFFIX)
    ):
        return content[len(PROMPT_PREFIX) : len(content) - len(PROMPT_SUFFIX)]
    return content


def _wrap(content: str) -> str:
    # Never wrap twice: the official files already carry the template.
    return content if content.startswith(PROMPT_PREFIX) else dapo_prompt(content)


def _last_user(messages: tuple[dict[str, str], ...]) -> int | None:
    for k in range(len(messages) - 1, -1, -1):
        if messages[k]["role"] == "user":
            return k
    return None


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _answer(value: Any) -> str:
    """The ground truth as a stripped string; raises ValueError with the reason."""
    if value is None:
        raise ValueError("missing")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(
            f"must be a string or an integer, got {_json_type(value)} {_short(value)}"
            "; write it as a string if it is meant as text"
        )
    text = str(value).strip()
    if not text:
        raise ValueError(EMPTY_ANSWER)
    return text


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if value is None:
        raise ValueError("missing")
    if not isinstance(value, list):
        raise ValueError(
            f"must be a list of {{role, content}} messages, got {_json_type(value)} {_short(value)}"
        )
    if not value:
        raise ValueError("empty prompt (no messages)")
    out = []
    for k, m in enumerate(value):
        if not (isinstance(m, dict) and all(isinstance(m.get(f), str) for f in _MESSAGE_FIELDS)):
            raise ValueError(
                f"message {k} must be a {{role, content}} pair of strings, got {_short(m)}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in out):
        raise ValueError("empty prompt (no message has any content)")
    return tuple(out)


def _data_source(value: Any, default: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a non-empty string, got {_short(value)}")
    return value


def _index(extra_info: Any) -> str | None:
    if extra_info is None:
        return None
    if not isinstance(extra_info, dict):
        raise ValueError(f"must be a struct (object), got {_short(extra_info)}")
    index = extra_info.get("index")
    if index is None or index == "":
        return None
    if isinstance(index, bool) or not isinstance(index, (str, int)):
        raise ValueError(f"index must be an integer or a string, got {_short(index)}")
    return str(index)


def _parse(
    i: int,
    rec: Any,
    *,
    fmt: str,
    question_key: str,
    answer_key: str,
    data_source: str,
    wrap_template: bool,
) -> _Row | BadRow:
    """Validate one row; the first problem found is returned as a BadRow."""
    if isinstance(rec, str):  # a JSON line that is not an object
        return BadRow(i, "(row)", rec)
    name = "prompt"
    try:
        if fmt == "dapo":
            raw = _messages(rec.get("prompt"))
            name = "reward_model"
            reward_model = rec.get("reward_model")
            if reward_model is None:
                raise ValueError("missing")
            if not isinstance(reward_model, dict):
                raise ValueError(f"must be a struct (object), got {_short(reward_model)}")
            name, answer_field = _GROUND_TRUTH, _GROUND_TRUTH
            answer = _answer(reward_model.get("ground_truth"))
            name = "data_source"
            source = _data_source(rec.get("data_source"), data_source)
            name = "extra_info"
            index = _index(rec.get("extra_info"))
        else:
            name = question_key
            question = rec.get(question_key)
            if question is None:
                raise ValueError("missing")
            if not isinstance(question, str):
                raise ValueError(f"must be a string, got {_json_type(question)} {_short(question)}")
            if not question.strip():
                raise ValueError("empty prompt (blank question)")
            raw = ({"role": "user", "content": question},)
            name = answer_field = answer_key
            answer = _answer(rec.get(answer_key))
            name = "data_source"
            source = _data_source(rec.get("data_source"), data_source)
            index = None
        messages = raw
        if wrap_template:
            name = "prompt" if fmt == "dapo" else question_key
            k = _last_user(raw)
            if k is None:
                raise ValueError("has no user message to wrap in the DAPO template")
            wrapped = dict(raw[k], content=_wrap(raw[k]["content"]))
            messages = raw[:k] + (wrapped,) + raw[k + 1 :]
    except ValueError as exc:
        return BadRow(i, name, str(exc))
    return _Row(i, messages, raw, answer, answer_field, source, index)


def _rows(
    table: _Table, fmt: str, *, question_key: str, answer_key: str, data_source: str, wrap: bool
) -> Iterator[_Row | BadRow]:
    for i, rec in enumerate(table.records):
        yield _parse(
            i,
            rec,
            fmt=fmt,
            question_key=question_key,
            answer_key=answer_key,
            data_source=data_source,
            wrap_template=wrap,
        )


def _prompt_hash(messages: tuple[dict[str, str], ...]) -> str:
    text = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _bad_row_error(path: Path, bad: BadRow, hint: str) -> DataError:
    return DataError(f"{path}: row {bad.row}, field {bad.field!r}: {bad.reason}; fix it, or {hint}")


# --- whole files -------------------------------------------------------------------------------


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
) -> LoadedData:
    """Read a problem file (Parquet or JSON Lines, in the dapo or flat format).

    Args:
        fmt: "dapo", "flat", or "auto": dapo when the file has ``prompt`` and ``reward_model``
            columns, flat otherwise.
        question_key, answer_key: the flat format's columns.
        data_source: for rows that name none (flat files without the column, or a null).
        wrap_template: wrap each problem (flat: the question; dapo: the last user message) in
            the DAPO instruction template, unless it already starts with it.
        dedup: rows with the same ``extra_info.index`` or the same prompt messages are one
            problem; ``copies`` counts them. With False every row is its own Problem, uid
            suffixed ``#k`` (the k-th copy, from 0), for users who want repeats to weigh more.
        on_bad_row: "error" raises DataError at the first bad row; "skip" skips each one and
            records it in ``skipped``.

    A repeated problem whose ground truth differs from its first copy's is a bad row either
    way: one of the two answers is wrong, and grading against either would be a guess.

    Example:
        >>> data = load_problems("aime-2024.parquet")  # 960 rows
        >>> len(data.problems), set(data.copies.values())
        (30, {32})
    """
    table = _read_table(path)
    return _load(
        table,
        fmt=fmt,
        question_key=question_key,
        answer_key=answer_key,
        data_source=data_source,
        wrap_template=wrap_template,
        dedup=dedup,
        on_bad_row=on_bad_row,
    )


def _load(
    table: _Table,
    *,
    fmt: str,
    question_key: str,
    answer_key: str,
    data_source: str,
    wrap_template: bool,
    dedup: bool,
    on_bad_row: str,
) -> LoadedData:
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be one of {', '.join(ON_BAD_ROW)}; got {on_bad_row!r}")
    fmt, _ = _resolve_format(table, fmt, question_key=question_key, answer_key=answer_key)
    out = LoadedData(path=table.path, fmt=fmt, problems=[], copies={}, rows=len(table.records))
    answers: dict[str, str] = {}  # base uid -> ground truth of its first copy
    seen: Counter[str] = Counter()  # base uid -> rows so far
    by_index: dict[str, str] = {}
    by_prompt: dict[tuple[tuple[str, str], ...], str] = {}

    def bad(b: BadRow) -> None:
        if on_bad_row == "error":
            raise _bad_row_error(table.path, b, SKIP_HINT)
        out.skipped.append(b)

    rows = _rows(
        table,
        fmt,
        question_key=question_key,
        answer_key=answer_key,
        data_source=data_source,
        wrap=wrap_template,
    )
    first_row: dict[str, int] = {}
    for r in rows:
        if isinstance(r, BadRow):
            bad(r)
            continue
        key = tuple((m["role"], m["content"]) for m in r.messages)
        uid = by_index.get(r.index) if r.index is not None else None
        if uid is None:
            uid = by_prompt.get(key)
        if uid is not None and r.answer != answers[uid]:
            bad(
                BadRow(
                    r.row,
                    r.answer_field,
                    f"ground truth {r.answer!r} differs from row {first_row[uid]}'s "
                    f"{answers[uid]!r} for the same problem",
                )
            )
            continue
        if uid is None:
            uid = r.index if r.index is not None else _prompt_hash(r.raw_messages)
            answers[uid] = r.answer
            first_row[uid] = r.row
        if r.index is not None:
            by_index.setdefault(r.index, uid)
        by_prompt.setdefault(key, uid)
        seen[uid] += 1
        if not dedup:
            uid_k = f"{uid}#{seen[uid] - 1}"
            out.problems.append(Problem(uid_k, r.messages, r.answer, r.data_source))
            out.copies[uid_k] = 1
            out.first_row[uid_k] = r.row
        elif seen[uid] == 1:
            out.problems.append(Problem(uid, r.messages, r.answer, r.data_source))
            out.first_row[uid] = r.row
    if dedup:
        out.copies = {p.uid: seen[p.uid] for p in out.problems}
    return out


@dataclass
class CheckStats:
    """What ``dapo data check`` reports about one file."""

    path: Path
    fmt: str
    rows: int
    schema: list[tuple[str, str]]
    problems: int
    """Distinct problems (rows merged by extra_info.index or identical prompt)."""
    duplicate_rows: int
    """Rows that repeat an earlier row's problem with the same ground truth."""
    repeated_problems: int
    """Problems held by more than one row."""
    max_copies: int
    empty_answers: int
    non_integer_answers: int
    non_integer_examples: list[tuple[int, str]]
    """(row, answer) of up to 5 of them."""
    data_sources: dict[str, int]
    """data_source -> distinct problems."""
    unknown_sources: list[str]
    """data sources with no verifier in dapo.rewards.REWARD_FNS."""
    templated: int
    """Problems whose last user message already starts with the DAPO template."""
    whitespace_twins: int
    """Problems that equal another one up to leading/trailing whitespace in the messages."""
    bad_rows: list[BadRow]
    prompt_tokens: dict[str, float] | None = None
    """min/median/p90/p99/max prompt length in tokens, with a tokenizer."""

    @property
    def clean(self) -> bool:
        return not self.bad_rows


def check_file(
    path: str | os.PathLike[str],
    *,
    fmt: str = "auto",
    question_key: str = "question",
    answer_key: str = "answer",
    tokenizer: str | os.PathLike[str] | None = None,
) -> CheckStats:
    """Load ``path`` skipping bad rows, and count what a user should know before training on it.

    ``tokenizer`` is a local Hugging Face tokenizer directory; prompts are rendered as the
    trainer renders them (the chat template when the tokenizer has one) and measured.
    """
    from dapo.rewards import REWARD_FNS

    table = _read_table(path)
    data = _load(
        table,
        fmt=fmt,
        question_key=question_key,
        answer_key=answer_key,
        data_source=DEFAULT_DATA_SOURCE,
        wrap_template=False,
        dedup=True,
        on_bad_row="skip",
    )
    problems = data.problems
    non_integer = [
        (data.first_row[p.uid], p.answer) for p in problems if not _INTEGER_RE.fullmatch(p.answer)
    ]
    sources = Counter(p.data_source for p in problems)
    stripped = {tuple((m["role"], m["content"].strip()) for m in p.messages) for p in problems}
    templated = 0
    for p in problems:
        k = _last_user(p.messages)
        templated += k is not None and p.messages[k]["content"].startswith(PROMPT_PREFIX)
    stats = CheckStats(
        path=table.path,
        fmt=data.fmt,
        rows=data.rows,
        schema=table.schema,
        problems=len(problems),
        duplicate_rows=sum(data.copies.values()) - len(problems),
        repeated_problems=sum(n > 1 for n in data.copies.values()),
        max_copies=max(data.copies.values(), default=0),
        empty_answers=sum(b.reason == EMPTY_ANSWER for b in data.skipped),
        non_integer_answers=len(non_integer),
        non_integer_examples=non_integer[:5],
        data_sources=dict(sources.most_common()),
        unknown_sources=sorted(s for s in sources if s not in REWARD_FNS),
        templated=templated,
        whitespace_twins=len(problems) - len(stripped),
        bad_rows=data.skipped,
    )
    if tokenizer is not None and problems:
        stats.prompt_tokens = _prompt_token_stats(problems, Path(tokenizer))
    return stats


def _prompt_token_stats(problems: list[Problem], tokenizer_dir: Path) -> dict[str, float]:
    if not tokenizer_dir.is_dir():
        raise ValueError(f"tokenizer {tokenizer_dir}: not a directory; give a local tokenizer")
    from transformers import AutoTokenizer

    # The trainer's own rendering, so the lengths are the ones rollout will see.
    from dapo.evaluate import render_prompt

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = [render_prompt(tok, p) for p in problems]
    lengths = sorted(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])

    def rank(q: float) -> int:  # nearest-rank percentile
        return lengths[max(0, math.ceil(q * len(lengths)) - 1)]

    return {
        "min": lengths[0],
        "median": statistics.median(lengths),
        "p90": rank(0.90),
        "p99": rank(0.99),
        "max": lengths[-1],
    }


# --- conversion --------------------------------------------------------------------------------


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
) -> ConvertResult:
    """Write ``src`` to ``dst`` in the ``to`` format (default: the other one), row for row.

    - to dapo: each raw problem is wrapped in the DAPO template (a message that already has
      it is first unwrapped, so nothing is wrapped twice); ``data_source`` is the given one
      or "math_dapo", ability "MATH", style "rule-lighteval/MATH_v2", and ``extra_info`` holds
      the source's index (the row number when it has none) and the raw problem. Applied to
      the DAPO-Math-17k copy, whose prompts lost the template, this rebuilds the official
      prompts.
    - to flat: the raw problem (template removed) and the answer, plus ``data_source``.

    Repeated rows are kept: conversion changes the format, not the content (``check`` reports
    repeats). The output type follows ``dst``'s extension; it is written to a temporary file
    beside it and renamed into place, so an error leaves nothing behind.
    """
    src, dst = Path(src), Path(dst)
    if to is not None and to not in FORMATS:
        raise ValueError(f"--to must be one of {', '.join(FORMATS)}; got {to!r}")
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be one of {', '.join(ON_BAD_ROW)}; got {on_bad_row!r}")
    if dst.suffix.lower() not in SUFFIXES:
        raise DataError(
            f"{dst}: unknown output file type {dst.suffix or '(no extension)'!r}; "
            f"accepted: {', '.join(SUFFIXES)}"
        )
    if dst.resolve() == src.resolve() or (dst.exists() and src.exists() and dst.samefile(src)):
        raise DataError(f"{dst}: is the input file; write the conversion to another path")
    if dst.is_dir():
        raise DataError(f"{dst}: is a directory; give an output file name")
    if not dst.parent.is_dir():
        raise DataError(f"{dst}: directory {dst.parent} does not exist")

    table = _read_table(src)
    src_fmt, _ = _resolve_format(table, fmt, question_key=question_key, answer_key=answer_key)
    to = to or ("flat" if src_fmt == "dapo" else "dapo")
    hint = "pass --on-bad-row skip to leave such rows out"
    records: list[dict[str, Any]] = []
    skipped: list[BadRow] = []
    indices: list[str] = []  # extra_info.index of each record (to dapo)
    wrapped = 0
    rows = _rows(
        table,
        src_fmt,
        question_key=question_key,
        answer_key=answer_key,
        data_source=DEFAULT_DATA_SOURCE,
        wrap=False,
    )
    for r in rows:
        if isinstance(r, BadRow):
            if on_bad_row == "error":
                raise _bad_row_error(src, r, hint)
            skipped.append(r)
            continue
        k = _last_user(r.raw_messages)
        if to == "flat" and (len(r.raw_messages) != 1 or k != 0):
            b = BadRow(
                r.row,
                "prompt",
                f"has {len(r.raw_messages)} message(s) "
                f"({', '.join(m['role'] for m in r.raw_messages)}); the flat format holds "
                "exactly one user question",
            )
            if on_bad_row == "error":
                raise _bad_row_error(src, b, hint)
            skipped.append(b)
            continue
        if k is None:  # to dapo: nothing to wrap
            b = BadRow(r.row, "prompt", "has no user message to wrap in the DAPO template")
            if on_bad_row == "error":
                raise _bad_row_error(src, b, hint)
            skipped.append(b)
            continue
        content = r.raw_messages[k]["content"]
        problem = strip_template(content)
        if to == "flat":
            records.append(
                {
                    question_key: problem,
                    answer_key: r.answer,
                    "data_source": data_source or r.data_source,
                }
            )
            continue
        wrapped += not content.startswith(PROMPT_PREFIX)
        user = {"content": dapo_prompt(problem), "role": "user"}
        others = [{"content": m["content"], "role": m["role"]} for m in r.raw_messages]
        indices.append(r.index if r.index is not None else str(r.row))
        records.append(
            {
                "data_source": data_source or DEFAULT_DATA_SOURCE,
                "prompt": others[:k] + [user] + others[k + 1 :],
                "ability": DAPO_ABILITY,
                "reward_model": {"ground_truth": r.answer, "style": DAPO_STYLE},
                "extra_info": {"index": None, "raw_problem": problem},
            }
        )
    if to == "dapo":
        # One column type for the index: int64 when every index is an integer, else string.
        all_int = all(_INTEGER_RE.fullmatch(i) and str(int(i)) == i for i in indices)
        for rec, index in zip(records, indices, strict=True):
            rec["extra_info"]["index"] = int(index) if all_int else index
        schema = _dapo_schema(pa.int64() if all_int else pa.string())
    else:
        schema = pa.schema(
            [(question_key, pa.string()), (answer_key, pa.string()), ("data_source", pa.string())]
        )
    _write_atomic(records, schema, dst)
    return ConvertResult(src_fmt, to, len(table.records), len(records), wrapped, skipped)


def _write_atomic(records: list[dict[str, Any]], schema: pa.Schema, dst: Path) -> None:
    parquet = dst.suffix.lower() == ".parquet"
    # Build everything before the temporary file exists: a failure here creates nothing.
    if parquet:
        table = pa.Table.from_pylist(records, schema=schema)
    else:
        lines = [json.dumps(rec, ensure_ascii=False) + "\n" for rec in records]
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    try:
        if parquet:
            os.close(fd)
            pq.write_table(table, tmp)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.writelines(lines)
        # mkstemp makes the file private (0600); give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
