"""Data-parallel ranks: the one package that talks to ``torch.distributed``.

In one process (no process group) every function is a no-op: world size 1, rank 0, the main
process, a sum over ranks that returns its argument, a gather that returns a list of one.
Under ``torchrun`` (:func:`init_from_env`) the same calls are collectives: what every rank
must decide together (dynamic sampling, skipping an update, stopping), what it must share
(the groups each rank generated, log-probs) and who writes the run's files (rank 0).
:mod:`dapo.dist.fsdp` shards the model, :mod:`dapo.dist.dcp` checkpoints it.

With ``dist.rollout_ranks`` (:mod:`dapo.dist.roles`) each rank has one role, and these
collectives, the world size and the rank are the role's: the trainers shard, decide and save
among themselves as if they were the whole job, the generators sample among themselves.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as torch_dist


def active() -> bool:
    """Whether this process trains in a process group (started by ``torchrun``, or joined by
    hand with more than one rank). A group of one that a library made for itself (vLLM in
    one process) is not one: everything stays a no-op."""
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return False
    return launched() or torch_dist.get_world_size() > 1


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (its environment names a rank)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


FAILED_COLLECTIVE = torch_dist.DistError
"""What a collective that failed raises (a rank gone, NCCL's error, a timeout): no fault of
the data it carried."""

_long_waits: Any = None
"""A gloo group whose barrier waits ``wait_timeout_s``: for ranks idle while rank 0 alone
builds, loads or saves the model, which may take longer than any training collective should."""


_group: Any = None
"""This rank's role group (:mod:`dapo.dist.roles`), which every collective here uses; None:
every rank (the default group)."""

_role_waits: Any = None
"""The role's group of :func:`wait_for_all`; None: :data:`_long_waits`."""


_rank_device: torch.device | None = None
"""This rank's compute device, chosen once at :func:`init_from_env`: the collectives put their
tensors there, whatever a library (vLLM) later makes the current CUDA device."""


def rank_device(*, cuda_count: int, local_rank: int) -> torch.device:
    """The GPU of a rank under a launcher: ``cuda:LOCAL_RANK`` when the node's GPUs are all
    visible, the one visible GPU when the launcher gives each task one (``srun``), the CPU
    without GPUs."""
    if cuda_count == 0:
        return torch.device("cpu")
    if cuda_count == 1:
        return torch.device("cuda", 0)
    if local_rank >= cuda_count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but {cuda_count} GPUs are visible to this rank: start "
            f"at most {cuda_count} ranks per node (torchrun --nproc-per-node), or give each "
            "rank one GPU (CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1)"
        )
    return torch.device("cuda", local_rank)


def launched_device() -> torch.device:
    """:func:`rank_device` of this process, from its ``LOCAL_RANK`` and the GPUs it sees."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return rank_device(cuda_count=count, local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def backend(cuda: bool) -> str:
    """NCCL for CUDA tensors and gloo for CPU ones (CPU-offloaded shards, objects), or gloo."""
    return "cuda:nccl,cpu:gloo" if cuda else "gloo"


def init_from_env(*, timeout_s: float, wait_timeout_s: float | None = None) -> torch.device | None:
    """Join the process group ``torchrun`` describes (:func:`backend`), with a ``timeout_s``
    limit on every collective, and a group for long waits (``wait_timeout_s``, default
    ``timeout_s``; see :func:`wait_for_all`); returns this rank's device
    (:func:`rank_device`). None, and nothing done, outside ``torchrun``."""
    global _rank_device
    if not launched() or active():
        return None
    device = launched_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch_dist.init_process_group(
        backend(device.type == "cuda"), timeout=datetime.timedelta(seconds=timeout_s)
    )
    _rank_device = device
    join_long_waits(wait_timeout_s or timeout_s)
    return device


def join_long_waits(wait_timeout_s: float) -> None:
    """Make the group of :func:`wait_for_all` (every rank calls it, after joining)."""
    global _long_waits
    _long_waits = torch_dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=wait_timeout_s)
    )


def shutdown() -> None:
    """Leave the process group (after the last collective)."""
    global _long_waits, _rank_device, _group, _role_waits
    if active():
        torch_dist.destroy_process_group()
    _long_waits = _rank_device = _group = _role_waits = None


def use_groups(group: Any, waits: Any) -> None:
    """Make ``group`` (and ``waits``, its group for long waits) the one every collective here
    uses: this rank's role (:func:`dapo.dist.roles.split`)."""
    global _group, _role_waits
    _group, _role_waits = group, waits


def group() -> Any:
    """The process group of this rank's role (None: the default group, every rank)."""
    return _group


def planned_ranks(world_size: int | None) -> int:
    """The ranks ``dapo train --dry-run`` plans for: ``world_size`` (``--world-size``), else
    torchrun's ``WORLD_SIZE``, else 1; a ValueError naming the one that is no count."""
    text = str(world_size) if world_size is not None else os.environ.get("WORLD_SIZE", "1")
    ranks = int(text) if text.strip().isdigit() else 0
    if ranks < 1:
        where = "--world-size" if world_size is not None else "the environment's WORLD_SIZE"
        raise ValueError(f"{where} is {text!r}: the ranks to plan for are a whole number >= 1")
    return ranks


def job_size() -> int:
    """Every process of the job, whatever its role; 1 without a process group."""
    return torch_dist.get_world_size() if active() else 1


def global_rank() -> int:
    """This process's rank in the job, whatever its role; 0 without a process group."""
    return torch_dist.get_rank() if active() else 0


def world_size() -> int:
    """Processes of this rank's role (every process without roles); 1 without a group."""
    return torch_dist.get_world_size(_group) if active() else 1


def rank() -> int:
    """This process's rank in its role (its global rank without roles), 0 without a group."""
    return torch_dist.get_rank(_group) if active() else 0


def is_main() -> bool:
    """Whether this process writes the run's outputs (global rank 0, the first trainer)."""
    return torch_dist.get_rank() == 0 if active() else True


def _global(role_rank: int) -> int:
    """The global rank of ``role_rank`` of this rank's role."""
    return role_rank if _group is None else torch_dist.get_global_rank(_group, role_rank)


def device_mesh() -> Any:
    """A one-dimensional DeviceMesh over this rank's role, on its device (FSDP shards over
    it); None: the default group's, which ``fully_shard`` makes itself."""
    if _group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(_group, _device().type)


def _device() -> torch.device:
    """Where reductions put their tensors: this rank's GPU, never "the current device"
    (vLLM's worker makes that cuda:0 on every rank); the CPU with gloo alone."""
    if _rank_device is not None:
        return _rank_device
    if "nccl" in str(torch_dist.get_backend()):  # a group made by hand (tests, a library)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(values: list[float], op) -> list[float]:
    if not active():
        return values
    # float64 holds every integer below 2**53 exactly.
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    torch_dist.all_reduce(t, op=op, group=_group)
    return t.tolist()


def all_reduce_sum(value: int | float) -> int | float:
    """``value`` summed over every rank (the same type back); ``value`` itself in one process.

    Counts are summed in float64, which holds every integer below 2**53 exactly.
    """
    if not active():
        return value
    return type(value)(_reduce([float(value)], torch_dist.ReduceOp.SUM)[0])


def all_reduce_max(value: int | float) -> int | float:
    """The largest ``value`` of any rank (the same type back)."""
    if not active():
        return value
    return type(value)(_reduce([float(value)], torch_dist.ReduceOp.MAX)[0])


def sum_dict(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over every rank; the keys must be the same, in the same order, on
    every rank."""
    if not active() or not values:
        return values
    return dict(zip(values, _reduce(list(values.values()), torch_dist.ReduceOp.SUM), strict=True))


def sum_tensor(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over every rank, elementwise, where it is (``values`` itself in one
    process): metric sums kept on the compute device are reduced there, with no read back to
    the host. Float64 sums of counts are exact below 2**53, as :func:`all_reduce_sum`'s."""
    if not active():
        return values
    t = values.to(_device(), copy=True)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM, group=_group)
    return t.to(values.device)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: a stop signal seen by one rank stops all."""
    return bool(all_reduce_max(int(flag)))


def gather_lists(items: list[Any], *, patient: bool = False) -> list[Any]:
    """Every rank's ``items`` concatenated in rank order, on every rank (pickled objects:
    tensors inside travel on the CPU). ``patient``: after generation, where one rank may
    still decode its longest response long after the others, the ranks wait on the group of
    :func:`wait_for_all` (``dist.wait_timeout_s``), not the training collectives' timeout."""
    if not active():
        return items
    parts: list[Any] = [None] * world_size()
    torch_dist.all_gather_object(parts, items, group=wait_group() if patient else _group)
    return [x for part in parts for x in part]


def exchange(outgoing: list[list[Any]]) -> list[Any]:
    """Point to point: ``outgoing[r]`` goes to rank r alone; returns what every rank sent this
    one, in rank order (pickled objects, tensors inside on the CPU). One scatter per rank, so
    each object crosses the network once, to the rank that needs it (``gather_lists`` gives
    everything to everyone)."""
    if not active():
        return list(outgoing[0])
    received: list[Any] = []
    for src in range(world_size()):
        box: list[Any] = [None]
        parts = outgoing if src == rank() else None
        torch_dist.scatter_object_list(box, parts, src=_global(src), group=_group)
        received.extend(box[0])
    return received


def broadcast(value: Any, *, patient: bool = False) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object). ``patient``: after work rank 0
    does alone (writing, fsyncing or deleting a checkpoint: minutes for a large model), the
    ranks wait up to ``dist.wait_timeout_s``, not the training collectives' timeout."""
    if not active():
        return value
    box = [value]
    group = wait_group() if patient else _group
    torch_dist.broadcast_object_list(box, src=_global(0), group=group)
    return box[0]


def from_first_of(group: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, run on ``group``'s first rank alone, on every rank of ``group`` (a
    picklable object): what the ranks of a tensor-parallel group must all see the same."""
    first = torch_dist.get_global_rank(group, 0)
    box = [compute() if torch_dist.get_rank() == first else None]
    torch_dist.broadcast_object_list(box, src=first, group=group)
    return box[0]


def barrier() -> None:
    """Wait until every rank gets here."""
    if active():
        torch_dist.barrier(group=_group)


def wait_for_all(*, everyone: bool = False) -> None:
    """Wait until every rank of the role (``everyone``: of the job) gets here, for as long as
    ``dist.wait_timeout_s``: the ranks that idle while rank 0 alone builds, loads or saves the
    whole model (minutes for a large one) are not cut off by the training collectives'
    ``timeout_s``."""
    if active():
        torch_dist.barrier(group=_long_waits if everyone else wait_group())


def wait_group() -> Any:
    """The role's group of :func:`wait_for_all` (gloo, ``dist.wait_timeout_s``): for
    coordination that waits on another rank's solo work (a checkpoint's shards written or
    read at each rank's own pace)."""
    return _role_waits or _long_waits


def share(n: int) -> range:
    """This rank's contiguous part of ``n`` items split in rank order, the parts' sizes
    differing by at most one."""
    w, r = world_size(), rank()
    return range(r * n // w, (r + 1) * n // w)
