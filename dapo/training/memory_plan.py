"""Memory per GPU, on paper: what a run holds on each rank, before anything is loaded.

One process holds float32 (``model.param_dtype``) weights, gradients and AdamW state, run
under autocast, whose cache keeps a compute-dtype copy of every weight while it generates or
trains. Under torchrun (here: from 2 ranks) FSDP2 shards those three per decoder layer,
gathers two layers at a time in the compute dtype, computes full logits (no chunked head),
and the native engine generates from a whole frozen copy on every rank; the ``dist`` options
apply only then. Generation (KV cache) and training (gradients, activations, output head)
never overlap: the peak is the larger phase plus what both hold (weights, AdamW state, the
generation copy, the GRPO reference). Parameters are exact for Qwen2/Qwen3/Llama/Mistral
(the tests check Qwen2.5's published counts); activations and logits are a rough model (the
tests compare ``activation_bytes`` and the full logits with what autograd keeps).

    python -m dapo.memory_plan          # the table of docs/scale-out.md
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dapo.config import Config

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Copies of dapo.algo.logits.HEAD_CHUNK_ELEMENTS and dapo.training.sampling.MAX_OVERSAMPLE (a test
# keeps them equal): those modules import torch, and a dry run plans before it loads.
HEAD_CHUNK_ELEMENTS = 1 << 26
MAX_OVERSAMPLE = 4

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")

_QWEN25_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_QWEN25_FIELDS += ("num_key_value_heads", "vocab_size", "tie_word_embeddings")
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    name: {"model_type": "qwen2", **dict(zip(_QWEN25_FIELDS, sizes, strict=True))}
    for name, *sizes in (
        ("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 151936, True),
        ("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, 151936, True),
        ("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, False),
        ("qwen2.5-32b", 5120, 27648, 64, 40, 8, 152064, False),
    )
}
"""The ``config.json`` fields that size four Qwen2.5 base models (the table's)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only causal LM that its memory depends on."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a ``config.json`` dict; ValueError for a layout not counted here."""
        kind = config.get("model_type")
        if kind not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {kind!r} is not one the memory plan counts {SUPPORTED_MODEL_TYPES}"
            )
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            vocab=int(config["vocab_size"]),
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            tied=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or attention_bias,
            o_bias=kind != "qwen2" and attention_bias,
            mlp_bias=kind == "llama" and bool(config.get("mlp_bias", False)),
            qk_norm=kind == "qwen3",
        )

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        """H (q + 2 kv) + q H for the attention projections (q = heads x head_dim, kv =
        kv_heads x head_dim); biases q + 2 kv (Qwen2), + H for o too with attention_bias
        (Llama, Qwen3); 3 H I for the MLP (+ 2 I + H with Llama's mlp_bias); 2 H for the two
        RMSNorms (+ 2 head_dim: Qwen3's q/k norms)."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_dim
        attention = h * (q + 2 * kv) + q * h
        attention += (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        return attention + mlp + 2 * h + 2 * self.head_dim * self.qk_norm

    @property
    def outer_parameters(self) -> int:
        """Outside the decoder layers: the embedding V H, the untied head V H, the final norm H."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def num_parameters(self) -> int:
        return self.layers * self.layer_parameters + self.outer_parameters


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

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of each part (per rank in host memory for what ``offloaded`` moved)."""

    shape: ModelShape
    settings: PlanSettings
    weights: int
    gradients: int
    optimizer: int
    generation_copy: int
    gathered_layers: int
    activations: int
    output_head: int
    kv_cache: int
    reference: int

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
        return states + self.generation_copy

    @property
    def generation_peak(self) -> int:
        return self.held + self.kv_cache

    @property
    def training_peak(self) -> int:
        grads = 0 if self.offloaded else self.gradients
        return self.held + grads + self.gathered_layers + self.activations + self.output_head

    @property
    def total(self) -> int:  # the peak per GPU: the larger phase
        return max(self.generation_peak, self.training_peak)


def activation_bytes(shape: ModelShape, *, tokens: int, compute: int, checkpointing: bool) -> int:
    """What autograd keeps for one micro-batch of ``tokens``, roughly. Per token and layer:
    ``compute x (6 H + 2 kv + 4 I)`` bytes (norm outputs and projection inputs, q, the
    attention output, k, v; the MLP's gate, up, activation and product) and ``16 H`` bytes of
    the RMSNorms' float32; attention is fused (sdpa), so no tokens^2 term. Checkpointed, a
    layer keeps only its input (``compute x H``) and one layer is recomputed at a time."""
    per_token_layer = compute * (6 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate)
    per_token_layer += 16 * shape.hidden
    if not checkpointing:
        return tokens * shape.layers * per_token_layer
    return tokens * (shape.layers * shape.hidden * compute + per_token_layer)


def output_head_bytes(shape: ModelShape, s: PlanSettings, *, compute: int) -> int:
    """One process: a float32 chunk of logits and its compute-dtype copy, the head's weight in
    the compute dtype and its float32 gradient (``dapo.algo.logits``). FSDP: the logits of each
    row's response and the position before it, from the model's own forward (no chunked head):
    backward holds four compute-dtype [positions, V] tensors at once, forward no more (see
    docs/scale-out.md); the head's weight is counted in the gathered root."""
    tokens, vocab = s.microbatch_tokens, shape.vocab
    if s.sharded:  # rows of prompt + L_max tokens
        positions = -(-tokens * (s.max_new_tokens + 1) // (s.prompt_tokens + s.max_new_tokens))
        return 4 * compute * positions * vocab
    chunk = min(tokens, max(1, HEAD_CHUNK_ELEMENTS // vocab))
    return chunk * vocab * (4 + compute) + vocab * shape.hidden * (compute + 4)


def kv_cache_bytes(shape: ModelShape, *, tokens: int, rows: int, compute: int) -> int:
    """K and V of every layer for ``rows`` responses of ``tokens`` (prompt + L_max) each."""
    return 2 * shape.layers * shape.kv_dim * compute * tokens * rows


def plan_memory(shape: ModelShape, settings: PlanSettings) -> MemoryPlan:
    s = settings
    if s.world_size < 1:
        raise ValueError(f"world size must be >= 1, got {s.world_size}")
    p, w = shape.num_parameters, s.world_size
    master, compute = DTYPE_BYTES[s.param_dtype], DTYPE_BYTES[s.compute_dtype]
    # Frozen copies (generation, reference) are bf16 when that computes, else the weights'
    # dtype (dapo.training.step); one process generates from its own module, under autocast.
    frozen = 2 if s.compute_dtype == "bfloat16" else master
    copy = p * frozen if s.sharded else (p * compute if compute != master else 0)
    tokens, ckpt = s.microbatch_tokens, s.activation_checkpointing
    gathered = 0
    if s.sharded:  # two layers (one prefetched) and the root's embedding/head in the
        # compute dtype, and one layer's unsharded float32 gradient before reduce-scatter
        layer = shape.layer_parameters
        gathered = (2 * layer + shape.outer_parameters) * compute + layer * 4
    return MemoryPlan(
        shape=shape,
        settings=s,
        weights=math.ceil(p * master / w),
        gradients=math.ceil(p * master / w),
        optimizer=math.ceil(2 * p * master / w),
        generation_copy=copy,
        gathered_layers=gathered,
        activations=activation_bytes(shape, tokens=tokens, compute=compute, checkpointing=ckpt),
        output_head=output_head_bytes(shape, s, compute=compute),
        kv_cache=kv_cache_bytes(
            shape, tokens=s.prompt_tokens + s.max_new_tokens, rows=s.rows, compute=compute
        ),
        reference=math.ceil(p * frozen / w) if s.reference else 0,
    )


def _in(unit: int):
    return lambda n: f"{n / unit:.2f}"


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a small text table, in GiB (MiB for a plan under 1 GiB)."""
    s, count = plan.settings, plan.shape.num_parameters
    w, master, compute = s.world_size, s.param_dtype, s.compute_dtype
    share = f"1/{w} shard" if s.sharded else "whole"
    where = "host" if plan.offloaded else "GPU"
    ckpt = ", checkpointed" if s.activation_checkpointing else ""
    unit, size = ("GiB", _in(GIB)) if max(plan.total, plan.host) >= GIB else ("MiB", _in(2**20))
    copy = "generation copy (whole)" if s.sharded else f"autocast's {compute} weight copy"
    kv = f"KV cache ({s.rows} rows x {s.prompt_tokens + s.max_new_tokens} tokens)"
    logits = f"full logits, 4 x {compute}" if s.sharded else "logit chunks, its gradient"
    rows = [
        (f"weights ({master}, {share})", plan.weights, where + ", always"),
        (f"gradients ({master}, {share})", plan.gradients, where + ", training"),
        (f"AdamW state (2 x {master}, {share})", plan.optimizer, where + ", always"),
        (copy, plan.generation_copy, "GPU, always"),
        (f"FSDP gathered layers ({compute})", plan.gathered_layers, "GPU, training"),
        (f"activations ({s.microbatch_tokens} tokens{ckpt})", plan.activations, "GPU, training"),
        (f"output head ({logits})", plan.output_head, "GPU, training"),
        (kv, plan.kv_cache, "GPU, generation"),
        (f"GRPO reference ({share})", plan.reference, where + ", always"),
        ("peak in generation", plan.generation_peak, ""),
        ("peak in training", plan.training_peak, ""),
        ("peak per GPU", plan.total, ""),
    ]
    if plan.offloaded:
        rows.append(("host memory per rank", plan.host, ""))
    rows = [row for row in rows if row[1] or not row[2]]  # parts this run does not have: out
    width = max(len(name) for name, _, _ in rows) + 2
    count_text = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
    head = f"memory per GPU on paper, world size {w}: {count_text} parameters, {compute} "
    head += f"compute, {master} weights ({unit}; the model: dapo/training/memory_plan.py)"
    lines = (f"  {name:<{width}}{size(n):>9}  {when}".rstrip() for name, n, when in rows)
    return "\n".join([head, *lines])


def round_prompts(cfg: Config) -> int:
    """The most prompts one generation round may draw (``dapo.training.sampling.round_size``)."""
    n, smp = cfg.train.prompts_per_step, cfg.sampling
    default = (smp.prompts_per_round or n) if smp.dynamic else n
    return max(default, MAX_OVERSAMPLE * n) if smp.dynamic and smp.oversample else default


def rows_per_rank(cfg: Config, world_size: int) -> int:
    """Responses one rank generates at once: a whole round's share, or fewer by
    ``rollout.rows_per_generate``."""
    share = math.ceil(round_prompts(cfg) * cfg.rollout.group_size / world_size)
    limit = cfg.rollout.rows_per_generate
    return min(limit, share) if limit > 0 else share


def settings_from_config(cfg: Config, *, world_size: int, prompt_tokens: int) -> PlanSettings:
    """The plan's settings for a run of ``world_size`` ranks whose longest prompt has
    ``prompt_tokens`` tokens (every response counted at L_max: an upper bound)."""
    context = prompt_tokens + cfg.rollout.max_new_tokens
    share = math.ceil(cfg.train.responses_per_minibatch / world_size) * context
    return PlanSettings(
        world_size=world_size,
        param_dtype=cfg.model.param_dtype,
        compute_dtype=cfg.model.compute_dtype,
        microbatch_tokens=max(context, min(cfg.train.tokens_per_microbatch, share)),
        prompt_tokens=prompt_tokens,
        max_new_tokens=cfg.rollout.max_new_tokens,
        rows=rows_per_rank(cfg, world_size),
        reference=cfg.algo.kl_coef > 0,
        activation_checkpointing=cfg.dist.activation_checkpointing,
        cpu_offload=cfg.dist.cpu_offload,
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
    """The run's model: the embedded one, or ``<model.path>/config.json``."""
    if cfg.model.path == "embedded":
        return ModelShape.from_hf_config(embedded_hf_config(cfg))
    path = Path(cfg.model.path) / "config.json"
    return ModelShape.from_hf_config(json.loads(path.read_text(encoding="utf-8")))


def print_plan(cfg: Config, *, world_size: int, prompt_tokens: int) -> None:
    """The dry run's memory table (or why there is none)."""
    try:
        shape = model_shape(cfg)
    except (OSError, ValueError, KeyError) as exc:
        print(f"memory plan: not available ({exc})")
        return
    settings = settings_from_config(cfg, world_size=world_size, prompt_tokens=prompt_tokens)
    print(format_plan(plan_memory(shape, settings)))
    if not settings.sharded and cfg.dist.cpu_offload:
        print("  note: dist.cpu_offload applies from 2 ranks")
    if cfg.rollout.rows_per_generate == 0:
        print(
            f"  note: KV cache of a whole round per rank (up to {round_prompts(cfg)} prompts x "
            f"{cfg.rollout.group_size} / {world_size}), every row at the longest prompt + L_max:"
            " an upper bound; rollout.rows_per_generate bounds it"
        )


def markdown_table(
    names: Sequence[str] = tuple(KNOWN_SHAPES),
    world_sizes: Sequence[int] = (1, 8, 64),
    settings: PlanSettings = PlanSettings(),
) -> str:
    """GiB per GPU of ``KNOWN_SHAPES`` at each world size (docs/scale-out.md's table)."""
    head = "model|params|GPUs|weights + grads + AdamW|generation copy|activations (checkpointed)"
    head += "|output head|KV cache|peak in training (checkpointed)|peak in generation"
    lines = ["| " + head.replace("|", " | ") + " |", "|---|" + "---:|" * 9]
    gib = _in(GIB)
    for name in names:
        shape = ModelShape.from_hf_config(KNOWN_SHAPES[name])
        for w in world_sizes:
            plain = plan_memory(shape, replace(settings, world_size=w))
            ck = plan_memory(shape, replace(settings, world_size=w, activation_checkpointing=True))
            states = plain.weights + plain.gradients + plain.optimizer
            # docs/scale-out.md's table: checkpointed figures beside the plain ones from 2 ranks.
            acts, training = gib(plain.activations), gib(plain.training_peak)
            if w > 1:
                acts += f" ({gib(ck.activations)})"
                training += f" ({gib(ck.training_peak)})"
            cells = (name, f"{shape.num_parameters / 1e9:.2f}B", str(w), gib(states))
            cells += (gib(plain.generation_copy), acts, gib(plain.output_head), gib(plain.kv_cache))
            lines.append("| " + " | ".join((*cells, training, gib(plain.generation_peak))) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
