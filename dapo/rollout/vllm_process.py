"""What starting vLLM in the training process does to the process, undone: its global random
generators and thread control (:func:`state_kept`), and the current CUDA device
(:func:`on_device`), which its worker sets from ``LOCAL_RANK``."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def state_kept() -> Iterator[None]:
    """Undo what starting an in-process vLLM does to the process: it seeds torch's, numpy's
    and Python's global generators, and a CPU worker swaps ``torch.set_num_threads`` for a
    function that only warns."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            random.setstate(py_state)
            np.random.set_state(np_state)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Start vLLM on ``device``: its external-launcher worker takes the GPU from LOCAL_RANK,
    which a launcher giving each task one GPU (srun) sets to something else than that GPU's
    index here. The CUDA device vLLM's worker makes current is put back, and checked."""
    if device.type != "cuda":
        yield
        return
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(device.index or 0)
    try:
        yield
    finally:
        if local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = local_rank
        torch.cuda.set_device(device)
    if torch.cuda.current_device() != (device.index or 0):
        raise RuntimeError(
            f"after vLLM started, the current CUDA device is cuda:{torch.cuda.current_device()}, "
            f"not this rank's {device}"
        )
