"""Writing the data files of ``dapo data convert`` and ``make``: to a temporary file beside
the output, renamed into place, so that a failure, Ctrl-C or SIGTERM leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dapo.data.files import SUFFIXES, DataError
from dapo.data.progress import Progress, tracked

WRITE_CHUNK_LINES = 65536
"""JSON lines written at a time: each chunk is a progress step (1.39 GB of them for the Hub's
DAPO-Math-17k)."""

ROW_GROUP_ROWS = 1024 * 1024
"""Rows of a Parquet row group: ``pq.write_table``'s own default (pyarrow 13 and later), so a
file written a group at a time is the one that a single call wrote, byte for byte."""

BUILD_PIECE_ROWS = 65536
"""Records made Arrow columns at a time within a row group, each a progress step: building
is most of a Parquet file's time (1.2 million DAPO rows: 2.7 s, the write 0.6 s)."""


class Terminated(BaseException):
    """SIGTERM while a data file is being written: a BaseException, like KeyboardInterrupt,
    so that no ``except Exception`` on the way takes it for an error of the file."""


def check_destination(src: Path, dst: Path) -> None:
    """Refuse an output path of ``dapo data convert``/``make`` that cannot be written as asked."""
    if dst.is_dir():  # before its suffix: a directory has none, and that is not the mistake
        raise DataError(f"{dst}: is a directory; give an output file name")
    if dst.suffix.lower() not in SUFFIXES:
        raise DataError(
            f"{dst}: unknown output file type {dst.suffix or '(no extension)'!r}; "
            f"accepted: {', '.join(SUFFIXES)}"
        )
    if dst.resolve() == src.resolve() or (dst.exists() and src.exists() and dst.samefile(src)):
        raise DataError(f"{dst}: is the input file; write the conversion to another path")
    if not dst.parent.is_dir():
        why = "is a file, not a directory" if dst.parent.exists() else "does not exist"
        raise DataError(f"{dst}: directory {dst.parent} {why}")


def current_umask() -> int:
    """The process's umask, read without setting it: ``os.umask`` sets it for every thread
    for a moment (where /proc has no Umask line, it is set stricter, never looser)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def plain_mode(*, directory: bool = False) -> int:
    """The mode ``open()`` (or ``mkdir()``) gives a new file under the umask: what dapo gives
    the files it writes through mkstemp, mkdtemp or safetensors, all three of which make
    them private (0600, 0700) whatever the umask."""
    return (0o777 if directory else 0o666) & ~current_umask()


def temp_prefix(name: str) -> str:
    """A hidden temporary name's prefix for ``name``, short enough that mkstemp's additions
    (8 characters and a suffix) keep it within a file name's 255 bytes."""
    return "." + name.encode()[:200].decode(errors="ignore") + "."


def write_records(records: list[dict[str, Any]], schema: pa.Schema, dst: Path) -> None:
    """``records`` as the data file ``dst`` (Parquet or JSON Lines by its extension), written
    beside it and renamed into place: an error, Ctrl-C or SIGTERM leaves nothing behind."""
    parquet = dst.suffix.lower() == ".parquet"
    # JSON is encoded before the temporary file exists: a failure there creates nothing.
    # Parquet is built a row group at a time into it (the clean-up below removes it).
    if not parquet:
        rows = tracked(records, f"encoding {dst.name}", len(records))
        lines = [json.dumps(rec, ensure_ascii=False) + "\n" for rec in rows]
    with sigterm_raises():  # before the temporary file exists, so none outlives a SIGTERM
        fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=temp_prefix(dst.name), suffix=".tmp")
        try:
            if parquet:
                os.close(fd)
                _write_parquet(records, schema, Path(tmp), dst)
            else:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    _write_lines(f, lines, dst)
            os.chmod(tmp, plain_mode())
            os.replace(tmp, dst)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _write_parquet(records: list[dict[str, Any]], schema: pa.Schema, tmp: Path, dst: Path) -> None:
    """``records`` as the Parquet file ``tmp``, a row group of :data:`ROW_GROUP_ROWS` at a
    time, built :data:`BUILD_PIECE_ROWS` records at a time with progress (``dst``: its name).
    Each group's pieces are combined into one chunk per column before it is written: a
    column written in chunks gets other page boundaries, other bytes, than ``pq.write_table``
    of the whole table wrote."""
    progress = Progress(f"writing {dst.name}", len(records))
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, len(records), ROW_GROUP_ROWS):
            end = min(start + ROW_GROUP_ROWS, len(records))
            pieces = []
            for first in range(start, end, BUILD_PIECE_ROWS):
                last = min(first + BUILD_PIECE_ROWS, end)
                pieces.append(pa.Table.from_pylist(records[first:last], schema=schema))
                progress.update(last)
            group = pa.concat_tables(pieces).combine_chunks()
            del pieces  # the group's one copy is enough while it is written
            writer.write_table(group, row_group_size=ROW_GROUP_ROWS)
        if not records:  # as write_table writes an empty table: its one empty row group
            writer.write_table(schema.empty_table())


def _write_lines(f: Any, lines: list[str], dst: Path) -> None:
    progress = Progress(f"writing {dst.name}", len(lines), "lines")
    for start in range(0, len(lines), WRITE_CHUNK_LINES):
        f.writelines(lines[start : start + WRITE_CHUNK_LINES])
        progress.update(min(start + WRITE_CHUNK_LINES, len(lines)))


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block SIGTERM raises Terminated, so the writer's clean-up runs (its default
    action ended the process at once, leaving ``.OUT.XXXX.tmp`` behind, or ``dapo export``'s
    ``.OUT.tmp-PID`` with a model's weights); then the process ends
    by SIGTERM after all, with the exit status a kill always gave (143 in a shell, -15 to
    subprocess). Only in the main thread (the only one that may set a handler), and only
    where SIGTERM has its default action: a handler of the caller's (the trainer's, ``dapo
    eval``'s) is left to do its own work."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered before kill returns: the process ends
        raise SystemExit(128 + signal.SIGTERM) from None  # reached only if SIGTERM is blocked
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
