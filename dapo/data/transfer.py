"""Host tensors onto the compute device without making the host wait for it.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory is a blocking copy: PyTorch
issues it and then synchronises the stream (``memcpy_and_sync`` in ATen's CUDA copy), so the
host waits for every kernel queued before it. A micro-batch's dozen tensors copied that way
would make each micro-batch wait for the previous one's backward pass to finish, and the card
would then idle while the host collates the next batch and launches its forward. Copied from
page-locked memory with ``non_blocking=True``, the copy takes its place in the stream's queue
and the host goes on; PyTorch's caching host allocator keeps the page-locked block until the
copy has run, so the host tensor may be dropped at once.
"""

from __future__ import annotations

import torch

ASYNC_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""Device types that host tensors reach by an asynchronous copy from page-locked memory."""


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``: through page-locked memory and an asynchronous copy when it
    goes from the host to a CUDA device, else ``tensor.to(device)`` (itself when it is
    there already). The values are the same either way."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type in ASYNC_DEVICE_TYPES:
        # Contiguous first: the copy of a strided source goes through a pageable temporary
        # (a column slice such as collate's distinct prompts), which pinning would not help.
        return tensor.contiguous().pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
