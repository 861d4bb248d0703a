"""Rollout correction: weigh each token's loss by pi_old / pi_rollout when the engine that
sampled the responses is not the trainer's own forward pass.

An inference engine (vLLM) samples with other kernels, precision and batching than the
trainer, so the log-probs it reports (pi_rollout) differ from pi_old, which the trainer
recomputes and which the PPO ratio uses. The responses are then drawn from pi_rollout, not
pi_old: training is slightly off-policy, and an importance weight pi_old / pi_rollout,
truncated or masked so that one diverged token cannot dominate, puts it back on (Yao et al.,
"Your efficient RL framework secretly brings you off-policy RL training", 2025: TIS; the
masked variants as in verl's rollout correction and TRL's vLLM importance sampling).
Shape suffixes: see :mod:`dapo.algo`.
"""

import torch

from dapo.algo.losses import LOG_RATIO_CLAMP, kl_k3

CORRECTION_MODES = ("none", "token_tis", "seq_tis", "token_mis", "seq_mis")
"""none, truncated importance sampling (TIS) per token or per sequence, or masked importance
sampling (MIS) per token or per sequence."""


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    threshold: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights of the policy loss, and the mismatch between the two policies.

    With d_{i,t} = log pi_old - log pi_rollout of each sampled token and C = ``threshold``:

        token_tis   w_{i,t} = min(exp(d_{i,t}), C)
        seq_tis     w_{i,t} = min(exp(Σ_t d_{i,t}), C)               the same for all of o_i
        token_mis   w_{i,t} = 1 if 1/C <= exp(d_{i,t}) <= C, else 0
        seq_mis     w_{i,t} = 1 if 1/C <= exp(Σ_t d_{i,t}) <= C, else 0
        none        w_{i,t} = 1

    Truncation caps the weight from above only (a small weight adds no variance); masking
    drops a token or a whole response whose ratio is off by more than a factor C either way.
    The weights carry no gradient: they multiply each token's loss, whose divisor (the
    mini-batch's token count) does not change, so micro-batch accumulation stays exact.

    Args:
        old_logprobs: pi_old of the sampled tokens ``[B, T]``, from the trainer's forward pass.
        rollout_logprobs: the engine's log-probs of the same tokens ``[B, T]``.
        mask: bool ``[B, T]``, True for response tokens.
        mode: one of ``CORRECTION_MODES``.
        threshold: C > 1.

    Returns:
        ``(weights_BT, stats)``: weights (float32, 0 where ``mask`` is False) and float64
        0-d tensors over the masked tokens: ``mismatch_abs`` (mean |d|), ``mismatch_kl`` (mean k3
        estimate of KL(pi_rollout || pi_old): the tokens were drawn from pi_rollout),
        ``corrected_frac`` (fraction of tokens whose weight was truncated or masked to 0)
        and ``num_tokens``.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"rollout correction mode must be one of {CORRECTION_MODES}, got {mode!r}")
    if not threshold > 1:
        raise ValueError(f"the rollout correction threshold must be > 1, got {threshold}")
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            "old_logprobs, rollout_logprobs and mask must have the same [B, T] shape, got "
            f"{tuple(old_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}"
        )
    # float64: mismatches of 1e-7 (float32 engines) are measured, not rounded to 0 or below.
    dtype = torch.float64
    zero_BT = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    # where() first: padding may hold anything, and must reach neither sum nor exp.
    d_BT = torch.where(mask, old_logprobs.detach().to(dtype) - rollout_logprobs.to(dtype), zero_BT)
    level_BT = d_BT if mode.startswith("token") else d_BT.sum(dim=-1, keepdim=True).expand_as(d_BT)
    ratio_BT = torch.exp(level_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode.endswith("tis"):
        weights_BT = ratio_BT.clamp(max=threshold)
        corrected_BT = ratio_BT > threshold
    elif mode.endswith("mis"):
        kept_BT = (ratio_BT >= 1.0 / threshold) & (ratio_BT <= threshold)
        weights_BT = kept_BT.to(dtype)
        corrected_BT = ~kept_BT
    else:
        weights_BT = torch.ones_like(ratio_BT)
        corrected_BT = torch.zeros_like(mask)
    weights_BT = torch.where(mask, weights_BT, zero_BT).float()

    num_tok = mask.sum().to(dtype)
    den = num_tok.clamp(min=1)
    kl_BT = kl_k3(rollout_logprobs.to(dtype), old_logprobs.detach().to(dtype))
    stats = {
        "mismatch_abs": d_BT.abs().sum() / den,
        "mismatch_kl": torch.where(mask, kl_BT, zero_BT).sum() / den,
        "corrected_frac": (mask & corrected_BT).sum().to(dtype) / den,
        "num_tokens": num_tok,
    }
    return weights_BT, stats
