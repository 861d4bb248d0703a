"""Room on the disk for what a run will write, checked before the model loads.

Sizes come from the model's files alone: the safetensors headers (every tensor's name, shape
and dtype; a few KB read from each file), or for the embedded model its shape. A checkpoint
holds the weights that train and AdamW's two moments of each (:mod:`dapo.run.checkpoint`):
every weight in full fine-tuning, the adapters alone, in float32, with LoRA (its frozen base is
the base model's files, named, not copied). The run's final ``model/`` is the whole policy:
in ``model.param_dtype``, or with LoRA the merge, in float32 whatever the base's dtype
(:func:`dapo.models.merged_save.widened`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Any

from dapo.config import Config

__all__ = [
    "DTYPE_BYTES",
    "check_space",
    "describe",
    "estimate_checkpoint_bytes",
    "estimate_model_bytes",
    "run_space_warning",
    "saves_left",
    "steps_left",
    "whole_run_bytes",
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


def steps_left(cfg: Config, trainer: dict[str, Any]) -> bool:
    """Whether a resume from the checkpoint whose ``trainer.json`` is ``trainer`` trains a
    step: not when train.steps are done or train.max_gen_tokens or max_seconds spent (as the
    loop decides); then it writes the final ``model/`` alone."""
    t, spent = cfg.train, trainer.get("spent") or {}
    if int(trainer.get("step", 0)) >= t.steps:
        return False
    tokens = t.max_gen_tokens and float(spent.get("gen_tokens", 0.0)) >= t.max_gen_tokens
    seconds = t.max_seconds and float(spent.get("step_seconds", 0.0)) >= t.max_seconds
    return not (tokens or seconds)


def check_space(
    run_dir: Path,
    cfg: Config,
    weights_dir: Path | None,
    *,
    resume: bool = False,
    finishing: bool = False,
    latest: Path | None = None,
) -> None:
    """Refuse to start when the disk cannot hold what the run writes next: two checkpoints
    (the newest being written while the previous one is still the safe copy), or one and the
    final ``model/`` when that is larger (LoRA's float32 merge); a resume's latest checkpoint
    is on the disk already, and it needs room for one more, or the final ``model/``;
    ``finishing``, a resume with no step left, for the final ``model/`` alone. ``latest``,
    a resume's latest checkpoint: the next one is taken to be at least its size (it holds
    what no estimate from the weights sees, such as the rollouts drawn ahead of training)."""
    copies = 0 if finishing else 1 if resume else 2
    checkpoint = estimate_checkpoint_bytes(cfg, weights_dir) if copies else 0
    if copies and latest is not None:
        checkpoint = max(checkpoint, _tree_bytes(latest))
    model = estimate_model_bytes(cfg, weights_dir)
    need = max(copies * checkpoint, (copies - 1) * checkpoint + model)
    free = _free_bytes(run_dir)
    if free >= need:
        return
    # A resumed run writes into its own directory: run.out_dir does not move it.
    where_to = (
        "copy the run directory to a larger disk and resume the copy"
        if resume
        else "set run.out_dir to a larger disk"
    )
    fix = f"free space or {where_to}"
    keep = cfg.train.keep_checkpoints
    more = (
        "" if finishing else f" (train.keep_checkpoints={keep} will keep up to {keep + 1} at once)"
    )
    raise ValueError(
        f"run directory {run_dir} has {free / 2**20:.0f} MiB free, but "
        f"{'finishing the run' if finishing else 'checkpointing'} needs about "
        f"{need / 2**20:.0f} MiB ({_what(cfg, copies, need == copies * checkpoint)}); {fix}{more}"
    )


def saves_left(step: int, steps: int, save_every: int) -> int:
    """How many checkpoints a run at ``step`` writes if it trains every step up to ``steps``:
    one at each multiple of ``save_every`` (0: none) after ``step``, and one after the last
    step unless that is such a multiple."""
    if step >= steps:
        return 0
    if not save_every:
        return 1
    return steps // save_every - step // save_every + (1 if steps % save_every else 0)


def whole_run_bytes(
    checkpoint: int, model: int, *, saves: int, keep: int, existing: int = 0
) -> int:
    """The most the disk must give a run that writes ``saves`` more checkpoints of
    ``checkpoint`` bytes, then its final ``model/`` of ``model`` bytes: the newest ``keep``
    checkpoints stay, one more while a save is written (older ones are pruned only after it is
    safe); ``existing``, the checkpoints a resumed run has on the disk already (a save beside
    them adds one before any is pruned)."""
    if saves == 0:
        return model
    during = max(1, min(keep + 1, existing + saves) - existing)
    after = max(0, min(keep, existing + saves) - existing)
    return max(during * checkpoint, after * checkpoint + model)


def run_space_warning(
    run_dir: Path,
    cfg: Config,
    weights_dir: Path | None,
    *,
    step: int = 0,
    existing: int = 0,
    latest: Path | None = None,
) -> str | None:
    """What to say when the disk holds the next save (:func:`check_space` passed) but not
    everything the run writes if it trains to train.steps (train.max_gen_tokens or
    max_seconds may stop it sooner): every checkpoint train.keep_checkpoints keeps, one more
    during a save, and the final ``model/``; None when it all fits. ``step``: a resume's
    step, ``existing``: its checkpoints on the disk, ``latest``: the newest of them."""
    t = cfg.train
    saves = saves_left(step, t.steps, t.save_every)
    checkpoint = estimate_checkpoint_bytes(cfg, weights_dir)
    if latest is not None:
        checkpoint = max(checkpoint, _tree_bytes(latest))
    model = estimate_model_bytes(cfg, weights_dir)
    need = whole_run_bytes(
        checkpoint, model, saves=saves, keep=t.keep_checkpoints, existing=existing
    )
    free = _free_bytes(run_dir)
    if free >= need:
        return None
    # train.keep_checkpoints=1 always fits once check_space has passed: it asks for as much.
    fits = max(
        (
            k
            for k in range(1, t.keep_checkpoints)
            if whole_run_bytes(checkpoint, model, saves=saves, keep=k, existing=existing) <= free
        ),
        default=1,
    )
    mib = 2**20
    return (
        f"run directory {run_dir} has {free / mib:.0f} MiB free, but the whole run needs about "
        f"{need / mib:.0f} MiB if it trains to train.steps={t.steps}: {saves} more "
        f"checkpoint{'s' if saves != 1 else ''} of about {checkpoint / mib:.0f} MiB "
        f"(train.save_every={t.save_every}), of which train.keep_checkpoints="
        f"{t.keep_checkpoints} stay ({t.keep_checkpoints + 1} while one is written), then the "
        f"final model/ of about {model / mib:.0f} MiB. It starts, and a save that finds the "
        "disk full stops it with its last checkpoint intact, to resume; to fit, set "
        f"train.keep_checkpoints={fits} or free space"
    )


def describe(cfg: Config, weights_dir: Path | None, run_dir: Path) -> str:
    """The dry run's line on disk space for a new run in ``run_dir``: a checkpoint's size,
    the final ``model/``'s, the most the whole run holds at once and the disk's free space."""
    t, mib = cfg.train, 2**20
    checkpoint = estimate_checkpoint_bytes(cfg, weights_dir)
    model = estimate_model_bytes(cfg, weights_dir)
    saves = saves_left(0, t.steps, t.save_every)
    need = whole_run_bytes(checkpoint, model, saves=saves, keep=t.keep_checkpoints)
    return (
        f"disk: a checkpoint about {checkpoint / mib:,.0f} MiB, the final model/ about "
        f"{model / mib:,.0f} MiB; the run holds up to {need / mib:,.0f} MiB at once ({saves} "
        f"saves, train.keep_checkpoints={t.keep_checkpoints}); {_free_bytes(run_dir) / mib:,.0f}"
        f" MiB free"
    )


def _what(cfg: Config, copies: int, checkpoints: bool) -> str:
    """What the space is needed for, in words."""
    state = "of the adapters and their" if cfg.model.lora.rank else "of weights and"
    dtype = "float32" if cfg.model.lora.rank else cfg.model.param_dtype
    final = f"the final model/ in {dtype}"
    if copies == 0:
        return f"{final}: no step is left to train"
    if checkpoints:
        count = ("one more checkpoint", "two checkpoints")[copies - 1]
        return f"{count} {state} optimiser state"
    before = f"a checkpoint {state} optimiser state, then " if copies == 2 else ""
    return before + final


def _free_bytes(run_dir: Path) -> int:
    """The free bytes of the disk ``run_dir`` is on; a new run's directory does not exist yet,
    and its nearest ancestor is on the same disk."""
    where = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    return shutil.disk_usage(where).free


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


def _tree_bytes(directory: Path) -> int:
    """The bytes of the files under ``directory`` (a checkpoint dapo wrote: links not
    followed)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            total += os.lstat(os.path.join(root, name)).st_size
    return total
