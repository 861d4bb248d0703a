"""What a call of the Python API changes in the calling process, put back as it returns.

A run sets torch's thread count (``run.threads``, and the thread governor lowers it under
load), may turn on deterministic kernels (``run.deterministic``) and seeds torch's generator
(``train.seed``; a resume sets Python's, numpy's and torch's generators to its checkpoint's).
A command ends its process; a notebook goes on, and its next run would start
capped at the last one's thread count, deterministic where it asked for nothing, with its own
random draws re-seeded. Hugging Face's loading and saving bars are silenced during the call,
as the command line silences them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"


@contextmanager
def kept_process_state() -> Iterator[None]:
    """Run the block, then restore torch's thread count, deterministic mode, cuDNN benchmark
    flag and ``CUBLAS_WORKSPACE_CONFIG``, the generators (Python's, numpy's, torch's CPU one
    and, once CUDA is in use, every GPU's), and transformers' progress bars."""
    import torch
    from transformers.utils import logging as hf_logging

    from dapo.run.rng_state import capture_rng, restore_rng

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    workspace = os.environ.get(WORKSPACE)
    rng = capture_rng()
    gpus = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        if workspace is None:
            os.environ.pop(WORKSPACE, None)
        else:
            os.environ[WORKSPACE] = workspace
        restore_rng(rng)
        if gpus is not None:  # CUDA in use before the call (torch.manual_seed seeds it too)
            torch.cuda.set_rng_state_all(gpus)
        if bars:
            hf_logging.enable_progress_bar()
