"""Writes in a run directory that never follow a symbolic link.

A run directory may come from elsewhere (a resumed run, a copied tree), and a link in it can
lead anywhere: written through, ``metrics.jsonl`` pointing at ``~/.bashrc`` would have it cut
to a checkpoint's offset, and a ``.dapo-lock`` pointing at a file would have that file
overwritten. So every file dapo writes there is opened with ``O_NOFOLLOW`` (a link in its
place is refused, naming it), and a directory dapo writes into (``checkpoints/``, ``model/``,
``tensorboard/`` and their temporaries) is refused when it is a link. dapo never deletes a
link it did not make: it names it, and the user removes it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import BinaryIO


class LinkRefused(ValueError):
    """A run-directory entry dapo writes is a symbolic link; the message names it."""


def refused(path: Path) -> LinkRefused:
    return LinkRefused(
        f"{path} is a symbolic link: dapo writes nothing in a run directory through a link (it "
        "could lead to any file). Remove the link, or start the run in another directory"
    )


def no_link(path: Path) -> Path:
    """``path``, refused when it is a symbolic link (dangling ones included)."""
    if Path(path).is_symlink():
        raise refused(Path(path))
    return Path(path)


def open_fd(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a link in the place of ``path`` (``O_NOFOLLOW``)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refused(Path(path)) from None
        raise


def open_binary(
    path: Path, *, append: bool = False, exclusive: bool = False, readable: bool = False
) -> BinaryIO:
    """``path`` opened for writing bytes, created if missing, never through a link: appended
    to, created only when absent (``exclusive``), or else emptied; ``readable``: its
    descriptor reads too (``os.pread``)."""
    flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT
    flags |= os.O_APPEND if append else os.O_EXCL if exclusive else os.O_TRUNC
    return os.fdopen(open_fd(path, flags), "ab" if append else "wb")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old file or the new, never
    half; neither ``path`` nor the temporary file beside it may be a link."""
    path = no_link(Path(path))
    tmp = path.with_name(f".{path.name}.tmp")
    with open_binary(tmp) as f:
        f.write(text.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
