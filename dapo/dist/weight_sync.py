"""The policy's weights from the trainers to the generators (``dist.rollout_ranks``).

After an update every trainer rank takes part in gathering each parameter whole from the FSDP
shards (a collective of the trainers), one bucket of parameters at a time; trainer rank 0
copies each bucket into one flat buffer in the generators' dtype, brings it to host memory and
broadcasts it in the sync group (:func:`dapo.dist.roles.sync_group`) without waiting: the
trainer goes on training while the generators take the weights when the step they draw next
needs them. A broadcast of one number, the version (the steps trained), goes first; -1 tells
the generators to stop (its buckets follow, unread, so that every message has one shape).

The weights travel through host memory (gloo), not NCCL, and a generator posts its receives
of the next version as soon as it has taken one (:class:`Receiver`), into buffers of its own
in host memory. So no transfer waits on a GPU: an NCCL broadcast started on trainer rank 0
and taken by the generators a step later would hold its kernel on rank 0's GPU meanwhile,
and any device-wide synchronisation there (``torch.cuda.empty_cache`` before a vLLM engine
wakes, for one) would wait for the generators, while the other trainers waited on rank 0 in
their collectives (issue 44). Host memory holds, on trainer rank 0, the versions not yet
taken (up to ``train.async_staleness``) and, on a generator, one version being received.

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
    trainer rank 0 broadcasts from host memory, keeping each bucket until its broadcast is
    done."""

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
            self._broadcast(torch.tensor([version], dtype=torch.long))
        for bucket in buckets(model, self.dtype, names=self.names):
            parts = [p.full_tensor() if isinstance(p, DTensor) else p for _, p in bucket]
            if self.sends:
                # Cast and joined on the run's device, then one copy to the host.
                flat = torch.cat(
                    [t.detach().reshape(-1).to(self.device, self.dtype) for t in parts]
                )
                self._broadcast(flat.cpu())
        return time.perf_counter() - t0

    def stop(self, model: torch.nn.Module) -> None:
        """Tell the generators there are no more weights to wait for (a message of the usual
        shape: ``model``'s buckets follow the -1, zeros)."""
        if self.sends:
            self._broadcast(torch.tensor([STOP], dtype=torch.long))
            for bucket in buckets(model, self.dtype, names=self.names):
                self._broadcast(torch.zeros(sum(p.numel() for _, p in bucket), dtype=self.dtype))

    def finish(self) -> None:
        """Wait until every broadcast started is done."""
        while self.pending:
            self.pending.popleft()[0].wait()


class Receiver:
    """A generator's side: the receives of the next message posted at once, into host
    buffers, and taken (loaded into ``model``, whose parameters are in the dtype the trainers
    send; those in ``names``, as the trainers' Sender has them) when a step needs them."""

    def __init__(
        self, model: torch.nn.Module, device: torch.device, names: set[str] | None = None
    ) -> None:
        dtype = next(model.parameters()).dtype  # the model is on ``device``: take() copies there
        self.buckets = buckets(model, dtype, names=names)
        self.header = torch.empty(1, dtype=torch.long)
        self.flats = [torch.empty(sum(p.numel() for _, p in b), dtype=dtype) for b in self.buckets]
        self.works: list = []
        self._post()

    def _post(self) -> None:
        group = roles.sync_group()
        self.works = [
            torch_dist.broadcast(t, src=0, group=group, async_op=True)
            for t in (self.header, *self.flats)
        ]

    @torch.no_grad()
    def take(self, *, post_next: bool = True) -> int:
        """The next version the trainers send, loaded into the model (and, ``post_next``, the
        receives of the message after it posted); :data:`STOP` when they have stopped."""
        for work in self.works:
            work.wait()
        self.works = []
        version = int(self.header.item())
        if version == STOP:
            return STOP
        for bucket, flat in zip(self.buckets, self.flats, strict=True):
            offset = 0
            for _, p in bucket:
                # A blocking copy: the buffer is free for the next message once it returns.
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        if post_next:
            self._post()
        return version


def receive(model: torch.nn.Module, device: torch.device, names: set[str] | None = None) -> int:
    """One message, received and taken at once (what :class:`Receiver` does, posting no
    receives ahead)."""
    return Receiver(model, device, names).take(post_next=False)
