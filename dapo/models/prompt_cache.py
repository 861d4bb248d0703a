"""The KV cache of a shared prompt pass, made safe to read twice.

:func:`dapo.models.logprobs.response_logprobs` runs a group's prompt once, then its responses
on top of that pass's cache. transformers' ``DynamicLayer`` appends to itself on every call,
so a layer that runs again on the same cache (activation checkpointing recomputes each layer
in the backward pass) would find its keys and values twice. Here neither pass writes twice:

- the prompt pass's layers become :class:`RecordedLayer` s: called again, they hold and
  return the keys and values they are given (those of the first call, recomputed);
- the response pass reads a :class:`PrefixLayer` per layer: the prompt's keys and values,
  indexed out to every row, that each call extends without storing.

The values are those of the plain cache, bit for bit: the response pass concatenates the same
tensors ``DynamicLayer`` would, and the indexing sums the rows' gradients as before.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicLayer


class RecordedLayer(DynamicLayer):
    """A prompt pass's keys and values: a second call replaces them (it recomputes them)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class PrefixLayer(RecordedLayer):
    """A prefix of keys and values that each call extends, keeping nothing: every call (the
    response pass, and its recompute) attends to the prefix and its own positions."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys = torch.cat([self.keys, key_states], dim=-2)
        return keys, torch.cat([self.values, value_states], dim=-2)


def recorded(cache) -> None:
    """Turn a prompt pass's cache (plain ``DynamicLayer`` s) into :class:`RecordedLayer` s."""
    cache.layers[:] = [RecordedLayer(layer.keys, layer.values) for layer in cache.layers]


def prefix_cache(cache, rows_B: torch.Tensor):
    """A cache for the response pass: ``cache``'s prompts indexed out to rows ``rows_B``
    (row b reads prompt ``rows_B[b]``). ``cache`` itself is left as it is, for a recompute
    of the prompt pass."""
    out = copy.copy(cache)
    out.layers = [PrefixLayer(layer.keys[rows_B], layer.values[rows_B]) for layer in cache.layers]
    return out
