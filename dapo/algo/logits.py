"""Per-token log-probabilities and entropy from logits, memory-aware in bf16/fp16.

Shape suffixes: see :mod:`dapo.algo`.
"""

import torch

# Upcasting bf16/fp16 logits to float32 is done this many elements at a time, so the
# float32 copy of a [B, T, V] tensor never exists in full (16M elements = 64 MiB).
UPCAST_CHUNK_ELEMENTS = 1 << 24


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: counts in bf16 are exact only up to 256, and sums over a large V
    need the precision."""
    return torch.promote_types(dtype, torch.float32)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) at every position (the paper's entropy diagnostic).

        H = -Σ_v p_v log p_v,    p = softmax(logits)

    Computed from ``log_softmax`` for stability. Tokens with p_v = 0 (logit -inf,
    e.g. a masked vocabulary entry) contribute 0: their log p is replaced by 0
    with ``torch.where`` before the product, so neither 0 · (-inf) in the forward
    pass nor in the backward pass makes a NaN. bf16/fp16 logits are upcast to
    float32 (the sum over a large V needs it) a block of rows at a time, and the
    result is float32.

    Args:
        logits: ``[..., V]``.

    Returns:
        entropies ``[...]``.
    """
    dtype = stats_dtype(logits.dtype)
    vocab = logits.shape[-1]
    logits_NV = logits.reshape(-1, vocab)
    if logits_NV.shape[0] == 0:
        return logits_NV.new_zeros(logits.shape[:-1], dtype=dtype)
    # A block of rows at a time: the float32 temporaries of [B, T, V] would dwarf the logits.
    rows_per_block = max(1, UPCAST_CHUNK_ELEMENTS // max(vocab, 1))
    out = []
    for block in logits_NV.split(rows_per_block):
        logp_V = torch.log_softmax(block.to(dtype), dim=-1)
        p_V = torch.exp(logp_V)
        safe_logp_V = torch.where(p_V > 0, logp_V, torch.zeros_like(logp_V))
        out.append(-(p_V * safe_logp_V).sum(dim=-1))
    return torch.cat(out).reshape(logits.shape[:-1])


def token_logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] at every position.

        log p(o_t) = logits[o_t] - logsumexp(logits)

    The gather-then-logsumexp form never materialises a full ``[B, T, V]``
    log_softmax copy. bf16/fp16 logits are upcast to float32 a block of rows at
    a time (log-probabilities and their ratios need float32 precision) and the
    result is float32; float32/float64 logits keep their dtype.

    Args:
        logits: ``[B, T, V]`` (any leading shape ``[...]``).
        tokens: long ``[B, T]`` (the same leading shape), the token ids to score.

    Returns:
        log-probabilities ``[B, T]``.
    """
    if tokens.dtype != torch.long:
        raise ValueError(f"tokens must be a long tensor, got {tokens.dtype}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits [..., V] and tokens [...] disagree: {tuple(logits.shape)} vs "
            f"{tuple(tokens.shape)}"
        )
    picked_BT = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    dtype = stats_dtype(logits.dtype)
    if dtype == logits.dtype:
        return picked_BT - torch.logsumexp(logits, dim=-1)

    vocab = logits.shape[-1]
    rows_per_block = max(1, UPCAST_CHUNK_ELEMENTS // max(vocab, 1))
    logits_NV = logits.reshape(-1, vocab)
    if logits_NV.shape[0] == 0:
        return picked_BT.to(dtype)
    lse_N = torch.cat(
        [torch.logsumexp(block.to(dtype), dim=-1) for block in logits_NV.split(rows_per_block)]
    )
    return picked_BT.to(dtype) - lse_N.reshape(picked_BT.shape)


def token_sums(
    entropy_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Sums over the tokens of ``mask_BT``: the policy's entropy, and the probability the
    sampling policy gave each token (divided by the token count, the paper's entropy and
    mean-probability curves).

    Returns:
        ``{"entropy_sum": 0-d, "prob_sum": 0-d}``.
    """
    return {
        "entropy_sum": entropy_BT[mask_BT].sum(),
        "prob_sum": old_logprobs_BT.exp()[mask_BT].sum(),
    }


def max_abs_gap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """max |a - b| over every element (0 for empty tensors): how far the sampler's log-probs
    are from a forward pass's.

    Returns:
        0-d tensor.
    """
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return a.new_zeros(())
    return (a - b).abs().amax()
