"""Packed micro-batches (``train.packing``): a micro-batch's rows laid end to end, no padding.

A padded micro-batch computes every row to the longest prompt plus the longest response; on
real length mixes much of that is padding, and attention over it is paid quadratically. A
packed one is one sequence ``[1, N]``: each row's prompt tokens and response tokens, rows one
after another, positions counted from 0 in each row. Attention stays within a row: the model's
attention function is :func:`packed_attention`, which runs causal attention on each row's
span alone when the forward is given ``packed_lengths`` (the rows' token counts, a host list,
so nothing is read back from the device), and is PyTorch's SDPA, as before, in every other
call (generation, an unpacked pass). Nothing attends across rows, nothing is computed twice:
the log-probs are those of the padded forward up to float rounding (tested).

A group's prompt runs once per row here (G times), where the padded path's shared-prompt
pass runs it once per group; which costs less depends on the lengths (docs: the speed guide).

Shapes: N = packed tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

PACKED_ATTENTION = "dapo_packed"
"""The attention implementation's name, registered with transformers (:func:`use_packing`)."""


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``query`` [1, heads, N, d], ``key`` and
    ``value`` [1, kv_heads, N, d]; returns [1, N, heads, d]): with ``packed_groups`` in
    ``kwargs`` (:attr:`dapo.data.batch.Packing.groups`), causal attention over each group's
    prompt followed by each of its responses in turn (the prompt's queries, keys and values
    copied beside each response: no mask is built, and a response never sees another);
    without, transformers' own SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = kwargs.pop("packed_groups", None)
    if groups is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    options = dict(dropout_p=dropout if module.training else 0.0, scale=scaling, enable_gqa=True)
    out, start = [], 0
    for prompt, responses in groups:
        span = slice(start, start + prompt)
        prompt_qkv = [x[:, :, span] for x in (query, key, value)]
        start += prompt
        first = True
        for length in filter(None, responses):  # an empty response has no query
            span = slice(start, start + length)
            # Causal attention over prompt + response, as the padded row computes it; the
            # prompt's own outputs are kept once, from the group's first response.
            q, k, v = (
                torch.cat([x_p, x[:, :, span]], dim=2)
                for x_p, x in zip(prompt_qkv, (query, key, value), strict=True)
            )
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
            out.append(attended if first else attended[:, :, prompt:])
            first, start = False, start + length
        if first and prompt:  # no response: the prompt alone
            out.append(F.scaled_dot_product_attention(*prompt_qkv, is_causal=True, **options))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def packed_mask(**kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, but none for a call with no padding mask whose queries are
    its keys (a packed pass, or one unpadded sequence: causal SDPA needs none). transformers
    would otherwise build a dense [N, N] mask of the packed sequence that
    :func:`packed_attention` never reads."""
    from transformers.masking_utils import sdpa_mask

    q_length = kwargs.get("q_length")
    if q_length is None:  # transformers before 5: the cache positions give it
        q_length = kwargs["cache_position"].shape[0]
    if kwargs.get("attention_mask") is None and q_length == kwargs["kv_length"]:
        return None
    return sdpa_mask(**kwargs)


def use_packing(model: torch.nn.Module) -> None:
    """Makes ``model`` attend through :func:`packed_attention` (registered with transformers
    once). Only from SDPA, and without sliding windows: another implementation (eager,
    flash) would change the model's unpacked calls, and a window would be lost, so these are
    refused with the fix."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = model.config
    current = getattr(config, "_attn_implementation", None)
    if current == PACKED_ATTENTION:
        return
    if current != "sdpa":
        raise ValueError(
            f"train.packing=true runs attention through PyTorch's SDPA, and this model was "
            f"loaded with attn_implementation={current!r}; set train.packing=false"
        )
    windowed = getattr(config, "use_sliding_window", False) and config.sliding_window
    if windowed or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(
            "train.packing=true attends to each whole row, and this model has sliding-window "
            "attention layers; set train.packing=false"
        )
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)
    for module in model.modules():  # sub-models (a VLM's text config) keep their own
        sub = getattr(module, "config", None)
        if sub is not None and getattr(sub, "_attn_implementation", None) == "sdpa":
            sub._attn_implementation = PACKED_ATTENTION
