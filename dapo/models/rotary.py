"""Rotary embeddings whose frequencies depend on the length of the forward pass, pinned.

transformers' ``dynamic`` (NTK) and ``longrope`` (Phi-3.5, Phi-4-mini) rotary embeddings
pick their frequencies in each forward call from the largest position in it: a row's
log-probs then depend on the other rows of its micro-batch (the longest sets everyone's),
on whether a group's prompt is computed apart (the shared-prompt forward: a shorter call),
and in decoding on how far the batch has come, so the gradient changed with the micro-batch
split and the update's ratio on unchanged weights was not 1. Here the frequencies are
chosen once, as a sequence of the model's whole context (``max_position_embeddings``) would
have them, and kept for every call: vLLM decides ``longrope``'s factors once from its
``max_model_len`` the same way. For ``dynamic`` that is the model's own frequencies for every
sequence within its context; for ``longrope`` with a context beyond its original one, the
long factors at every length.
"""

from __future__ import annotations

import torch

PINNED = "pinned"
"""The ``rope_type`` a pinned rotary embedding is left with: transformers' update, which
looks for ``dynamic`` and ``longrope`` there, leaves it alone."""


def length_dependent(kind: object) -> bool:
    """Whether a rotary embedding of ``rope_type`` ``kind`` changes with the call's length."""
    return isinstance(kind, str) and ("dynamic" in kind or kind == "longrope")


def pin(model: torch.nn.Module) -> str | None:
    """Pin every length-dependent rotary embedding of ``model`` (see the module's docstring);
    a line for the log saying what was pinned, or None when nothing was."""
    config = getattr(model, "config", None)
    context = getattr(config, "max_position_embeddings", None)
    pinned = []
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        if isinstance(kind, dict) and any(map(length_dependent, kind.values())):
            raise ValueError(
                f"the model's rotary embeddings per layer type ({kind}) change with the length "
                "of each forward pass, which dapo cannot keep the same for every row: use a "
                "model whose rope_parameters are not dynamic or longrope"
            )
        if not length_dependent(kind):
            continue
        if not isinstance(context, int) or context < 1:
            raise ValueError(
                f"rotary embeddings of type {kind!r} need the model's max_position_embeddings "
                "to be fixed once; its config has none"
            )
        inv_freq = module.inv_freq
        with torch.no_grad():  # transformers' own update, for a call that reaches the context
            module(
                inv_freq.new_zeros(1, 1, 1), torch.tensor([[context - 1]], device=inv_freq.device)
            )
        module.rope_type = PINNED
        pinned.append(kind)
    if not pinned:
        return None
    return (
        f"rotary embeddings: {', '.join(sorted(set(pinned)))} pinned at the model's context "
        f"({context} tokens), so that a row's log-probs do not depend on the others in its "
        "forward pass"
    )
