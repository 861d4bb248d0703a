"""CPU threads that give way to other processes (``run.threads=0``).

torch runs each operation on all its intra-op threads and waits for the slowest. When another
process keeps one of two cores busy, the thread that shares that core gets half of it, and
every operation waits for it: measured on SmolLM2-135M decoding (2 cores), 165 tokens/s quiet
and 54 beside one busy process with 2 threads, 118 with 1 thread. So before each training
step and each evaluation batch, the governor measures how many cores other processes (the
reward workers included) kept busy since it last looked, and uses the cores left.

Linux only (it reads ``/proc/stat``); elsewhere the thread count stays torch's default. A
count that changes changes floating-point reduction order, so a run that must repeat bit for
bit sets ``run.threads`` to a fixed number (1 is exact on CPU).
"""

from __future__ import annotations

import os
import time

import torch

PROC_STAT = "/proc/stat"
# The first look: how busy the machine is before any work starts.
FIRST_LOOK_S = 0.25
# Round the cores left up from this fraction: a core 70% free is worth a thread.
SPARE_CORE = 0.3


def busy_seconds() -> float | None:
    """CPU seconds every core of the machine spent busy since boot (None off Linux)."""
    try:
        with open(PROC_STAT) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds of this process, all its threads, its children not included."""
    t = os.times()
    return t.user + t.system


def threads_for(cores: int, others_busy: float, most: int) -> int:
    """Threads to use on ``cores`` cores while others keep ``others_busy`` of them busy."""
    return max(1, min(most, int(cores - others_busy + SPARE_CORE)))


class ThreadGovernor:
    """Sets torch's thread count from the load other processes put on this process's cores."""

    def __init__(self, most: int | None = None, *, first_look_s: float = FIRST_LOOK_S) -> None:
        self.most = most or torch.get_num_threads()
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.cores = min(self.cores, os.cpu_count() or 1)
        self._last = self._sample()
        if self._last is not None and first_look_s > 0:
            time.sleep(first_look_s)
            self.adjust()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = busy_seconds()
        return None if busy is None else (time.monotonic(), busy, own_seconds())

    def others_busy(self) -> float | None:
        """Cores other processes kept busy since the last call (None when unknown)."""
        now, last = self._sample(), self._last
        self._last = now
        if now is None or last is None or now[0] - last[0] < 0.05:
            return None
        wall = now[0] - last[0]
        # Machine-wide busy time counts every core; scale it to this process's share.
        total = os.cpu_count() or 1
        others = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, others / wall) * self.cores / total

    def adjust(self) -> int:
        """Set and return the thread count for the work that follows."""
        others = self.others_busy()
        if others is not None:
            threads = threads_for(self.cores, others, self.most)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        return torch.get_num_threads()
