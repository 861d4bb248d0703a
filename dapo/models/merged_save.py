"""What a LoRA run's merged weights are saved as: a plain model whose ``config.json`` says
what the weights are.

The merge (:func:`dapo.models.lora.merge_stream`) gives float32 weights for a bfloat16 or
float16 base: the policy trained was the base plus float32 adapters, applied unmerged, and
only float32 holds ``W + (alpha / r) B A`` without rounding most of the update away. With
``lm_head`` among ``model.lora.target_modules`` on a model whose head is its input embedding
(``tie_word_embeddings``), the merged head is no longer the embedding: the two are saved
apart, and the config must say so, or a loader that ties them reads one tensor for both.
``save_pretrained`` writes the config of the model it is called on, with the dtype of that
model's parameters, so such weights are saved through an empty copy of the model (its
parameters on the meta device) built from the config they need.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import torch

from dapo.dist import dcp
from dapo.models import lora
from dapo.models.sharded_load import empty_model


def head_untied(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    """Whether ``weights`` (``model``'s, merged) hold its tied head and input embeddings as
    two different tensors: the head adapted."""
    keys = dcp.tied_keys(model)
    if keys is None or not all(k in weights for k in keys):
        return False
    head, inputs = (weights[k] for k in keys)
    return head is not inputs and not (head.shape == inputs.shape and torch.equal(head, inputs))


def base_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of ``model``'s frozen base weights (the adapters are float32 whatever it)."""
    return next(
        p.dtype
        for name, p in model.named_parameters()
        if lora.ADAPTER not in name and p.is_floating_point()
    )


def widened(model: torch.nn.Module) -> bool:
    """Whether ``model``'s merged weights are float32 where its base is not."""
    return lora.enabled(model) and base_dtype(model) in lora.HALF


def saving_model(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model whose ``save_pretrained(state_dict=weights)`` writes ``weights`` (``model``'s
    merged) with a ``config.json`` that describes them: ``model`` itself, or an empty copy
    in float32 (a widened merge) and with ``tie_word_embeddings`` false (an adapted head)."""
    untie, wide = head_untied(model, weights), widened(model)
    if not (untie or wide):
        return model
    config = copy.deepcopy(model.config)
    if untie:
        config.tie_word_embeddings = False
    shell = empty_model(config, torch.float32 if wide else base_dtype(model))
    if getattr(model, "generation_config", None) is not None:
        shell.generation_config = copy.deepcopy(model.generation_config)
    return shell


def widened_note(model: torch.nn.Module, run_dir: Path) -> str | None:
    """The line that says a LoRA run's ``model/`` is float32 on a bfloat16 or float16 base,
    and how to get the smaller rounded copy; None otherwise."""
    if not widened(model):
        return None
    kind = str(base_dtype(model)).removeprefix("torch.")
    return (
        f"model/: float32, the trained policy exactly (the base is {kind}, the adapters "
        f"were trained unmerged in float32); `dapo export {shlex.quote(str(run_dir))} "
        f"--merge --dtype {kind} --out DIR` writes a copy half the size, rounded"
    )
