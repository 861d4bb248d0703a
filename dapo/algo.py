"""The DAPO maths: pure tensor functions, no I/O, no config objects.

Every DAPO technique lives here once (Yu et al., 2025, arXiv 2503.14476; see
docs/dapo-spec.md):

- group-relative advantage (GRPO, DAPO §2.2)          -> ``group_advantages``
- Clip-Higher, decoupled eps_low / eps_high (§3.1)    -> ``policy_loss``
- dynamic sampling filter 0 < #correct < G (§3.2)     -> ``mixed_groups``
- token-level policy-gradient loss (§3.3)             -> ``aggregate`` / ``policy_loss``
- soft overlong punishment (§3.4)                     -> ``overlong_penalty``
- k3 KL estimator, used only by the GRPO baseline (DAPO §2.3 removes the KL) -> ``kl_k3``
- diagnostics and per-token log-probabilities         -> ``entropy_from_logits``,
                                                         ``token_logprobs_from_logits``

Shape-suffix legend for tensor names:

    B  responses (sequences) in the batch at hand
    T  response tokens (padded length)
    V  vocabulary size
    n  groups (prompts), one row per prompt
    G  group size, responses per prompt

So ``logp_BT`` is ``[B, T]`` and ``scores_nG`` is ``[n, G]``. A trailing ``1``
marks a broadcast dimension (``adv_B1``).
"""

import torch

__all__ = [
    "AGG_MODES",
    "aggregate",
    "entropy_from_logits",
    "group_advantages",
    "kl_k3",
    "mixed_groups",
    "overlong_penalty",
    "policy_loss",
    "token_logprobs_from_logits",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean")
"""Loss aggregations: DAPO's token-level mean (§3.3) and GRPO's sample-level mean."""

# exp() of a log-ratio beyond +-20 (a ratio of ~5e8 or ~2e-9) only happens on a
# pathological policy step; clamping keeps exp() and its backward finite, as verl does.
_LOG_RATIO_CLAMP = 20.0

# Upcasting bf16/fp16 logits to float32 is done this many elements at a time, so the
# float32 copy of a [B, T, V] tensor never exists in full (16M elements = 64 MiB).
_UPCAST_CHUNK_ELEMENTS = 1 << 24


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    # Counts in bf16 are exact only up to 256; statistics are kept in at least float32.
    return torch.promote_types(dtype, torch.float32)


def group_advantages(scores: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage of every response (GRPO, DAPO §2.2; spec "One training step").

        Â_i = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + eps)

    computed per row, with the unbiased standard deviation (``correction=1``,
    torch's default, as in the reference). The same Â_i is used for every token
    of response i.

    A constant group (all G rewards identical, which includes G = 1) gets exactly
    zero advantage: it carries no learning signal (DAPO §3.2). This is enforced
    explicitly, because floating-point ``mean`` of equal values need not equal
    them (three 0.1's average to 0.10000000000000002), and the unbiased std of a
    single element is NaN. Note that verl instead passes a lone response's raw
    score through for G = 1; here it is zero, consistently with the constant rule.

    Args:
        scores: rewards ``[n, G]``, one row per prompt.
        eps: added to the std so that near-constant groups do not blow up; >= 0.

    Returns:
        advantages ``[n, G]``, floating point.
    """
    if scores.ndim != 2:
        raise ValueError(f"scores must be [n_groups, G], got shape {tuple(scores.shape)}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    scores_nG = scores if scores.is_floating_point() else scores.to(torch.get_default_dtype())
    if scores_nG.shape[1] < 2:
        return torch.zeros_like(scores_nG)  # one response: no baseline, no signal
    is_constant_n1 = (scores_nG == scores_nG[:, :1]).all(dim=-1, keepdim=True)
    mean_n1 = scores_nG.mean(dim=-1, keepdim=True)
    std_n1 = scores_nG.std(dim=-1, keepdim=True)  # unbiased, correction=1
    adv_nG = (scores_nG - mean_n1) / (std_n1 + eps)
    # where(), not multiplication: with eps = 0 a constant group divides 0 by 0.
    return torch.where(is_constant_n1, torch.zeros_like(adv_nG), adv_nG)


def overlong_penalty(
    lengths: torch.Tensor, l_max: int, l_cache: int, factor: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment R_length (DAPO §3.4, spec "Overlong reward shaping").

        R_length(y) = 0                                    if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                   if |y| > L_max

    times ``factor`` (1.0 in the paper). The three cases are one clamp: the linear
    ramp is 0 at L_max - L_cache and -1 at L_max, so
    ``clamp(((L_max - L_cache) - |y|) / L_cache, -1, 0)`` equals the definition.
    Paper values: L_max = 20480, L_cache = 4096, so 16384 tokens are penalty-free.

    Args:
        lengths: response lengths in tokens ``[B]`` (integer or float).
        l_max: generation limit L_max.
        l_cache: length of the punishment buffer L_cache, 0 < l_cache <= l_max.
        factor: penalty factor, >= 0.

    Returns:
        penalties ``[B]`` in ``[-factor, 0]``: the default float dtype for integer
        lengths, else the dtype of ``lengths``.
    """
    if l_cache == 0:
        raise ValueError(
            "l_cache must be > 0: with no buffer there is nothing to shape; disable overlong "
            "shaping or use overlong filtering (mask truncated responses) instead"
        )
    if l_cache < 0 or l_cache > l_max:
        raise ValueError(f"need 0 < l_cache <= l_max, got l_cache={l_cache}, l_max={l_max}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0 (it scales a penalty), got {factor}")
    len_B = lengths if lengths.is_floating_point() else lengths.to(torch.get_default_dtype())
    ramp_B = ((l_max - l_cache) - len_B) / l_cache
    return ramp_B.clamp(min=-1.0, max=0.0) * factor


def mixed_groups(correct: torch.Tensor) -> torch.Tensor:
    """Groups that DAPO's dynamic sampling keeps (DAPO §3.2, spec "Dynamic sampling").

        keep_g  <=>  0 < |{o_i : correct}| < G

    A group whose responses are all correct or all wrong has zero advantage for
    every token and so no gradient. The filter is on correctness, not on the
    shaped reward.

    Args:
        correct: bool ``[n, G]``, whether each response's answer is correct.

    Returns:
        bool ``[n]``, True for the groups to keep.
    """
    if correct.dtype != torch.bool:
        raise ValueError(f"correct must be a bool tensor, got {correct.dtype}")
    if correct.ndim != 2:
        raise ValueError(f"correct must be [n_groups, G], got shape {tuple(correct.shape)}")
    num_correct_n = correct.sum(dim=-1)
    return (num_correct_n > 0) & (num_correct_n < correct.shape[1])


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token values ``[B, T]`` to a scalar loss over the masked tokens.

    ``agg="token-mean"`` (DAPO §3.3, token-level loss):

        L = Σ_i Σ_t mask_{i,t} · v_{i,t} / num_tokens

    ``num_tokens`` defaults to this batch's ``mask.sum()``. When a mini-batch is
    split into micro-batches and/or data-parallel ranks, pass the token count of
    the WHOLE mini-batch (summed over ranks) to every call: each micro-batch loss
    is then its share of the mini-batch loss, so the micro-batch losses add up to
    it and their gradients accumulate to exactly the one-batch gradient (spec
    "Token-level loss"). If the data-parallel wrapper *averages* gradients over
    ranks (DDP/FSDP default), the sum is divided by the world size; the caller
    undoes that (e.g. multiplies the loss by the world size).

    ``agg="seq-mean-token-mean"`` (GRPO sample-level loss, the ablation baseline):

        L = Σ_i ( Σ_t mask_{i,t} · v_{i,t} / Σ_t mask_{i,t} ) / num_seqs

    A sequence with no masked token contributes 0 (not NaN). ``num_seqs``
    defaults to B, this batch's number of rows, fully masked rows included (the
    plain mean over responses); pass the whole mini-batch's B for exact
    accumulation, or a count that excludes fully masked responses if they should
    not dilute the mean.

    Masked-out positions are removed with ``torch.where``, so inf/NaN there
    reaches neither the value nor the gradient. A batch with no masked token
    gives 0 with the default normalisers.

    Args:
        values: per-token values ``[B, T]`` (e.g. the per-token policy loss, the KL).
        mask: bool ``[B, T]``, True where a response token counts.
        agg: one of ``AGG_MODES``.
        num_tokens: token-mean divisor; a positive number or a (0-d) tensor.
        num_seqs: seq-mean-token-mean divisor; a positive number or a (0-d) tensor.

    Returns:
        0-d tensor.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    if values.ndim != 2 or values.shape != mask.shape:
        raise ValueError(
            f"values and mask must both be [B, T], got {tuple(values.shape)} and "
            f"{tuple(mask.shape)}"
        )
    for name, count in (("num_tokens", num_tokens), ("num_seqs", num_seqs)):
        # A tensor count is not checked: reading it would force a device sync.
        if isinstance(count, int | float) and count <= 0:
            raise ValueError(f"{name} must be > 0, got {count}")

    masked_BT = torch.where(mask, values, torch.zeros_like(values))
    if agg == "token-mean":
        if num_tokens is None:
            num_tokens = mask.sum().clamp(min=1)
        # DAPO §3.3: divide by Σ|o_i| of the whole mini-batch, not of this micro-batch.
        return masked_BT.sum() / num_tokens

    num_tokens_B = mask.sum(dim=-1)
    seq_mean_B = masked_BT.sum(dim=-1) / num_tokens_B.clamp(min=1)
    if num_seqs is None:
        num_seqs = max(values.shape[0], 1)
    return seq_mean_B.sum() / num_seqs


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    agg: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss -J_DAPO (DAPO §3.1 and §3.3, spec "The objective").

        r_{i,t}   = exp(logp_{i,t} - old_logp_{i,t})
        J_{i,t}   = min(r_{i,t} Â_{i,t}, clip(r_{i,t}, 1 - eps_low, 1 + eps_high) Â_{i,t})
        loss_{i,t} = -J_{i,t}

    reduced by ``aggregate`` (token-level mean for DAPO, §3.3; pass ``num_tokens``
    = the whole mini-batch's token count when accumulating micro-batches or
    ranks). Clip-Higher (§3.1) is ``eps_high > eps_low`` (paper 0.2 / 0.28); plain
    PPO/GRPO is ``eps_high == eps_low``. Where a clip is active the token's
    gradient is zero. No KL term: DAPO drops it (§2.3); the GRPO baseline adds
    ``aggregate(kl_k3(...))`` itself.

    Positions where ``mask`` is False never count and are excluded with
    ``torch.where`` before ``exp``, so -inf or garbage log-probabilities there give
    a finite loss and a zero (not NaN) gradient. The log-ratio is clamped to
    ±20 (see ``_LOG_RATIO_CLAMP``).

    Args:
        logprobs: current-policy log-probabilities of the response tokens ``[B, T]``.
        old_logprobs: rollout-policy log-probabilities ``[B, T]`` (no gradient needed).
        advantages: ``[B]`` (broadcast over T) or ``[B, T]``.
        mask: bool ``[B, T]``, True for response tokens that count.
        eps_low: lower clip range, ratio >= 1 - eps_low; >= 0.
        eps_high: upper clip range, ratio <= 1 + eps_high; >= 0.
        agg, num_tokens, num_seqs: see ``aggregate``.
        return_stats: also return diagnostics.

    Returns:
        the 0-d loss; with ``return_stats`` a pair ``(loss, stats)`` where ``stats``
        holds detached 0-d float tensors over this batch's masked tokens:
        ``clip_low_frac`` (Â < 0 and r < 1 - eps_low), ``clip_high_frac`` (Â > 0
        and r > 1 + eps_high), ``clip_high_prob_mean`` (mean old-policy probability
        of the tokens clipped at the upper bound, 0 if none: the paper's
        Clip-Higher diagnostic), ``ratio_mean``, ``num_tokens`` and
        ``num_clip_high``. To combine micro-batches, weight the fractions and
        ``ratio_mean`` by ``num_tokens`` and ``clip_high_prob_mean`` by
        ``num_clip_high``.
    """
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low} and {eps_high}")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            "logprobs, old_logprobs and mask must have the same [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape == logprobs.shape[:1]:
        adv_BT = advantages.unsqueeze(-1)  # [B, 1], the same Â_i for every token of o_i
    elif advantages.shape == logprobs.shape:
        adv_BT = advantages
    else:
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(logprobs.shape)}, "
            f"got {tuple(advantages.shape)}"
        )

    # where() first, so exp() never sees -inf - -inf = NaN at padding and no NaN can
    # flow back through the unselected branch.
    log_ratio_BT = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    log_ratio_BT = log_ratio_BT.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio_BT = torch.exp(log_ratio_BT)
    clipped_ratio_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    objective_BT = torch.minimum(ratio_BT * adv_BT, clipped_ratio_BT * adv_BT)
    loss = aggregate(-objective_BT, mask, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs)
    if not return_stats:
        return loss

    with torch.no_grad():
        dtype = _stats_dtype(logprobs.dtype)
        ratio_BT = ratio_BT.to(dtype)
        # The clip is "active" only where min() picks the clipped branch.
        clip_low_BT = mask & (adv_BT < 0) & (ratio_BT < 1.0 - eps_low)
        clip_high_BT = mask & (adv_BT > 0) & (ratio_BT > 1.0 + eps_high)
        num_tok = mask.sum().to(dtype)
        num_clip_high = clip_high_BT.sum().to(dtype)
        old_prob_BT = torch.exp(old_logprobs.to(dtype))
        zero_BT = torch.zeros_like(ratio_BT)
        stats = {
            "clip_low_frac": clip_low_BT.sum().to(dtype) / num_tok.clamp(min=1),
            "clip_high_frac": num_clip_high / num_tok.clamp(min=1),
            "clip_high_prob_mean": torch.where(clip_high_BT, old_prob_BT, zero_BT).sum()
            / num_clip_high.clamp(min=1),
            "ratio_mean": torch.where(mask, ratio_BT, zero_BT).sum() / num_tok.clamp(min=1),
            "num_tokens": num_tok,
            "num_clip_high": num_clip_high,
        }
    return loss, {name: value.detach() for name, value in stats.items()}


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref) (Schulman's approximator; GRPO baseline).

        d = log π_ref - log π_θ,    kl = exp(d) - d - 1  (>= 0)

    Unbiased for KL(π_θ ‖ π_ref) when tokens are sampled from π_θ, and never
    negative. DAPO itself uses no KL penalty (§2.3); the naive-GRPO ablation adds
    β · aggregate(kl_k3(...)). ``d`` is clamped to [-20, 20] so exp() cannot
    overflow on a diverged or garbage position (the gradient is zero beyond the
    clamp). Mask padding with ``aggregate``.

    Args:
        logprobs: current-policy log-probabilities ``[...]``.
        ref_logprobs: reference-policy log-probabilities, same shape.

    Returns:
        per-token KL estimates, same shape.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs and ref_logprobs shapes differ: {tuple(logprobs.shape)} vs "
            f"{tuple(ref_logprobs.shape)}"
        )
    d = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


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
    dtype = _stats_dtype(logits.dtype)
    vocab = logits.shape[-1]
    logits_NV = logits.reshape(-1, vocab)
    if logits_NV.shape[0] == 0:
        return logits_NV.new_zeros(logits.shape[:-1], dtype=dtype)
    # A block of rows at a time: the float32 temporaries of [B, T, V] would dwarf the logits.
    rows_per_block = max(1, _UPCAST_CHUNK_ELEMENTS // max(vocab, 1))
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
    dtype = _stats_dtype(logits.dtype)
    if dtype == logits.dtype:
        return picked_BT - torch.logsumexp(logits, dim=-1)

    vocab = logits.shape[-1]
    rows_per_block = max(1, _UPCAST_CHUNK_ELEMENTS // max(vocab, 1))
    logits_NV = logits.reshape(-1, vocab)
    if logits_NV.shape[0] == 0:
        return picked_BT.to(dtype)
    lse_N = torch.cat(
        [torch.logsumexp(block.to(dtype), dim=-1) for block in logits_NV.split(rows_per_block)]
    )
    return picked_BT.to(dtype) - lse_N.reshape(picked_BT.shape)
