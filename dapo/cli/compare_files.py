"""The files ``dapo eval --compare A B`` reads: each evaluation's ``problems.jsonl``, one
record (uid, metrics, ground truth) per problem. They may come from elsewhere: anything but
such records is named by file and line, not met as a traceback later."""

from __future__ import annotations

import json
import shlex
from pathlib import Path


def read_problems(path: Path) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Each problem's metrics and ground truth (where its record has one), by uid."""
    path = path / "problems.jsonl" if path.is_dir() else path
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise ValueError(f"--compare: cannot read {path}: {exc.strerror}") from None
    out: dict[str, dict[str, float]] = {}
    truths: dict[str, str] = {}
    first: dict[str, int] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue  # a blank line (an editor's last newline) holds no record
        record = record_of(line)
        if record is None:
            raise ValueError(
                f"--compare: {path} line {i + 1} is not a dapo eval record (a uid, and metrics "
                "whose values are finite numbers)"
            )
        if record[0] in first:  # joined files: the last record alone would count, unsaid
            raise ValueError(
                f"--compare: {path} line {i + 1} repeats uid {record[0]!r} of line "
                f"{first[record[0]]}: one record per problem, as dapo eval writes them (for "
                "more samples per problem, evaluate once with a larger --k)"
            )
        first[record[0]] = i + 1
        out[record[0]] = record[1]
        if record[2] is not None:
            truths[record[0]] = record[2]
    if not out:
        raise ValueError(
            f"--compare: {path} holds no dapo eval record (one JSON line per problem, as dapo "
            "eval writes problems.jsonl)"
        )
    return out, truths


def refuse_model_files(*paths: Path) -> None:
    """Refuse a GGUF file (by its name or its first bytes) as a side of ``--compare``: it is a
    model, but one that dapo reads only once imported (read as an evaluation, its bytes were
    "not a dapo eval record")."""
    for path in paths:
        if path.is_file() and (path.suffix.lower() == ".gguf" or _starts_gguf(path)):
            raise ValueError(
                f"--compare: {path} is a GGUF file, not a model directory: import it first, "
                f"`dapo model import {shlex.quote(str(path))} OUT_DIR`, and compare OUT_DIR "
                "(with --data)"
            )


def _starts_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False  # read_problems names what cannot be read


def data_needed(*paths: Path) -> ValueError:
    """The refusal of models to compare without ``--data``; a side that is no local path was
    read as a Hub model id, which a mistyped evaluation's path (``evals/nothere``) looks
    like: named."""
    missing = [p for p in paths if not p.exists() and str(p) != "embedded"]
    hub = f"; {missing[0]} is no local path, so it was read as a Hub model id" if missing else ""
    return ValueError(f"--compare with a model directory needs --data FILE (or arith){hub}")


def same_problems(a: dict[str, str], b: dict[str, str]) -> None:
    """Refuse to pair problems whose ground truths differ: two files may number their
    problems alike (AIME's copies use 0-29 in different orders)."""
    differ = sorted(uid for uid in a.keys() & b.keys() if a[uid] != b[uid])
    if differ:
        uid = differ[0]
        raise ValueError(
            f"--compare: {len(differ)} problems of the same uid have other ground truths in A "
            f"and B (uid {uid}: {a[uid][:40]!r} vs {b[uid][:40]!r}): the evaluations are of "
            "different data; compare two evaluations of one file"
        )


def record_of(line: str) -> tuple[str, dict[str, float], str | None] | None:
    """(uid, metrics) of one problems.jsonl line, or None for anything else. Files compared may
    come from elsewhere: a 5000-digit int, nesting deeper than the parser recurses and a number
    beyond a float's range are named as a bad line here, not met as a traceback later."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("metrics"), dict):
        return None
    uid, metrics = record.get("uid"), record["metrics"]
    from dapo.report.runs import is_number

    if not isinstance(uid, str) or not all(is_number(v) for v in metrics.values()):
        return None
    truth = record.get("ground_truth")
    truth = str(truth) if isinstance(truth, str | int) and not isinstance(truth, bool) else None
    return uid, {str(k): float(v) for k, v in metrics.items()}, truth
