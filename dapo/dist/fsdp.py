"""FSDP2 for the policy: shard per decoder layer, gather whole weights for generation, clip
the gradient norm over the shards, sum (not average) the gradients of the ranks.

The loss of a mini-batch is already divided by the token count of the whole global
mini-batch (``dapo.training.update``), so each rank's gradient is its share of the sum: the ranks'
gradients are summed, and FSDP's division by the world size is turned off.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


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
    kwargs = {"mp_policy": policy}
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
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (gloo has no pre-multiplied sum; with a factor of 1 there is nothing
            # to multiply).
            module.set_force_sum_reduction_for_comms(True)
    return model


def checkpoint_layer(layer: torch.nn.Module) -> None:
    """Recompute ``layer``'s activations in the backward pass instead of keeping them."""
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward

    def recomputed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = recomputed


def checkpoint_layers(model: torch.nn.Module) -> None:
    """:func:`checkpoint_layer` every decoder layer of a model that is not sharded (one
    process), and mark it: its forward passes then run without a shared prompt cache, which a
    recomputed layer would append to twice."""
    for layer in decoder_layers(model):
        checkpoint_layer(layer)
    model.dapo_activation_checkpointing = True  # type: ignore[assignment]


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def is_checkpointed(model: torch.nn.Module) -> bool:
    """Whether :func:`checkpoint_layers` recomputes ``model``'s layers (one process)."""
    return bool(getattr(model, "dapo_activation_checkpointing", False))


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


def clip_grad_norm(parameters, max_norm: float) -> float:
    """``clip_grad_norm_`` over parameters that may be shards: the norm of the whole gradient,
    the same on every rank."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def all_finite(model: torch.nn.Module) -> bool:
    """Whether every weight, on every rank's shard, is finite (this rank's part only; the
    caller combines ranks)."""
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if not bool(torch.isfinite(local).all()):
            return False
    return True
