"""Per-group maths: the group-relative advantage and the dynamic-sampling filter.

Both read one row per prompt (``[n, G]``): a group whose rewards are all equal has zero
advantage everywhere (``group_advantages``), which is why dynamic sampling keeps only groups
of mixed correctness (``mixed_groups``). Shape suffixes: see :mod:`dapo.algo`.
"""

import torch

ADV_NORMS = ("group", "batch", "none")
"""The advantage's divisor: its group's std (GRPO, DAPO), the std of every reward of the batch
(batch-level normalisation), or none (Dr. GRPO)."""


def group_advantages(scores: torch.Tensor, eps: float = 1e-6, norm: str = "group") -> torch.Tensor:
    """Group-relative advantage of every response (GRPO, DAPO §2.2; spec "One training step").

        Â_i = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + eps)      norm="group" (DAPO)
        Â_i = (R_i - mean(R_1..R_G)) / (std(all n x G rewards) + eps)   norm="batch"
        Â_i =  R_i - mean(R_1..R_G)                                 norm="none" (Dr. GRPO)

    computed per row, with the unbiased standard deviation (``correction=1``,
    torch's default, as in the reference). The same Â_i is used for every token
    of response i.

    A constant group (all G rewards identical, which includes G = 1) gets exactly
    zero advantage: it carries no learning signal (DAPO §3.2). This is enforced
    explicitly, because floating-point ``mean`` of equal values need not equal
    them (three 0.1's average to 0.10000000000000002), and the unbiased std of a
    single element is NaN. Note that verl instead passes a lone response's raw
    score through for G = 1; here it is zero, consistently with the constant rule.

    Dr. GRPO (Liu et al., 2025) drops the division: a group whose rewards barely differ then
    gets a small advantage instead of one scaled up to unit size. Batch-level normalisation
    keeps the group's mean as the baseline and divides by one std for the whole batch.

    Args:
        scores: rewards ``[n, G]``, one row per prompt.
        eps: added to the std so that near-constant groups do not blow up; >= 0.
        norm: one of ``ADV_NORMS``.

    Returns:
        advantages ``[n, G]``, floating point.
    """
    if scores.ndim != 2:
        raise ValueError(f"scores must be [n_groups, G], got shape {tuple(scores.shape)}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if norm not in ADV_NORMS:
        raise ValueError(f"norm must be one of {ADV_NORMS}, got {norm!r}")
    scores_nG = scores if scores.is_floating_point() else scores.to(torch.get_default_dtype())
    if scores_nG.shape[1] < 2:
        return torch.zeros_like(scores_nG)  # one response: no baseline, no signal
    is_constant_n1 = (scores_nG == scores_nG[:, :1]).all(dim=-1, keepdim=True)
    mean_n1 = scores_nG.mean(dim=-1, keepdim=True)
    centred_nG = scores_nG - mean_n1
    if norm == "group":
        adv_nG = centred_nG / (scores_nG.std(dim=-1, keepdim=True) + eps)  # unbiased
    elif norm == "batch":
        adv_nG = centred_nG / (scores_nG.std() + eps)
    else:
        adv_nG = centred_nG
    # where(), not multiplication: with eps = 0 a constant group divides 0 by 0.
    return torch.where(is_constant_n1, torch.zeros_like(adv_nG), adv_nG)


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
