"""Deterministic kernels on a GPU (``run.deterministic``).

On a CPU a run repeats bit for bit at a fixed ``run.threads``. On CUDA it does not by default:
measured on an H200 (torch 2.11, the demo at 4 steps), two identical runs differ from the
first update on (the loss in the 8th digit, weights by 1.2e-7), because several CUDA kernels
sum in whatever order their threads finish, and so a run resumed after kill -9 is not the
uninterrupted one either. torch's deterministic mode picks kernels that sum in a fixed order
(and raises, naming the operation, where one has none); cuBLAS needs a fixed workspace
size for the same, which it reads when an operation starts.
"""

from __future__ import annotations

import os

import torch

# cuBLAS's documented setting for reproducible results (8 buffers of 4 MiB per stream).
CUBLAS_WORKSPACE = ":4096:8"


def make_deterministic() -> None:
    """Deterministic kernels for the rest of this process; a cuBLAS workspace size already
    set in the environment is kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
