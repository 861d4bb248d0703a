"""One run at a time in a run directory: an exclusive lock held for the whole run.

Two processes writing one run directory (a ``--resume`` started while the run, or orphans of
a killed job, still train) interleave checkpoints and metrics lines and leave a run that is
neither. The lock is ``flock`` on ``<run dir>/.dapo-lock``: the kernel releases it when the
holding process ends, however it ends (``kill -9`` included), so a stale lock cannot outlive
its run; Linux's NFS client implements ``flock`` with byte-range locks, so it holds across
the nodes of a shared file system too. The file records who holds it, for the message that
refuses a second run, and :func:`in_use_by` tells whether anyone holds it (a start killed
before its run began left its directory; is its process gone?).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dapo.run import nofollow

LOCK_NAME = ".dapo-lock"
GRACE_S = 0.25
"""How long a lock found held is tried again before it is reported in use: :func:`in_use_by`
holds it for an instant to tell whether anyone else does, and the holder writes its name an
instant after it takes it."""
ATTEMPTS = 5  # lock files replaced under it in a row before the lock taken is kept anyway


class RunLock:
    """An exclusive lock on a run directory, released by :meth:`release` or process exit.

    ``name``, ``refusal``, ``link_refusal`` and ``kind`` lock another kind of directory the
    same way (an ablation's, :mod:`dapo.ablate.runs`): its lock file, the error that names who
    holds it, the error for a symbolic link in the lock file's place, and what the directory
    is called, with the setting that moves it (when flock fails)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        name: str = LOCK_NAME,
        refusal: Callable[[Path, str], ValueError] | None = None,
        link_refusal: Callable[[Path], ValueError] = nofollow.refused,
        kind: tuple[str, str] = ("run directory", "set run.out_dir to"),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.name = name
        self.refusal = refusal
        self.link_refusal = link_refusal
        self.kind = kind
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise ValueError naming the process that holds it (a
        FileNotFoundError when the directory is gone)."""
        path = self.run_dir / self.name
        for attempt in range(ATTEMPTS):
            fd = self._open(path)
            try:
                held = _taken(fd)
            except OSError as exc:
                os.close(fd)
                what, move = self.kind
                raise ValueError(
                    f"cannot lock {what} {self.run_dir} ({exc.strerror}): its file system "
                    f"does not support flock; {move} a local or NFS file system"
                ) from exc
            if not held:
                holder = _holder(fd)
                os.close(fd)
                raise (self.refusal or in_use_error)(self.run_dir, holder)
            if _linked(fd, path) or attempt == ATTEMPTS - 1:
                break
            # The holder before removed the directory's files (a start that failed): the lock
            # taken is on a file no one else will open; take the one there now, if any.
            os.close(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self.fd = fd
        return self

    def _open(self, path: Path) -> int:
        """The lock file's descriptor; a link in its place refused (:attr:`link_refusal`)."""
        try:
            return nofollow.open_fd(path, os.O_RDWR | os.O_CREAT)
        except nofollow.LinkRefused:
            raise self.link_refusal(path) from None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def in_use_error(run_dir: Path, holder: str) -> ValueError:
    """The refusal of a second run in ``run_dir``, whose lock ``holder`` holds."""
    return ValueError(
        f"run directory {run_dir} is in use by {holder}: one run at a time writes "
        "a run directory. Wait for that run to end (or stop it), then try again; to "
        "start a separate run, pick another run.name"
    )


def in_use_by(run_dir: Path) -> str | None:
    """Who holds the lock of ``run_dir`` ("process N on host H (since T)"), or None: no lock
    file there, or no process holds it. Tells by taking the lock for an instant (a run taking
    it then waits that instant out: :data:`GRACE_S`), and writes nothing."""
    try:
        fd = nofollow.open_fd(Path(run_dir) / LOCK_NAME, os.O_RDWR)
    except OSError:  # no lock file (no run ever locked it), or a read-only file system
        return None
    try:
        return None if _taken(fd) else _holder(fd)
    except OSError:  # no flock here: nothing can be told
        return None
    finally:
        os.close(fd)  # dropping the lock, when it was taken


def _taken(fd: int) -> bool:
    """Whether the exclusive lock on ``fd`` was taken; tried again for up to :data:`GRACE_S`
    while another process holds it (perhaps only for an instant)."""
    deadline = time.monotonic() + GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _linked(fd: int, path: Path) -> bool:
    """Whether the file open as ``fd`` is still the one at ``path``."""
    try:
        here, there = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _holder(fd: int) -> str:
    """Who holds the lock on ``fd``, as its file names them; read again for up to
    :data:`GRACE_S` while it is empty (the holder writes its name an instant after locking)."""
    deadline = time.monotonic() + GRACE_S
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
            return f"process {int(info['pid'])} on host {info['host']} (since {since})"
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            if time.monotonic() >= deadline:
                return "another process"  # the holder has not written its name yet
            time.sleep(0.01)
