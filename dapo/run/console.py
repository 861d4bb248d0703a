"""stdout for a long command whose reader may leave (``dapo train | head -1``, a killed
``tee``): the run's results are in its files, so it goes on without its console."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, TextIO


def silence(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at /dev/null once its reader has gone: whatever prints
    to it later, and the interpreter's flush at exit, would fail with BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


class ReaderMayLeave:
    """``stream``, whose first BrokenPipeError silences it (:func:`silence`) and says so once
    on stderr instead of raising; everything else is the stream's own."""

    def __init__(self, stream: TextIO, command: str) -> None:
        self._stream, self._command, self.left = stream, command, False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._reader_left()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_left()

    def _reader_left(self) -> None:
        if not self.left:
            self.left = True
            silence(self._stream)
            with contextlib.suppress(OSError):
                print(
                    f"dapo: warning: stdout was closed (its reader ended); dapo {self._command} "
                    "goes on, its results in its files",
                    file=sys.stderr,
                    flush=True,
                )
        with contextlib.suppress(BrokenPipeError):
            self._stream.flush()  # what it held goes to /dev/null now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
