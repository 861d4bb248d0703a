"""A memory cap for a process that runs untrusted work (a verifier, a chat template).

Standard library only, and nothing of dapo: reward workers and the forked child that renders
chat templates both import it.
"""

from __future__ import annotations

import os

try:
    import resource
except ImportError:  # Windows: workers there run without a memory limit
    resource = None  # type: ignore[assignment]

__all__ = ["limit_address_space", "mapped_bytes"]


def mapped_bytes() -> int:
    """The process's current virtual size (Linux), or 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def limit_address_space(memory_mb: int) -> None:
    """Let this process map at most ``memory_mb`` MiB more than it does now (Linux)."""
    if memory_mb <= 0 or resource is None or not hasattr(resource, "RLIMIT_AS"):
        return
    # memory_mb is room on top of what the process maps now, not an absolute cap: a worker
    # that inherits a heavy __main__ (importing CPU torch maps 0.6 GB, CUDA builds more)
    # would otherwise fail every response with "memory".
    limit = mapped_bytes() + memory_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
