"""``dapo data check``: what a problem file holds. ``dapo data convert`` and ``make`` live in
:mod:`dapo.data.convert`; the commands import all three from here."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo.data import code_rows, convert
from dapo.data.convert import ConvertResult, make_file
from dapo.data.files import (
    DEFAULT_DATA_SOURCE,
    INTEGER_RE,
    Table,
    load_table,
    read_table,
    records_table,
)
from dapo.data.problems import Problem
from dapo.data.prompts import PROMPT_PREFIX, render_prompts
from dapo.data.rows import EMPTY_ANSWER, BadRow, last_user
from dapo.reward import tasks

__all__ = [
    "UNGRADED",
    "CheckStats",
    "ConvertResult",
    "check_data_source",
    "check_file",
    "convert_file",
    "make_file",
]


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
    """data sources with no verifier in the task registry (:mod:`dapo.reward.tasks`): a
    warning, not a bad row (:data:`UNGRADED`)."""
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
        """Whether every row is usable: no bad row (data.on_bad_row defaults to error). A
        data_source no built-in verifier grades is not counted: a run with a reward function
        of the user's own (reward.function) grades such rows (see :data:`UNGRADED`)."""
        return not self.bad_rows


UNGRADED = (
    "training and evaluation grade such rows only with a reward function of your own (dapo "
    "train reward.function=module:fn, dapo eval --reward-function module:fn) or one verifier "
    "for every row (dapo train reward.mode=dapo, dapo eval --reward-mode dapo), and refuse "
    "them otherwise"
)
"""What a run does with rows whose data_source no built-in verifier grades."""


def check_data_source(name: str | None) -> str | None:
    """The warning for a ``--data-source`` no built-in verifier grades (a task of the user's
    own, graded by reward.function), None for a verifier's name or none given; ValueError for
    a name no row should carry: empty, or with whitespace or control characters."""
    if name is None or name in tasks.names():
        return None
    known = ", ".join(tasks.names())
    if not name or any(c.isspace() or not c.isprintable() for c in name):
        raise ValueError(
            f"--data-source {name!r}: not a data_source name (empty, or with whitespace or "
            f"control characters); give a verifier's name ({known}; math_dapo is the paper's) "
            "or your own task's, one word such as my_task (graded with reward.function)"
        )
    return (
        f"--data-source {name!r}: no built-in verifier of that name (known: {known}); " + UNGRADED
    )


def convert_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    data_source: str | None = None,
    **options: Any,
) -> ConvertResult:
    """:func:`dapo.data.convert.convert_file`, ``data_source`` checked first by
    :func:`check_data_source` (that module sits below the task registry): a malformed name is
    refused; one no built-in verifier grades is written (its warning is the caller's to show)."""
    check_data_source(data_source)
    return convert.convert_file(
        src, dst, data_source=data_source, truth_rules=tasks.truth_rule, **options
    )


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
    humaneval = code_rows.read_as_humaneval(Path(path), fmt)
    table = None if humaneval else read_table(path)
    if humaneval or (fmt == "auto" and code_rows.is_humaneval(table.columns)):
        # As the code rows `dapo data convert` makes of it, screened as it screens them.
        rows = records_table(Path(path), code_rows.humaneval_rows(Path(path), table))
        stats = _check_table(rows, "dapo", "question", "answer", tokenizer)
        return dataclasses.replace(stats, fmt="humaneval")
    return _check_table(table, fmt, question_key, answer_key, tokenizer)


def _check_table(
    table: Table,
    fmt: str,
    question_key: str,
    answer_key: str,
    tokenizer: str | os.PathLike[str] | None,
) -> CheckStats:
    """:func:`check_file` of a table read already."""
    data = load_table(
        table,
        fmt=fmt,
        question_key=question_key,
        answer_key=answer_key,
        data_source=DEFAULT_DATA_SOURCE,
        wrap_template=False,
        dedup=True,
        on_bad_row="skip",
        truth_rules=tasks.truth_rule,
    )
    problems = data.problems
    checked = data.checked
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
        bad_rows=data.skipped,
        checked_truths={k: v for k, v in checked.items() if v},
    )
    if tokenizer is not None and problems:
        stats.prompt_tokens = _prompt_token_stats(problems, str(tokenizer))
    return stats


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
    texts = render_prompts(tok, problems)
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
