"""The sizes of a decoder-only causal LM that its memory depends on, from its ``config.json``
alone (no weights, no torch): parameters counted exactly for Qwen2/Qwen3/Llama/Mistral (the
tests check Qwen2.5's published counts), and the shapes of four Qwen2.5 models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    model_type: str = field(default="", compare=False)
    """``config.json``'s ``model_type`` (which decoding path runs it), when known."""

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
            model_type=kind,
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
    def tp_split_parameters(self) -> int:
        """What tensor-parallel generation splits over its ranks (``dapo.dist.tensor_parallel``
        ``tp_plan``): every decoder layer's Linear weights (q, k, v, o, gate, up, down) and
        the biases of the column-wise ones (q, k, v, gate, up), the embedding and an untied
        head (both over the vocabulary; a tied head shares the embedding's shard). Whole on
        every rank: the norms and the row-wise layers' biases (o, down)."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_dim
        linear = h * (q + 2 * kv) + q * h + 3 * h * i
        linear += (q + 2 * kv) * self.qkv_bias + 2 * i * self.mlp_bias
        return self.layers * linear + self.vocab * h * (1 if self.tied else 2)

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest weight: the embedding, or an MLP projection, or q."""
        q = self.heads * self.head_dim
        return max(self.vocab, self.intermediate, q) * self.hidden

    @property
    def outer_parameters(self) -> int:
        """Outside the decoder layers: the embedding V H, the untied head V H, the final norm H."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def num_parameters(self) -> int:
        return self.layers * self.layer_parameters + self.outer_parameters

    def _linear_sizes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each Linear of a decoder layer, by name."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def lora_parameters(self, rank: int, targets: Sequence[str]) -> int:
        """LoRA's adapter parameters (``model.lora``): r (in + out) for each targeted Linear
        of every decoder layer (q, k, v, o, gate, up, down; other names count nothing)."""
        sizes = self._linear_sizes()
        per_layer = sum(rank * sum(sizes[t]) for t in set(targets) if t in sizes)
        return self.layers * per_layer

    def lora_target_weights(self, targets: Sequence[str]) -> int:
        """The weights of the Linears LoRA adapts (in x out each), every decoder layer's."""
        sizes = self._linear_sizes()
        return self.layers * sum(a * b for t, (a, b) in sizes.items() if t in set(targets))
