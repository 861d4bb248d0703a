"""The run's final ``model/``: the policy as ``save_pretrained`` writes it, a LoRA policy's
adapters merged into its base (:mod:`dapo.models.merged_save`: float32 on a bfloat16 or
float16 base, the head apart from the embeddings when the head was adapted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dapo import dist
from dapo.dist import fsdp
from dapo.models import lora, merged_save
from dapo.run import checkpoint, sharded_checkpoint


def save_final(
    model: torch.nn.Module, tokenizer: Any, run_dir: Path, say: Callable[[str], None]
) -> None:
    """Write ``run_dir/model`` from ``model`` (whole, or FSDP shards gathered on rank 0),
    saying when a LoRA policy's merge is written wider than its base."""
    adapted = lora.enabled(model)
    if adapted and dist.is_main() and (note := merged_save.widened_note(model, run_dir)):
        say(note)
    if fsdp.is_sharded(model):
        saver = merged_save.saving_model if adapted else None
        sharded_checkpoint.export_model(
            model, tokenizer, run_dir / "model", lora.merger(model), saver
        )
    else:  # with LoRA, the merged weights: a model like the base that anything can load
        merged = lora.merged_weights(model) if adapted else None
        target = merged_save.saving_model(model, merged) if merged is not None else model
        checkpoint.export_model(target, tokenizer, run_dir / "model", merged)
