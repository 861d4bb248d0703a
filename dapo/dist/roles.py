"""Ranks with one role each (``dist.rollout_ranks`` = R): trainers and generators.

Of a ``torchrun`` job of W ranks, ranks [0, T) train and ranks [T, W) generate, T = W - R.
Each role gets a process group of its own, which :mod:`dapo.dist`'s collectives then use, so
that the code of either side runs as it does without roles: the trainers shard the policy
(FSDP over their group), decide, save and evaluate among themselves, rank 0 writing the run's
files; the generators split each round's prompts among themselves as ranks always have.

The roles meet in two places only (:mod:`dapo.training.generator_ranks`), through this module:

- the **weights** go from trainer rank 0 to every generator by broadcasts in the sync group
  (trainer rank 0 and the generators), in buckets (:mod:`dapo.dist.weight_sync`);
- the **rollouts** of each step go from the first generator to every trainer, point to point.

Every rank makes every group (``new_group`` is a collective of the whole job), in one order.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

from dapo import dist


@dataclass(frozen=True)
class Roles:
    """Who does what in a job of ``world`` ranks with ``generators`` of them generating."""

    world: int
    generators: int

    @property
    def trainers(self) -> int:
        return self.world - self.generators

    @property
    def first_generator(self) -> int:
        """The global rank of the generator that sends the rollouts."""
        return self.trainers

    def generates(self, rank: int) -> bool:
        return rank >= self.trainers


def check(rollout_ranks: int, world_size: int) -> None:
    """Refuse ``dist.rollout_ranks`` that leaves no trainer (before any model loads)."""
    if rollout_ranks and world_size == 1:
        # dist.rollout_ranks=0 first: a resume accepts it (train.async_staleness may not
        # change on one), and at the run's staleness a thread draws what the ranks would.
        raise ValueError(
            f"dist.rollout_ranks={rollout_ranks} gives ranks of a torchrun job the role of "
            "generating; in one process set dist.rollout_ranks=0 (on --resume too): a generator "
            "thread then draws on the same schedule (train.async_staleness=k >= 1; at 0 each "
            "step draws in turn), or launch with torchrun --nproc-per-node N and "
            "N > dist.rollout_ranks"
        )
    if rollout_ranks >= world_size:
        raise ValueError(
            f"dist.rollout_ranks={rollout_ranks} leaves no trainer among {world_size} ranks: "
            f"set dist.rollout_ranks to at most {world_size - 1}, or launch more ranks"
        )


_roles: Roles | None = None
_sync: Any = None
_rollouts: Any = None
"""Every rank, gloo, waiting ``wait_timeout_s``: the rollouts' transfers, which a trainer waits
on while the generators draw a whole round (minutes at the paper's lengths)."""


def split(
    rollout_ranks: int, *, wait_timeout_s: float, timeout_s: float | None = None
) -> Roles | None:
    """Give this rank its role (every rank calls it, after :func:`dapo.dist.init_from_env`);
    None, and nothing done, without rollout ranks or a process group. The roles' own
    collectives wait ``timeout_s`` (``dist.timeout_s``; None: torch's default), what waits
    on the other role ``wait_timeout_s``."""
    global _roles, _sync, _rollouts
    if not rollout_ranks or not dist.active():
        return None
    roles = Roles(torch_dist.get_world_size(), rollout_ranks)
    check(rollout_ranks, roles.world)
    me = torch_dist.get_rank()
    waits = datetime.timedelta(seconds=wait_timeout_s)
    short = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    trainers = list(range(roles.trainers))
    generators = list(range(roles.trainers, roles.world))
    made = {}
    for name, ranks in (("train", trainers), ("generate", generators)):
        made[name] = (
            torch_dist.new_group(ranks, **short),
            torch_dist.new_group(ranks, backend="gloo", timeout=waits),
        )
    # The sync group waits as long as the generators may, and is gloo: the weights travel
    # through host memory (dapo.dist.weight_sync), so no transfer holds a kernel on a GPU.
    _sync = torch_dist.new_group([0, *generators], backend="gloo", timeout=waits)
    _rollouts = torch_dist.new_group(list(range(roles.world)), backend="gloo", timeout=waits)
    dist.use_groups(*made["generate" if roles.generates(me) else "train"])
    _roles = roles
    return roles


def roles() -> Roles | None:
    """This job's roles; None without ``dist.rollout_ranks``."""
    return _roles


def generating() -> bool:
    """Whether this rank is a generator."""
    return _roles is not None and _roles.generates(torch_dist.get_rank())


def sync_group() -> Any:
    """Trainer rank 0 and the generators: the weights' broadcasts."""
    return _sync


def send_bytes(buffer: torch.Tensor, dst: int, pending: list) -> None:
    """Start sending ``buffer`` (uint8, on the CPU) to global rank ``dst``; its size goes
    first. ``pending`` keeps what is in flight (:func:`release_sent`, :func:`wait_sent`)."""
    size = torch.tensor([buffer.numel()], dtype=torch.long)
    for t in (size, buffer):  # kept alive until sent
        pending.append((torch_dist.isend(t, dst, group=_rollouts), t))


def recv_bytes(src: int) -> torch.Tensor:
    """What :func:`send_bytes` sent from global rank ``src``: waits up to ``wait_timeout_s``
    (a round of generation), not the collectives' ``timeout_s``."""
    size = torch.empty(1, dtype=torch.long)
    torch_dist.recv(size, src, group=_rollouts)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    torch_dist.recv(buffer, src, group=_rollouts)
    return buffer


def broadcast_json(value: Any) -> Any:
    """Trainer rank 0's ``value`` on the generators (the sync group)."""
    group = sync_group()
    data = json.dumps(value).encode() if value is not None else b""
    size = torch.tensor([len(data)], dtype=torch.long)
    torch_dist.broadcast(size, src=0, group=group)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if value is not None else None
    if buffer is None:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    torch_dist.broadcast(buffer, src=0, group=group)
    return json.loads(buffer.numpy().tobytes())


def release_sent(pending: list) -> None:
    """Forget the sends of ``pending`` that are done."""
    pending[:] = [(w, t) for w, t in pending if not w.is_completed()]


def wait_sent(pending: list) -> None:
    """Wait until every send of ``pending`` is done."""
    for work, _ in pending:
        work.wait()
    pending.clear()


def forget() -> None:
    """Drop the roles (the job's process group is being destroyed)."""
    global _roles, _sync, _rollouts
    _roles = _sync = _rollouts = None


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure (another rank died or stalled), not a failed
    draw: gloo raises a plain RuntimeError naming its own source file, NCCL and the store
    ``torch.distributed``'s errors."""
    if isinstance(exc, torch_dist.DistError):
        return True
    return type(exc) is RuntimeError and "gloo" in str(exc).lower()
