"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own
shards in parallel, and a checkpoint loads at any world size, one process included, because
each shard records where it lies in the whole tensor and DCP reshards on load.

A checkpoint from elsewhere is data, not code, so nothing in one is pickled. DCP's default
files are: its ``.metadata`` is a pickle, and its default load planner reads every non-tensor
item (the optimizer's learning rate, betas ...) with ``torch.load(weights_only=False)``, which
runs whatever a crafted shard asks for. Here the shards are safetensors files (DCP's Hugging
Face storage: tensors and a JSON header, each shard's offsets in it), there is no
``.metadata`` (the reader rebuilds it from the shards' headers), every value that is not a
tensor is JSON (``optimizer.json``), and the load planner refuses any item that is not a
tensor. A directory in the pickled format (dapo before commit 96772cf) is refused before
anything in it is read.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from dapo import dist
from dapo.dist.optim_groups import kernels_kept
from dapo.dist.state_json import join_optimizer_state, split_optimizer_state

OPTIMIZER_JSON = "optimizer.json"
"""The optimizer's values that are not tensors (each group's settings), beside the shards."""
_PICKLED = ".metadata"  # DCP's default metadata file: a pickle


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something that is not tensors and JSON, or points outside itself."""


# ----------------------------------------------------------------------------- reading safely


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that an item that is not a tensor is refused: DCP's own
    reads one with ``torch.load(weights_only=False)``."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise UnsafeCheckpointError(
            f"the checkpoint holds a non-tensor item {read_item.dest_index.fqn!r}, which dapo "
            "never writes and does not read (it would be unpickled). Resume only from a run "
            "directory dapo wrote (or restore the checkpoint from a copy you trust)"
        )


class SafeReader(HuggingFaceStorageReader):
    """DCP's safetensors reader, over the shards of one directory only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        where = Path(self.path)
        try:
            metadata = super().read_metadata(*args, **kwargs)
        except Exception as exc:  # a truncated or garbled shard: safetensors' own error
            raise UnsafeCheckpointError(
                f"{where}: unreadable checkpoint shards ({type(exc).__name__}: {exc})"
            ) from None
        for info in metadata.storage_data.values():
            path = Path(info.relative_path)
            if path.parent.resolve() != where.resolve() or path.is_symlink():
                raise UnsafeCheckpointError(
                    f"{where}: the checkpoint reads {path}, outside its directory; it was not "
                    "read. Resume only from a run directory dapo wrote"
                )
        if not metadata.state_dict_metadata:
            raise UnsafeCheckpointError(f"{where}: no checkpoint shards (*.safetensors)")
        for name, info in metadata.state_dict_metadata.items():
            gap = _uncovered(info) if hasattr(info, "chunks") else None
            if gap:
                raise UnsafeCheckpointError(
                    f"{where}: the shards of tensor {name!r} {gap}: the checkpoint is damaged "
                    "or incomplete (a rank's shard missing); use another checkpoint"
                )
        return metadata


def _uncovered(info: Any) -> str | None:
    """Why the chunks the shards hold of one tensor (``info``: DCP's metadata of it) do not
    cover it exactly once, or None when they do: a part left out would be read as whatever
    memory held before."""
    size = tuple(info.size)
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in info.chunks]
    for offsets, sizes in boxes:
        inside = len(offsets) == len(sizes) == len(size) and all(
            o >= 0 and n >= 0 and o + n <= whole
            for o, n, whole in zip(offsets, sizes, size, strict=True)
        )
        if not inside:
            where = f"offsets {list(offsets)}, sizes {list(sizes)}"
            return f"hold a part ({where}) outside its shape {list(size)}"
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if all(
                max(ao, bo) < min(ao + an, bo + bn)
                for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size, strict=True)
            ):
                return f"overlap (parts at offsets {list(a_off)} and {list(b_off)})"
    held = sum(math.prod(sizes) for _, sizes in boxes)
    if held != math.prod(size):
        return f"hold {held} of its {math.prod(size)} elements"
    return None


def check_format(path: Path) -> None:
    """Refuse a directory of DCP's pickled format before anything in it is read."""
    if (Path(path) / _PICKLED).exists():
        raise UnsafeCheckpointError(
            f"{path} holds a pickled checkpoint ({_PICKLED}: by dapo before commit 96772cf, or "
            "not by dapo), which dapo does not read: a pickle can run code. Resume it with the "
            "dapo that wrote it, or start the run again"
        )


# ----------------------------------------------------------------------------- save and load


def tied_keys(model: torch.nn.Module) -> tuple[str, str] | None:
    """(output head key, input embeddings key) when the two share one weight (an adapted
    head's frozen weight included: peft's layer shows its base layer's), which
    ``save_pretrained`` stores once, as the input embeddings."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    inputs = getattr(model, "get_input_embeddings", lambda: None)()
    if head is None or inputs is None or head.weight is not inputs.weight:
        return None
    by_module = {id(m): n for n, m in model.named_modules()}
    return f"{by_module[id(head)]}.weight", f"{by_module[id(inputs)]}.weight"


def tied_aliases(model_sd: dict[str, Any]) -> dict[str, str]:
    """``{key: the earlier key whose tensor it is}`` for weights tied to another (a head that
    is the input embedding): safetensors stores a tensor once, under its first key."""
    seen: dict[tuple, str] = {}
    aliases = {}
    for key, value in model_sd.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        if not isinstance(local, torch.Tensor):
            continue
        where = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if where in seen and local.numel():
            aliases[key] = seen[where]
        else:
            seen.setdefault(where, key)
    return aliases


def _unstepped(optimizer: torch.optim.Optimizer) -> None:
    """Empty again the state of an optimizer that had none (it has not stepped yet): torch's
    ``get_state_dict`` and ``set_state_dict`` give it a made-up one (``_init_optim_state``:
    a step of zero gradients at learning rate 0, leaving AdamW's step count at 1 and its
    moments at zero), and its first real update would take the bias correction of step 2
    (about 0.74x as large) rather than of step 1, unlike the one-process run's."""
    optimizer.state.clear()


def _options(model: torch.nn.Module) -> StateDictOptions:
    """Frozen parameters (LoRA's base) are neither saved nor loaded: they never change, and
    the base model's own files hold them."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _without_frozen(model: torch.nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """``model_sd`` without the frozen parameters under any of their names: DCP's
    ``ignore_frozen_params`` drops each under one name, and a tied one (a head that is the
    frozen embedding) stays under the other."""
    frozen = {
        name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        for name, p in model.named_parameters(remove_duplicate=False)
        if not p.requires_grad
    }
    return {k: v for k, v in model_sd.items() if k not in frozen}


def save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the model's and the optimizer's tensors (each rank its shards, safetensors; a
    tied weight once; no frozen parameter) under ``path``, and the optimizer's other values
    as JSON (rank 0). An optimizer that has not stepped yet is saved, and left, without state
    (as the one-process checkpoint keeps it): see :func:`_unstepped`."""
    unstepped = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    if unstepped:
        _unstepped(optimizer)
        optim_sd = {**optim_sd, "state": {}}  # no tensors: load reads "not stepped yet"
    model_sd = _without_frozen(model, model_sd)
    for alias in tied_aliases(model_sd):
        del model_sd[alias]
    optim_tensors, optim_json = split_optimizer_state(optim_sd)
    state = {"model": model_sd, "optim": optim_tensors}
    writer = HuggingFaceStorageWriter(str(path), save_distributed=True)
    # Coordinated on the patient group: a rank that has written its shards waits there for
    # the slowest writer, for as long as dist.wait_timeout_s, not the collectives' timeout.
    try:
        dcp.save(state, storage_writer=writer, process_group=dist.wait_group())
    except CheckpointException as exc:  # on every rank: DCP shares a rank's failure
        raise first_failure(exc) from None
    failed = None
    if dist.is_main():
        try:
            (Path(path) / OPTIMIZER_JSON).write_text(json.dumps(optim_json) + "\n")
        except OSError as exc:
            failed = exc
    failed = dist.broadcast(failed)  # every rank raises rank 0's failure, none waits on it
    if failed is not None:
        raise failed


def first_failure(exc: CheckpointException) -> Exception:
    """The error of the lowest rank that failed, behind DCP's report of a failed save: an
    ``OSError`` for a full disk, which the report (a ``BaseException``, not an ``Exception``,
    with every rank's traceback) would hide from the callers that name it."""
    failures = exc.failures
    first = failures[min(failures)][0] if failures else None
    return first if isinstance(first, Exception) else RuntimeError(str(exc))


def unreadable(path: Path, exc: CheckpointException) -> UnsafeCheckpointError:
    """The error of a load DCP reports as failed: the planner's refusal as it is, a read
    error (a shard cut short, an I/O error) naming the directory and the fix."""
    first = first_failure(exc)
    if isinstance(first, UnsafeCheckpointError):
        return first
    return UnsafeCheckpointError(
        f"{path}: the checkpoint shards could not be read ({type(first).__name__}: {first}): "
        "the checkpoint is damaged; resume from an earlier one (move this step's directory "
        "out of checkpoints/)"
    )


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read a checkpoint :func:`save` wrote, at this world size (sharded or one process)."""
    check_format(path)
    # Read here first, so that a bad directory is refused with its own message rather than
    # inside DCP's collective error report (the reader checks again as DCP reads).
    metadata = SafeReader(str(path)).read_metadata()
    options = _options(model)
    if any(name.startswith("optim.") for name in metadata.state_dict_metadata):
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        optim_tensors, _ = split_optimizer_state(optim_sd)  # where the saved state goes
    else:  # saved before the optimizer's first step: none to read, nor to make up
        model_sd, optim_tensors = get_model_state_dict(model, options=options), {"state": {}}
    model_sd = _without_frozen(model, model_sd)
    aliases = tied_aliases(model_sd)
    state = {"model": {k: v for k, v in model_sd.items() if k not in aliases}}
    state["optim"] = optim_tensors
    with warnings.catch_warnings():
        # One process reading shards is intended here, not a missing process group.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(
                state,
                storage_reader=SafeReader(str(path)),
                planner=TensorsOnlyPlanner(),
                process_group=dist.wait_group(),  # each rank reads its shards at its own pace
            )
        except CheckpointException as exc:
            raise unreadable(path, exc) from None
    try:
        optim_json = json.loads((Path(path) / OPTIMIZER_JSON).read_text())
        optim = join_optimizer_state(state["optim"], optim_json)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:  # deep JSON too
        raise UnsafeCheckpointError(
            f"{Path(path) / OPTIMIZER_JSON} is missing or unreadable ({exc!r}): the checkpoint "
            "is damaged; resume from an earlier one (delete this step's directory)"
        ) from None
    for alias, source in aliases.items():
        state["model"][alias] = state["model"][source]
    with kernels_kept(optimizer):
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=optim,
            options=options,
        )
    if not optim["state"]:  # none saved: none made up here either
        _unstepped(optimizer)


def load_full(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    optim_state: dict[str, Any],
) -> None:
    """Load a one-process checkpoint (whole tensors; the optimizer's state keyed by parameter
    index, as ``optimizer.state_dict()`` gives it) into a sharded model and its optimizer."""
    frozen = any(not p.requires_grad for p in model.parameters())  # LoRA: adapters alone
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=frozen, strict=not frozen)
    set_model_state_dict(model, weights, options=options)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    by_name = {
        "state": {names[i]: s for i, s in optim_state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]
        ],
    }
    with kernels_kept(optimizer):
        set_optimizer_state_dict(model, optimizer, by_name, options=options)
    if not by_name["state"]:  # saved before the first step: the made-up state is not kept
        _unstepped(optimizer)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights on rank 0, in the CPU memory (empty on the other ranks), for an
    export in the Hugging Face format."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


# ----------------------------------------------------------------------------- one process


def stored_tensors(path: Path, prefix: str = "model.") -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The tensors of a checkpoint :func:`save` wrote whose names start with ``prefix`` (the
    model's: ``model.`` and its parameter names), each whole tensor's shape and dtype, read
    from the shards' headers alone."""
    check_format(path)
    metadata = SafeReader(str(path)).read_metadata()
    return {
        name: (info.size, info.properties.dtype)
        for name, info in metadata.state_dict_metadata.items()
        if name.startswith(prefix) and hasattr(info, "size")
    }


def read_tensors(
    path: Path, wanted: dict[str, tuple[torch.Size, torch.dtype]]
) -> dict[str, torch.Tensor]:
    """The whole tensors ``wanted`` (name: shape and dtype, as :func:`stored_tensors` gives
    them) of a checkpoint written at any world size, gathered from every rank's shards in this
    one process, into the CPU memory: a part of the checkpoint at a time."""
    SafeReader(str(path)).read_metadata()  # refused with its own message, not DCP's report
    state = {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in wanted.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(
                state,
                storage_reader=SafeReader(str(path)),
                planner=TensorsOnlyPlanner(),
                no_dist=True,
            )
        except CheckpointException as exc:
            raise unreadable(path, exc) from None
    return state
