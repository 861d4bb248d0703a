"""The policy loss's variants, by name: how a token's ratio is taken, what objective it enters,
and how the per-token terms reduce to a scalar.

Each registry maps a name (the value of ``algo.ratio_level``, ``algo.loss_fn`` or
``algo.loss_agg``) to a pure function; :func:`dapo.algo.losses.policy_loss` looks the three up
and composes them, so the loss itself has no branch per variant. A new variant is one function
and its decorator line here, plus its name in the config field's ``Literal`` (tested to list
exactly the registry's names). The variants and their papers:

- ratios: per token (PPO, GRPO, DAPO) or per response (GSPO, Zheng et al. 2025);
- objectives: the clipped surrogate with optional dual-clip (PPO, DAPO §3.1), or CISPO's
  clipped stop-gradient weight on log pi (MiniMax-M1, 2025);
- aggregations: DAPO's token-level mean (§3.3), GRPO's sample-level mean, Dr. GRPO's
  per-response sum over a constant (Liu et al. 2025).

Shape suffixes: see :mod:`dapo.algo`.
"""

from collections.abc import Callable

import torch

RatioFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ObjectiveFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
AggregationFn = Callable[..., torch.Tensor]

RATIOS: dict[str, RatioFn] = {}
"""``algo.ratio_level`` -> (logprobs, old_logprobs, mask) -> the log-ratio [B, T], 0 at
padding, before :data:`~dapo.algo.losses.LOG_RATIO_CLAMP`."""
OBJECTIVES: dict[str, ObjectiveFn] = {}
"""``algo.loss_fn`` -> (ratio, advantages, logprobs, mask, eps_low, eps_high, clip_ratio_c) ->
(the per-token objective J [B, T] to maximise, where dual-clip was active [B, T] or None)."""
AGGREGATIONS: dict[str, AggregationFn] = {}
"""``algo.loss_agg`` -> (masked values, mask, num_tokens, num_seqs, norm_len) -> the 0-d loss."""


def _register(registry: dict, name: str) -> Callable:
    def add(fn: Callable) -> Callable:
        if name in registry:
            raise ValueError(f"loss variant {name!r} is registered twice")
        registry[name] = fn
        return fn

    return add


# ----------------------------------------------------------------------------- ratios


@_register(RATIOS, "token")
def token_log_ratio(logprobs, old_logprobs, mask) -> torch.Tensor:
    """log r_{i,t} = logp_{i,t} - old_logp_{i,t}."""
    # where() first, so exp() never sees -inf - -inf = NaN at padding and no NaN can
    # flow back through the unselected branch.
    return torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))


@_register(RATIOS, "sequence")
def sequence_log_ratio(logprobs, old_logprobs, mask) -> torch.Tensor:
    """GSPO: log s_i = (1/|o_i|) Σ_t (logp - old_logp), as sg(log s_i) + logp - sg(logp), so
    its value is s_i on every token of o_i and its gradient s_i ∇logp_{i,t}."""
    zero_BT = torch.zeros_like(logprobs)
    log_ratio_BT = torch.where(mask, logprobs - old_logprobs, zero_BT)
    lengths_B1 = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_B1 = log_ratio_BT.sum(dim=-1, keepdim=True) / lengths_B1
    logp_BT = torch.where(mask, logprobs, zero_BT)
    return torch.where(mask, seq_B1.detach() + logp_BT - logp_BT.detach(), zero_BT)


# ----------------------------------------------------------------------------- objectives


@_register(OBJECTIVES, "clip")
def clipped_surrogate(ratio_BT, adv_BT, logprobs, mask, *, eps_low, eps_high, clip_ratio_c):
    """J = min(r Â, clip(r, 1 - eps_low, 1 + eps_high) Â); with dual-clip (c > 1),
    J = max(J, c Â) where Â < 0, its gradient zero where that bound is active."""
    clipped_ratio_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    objective_BT = torch.minimum(ratio_BT * adv_BT, clipped_ratio_BT * adv_BT)
    if not clip_ratio_c > 0:
        return objective_BT, None
    dual_BT = (adv_BT < 0) & (objective_BT < clip_ratio_c * adv_BT)
    return torch.where(dual_BT, clip_ratio_c * adv_BT, objective_BT), dual_BT


@_register(OBJECTIVES, "cispo")
def cispo(ratio_BT, adv_BT, logprobs, mask, *, eps_low, eps_high, clip_ratio_c):
    """J = sg(clip(r, 1 - eps_low, 1 + eps_high)) Â logp: no token's gradient is dropped;
    dual-clip does not apply (``clip_ratio_c`` is ignored)."""
    clipped_ratio_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    logp_BT = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    return clipped_ratio_BT.detach() * adv_BT * logp_BT, None


# ----------------------------------------------------------------------------- aggregations


@_register(AGGREGATIONS, "token-mean")
def token_mean(masked_BT, mask, *, num_tokens, num_seqs, norm_len) -> torch.Tensor:
    """Σ_i Σ_t v_{i,t} / num_tokens (default: this batch's masked tokens)."""
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    # DAPO §3.3: divide by Σ|o_i| of the whole mini-batch, not of this micro-batch.
    return masked_BT.sum() / num_tokens


@_register(AGGREGATIONS, "seq-mean-token-mean")
def seq_mean_token_mean(masked_BT, mask, *, num_tokens, num_seqs, norm_len) -> torch.Tensor:
    """Σ_i (Σ_t v_{i,t} / |o_i|) / num_seqs (default: this batch's rows)."""
    num_seqs = max(masked_BT.shape[0], 1) if num_seqs is None else num_seqs
    num_tokens_B = mask.sum(dim=-1)
    seq_mean_B = masked_BT.sum(dim=-1) / num_tokens_B.clamp(min=1)
    return seq_mean_B.sum() / num_seqs


@_register(AGGREGATIONS, "seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(masked_BT, mask, *, num_tokens, num_seqs, norm_len) -> torch.Tensor:
    """Σ_i (Σ_t v_{i,t} / norm_len) / num_seqs, norm_len a constant (L_max)."""
    num_seqs = max(masked_BT.shape[0], 1) if num_seqs is None else num_seqs
    if norm_len is None or not norm_len > 0:
        raise ValueError(
            f"agg='seq-mean-token-sum-norm' needs norm_len > 0 (L_max), got {norm_len}"
        )
    return (masked_BT.sum(dim=-1) / norm_len).sum() / num_seqs


def lookup(registry: dict[str, Callable], name: str, what: str) -> Callable:
    """``registry[name]``, or a ValueError naming ``what`` and the registered names."""
    if name not in registry:
        raise ValueError(f"{what} must be one of {tuple(registry)}, got {name!r}")
    return registry[name]
