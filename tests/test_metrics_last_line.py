"""The last line of ``metrics.jsonl``, read back by a resume with no step left
(:func:`dapo.training.resume.logged_again`): read backwards in linear time, and a line over
``MAX_LINE_BYTES`` read as damaged (nothing logged again) instead of joined block by block in
quadratic time (a 256 MiB line took 658 s)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dapo.training.resume import MAX_LINE_BYTES, logged_again

FIGURES = {"val/accuracy": 0.5}


def _reference(path: Path) -> dict:
    """The last line as dapo read it before the fix (one block prepended at a time)."""
    data, pos, tail = path.read_bytes(), path.stat().st_size, b""
    while pos > 0 and b"\n" not in tail[:-1]:
        size = min(1 << 16, pos)
        pos -= size
        tail = data[pos : pos + size] + tail
    try:
        record = json.loads(tail.rstrip(b"\n").rsplit(b"\n", 1)[-1])
    except (ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def _expected(path: Path, step: int) -> dict:
    record = _reference(path)
    again = {k: v for k, v in record.items() if k != "step"} if record.get("step") == step else {}
    return {**again, **FIGURES}


def test_a_last_line_over_the_cap_is_read_as_damaged(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    pad = "x" * (MAX_LINE_BYTES + (1 << 17))  # a whole line, valid JSON, over the cap
    path.write_text(json.dumps({"step": 1, "a": 1}) + "\n" + json.dumps({"step": 2, "pad": pad}))
    assert logged_again(tmp_path, 2, FIGURES) == FIGURES
    # A line just under the cap, and of many blocks, is read whole.
    pad = "y" * (MAX_LINE_BYTES - 100)
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2, "pad": pad}) + "\n")
    assert logged_again(tmp_path, 2, FIGURES) == {"pad": pad, **FIGURES}


@pytest.mark.parametrize(
    "lines",
    [
        [b'{"step": 3, "a": 1}\n'],
        [b'{"step": 2}\n', b'{"step": 3, "a": 2}\n'],
        [b'{"step": 2}\n', b'{"step": 3, "a": 3}'],  # no final newline
        [b'{"step": 2}\n', b'{"step": 3, "a": 4}\n\n'],  # an empty last line
        [b'{"step": 3, "a": 5}\n', b'{"step": 3, "a": 6'],  # cut mid-line
        [b"\n"],
        [b'{"step": 2, "p": "' + b"z" * 70_000 + b'"}\n', b'{"step": 3, "a": 7}\n'],
        [b'{"step": 2}\n', b'{"step": 3, "p": "' + b"z" * 200_000 + b'"}\n'],
        [b'{"step": 1}\n' * 20_000, b'{"step": 3, "p": "' + b"z" * 65_520 + b'"}\n'],
        [b'{"step": 2}\n', b'{"step": 3, "p": "' + b"z" * 131_040 + b'"}\n\n\n'],
        [b"[" * 100_000 + b"\n"],
        [b'{"step": 1}\n' * 9000, b"\n" * 70_000],
    ],
)
def test_the_last_line_is_read_as_before(tmp_path: Path, lines: list[bytes]) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(lines))
    assert logged_again(tmp_path, 3, FIGURES) == _expected(path, 3)


def test_block_edges_are_read_as_before(tmp_path: Path) -> None:
    """Every place a line's start or the file's end can fall against a 64 KiB block."""
    path = tmp_path / "metrics.jsonl"
    for size in (1 << 16) - 2, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, (1 << 17) - 1, 1 << 17:
        for end in (b"", b"\n", b"\n\n"):
            head = b'{"step": 1}\n'
            body = b'{"step": 3, "p": "' + b"z" * (size - 21 - len(end)) + b'"}'
            path.write_bytes(head + body + end)
            assert os.path.getsize(path) == len(head) + size - 1
            assert logged_again(tmp_path, 3, FIGURES) == _expected(path, 3), (size, end)
