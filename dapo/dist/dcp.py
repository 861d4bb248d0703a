"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own
shards in parallel, and a checkpoint loads at any world size, one process included, because
DCP stores each tensor's global shape and reshards on load.

The state is keyed by parameter name (``get_state_dict``), for the model and the optimizer
alike, so that no rank or parameter index is written into the checkpoint.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)


def save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the model's and the optimizer's state (each rank its shards) under ``path``."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read a checkpoint :func:`save` wrote, at this world size (sharded or one process)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        # One process reading shards is intended here, not a missing process group.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
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
