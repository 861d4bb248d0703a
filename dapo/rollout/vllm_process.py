"""What starting vLLM in the training process does to the process, undone: its global random
generators and thread control (:func:`state_kept`), the current CUDA device
(:func:`on_device`), which its worker sets from ``LOCAL_RANK``, the named shared memory of
its CPU tensor-parallel groups (:func:`release_shared_memory`, :func:`shared_memory_checked`),
and the engines' temporary directories (:func:`remove_temporary_dirs`).

vLLM's CPU build gives each rank of a tensor-parallel group a POSIX shared-memory segment
named after the group, the same name in every run under torchrun (its external launcher
initializes from ``env://``), and removes the name only when the process exits normally. A
rank killed (``kill -9``, a crash) or ended by ``os._exit`` left it behind, and the next run's
engine on that machine then failed to start ("create shm in SHMManager failed. errno: 17").
Once every rank of a group has mapped the segments, the names are no longer needed (a mapping
outlives its name), so each rank removes its own right after the engine starts.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import shlex
import shutil
from collections.abc import Iterator

import numpy as np
import torch

SHM_DIR = "/dev/shm"
"""Where Linux shows POSIX shared memory as files."""
TEMPORARY_DIRS: set[str] = set()
"""Every engine's temporary directory (its config.json, LoRA adapters) not yet removed."""


def remove_temporary_dirs(*dirs: str) -> None:
    """Remove ``dirs`` (default: every engine's), as an engine's finalizer does: also called
    by a rank that leaves with ``os._exit``, which runs no finalizer."""
    for path in dirs or tuple(TEMPORARY_DIRS):
        shutil.rmtree(path, ignore_errors=True)
        TEMPORARY_DIRS.discard(path)


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


def release_shared_memory() -> list[str]:
    """Remove the names of this rank's shared-memory segments in vLLM's CPU tensor-parallel
    and pipeline groups (see the module docstring); the segments stay mapped and in use.
    Returns the names removed (none on GPUs, whose groups use NCCL). Call it after the
    engine has started: vLLM's start ends with a barrier once every rank has mapped them."""
    try:
        import _posixshmem  # POSIX shared memory, as multiprocessing.shared_memory uses it

        from vllm.distributed import parallel_state

        groups = (parallel_state.get_tp_group(), parallel_state.get_pp_group())
    except (ImportError, AttributeError, AssertionError):  # another vLLM: its names stay
        return []
    removed = []
    for group in groups:
        communicator = getattr(group, "device_communicator", None)
        name = getattr(getattr(communicator, "dist_module", None), "group_name", None)
        if name is None:
            continue
        segment = f"{name}_{communicator.rank}"
        try:
            _posixshmem.shm_unlink(segment)
        except FileNotFoundError:
            continue
        removed.append(segment)
    return removed


@contextlib.contextmanager
def shared_memory_checked(shm_dir: str = SHM_DIR) -> Iterator[None]:
    """Start vLLM with its failures to set up a tensor-parallel group's shared memory
    explained: a segment of that name exists already (which of this user's files hold such
    names, and the command that removes them), or one was removed while the group started."""
    try:
        yield
    except RuntimeError as e:
        if "open shm in SHMManager failed. errno: 2" in str(e):
            raise RuntimeError(
                "vLLM's CPU tensor-parallel workers lost a segment of their shared memory "
                "while they started: a vLLM run on this machine ended at that moment (vLLM "
                "removes the names of its group's segments as it exits, and under torchrun "
                "names them the same in every run). Start again."
            ) from e
        if "create shm in SHMManager failed. errno: 17" not in str(e):
            raise
        pattern = os.path.join(glob.escape(shm_dir), "*cpushm_*")
        stale = sorted(f for f in glob.glob(pattern) if os.stat(f).st_uid == os.getuid())
        remove = f" (rm -- {' '.join(shlex.quote(f) for f in stale)})" if stale else ""
        raise RuntimeError(
            "vLLM's CPU tensor-parallel workers could not create their shared memory: a "
            "segment of the same name exists, left by a vLLM process that did not end normally "
            "(killed, or by os._exit) or held by another vLLM run starting on this machine "
            f"right now. Under torchrun vLLM gives it the same name in every run. Segments "
            f"found: {', '.join(stale) or f'none of yours in {shm_dir}'}. If no other vLLM "
            f"runs on this machine, remove them{remove} and start again."
        ) from e
