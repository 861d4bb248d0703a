"""Reward shaping by response length: the soft overlong punishment and its alternatives.

DAPO §3.4 adds R_length to R_correct; the ablation's overlong filtering masks truncated
responses out of the loss instead, and the naive baseline scores them a hard -1.
Shape suffixes: see :mod:`dapo.algo`.
"""

import torch


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


def shape_rewards(
    scores_B: torch.Tensor,
    correct_B: torch.Tensor,
    lengths_B: torch.Tensor,
    truncated_B: torch.Tensor,
    *,
    l_max: int,
    l_cache: int,
    factor: float = 1.0,
    soft_punish: bool = True,
    filter_truncated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards after length shaping, which responses count as correct, and which count in the
    loss.

        soft_punish:       R_i = R_correct,i + R_length(|o_i|)        (DAPO §3.4)
        filter_truncated:  truncated responses are masked out of the loss (the ablation's
                           overlong filtering); their reward is left as it is
        neither:           R_i = -1 for a truncated response (the naive baseline), which is
                           then incorrect too, so that dynamic sampling's filter (on
                           correctness) sees the reward the group is trained on

    Args:
        scores_B: R_correct of each response ``[B]``, floating point.
        correct_B: bool ``[B]``, the verifier's verdict.
        lengths_B: response lengths in tokens ``[B]``.
        truncated_B: bool ``[B]``, True where the response hit L_max without ending.
        l_max, l_cache, factor: see ``overlong_penalty``.

    Returns:
        ``(rewards_B, correct_B, trainable_B)``: rewards in the dtype of ``scores_B`` (the
        penalty is computed in the default dtype and added in that of the scores), and two
        bool masks.
    """
    if truncated_B.dtype != torch.bool or correct_B.dtype != torch.bool:
        raise ValueError(
            f"correct_B and truncated_B must be bool tensors, got {correct_B.dtype} and "
            f"{truncated_B.dtype}"
        )
    rewards_B = scores_B
    if soft_punish:
        penalty_B = overlong_penalty(lengths_B, l_max, l_cache, factor)
        rewards_B = rewards_B + penalty_B.to(rewards_B.dtype)
    trainable_B = ~truncated_B if filter_truncated else torch.ones_like(truncated_B)
    if not soft_punish and not filter_truncated:
        rewards_B = torch.where(truncated_B, torch.full_like(rewards_B, -1.0), rewards_B)
        correct_B = correct_B & ~truncated_B
    return rewards_B, correct_B, trainable_B
