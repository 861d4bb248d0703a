"""LoRA adapters on the ``vllm`` engine, through vLLM's LoRA support.

The frozen base weights are loaded into vLLM once (:func:`base_weights`, the adapted layers'
``base_layer`` weights under their base-model names; a sleeping engine keeps them in host
memory, at sleep level 1, rather than dropping them); after each update only the adapters
move (:class:`AdapterSlot`): written as a peft adapter directory (a few MB where the model is
GBs) and added under a new adapter id, the previous one removed with its files, and every
request names the current one. vLLM computes ``x W^T + (alpha / r) (x A^T) B^T`` as peft does;
in bfloat16 the adapters' small updates are not rounded away into ``W`` as a merged copy's
would be.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors.torch import save_file

from dapo.dist import fsdp
from dapo.models import lora

Weights = Iterator[tuple[str, torch.Tensor]]

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for ``max_lora_rank``: the engine asks for the least >= the rank."""


def llm_options(model: torch.nn.Module) -> dict[str, Any]:
    """``vllm.LLM``'s LoRA arguments for ``model`` (none without adapters)."""
    if not lora.enabled(model):
        return {}
    r = lora.rank(model)
    limit = next((x for x in LORA_RANKS if x >= r), None)
    if limit is None:
        raise ValueError(
            f"rollout.engine=vllm serves LoRA adapters of rank <= {LORA_RANKS[-1]}; "
            f"model.lora.rank is {r}"
        )
    return {"enable_lora": True, "max_lora_rank": limit, "max_loras": 1}


def base_weights(model: torch.nn.Module, dtype: torch.dtype) -> Weights:
    """The frozen base model's weights of adapted ``model``, one whole tensor at a time, by
    the names a model without adapters has (every rank of a sharded model joins, in step)."""
    names = dict(lora.base_names(model.state_dict()))
    for name, tensor in fsdp.whole_state(model, dtype, names):
        yield names[name], tensor


class AdapterSlot:
    """The one adapter a vLLM engine serves: :meth:`load` replaces it, :attr:`request` names
    it in every generate call."""

    def __init__(self, model: torch.nn.Module, directory: str) -> None:
        self.directory = directory
        self.config = lora.adapter_config(model, base=directory)
        self.request: Any = None  # vllm.lora.request.LoRARequest
        self.made = 0

    def load(
        self,
        llm: Any,
        model: torch.nn.Module,
        dtype: torch.dtype,
        counted: Callable[[Weights], Weights] = lambda w: w,
    ) -> None:
        """Hand ``llm`` the adapters of ``model`` (gathered whole under FSDP2) under a new id,
        and drop the previous adapter, its files too. ``counted`` sees every tensor."""
        from vllm.lora.request import LoRARequest

        moving = lora.moving_names(model) or set()
        tensors = {
            lora.peft_name(name): t.contiguous()
            for name, t in counted(fsdp.whole_state(model, dtype, moving))
        }
        self.made += 1
        where = os.path.join(self.directory, f"adapter-{self.made}")
        os.makedirs(where)
        save_file(tensors, os.path.join(where, "adapter_model.safetensors"))
        with open(os.path.join(where, "adapter_config.json"), "w") as f:
            json.dump(self.config, f)
        old, self.request = self.request, LoRARequest(f"policy-{self.made}", self.made, where)
        llm.llm_engine.add_lora(self.request)
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
