"""What the machine around a command got wrong, told in one line instead of a traceback: the
reader of its output left, the user has no home directory, or a directory that torch makes
as it loads cannot be made."""

from __future__ import annotations

import os
import select
import sys

NO_HOME = "Could not determine home directory."
"""pathlib's RuntimeError for "~" where HOME is unset and the uid has no passwd entry (a
container started with ``-u 12345``)."""

CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "TMPDIR")
"""The environment variables that place what torch writes as it loads, checked in this order."""


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``dapo ... | head -1``)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def host_refused(exc: BaseException) -> tuple[str | None, int] | None:
    """The message (None: say nothing) and exit status for ``exc`` when the machine around
    the command caused it; None for anything else."""
    if isinstance(exc, BrokenPipeError) and stdout_closed():
        from dapo.run.console import silence

        silence(sys.stdout)  # or the interpreter's last flush fails the same way
        return None, 1  # whoever closed the pipe wanted no more of it: nothing to say
    if isinstance(exc, RuntimeError) and str(exc) == NO_HOME:
        return (
            f"a path that starts with ~ needs a home directory, and this user has none (HOME "
            f"is unset and uid {os.getuid()} has no passwd entry): set HOME, or give the path "
            "in full",
            2,
        )
    return None


def import_refused(exc: OSError) -> str:
    """The message for ``exc``, raised as torch loads: it makes its compiler's cache
    directory then, and one that cannot be made stopped every command."""
    path = os.fsdecode(exc.filename) if exc.filename is not None else "a directory"
    for name in CACHE_VARIABLES:
        value = os.environ.get(name, "").rstrip("/")
        if value and (path == value or path.startswith(value + "/")):
            fix = f"it comes from {name}={os.environ[name]}: set {name} to a writable directory"
            return f"cannot start: torch cannot make {path} as it loads ({exc.strerror}); {fix}"
    listed = ", ".join(CACHE_VARIABLES)
    return (
        f"cannot start: torch cannot make {path} as it loads ({exc.strerror}); check the "
        f"variables that place its files ({listed})"
    )
