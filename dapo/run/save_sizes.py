"""Sizes of what a run saves, from the model's files alone, with no model in memory.

The safetensors headers give every tensor's name, shape and dtype (a few KB read from each
file), or for the embedded model its shape. A checkpoint holds the weights that train and
AdamW's two moments of each (:mod:`dapo.run.checkpoint`): every weight in full fine-tuning, the
adapters alone, in float32, with LoRA (its frozen base is the base model's files, named, not
copied), and with ``train.async_staleness`` the rollouts drawn ahead. The run's final
``model/`` is the whole policy: in ``model.param_dtype``, or with LoRA the merge, in float32
whatever the base's dtype (:func:`dapo.models.merged_save.widened`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from dapo.config import Config

__all__ = [
    "DTYPE_BYTES",
    "ahead_bytes",
    "estimate_checkpoint_bytes",
    "estimate_model_bytes",
    "tree_bytes",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

STATE_BYTES = 64 * 2**10
"""A save's small files beyond the model directory's own: a checkpoint's generator states,
trainer.json, manifest and optimizer.json (about 22 KB on a CPU), a tokenizer's and config's
files as written again (a few hundred bytes more than the model directory's)."""

ENTRY_BYTES = 160
"""A tensor's entry in a safetensors header: its name, dtype, shape and offsets (90 to 130
bytes for a Qwen2's)."""

TENSOR_BYTES = 4 * ENTRY_BYTES + 8
"""What a trained tensor adds to a checkpoint beyond its values and its moments: its entries
in the headers of the weights and of the optimizer state (its two moments and its step
count), and the step count."""

SIDE_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")
"""The model directory's files that a save writes again beside the weights: its tokenizer's
and its configs."""

ROW_JSON_BYTES = 128
"""A rollout row's fields in a checkpoint's JSON beside its text (its reward, flags and
keys: about 118 bytes a row, measured on the demo's)."""

_HEADER_MAX = 100 * 2**20  # safetensors' own limit on a header


def estimate_checkpoint_bytes(cfg: Config, weights_dir: Path | None) -> int:
    """About what one checkpoint takes: the weights that train and AdamW's two moments of
    each (model.param_dtype; LoRA's adapters: float32), the tokenizer and the small state.

    From the weight files in ``weights_dir`` (the model's directory, a Hub id's snapshot; None
    for the embedded model, from its shape), so it needs no model in memory.
    """
    side = STATE_BYTES + _side_bytes(weights_dir)
    shapes = _shapes(cfg, weights_dir)
    if cfg.model.lora.rank and shapes is not None:
        params, tensors = _adapters(cfg, shapes)
        return 3 * params * 4 + tensors * TENSOR_BYTES + side
    params = _parameters(weights_dir, shapes)
    tensors = len(shapes or ())
    return 3 * params * DTYPE_BYTES[cfg.model.param_dtype] + tensors * TENSOR_BYTES + side


def estimate_model_bytes(cfg: Config, weights_dir: Path | None) -> int:
    """About what the run's final ``model/`` takes: every weight in model.param_dtype, or a
    LoRA run's merge in float32 (a tied head adapted saved apart), and the tokenizer."""
    shapes = _shapes(cfg, weights_dir)
    params, entries = _parameters(weights_dir, shapes), len(shapes or ())
    side = entries * ENTRY_BYTES + STATE_BYTES + _side_bytes(weights_dir)
    if not cfg.model.lora.rank:
        return params * DTYPE_BYTES[cfg.model.param_dtype] + side
    if shapes is not None and "lm_head" in cfg.model.lora.target_modules:
        if not any(_module(name) == "lm_head" for name in shapes):  # tied: the embeddings
            params += max((math.prod(s) for s in shapes.values() if len(s) == 2), default=0)
    return params * 4 + side


def ahead_bytes(cfg: Config, prompt_tokens: int) -> int:
    """About what each checkpoint of a run that generates ahead (``train.async_staleness`` =
    k) holds of the k steps drawn ahead: each step's rows taken as 4 x train.prompts_per_step
    x G with dynamic sampling (a round's largest oversampled size: the demo's steps drew about
    that many over their rounds), train.prompts_per_step x G without (or one
    ``sampling.prompts_per_round`` when larger), every row at the longest prompt and L_max:
    the prompt's and response's token ids (8 bytes each), the response's log-probs (4) and its
    text in JSON (about 4 per token, and ROW_JSON_BYTES of fields)."""
    k = cfg.train.async_staleness
    if not k:
        return 0
    s, r = cfg.sampling, cfg.rollout
    prompts = max(s.prompts_per_round, (4 if s.dynamic else 1) * cfg.train.prompts_per_step)
    row = 8 * prompt_tokens + 16 * r.max_new_tokens + ROW_JSON_BYTES
    return k * prompts * r.group_size * row


def _module(name: str) -> str:
    """The last part of the module a stored tensor belongs to (``q_proj`` of
    ``model.layers.0.self_attn.q_proj.weight``)."""
    parts = name.rsplit(".", 2)
    return parts[-2] if len(parts) > 1 else ""


def _adapters(cfg: Config, shapes: dict[str, list[int]]) -> tuple[int, int]:
    """LoRA's trained parameters and tensors: A and B, r (in + out) values together, for each
    weight of a targeted layer; a tied head targeted (stored as the embeddings alone) counted
    as the largest matrix."""
    lora = cfg.model.lora
    targets = set(lora.target_modules)
    matrices = {n: s for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2}
    adapted = [s for n, s in matrices.items() if _module(n) in targets]
    if "lm_head" in targets and not any(_module(n) == "lm_head" for n in matrices):
        adapted.append(max(matrices.values(), key=sum, default=[0, 0]))
    return sum(lora.rank * sum(s) for s in adapted), 2 * len(adapted)


def _parameters(weights_dir: Path | None, shapes: dict[str, list[int]] | None) -> int:
    """The model's parameters: counted from ``shapes``, else from the weight files' sizes
    and config.json's dtype (pickled .bin weights)."""
    if shapes is not None:
        return sum(math.prod(s) for s in shapes.values())
    assert weights_dir is not None  # the embedded model always has its shapes
    weights = sum(f.stat().st_size for f in weights_dir.glob("*.safetensors"))
    weights += sum(f.stat().st_size for f in weights_dir.glob("*.bin"))
    stored = 2
    try:
        meta = json.loads((weights_dir / "config.json").read_text())
        stored = DTYPE_BYTES.get(str(meta.get("torch_dtype") or meta.get("dtype")), 2)
    except (OSError, ValueError):
        pass
    return weights // stored


def _shapes(cfg: Config, weights_dir: Path | None) -> dict[str, list[int]] | None:
    """Every stored tensor's shape by name: the embedded model's from its shape, a
    directory's from its safetensors headers; None when there are none to read."""
    if weights_dir is None:
        return _embedded_shapes(cfg)
    files = _weight_files(weights_dir)
    shapes: dict[str, list[int]] = {}
    for file in files:
        header = _header(file)
        if header is None:
            return None
        shapes |= {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return shapes if files else None


def _weight_files(weights_dir: Path) -> list[Path]:
    """The safetensors files a load reads: those the index names, or ``model.safetensors``;
    else every one (a Hub snapshot may hold a second copy, ``consolidated.safetensors``)."""
    try:
        index = json.loads((weights_dir / "model.safetensors.index.json").read_text())
        return sorted({weights_dir / str(f) for f in index["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    single = weights_dir / "model.safetensors"
    return [single] if single.is_file() else sorted(weights_dir.glob("*.safetensors"))


def _header(file: Path) -> dict[str, Any] | None:
    """The JSON header of the safetensors file ``file``; None when it is not readable as one
    (the model's load, after this check, names the file and what is wrong)."""
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _HEADER_MAX:
                return None
            header = json.loads(f.read(size))
        tensors = [v for k, v in header.items() if k != "__metadata__"]
        shapes = [v.get("shape") for v in tensors if isinstance(v, dict)]
    except (OSError, ValueError, struct.error, AttributeError, RecursionError):
        return None
    sized = all(isinstance(s, list) and all(type(n) is int and n >= 0 for n in s) for s in shapes)
    return header if sized and len(shapes) == len(tensors) else None


def _embedded_shapes(cfg: Config) -> dict[str, list[int]]:
    """The embedded Qwen2's tensors (:func:`dapo.models.demo.tiny_qwen2`: 4 heads, 2 of keys
    and values, an MLP of 2 x hidden, the head tied), its vocabulary taken as 4096, an upper
    bound of the word-level demo's."""
    h, kv = cfg.embedded.hidden, cfg.embedded.hidden // 2
    shapes = {"model.embed_tokens.weight": [4096, h], "model.norm.weight": [h]}
    layer = {
        "self_attn.q_proj.weight": [h, h],
        "self_attn.q_proj.bias": [h],
        "self_attn.k_proj.weight": [kv, h],
        "self_attn.k_proj.bias": [kv],
        "self_attn.v_proj.weight": [kv, h],
        "self_attn.v_proj.bias": [kv],
        "self_attn.o_proj.weight": [h, h],
        "mlp.gate_proj.weight": [2 * h, h],
        "mlp.up_proj.weight": [2 * h, h],
        "mlp.down_proj.weight": [h, 2 * h],
        "input_layernorm.weight": [h],
        "post_attention_layernorm.weight": [h],
    }
    for i in range(cfg.embedded.layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _side_bytes(weights_dir: Path | None) -> int:
    """The bytes of the files a save writes beside the weights (:data:`SIDE_FILES`), as the
    model directory holds them; the embedded model's are a few KB (in STATE_BYTES)."""
    if weights_dir is None:
        return 0
    found = {f for pattern in SIDE_FILES for f in weights_dir.glob(pattern) if f.is_file()}
    return sum(f.stat().st_size for f in found)


def tree_bytes(directory: Path) -> int:
    """The bytes of the files under ``directory`` (a checkpoint dapo wrote: links not
    followed)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            total += os.lstat(os.path.join(root, name)).st_size
    return total
