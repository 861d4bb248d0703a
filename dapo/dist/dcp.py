"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own
shards in parallel, and a checkpoint loads at any world size, one process included, because
DCP stores each tensor's global shape and reshards on load.

The state is keyed by parameter name (``get_state_dict``), for the model and the optimizer
alike, so that no rank or parameter index is written into the checkpoint.

A checkpoint from elsewhere is data, not code: DCP writes its ``.metadata`` with pickle and
torch's reader loads it with ``pickle.load``, which runs whatever a crafted file asks for.
:class:`SafeReader` reads it through an unpickler that admits only the classes DCP's metadata
is made of; the shards' non-tensor items are read by torch with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from dapo import dist


# (module, name) -> allowed: DCP's metadata records, torch's sizes, dtypes and layouts, a path.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint's metadata asks for something that is not checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{module}.{name}")


def read_metadata(data: bytes, where: str) -> Any:
    """DCP's metadata from the bytes of a ``.metadata`` file, refusing anything else."""
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"{where}: the checkpoint's metadata asks for {exc}, which no torch.distributed "
            "checkpoint holds; it was not read and nothing in it ran. Resume only from a run "
            "directory dapo wrote (or restore the checkpoint from a copy you trust)"
        ) from None
    except Exception as exc:  # a truncated or garbled file: any unpickling error
        raise UnsafeCheckpointError(
            f"{where}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})"
        ) from None


class SafeReader(FileSystemReader):
    """torch's file-system reader, with ``.metadata`` read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_metadata(path.read_bytes(), str(path))
        # Shards are files of this directory: a crafted path must not read one elsewhere.
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            name = getattr(info, "relative_path", "")
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise UnsafeCheckpointError(
                    f"{path}: the checkpoint's metadata points at {name!r}, outside its "
                    "directory; it was not read. Resume only from a run directory dapo wrote"
                )
        # What torch's own read_metadata adds after loading.
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the model's and the optimizer's state (each rank its shards) under ``path``."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, checkpoint_id=str(path), process_group=dist.group())


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read a checkpoint :func:`save` wrote, at this world size (sharded or one process)."""
    # Checked here first, so that a crafted file is refused with its own message rather than
    # inside DCP's collective error report (the reader checks again as DCP reads).
    SafeReader(str(path)).read_metadata()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        # One process reading shards is intended here, not a missing process group.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(str(path)), process_group=dist.group())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def load_full(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    optim_state: dict[str, Any],
) -> None:
    """Load a one-process checkpoint (whole tensors; the optimizer's state keyed by parameter
    index, as ``optimizer.state_dict()`` gives it) into a sharded model and its optimizer."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=options)
    names = [name for name, _ in model.named_parameters()]
    by_name = {
        "state": {names[i]: s for i, s in optim_state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=options)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights on rank 0, in the CPU memory (empty on the other ranks), for an
    export in the Hugging Face format."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
