"""The records of a ``dapo eval`` as they are made, so that a killed evaluation resumes.

``problems.partial.jsonl`` in the output directory: a first line with the evaluation's
protocol (model, data, k, sampling, seed, ...), then one record per problem, appended and
flushed to disk as each batch finishes. Started again with the same protocol, ``dapo eval``
reads the records back and samples only the problems after them; seeded per problem, the
result is the one an uninterrupted evaluation gives. A different protocol starts afresh. When
the evaluation ends, ``problems.jsonl`` and ``summary.json`` are written and the journal goes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NAME = "problems.partial.jsonl"


def fingerprint(names: Sequence[str]) -> list[Any]:
    """What each local path holds, cheaply: every file under it (a model directory) or it
    (a data file) with its size and modification time in ns; a name that is no local path
    (a Hub id, ``embedded``) as it is. A model rewritten at the same path between a run and
    its resumption would otherwise mix two models' records in one evaluation."""
    out: list[Any] = []
    for name in names:
        path = Path(name)
        if not path.exists():
            out.append(name)
            continue
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        out.append([[str(p.relative_to(path)), *_size_and_time(p)] for p in files])
    return out


def _size_and_time(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


class Journal:
    def __init__(self, out_dir: Path, protocol: dict[str, Any], identity: Any = None) -> None:
        """``identity``: what else must be the same to continue (the files' fingerprint, the
        device), kept in the journal only, not in the evaluation's protocol."""
        self.path = Path(out_dir) / NAME
        self.protocol = protocol if identity is None else {**protocol, "identity": identity}
        self._file: Any = None

    def resume(self, uids: Sequence[str]) -> list[dict[str, Any]]:
        """The records an earlier run of this evaluation finished, for the first problems of
        ``uids`` in order; [] (and a fresh journal) when there is none or it differs."""
        records = self._read(uids)
        self._file = self.path.open("w" if not records else "a", encoding="utf-8")
        if not records:
            self._write([{"protocol": self.protocol}])
        return records

    def _read(self, uids: Sequence[str]) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        records: list[dict[str, Any]] = []
        with self.path.open(encoding="utf-8", errors="replace") as f:
            try:
                if json.loads(f.readline()).get("protocol") != self.protocol:
                    return []
            except (ValueError, AttributeError):
                return []
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    break  # the half line of a killed run: that problem is sampled again
                if len(records) >= len(uids) or record.get("uid") != uids[len(records)]:
                    return []
                records.append(record)
        # Keep exactly the whole lines read, so that appends follow the last complete record.
        text = "".join(json.dumps(x) + "\n" for x in [{"protocol": self.protocol}, *records])
        self.path.write_text(text, encoding="utf-8")
        return records

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        """Add a finished batch's records, on disk before the next batch starts."""
        self._write(records)

    def _write(self, items: Sequence[dict[str, Any]]) -> None:
        self._file.write("".join(json.dumps(x) + "\n" for x in items))
        self._file.flush()
        os.fsync(self._file.fileno())

    def finish(self) -> None:
        """The evaluation's own files are written: the journal is no longer needed."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)
