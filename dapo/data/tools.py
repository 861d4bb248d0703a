"""``dapo data check`` and ``dapo data convert``: what a problem file holds, and the same rows
in the other format (dapo <-> flat)."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
from collections import Counter
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
    bad_row_error,
    check_destination,
    load_table,
    read_table,
    resolve_format,
    write_records,
)
from dapo.data.problems import Problem
from dapo.data.prompts import PROMPT_PREFIX, dapo_prompt, render_prompt, strip_template
from dapo.data.rows import EMPTY_ANSWER, BadRow, Row, last_user, parse_rows
from dapo.reward import tasks

# What the official DAPO files hold in these columns; ``convert_file`` writes the same.
DAPO_ABILITY = "MATH"
DAPO_STYLE = "rule-lighteval/MATH_v2"
_DAPO_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


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
    """data sources with no verifier in the task registry (:mod:`dapo.reward.tasks`)."""
    templated: int
    """Problems whose last user message already starts with the DAPO template."""
    whitespace_twins: int
    """Problems that equal another one up to leading/trailing whitespace in the messages."""
    bad_rows: list[BadRow]
    prompt_tokens: dict[str, float] | None = None
    """min/median/p90/p99/max prompt length in tokens, with a tokenizer."""
    checked_truths: dict[str, int] | None = None
    """data_source -> problems whose ground truth its task checked by its own rules
    (``Task.check_truth``: a code row's JSON entry point and tests); the unusable ones are
    among ``bad_rows``."""

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

    ``tokenizer`` is a local Hugging Face tokenizer directory or a Hub model id; prompts are
    rendered as the trainer renders them (the chat template when the tokenizer has one) and
    measured. A HumanEval file (``fmt`` humaneval, or found by ``auto``) is checked as the code
    rows ``dapo data convert`` makes of it."""
    humaneval = fmt == "humaneval" or (fmt == "auto" and str(path).endswith(".gz"))
    table = None if humaneval else read_table(path)
    if humaneval or (fmt == "auto" and code_rows.is_humaneval(table.columns)):
        return _check_humaneval(Path(path), tokenizer)
    data = load_table(
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
    checked, bad_truths = _check_truths(problems, data.first_row)
    non_integer = [  # a math answer that is not an integer is worth a look, not an error
        (data.first_row[p.uid], p.answer)
        for p in problems
        if p.data_source not in checked and not INTEGER_RE.fullmatch(p.answer.strip())
    ]
    sources = Counter(p.data_source for p in problems)
    stripped = {tuple((m["role"], m["content"].strip()) for m in p.messages) for p in problems}
    templated = 0
    for p in problems:
        k = last_user(p.messages)
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
        unknown_sources=sorted(s for s in sources if s not in tasks.names()),
        templated=templated,
        whitespace_twins=len(problems) - len(stripped),
        bad_rows=sorted([*data.skipped, *bad_truths], key=lambda b: b.row),
        checked_truths={k: v for k, v in checked.items() if v},
    )
    if tokenizer is not None and problems:
        stats.prompt_tokens = _prompt_token_stats(problems, str(tokenizer))
    return stats


def _check_humaneval(path: Path, tokenizer: str | os.PathLike[str] | None) -> CheckStats:
    """:func:`check_file` of the code rows ``dapo data convert`` makes of HumanEval ``path``."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "code-rows.jsonl"
        _write_code_rows(code_rows.humaneval_rows(path), rows, "dapo", "humaneval")
        stats = check_file(rows, tokenizer=tokenizer)
    return dataclasses.replace(stats, path=path, fmt="humaneval")


def _check_truths(
    problems: list[Problem], first_row: dict[str, int]
) -> tuple[dict[str, int], list[BadRow]]:
    """({data_source: problems checked}, the bad rows) of the problems whose task checks its
    ground truths by rules of its own (a registered task with ``check_truth``)."""
    checked: Counter[str] = Counter()
    bad = []
    for p in problems:
        task = tasks.REGISTRY.get(p.data_source)
        if task is None or task.check_truth is None:
            continue
        checked[p.data_source] += 1
        reason = task.check_truth(p.answer)
        if reason is not None:
            bad.append(BadRow(first_row[p.uid], "reward_model.ground_truth", reason))
    return dict(checked), bad


def _prompt_token_stats(problems: list[Problem], tokenizer: str) -> dict[str, float]:
    from dapo.models import hub
    from dapo.models.policy import tokenizer_from_dir

    tokenizer_dir = hub.resolve(tokenizer, setting="--tokenizer")
    if not tokenizer_dir.is_dir():
        raise ValueError(
            f"--tokenizer {tokenizer}: not a directory; give a local tokenizer or a Hub model id"
        )

    # The trainer's own tokenizer loading and rendering: the lengths rollout will see.
    tok = tokenizer_from_dir(tokenizer_dir, setting="--tokenizer")
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

    - to dapo: each raw problem is wrapped in the DAPO template (a message that starts with
      it is kept as it is, so nothing is wrapped twice); ``data_source`` is the given one
      or "math_dapo", ability "MATH", style "rule-lighteval/MATH_v2", and ``extra_info`` holds
      the source's index (the row number when it has none; ``row-N`` when another row's own
      index is that number) and the raw problem. Applied to
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
    check_destination(src, dst)
    if fmt == "humaneval" or (fmt == "auto" and src.name.endswith(".gz")):
        return _write_code_rows(code_rows.humaneval_rows(src), dst, to, "humaneval")
    table = read_table(src)
    if fmt == "auto" and code_rows.is_humaneval(table.columns):
        return _write_code_rows(code_rows.humaneval_rows(src), dst, to, "humaneval")
    src_fmt, _ = resolve_format(table, fmt, question_key=question_key, answer_key=answer_key)
    to = to or ("flat" if src_fmt == "dapo" else "dapo")
    records: list[dict[str, Any]] = []
    skipped: list[BadRow] = []
    indices: list[str] = []  # extra_info.index of each record (to dapo)
    wrapped = 0
    rows = list(
        parse_rows(
            table.records,
            src_fmt,
            question_key=question_key,
            answer_key=answer_key,
            data_source=DEFAULT_DATA_SOURCE,
            wrap=False,
        )
    )
    # A row without an index gets its row number, unless a row's own index is that number
    # (the two would then read as one problem): then "row-N".
    taken = {r.index for r in rows if not isinstance(r, BadRow) and r.index is not None}
    for r in rows:
        out = r if isinstance(r, BadRow) else _convert_row(r, to, question_key, answer_key)
        if isinstance(out, BadRow):
            if on_bad_row == "error":
                raise bad_row_error(src, out, "pass --on-bad-row skip to leave such rows out")
            skipped.append(out)
            continue
        record, newly_wrapped = out
        if to == "flat":
            record["data_source"] = data_source or r.data_source
        else:
            record["data_source"] = data_source or DEFAULT_DATA_SOURCE
            indices.append(r.index if r.index is not None else _free_index(r.row, taken))
        wrapped += newly_wrapped
        # The official files' column order, data_source first (JSON Lines keeps it).
        order = _DAPO_COLUMNS if to == "dapo" else (question_key, answer_key, "data_source")
        records.append({key: record[key] for key in order})
    write_records(records, _schema(records, indices, to, question_key, answer_key), dst)
    return ConvertResult(src_fmt, to, len(table.records), len(records), wrapped, skipped)


def _free_index(row: int, taken: set[str]) -> str:
    """An index for row ``row``, which has none: its number, else one no row holds."""
    index, n = str(row), 0
    while index in taken:
        n += 1
        index = f"row-{row}" + (f"-{n}" if n > 1 else "")
    taken.add(index)
    return index


def _write_code_rows(
    records: list[dict[str, Any]], dst: Path, to: str | None, src_fmt: str
) -> ConvertResult:
    if to not in (None, "dapo"):
        raise ValueError(f"a {src_fmt} file converts to the dapo format (code rows), not {to}")
    write_records(records, _dapo_schema(pa.string()), dst)
    return ConvertResult(src_fmt, "dapo", len(records), len(records), 0, [])


def make_file(
    task: str, dst: str | os.PathLike[str], *, count: int, seed: int, skip: int = 0
) -> int:
    """Write ``count`` generated problems of ``task`` (``code-easy``) to ``dst``, after the
    first ``skip`` of the seed's sequence (so that a held-out file shares no problem, in text
    or in what it computes, with a training file of ``skip`` problems and the same seed)."""
    if task != "code-easy":
        raise ValueError(f"unknown task {task!r}; dapo data make knows code-easy")
    if count < 1 or skip < 0:
        raise ValueError(f"--count must be >= 1 and --skip >= 0, got {count} and {skip}")
    dst = Path(dst)
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
    # One column type for the index: int64 when every index is an integer, else string.
    all_int = all(INTEGER_RE.fullmatch(i) and str(int(i)) == i for i in indices)
    for rec, index in zip(records, indices, strict=True):
        rec["extra_info"]["index"] = int(index) if all_int else index
    return _dapo_schema(pa.int64() if all_int else pa.string())
