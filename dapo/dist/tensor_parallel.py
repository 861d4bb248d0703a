"""Tensor-parallel generation (``rollout.tp_size=k``): each group of k consecutive ranks holds
one generation copy of the policy, split across its ranks, instead of a whole copy per rank.

Why: under FSDP2 the native engine generates from a whole frozen copy on every rank, and for a
large model that copy alone fills a GPU (``docs/scale-out.md``). Split k ways, each rank holds
1/k of every attention and MLP weight, of the output head and embedding, and 1/k of the KV
cache (its share of the heads); only the norms and rotary tables are whole on every rank.

The split is PyTorch's own tensor parallelism (DTensor placements from ``parallelize_module``),
so it runs on CPU with gloo as on GPUs with NCCL:

- q, k, v, gate and up projections column-wise (each rank computes its heads and its slice
  of the MLP's intermediate), o and down projections row-wise (their partial sums are
  all-reduced): two all-reduces per decoder layer. transformers' attention reshapes with -1
  heads, so a rank's local heads need no change to the model's code, nor does the native
  engine's KV cache (sized from the keys it is given: the local heads);
- the embedding row-wise (vocabulary-sharded, its lookups all-reduced) and the output head
  column-wise with its logits all-gathered to the full vocabulary. Why not a replicated head:
  the head is the largest single matrix of a small model (a 152k x 3584 bf16 head is 1 GiB)
  and tied to the embedding, so sharding both along the vocabulary keeps one tied shard of
  V x H / k per rank, while the gathered logits are [rows, V], what the sampler reads anyway.

By default the split layers then compute on their local shards with plain collectives
(``local_forward``): DTensor's own dispatch is ~1 ms of host time per layer call, which made
decoding 13x slower on a GPU (:func:`tp_generation_copy`).

The logits every rank of a group sees are the same bits (all-gathered shards of a replicated
hidden state; gloo's and NCCL's all-reduces hand every rank the same reduced chunks), so every
rank draws the same tokens from the same seeds: the ranks of a group stay in lockstep, finish
the same rows at the same steps, and return the same rollout. Against one process the
row-parallel sums add in another order: logits differ by float rounding (float32 log-probs
within 1e-6 measured, 1e-4 tested), so a token can differ only where two candidates tie to
within that rounding (greedy) or a uniform falls within it of a CDF boundary (sampled).

How the training step uses it (not wired yet), under torchrun with ``rollout.tp_size=k``:

1. before loading the model, :func:`check_tp_size` with the model's config (errors join the
   config's); every rank then calls ``mesh = tp_mesh(k, device.type)``;
2. instead of the whole ``gen_model``: ``tp_generation_copy(model, mesh, dtype=held,
   device=device)`` (before or after ``fsdp.shard``), given to ``NativeEngine`` as usual;
3. ``sync_engine``: ``fill_tp_copy(model, gen_model)`` in place of ``fsdp.gather_into``;
4. a round's prompts are split over groups, not ranks: ``group_share(n, mesh)`` in place of
   ``dist.share(n)``; every rank of a group calls ``generate`` with the same prompts, seeds
   and ``rows_per_generate`` chunks (the collectives pair up call by call);
5. right after generating, each rank keeps ``group_contribution(samples, mesh)``: the first
   rank of a group keeps its samples, the others none (they need not grade copies), so the
   all-gather of graded groups (``dist.gather_lists``) holds every group's samples once, in
   group order, as one rank per group would give them. Training (FSDP, all ranks) is as now.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dapo import dist

TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Decoder-only models whose attention is q/k/v/o and MLP gate/up/down ``nn.Linear`` layers
under ``model.layers.*``, with ``model.embed_tokens`` and ``lm_head``: :func:`tp_plan` splits
exactly these (mistral untested; one with a sliding window is refused by the native engine,
whose cache must be row-sliceable). Other architectures (fused qkv, MoE experts) need their
own plan."""


def _field(config: Any, name: str) -> Any:
    """A model setting from a transformers config or a config.json dict (None if absent)."""
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def check_tp_size(tp_size: int, world_size: int, model_config: Any) -> list[str]:
    """Why ``rollout.tp_size`` cannot be used with this world size and model, each reason
    naming the field and its fix; empty when it can. ``model_config`` is the model's
    transformers config or its config.json as a dict: the check reads no weights, so a run
    is refused before any model loads.

    tp_size must divide the world size (a group is k consecutive ranks), the attention heads
    and the key-value heads (each rank computes whole heads, and its query heads must read
    its own key-value heads), and the MLP's intermediate size; the model must be one that
    :data:`TP_MODEL_TYPES` lists. The vocabulary need not divide: shards may be uneven."""
    if tp_size == 1:
        return []
    if tp_size < 1:
        return [f"rollout.tp_size must be >= 1 (1 = a whole copy per rank), got {tp_size}"]
    errors = []
    model_type = _field(model_config, "model_type")
    if model_type not in TP_MODEL_TYPES:
        errors.append(
            f"rollout.tp_size={tp_size}: no tensor-parallel plan for model type "
            f"{model_type!r} (supported: {', '.join(TP_MODEL_TYPES)}); set rollout.tp_size=1"
        )
    sizes = {"the world size": world_size}
    names = (
        ("num_attention_heads", "attention heads"),
        ("num_key_value_heads", "key-value heads"),
        ("intermediate_size", "MLP intermediate size"),
    )
    for attr, what in names:
        value = _field(model_config, attr)
        if attr == "num_key_value_heads" and value is None:
            value = _field(model_config, "num_attention_heads")  # no GQA: one kv head per head
        if value is not None:
            sizes[f"the model's {what} ({attr})"] = int(value)
    allowed = [k for k in range(1, world_size + 1) if all(n % k == 0 for n in sizes.values())]
    for what, n in sizes.items():
        if n % tp_size:
            errors.append(
                f"rollout.tp_size={tp_size} does not divide {what}, {n}: set rollout.tp_size "
                f"to one that divides the world size, the heads, the key-value heads and the "
                f"intermediate size: {', '.join(map(str, allowed))}"
            )
    return errors


def require_tp_size(tp_size: int, world_size: int, model_config: Any) -> None:
    """:func:`check_tp_size`, raising ValueError with every reason at once."""
    errors = check_tp_size(tp_size, world_size, model_config)
    if errors:
        raise ValueError("; ".join(errors))


def tp_mesh(tp_size: int, device_type: str) -> DeviceMesh:
    """The 2-D mesh ("dp", "tp") of every rank: ranks 0..k-1 are group 0, k..2k-1 group 1...

    Consecutive ranks, because under torchrun they share a node (for k up to the GPUs per
    node): the two all-reduces per layer then run over NVLink, never the network. Every rank
    calls this (it makes process groups). ``device_type``: "cuda" (NCCL) or "cpu" (gloo), the
    device the model computes on.
    """
    world = dist.world_size()
    if not dist.active():
        raise RuntimeError("rollout.tp_size needs a process group (start under torchrun)")
    if tp_size < 1 or world % tp_size:
        raise ValueError(
            f"rollout.tp_size={tp_size} does not divide the world size {world}: set it to a "
            "divisor of the number of ranks"
        )
    return init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


def tp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(group index, rank within the group) of this rank: rank = group x k + tp rank."""
    return mesh.get_local_rank("dp"), mesh.get_local_rank("tp")


def group_share(n: int, mesh: DeviceMesh) -> range:
    """This rank's group's contiguous part of ``n`` items (a round's prompts) split in group
    order, the parts differing by at most one: what ``dist.share`` is with one rank per
    group. Every rank of a group gets the same part, and must generate all of it."""
    groups, (g, _) = mesh.size(0), tp_coordinates(mesh)
    return range(g * n // groups, (g + 1) * n // groups)


def group_contribution(items: list[Any], mesh: DeviceMesh) -> list[Any]:
    """What this rank adds to an all-gather of the groups' results (``dist.gather_lists``):
    its items on the group's first rank, nothing on the others, whose results are the same.
    The gathered list is then every group's results once, in group order."""
    return items if tp_coordinates(mesh)[1] == 0 else []


def tp_plan() -> dict[str, ParallelStyle]:
    """How :func:`tp_generation_copy` splits a model of :data:`TP_MODEL_TYPES`.

    Column-wise layers keep their output sharded (the next layer reads only its part);
    row-wise ones all-reduce theirs to a replicated hidden state. The head gathers its logits
    to the full vocabulary, which the sampler needs (see the module's docstring)."""
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        plan[f"model.layers.*.{name}"] = ColwiseParallel()
    plan["model.layers.*.self_attn.o_proj"] = RowwiseParallel()
    plan["model.layers.*.mlp.gate_proj"] = ColwiseParallel()
    plan["model.layers.*.mlp.up_proj"] = ColwiseParallel()
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()
    return plan


def tp_generation_copy(
    source: Any,
    mesh: DeviceMesh,
    *,
    dtype: torch.dtype,
    device: torch.device,
    local_forward: bool = True,
) -> torch.nn.Module:
    """A frozen generation copy of ``source`` split over ``mesh["tp"]``, in ``dtype`` on
    ``device``, its weights uninitialised: fill it with :func:`fill_tp_copy`.

    ``source`` is the policy (plain or FSDP2-sharded; only its config is read) or its
    transformers config. The model is built on the meta device and split there, so no rank
    ever allocates more than its shards. The rotary tables (buffers, not weights) are
    recomputed from the config in float32, as transformers makes them.

    ``local_forward`` (default): the split layers compute on their local shards with plain
    ``torch.distributed`` collectives (:func:`_run_on_local_shards`): the same layout, the
    same values, without DTensor's dispatch, which cost ~1 ms per layer call on an H200 host
    (torch 2.11) against 15 us for the matmul itself: 135-167 ms per decoding step of a 98M
    model at tp 1, against 10-12 ms whole and 11-18 ms with local shards; on that host's CPU,
    2 gloo ranks decoded 36 tokens/s through DTensor, 117 with local shards. False keeps
    ``parallelize_module``'s own forwards (tested equal; slower).
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(source.config if isinstance(source, torch.nn.Module) else source)
    require_tp_size(mesh["tp"].size(), mesh.size(), config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to(dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    parallelize_module(model, mesh["tp"], tp_plan())
    if tied:  # both Shard(0) over the vocabulary: the same shard serves both
        model.lm_head.weight = model.model.embed_tokens.weight
    split = sum(isinstance(p, DTensor) for p in model.parameters())
    if split < 1 + 7 * config.num_hidden_layers:
        raise ValueError(
            f"rollout.tp_size: the tensor-parallel plan matched only {split} weights of this "
            f"{config.model_type} model (its modules are not named as the plan expects); "
            "set rollout.tp_size=1"
        )
    model.to_empty(device=device)
    _recompute_buffers(model, device)
    model.eval().requires_grad_(False)
    if local_forward:
        _run_on_local_shards(model, mesh)
    return model


def _recompute_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Fill the buffers that ``to_empty`` left uninitialised: the rotary embeddings'
    ``inv_freq`` tables, rebuilt from the config (a meta model has no values to move). Any
    other buffer is refused rather than left holding garbage."""
    for module in model.modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            raise ValueError(
                f"rollout.tp_size: {type(module).__name__} holds buffers {sorted(own)} that a "
                "tensor-parallel copy cannot rebuild; set rollout.tp_size=1"
            )
        fresh = type(module)(module.config)  # on the CPU, float32: transformers' own values
        for name, buf in fresh.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))


def _run_on_local_shards(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Replace the forward of every split layer (and the hooks ``parallelize_module`` put on
    it) by the same computation on this rank's shards: column-wise ``x @ W_r.T``; row-wise
    the same, all-reduced, then the whole bias; the embedding looks up the ids of its
    vocabulary slice (zeros elsewhere) and all-reduces; the head all-gathers its logits.

    The shards are read in place (views of the DTensors' local tensors), so
    :func:`fill_tp_copy` keeps updating them; moving the model (``.to``) would not."""
    group, tp_rank = mesh.get_group("tp"), mesh.get_local_rank("tp")
    head = model.get_output_embeddings()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, DTensor):
            continue
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
        local = weight.to_local()
        bias = module.bias.to_local() if getattr(module, "bias", None) is not None else None
        rows = -(-weight.shape[0] // mesh["tp"].size())  # torch.chunk's: the last may be short
        if isinstance(module, torch.nn.Embedding):
            module.forward = _vocab_lookup(local, tp_rank * rows, group)
        elif module is head:
            sizes = [min(rows, max(0, weight.shape[0] - r * rows)) for r in range(mesh.size(1))]
            module.forward = _gathered_logits(local, rows, sizes, group)
        elif weight.placements[0].is_shard(1):  # row-wise: a partial sum
            module.forward = _reduced_linear(local, bias, group)
        else:
            module.forward = _local_linear(local, bias)


Forward = Callable[[torch.Tensor], torch.Tensor]


def _local_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Forward:
    """Column-wise: this rank's output features (its heads, its MLP slice), no collective:
    the next layer reads only them."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight, bias)

    return forward


def _reduced_linear(weight: torch.Tensor, bias: torch.Tensor | None, group: Any) -> Forward:
    """Row-wise: this rank's input features give a partial sum; the all-reduce makes the
    whole output on every rank; the (whole) bias is added once, after it."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x, weight)
        torch.distributed.all_reduce(out, group=group)
        return out if bias is None else out + bias

    return forward


def _vocab_lookup(weight: torch.Tensor, start: int, group: Any) -> Forward:
    """Vocabulary-sharded embedding: each id is found on exactly one rank (the others add
    zeros), so the all-reduce gives the whole model's embedding exactly."""

    def forward(ids: torch.Tensor) -> torch.Tensor:
        local = ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
        out = out.masked_fill(outside[..., None], 0.0)
        torch.distributed.all_reduce(out, group=group)
        return out

    return forward


def _gathered_logits(weight: torch.Tensor, rows: int, sizes: list[int], group: Any) -> Forward:
    """Vocabulary-sharded head: each rank's logits of its slice, all-gathered (padded to a
    common size, as a collective needs) into the full [.., V] that every rank samples from."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        part = torch.nn.functional.linear(x, weight)
        if part.shape[-1] < rows:  # uneven vocabulary: pad to the common size, trim below
            part = torch.nn.functional.pad(part, (0, rows - part.shape[-1]))
        parts = [torch.empty_like(part) for _ in sizes]
        torch.distributed.all_gather(parts, part.contiguous(), group=group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    return forward


def whole_tensor(p: torch.Tensor) -> torch.Tensor:
    """``p`` whole: all-gathered when it is a DTensor shard (a collective), else itself."""
    return p.full_tensor() if isinstance(p, DTensor) else p


@torch.no_grad()
def fill_tp_copy(
    source: torch.nn.Module,
    tp_model: torch.nn.Module,
    read: Callable[[str], torch.Tensor] | None = None,
) -> None:
    """Copy ``source``'s weights into the tensor-parallel copy (same parameter names), one
    parameter at a time: the whole of one parameter (all-gathered when ``source`` is
    FSDP2-sharded), then this rank's slice of it, then it is freed before the next. No rank
    holds more than one whole parameter beyond its shards, never the whole model.

    ``source``: the policy as ``dapo.dist.fsdp.shard`` leaves it (DTensor shards over every
    rank) or a plain whole model. Every rank calls this, in the same parameter order (the
    gathers are collectives of the whole world). Values are cast to the copy's dtype. The
    buffers (rotary tables) are copied from ``source`` too, as ``fsdp.gather_into`` does.
    ``read``: a whole tensor by its name in the copy (default: ``source``'s parameter of that
    name, :func:`whole_tensor`); a LoRA policy's merges (:func:`dapo.models.lora.whole_reader`).
    """
    sources = dict(source.named_parameters())
    for name, target in tp_model.named_parameters():
        if read is None and name not in sources:
            raise KeyError(f"fill_tp_copy: the source has no parameter {name!r}")
        full = whole_tensor(sources[name]) if read is None else read(name)
        if isinstance(target, DTensor):
            part = distribute_tensor(
                full, target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
            target.to_local().copy_(part)
            del part
        else:
            target.copy_(full)
        del full
    for name, target in tp_model.named_buffers():
        b = source.get_buffer(name)
        target.copy_(b.full_tensor() if isinstance(b, DTensor) else b)


def same_on_group(values: Sequence[torch.Tensor], mesh: DeviceMesh) -> bool:
    """Whether every rank of this rank's group holds the same ``values`` (bit for bit): a
    check that a group's ranks stayed in lockstep, for tests and debugging (it all-gathers
    them, so not for every step of a run)."""
    group = mesh.get_group("tp")
    ours = [v.detach().cpu() for v in values]
    theirs: list[Any] = [None] * mesh["tp"].size()
    torch.distributed.all_gather_object(theirs, ours, group=group)
    return all(
        len(t) == len(ours) and all(torch.equal(a, b) for a, b in zip(t, ours, strict=True))
        for t in theirs
    )
