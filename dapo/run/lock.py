"""One run at a time in a run directory: an exclusive lock held for the whole run.

Two processes writing one run directory (a ``--resume`` started while the run, or orphans of
a killed job, still train) interleave checkpoints and metrics lines and leave a run that is
neither. The lock is ``flock`` on ``<run dir>/.dapo-lock``: the kernel releases it when the
holding process ends, however it ends (``kill -9`` included), so a stale lock cannot outlive
its run; Linux's NFS client implements ``flock`` with byte-range locks, so it holds across
the nodes of a shared file system too. The file records who holds it, for the message that
refuses a second run.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from dapo.run import nofollow

LOCK_NAME = ".dapo-lock"


class RunLock:
    """An exclusive lock on a run directory, released by :meth:`release` or process exit."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise ValueError naming the process that holds it."""
        path = self.run_dir / LOCK_NAME
        fd = nofollow.open_fd(path, os.O_RDWR | os.O_CREAT)  # a link there is refused
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ValueError(
                f"run directory {self.run_dir} is in use by {holder}: one run at a time writes "
                "a run directory. Wait for that run to end (or stop it), then try again; to "
                "start a separate run, pick another run.name"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise ValueError(
                f"cannot lock run directory {self.run_dir} ({exc.strerror}): its file system "
                "does not support flock; set run.out_dir to a local or NFS file system"
            ) from exc
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"process {int(info['pid'])} on host {info['host']} (since {since})"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another process"  # the holder has not written its name yet
