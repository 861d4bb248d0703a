"""Dynamic sampling (DAPO §3.2): generate rounds of groups until N mixed ones are kept.

A group whose responses are all correct or all wrong has zero advantage everywhere and so no
gradient. The filter is on correctness, not on the shaped reward. Generation is bounded by
``max_rounds``; what the technique costs (rounds, prompts, tokens) is returned for the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dapo.algo import mixed_groups
from dapo.batch import Episode


@dataclass
class Group:
    uid: str
    episodes: list[Episode]

    @property
    def correct(self) -> list[bool]:
        return [e.correct for e in self.episodes]


@dataclass
class SamplingResult:
    groups: list[Group]
    rounds: int = 0
    prompts_drawn: int = 0
    groups_mixed: int = 0
    exhausted: bool = False
    """max_rounds was hit before N groups were kept."""
    generated: list[Group] = field(default_factory=list)
    """Every group generated this step, kept or not (for rollout metrics)."""

    @property
    def tokens_generated(self) -> int:
        return sum(e.length for g in self.generated for e in g.episodes)


class DynamicSamplingExhausted(RuntimeError):
    pass


def oversampled_round(need: int, kept_frac: float | None, *, default: int, cap: int) -> int:
    """Prompts to draw so that ``need`` more groups are likely kept, at the measured fraction f.

    The kept count of n prompts is about Binomial(n, f); n = ceil((need + sqrt(need (1 - f))) / f)
    adds one standard deviation, so one round suffices about five times in six instead of
    half the time. Within [need, cap]; ``default`` (at least ``need``) while nothing has been
    measured. Fewer prompts make another round (another pass of generation overhead) likely;
    more waste the surplus groups, which are dropped.
    """
    if kept_frac is None:
        return max(default, need)
    if kept_frac <= 0:
        return max(cap, need)
    size = math.ceil((need + math.sqrt(need * (1.0 - min(kept_frac, 1.0)))) / kept_frac)
    return min(max(size, need), max(cap, need))


def collect_groups(
    draw_round: Callable[[int, int], list[Group]],
    *,
    num_groups: int,
    dynamic: bool,
    max_rounds: int,
    on_max_rounds: str,
    round_size: Callable[[SamplingResult], int] | None = None,
) -> SamplingResult:
    """Call ``draw_round(round_index, num_prompts)`` until ``num_groups`` groups are kept, then
    cut to exactly N. ``round_size(result so far)`` gives each round's prompts (default N).

    Without ``dynamic``, one round is drawn and every group is kept (the caller draws N prompts).
    ``max_rounds`` = 0 means unbounded. When the bound is hit, ``on_max_rounds="error"`` raises
    :class:`DynamicSamplingExhausted`; ``"train"`` returns what was kept, flagged ``exhausted``.
    """
    result = SamplingResult(groups=[])
    while len(result.groups) < num_groups:
        if max_rounds and result.rounds >= max_rounds:
            result.exhausted = True
            if on_max_rounds == "error":
                raise DynamicSamplingExhausted(
                    f"dynamic sampling kept {len(result.groups)} of {num_groups} groups after "
                    f"{result.rounds} rounds ({result.prompts_drawn} prompts drawn): the policy is "
                    "all right or all wrong on nearly every prompt. Raise sampling.max_rounds "
                    "(0 = unbounded), set sampling.on_max_rounds=train to train on the groups "
                    "kept, or use data closer to the policy's level."
                )
            break
        groups = draw_round(result.rounds, round_size(result) if round_size else num_groups)
        result.rounds += 1
        result.prompts_drawn += len(groups)
        result.generated.extend(groups)
        if not dynamic:
            result.groups.extend(groups)
            break
        correct_nG = torch.tensor([g.correct for g in groups], dtype=torch.bool)
        keep_n = mixed_groups(correct_nG)
        result.groups_mixed += int(keep_n.sum())
        result.groups.extend(g for g, k in zip(groups, keep_n.tolist(), strict=True) if k)
    del result.groups[num_groups:]
    return result
