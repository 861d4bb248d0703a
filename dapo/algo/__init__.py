"""The DAPO maths: pure tensor functions, no I/O, no config objects; imports only torch.

Every technique lives here once (Yu et al., 2025, arXiv 2503.14476; see the spec):

- group-relative advantage (GRPO, DAPO §2.2)          -> ``groups.group_advantages``
  (and its batch-std and Dr. GRPO no-std variants: ``norm``)
- dynamic sampling filter 0 < #correct < G (§3.2)     -> ``groups.mixed_groups``
- Clip-Higher, decoupled eps_low / eps_high (§3.1)    -> ``losses.policy_loss``
- token-level policy-gradient loss (§3.3)             -> ``losses.aggregate`` / ``policy_loss``
  (and Dr. GRPO's constant normaliser, ``seq-mean-token-sum-norm``)
- the loss variants by name: ratios (per token, GSPO's per response), objectives (the
  clipped surrogate with dual-clip, CISPO's clipped weight), aggregations -> ``variants``
- soft overlong punishment (§3.4)                     -> ``shaping.overlong_penalty``
- overlong filtering, hard -1 baseline (ablation)     -> ``shaping.shape_rewards``
- rollout correction (TIS / MIS) of an engine's log-probs -> ``correction.rollout_correction``
- k3 KL estimator, only in the GRPO baseline (DAPO §2.3 removes the KL) -> ``losses.kl_k3``
- per-token log-probabilities and entropy             -> ``logits.token_logprobs_from_logits``,
                                                         ``logits.entropy_from_logits``
- the same from hidden states, in bounded memory      -> ``logits.token_logprobs_from_hidden``
- the entropy and token-probability curves            -> ``logits.token_sums``
- the sampler-vs-forward log-prob check               -> ``logits.max_abs_gap``

Each is importable from here too (``dapo.algo.policy_loss``).

Shape-suffix legend for tensor names:

    B  responses (sequences) in the batch at hand
    T  response tokens (padded length)
    V  vocabulary size
    n  groups (prompts), one row per prompt
    G  group size, responses per prompt

So ``logp_BT`` is ``[B, T]`` and ``scores_nG`` is ``[n, G]``. A trailing ``1``
marks a broadcast dimension (``adv_B1``).
"""

from dapo.algo.correction import CORRECTION_MODES, rollout_correction
from dapo.algo.groups import ADV_NORMS, group_advantages, mixed_groups
from dapo.algo.logits import (
    entropy_from_logits,
    max_abs_gap,
    token_logprobs_from_hidden,
    token_logprobs_from_logits,
    token_sums,
)
from dapo.algo.losses import AGG_MODES, LOSS_FNS, RATIO_LEVELS, aggregate, kl_k3, policy_loss
from dapo.algo.shaping import overlong_penalty, shape_rewards
from dapo.algo.variants import AGGREGATIONS, OBJECTIVES, RATIOS

__all__ = [
    "ADV_NORMS",
    "AGGREGATIONS",
    "AGG_MODES",
    "CORRECTION_MODES",
    "LOSS_FNS",
    "OBJECTIVES",
    "RATIOS",
    "RATIO_LEVELS",
    "aggregate",
    "entropy_from_logits",
    "group_advantages",
    "kl_k3",
    "max_abs_gap",
    "mixed_groups",
    "overlong_penalty",
    "policy_loss",
    "rollout_correction",
    "shape_rewards",
    "token_logprobs_from_hidden",
    "token_logprobs_from_logits",
    "token_sums",
]
