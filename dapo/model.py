"""Load the policy and tokenizer; per-token log-probs and entropy of given responses.

Shapes: B = responses, P = prompt tokens (left padded), T = response tokens (right padded).
"""

from __future__ import annotations

import torch

from dapo.algo import entropy_from_logits, token_logprobs_from_logits
from dapo.batch import Batch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def response_logprobs(
    model,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) for every response token, and optionally the entropy there.

    Position ids follow the attention mask, as ``generate`` builds them for left-padded prompts,
    so these log-probs are those the sampler saw. Only the T+1 last positions go through the
    LM head: prompt logits are never needed.
    """
    ids = torch.cat([prompt_ids_BP, response_ids_BT], dim=1)
    attn = torch.cat([prompt_mask_BP, response_mask_BT.to(prompt_mask_BP.dtype)], dim=1)
    position_ids = (attn.long().cumsum(dim=1) - 1).clamp(min=0)
    num_resp = response_ids_BT.shape[1]
    out = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=position_ids,
        logits_to_keep=num_resp + 1,
        use_cache=False,
    )
    # Position P-1+t predicts response token t; the last position predicts past the end.
    # No float() here: the log-prob and entropy functions upcast in chunks, so a bf16 model
    # never holds a float32 copy of [B, T, V].
    logits_BTV = out.logits[:, :-1]
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    logp_BT = token_logprobs_from_logits(logits_BTV, response_ids_BT)
    entropy_BT = None
    if with_entropy:
        with torch.no_grad():
            entropy_BT = entropy_from_logits(logits_BTV.detach())
    return logp_BT, entropy_BT


def batch_logprobs(
    model, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_logprobs` of a collated :class:`~dapo.batch.Batch`."""
    return response_logprobs(
        model,
        batch.prompt_ids_BP,
        batch.prompt_mask_BP,
        batch.response_ids_BT,
        batch.response_mask_BT,
        temperature=temperature,
        with_entropy=with_entropy,
    )
