"""What a GPU holds beyond a run's tensors, for the memory plan (:mod:`dapo.training.gpu_memory`):
the CUDA runtime and NCCL's buffers (outside PyTorch's counters), what the caching allocator
reserves beyond what it hands out, the vllm engine's reservation, and what a card of a given
size really offers.

Measured here: nvidia-smi shows 81,559 MiB (79.65 GiB) on an "80 GB" H100 and 143,771 MiB
(140.4 GiB) on an H200 (2026-11), CUDA itself about 0.46 GiB less on the H100 (public logs);
on one H100 (2026-11-27, ``benchmarks/gpu.py``) the allocator reserved 1.02 GiB
(Qwen2.5-0.5B shape) and 3.68 GiB (1.5B) more than the training step's allocated peak, 8.6%
and 14.9% of the activations the plan counts. Not measured here (the issue's estimates, taken
at the top of their range): the CUDA context with cuBLAS' and cuDNN's workspaces, NCCL's
buffers per communicator, and what a sleeping vLLM keeps.
"""

from __future__ import annotations

from dapo.training.plan_settings import PlanSettings

GIB = 2**30

CUDA_RUNTIME_BYTES = GIB
"""A process's CUDA context and library workspaces (cuBLAS, cuDNN): 0.5-1 GiB."""

NCCL_COMMUNICATOR_BYTES = GIB
"""NCCL's buffers for one communicator a rank belongs to: 0.5-2 GiB."""

ALLOCATOR_SLACK = 0.2
"""The caching allocator's reserve beyond its allocated peak in training, as a fraction of
the transient tensors (activations, the output head's chunk, gathered layers): 8.6% and
14.9% of the activations measured, 20% planned."""

VLLM_ASLEEP_BYTES = 2 * GIB
"""What a sleeping vllm engine (sleep level 1: KV cache freed, weights in host memory)
keeps on the GPU: its CUDA graphs' pool, buffers and communicators."""

CARD_GIB = {80: 79.19, 141: 139.9}
"""Cards sold as N GB and the GiB CUDA reports, which vLLM's reservation is a share of: an
H100 80GB about 81,090 MiB (public logs of ``torch.cuda.get_device_properties``; nvidia-smi
shows 81,559 MiB, measured here); an H200 143,771 MiB by nvidia-smi (measured here), less
the same 0.46 GiB (an estimate). Other sizes are taken as N x 10^9 bytes."""


def usable_gib(nominal_gb: float) -> float:
    """The GiB a card sold as ``nominal_gb`` GB offers (``hardware.gpu_gib`` of a recipe)."""
    return CARD_GIB.get(int(nominal_gb), nominal_gb * 1e9 / GIB) if nominal_gb else 0.0


def communicators(s: PlanSettings) -> int:
    """NCCL communicators a trainer rank belongs to: the job's (FSDP's collectives; with
    generator ranks, the job's and the trainers' own) and a tensor-parallel group's. The
    weights go to generator ranks over gloo (:mod:`dapo.dist.weight_sync`): no NCCL."""
    if not s.sharded and not s.generators:
        return 0
    return 1 + int(s.generators > 0) + int(s.tp_size > 1)


def runtime_bytes(s: PlanSettings) -> int:
    """The CUDA runtime and NCCL buffers of a trainer rank (nothing on a CPU)."""
    if s.device != "cuda":
        return 0
    return CUDA_RUNTIME_BYTES + communicators(s) * NCCL_COMMUNICATOR_BYTES


def vllm_bytes(s: PlanSettings) -> tuple[int, int]:
    """(while generating, while training) of the vllm engine: its reservation, a fraction
    of the card (its weights, KV cache and CUDA graphs, which vLLM requires free at start);
    asleep while the trainer trains, or the whole reservation when it does not sleep. With
    generator ranks the trainers still hold one to evaluate. (0, 0) for the other engines or
    a card of unknown size."""
    if s.engine != "vllm" or s.device != "cuda" or not s.gpu_bytes:
        return 0, 0
    reserved = int(s.vllm_fraction * s.gpu_bytes)
    return reserved, (VLLM_ASLEEP_BYTES if s.vllm_sleep else reserved)
