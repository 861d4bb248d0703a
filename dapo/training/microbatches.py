"""The one micro-batch loop: what the pi_old (and pi_ref) pass and the update both iterate.

A rank's share of a mini-batch goes by prompt and length (a group's rows together, so that its
prompt runs once; :func:`~dapo.data.batch.length_sorted`), cut into micro-batches of at most
``train.tokens_per_microbatch`` padded tokens (real ones when packed, ``train.packing``), each
collated and moved to the compute device.
Under FSDP a forward and a backward are collectives, so a rank with fewer micro-batches than
another runs idle passes to match it (one padding token, nothing kept, no gradient): they are
made here and nowhere else.

What a pass measures stays on the device (:class:`DeviceSums`) and is read back once, at the
end of the mini-batch: on a GPU every read is a synchronisation that stalls the queue of
kernels, so none happens per micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dapo import dist
from dapo.data.batch import Batch, Episode, collate, length_sorted, split_microbatches


@dataclass
class MicroBatch:
    rows: list[int]
    """Indices into the mini-batch's episodes; empty for an idle pass."""
    batch: Batch
    """``rows`` collated on the compute device; an idle pass's one padding token."""
    last: bool
    """Whether this is the rank's last pass of the mini-batch (gradients reduce after it)."""

    @property
    def idle(self) -> bool:
        """A pass that computes nothing, run to match a rank with more micro-batches."""
        return not self.rows


def idle_row(pad_id: int) -> Episode:
    """The one-token episode an idle pass forwards: a rank may hold none of the step's
    whole episodes, so it is made here rather than taken from them."""
    one = torch.tensor([pad_id])
    return Episode(one, one, torch.zeros(1), False, False, 0.0)


def micro_batches(
    episodes: Sequence[Episode],
    share: Sequence[int],
    *,
    max_tokens: int,
    pad_id: int,
    device: torch.device,
    packed: bool = False,
) -> Iterator[MicroBatch]:
    """This rank's micro-batches of ``episodes[share]``, then idle passes up to the most any
    rank has; each collated on ``device`` (``packed``: ``train.packing``, their rows laid end
    to end, ``max_tokens`` real tokens), and under ``torchrun`` (unpacked) at least one masked
    response column wide, so that every rank makes the shared-prompt pass."""
    order = length_sorted(episodes, share)
    chunks = split_microbatches(episodes, order, max_tokens=max_tokens, packed=packed)
    passes = dist.all_reduce_max(len(chunks))
    # Ranks make the same collective calls only if no micro-batch is 0 columns wide (rows
    # whose responses are all empty skip the shared-prompt pass): one masked column then.
    width = 1 if dist.world_size() > 1 and not packed else 0
    for n in range(passes):
        rows = chunks[n] if n < len(chunks) else []
        members = [episodes[i] for i in rows] or [idle_row(pad_id)]
        batch = collate(members, pad_id=pad_id, packed=packed, min_width=width).to(device)
        yield MicroBatch(rows, batch, last=n == passes - 1)


class DeviceSums:
    """Named sums of 0-d tensors kept on the device in float64, read back in one transfer.

    Float64 keeps the sums the values a host-side sum of Python floats would give: each value
    is widened exactly, and the additions round as Python's do, in the same order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.values: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor | float) -> None:
        if key not in self.values:
            # 0.0 + value, as a host-side sum starts: -0.0 becomes 0.0 there too.
            self.values[key] = torch.zeros((), dtype=torch.float64, device=self.device)
        if isinstance(value, torch.Tensor):
            value = value.detach().to(self.device, torch.float64)
        self.values[key] = self.values[key] + value  # a Python float is a float64 scalar

    def summed_over_ranks(self, keys: Sequence[str]) -> DeviceSums:
        """The sums of ``keys`` over every rank (each rank sends the same keys in the same
        order, a missing one as 0); in one process this object itself, unchanged."""
        if dist.world_size() == 1:
            return self
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        stacked = torch.stack([self.values.get(k, zero) for k in keys])
        out = DeviceSums(self.device)
        out.values = dict(zip(keys, dist.sum_tensor(stacked).unbind(), strict=True))
        return out

    def read(self, **extra: torch.Tensor) -> dict[str, float]:
        """Every sum, and ``extra`` 0-d tensors, as floats: one transfer to the host."""
        named = {**self.values, **{k: v.detach().double().reshape(()) for k, v in extra.items()}}
        if not named:
            return {}
        stacked = torch.stack([v.to(self.device) for v in named.values()])
        return dict(zip(named, stacked.cpu().tolist(), strict=True))
