"""The policy's weights from the trainers to the generators (``dist.rollout_ranks``).

After an update every trainer rank takes part in gathering each parameter whole from the FSDP
shards (a collective of the trainers), one bucket of parameters at a time; trainer rank 0
copies each bucket into one flat buffer in the generators' dtype and broadcasts it in the sync
group (:func:`dapo.dist.roles.sync_group`) without waiting: the trainer goes on training while
the generators take the weights when the step they draw next needs them. A broadcast of one
number, the version (the steps trained), goes first; -1 tells the generators to stop.

Both sides cut the parameters into the same buckets, in ``named_parameters`` order (a tied
weight once), so nothing but the tensors' bytes travels.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor

from dapo import dist
from dapo.dist import roles

BUCKET_BYTES = 256 * 2**20
"""The most bytes broadcast at once (a tensor larger than this goes alone): one bucket's
buffer is the extra memory of each side while weights move."""

STOP = -1


def buckets(
    model: torch.nn.Module,
    dtype: torch.dtype,
    limit: int = BUCKET_BYTES,
    names: set[str] | None = None,
) -> list[list]:
    """``model``'s (name, parameter) pairs (those in ``names``, by default all) cut into
    consecutive buckets of at most ``limit`` bytes in ``dtype`` (a larger parameter alone)."""
    size = torch.empty(0, dtype=dtype).element_size()
    out: list[list] = [[]]
    used = 0
    for name, p in model.named_parameters():
        if names is not None and name not in names:
            continue
        nbytes = p.numel() * size
        if out[-1] and used + nbytes > limit:
            out.append([])
            used = 0
        out[-1].append((name, p))
        used += nbytes
    return [b for b in out if b]


class Sender:
    """The trainers' side: every trainer rank calls :meth:`send` (the gather is theirs);
    trainer rank 0 broadcasts, keeping each bucket until its broadcast is done."""

    def __init__(
        self, dtype: torch.dtype, device: torch.device, names: set[str] | None = None
    ) -> None:
        self.dtype, self.device = dtype, device
        self.names = names  # the parameters that move (LoRA's adapters); None: all
        self.pending: deque = deque()  # (work, buffer): alive until the broadcast is done
        self.sends = dist.is_main()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        work = torch_dist.broadcast(tensor, src=0, group=roles.sync_group(), async_op=True)
        self.pending.append((work, tensor))

    def _release(self) -> None:
        while self.pending and self.pending[0][0].is_completed():
            self.pending.popleft()[0].wait()  # raises what the broadcast met

    @torch.no_grad()
    def send(self, model: torch.nn.Module, version: int) -> float:
        """Start sending ``model``'s weights as ``version``; the seconds it took this rank."""
        t0 = time.perf_counter()
        self._release()
        if self.sends:
            self._broadcast(torch.tensor([version], dtype=torch.long, device=self.device))
        for bucket in buckets(model, self.dtype, names=self.names):
            parts = [p.full_tensor() if isinstance(p, DTensor) else p for _, p in bucket]
            if self.sends:
                flat = torch.cat([t.detach().reshape(-1).to(self.device, self.dtype) for t in parts])
                self._broadcast(flat)
        return time.perf_counter() - t0

    def stop(self) -> None:
        """Tell the generators there are no more weights to wait for."""
        if self.sends:
            self._broadcast(torch.tensor([STOP], dtype=torch.long, device=self.device))

    def finish(self) -> None:
        """Wait until every broadcast started is done."""
        while self.pending:
            self.pending.popleft()[0].wait()


@torch.no_grad()
def receive(model: torch.nn.Module, device: torch.device, names: set[str] | None = None) -> int:
    """A generator's side: the next version the trainers send, loaded into ``model`` (its
    parameters in the dtype the trainers send; those in ``names``, as the trainers' Sender
    has them); :data:`STOP` when they have stopped."""
    header = torch.empty(1, dtype=torch.long, device=device)
    torch_dist.broadcast(header, src=0, group=roles.sync_group())
    version = int(header.item())
    if version == STOP:
        return STOP
    dtype = next(model.parameters()).dtype
    for bucket in buckets(model, dtype, names=names):
        flat = torch.empty(sum(p.numel() for _, p in bucket), dtype=dtype, device=device)
        torch_dist.broadcast(flat, src=0, group=roles.sync_group())
        offset = 0
        for _, p in bucket:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    return version
