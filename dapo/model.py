"""Per-token log-probs and entropy of given responses, with shared-prompt forward passes.

Shapes: B = responses, P = prompt tokens (left padded), T = response tokens (right padded).
"""

from __future__ import annotations

import contextlib

import torch

from dapo.algo import entropy_from_logits, token_logprobs_from_logits
from dapo.batch import Batch


def response_logprobs(
    model,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) for every response token, and optionally the entropy there.

    Position ids follow the attention mask, as ``generate`` builds them for left-padded prompts,
    so these log-probs are those the sampler saw. Only response positions go through the LM
    head: prompt logits are never needed.

    With ``share_prompts``, rows with the same prompt (a group's responses) share one forward
    pass of it: the distinct prompts run once, their KV cache is indexed out to every row, and
    the responses run on top. Gradients flow back through the cache (its indexing sums them
    over a group's rows), so values and gradients are those of the full forward, up to float
    rounding (tested); a group's prompt is computed once instead of G times.
    """
    args = (model, prompt_ids_BP, prompt_mask_BP, response_ids_BT, response_mask_BT)
    shared = _shared_prompt_pass(*args[:3]) if share_prompts else None
    if shared is None:  # no prompt repeats, or a cache that cannot be sliced by row
        return _full_forward(*args, temperature=temperature, with_entropy=with_entropy)
    prompt_out, inverse_B = shared
    cache = prompt_out.past_key_values
    cache.batch_select_indices(inverse_B)
    attn = torch.cat([prompt_mask_BP, response_mask_BT.to(prompt_mask_BP.dtype)], dim=1)
    num_resp = response_ids_BT.shape[1]
    start_B1 = prompt_mask_BP.long().sum(dim=1, keepdim=True)
    out = model(
        input_ids=response_ids_BT,
        attention_mask=attn,
        position_ids=start_B1 + torch.arange(num_resp, device=attn.device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=num_resp,
    )
    # The last prompt position predicts response token 0, response position t token t+1.
    first_B1V = prompt_out.logits[:, -1:][inverse_B]
    rest_BTV = out.logits[:, :-1]
    parts = [(first_B1V, response_ids_BT[:, :1]), (rest_BTV, response_ids_BT[:, 1:])]
    logps, entropies = [], []
    for logits, ids in parts:
        lp, ent = _scored(logits, ids, temperature=temperature, with_entropy=with_entropy)
        logps.append(lp)
        entropies.append(ent)
    entropy_BT = torch.cat(entropies, dim=1) if with_entropy else None
    return torch.cat(logps, dim=1), entropy_BT


def _shared_prompt_pass(model, prompt_ids_BP, prompt_mask_BP):
    """The distinct prompts' forward pass and each row's prompt index, or None when no prompt
    repeats or the cache cannot be indexed by row."""
    ids_NP, mask_NP, inverse_B = distinct_prompts(prompt_ids_BP, prompt_mask_BP)
    if ids_NP.shape[0] == prompt_ids_BP.shape[0]:
        return None
    out = model(
        input_ids=ids_NP,
        attention_mask=mask_NP,
        position_ids=(mask_NP.cumsum(dim=1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    if not row_sliceable(out.past_key_values):  # e.g. a recurrent-state cache
        return None
    return out, inverse_B


def distinct_prompts(prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor):
    """(ids [N, P], mask [N, P], row -> index [B]) of the distinct padded prompts of a batch."""
    width = prompt_ids_BP.shape[1]
    rows_NP, inverse_B = torch.unique(
        torch.cat([prompt_ids_BP, prompt_mask_BP.long()], dim=1), dim=0, return_inverse=True
    )
    return rows_NP[:, :width], rows_NP[:, width:], inverse_B


def row_sliceable(cache) -> bool:
    """Whether a KV cache holds only full per-row keys and values, so that repeating or
    indexing its batch dimension is exact (sliding windows, quantized layers and the recurrent
    states of hybrid models are left to the plain paths)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    return isinstance(cache, DynamicCache) and all(
        type(layer) is DynamicLayer for layer in cache.layers
    )


def _full_forward(
    model,
    prompt_ids_BP,
    prompt_mask_BP,
    response_ids_BT,
    response_mask_BT,
    *,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward pass over prompt and response together."""
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
    return _scored(
        out.logits[:, :-1], response_ids_BT, temperature=temperature, with_entropy=with_entropy
    )


def _scored(
    logits_BTV: torch.Tensor, ids_BT: torch.Tensor, *, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # No float() here: the log-prob and entropy functions upcast in chunks, so a bf16 model
    # never holds a float32 copy of [B, T, V].
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    logp_BT = token_logprobs_from_logits(logits_BTV, ids_BT)
    entropy_BT = None
    if with_entropy:
        with torch.no_grad():
            entropy_BT = entropy_from_logits(logits_BTV.detach())
    return logp_BT, entropy_BT


def batch_logprobs(
    model,
    batch: Batch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
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
        share_prompts=share_prompts,
    )


def forward_slots(b: Batch, *, shared: bool) -> tuple[float, float]:
    """(padded, real) token positions a micro-batch's forward pass computes; a shared prompt
    counts once."""
    prompts = b.prompt_mask_BP  # [B, P], or [N, P] over the N distinct prompts when shared
    if shared:
        _, prompts, _ = distinct_prompts(b.prompt_ids_BP, b.prompt_mask_BP)
    resp = b.response_mask_BT
    return float(prompts.numel() + resp.numel()), float(prompts.sum() + resp.sum())


def autocast(model: torch.nn.Module, compute_dtype: torch.dtype | None):
    """A context that runs ``model`` in ``compute_dtype`` (torch.autocast on its device) when
    its weights are another dtype: float32 master weights, bf16 matmuls. Nothing to do when
    they match, or when ``compute_dtype`` is None."""
    weights = next(model.parameters())
    if compute_dtype is None or weights.dtype == compute_dtype:
        return contextlib.nullcontext()
    return torch.autocast(weights.device.type, dtype=compute_dtype)
