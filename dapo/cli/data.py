"""``dapo data check FILE`` and ``dapo data convert IN OUT``: inspect and rewrite problem files.

Files are Parquet or JSON Lines, in the DAPO format (chat ``prompt``,
``reward_model.ground_truth``, ``data_source``) or a flat question/answer table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapo.data.tools import CheckStats

MAX_BAD_ROWS_SHOWN = 10
CHECK_DESCRIPTION = (
    "Read FILE as training or validation data and report what a run would get from it; "
    "rows of a task with rules for its ground truth (code: a JSON entry point and "
    "tests that parse) are checked by them. Exit status 0 when every row is usable, 1 "
    "when some are not (they are listed), 2 when FILE cannot be read "
    "as problems (missing, unknown format or columns: the message says which). "
    "Rows whose data_source no built-in verifier grades (a task of your own) are a "
    "warning, not a failure: a run grades them only with reward.function (or reward.mode). "
    "Progress lines of a large file go to stderr."
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``data check`` and ``data convert`` on the ``dapo`` command's subparsers."""
    data = subparsers.add_parser(
        "data",
        help="check or convert a problem file (Parquet or JSON Lines)",
        description=__doc__,
    )
    sub = data.add_subparsers(dest="data_command", required=True, metavar="{check,convert,make}")

    check = sub.add_parser(
        "check",
        help="report rows, problems, repeats, answers and bad rows of a problem file",
        description=CHECK_DESCRIPTION,
    )
    check.add_argument("file", type=Path, metavar="FILE", help=".parquet, .jsonl or .json lines")
    add_format_args(check)
    check.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="a local Hugging Face tokenizer directory or a Hub model id: also report prompt "
        "lengths in tokens",
    )
    check.set_defaults(func=cmd_check)

    convert = sub.add_parser(
        "convert",
        help="write a problem file in the other format (dapo <-> flat)",
        description=(
            "Convert IN to OUT row for row; OUT's type follows its extension (.parquet, .jsonl). "
            "To dapo, each problem is wrapped in the DAPO instruction template (never twice), as "
            "in the official DAPO-Math-17k and AIME files; to flat, the template is removed."
        ),
    )
    convert.add_argument("src", type=Path, metavar="IN", help="input file")
    convert.add_argument("dst", type=Path, metavar="OUT", help="output file (not IN)")
    convert.add_argument(
        "--to", choices=("dapo", "flat"), help="output format (default: the other one than IN's)"
    )
    add_format_args(convert)
    convert.add_argument(
        "--data-source",
        metavar="NAME",
        help="data_source of every output row: a verifier's name (math_dapo, math_verify, ...) "
        "or your own task's (a warning: a run grades its rows only with reward.function or "
        "reward.mode); default: math_dapo to dapo, IN's to flat",
    )
    convert.add_argument(
        "--on-bad-row",
        choices=("error", "skip"),
        default="error",
        help="error: stop at the first unusable row; skip: leave such rows out (default error)",
    )
    convert.set_defaults(func=cmd_convert)

    _add_make_parser(sub)


def _add_make_parser(sub: argparse._SubParsersAction) -> None:
    make = sub.add_parser(
        "make",
        help="write a generated task's problems (code-easy) in the DAPO format",
        description=(
            "Write COUNT generated problems to OUT (.parquet or .jsonl). code-easy: write "
            "compute(a, ...) returning a short arithmetic expression of its arguments, graded by "
            "running five asserts in the code task's sandbox (data_source code)."
        ),
    )
    make.add_argument("task", choices=("code-easy",), help="the generated task")
    make.add_argument(
        "dst", type=Path, metavar="OUT", help="output file (missing directories are created)"
    )
    make.add_argument("--count", type=int, default=1000, help="problems (default 1000)")
    make.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    make.add_argument(
        "--skip",
        type=int,
        default=0,
        help="leave out the seed's first N problems: a held-out file disjoint from a training "
        "file of N problems made with the same seed (none of its problems computes what one "
        "of those does, b + a after a + b, nor what another of its own does)",
    )
    make.set_defaults(func=cmd_make)


def add_format_args(parser: argparse.ArgumentParser) -> None:
    """``--format``, ``--question-key`` and ``--answer-key``: how a problem file is read
    (``dapo data check``, ``convert`` and ``dapo eval``)."""
    parser.add_argument(
        "--format",
        choices=("auto", "dapo", "flat", "humaneval"),
        default="auto",
        help="input format (default auto: dapo when there are prompt and reward_model "
        "columns, humaneval for task_id, prompt, entry_point and test or a gzip-compressed file "
        "(.jsonl.gz), else flat)",
    )
    parser.add_argument(
        "--question-key",
        default="question",
        metavar="K",
        help="flat format's question column (default question)",
    )
    parser.add_argument(
        "--answer-key",
        default="answer",
        metavar="K",
        help="flat format's answer column (default answer)",
    )


def cmd_check(args: argparse.Namespace) -> int:
    from dapo.data.progress import shown
    from dapo.data.tools import check_file

    with shown():  # a large file takes a minute: progress lines on stderr
        stats = check_file(
            args.file,
            fmt=args.format,
            question_key=args.question_key,
            answer_key=args.answer_key,
            tokenizer=args.tokenizer,
        )
    print(format_check(stats))
    return 0 if stats.clean else 1


def format_check(s: CheckStats) -> str:
    """The report ``dapo data check`` prints."""
    lines = [
        f"file: {s.path}",
        f"format: {s.fmt}",
        f"rows: {s.rows:,}",
        "schema:",
        *(f"  {name}: {kind}" for name, kind in s.schema),
        f"distinct problems: {s.problems:,}",
        f"duplicate rows: {s.duplicate_rows:,}",
    ]
    if s.duplicate_rows:
        lines[-1] += (
            f" ({s.repeated_problems:,} problems appear more than once, at most "
            f"{s.max_copies} times; training draws each once)"
        )
    if s.whitespace_twins:
        lines.append(
            f"near-duplicates: {s.whitespace_twins:,} problems equal another one up to "
            "leading/trailing whitespace (kept apart)"
        )
    lines.append(f"DAPO template: {s.templated:,} of {s.problems:,} problems already wrapped")
    lines.append(f"empty answers: {s.empty_answers:,}")
    examples = ", ".join(f"row {row}: {_clip(answer)!r}" for row, answer in s.non_integer_examples)
    non_integer = f"non-integer answers: {s.non_integer_answers:,}"
    lines.append(non_integer + (f" (e.g. {examples})" if examples else ""))
    for name, n in (s.checked_truths or {}).items():
        lines.append(f"{name} ground truths checked by the task's own rules: {n:,}")
    sources = ", ".join(f"{name} {n:,}" for name, n in s.data_sources.items())
    lines.append(f"data sources (problems): {sources or 'none'}")
    if s.unknown_sources:
        from dapo.data.tools import UNGRADED

        lines.append(
            f"  warning: no verifier in dapo.reward.tasks for: {', '.join(s.unknown_sources)} "
            f"(not bad rows); {UNGRADED}; or convert with `dapo data convert --to dapo` "
            "(data_source math_dapo), or add a task"
        )
    if s.prompt_tokens is not None:
        t = s.prompt_tokens
        lines.append(
            "prompt tokens: "
            + ", ".join(f"{k} {v:g}" for k, v in t.items())
            + " (one per distinct problem, as rendered for rollout)"
        )
    lines.append(f"bad rows: {len(s.bad_rows):,}" + (" (skipped)" if s.bad_rows else ""))
    lines.extend(f"  {b}" for b in s.bad_rows[:MAX_BAD_ROWS_SHOWN])
    if len(s.bad_rows) > MAX_BAD_ROWS_SHOWN:
        lines.append(f"  ... and {len(s.bad_rows) - MAX_BAD_ROWS_SHOWN:,} more")
    return "\n".join(lines)


def cmd_convert(args: argparse.Namespace) -> int:
    from dapo.data.progress import shown
    from dapo.data.tools import check_data_source, convert_file

    warning = check_data_source(args.data_source)  # a malformed name: refused before reading
    with shown():
        result = convert_file(
            args.src,
            args.dst,
            to=args.to,
            fmt=args.format,
            question_key=args.question_key,
            answer_key=args.answer_key,
            data_source=args.data_source,
            on_bad_row=args.on_bad_row,
        )
    line = (
        f"wrote {result.rows_out:,} of {result.rows_in:,} rows ({result.src_fmt} -> {result.to}) "
        f"to {args.dst}"
    )
    if result.to == "dapo":
        line += f"; {result.wrapped:,} rows newly wrapped in the DAPO template"
    print(line)
    for b in result.skipped[:MAX_BAD_ROWS_SHOWN]:
        print(f"  skipped {b}")
    if len(result.skipped) > MAX_BAD_ROWS_SHOWN:
        print(f"  ... and {len(result.skipped) - MAX_BAD_ROWS_SHOWN:,} more skipped")
    if warning:  # after the progress lines, where it is seen
        print(f"dapo: warning: {warning}", file=sys.stderr)
    return 0


def cmd_make(args: argparse.Namespace) -> int:
    from dapo.data.progress import shown
    from dapo.data.tools import make_file

    with shown():
        rows = make_file(args.task, args.dst, count=args.count, seed=args.seed, skip=args.skip)
    print(f"wrote {rows:,} {args.task} problems to {args.dst}")
    return 0


def _clip(text: str, limit: int = 60) -> str:
    # A code row's answer is a JSON object of tests: a line of the report, not the whole of it.
    return text if len(text) <= limit else text[: limit - 3] + "..."
