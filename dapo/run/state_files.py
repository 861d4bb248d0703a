"""The optimizer's state and the generators' states as files of tensors and JSON, nothing
pickled: ``NAME.safetensors`` holds the tensors, ``NAME.json`` everything else.

A checkpoint from elsewhere is data: reading it must not run anything, and a pickle (even
torch's restricted one) is a program for its unpickler. safetensors and JSON are formats a
reader parses; a damaged or crafted file is an error naming it, never code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dapo.dist.state_json import join_optimizer_state, split_optimizer_state, to_json

_SEP = "/"  # between a parameter's index and its state's name in a tensor's key


class StateFileError(ValueError):
    """A state file is missing, damaged or not what dapo writes; the message names it."""


def save_optimizer(optim_sd: dict[str, Any], stem: Path) -> None:
    """``optimizer.state_dict()`` as ``stem.safetensors`` and ``stem.json``."""
    tensors, rest = split_optimizer_state(optim_sd)
    flat = {
        f"{param}{_SEP}{name}": t.detach().contiguous()
        for param, entries in tensors["state"].items()
        for name, t in entries.items()
    }
    save_file(flat, stem.with_suffix(".safetensors"))
    stem.with_suffix(".json").write_text(json.dumps(rest) + "\n")


def load_optimizer(stem: Path) -> dict[str, Any]:
    """The state dict :func:`save_optimizer` wrote, keyed by parameter index as
    ``optimizer.load_state_dict`` takes it."""
    try:
        flat = load_file(stem.with_suffix(".safetensors"))
        rest = json.loads(stem.with_suffix(".json").read_text())
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in flat.items():
            param, name = key.split(_SEP, 1)
            state.setdefault(int(param), {})[name] = tensor
        return join_optimizer_state({"state": state}, rest)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError, RecursionError) as exc:
        raise _damaged(stem, exc) from None


def save_rng(state: dict[str, Any], stem: Path) -> None:
    """The generators' states (:func:`dapo.run.checkpoint.capture_rng`) as ``stem.*``."""
    kind, keys, pos, has_gauss, cached = state["numpy"]
    tensors = {"torch": state["torch"], "numpy_keys": keys}
    if "cuda_rank" in state:
        tensors["cuda_rank"] = state["cuda_rank"]
    save_file(tensors, stem.with_suffix(".safetensors"))
    rest = {"python": to_json(state["python"]), "numpy": [kind, pos, has_gauss, cached]}
    stem.with_suffix(".json").write_text(json.dumps(rest) + "\n")


def load_rng(stem: Path) -> dict[str, Any]:
    """What :func:`save_rng` was given."""
    try:
        tensors = load_file(stem.with_suffix(".safetensors"))
        rest = json.loads(stem.with_suffix(".json").read_text())
        version, internal, gauss = rest["python"]
        kind, pos, has_gauss, cached = rest["numpy"]
        state = {
            "python": [int(version), [int(x) for x in internal], gauss],
            "numpy": [str(kind), tensors["numpy_keys"], int(pos), int(has_gauss), float(cached)],
            "torch": tensors["torch"],
        }
    except (OSError, ValueError, KeyError, TypeError, SafetensorError, RecursionError) as exc:
        raise _damaged(stem, exc) from None
    if "cuda_rank" in tensors:
        state["cuda_rank"] = tensors["cuda_rank"]
    return state


def unfit(stem: Path, exc: Exception, what: str) -> str:
    """Why the state read from ``stem.*`` could not be set into ``what`` (``exc``: the error
    torch or Python raised, which names no file)."""
    return (
        f"{stem}.json / {stem.name}.safetensors hold a state that does not fit {what} "
        f"({type(exc).__name__}: {exc})"
    )


def _damaged(stem: Path, exc: Exception) -> StateFileError:
    """The error for state files that cannot be read (JSON nested deeper than the parser
    recurses, a RecursionError, included): damage like any other, named."""
    return StateFileError(
        f"{stem}.safetensors / {stem.name}.json are missing or unreadable ({exc!r}): the "
        "checkpoint is damaged; resume from an earlier one (delete this step's directory)"
    )
