"""Which multiprocessing start method the processes that run untrusted code come from."""

from __future__ import annotations

import multiprocessing
import os
import tempfile

FORKSERVER_PATH_EXTRA = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
"""What the forkserver adds to the temporary directory's path for its listening socket."""
SOCKET_PATH_MAX = 107
"""The longest path a Unix socket can bind on Linux (108 bytes with the terminating NUL)."""


def default_start_method() -> str:
    """The forkserver (a fresh, small interpreter) where the platform has it and the temporary
    directory's path leaves room for its socket, else spawn (slower to start, no socket).

    Under a longer TMPDIR, such as a cluster job's scratch directory, Python 3.11's forkserver
    fails at the first process with "AF_UNIX path too long" (3.14 falls back on its own)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    path = len(os.fsencode(tempfile.gettempdir())) + FORKSERVER_PATH_EXTRA
    return "forkserver" if path <= SOCKET_PATH_MAX else "spawn"
