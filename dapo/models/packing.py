"""Packed micro-batches (``train.packing``): a micro-batch's rows laid end to end, no padding.

A padded micro-batch computes every row to the longest prompt plus the longest response; on
real length mixes much of that is padding, and attention over it is paid quadratically. A
packed one is one sequence ``[1, N]``: each group's prompt once, then each of its rows'
responses, groups one after another, positions counted from 0 at each prompt's first token.
Attention stays within a row: the model's attention function is :func:`packed_attention`,
which, when the forward is given ``packed_groups`` (the groups' token counts, a host tuple, so
nothing is read back from the device), lets each response attend to its prompt and itself
alone; in every other call (generation, an unpacked pass) it is transformers' SDPA, as before.
Nothing attends across rows, nothing is computed twice: the log-probs are those of the padded
forward up to float rounding (tested).

Two ways to run it, the same function: on a GPU in bf16/fp16, one call of PyTorch's
variable-length flash attention for the whole micro-batch (:func:`varlen_packed`, a later
response's prompt keys gathered beside it); elsewhere one causal SDPA call per response
(:func:`looped_packed`).

Shapes: N = packed tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dapo.data.transfer import to_device

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
    prompt followed by each of its responses in turn, a response never seeing another; without,
    transformers' own SDPA.

    On a GPU in bf16 or fp16 this is one call of PyTorch's variable-length flash attention
    (:func:`varlen_dtype`); elsewhere (a CPU, float32) one SDPA call per response, its prompt's
    queries, keys and values copied beside it."""
    if torch.compiler.is_compiling():  # a compiled layer (train.compile): run it outside
        args = (module, query, key, value, attention_mask, dropout, scaling, is_causal)
        return outside_graph(*args, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = kwargs.pop("packed_groups", None)
    if isinstance(groups, Layout):
        groups = groups.groups
    check_routed(module, query, groups)
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
    dropout_p = dropout if module.training else 0.0
    half = varlen_dtype(query) if dropout_p == 0.0 else None
    if half is not None:  # cast as SDPA under autocast casts (the rotary leaves float32)
        q, k, v = (x.to(half) for x in (query, key, value))
        return varlen_packed(q, k, v, groups, scale=scaling), None
    return looped_packed(query, key, value, groups, dropout_p=dropout_p, scale=scaling), None


class PackingRefused(ValueError):
    """A model that packed passes cannot keep rows apart in (the message says the fix)."""


_PASS: contextvars.ContextVar[tuple[int, list[int]] | None] = contextvars.ContextVar(
    "dapo_packed_pass", default=None
)
"""The packed forward under way in this thread: its token count, and how many attention
calls were given its groups."""


@contextlib.contextmanager
def packed_pass(tokens: int, model: Any) -> Iterator[None]:
    """A packed forward of ``tokens`` through ``model`` (or its forward method, as FSDP's
    :func:`dapo.dist.fsdp.within_forward` hands it), refused (with the fix) when its
    attention did not come through :func:`packed_attention` with the groups: a model whose
    attention bypasses transformers' attention functions (Falcon's eager path) fails inside,
    or not at all, and its rows would attend to each other."""
    config = getattr(getattr(model, "__self__", model), "config", None)
    kind = getattr(config, "model_type", None) or "its type unknown"
    calls = [0]
    reset = _PASS.set((tokens, calls))
    try:
        yield
    except TypeError as exc:  # Falcon's eager path given no mask; an OOM or NCCL error passes
        if calls[0]:
            raise
        why = f" (it failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        raise PackingRefused(_not_routed(kind, "does not run attention through") + why) from exc
    else:
        if not calls[0]:
            raise PackingRefused(_not_routed(kind, "does not run attention through"))
    finally:
        _PASS.reset(reset)


def check_routed(module: torch.nn.Module, query: torch.Tensor, groups: Groups | None) -> None:
    """Count an attention call of the packed pass under way, or refuse one that lost its
    groups on the way (a decoder layer that drops its keyword arguments: StableLM's), which
    would attend over the whole packed sequence, every row seeing the rows before it."""
    active = _PASS.get()
    if active is None:  # not a packed pass (or backward's recompute of a checkpointed layer)
        return
    tokens, calls = active
    if groups is not None:
        calls[0] += 1
    elif query.shape[-2] == tokens:
        kind = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise PackingRefused(_not_routed(kind, "does not hand packed_groups to"))


def _not_routed(kind: str, what: str) -> str:
    return (
        f"train.packing=true: this model ({kind}) {what} transformers' attention functions "
        "(dapo's packed attention), so packed rows could not be kept from attending to each "
        "other; set train.packing=false"
    )


outside_graph = torch.compiler.disable(packed_attention)
""":func:`packed_attention` kept out of compiled graphs: the loop's splits and varlen's
offsets come from host data."""


class Layout:
    """A micro-batch's groups as the model is given them (``packed_groups``): an object a
    compiled layer (``train.compile``) passes on without reading, where a tuple would be a
    constant its graph is specialised on, compiling again for every micro-batch."""

    __slots__ = ("groups",)

    def __init__(self, groups: Groups) -> None:
        self.groups = groups


def looped_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    groups: Groups,
    *,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Packed attention as one causal SDPA call per response over its prompt and itself
    (returns [1, N, heads, d]). The packed tensors are split once: the gradient of a split is
    one concatenation, where a slice per response would add a zero-filled [1, heads, N, d]
    gradient per slice in backward."""
    sizes = [n for prompt, responses in groups for n in (prompt, *responses)]
    pieces = [x.split(sizes, dim=2) for x in (query, key, value)]
    options = dict(dropout_p=dropout_p, scale=scale, enable_gqa=True)
    out, i = [], 0
    for _, responses in groups:
        prompt_qkv = [x[i] for x in pieces]
        first = True
        for j, length in enumerate(responses, start=i + 1):
            if not length:  # an empty response has no query
                continue
            # Causal attention over prompt + response, as the padded row computes it; the
            # prompt's own outputs are kept once, from the group's first response.
            q, k, v = (
                torch.cat([x_p, x[j]], dim=2) for x_p, x in zip(prompt_qkv, pieces, strict=True)
            )
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
            out.append(attended if first else attended[:, :, prompt_qkv[0].shape[2] :])
            first = False
        if first and prompt_qkv[0].shape[2]:  # no response: the prompt alone
            out.append(F.scaled_dot_product_attention(*prompt_qkv, is_causal=True, **options))
        i += 1 + len(responses)
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()


def varlen_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The dtype :func:`varlen_packed` runs ``query`` in, or None where it cannot run.

    It runs on a CUDA tensor in bf16 or fp16: the autocast dtype under CUDA autocast (a
    float32 query there is what rotary embeddings computed in float32 give back, and SDPA
    would cast it), else the query's own. Also needed: a GPU that flash attention supports
    (compute capability 8.0 or later), a head size of at most 256, and a PyTorch with
    ``torch.nn.attention.varlen``."""
    if not query.is_cuda:
        return None
    autocast = torch.is_autocast_enabled("cuda")
    dtype = torch.get_autocast_dtype("cuda") if autocast else query.dtype
    if dtype not in (torch.bfloat16, torch.float16) or query.shape[-1] > 256:
        return None
    if torch.cuda.get_device_capability(query.device) < (8, 0) or varlen_kernel() is None:
        return None
    return dtype


def varlen_packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    groups: Groups,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Packed attention as one variable-length flash-attention call (returns [1, N, heads,
    d]). Each segment of queries (a group's prompt with its first response, then each later
    response) attends causally to its keys, aligned at the end: a later response's keys are its
    prompt's, gathered once, then its own."""
    layout = varlen_layout(groups, query.device)
    k_1KNd, v_1KNd = key, value
    if layout.key_index is not None:
        k_1KNd = key.index_select(2, layout.key_index)
        v_1KNd = value.index_select(2, layout.key_index)
    q_NHd, k_NHd, v_NHd = (x[0].transpose(0, 1) for x in (query, k_1KNd, v_1KNd))
    attend, gqa = varlen_kernel()
    extra = {"enable_gqa": True} if gqa else {}  # older PyTorch: flash takes GQA as it is
    out_NHd = attend(
        q_NHd,
        k_NHd,
        v_NHd,
        layout.cu_q,
        layout.cu_k,
        layout.max_q,
        layout.max_k,
        scale=scale,
        window_size=(-1, 0),  # causal, aligned at the segment's last key
        **extra,
    )
    return out_NHd[None]


Groups = tuple[tuple[int, tuple[int, ...]], ...]
"""(prompt tokens, each of its rows' response tokens) per group: :attr:`Packing.groups`."""


@dataclass(frozen=True)
class VarlenLayout:
    """Where the variable-length call's segments start (int32 offsets on the device)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    key_index: torch.Tensor | None
    """Packed positions of each segment's keys, in order; None where they are its queries'."""


@functools.lru_cache(maxsize=8)  # one micro-batch's layout serves all its layers
def varlen_layout(groups: Groups, device: torch.device) -> VarlenLayout:
    """The segments of :func:`varlen_packed` for ``groups``, built on the host."""
    q_lengths, k_ranges, start = [], [], 0
    for prompt, responses in groups:
        first = True
        at = start + prompt
        for length in responses:
            if length:
                if first:
                    q_lengths.append(prompt + length)
                    k_ranges.append([(start, prompt + length)])
                else:
                    q_lengths.append(length)
                    k_ranges.append([(start, prompt), (at, length)])
                first = False
            at += length
        if first and prompt:
            q_lengths.append(prompt)
            k_ranges.append([(start, prompt)])
        start = at
    k_lengths = [sum(n for _, n in ranges) for ranges in k_ranges]
    shared = k_lengths != q_lengths
    index = [p for ranges in k_ranges for s, n in ranges for p in range(s, s + n)]

    def offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32)

    return VarlenLayout(
        cu_q=to_device(offsets(q_lengths), device),
        cu_k=to_device(offsets(k_lengths), device),
        max_q=max(q_lengths, default=0),
        max_k=max(k_lengths, default=0),
        key_index=to_device(torch.tensor(index, dtype=torch.long), device) if shared else None,
    )


@functools.cache
def varlen_kernel() -> tuple[Callable, bool] | None:
    """PyTorch's ``varlen_attn`` and whether it takes ``enable_gqa`` (added after 2.11), or
    None before it existed."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


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


FULL_LAYERS = frozenset({"full_attention", "attention", "dense", "sparse", "moe"})
"""``layer_types`` entries that attend to the whole row, or are no attention at all."""


def packing_refusal(config: Any) -> str | None:
    """Why a model of this transformers config cannot pack (the message, with the model type,
    the field and the fix), or None. :func:`packed_attention` attends to each whole row, so a
    sliding window that can bind (one shorter than ``max_position_embeddings``, switched on by
    ``use_sliding_window`` where the config has that switch: Qwen2's carries a window it does
    not use) would be lost, and so would any layer not of full attention (``layer_types``:
    windowed, chunked, recurrent)."""
    kind = getattr(config, "model_type", None) or type(config).__name__
    fix = "; set train.packing=false"
    window = getattr(config, "sliding_window", None)
    switch = getattr(config, "use_sliding_window", True)
    longest = getattr(config, "max_position_embeddings", None)
    if isinstance(window, int) and switch and (longest is None or window < longest):
        field = "use_sliding_window=true, " if hasattr(config, "use_sliding_window") else ""
        return (
            f"train.packing=true attends to each whole row, and this model ({kind}) has "
            f"sliding-window attention ({field}sliding_window={window}, shorter than its "
            f"max_position_embeddings={longest}){fix}"
        )
    other = sorted(set(getattr(config, "layer_types", None) or ()) - FULL_LAYERS)
    if other:
        return (
            f"train.packing=true attends to each whole row, and this model ({kind}) has "
            f"layers that do not attend to the whole row (layer_types: {', '.join(other)}): "
            f"packed, a window would be lost or a recurrent state would cross rows{fix}"
        )
    return None


def use_packing(model: torch.nn.Module) -> None:
    """Makes ``model`` attend through :func:`packed_attention` (registered with transformers
    once). Only from SDPA, and without sliding windows (:func:`packing_refusal`): another
    implementation (eager, flash) would change the model's unpacked calls, and a window would
    be lost, packed and in unpadded unpacked calls (:func:`packed_mask` builds no mask there),
    so these are refused with the fix, before anything changes."""
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
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None))}
    for sub in configs.values():  # a VLM's text model has a config of its own
        why = packing_refusal(sub)
        if why:
            raise ValueError(why)
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)
    for module in model.modules():  # sub-models (a VLM's text config) keep their own
        sub = getattr(module, "config", None)
        if sub is not None and getattr(sub, "_attn_implementation", None) == "sdpa":
            sub._attn_implementation = PACKED_ATTENTION
