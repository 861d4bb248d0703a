"""FSDP2 for the policy: shard per decoder layer, gather whole weights for generation, clip
the gradient norm over the shards, sum (not average) the gradients of the ranks.

The loss of a mini-batch is already divided by the token count of the whole global
mini-batch (``dapo.training.update``), so each rank's gradient is its share of the sum: the ranks'
gradients are summed, and FSDP's division by the world size is turned off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterator
from typing import Any, TypeVar

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dapo import dist

T = TypeVar("T")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: the classes a Hugging Face model names in
    ``_no_split_modules`` (Qwen2DecoderLayer ...), else the largest ModuleList's children."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def shard(
    model: torch.nn.Module,
    *,
    compute_dtype: torch.dtype,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the rest of ``model`` (embeddings, final norm,
    head), in place: the weights stay in their dtype (float32 master weights and optimizer
    state, sharded), are gathered in ``compute_dtype`` for compute, and gradients are reduced
    in float32 and summed over ranks."""
    weights = next(model.parameters()).dtype
    policy = MixedPrecisionPolicy(
        param_dtype=compute_dtype if compute_dtype != weights else None,
        reduce_dtype=torch.float32,
    )
    kwargs: dict[str, Any] = {"mp_policy": policy}
    mesh = dist.device_mesh()  # the trainers' alone, when some ranks only generate
    if mesh is not None:
        kwargs["mesh"] = mesh
    if cpu_offload:
        if next(model.parameters()).device.type == "cpu":
            raise ValueError(
                "dist.cpu_offload=true keeps a GPU run's shards in host memory; this model "
                "trains on the CPU already: drop dist.cpu_offload"
            )
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        if activation_checkpointing:
            checkpoint_layer(layer)
        fully_shard(layer, **kwargs, reshard_after_forward=reshard_after_forward)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (gloo has no pre-multiplied sum; with a factor of 1 there is nothing
            # to multiply).
            module.set_force_sum_reduction_for_comms(True)
    return model


def checkpoint_layer(layer: torch.nn.Module) -> None:
    """Recompute ``layer``'s activations in the backward pass instead of keeping them. A
    partial over the layer's forward, not a closure: a deep copy of the model then recomputes
    its own layers."""
    layer.forward = functools.partial(recomputed, layer.forward)


def recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)``, its activations recomputed in the backward pass."""
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: torch.nn.Module) -> None:
    """:func:`checkpoint_layer` every decoder layer of a model that is not sharded (one
    process)."""
    for layer in decoder_layers(model):
        checkpoint_layer(layer)


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def holds_dtensors(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor (FSDP2 or tensor-parallel shards)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def within_forward(model: torch.nn.Module, fn: Callable[[Callable[..., Any]], T]) -> T:
    """``fn(forward)`` run as ``model``'s own forward, ``forward`` being the model's real one.

    FSDP2 gathers the root's weights (embeddings, final norm, head) in the hooks around the
    root module's forward, and hooks its backward (the reduce-scatter of their gradients) on
    what that forward returns. Code that takes the model apart (the decoder, then a chunked
    head on its hidden states; a prompt pass, then a response pass) runs inside that call, so
    it sees whole weights and its gradients are reduced as the model's own would be.
    """
    own = "forward" in vars(model)
    saved = vars(model).get("forward")
    forward = model.forward
    model.forward = lambda run: run(forward)  # type: ignore[method-assign]
    try:
        # ``fn`` goes in as the call's one argument: FSDP2 before torch 2.13 takes the first
        # positional argument of a root call on CUDA unchecked (IndexError with none; seen
        # on an H200 with torch 2.11), and moves only tensors, so ``fn`` passes unchanged.
        return model(fn)
    finally:
        if own:
            model.forward = saved  # type: ignore[method-assign]
        else:
            del model.forward


def set_grad_sync(model: torch.nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters the gradients (FSDP2's switch). Off, each rank
    accumulates unsharded float32 gradients (FSDP2 keeps them in the reduce dtype) across
    micro-batches; the backward that turns it on again adds its own and reduces them all once.
    Nothing to do for a model that is not sharded."""
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]


@torch.no_grad()
def gather_into(sharded: torch.nn.Module, whole: torch.nn.Module) -> None:
    """Copy ``sharded``'s weights into the plain module ``whole`` (same names), one parameter
    at a time, so that no more than one extra full parameter exists at once."""
    params = dict(whole.named_parameters())
    for name, p in sharded.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        params[name].copy_(full)
    for name, b in sharded.named_buffers():
        target = whole.get_buffer(name)
        target.copy_(b.full_tensor() if isinstance(b, DTensor) else b)


def whole_state(
    model: torch.nn.Module, dtype: torch.dtype, names: Container[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s state dict (the entries in ``names``, default all) one whole tensor at a
    time, in ``dtype``: a shard is all-gathered as it is reached and dropped by the consumer
    before the next, so no rank holds more than one whole tensor beyond its shards (an engine
    that slices what it loads, as vLLM's tensor-parallel layers do). Under FSDP2 every rank of
    the policy's mesh must consume it to the end, in step: each shard's gather is a
    collective."""
    for name, t in model.state_dict().items():
        if names is not None and name not in names:
            continue
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        yield name, whole.detach().to(dtype)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over parameters that may be shards: the norm of the whole gradient,
    the same on every rank, as a 0-d tensor on the gradients' device (not read back: the
    caller reads it with the mini-batch's metrics)."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


def all_finite(model: torch.nn.Module) -> bool:
    """Whether every weight, on every rank's shard, is finite (this rank's part only; the
    caller combines ranks)."""
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if not bool(torch.isfinite(local).all()):
            return False
    return True


def local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the part of ``tensor`` this rank holds, where that part lies in the whole tensor),
    for a loader that reads only that part (:mod:`dapo.models.sharded_load`); an empty index
    for a tensor that is not a shard or is replicated. FSDP2 shards dimension 0 as
    ``torch.chunk`` does: rank r of n holds rows [r*c, (r+1)*c) with c = ceil(rows / n), the
    last ranks fewer or none (its padding is not part of the tensor)."""
    if not isinstance(tensor, DTensor):
        return tensor, ()
    local = tensor.to_local()
    if len(tensor.placements) != 1:
        raise NotImplementedError("reading shards over a mesh of more than one dimension")
    placement, mesh = tensor.placements[0], tensor.device_mesh
    if placement.is_replicate():
        return local, ()
    if not placement.is_shard():
        raise NotImplementedError(f"reading into a {placement} placement")
    dim, size = placement.dim, tensor.shape[placement.dim]
    chunk = -(-size // mesh.size())
    start = min(mesh.get_local_rank() * chunk, size)
    if local.shape[dim] != max(0, min(chunk, size - start)):
        raise AssertionError(f"a shard of {local.shape[dim]} rows at row {start} of {size}")
    index = [slice(None)] * tensor.dim()
    index[dim] = slice(start, start + local.shape[dim])
    return local, tuple(index)
