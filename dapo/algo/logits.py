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
    entropy_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    index_N: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Sums over the tokens of ``mask_BT``: the policy's entropy, and the probability the
    sampling policy gave each token (divided by the token count, the paper's entropy and
    mean-probability curves).

    ``index_N``: the flat (row-major) positions of ``mask_BT``'s tokens, when the caller knows
    them. Selecting by a bool mask sizes its output by the data (a ``nonzero``, which on a GPU
    waits for every queued kernel); selecting by known positions does not, and sums the same
    values in the same order.

    Returns:
        ``{"entropy_sum": 0-d, "prob_sum": 0-d}``.
    """
    if index_N is None:
        return {
            "entropy_sum": entropy_BT[mask_BT].sum(),
            "prob_sum": old_logprobs_BT.exp()[mask_BT].sum(),
        }
    return {
        "entropy_sum": entropy_BT.flatten()[index_N].sum(),
        "prob_sum": old_logprobs_BT.exp().flatten()[index_N].sum(),
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


HEAD_CHUNK_ELEMENTS = 1 << 26
"""Logits computed at once by ``token_logprobs_from_hidden``: 2**26 = 256 MiB in float32,
about 440 tokens at a 152k vocabulary, whatever the sequence length."""


def token_logprobs_from_hidden(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    tokens_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(h W^T / T)[token] at every position, and optionally the entropy there,
    without the ``[N, V]`` logits ever existing in full.

    The output head runs a chunk of ``chunk_tokens`` positions at a time (default: as many as
    fit ``HEAD_CHUNK_ELEMENTS``); each chunk's logits are upcast to float32, reduced to the
    log-prob of its token (and the entropy) and dropped. Backward recomputes them chunk by
    chunk, d log p(o) / d logits = onehot(o) - softmax, so memory grows with the chunk, not
    with the sequence: at 32k tokens x 152k vocabulary the float32 logits alone are 20 GB.
    Under autocast the head's matmul runs in the autocast dtype, as an autocast Linear would.

    Args:
        hidden_NH: the decoder's output ``[N, H]`` at the positions that predict ``tokens``.
        weight_VH: the output head's weight ``[V, H]`` (a bias-free Linear).
        tokens_N: long ``[N]``.
        temperature: logits are divided by it.
        with_entropy: also the entropy of softmax(h W^T / T) at each position (no gradient).

    Returns:
        ``(logp_N, entropy_N or None)``, float32 (float64 for float64 inputs).
    """
    if tokens_N.dtype != torch.long or tokens_N.shape != hidden_NH.shape[:1]:
        raise ValueError(
            f"tokens must be a long [N] tensor for hidden [N, H] = {tuple(hidden_NH.shape)}, "
            f"got {tokens_N.dtype} {tuple(tokens_N.shape)}"
        )
    device_type = hidden_NH.device.type
    compute = torch.promote_types(hidden_NH.dtype, weight_VH.dtype)
    if torch.is_autocast_enabled(device_type):
        compute = torch.get_autocast_dtype(device_type)
    chunk = chunk_tokens or max(1, HEAD_CHUNK_ELEMENTS // max(weight_VH.shape[0], 1))
    with torch.autocast(device_type, enabled=False):
        logp_N, entropy_N = _ChunkedHead.apply(
            hidden_NH, weight_VH, tokens_N, temperature, chunk, with_entropy, compute
        )
    return logp_N, entropy_N if with_entropy else None


class _ChunkedHead(torch.autograd.Function):
    """Log-probs of an output head, a chunk of positions at a time, recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, tokens_N, temperature, chunk, with_entropy, compute):
        out_dtype = stats_dtype(compute)
        num = hidden_NH.shape[0]
        logp_N = hidden_NH.new_empty(num, dtype=out_dtype)
        lse_N = hidden_NH.new_empty(num, dtype=out_dtype)
        entropy_N = hidden_NH.new_zeros(num if with_entropy else 0, dtype=out_dtype)
        weight = weight_VH.to(compute)
        for start in range(0, num, chunk):
            end = min(start + chunk, num)
            logits = _chunk_logits(hidden_NH[start:end], weight, temperature, out_dtype)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, tokens_N[start:end, None]).squeeze(1)
            logp_N[start:end], lse_N[start:end] = picked - lse, lse
            if with_entropy:  # H = lse - sum p * logits
                probs = torch.exp(logits - lse[:, None])
                entropy_N[start:end] = lse - (probs * logits).sum(dim=-1)
        ctx.save_for_backward(hidden_NH, weight_VH, tokens_N, lse_N)
        ctx.temperature, ctx.chunk, ctx.compute = temperature, chunk, compute
        ctx.mark_non_differentiable(entropy_N)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, _grad_entropy_N):
        hidden_NH, weight_VH, tokens_N, lse_N = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden_NH) if need_hidden else None
        grad_weight = torch.zeros_like(weight_VH, dtype=lse_N.dtype) if need_weight else None
        weight = weight_VH.to(ctx.compute)
        for start in range(0, hidden_NH.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden_NH.shape[0])
            logits = _chunk_logits(hidden_NH[start:end], weight, ctx.temperature, lse_N.dtype)
            grad = grad_logp_N[start:end, None]
            # d logp / d logits = onehot(token) - softmax, times the incoming gradient, / T;
            # in place on the chunk's fresh logits, so it holds one [chunk, V] buffer.
            grad_logits = logits.sub_(lse_N[start:end, None]).exp_().mul_(-grad)
            grad_logits.scatter_add_(1, tokens_N[start:end, None], grad)
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            grad_logits = grad_logits.to(ctx.compute)
            if need_hidden:
                grad_hidden[start:end] = (grad_logits @ weight).to(hidden_NH.dtype)
            if need_weight:
                add_product(grad_weight, grad_logits.T, hidden_NH[start:end].to(ctx.compute))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VH.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def add_product(acc_VH: torch.Tensor, a_VC: torch.Tensor, b_CH: torch.Tensor) -> None:
    """``acc += a @ b`` in place, without a ``[V, H]`` temporary where the hardware allows.

    The head's weight gradient is summed over chunks in the weight's dtype (float32 master
    weights) from products in the compute dtype. On CUDA, cuBLAS writes a bf16/fp16 product's
    float32 sum straight into the accumulator (``addmm``'s ``out_dtype``): no half-precision
    ``[V, H]`` product, no cast, no separate add, and no rounding of each chunk's product to
    half precision (2.1 against 3.3 ms a chunk at 152k x 1536 on an H100). Elsewhere: the
    product, cast, then added."""
    if acc_VH.dtype == a_VC.dtype:
        acc_VH.addmm_(a_VC, b_CH)
    elif acc_VH.is_cuda and acc_VH.dtype == torch.float32:
        torch.addmm(acc_VH, a_VC, b_CH, out_dtype=torch.float32, out=acc_VH)
    else:
        acc_VH += (a_VC @ b_CH).to(acc_VH.dtype)


def _chunk_logits(hidden, weight, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """A fresh [chunk, V] tensor of logits / temperature in ``dtype`` (safe to change in place)."""
    logits = (hidden.to(weight.dtype) @ weight.T).to(dtype)
    return logits.div_(temperature) if temperature != 1.0 else logits
