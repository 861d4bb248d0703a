"""An optimizer's state dict as safetensors and JSON, with nothing pickled: its tensors
(moments, step counts) go to the shards, everything else (each group's settings, any value
that is not a tensor) to JSON that reads back exactly, tuples and integer keys included."""

from __future__ import annotations

from typing import Any

import torch


def to_json(value: Any) -> Any:
    """``value`` (numbers, strings, None, lists, tuples, dicts with string or integer keys) as
    JSON that :func:`from_json` turns back into it exactly: a tuple is ``{"__tuple__": [...]}``
    and a dict with integer keys ``{"__int_keys__": [[k, v], ...]}``. Anything else (a tensor
    among an optimizer's settings, say) is a TypeError naming it."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v) for v in value]}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: to_json(v) for k, v in value.items()}
        if all(isinstance(k, int) for k in value):
            return {"__int_keys__": [[k, to_json(v)] for k, v in value.items()]}
    raise TypeError(f"{type(value).__name__} {value!r} cannot be saved as JSON")


def from_json(value: Any) -> Any:
    """What :func:`to_json` was given."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(from_json(v) for v in value["__tuple__"])
        if set(value) == {"__int_keys__"}:
            return {int(k): from_json(v) for k, v in value["__int_keys__"]}
        return {k: from_json(v) for k, v in value.items()}
    return value


def split_optimizer_state(
    optim_sd: dict[str, Any],
) -> tuple[dict[str, dict[Any, dict[str, torch.Tensor]]], dict[str, Any]]:
    """An optimizer's state dict as its tensors (``{"state": {param: {name: tensor}}}``) and
    the rest, as JSON (``param_groups``, and any per-parameter value that is not a tensor)."""
    tensors: dict[Any, dict[str, torch.Tensor]] = {}
    others: dict[Any, dict[str, Any]] = {}
    for param, entries in optim_sd["state"].items():
        tensors[param] = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
        rest = {k: v for k, v in entries.items() if not isinstance(v, torch.Tensor)}
        if rest:
            others[param] = rest
    rest_json = {"param_groups": to_json(optim_sd["param_groups"]), "state": to_json(others)}
    return {"state": tensors}, rest_json


def join_optimizer_state(
    tensors: dict[str, dict[Any, dict[str, torch.Tensor]]], rest_json: dict[str, Any]
) -> dict[str, Any]:
    """The state dict :func:`split_optimizer_state` split."""
    state = {param: dict(entries) for param, entries in tensors["state"].items()}
    for param, entries in from_json(rest_json["state"]).items():
        state.setdefault(param, {}).update(entries)
    return {"state": state, "param_groups": from_json(rest_json["param_groups"])}
