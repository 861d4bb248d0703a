"""The policy's own dropout, turned off as it loads.

Some configs ask for dropout (GPT-2's ``attn_pdrop``/``resid_pdrop``/``embd_pdrop`` of 0.1,
OPT's ``dropout``, Phi's): the update's forward passes run in training mode, and with
dropout they are random, so an update that has not moved the policy yet sees an importance
ratio that is not 1, its clipping acts on noise, and a packed batch and a padded one give
different gradients (different draws). The old log-probs are scored in evaluation mode, and
the sampler never drops anything, so only the update's passes would differ: TRL's trainers
turn dropout off for the same reason. LoRA's own ``model.lora.dropout`` is a setting of the
run, added after this (:func:`dapo.models.lora.apply`), and left as set.

Dropout is not a model's only randomness in training mode (PhiMoE's router draws its experts
there), so the update's passes run in evaluation mode, as the old log-probs' do, but for
LoRA's dropout (:func:`update_mode`).
"""

from __future__ import annotations

from typing import Any

import torch

DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)
NAMES = ("dropout", "pdrop", "layerdrop")
"""What the name of a dropout probability holds: a config's field, or the float a layer
keeps for ``torch.nn.functional.dropout`` (``attention_dropout``, ``attn_pdrop``, OPT's
``layerdrop``, which skips whole layers at random in training)."""


def _is_rate(name: str, value: Any) -> bool:
    return any(n in name.lower() for n in NAMES) and type(value) is float and value > 0


def disable(model: torch.nn.Module) -> str | None:
    """Set every dropout probability of ``model`` to 0: each dropout layer's ``p``, each
    layer's float named for one, and its config's fields (the copies built from the config
    get none either). LoRA's adapters' dropout (``.lora_dropout.``) is left alone. Returns a
    line for the log naming what was nonzero, or None when nothing was."""
    fields = _zero_config(getattr(model, "config", None), "")
    layers = 0
    for name, module in model.named_modules():
        if ".lora_dropout." in f".{name}.":
            continue
        if isinstance(module, DROPOUTS) and module.p > 0:
            module.p, layers = 0.0, layers + 1
        for key, value in list(vars(module).items()):
            if _is_rate(key, value):
                setattr(module, key, 0.0)
                layers += 1
    if not (fields or layers):
        return None
    named = ", ".join(fields) if fields else f"{layers} dropout layers"
    return (
        f"dropout: off in the policy ({named}; now 0): with it, an update's forward pass is "
        "random, so an on-policy update's importance ratio is not 1 and packed and padded "
        "batches differ (model.lora.dropout is left as set)"
    )


def _zero_config(config: Any, prefix: str) -> list[str]:
    """Zero ``config``'s dropout fields (those of a config inside it too: a text config);
    returns them, ``name=value`` as they were."""
    found: list[str] = []
    if config is None or not hasattr(config, "to_dict"):
        return found
    for key, value in sorted(vars(config).items()):
        if _is_rate(key, value):
            setattr(config, key, 0.0)
            found.append(f"{prefix}{key}={value:g}")
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            found += _zero_config(value, f"{prefix}{key}.")
    return found


def update_mode(model: torch.nn.Module) -> None:
    """``model`` set for the update's passes: evaluation mode, in which they compute what the
    old log-probs' pass computes (training mode may draw at random beyond dropout: PhiMoE's
    router samples its experts, Mixtral's jitters its input), except LoRA's adapters' dropout
    (``model.lora.dropout``, a setting of the run), in training mode."""
    model.eval()
    for name, module in model.named_modules():
        if ".lora_dropout." in f".{name}.":
            module.train()
