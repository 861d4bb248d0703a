"""Where a step's rollouts come from: the rollout source protocol, and the source that draws
them in turn.

The loop builds one source for the run (:func:`dapo.training.loop.rollout_source`):

=========================  ==========================================  ===================
source                     when                                        module
=========================  ==========================================  ===================
:class:`InTurn`            ``train.async_staleness=0`` (the paper's)   here
``GeneratorThread``        ``train.async_staleness=k``, one process    ``generator_thread``
``GeneratorRanks``         ``dist.rollout_ranks=R`` under torchrun     ``generator_ranks``
=========================  ==========================================  ===================

The step (:func:`dapo.training.step.train_step`) asks its source for the step's rollouts,
trains on them and tells it when the weights changed; it never asks which source it has.
What the trainer must know of the rollouts, the source says: whether the sampler's
log-probs are the policy's own (:attr:`StepRollouts.sampler_is_policy`), how stale each
group is (:attr:`~dapo.training.sampling.Group.version`), and, through
:meth:`RolloutSource.weights_changed`, who takes the new weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dapo import dist
from dapo.data.batch import Episode
from dapo.training import exchange
from dapo.training.exchange import LocalGroups, MiniBatch
from dapo.training.rounds import Drawer, draw_step
from dapo.training.sampling import SamplingResult
from dapo.training.state import TrainState, drawer_for


@dataclass
class StepRollouts:
    """The rollouts of one step, and how they were drawn."""

    step: int
    version: int
    """The policy that drew them: the weights after this many updates."""
    result: SamplingResult
    timers: dict[str, float]
    """``gen_slots`` and ``reward`` of the step's rounds (the perf/* metrics)."""
    seconds: float
    """Wall time of the step's rounds, grading included."""
    idle: float
    """Seconds the generator waited for this step's weights before it started."""
    sampler_is_policy: bool = False
    """Whether the sampler's log-probs are the trained policy's own (an exact engine drawing
    from the current weights): they may then stand in for pi_old, and need no correction.
    Set by the source that hands them to the trainer."""


class RolloutSource(Protocol):
    """What the step needs of a source; the loop closes it after the last step."""

    signal_received: int
    """A stop signal that reached the processes drawing the rollouts (generator ranks), for
    the loop to stop the trainers on too; 0: none."""

    def take(self, state: TrainState) -> StepRollouts:
        """The rollouts of step ``state.step``: drawn now, or taken once drawn elsewhere;
        their timers join the step's (``state.timers``)."""
        ...

    def episodes(self, rollouts: StepRollouts, plan: list[MiniBatch]) -> list[Episode]:
        """The step's kept episodes in order, those this rank trains in ``plan`` whole."""
        ...

    def weights_changed(self, state: TrainState) -> None:
        """The step's updates changed the policy: bring the engine that samples from it (or
        evaluates with it) up to date, now or before it is next used."""
        ...

    def finish_step(
        self, state: TrainState, rollouts: StepRollouts, metrics: dict[str, float], waited: float
    ) -> dict[str, float]:
        """After the step: hand its weights to whoever draws a later step from them; this
        source's metrics of the step (``waited``: the seconds :meth:`take` took)."""
        ...

    def settle(self, state: TrainState) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """Before a save at step ``state.step``: the rollouts drawn ahead of it, as (JSON,
        tensors) for the checkpoint; None when nothing is drawn ahead."""
        ...

    def close(self, *, failed: bool = False) -> None:
        """Stop drawing, between two rounds; ``failed``: the run is failing, and nothing
        that waits on another process may be waited for."""
        ...


class InTurn:
    """Rollouts drawn at the start of each step, in the trainer's process, by the trainer's
    engine from the current weights: the paper's synchronous schedule. Under ranks each
    rank draws its share of every round and keeps its groups whole until the plan says who
    trains them (:func:`dapo.training.exchange.deliver`)."""

    signal_received = 0  # drawn in this process: its signals are its own

    def __init__(self) -> None:
        self.local = LocalGroups()

    @staticmethod
    def drawer(state: TrainState) -> Drawer:
        """The trainer's own drawer: its engine, pool, prompt sampler, timers and phases."""
        return drawer_for(
            state.cfg,
            tokenizer=state.tokenizer,
            engine=state.engine,
            sampler=state.sampler,
            model=state.model,
            pool=state.pool,
            tp_mesh=state.tp_mesh,
            timers=state.timers,
            on_phase=state.on_phase,
            episodes=state.episodes,
        )

    def take(self, state: TrainState) -> StepRollouts:
        self.local = LocalGroups()
        drawer = self.drawer(state)
        t0 = time.perf_counter()
        step = state.step
        result = draw_step(
            drawer, step=step, version=step, prior=state.sampling_prior, local=self.local
        )
        state.sampling_prior = (result.groups_mixed, result.prompts_drawn)
        if dist.world_size() > 1:  # every rank's generation slots (perf/gen_padding_frac)
            state.timers["gen_slots"] = dist.all_reduce_sum(state.timers.get("gen_slots", 0.0))
        seconds = time.perf_counter() - t0
        exact = state.engine.exact_logprobs
        return StepRollouts(step, step, result, state.timers, seconds, 0.0, exact)

    def episodes(self, rollouts: StepRollouts, plan: list[MiniBatch]) -> list[Episode]:
        groups = rollouts.result.groups
        if dist.world_size() == 1:
            return [e for g in groups for e in g.episodes]
        return exchange.deliver(groups, self.local, plan)

    def weights_changed(self, state: TrainState) -> None:
        state.sync_engine()

    def finish_step(
        self, state: TrainState, rollouts: StepRollouts, metrics: dict[str, float], waited: float
    ) -> dict[str, float]:
        return {}

    def settle(self, state: TrainState) -> None:
        return None

    def close(self, *, failed: bool = False) -> None:
        pass


def drawn_ahead_metrics(
    state: TrainState, rollouts: StepRollouts, waited: float
) -> dict[str, float]:
    """The metrics of a step trained on rollouts drawn ahead of it: how stale its groups are,
    the seconds each side waited, and its generation and grading figures as the generator
    measured them (``waited``: the trainer's seconds waiting for the rollouts, which with
    its logprobs, train and other seconds add up to the step's)."""
    generate_s = rollouts.seconds - rollouts.timers.get("reward", 0.0)
    versions = [g.version for g in rollouts.result.groups] or [rollouts.version]
    staleness = [float(state.step - v) for v in versions]
    return {
        "async/staleness_mean": sum(staleness) / len(staleness),
        "async/staleness_max": max(staleness),
        "perf/trainer_idle_s": waited,
        "perf/generator_idle_s": rollouts.idle,
        "perf/generate_s": generate_s,
        "perf/reward_s": rollouts.timers.get("reward", 0.0),
        "perf/gen_tokens_per_s": rollouts.result.tokens_generated / max(generate_s, 1e-9),
    }
