"""The objective: token- or sample-level aggregation, the clipped policy loss, the k3 KL.

DAPO §3.1 (Clip-Higher, decoupled eps_low / eps_high) and §3.3 (token-level loss: divide by
the token count of the whole mini-batch, passed in). Shape suffixes: see :mod:`dapo.algo`.
"""

import torch

from dapo.algo.logits import stats_dtype
from dapo.algo.variants import AGGREGATIONS, OBJECTIVES, RATIOS, lookup

AGG_MODES = tuple(AGGREGATIONS)
"""Loss aggregations: DAPO's token-level mean (§3.3), GRPO's sample-level mean, and Dr. GRPO's
sum over each response divided by a constant (the generation budget L_max)."""
RATIO_LEVELS = tuple(RATIOS)
"""The importance ratio per token (PPO, GRPO, DAPO) or per response (GSPO)."""
LOSS_FNS = tuple(OBJECTIVES)
"""The clipped surrogate (PPO, DAPO) or CISPO's clipped, stop-gradient weight on log pi."""

# exp() of a log-ratio beyond +-20 (a ratio of ~5e8 or ~2e-9) only happens on a
# pathological policy step; clamping keeps exp() and its backward finite, as verl does.
LOG_RATIO_CLAMP = 20.0
# A k3 estimate above this is capped, as the reference does (its clamp to [-10, 10]; k3 is
# never negative): one diverged token must not dominate the KL term.
KL_CLAMP = 10.0


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_len: int | float | None = None,
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

    ``agg="seq-mean-token-sum-norm"`` (Dr. GRPO, Liu et al. 2025: no length bias):

        L = Σ_i ( Σ_t mask_{i,t} · v_{i,t} / norm_len ) / num_seqs

    with ``norm_len`` a constant (the generation budget L_max), the same for every response.

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
        num_seqs: the seq-mean divisor; a positive number or a (0-d) tensor.
        norm_len: seq-mean-token-sum-norm's constant per-response divisor; > 0, required there.

    Returns:
        0-d tensor.
    """
    reduce = lookup(AGGREGATIONS, agg, "agg")
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
    return reduce(masked_BT, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float = 0.0,
    weights: torch.Tensor | None = None,
    ratio_level: str = "token",
    loss_fn: str = "clip",
    agg: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_len: int | float | None = None,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss -J_DAPO (DAPO §3.1 and §3.3, spec "The objective").

        r_{i,t}   = exp(logp_{i,t} - old_logp_{i,t})
        J_{i,t}   = min(r_{i,t} Â_{i,t}, clip(r_{i,t}, 1 - eps_low, 1 + eps_high) Â_{i,t})
        loss_{i,t} = -J_{i,t}

    The ratio, the objective and the aggregation are looked up by name
    (``ratio_level``, ``loss_fn``, ``agg``) in :mod:`dapo.algo.variants`, reduced by
    ``aggregate`` (token-level mean for DAPO, §3.3; pass ``num_tokens``
    = the whole mini-batch's token count when accumulating micro-batches or
    ranks). Clip-Higher (§3.1) is ``eps_high > eps_low`` (paper 0.2 / 0.28); plain
    PPO/GRPO is ``eps_high == eps_low``. Where a clip is active the token's
    gradient is zero. No KL term: DAPO drops it (§2.3); the GRPO baseline adds
    ``aggregate(kl_k3(...))`` itself.

    Dual-clip (``clip_ratio_c`` = c > 1, as in the reference's recipe; 0 = off) bounds what
    a token with a negative advantage can contribute, however far its ratio has grown over
    the mini-batches of a step:

        J_{i,t} = max(J_{i,t}, c Â_{i,t})   where Â_{i,t} < 0,   so loss_{i,t} <= -c Â_{i,t}

    with zero gradient where the bound is active. Positive advantages are unaffected.

    Rollout correction (``weights`` = w, from :func:`dapo.algo.correction.rollout_correction`
    when the sampling engine's log-probs are not pi_old's) multiplies each token's term,
    without gradient and without changing the divisor:

        loss_{i,t} = -w_{i,t} J_{i,t}

    GSPO (``ratio_level="sequence"``, Zheng et al. 2025) replaces each token's log-ratio by its
    response's mean, length-normalised, so that the clip keeps or drops whole responses:

        log s_i = (1/|o_i|) Σ_t (logp_{i,t} - old_logp_{i,t}),
        log r_{i,t} = sg(log s_i) + logp_{i,t} - sg(logp_{i,t})   (GSPO-token: value s_i)

    whose gradient is s_i ∇logp_{i,t} on every token of o_i; its paper clips at 3e-4 / 4e-4.

    CISPO (``loss_fn="cispo"``, MiniMax-M1 2025) never drops a token's gradient: the clipped
    ratio becomes a stop-gradient weight on the log-probability,

        J_{i,t} = sg(clip(r_{i,t}, 1 - eps_low, 1 + eps_high)) Â_{i,t} logp_{i,t}

    (its paper sets no lower bound: ``eps_low = 1``). Where no clip is active, its gradient is
    the clipped surrogate's: r Â ∇logp. Dual-clip does not apply to it.

    Positions where ``mask`` is False never count and are excluded with
    ``torch.where`` before ``exp``, so -inf or garbage log-probabilities there give
    a finite loss and a zero (not NaN) gradient. The log-ratio is clamped to
    ±20 (see ``LOG_RATIO_CLAMP``).

    Args:
        logprobs: current-policy log-probabilities of the response tokens ``[B, T]``.
        old_logprobs: rollout-policy log-probabilities ``[B, T]`` (no gradient needed).
        advantages: ``[B]`` (broadcast over T) or ``[B, T]``.
        mask: bool ``[B, T]``, True for response tokens that count.
        eps_low: lower clip range, ratio >= 1 - eps_low; >= 0.
        eps_high: upper clip range, ratio <= 1 + eps_high; >= 0.
        clip_ratio_c: the dual-clip bound c for negative advantages; 0 (off) or > 1.
        weights: per-token loss weights ``[B, T]`` (no gradient), or None (all 1).
        ratio_level: one of ``RATIO_LEVELS``.
        loss_fn: one of ``LOSS_FNS``.
        agg, num_tokens, num_seqs, norm_len: see ``aggregate``.
        return_stats: also return diagnostics.

    Returns:
        the 0-d loss; with ``return_stats`` a pair ``(loss, stats)`` where ``stats``
        holds detached 0-d float tensors over this batch's masked tokens:
        ``clip_low_frac`` (Â < 0 and r < 1 - eps_low), ``clip_high_frac`` (Â > 0
        and r > 1 + eps_high; for CISPO, Â ≠ 0 on either side: its weight is capped
        whatever Â's sign), ``clip_high_prob_mean`` (mean old-policy probability
        of the tokens clipped at the upper bound, 0 if none: the paper's
        Clip-Higher diagnostic), ``dual_clip_frac`` (Â < 0 and the dual-clip bound
        active), ``ratio_mean``, ``num_tokens`` and ``num_clip_high``. To combine
        micro-batches, weight the fractions and ``ratio_mean`` by ``num_tokens`` and
        ``clip_high_prob_mean`` by ``num_clip_high``.
    """
    adv_BT = _checked(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, clip_ratio_c)
    if ratio_level not in RATIOS or loss_fn not in OBJECTIVES:
        raise ValueError(
            f"ratio_level must be one of {RATIO_LEVELS} and loss_fn one of {LOSS_FNS}, got "
            f"{ratio_level!r} and {loss_fn!r}"
        )
    log_ratio_BT = RATIOS[ratio_level](logprobs, old_logprobs, mask)
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    objective_BT, dual_BT = OBJECTIVES[loss_fn](
        ratio_BT,
        adv_BT,
        logprobs,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        clip_ratio_c=clip_ratio_c,
    )
    if weights is not None:
        if weights.shape != mask.shape:
            raise ValueError(
                f"weights must be [B, T] = {tuple(mask.shape)}, got {tuple(weights.shape)}"
            )
        objective_BT = objective_BT * weights.detach()
    loss = aggregate(
        -objective_BT, mask, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len
    )
    if not return_stats:
        return loss

    dtype = stats_dtype(logprobs.dtype)
    # min() clips the low side for Â < 0, the high for Â > 0; CISPO caps its weight either way.
    sides = (adv_BT != 0,) * 2 if loss_fn == "cispo" else (adv_BT < 0, adv_BT > 0)
    stats = _clip_stats(ratio_BT, old_logprobs, sides, mask, eps_low, eps_high, dtype)
    num_dual = (mask & dual_BT).sum() if dual_BT is not None else mask.new_zeros(())
    stats["dual_clip_frac"] = num_dual.to(dtype) / stats["num_tokens"].clamp(min=1)
    return loss, stats


def _checked(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, clip_ratio_c):
    """``policy_loss``'s arguments checked; the advantages as ``[B, 1]`` or ``[B, T]``."""
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low} and {eps_high}")
    if clip_ratio_c != 0 and not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c must be 0 (off) or > 1, got {clip_ratio_c}")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            "logprobs, old_logprobs and mask must have the same [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape == logprobs.shape[:1]:
        return advantages.unsqueeze(-1)  # [B, 1], the same Â_i for every token of o_i
    if advantages.shape == logprobs.shape:
        return advantages
    raise ValueError(
        f"advantages must be [B] or [B, T] = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
    )


@torch.no_grad()
def _clip_stats(ratio_BT, old_logprobs, sides, mask, eps_low, eps_high, dtype: torch.dtype):
    """``policy_loss``'s diagnostics over the masked tokens, detached, in ``dtype``; a bound
    counts as active only where ``sides`` (low, high) says the objective clips there."""
    ratio_BT = ratio_BT.to(dtype)
    clip_low_BT = mask & sides[0] & (ratio_BT < 1.0 - eps_low)
    clip_high_BT = mask & sides[1] & (ratio_BT > 1.0 + eps_high)
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
    return {name: value.detach() for name, value in stats.items()}


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref) (Schulman's approximator; GRPO baseline).

        d = log π_ref - log π_θ,    kl = exp(d) - d - 1  (>= 0)

    Unbiased for KL(π_θ ‖ π_ref) when tokens are sampled from π_θ, and never
    negative. DAPO itself uses no KL penalty (§2.3); the naive-GRPO ablation adds
    β · aggregate(kl_k3(...)). ``d`` is clamped to [-20, 20] so exp() cannot
    overflow on a diverged or garbage position, and the estimate is capped at
    ``KL_CLAMP`` (10) as in the reference; the gradient is zero beyond either clamp.
    Mask padding with ``aggregate``.

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
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1.0).clamp(max=KL_CLAMP)
