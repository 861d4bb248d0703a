"""Per-token log-probs and entropy of given responses, with shared-prompt forward passes.

Where the model's output head is a plain bias-free Linear (Llama, Mistral, Qwen2/3, SmolLM:
``PLAIN_HEAD_MODEL_TYPES``), the log-probs come from the hidden states through
``algo.token_logprobs_from_hidden``, a chunk of tokens at a time, forward and backward: the
``[B, T, V]`` logits never exist. Other heads (a bias, soft-capping) use the model's logits.

Shapes: B = responses, P = prompt tokens (left padded), T = response tokens (right padded),
H = hidden size, V = vocabulary; X is H or V (hidden states or logits).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch

from dapo import dist
from dapo.algo import entropy_from_logits, token_logprobs_from_hidden, token_logprobs_from_logits
from dapo.data.batch import Batch, Packing
from dapo.dist import fsdp
from dapo.models import packing as packed
from dapo.models import prompt_cache

# Model types whose causal-LM logits are exactly ``decoder(...) @ lm_head.weight.T``, read
# from their transformers forward. Others (Gemma2's soft-capping, Cohere's, Granite's or
# Falcon-H1's scaling, ...) take the model's own logits: a new type joins after its forward
# is read, never by default.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def output_head(model) -> torch.Tensor | None:
    """The output head's weight when logits are exactly ``decoder(...) @ weight.T``, else None.

    For a model sharded by FSDP this is the whole weight only while the model's own forward
    runs (its hooks gather the root's weights there): :func:`response_logprobs` asks for it
    inside :func:`dapo.dist.fsdp.within_forward`.
    """
    head = getattr(model, "get_output_embeddings", lambda: None)()
    decoder = getattr(model, "get_decoder", lambda: None)()
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    if decoder is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return head.weight


@functools.cache
def _cache_parameter(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_argument(module: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """The KV cache as ``module``'s forward takes it: ``cache=`` in transformers that renamed
    it (``past_key_values`` is deprecated there), ``past_key_values=`` before."""
    return {_cache_parameter(type(module)): cache}


def prompt_pass(
    model: torch.nn.Module, ids_nP: torch.Tensor, mask_nP: torch.Tensor, prefix: Any = None
) -> Any:
    """One forward pass over left-padded prompts (positions counted from each prompt's first
    token) that keeps the KV cache and the last position's logits: a rollout's prefill.
    ``prefix``: the KV cache of the first columns, already computed (a continued episode:
    :mod:`dapo.rollout.parking`); the pass then runs over the columns after them."""
    done = 0 if prefix is None else prefix.get_seq_length()
    extra = {} if prefix is None else cache_argument(model, prefix)
    return model(
        input_ids=ids_nP[:, done:],
        attention_mask=mask_nP,
        position_ids=(mask_nP.long().cumsum(dim=1) - 1).clamp(min=0)[:, done:],
        use_cache=True,
        logits_to_keep=1,
        **extra,
    )


def returned_cache(out: Any) -> Any:
    """The KV cache a forward returned, under either name; None when it returned none.
    Looked up among the keys the output really has: asking the output itself for
    ``past_key_values`` (``in``, ``get``) makes transformers 5.2x log that it is deprecated."""
    keys = out.keys()
    for name in ("cache", "past_key_values"):
        if name in keys:
            return out[name]
    return None


def _forward(
    model, head: torch.Tensor | None, *, keep: int | torch.Tensor, cache: Any = None, **kwargs
):
    """(hidden states or logits [B, keep, X] of the last ``keep`` positions, or of the
    positions ``keep`` lists, the KV cache). ``model`` is the module, or (under FSDP) its own
    forward, called from inside its hooks."""
    module = getattr(model, "__self__", model)  # the module of a bound forward
    if head is None:
        out = model(**kwargs, **cache_argument(module, cache), logits_to_keep=keep)
        return out.logits, returned_cache(out)
    decoder = module.get_decoder()
    out = decoder(**kwargs, **cache_argument(decoder, cache))
    states = out.last_hidden_state
    return states[:, keep] if torch.is_tensor(keep) else states[:, -keep:], returned_cache(out)


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
    prompts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    packing: Packing | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) for every response token, and optionally the entropy there.

    Position ids follow the attention mask, as ``generate`` builds them for left-padded prompts,
    so these log-probs are those the sampler saw. Only response positions go through the LM
    head: prompt logits are never needed.

    With ``share_prompts``, rows with the same prompt (a group's responses) share one forward
    pass of it: the distinct prompts run once, their KV cache is indexed out to every row, and
    the responses run on top. Gradients flow back through the cache (its indexing sums them
    over a group's rows), so values and gradients are those of the full forward, up to float
    rounding (tested); a group's prompt is computed once instead of G times. ``prompts``: the
    distinct prompts as :func:`distinct_prompts` gives them, found on the host beforehand
    (:func:`dapo.data.batch.collate`); without them they are found here, on the device,
    where the size of ``torch.unique``'s output is a read back to the host.

    A model sharded by FSDP runs all of this inside its own forward (:func:`fsdp.within_forward`),
    where its hooks have gathered the head: the chunked head and the shared prompt work there
    as in one process.

    With ``packing`` (``train.packing``: the model attends through
    :func:`dapo.models.packing.packed_attention`) the rows run laid end to end, with no
    padding, a group's prompt once, in one forward pass. Padding positions get 0.
    """
    args = (prompt_ids_BP, prompt_mask_BP, response_ids_BT, response_mask_BT)
    options = dict(temperature=temperature, with_entropy=with_entropy, share_prompts=share_prompts)
    options |= dict(prompts=prompts, packing=packing)
    if fsdp.is_sharded(model):
        return fsdp.within_forward(model, lambda fwd: _owned(_logprobs(fwd, *args, **options)))
    return _logprobs(model, *args, **options)


def _owned(pair: tuple[torch.Tensor, torch.Tensor | None]):
    """Tensors that are not views ([B, T]: cheap): FSDP hooks the backward of what a forward
    returns, and an in-place change of a view would bypass that hook."""
    return tuple(None if t is None else t.clone() if t._is_view() else t for t in pair)


def _logprobs(
    model,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    share_prompts: bool,
    prompts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    packing: Packing | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`response_logprobs` of ``model``: the module, or its forward inside FSDP's hooks."""
    module = getattr(model, "__self__", model)
    head = output_head(module)
    if packing is not None:
        ids = (prompt_ids_BP, response_ids_BT)
        return _packed_forward(model, head, *ids, packing, temperature, with_entropy)
    args = (model, head, prompt_ids_BP, prompt_mask_BP, response_ids_BT, response_mask_BT)
    sharded = fsdp.is_sharded(module)
    shared = None
    if share_prompts and response_ids_BT.shape[1]:  # responses all empty: nothing to share
        shared = _shared_prompt_pass(*args[:4], sharded=sharded, prompts=prompts)
    if shared is None:  # no prompt repeats, or a cache that cannot be sliced by row
        return _full_forward(*args, temperature=temperature, with_entropy=with_entropy)
    prompt_states_N1X, cache, inverse_B = shared
    attn = torch.cat([prompt_mask_BP, response_mask_BT.to(prompt_mask_BP.dtype)], dim=1)
    num_resp = response_ids_BT.shape[1]
    start_B1 = prompt_mask_BP.long().sum(dim=1, keepdim=True)
    rest_BTX, _ = _forward(
        model,
        head,
        keep=num_resp,
        input_ids=response_ids_BT,
        attention_mask=attn,
        position_ids=start_B1 + torch.arange(num_resp, device=attn.device),
        cache=prompt_cache.prefix_cache(cache, inverse_B),
        use_cache=True,
    )
    # The last prompt position predicts response token 0, response position t token t+1.
    first_B1X, rest_BTX = prompt_states_N1X[inverse_B], rest_BTX[:, :-1]
    if head is not None:  # hidden states: joined, then one chunked pass through the head
        states_BTX = torch.cat([first_B1X, rest_BTX], dim=1)
        return _scored(states_BTX, response_ids_BT, head, temperature, with_entropy)
    # Logits are scored apart: joining them would copy [B, T, V].
    first = _scored(first_B1X, response_ids_BT[:, :1], None, temperature, with_entropy)
    rest = _scored(rest_BTX, response_ids_BT[:, 1:], None, temperature, with_entropy)
    entropy_BT = torch.cat([first[1], rest[1]], dim=1) if with_entropy else None
    return torch.cat([first[0], rest[0]], dim=1), entropy_BT


def _shared_prompt_pass(
    model, head, prompt_ids_BP, prompt_mask_BP, *, sharded: bool = False, prompts=None
):
    """The distinct prompts' last states [N, 1, X], their KV cache and each row's prompt
    index, or None when no prompt repeats or the cache cannot be indexed by row. The cache's
    layers are then :func:`prompt_cache.recorded`: a layer recomputed in backward (activation
    checkpointing) hands back its keys instead of appending them again.

    A ``sharded`` model's forward is a collective: every rank must make the same calls, so the
    ranks share prompts where any of them has one that repeats (one scalar all-reduce). Not
    everywhere: FSDP2 reduce-scatters a layer's gradient after the backward of each call, so
    the two passes cost two reduce-scatters where gradients are synchronised."""
    ids_NP, mask_NP, inverse_B = prompts or distinct_prompts(prompt_ids_BP, prompt_mask_BP)
    repeats = ids_NP.shape[0] < prompt_ids_BP.shape[0]
    if not (dist.any_rank(repeats) if sharded else repeats):
        return None
    states_N1X, cache = _forward(
        model,
        head,
        keep=1,
        input_ids=ids_NP,
        attention_mask=mask_NP,
        position_ids=(mask_NP.cumsum(dim=1) - 1).clamp(min=0),
        use_cache=True,
    )
    if not row_sliceable(cache):  # e.g. a recurrent-state cache
        return None
    prompt_cache.recorded(cache)
    return states_N1X, cache, inverse_B


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
    head,
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
    states_BTX, _ = _forward(
        model,
        head,
        keep=response_ids_BT.shape[1] + 1,
        input_ids=ids,
        attention_mask=attn,
        position_ids=position_ids,
        use_cache=False,
    )
    # Position P-1+t predicts response token t; the last position predicts past the end.
    return _scored(states_BTX[:, :-1], response_ids_BT, head, temperature, with_entropy)


def _packed_forward(model, head, prompt_ids_BP, response_ids_BT, packing, temperature, entropy):
    """One forward pass over the rows laid end to end; the outputs that predict response
    tokens are scored, and put back at their ``[B, T]`` places."""
    B, T = response_ids_BT.shape
    ids_1N = torch.cat([prompt_ids_BP, response_ids_BT], dim=1).flatten()[packing.index_N][None]
    with packed.packed_pass(ids_1N.shape[1], model):
        states_1RX, _ = _forward(
            model,
            head,
            keep=packing.states_R,
            input_ids=ids_1N,
            position_ids=packing.positions_N[None],
            packed_groups=packed.Layout(packing.groups),
            use_cache=False,
        )
    targets_1R = response_ids_BT.flatten()[packing.response_R][None]
    scored = _scored(states_1RX, targets_1R, head, temperature, entropy)
    place = (packing.response_R,)
    return tuple(
        None if v is None else v.new_zeros(B * T).index_put(place, v[0]).view(B, T) for v in scored
    )


def _scored(
    states_BTX: torch.Tensor,
    ids_BT: torch.Tensor,
    head: torch.Tensor | None,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropies from hidden states through ``head`` (in bounded memory), or
    from the model's logits when it has no plain head."""
    if head is not None:
        B, T, H = states_BTX.shape
        logp_N, entropy_N = token_logprobs_from_hidden(
            states_BTX.reshape(B * T, H),
            head,
            ids_BT.reshape(B * T),
            temperature=temperature,
            with_entropy=with_entropy,
        )
        entropy_BT = entropy_N.reshape(B, T) if entropy_N is not None else None
        return logp_N.reshape(B, T), entropy_BT
    # No float() here: the log-prob and entropy functions upcast in chunks, so a bf16 model
    # never holds a float32 copy of [B, T, V] (the model's own logits exist, though).
    logits_BTV = states_BTX / temperature if temperature != 1.0 else states_BTX
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
    """:func:`response_logprobs` of a collated :class:`~dapo.data.batch.Batch`."""
    return response_logprobs(
        model,
        batch.prompt_ids_BP,
        batch.prompt_mask_BP,
        batch.response_ids_BT,
        batch.response_mask_BT,
        temperature=temperature,
        with_entropy=with_entropy,
        share_prompts=share_prompts,
        prompts=batch.distinct_prompts,
        packing=batch.packing,
    )


def forward_slots(b: Batch, *, shared: bool) -> tuple[float, torch.Tensor]:
    """(padded, real) token positions a micro-batch's forward pass computes, a shared prompt
    counted once: the padded count a number, the real one a 0-d tensor where ``b`` is (not
    read back: the caller sums it on the device)."""
    if b.packing is not None:  # nothing padded, no prompt shared
        tokens = float(b.packing.tokens)
        # A fill on the device: new_tensor would copy the number from the host, and a copy
        # from pageable memory makes the host wait for the queue (dapo.data.transfer).
        device = b.response_mask_BT.device
        return tokens, torch.full((), tokens, dtype=torch.float64, device=device)
    prompts = b.prompt_mask_BP  # [B, P], or [N, P] over the N distinct prompts when shared
    if shared:
        found = b.distinct_prompts or distinct_prompts(b.prompt_ids_BP, b.prompt_mask_BP)
        prompts = found[1]
    resp = b.response_mask_BT
    return float(prompts.numel() + resp.numel()), prompts.sum() + resp.sum()


def autocast(
    model: torch.nn.Module, compute_dtype: torch.dtype | None, device: torch.device | None = None
):
    """A context that runs ``model`` in ``compute_dtype`` (torch.autocast on ``device``, the
    run's compute device; default: where its weights are) when its weights are another dtype:
    float32 master weights, bf16 matmuls. Nothing to do when they match, or when
    ``compute_dtype`` is None. The device matters: CPU-offloaded weights are on the CPU while
    the GPU computes, and autocast on the CPU would leave the GPU's matmuls in float32."""
    weights = next(model.parameters())
    if compute_dtype is None or weights.dtype == compute_dtype:
        return contextlib.nullcontext()
    return torch.autocast((device or weights.device).type, dtype=compute_dtype)
