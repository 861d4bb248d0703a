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
from dapo.data.batch import Episode


@dataclass
class Group:
    uid: str
    episodes: list[Episode]
    origin: tuple[int, int, int] | None = None
    """Under ranks, for a group of summaries: (round, index in the round, the rank that holds
    its whole episodes); see :mod:`dapo.training.exchange`."""
    version: int = 0
    """The policy that drew it: the weights after this many training steps, not optimizer
    updates (a step trained from weights ``step - version`` steps old is that stale)."""

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
        """The model's tokens (an environment's observations are not generated)."""
        return sum(e.model_tokens for g in self.generated for e in g.episodes)


class DynamicSamplingExhausted(RuntimeError):
    pass


MAX_OVERSAMPLE = 4
"""A round draws at most this many times N prompts (rollout.rows_per_generate bounds the rows
generated at once)."""


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


def round_size(
    so_far: SamplingResult,
    *,
    num_groups: int,
    dynamic: bool,
    prompts_per_round: int,
    oversample: bool,
    prior: tuple[int, int],
) -> int:
    """Prompts to draw in the next round of a step.

    Without dynamic sampling every group is kept, so one round of exactly N prompts. With it,
    ``prompts_per_round`` (0 = N), or with ``oversample`` enough for the groups still needed
    at the mixed share (groups mixed / prompts drawn; not the logged ``kept_frac``, which
    the cap at N groups lowers) measured over ``prior`` (the last step's (mixed groups,
    prompts drawn)) and this step so far (``oversampled_round``), at most ``MAX_OVERSAMPLE`` x N.
    """
    if not dynamic:
        return num_groups
    default = prompts_per_round or num_groups
    if not oversample:
        return default
    mixed = so_far.groups_mixed + prior[0]
    drawn = so_far.prompts_drawn + prior[1]
    kept_frac = mixed / drawn if drawn else None
    need = num_groups - len(so_far.groups)
    return oversampled_round(need, kept_frac, default=default, cap=MAX_OVERSAMPLE * num_groups)


def collect_groups(
    draw_round: Callable[[int, int], list[Group]],
    *,
    num_groups: int,
    dynamic: bool,
    max_rounds: int,
    on_max_rounds: str,
    round_size: Callable[[SamplingResult], int] | None = None,
    stopping: Callable[[], bool] = lambda: False,
) -> SamplingResult | None:
    """Call ``draw_round(round_index, num_prompts)`` until ``num_groups`` groups are kept, then
    cut to exactly N. ``round_size(result so far)`` gives each round's prompts (default N).
    ``stopping()`` is asked before each round: True ends the step unfinished (None).

    Without ``dynamic``, one round is drawn and every group is kept (the caller draws N prompts).
    ``max_rounds`` = 0 means unbounded. When the bound is hit, ``on_max_rounds="error"`` raises
    :class:`DynamicSamplingExhausted`; ``"train"`` returns what was kept, flagged ``exhausted``.
    """
    result = SamplingResult(groups=[])
    while len(result.groups) < num_groups:
        if max_rounds and result.rounds >= max_rounds:
            result.exhausted = True
            if on_max_rounds == "error":
                mixed = len(result.groups) / max(result.prompts_drawn, 1)
                why = (
                    "the policy is all right or all wrong on nearly every prompt"
                    if mixed < 0.5
                    else f"{mixed:.0%} of the prompts drawn gave mixed groups, but too few "
                    "prompts were drawn in that many rounds"
                )
                raise DynamicSamplingExhausted(
                    f"dynamic sampling kept {len(result.groups)} of {num_groups} groups after "
                    f"{result.rounds} rounds ({result.prompts_drawn} prompts drawn): {why}. "
                    "Raise sampling.max_rounds (0 = unbounded), set sampling.on_max_rounds=train "
                    "to train on the groups kept, or use data closer to the policy's level."
                )
            break
        if stopping():
            return None
        groups = draw_round(result.rounds, round_size(result) if round_size else num_groups)
        result.rounds += 1
        result.prompts_drawn += len(groups)
        result.generated.extend(groups)
        correct_nG = torch.tensor([g.correct for g in groups], dtype=torch.bool)
        keep_n = mixed_groups(correct_nG)
        result.groups_mixed += int(keep_n.sum())  # with dynamic sampling or without
        if not dynamic:
            result.groups.extend(groups)
            break
        result.groups.extend(g for g, k in zip(groups, keep_n.tolist(), strict=True) if k)
    del result.groups[num_groups:]
    return result


def rollout_metrics(result: SamplingResult) -> dict[str, float]:
    """Figures over every response generated this step, what dynamic sampling cost, and how
    many trained groups carry a gradient (call it after the advantages are assigned)."""
    eps = [e for g in result.generated for e in g.episodes]
    lengths = torch.tensor([e.model_tokens for e in eps], dtype=torch.float64)
    kept = len(result.groups)
    drawn = max(len(result.generated), 1)
    # The mechanisms dynamic sampling answers: as groups become all right (or stay all wrong)
    # their advantages vanish, and without the filter the batch that carries a gradient
    # shrinks. Advantages are assigned before the metrics are taken.
    all_correct = sum(all(g.correct) for g in result.generated)
    all_wrong = sum(not any(g.correct) for g in result.generated)
    # A response overlong filtering masked out (not trainable) gives no gradient.
    with_gradient = sum(
        any(e.trainable and e.advantage != 0.0 for e in g.episodes) for g in result.groups
    )
    return {
        "rollout/accuracy": sum(e.correct for e in eps) / len(eps),
        "rollout/reward_mean": sum(e.reward for e in eps) / len(eps),
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/truncated_frac": sum(e.truncated for e in eps) / len(eps),
        "reward/faults": float(sum(1 for e in eps if e.reward_fault)),
        "sampling/rounds": float(result.rounds),
        "sampling/prompts_drawn": float(result.prompts_drawn),
        "sampling/groups_mixed": float(result.groups_mixed),
        "sampling/groups_kept": float(kept),
        "sampling/kept_frac": kept / max(result.prompts_drawn, 1),
        "sampling/tokens_generated": float(result.tokens_generated),
        "sampling/tokens_per_kept_group": result.tokens_generated / kept if kept else math.nan,
        # Without dynamic sampling every group is kept, the mixed ones among them: none dropped.
        "sampling/groups_surplus": float(max(result.groups_mixed - kept, 0)),
        "sampling/exhausted": float(result.exhausted),
        "sampling/all_correct_frac": all_correct / drawn,
        "sampling/all_wrong_frac": all_wrong / drawn,
        "sampling/groups_with_gradient": float(with_gradient),
    } | episode_metrics(eps)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Figures of multi-turn episodes (``env.class``), per response: tool calls, the share of
    calls that failed, tool seconds, model turns and the environment's tokens; none for
    single-turn responses."""
    traces = [e.trace for e in episodes if e.trace is not None]
    if not traces:
        return {}
    n = len(episodes)
    calls = sum(t.tool_calls for t in traces)
    return {
        "tools/calls_per_response": calls / n,
        "tools/call_frac": sum(t.tool_calls > 0 for t in traces) / n,
        "tools/error_frac": sum(t.tool_errors for t in traces) / max(calls, 1),
        "tools/seconds": sum(t.tool_seconds for t in traces),
        "episode/turns": sum(t.turns for t in traces) / n,
        "episode/env_tokens": sum(t.env_tokens for t in traces) / n,
    }
