"""The DAPO training step, top to bottom. No maths here: every formula is in :mod:`dapo.algo`.

One step (spec, "One training step"):

1. rounds of prompts, G responses each, graded and shaped      the rollout source's ``take``
2. dynamic sampling: more rounds until N mixed groups are kept  (:mod:`dapo.training.rounds`)
3. group-relative advantages                                    :func:`assign_advantages`
4. pi_old (and pi_ref) log-probs, then mu epochs of updates,    :mod:`dapo.training.update`
   each micro-batch's loss divided by its mini-batch's tokens
5. the step's metrics; the source hands the new weights on     ``finish_step``

Where the rollouts come from (drawn now, in turn; by a generator thread; by generator ranks)
is the rollout source's business (:mod:`dapo.training.sources`): the step has no branch on
it. The loop around the step (evaluation, checkpoints, resume, signals, the run's outputs) is
:mod:`dapo.training.loop`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from dapo import algo
from dapo.config import OptimConfig
from dapo.training import exchange, sampling
from dapo.training.perf import step_perf
from dapo.training.sampling import Group
from dapo.training.sources import InTurn, RolloutSource
from dapo.training.state import TrainState
from dapo.training.update import untrained_metrics, update


def train_step(state: TrainState, source: RolloutSource | None = None) -> dict[str, float]:
    """One step of DAPO on ``state``, its rollouts from ``source`` (default: drawn now, in
    turn): rounds until N groups are kept, advantages, the updates; the step's metrics."""
    cfg, source = state.cfg, source or InTurn()
    state.timers.clear()
    t0 = time.perf_counter()
    rollouts = source.take(state)  # 1-2. rounds of rollouts until N mixed groups are kept
    t_gen = time.perf_counter() - t0
    groups = rollouts.result.groups
    assign_advantages(groups, eps=cfg.algo.adv_eps, norm=cfg.algo.adv_norm)  # 3.

    t1 = time.perf_counter()  # 4. pi_old, then mu epochs of mini-batch updates
    state.on_phase("train")
    summaries = [e for g in groups for e in g.episodes]
    plan = exchange.training_plan(cfg.train, cfg.rollout.group_size, state.step, summaries)
    episodes = source.episodes(rollouts, plan)
    lr = lr_at(cfg.optim, state.step)
    on_policy = rollouts.sampler_is_policy
    if episodes:
        metrics = update(state, episodes, lr=lr, plan=plan, sampler_is_policy=on_policy)
    else:  # no group kept (sampling.on_max_rounds=train)
        metrics = untrained_metrics(state, lr)
    if metrics.get("train/updates"):
        source.weights_changed(state)
    t_train = time.perf_counter() - t1

    metrics.update(sampling.rollout_metrics(rollouts.result))  # 5. the step's metrics
    times = dict(t0=t0, t_gen=t_gen, t_train=t_train)
    metrics.update(
        step_perf(state.timers, rollouts.result, metrics, epochs=cfg.train.epochs, **times)
    )
    if "weight_sync" in state.timers:  # a gather and/or an engine's load (in train_s)
        metrics["perf/weight_sync_s"] = state.timers["weight_sync"]
    metrics.update(source.finish_step(state, rollouts, metrics, waited=t_gen))
    state.step += 1
    return metrics


def assign_advantages(groups: Sequence[Group], *, eps: float, norm: str = "group") -> None:
    """Â_i = (R_i - mean(R_group)) / (std(R_group) + eps), the same for every token of o_i
    (``norm``: the group's std, the batch's, or none; ``algo.adv_norm``)."""
    if not groups:
        return
    scores_nG = torch.tensor([[e.reward for e in g.episodes] for g in groups], dtype=torch.float64)
    adv_nG = algo.group_advantages(scores_nG, eps=eps, norm=norm)
    for g, row in zip(groups, adv_nG.tolist(), strict=True):
        for e, a in zip(g.episodes, row, strict=True):
            e.advantage = a


def lr_at(optim: OptimConfig, step: int) -> float:
    """Linear warm-up over ``optim.warmup_steps`` rollout steps, then constant (paper)."""
    if optim.warmup_steps == 0:
        return optim.lr
    return optim.lr * min(1.0, (step + 1) / optim.warmup_steps)
