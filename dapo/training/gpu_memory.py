"""Memory per GPU, on paper: what a run holds on each rank, before anything is loaded.

One process holds float32 (``model.param_dtype``) weights, gradients and AdamW state (with
LoRA, of the adapters alone), run under autocast, whose cache keeps a compute-dtype copy of
every weight. Under torchrun (from 2 ranks) FSDP2 shards those three per decoder layer and
gathers two layers at a time in the compute dtype; ``dist.grad_sync=minibatch`` adds an
unsharded float32 gradient. The output head runs a chunk of logits at a time
(``dapo.algo.logits``). Generation runs from a frozen compute-dtype copy, split over each
``rollout.tp_size`` ranks (Linear weights, embedding, head, KV heads; norms whole). Generation
(KV cache, decoding workspace) and training (gradients, activations, output head) take turns,
the peak being the larger phase plus what both hold (weights, AdamW state, the generation
copy, the GRPO reference), except ahead of training (``train.async_staleness`` = k), when they
overlap. Loading is planned in host memory. Parameters are exact for Qwen2/Qwen3/Llama/Mistral
(:mod:`dapo.training.model_shape`); activations and logits are a rough model (the tests
compare ``activation_bytes`` and the chunked head with what autograd keeps).

    python -m dapo.memory_plan          # the table of docs/scale-out.md (memory_table.py)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dapo.models import hub
from dapo.training import fixed_memory
from dapo.training.model_shape import ModelShape
from dapo.training.plan_settings import PlanSettings

if TYPE_CHECKING:
    from dapo.config import Config

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Copies of dapo.algo.logits.HEAD_CHUNK_ELEMENTS, dapo.training.sampling.MAX_OVERSAMPLE and
# dapo.rollout.native.CDF_CHUNK_ELEMENTS (a test keeps them equal): those modules import torch,
# and a dry run plans before it loads.
HEAD_CHUNK_ELEMENTS = 1 << 26
MAX_OVERSAMPLE = 4
CDF_CHUNK_ELEMENTS = 1 << 24
STATIC_DECODING_TYPES = ("llama", "qwen2", "qwen3")
"""A copy of dapo.rollout.decoder_step.SUPPORTED_MODEL_TYPES (a test keeps them equal)."""
PACKED_GQA_TRANSFORMERS = (5, 23)
"""The first transformers release whose sdpa attention decodes a grouped-query model under a
mask without copying each layer's keys and values to every query head (it packs the query)."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of each part (per rank in host memory for what ``offloaded`` moved)."""

    shape: ModelShape
    settings: PlanSettings
    weights: int
    gradients: int
    optimizer: int
    accumulated_gradients: int
    """The unsharded float32 (FSDP2's reduce dtype) gradient of ``dist.grad_sync=minibatch``."""
    generation_copy: int
    gathered_layers: int
    activations: int
    output_head: int
    kv_cache: int
    decode_workspace: int
    """What a decoding step holds beside the KV cache (:func:`decode_workspace_bytes`)."""
    reference: int
    load_host: int
    """Host memory per rank while the model loads (not on the GPU, not in the peaks)."""
    ahead: int = 0
    """The generator's copy and up to k clones of what moves (``train.async_staleness``)."""
    runtime: int = 0
    """The CUDA runtime and NCCL's buffers (outside PyTorch's counters: :mod:`fixed_memory`)."""
    allocator_slack: int = 0
    """What the caching allocator reserves beyond its allocated peak in training."""
    vllm_generating: int = 0
    """The vllm engine's reservation while it generates (in place of KV cache and workspace)."""
    vllm_training: int = 0
    """What the vllm engine keeps while the trainer trains (asleep, or all of it)."""

    @property
    def offloaded(self) -> bool:
        """Weights, gradients and AdamW state in host memory (``dist.cpu_offload``)."""
        return self.settings.cpu_offload and self.settings.sharded

    @property
    def host(self) -> int:  # the reference is sharded (and offloaded) like the policy
        states = self.weights + self.gradients + self.optimizer + self.reference
        return states if self.offloaded else 0

    @property
    def held(self) -> int:  # on the GPU through both phases
        states = 0 if self.offloaded else self.weights + self.optimizer + self.reference
        return states + self.generation_copy + self.ahead + self.runtime

    @property
    def generation_peak(self) -> int:
        return self.held + self.kv_cache + self.decode_workspace + self.vllm_generating

    @property
    def training_peak(self) -> int:
        grads = (0 if self.offloaded else self.gradients) + self.accumulated_gradients
        decoding = self.kv_cache + self.decode_workspace
        # Generating meanwhile, in this process (not on generator ranks).
        overlap = decoding if self.settings.staleness and not self.settings.generators else 0
        transient = self.gathered_layers + self.activations + self.output_head
        return self.held + grads + transient + self.allocator_slack + overlap + self.vllm_training

    @property
    def total(self) -> int:  # the peak per GPU: the larger phase
        return max(self.generation_peak, self.training_peak)


def activation_bytes(
    shape: ModelShape, *, tokens: int, compute: int, checkpointing: bool, residual: int = 0
) -> int:
    """What autograd keeps for one micro-batch of ``tokens``, roughly. Per token and layer:
    ``compute x (6 H + 2 kv + 4 I)`` bytes (norm outputs and projection inputs, q, the
    attention output, k, v; the MLP's gate, up, activation and product) and ``16 H`` bytes of
    the RMSNorms' float32; attention is fused (sdpa), so no tokens^2 term. Checkpointed, a
    layer keeps its input, ``residual x H`` (the residual stream: FSDP's ``compute``; one
    process's weights' dtype under autocast), and one layer is recomputed at a time."""
    per_token_layer = compute * (6 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate)
    per_token_layer += 16 * shape.hidden
    if not checkpointing:
        return tokens * shape.layers * per_token_layer
    return tokens * (shape.layers * shape.hidden * (residual or compute) + per_token_layer)


def output_head_bytes(shape: ModelShape, s: PlanSettings, *, compute: int) -> int:
    """The chunked head (``dapo.algo.logits``), one process or FSDP: the larger of forward
    and backward. Forward, with the entropy, holds 16 bytes a logit of a chunk of
    ``HEAD_CHUNK_ELEMENTS`` (fewer for a shorter micro-batch): the float32 logits, the softmax
    and a product (measured on a CPU). Backward holds the float32 chunk and its compute-dtype
    copy, the head's float32 weight gradient summed over the chunks and, unless computing in
    float32, a chunk's ``[V, H]`` gradient and its float32 copy (none with LoRA: the head is
    frozen). One process adds the weight cast to the compute dtype (FSDP: gathered root)."""
    vocab, weight = shape.vocab, shape.vocab * shape.hidden
    logits = min(s.microbatch_tokens, max(1, HEAD_CHUNK_ELEMENTS // vocab)) * vocab
    held = 0 if s.lora_rank else 4 * weight + (0 if compute == 4 else (compute + 4) * weight)
    cast = compute * weight if not s.sharded and compute != DTYPE_BYTES[s.param_dtype] else 0
    return max(16 * logits, logits * (4 + compute) + held) + cast


def kv_cache_bytes(shape: ModelShape, *, tokens: int, rows: int, compute: int, tp: int = 1) -> int:
    """K and V of every layer for ``rows`` responses of ``tokens`` (prompt + L_max) each; a
    rank of a tensor-parallel group of ``tp`` holds 1/tp of the key-value heads."""
    return math.ceil(2 * shape.layers * shape.kv_dim * compute * tokens * rows / tp)


def decode_workspace_bytes(shape: ModelShape, s: PlanSettings, *, compute: int) -> int:
    """What the native engine holds beside the KV cache while it decodes ``s.rows`` rows (A)
    of up to L_max new tokens at a vocabulary of V: the responses' tokens and log-probs
    (12 A L_max bytes), and the larger of

    - drawing a token (``dapo.rollout.native.draw_tokens``): the step's float32 logits and their
      temperature-scaled copy (8 A V bytes), and, a block of B = min(A, ``CDF_CHUNK_ELEMENTS``
      / V) rows at a time, two float64 [B, V] arrays at once of the logits, probabilities and
      CDF (16 B V; 33 B V with top-p's sort, its order and the mass above each token);
    - a step's forward, while the last step's float32 logits (4 A V) wait: one layer's keys
      and values at prompt + L_max positions, copied to every query head by transformers
      before 5.23 (``repeat_kv``), else the old buffer of a layer whose cache grows
      (:mod:`dapo.rollout.kv_cache`), at most its key-value heads; 1/tp of the heads per rank
      either way."""
    rows, vocab = s.rows, shape.vocab
    block = min(rows, max(1, CDF_CHUNK_ELEMENTS // vocab))
    draw = 8 * rows * vocab + (33 if s.top_p else 16) * block * vocab
    heads = shape.heads if copies_gqa(shape, s) else shape.kv_heads
    width = s.prompt_tokens + s.max_new_tokens
    layer = math.ceil(2 * rows * heads * shape.head_dim * width * compute / s.tp_size)
    return 12 * rows * s.max_new_tokens + max(draw, 4 * rows * vocab + layer)


def copies_gqa(shape: ModelShape, s: PlanSettings) -> bool:
    """Whether decoding copies a layer's keys and values to every query head: transformers'
    forward before 5.23 does (``s.gqa_copy``), the native engine's CUDA-graph step (on CUDA,
    ``rollout.cuda_graphs``, a whole model of ``STATIC_DECODING_TYPES``, not a
    tensor-parallel copy; LoRA adapters merged) never."""
    static = s.device == "cuda" and s.engine == "dapo" and s.cuda_graphs and s.tp_size == 1
    return s.gqa_copy and not (static and shape.model_type in STATIC_DECODING_TYPES)


def transformers_copies_gqa() -> bool:
    """Whether the installed transformers copies keys and values per query head when it
    decodes under a mask (``PACKED_GQA_TRANSFORMERS``); True when it cannot tell. Reads the
    version only: no torch import before a dry run's plan."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = tuple(int(part) for part in version("transformers").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return True
    return release < PACKED_GQA_TRANSFORMERS


def generation_copy_bytes(shape: ModelShape, s: PlanSettings, *, frozen: int) -> int:
    """Under FSDP a frozen copy (``frozen`` bytes a value) to generate from, whole or with
    ``shape.tp_split_parameters`` split over ``s.tp_size`` ranks; one process generates from its
    own module, whose compute-dtype copy under autocast this counts (none in float32). The
    vllm engine under FSDP loads its own weights from the shards (in its reservation): none.
    LoRA on float32 weights sampled by the eager loop or hf (``model.lora.merged_sampling``):
    the adapted weights once more, merged, in float32."""
    master, compute = DTYPE_BYTES[s.param_dtype], DTYPE_BYTES[s.compute_dtype]
    static = s.device == "cuda" and s.cuda_graphs and shape.model_type in STATIC_DECODING_TYPES
    eager = s.engine == "hf" or (s.engine == "dapo" and not static)
    float32 = (frozen if s.sharded else master) == 4
    merged = eager and float32 and s.lora_rank and s.merged_sampling and s.tp_size == 1
    extra = 4 * shape.lora_target_weights(s.lora_targets) if merged else 0
    if s.sharded and s.engine == "vllm":
        return 0
    if not s.sharded:
        return (shape.num_parameters * compute if compute != master else 0) + extra
    split = shape.tp_split_parameters
    return math.ceil(split * frozen / s.tp_size) + (shape.num_parameters - split) * frozen + extra


def load_host_bytes(shape: ModelShape, s: PlanSettings) -> int:
    """Host memory of a rank while it loads: under torchrun it builds the model on the meta
    device and reads only its shards from the safetensors files, so its float32 shard and the
    largest tensor in flight; one process, the whole model in ``model.param_dtype``."""
    master = DTYPE_BYTES[s.param_dtype]
    if not s.sharded:
        return shape.num_parameters * master
    return math.ceil(shape.num_parameters * master / s.world_size) + shape.largest_tensor * master


def plan_memory(shape: ModelShape, settings: PlanSettings) -> MemoryPlan:
    s = settings
    s.check(shape)
    p, w = shape.num_parameters, s.world_size
    master, compute = DTYPE_BYTES[s.param_dtype], DTYPE_BYTES[s.compute_dtype]
    # Frozen copies (generation, reference): bf16 when that computes, else the weights' dtype.
    frozen = 2 if s.compute_dtype == "bfloat16" else master
    tokens, ckpt = s.microbatch_tokens, s.activation_checkpointing
    stream = compute if s.sharded else master  # autocast leaves the embedding, residual adds
    gathered = 0
    if s.sharded:  # two layers (one prefetched; every layer without resharding after
        # forward) and the root's embedding/head in the compute dtype, and one layer's
        # unsharded float32 gradient before reduce-scatter
        layer = shape.layer_parameters
        layers = 2 if s.reshard_after_forward else shape.layers
        gathered = (layers * layer + shape.outer_parameters) * compute + layer * 4
    kv_tokens, k = s.prompt_tokens + s.max_new_tokens, s.staleness
    # LoRA: the adapters (float32) alone have gradients and AdamW state; the reference is
    # the policy with them off; copies of the policy take the adapters alone after an update.
    a = shape.lora_parameters(s.lora_rank, s.lora_targets) if s.lora_rank else 0
    trained = (4 * a) if a else p * master
    if a and s.sharded:
        gathered += (a // shape.layers - shape.layer_parameters) * 4  # one layer's gradient
    moving = a * frozen if a else p * frozen
    activations = activation_bytes(
        shape, tokens=tokens, compute=compute, checkpointing=ckpt, residual=stream
    )
    if s.packing:  # rows of the plan's lengths: each copies its prompt's q, k, v and output
        copies = tokens * s.prompt_tokens // (s.prompt_tokens + s.max_new_tokens)
        per_copy = (2 * shape.hidden + 2 * shape.kv_dim) * compute
        activations += (1 if ckpt else shape.layers) * copies * per_copy
    head = output_head_bytes(shape, s, compute=compute)
    vllm_generating, vllm_training = fixed_memory.vllm_bytes(s)
    native = s.engine != "vllm"  # vLLM's KV cache and workspace are in its reservation
    slack = (activations + head + gathered) * fixed_memory.ALLOCATOR_SLACK
    return MemoryPlan(
        shape=shape,
        settings=s,
        weights=math.ceil((p * master + 4 * a) / w),
        gradients=math.ceil(trained / w),
        optimizer=math.ceil(2 * trained / w),
        accumulated_gradients=(4 * a or 4 * p) if s.sharded and s.grad_sync == "minibatch" else 0,
        generation_copy=generation_copy_bytes(shape, s, frozen=frozen) + 4 * a,
        gathered_layers=gathered,
        activations=activations,
        output_head=head,
        kv_cache=native
        * (1 + s.episodes)  # parked rows' caches beside the decoding rows'
        * kv_cache_bytes(shape, tokens=kv_tokens, rows=s.rows, compute=compute, tp=s.tp_size),
        decode_workspace=native * decode_workspace_bytes(shape, s, compute=compute),
        reference=math.ceil(p * frozen / w) if s.reference and not a else 0,
        load_host=load_host_bytes(shape, s),
        # With generator ranks, the versions not yet taken wait in rank 0's host memory.
        ahead=0 if s.generators else (p * frozen + k * moving if k else 0),
        runtime=fixed_memory.runtime_bytes(s),
        allocator_slack=math.ceil(slack) if s.device == "cuda" else 0,
        vllm_generating=vllm_generating,
        vllm_training=vllm_training,
    )


def generator_bytes(shape: ModelShape, s: PlanSettings) -> dict[str, int]:
    """A generator rank's GPU memory (``dist.rollout_ranks``), ``s`` being its settings
    (world size 1, its rows): the policy whole in the frozen dtype, the KV cache and the
    decoding workspace of its rows (or the vllm engine's reservation), the CUDA runtime on a
    GPU. The next weights arrive in its host memory (one version of what moves:
    :mod:`dapo.dist.weight_sync`), not on the GPU."""
    frozen = 2 if s.compute_dtype == "bfloat16" else DTYPE_BYTES[s.param_dtype]
    compute = DTYPE_BYTES[s.compute_dtype]
    tokens = s.prompt_tokens + s.max_new_tokens
    vllm, _ = fixed_memory.vllm_bytes(s)
    native = s.engine != "vllm"
    return {
        "policy": shape.num_parameters * frozen,
        "kv_cache": native * kv_cache_bytes(shape, tokens=tokens, rows=s.rows, compute=compute),
        "decode_workspace": native * decode_workspace_bytes(shape, s, compute=compute),
        "vllm": vllm,
        "runtime": fixed_memory.runtime_bytes(s),
    }


def round_prompts(cfg: Config) -> int:
    """The most prompts one generation round may draw (``dapo.training.sampling.round_size``)."""
    n, smp = cfg.train.prompts_per_step, cfg.sampling
    default = (smp.prompts_per_round or n) if smp.dynamic else n
    return max(default, MAX_OVERSAMPLE * n) if smp.dynamic and smp.oversample else default


def rows_per_rank(cfg: Config, world_size: int, tp_size: int = 1) -> int:
    """Responses one rank generates at once: its tensor-parallel group's share of a whole
    round (``world_size / tp_size`` groups, every rank of a group holding all its rows), or
    fewer by ``rollout.rows_per_generate`` (whole groups: a call holds floor(it / G) of them)."""
    groups = max(1, world_size // tp_size)
    share = math.ceil(round_prompts(cfg) * cfg.rollout.group_size / groups)
    G, limit = cfg.rollout.group_size, cfg.rollout.rows_per_generate
    return min(max(G, limit // G * G), share) if limit > 0 else share


def settings_from_config(
    cfg: Config,
    *,
    world_size: int,
    prompt_tokens: int,
    tp_size: int | None = None,
    device: str = "",
    gpu_bytes: int = 0,
) -> PlanSettings:
    """The plan's settings for a run of ``world_size`` ranks whose longest prompt has
    ``prompt_tokens`` tokens (every response counted at L_max: an upper bound), generating
    ``tp_size`` ranks at a time (by default ``rollout.tp_size``), on ``device`` (``cuda`` counts
    the runtime's and the allocator's overheads; "": not stated) with cards of ``gpu_bytes``
    (0: not known)."""
    generators = cfg.dist.rollout_ranks if world_size > cfg.dist.rollout_ranks else 0
    world_size -= generators  # a trainer rank's plan (a generator's: generator_bytes)
    context = prompt_tokens + cfg.rollout.max_new_tokens
    share = math.ceil(cfg.train.responses_per_minibatch / world_size) * context
    tp = cfg.rollout.tp_size if tp_size is None else tp_size
    return PlanSettings(
        world_size=world_size,
        param_dtype=cfg.model.param_dtype,
        compute_dtype=cfg.model.compute_dtype,
        microbatch_tokens=max(context, min(cfg.train.tokens_per_microbatch, share)),
        prompt_tokens=prompt_tokens,
        max_new_tokens=cfg.rollout.max_new_tokens,
        rows=rows_per_rank(cfg, world_size, tp),
        reference=cfg.algo.kl_coef > 0,
        activation_checkpointing=cfg.dist.activation_checkpointing,
        cpu_offload=cfg.dist.cpu_offload,
        grad_sync=cfg.dist.grad_sync,
        tp_size=tp,
        reshard_after_forward=cfg.dist.reshard_after_forward,
        staleness=cfg.train.async_staleness,
        episodes=bool(cfg.env.class_),
        generators=generators,
        top_p=min(cfg.rollout.top_p, cfg.eval.top_p) < 1,
        lora_rank=cfg.model.lora.rank,
        lora_targets=tuple(cfg.model.lora.target_modules),
        merged_sampling=cfg.model.lora.merged_sampling,
        gqa_copy=transformers_copies_gqa(),
        device=device,
        engine=cfg.rollout.engine,
        cuda_graphs=cfg.rollout.cuda_graphs,
        packing=cfg.train.packing,
        compiled=cfg.train.compile,
        vllm_fraction=cfg.vllm.gpu_memory_utilization,
        vllm_sleep=cfg.vllm.sleep,
        gpu_bytes=gpu_bytes,
    )


def embedded_hf_config(cfg: Config) -> dict[str, Any]:
    """The embedded tiny Qwen2's config fields, as ``dapo.models.policy`` builds it."""
    from dapo.models.demo import TinyModelSpec, build_tokenizer

    spec = TinyModelSpec()
    return {
        "model_type": "qwen2",
        "vocab_size": len(build_tokenizer()),
        "hidden_size": cfg.embedded.hidden,
        "intermediate_size": 2 * cfg.embedded.hidden,  # as dapo.models.policy sizes the spec
        "num_hidden_layers": cfg.embedded.layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "tie_word_embeddings": True,
    }


def model_shape(cfg: Config) -> ModelShape:
    """The run's model: the embedded one, or ``<model.path>/config.json`` (a Hub id's)."""
    if cfg.model.path == "embedded":
        return ModelShape.from_hf_config(embedded_hf_config(cfg))
    snapshot = hub.resolve(cfg.model.path, cfg.model.revision)
    return ModelShape.from_hf_config(json.loads((snapshot / "config.json").read_bytes()))
