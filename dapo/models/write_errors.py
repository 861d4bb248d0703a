"""A full or read-only disk met while dapo writes a directory of its own making (an export, a
model import) is named by the directory the user gave: the error itself names dapo's
temporary file beside it, or, for a copy, the checkpoint file being read, and the user frees
space or picks another place where the output goes."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = ["WRITE_ERRNOS", "disk_errno", "named_by"]

WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""Errors only a write can meet: no room, no quota, a file size limit, a read-only file
system."""


def disk_errno(exc: BaseException) -> int | None:
    """The errno of ``exc`` when it is a write refused for want of room or a writable disk:
    an OSError's, or the one safetensors' ``SafetensorError`` gives in its text ("I/O error:
    No space left on device (os error 28)"; before 0.5, "IoError(Os { code: 28, ...})");
    None for anything else."""
    if isinstance(exc, OSError):
        return exc.errno if exc.errno in WRITE_ERRNOS else None
    if type(exc).__name__ == "SafetensorError":  # not an OSError, and only text to read
        found = re.search(r"(?:\(os error |Os \{ code: )(\d+)", str(exc))
        if found and int(found.group(1)) in WRITE_ERRNOS:
            return int(found.group(1))
    return None


@contextlib.contextmanager
def named_by(place: str | os.PathLike[str]) -> Iterator[None]:
    """Re-raise a write refused for want of room or a writable disk (:func:`disk_errno`) as
    an OSError naming ``place``; anything else as it is."""
    try:
        yield
    except Exception as exc:
        code = disk_errno(exc)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(Path(place))) from exc
