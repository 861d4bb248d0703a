"""Progress lines for long data work: ``dapo data check`` reads the Hub's DAPO-Math-17k
(1,791,700 rows) for about 50 s and ``dapo data convert`` writes it in about a minute, which
without a word looks like a hang.

Lines go to stderr (stdout keeps the report, byte for byte), at most one every
``PROGRESS_SECONDS`` per task, so a file done sooner prints none. They are shown only inside
:func:`shown`, which the ``dapo data`` commands open: a training run loads the same file on
every rank, and the library stays silent for its other callers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

PROGRESS_SECONDS = 5.0
"""The least time between two lines of one task, and before its first."""

EVERY_ROWS = 4096
"""Loops over rows look at the clock once per this many rows: the look costs more than a row."""

T = TypeVar("T")

_LOG: ContextVar[Callable[[str], None] | None] = ContextVar("dapo_data_progress", default=None)


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def shown(log: Callable[[str], None] = to_stderr) -> Iterator[None]:
    """Within the block, data readers and writers report their progress to ``log``."""
    token = _LOG.set(log)
    try:
        yield
    finally:
        _LOG.reset(token)


class Progress:
    """One task (reading a file, checking its rows, writing one): ``update`` says how far it
    is, and a line is shown when PROGRESS_SECONDS have passed since the last (or the start)."""

    def __init__(self, what: str, total: int | None = None, unit: str = "rows") -> None:
        self.what, self.total, self.unit = what, total, unit
        self.start = self.last = time.monotonic()

    def update(self, done: int) -> None:
        log = _LOG.get()
        if log is None:
            return
        now = time.monotonic()
        if now - self.last < PROGRESS_SECONDS:
            return
        self.last = now
        if self.total:  # a share of nothing (an empty file) is no figure
            of = f" of {self.total:,} {self.unit} ({100 * done // self.total}%)"
        else:
            of = f" {self.unit}"
        log(f"  {self.what}: {done:,}{of}, {now - self.start:.0f} s")


def tracked(items: Iterable[T], what: str, total: int | None) -> Iterator[T]:
    """``items``, one by one, reporting as ``Progress(what, total)`` every EVERY_ROWS items."""
    progress = Progress(what, total)
    for i, item in enumerate(items):
        if i % EVERY_ROWS == 0 and i:
            progress.update(i)
        yield item
