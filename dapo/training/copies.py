"""The policy's other copies under ``torchrun``: the one the engine generates from and the
GRPO reference, and the policy's own shards.

In one process the engine samples from the policy itself (nothing to copy) and a reference is
a frozen deep copy. Under FSDP2 the policy is sharded, and a sharded forward is a collective
that ranks generating different lengths cannot share, so the engine gets its own frozen copy,
refreshed from the shards after every update (``TrainState.sync_engine``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dapo import dist
from dapo.config import Config
from dapo.dist import fsdp, tensor_parallel
from dapo.models import compiled_layers, lora, sharded_load
from dapo.models.casting import cast_weights


def frozen_dtype(model: torch.nn.Module, compute: torch.dtype) -> torch.dtype:
    """The dtype frozen copies (generation, reference) are held in: bfloat16 when that is the
    compute dtype; else the policy's own (float16 weights would overflow without autocast's
    float32 ops)."""
    return compute if compute == torch.bfloat16 else next(model.parameters()).dtype


def copies_and_shards(
    cfg: Config, model: torch.nn.Module, compute: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module | None, torch.nn.Module | None, Any]:
    """(the frozen reference (KL), the copy the engine samples from, the tensor-parallel
    mesh), the policy sharded in place under FSDP2; its layers compiled (``train.compile``)
    and checkpointed (FSDP's, or in one process), in that order.

    Under FSDP2 the generation copy is whole on every rank, or with ``rollout.tp_size`` = k
    split over each group of k ranks (:mod:`dapo.dist.tensor_parallel`: the mesh says who is
    in a group); none for the vllm engine, which loads its own from the shards. A policy
    loaded straight into shards (:mod:`dapo.models.sharded_load`) has its copies made from its
    shards, on ``device``. In one process: (reference, None, None).
    """
    held = frozen_dtype(model, compute)
    tp = cfg.rollout.tp_size if dist.active() else 1
    mesh = tensor_parallel.tp_mesh(tp, device.type) if tp > 1 else None
    # vLLM holds its own weights (its slice of them at tp_size > 1), loaded from the shards.
    native = cfg.rollout.engine != "vllm"
    whole = mesh is None and native
    if dist.active() and fsdp.is_sharded(model):
        ref, gen = sharded_load.copies(model, cfg, held, device, whole_copy=whole)
    else:
        ref, gen = _copies_then_shards(cfg, model, held, whole_copy=whole)
    if mesh is not None and native:  # split from the shards, one whole parameter at a time
        gen = tensor_parallel.tp_generation_copy(model, mesh, dtype=held, device=device)
        fill_tp_copy(model, gen)
    return ref, gen, mesh


def fill_tp_copy(model: torch.nn.Module, gen: torch.nn.Module) -> None:
    """The tensor-parallel generation copy refilled from the policy (after every update); a
    LoRA policy's adapted weights merged on the way (the copy is a plain model)."""
    read = None
    if lora.enabled(model):
        read = lora.whole_reader(model, tensor_parallel.whole_tensor)
    tensor_parallel.fill_tp_copy(model, gen, read)


def _copies_then_shards(
    cfg: Config, model: torch.nn.Module, held: torch.dtype, *, whole_copy: bool
) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """A policy loaded whole: the reference and (``whole_copy``, under FSDP) the generation
    copy deep-copied, then the policy and the reference sharded."""
    ref_model = gen_model = None
    # The naive-GRPO KL anchor: a frozen copy of the starting policy (with LoRA, the policy
    # with its adapters off: TrainState.reference).
    if cfg.algo.kl_coef > 0 and not lora.enabled(model):
        ref_model = cast_weights(copy.deepcopy(model), held).eval().requires_grad_(False)
    options = sharded_load.shard_options(cfg) if dist.active() else {}  # refuses float16
    if dist.active() and whole_copy:
        gen_model = cast_weights(copy.deepcopy(model), held).eval().requires_grad_(False)
    if cfg.train.compile:  # after the copies, before checkpointing (which recomputes it)
        compiled_layers.compile_layers(model)
    if not dist.active() and cfg.dist.activation_checkpointing:
        fsdp.checkpoint_layers(model)
    if dist.active():
        fsdp.shard(model, **options)
        if ref_model is not None:
            frozen = {"activation_checkpointing": False, "reshard_after_forward": True}
            fsdp.shard(ref_model, **{**options, **frozen})  # forward only
    return ref_model, gen_model
