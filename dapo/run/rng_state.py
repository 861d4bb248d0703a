"""This process's generators (Python's, numpy's, torch's CPU one and its GPU's), as a
checkpoint saves and restores them (:mod:`dapo.run.checkpoint`, which names these too)."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """This process's generators: Python's, numpy's, torch's CPU one and, when it computes
    on a GPU, that one GPU's (``cuda_rank``) - not every visible GPU's, which would tie the
    checkpoint to the number of GPUs of the machine that wrote it."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda_rank"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Set the generators :func:`capture_rng` saved; the GPU one on ``device``. A checkpoint
    from other hardware resumes: with no GPU here, or a GPU state from a checkpoint of
    before, only the GPU's generator (dropout, none in dapo's sampling, which draws on the
    CPU) differs from the uninterrupted run's, and a warning says so."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    gpu = device is not None and device.type == "cuda"
    saved = state.get("cuda_rank")
    if saved is None and state.get("cuda"):  # dapo <= 0.2: every visible GPU's state
        index = (device.index or 0) if gpu else 0
        saved = state["cuda"][index] if gpu and index < len(state["cuda"]) else None
        if saved is None:
            _warn_gpu_stream(f"{len(state['cuda'])} GPU generator states")
    if saved is not None and gpu:
        torch.cuda.set_rng_state(saved, device)
    elif saved is not None:
        _warn_gpu_stream("a GPU generator state")


def _warn_gpu_stream(what: str) -> None:
    warnings.warn(
        f"the checkpoint holds {what}, which this process cannot use (another number of GPUs, "
        "or none): resumed here, only the GPU generator's draws differ from the uninterrupted "
        "run (dapo samples with CPU generators)",
        stacklevel=3,
    )
