"""Data-parallel ranks: the one module that talks to ``torch.distributed``.

In one process (no process group) every function is a no-op: world size 1, rank 0, the main
process, and a sum over ranks that returns its argument. The update already sums the token
count that divides a mini-batch's loss through ``all_reduce_sum``; scale-out adds the rest
(what every rank must decide together, who writes the run's files) through this module.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist


def _active() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def world_size() -> int:
    """Processes training together; 1 without a process group."""
    return torch_dist.get_world_size() if _active() else 1


def rank() -> int:
    """This process's rank, 0 without a process group."""
    return torch_dist.get_rank() if _active() else 0


def is_main() -> bool:
    """Whether this process writes the run's outputs (rank 0)."""
    return rank() == 0


def all_reduce_sum(value: int | float) -> int | float:
    """``value`` summed over every rank (the same type back); ``value`` itself in one process.

    Counts are summed in float64, which holds every integer below 2**53 exactly.
    """
    if not _active():
        return value
    total = torch.tensor(float(value), dtype=torch.float64)
    if torch_dist.get_backend() == "nccl":
        total = total.cuda()
    torch_dist.all_reduce(total, op=torch_dist.ReduceOp.SUM)
    return type(value)(total.item())
