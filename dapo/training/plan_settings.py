"""What a memory plan (:mod:`dapo.training.gpu_memory`) depends on besides the model: the run's
settings that size what each rank holds, with the defaults of the scale-out table."""

from __future__ import annotations

from dataclasses import dataclass

from dapo.training.model_shape import ModelShape


@dataclass(frozen=True)
class PlanSettings:
    """What the plan depends on besides the model; the defaults are the table's assumptions."""

    world_size: int = 1
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    microbatch_tokens: int = 512 + 20480
    """Padded tokens of the largest micro-batch: ``train.tokens_per_microbatch``, or fewer when
    a rank's share of a mini-batch is smaller, or one whole response when that is longer."""
    prompt_tokens: int = 512
    max_new_tokens: int = 20480
    rows: int = 16
    """Responses one rank generates at once (each holds prompt + L_max tokens of KV cache)."""
    reference: bool = False
    """A frozen GRPO reference model (``algo.kl_coef > 0``)."""
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    grad_sync: str = "minibatch"
    """``dist.grad_sync``: ``minibatch`` accumulates an unsharded float32 gradient of the
    whole model on every rank until a mini-batch's last micro-batch; ``microbatch`` does not."""
    tp_size: int = 1
    """``rollout.tp_size``: ranks that generate together, tensor parallel (1 in one process)."""
    reshard_after_forward: bool = True
    """``dist.reshard_after_forward``: False keeps every layer gathered from its forward to its
    backward."""
    staleness: int = 0
    """``train.async_staleness``: generation overlaps training (in one process, or on
    ``generators`` ranks of their own)."""
    episodes: bool = False
    """``env.class`` is set: the native engine keeps the caches of rows that stop at a turn end
    (:mod:`dapo.rollout.parking`) beside those of the rows still decoding, up to a second KV
    cache."""
    generators: int = 0
    """``dist.rollout_ranks``: this is a trainer rank's plan, the generators being other ranks
    (:func:`generator_bytes`); ``world_size`` counts the trainers."""
    top_p: bool = False
    """Sampling restricted to a nucleus (``rollout.top_p`` or ``eval.top_p`` < 1): its sort
    holds more [rows, V] float64 arrays while a token is drawn."""
    lora_rank: int = 0
    """``model.lora.rank``: adapters train (float32, with their gradients and AdamW state)
    and the rest is frozen; 0: every weight trains."""
    lora_targets: tuple[str, ...] = ()
    """``model.lora.target_modules``."""
    merged_sampling: bool = True
    """``model.lora.merged_sampling``: the eager loop and hf sample LoRA from a merged copy."""
    device: str = ""
    """Where the run computes: on ``cuda`` the CUDA runtime, NCCL's buffers and the caching
    allocator's reserve count (:mod:`dapo.training.fixed_memory`); ``cpu`` or unstated (""),
    the run's tensors alone."""
    engine: str = "dapo"
    """``rollout.engine``: ``vllm`` holds a reservation of its own in place of the native
    engine's KV cache and workspace."""
    vllm_fraction: float = 0.5
    """``vllm.gpu_memory_utilization``: the share of the card vLLM reserves."""
    vllm_sleep: bool = True
    """``vllm.sleep``: vLLM frees its reservation (but a little) while the trainer trains."""
    cuda_graphs: bool = True
    """``rollout.cuda_graphs``: on CUDA the native engine decodes a Llama, Qwen2 or Qwen3 on its
    own static step, which never copies keys and values per query head."""
    gpu_bytes: int = 0
    """The card's memory as the driver reports it (0: not known; the vllm engine's
    reservation, a share of it, is then left out, and the dry run says so)."""
    packing: bool = False
    """``train.packing``: each response attends with a copy of its group's prompt queries,
    keys and values, and an attention output over them (held for the backward), beside the
    packed tokens' own activations."""
    compiled: bool = False
    """``train.compile``: the decoder layers run compiled; the activations are counted as
    eager ones keep them, an upper bound (inductor's fusions keep fewer: measured, not
    modelled)."""
    gqa_copy: bool = True
    """The installed transformers copies a layer's keys and values to every query head while
    decoding (before 5.23; :func:`transformers_copies_gqa`): True, the upper bound, by default."""

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def check(self, shape: ModelShape) -> None:
        """ValueError for settings no run has."""
        w, k = self.world_size, self.tp_size
        if w < 1:
            raise ValueError(f"world size must be >= 1, got {w}")
        if self.grad_sync not in ("minibatch", "microbatch"):
            raise ValueError(f"dist.grad_sync must be minibatch or microbatch: {self.grad_sync}")
        if self.staleness and w > 1 and not self.generators:
            raise ValueError(
                "train.async_staleness under torchrun needs dist.rollout_ranks: plan world size "
                "1, or set dist.rollout_ranks"
            )
        if k > 1 and w == 1:
            raise ValueError(
                f"rollout.tp_size {k} needs torchrun (one process generates alone): plan the "
                "run's ranks with --world-size N"
            )
        if k < 1 or w % k:
            raise ValueError(f"rollout.tp_size {k} must divide the world size {w}")
        if shape.heads % k or shape.kv_heads % k:
            raise ValueError(
                f"rollout.tp_size {k} must divide the model's {shape.heads} attention and "
                f"{shape.kv_heads} key-value heads"
            )
