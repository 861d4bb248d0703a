"""Generation on ranks of their own (``dist.rollout_ranks`` = R) under ``torchrun``.

The job's last R ranks generate and the others train (:mod:`dapo.dist.roles`). The schedule
is the generator thread's (:mod:`dapo.training.generator_thread`) with k =
``train.async_staleness``: step t samples from the weights after step max(0, t - k), so a
run repeats itself and a resumed run continues exactly; at k = 0 the two roles take turns.

- **The generators** (:func:`serve`) draw each step's rounds as a step drawn in turn does
  (:func:`dapo.training.rounds.draw_step`, split over the generators as over ranks), and the
  first of them sends the step's rollouts to every trainer in the format of the checkpoint's
  rollouts (:func:`dapo.training.rollout_files.encode`, nothing pickled), with the prompt
  sampler's position after the step. Before a step whose weights they lack, they wait for
  the trainers' next broadcast (:mod:`dapo.dist.weight_sync`).
- **The trainers** (:class:`GeneratorRanks`, their rollout source) receive each step's
  rollouts, train on them, and after each update start sending the new weights if a later
  step samples from them. Evaluation runs on the trainers, on their own copy, refreshed
  before an evaluation (``TrainState.engine_behind``).
- **Checkpoints.** Before a save at step s the trainers take every step the generators can
  draw (through s + k) and save them with the generators' sampler position, as the
  generator thread does; a resumed run tells the generators where to go on.
- **Failures.** A step whose draw fails is sent as its error (type and text) with the
  sampler's position before it, and the generators wait for the trainers' stop: as with the
  generator thread, a save before that step keeps the steps drawn until then, and the
  trainers raise the error when they take the step. A generator that dies or stalls is
  named in the trainers' error (both in :mod:`dapo.training.exchange`).

:func:`rollout_source` builds the run's source: these ranks, a generator thread
(:mod:`dapo.training.generator_thread`) or drawing in turn (``InTurn``); the loop calls it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from dapo import dist
from dapo.config import Config
from dapo.data.batch import Episode
from dapo.data.problems import Problem, PromptSampler
from dapo.dist import roles, weight_sync
from dapo.models import lora
from dapo.models.policy import DTYPES, compute_device, stop_token_ids
from dapo.reward.pool import RewardPool
from dapo.rollout import make_engine
from dapo.rollout.base import close_engine
from dapo.run.interrupt import GracefulStop, StepAborted
from dapo.training.copies import frozen_dtype
from dapo.training.exchange import (
    LocalGroups,
    MiniBatch,
    failed_draw,
    failure,
    receive_step,
)
from dapo.training.generator_thread import GeneratorThread
from dapo.training.rollout_files import decode, encode, rollouts_to_files
from dapo.training.rounds import Drawer, draw_step
from dapo.training.sampling import SamplingResult
from dapo.training.sources import InTurn, RolloutSource, StepRollouts, drawn_ahead_metrics
from dapo.training.state import (
    TrainState,
    close_episodes,
    drawer_for,
    engine_options,
    engine_stops,
    reward_pool,
)

# ----------------------------------------------------------------------------- the trainers


def rollout_source(
    state: TrainState,
    *,
    make_pool: Callable[[], RewardPool] | None,
    threads: int,
    restored: tuple[list[StepRollouts], tuple[int, int]] | None,
) -> RolloutSource:
    """The rollout source the config asks for, built once for the run: generator ranks
    (``dist.rollout_ranks``), a generator thread of ``threads`` threads and a reward pool of
    its own (``train.async_staleness``), or drawn in turn; ``restored``: the steps a resumed
    checkpoint holds drawn ahead, and the kept fraction their drawer had."""
    if roles.roles() is not None:  # dist.rollout_ranks: the generators are other ranks
        return GeneratorRanks(state, restored=restored)
    if not state.cfg.train.async_staleness:
        return InTurn()
    pool = make_pool() if make_pool else None
    return GeneratorThread(state, pool=pool, threads=threads, restored=restored)


class GeneratorRanks:
    """The trainers' rollout source: steps received from the generator ranks."""

    def __init__(
        self, state: TrainState, *, restored: tuple[list[StepRollouts], tuple[int, int]] | None
    ) -> None:
        cfg = state.cfg
        self.state = state
        self.k, self.limit = cfg.train.async_staleness, cfg.train.steps
        # Taking turns (k = 0), an exact engine samples the weights being trained.
        self.on_policy = self.k == 0 and state.engine.exact_logprobs
        self.source = roles.roles().first_generator
        self.ready: dict[int, StepRollouts] = {}
        self.prior = tuple(state.sampling_prior)
        if restored is not None:
            steps, self.prior = restored
            self.ready = {s.step: s for s in steps}
        self.received = state.step + len(self.ready) - 1  # the newest step the trainers have
        self.failure: dict[str, Any] | None = None  # a failed draw's error (failed_draw)
        self.sent: int | None = None  # the newest weights sent
        self.stopped = False
        self.signal_received = 0
        self.sync_s = 0.0
        dtype = frozen_dtype(state.model, DTYPES[cfg.model.compute_dtype])
        self.sender = weight_sync.Sender(dtype, state.device, lora.moving_names(state.model))
        nxt = self.received + 1  # the generators' first step
        if dist.is_main():
            start = {"next": nxt, "sampler": state.sampler.state_dict()}
            roles.broadcast_json({**start, "prior": list(self.prior)})
        # Rank 0 has waited there for the generators to load their model: the others wait
        # for it as long as that may take, not in the gather's short collectives.
        dist.wait_for_all()
        if nxt < self.limit and max(0, nxt - self.k) <= state.step:
            self._send(state.step)

    def _send(self, version: int) -> None:
        self.sync_s += self.sender.send(self.state.model, version)
        self.sent = version

    def _receive(self) -> None:
        wait_s = self.state.cfg.dist.wait_timeout_s
        generators = roles.roles().generators
        drawn, extra = decode(receive_step(self.source, self.received + 1, wait_s, generators))
        if "failed" in extra:  # the generators draw no further: the error waits for its step
            self.failure = extra["failed"]
        else:
            self.ready[drawn.step] = drawn
            self.received = drawn.step
        self.state.sampler.load_state_dict(extra["sampler"])
        self.prior = tuple(extra["prior"])
        signum = int(extra.get("signal", 0))
        if signum and not self.signal_received and dist.is_main():
            print(
                f"\n{signal.Signals(signum).name} reached a generator rank: the trainers "
                "finish this step, then save a checkpoint",
                file=sys.stderr,
                flush=True,
            )
        self.signal_received = self.signal_received or signum

    def _catch_up(self) -> None:
        """Receive every step the generators draw with the weights sent so far, or up to
        the step whose draw failed."""
        while self.failure is None and self.received < self._drawn_through():
            self._receive()

    def take(self, state: TrainState) -> StepRollouts:
        """The rollouts of step ``state.step``, once received; the error of its draw, if
        it failed."""
        while state.step not in self.ready:
            if self.failure is not None:  # steps are sent in order: this is the failed one
                raise failed_draw(self.failure)
            self._receive()
        drawn = self.ready.pop(state.step)
        drawn.sampler_is_policy = self.on_policy
        state.timers.update(drawn.timers)
        return drawn

    def episodes(self, rollouts: StepRollouts, plan: list[MiniBatch]) -> list[Episode]:
        return [e for g in rollouts.result.groups for e in g.episodes]  # whole on every rank

    def weights_changed(self, state: TrainState) -> None:
        state.engine_behind = True  # the generators get the weights; evaluation refreshes it

    def finish_step(
        self, state: TrainState, rollouts: StepRollouts, metrics: dict[str, float], waited: float
    ) -> dict[str, float]:
        """Start sending the new weights (if a later step samples from them); the step's
        metrics, with the seconds the trainers spent on the weights (their engine's copy for
        evaluation and the generators')."""
        self.sync_s = 0.0
        version = state.step + 1
        if version + self.k < self.limit:
            self._send(version)
        else:
            # No step samples from later weights: stop now, so that the receive each
            # generator has posted for its next message is answered at once, not after the
            # final evaluation, save and export (which may outlast its wait).
            self._stop()
        out = drawn_ahead_metrics(state, rollouts, waited)
        out["perf/weight_sync_s"] = metrics.get("perf/weight_sync_s", 0.0) + self.sync_s
        return out

    def _drawn_through(self) -> int:
        """The last step the generators draw with the weights sent so far."""
        if self.sent is None:
            return self.received
        return max(self.received, min(self.limit - 1, self.sent + self.k))

    def settle(self, state: TrainState) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Before a save at step ``state.step``: every step the generators can draw (through
        step + k, or up to the step whose draw failed), as (JSON, tensors) for the
        checkpoint."""
        self._catch_up()
        meta, tensors = rollouts_to_files([self.ready[t] for t in sorted(self.ready)])
        return {"prior": list(self.prior), "rollouts": meta}, tensors

    def close(self, *, failed: bool = False) -> None:
        """Stop the generators: the stop signal (unless sent), then take what they still
        draw. A failing run waits for nothing: its exit makes torchrun stop the job; but
        generators that sent a failed draw wait for the stop, which lets them end well."""
        if failed and self.failure is None:
            return
        self._stop()
        self._catch_up()
        self.sender.finish()

    def _stop(self) -> None:
        """Tell the generators no more weights come (once)."""
        if not self.stopped:
            self.sender.stop(self.state.model)
            self.stopped = True


# ----------------------------------------------------------------------------- the generators


def generate_on_this_rank(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer: Any,
    problems: list[Problem],
    reward_fn: Callable[..., Any] | None = None,
) -> None:
    """A generator rank's run, around its own whole copy of the policy (``model``, its
    starting weights, replaced by the trainers' before its first step). A first stop signal
    is passed on to the trainers with the next step's rollouts (they stop after that step
    and save, then stop the generators); a second one stops this rank."""
    device = compute_device(cfg.model.device)
    compute = DTYPES[cfg.model.compute_dtype]
    model = model.to(device, frozen_dtype(model, compute)).eval().requires_grad_(False)
    stops = engine_stops(
        stop_token_ids(model, tokenizer, cfg.rollout.stop_token_ids), tokenizer, cfg.env
    )
    engine = make_engine(
        cfg.rollout.engine,
        model,
        tokenizer,
        stops,
        compute,
        vllm=vars(cfg.vllm),
        device=device,
        **engine_options(cfg),
    )
    sampler = PromptSampler(problems, seed=cfg.train.seed)
    pool = reward_pool(cfg, reward_fn)
    drawer = drawer_for(
        cfg, tokenizer=tokenizer, engine=engine, sampler=sampler, model=model, pool=pool
    )
    failed = True
    try:
        with open(os.devnull, "w") as quiet, GracefulStop(stream=quiet) as stop:
            k, steps = cfg.train.async_staleness, cfg.train.steps
            serve(drawer, staleness=k, steps=steps, device=device, stop=stop)
        failed = False
    finally:
        pool.close()
        close_episodes(drawer.episodes)
        close_engine(engine, failed=failed)


def serve(
    drawer: Drawer,
    *,
    staleness: int,
    steps: int,
    device: torch.device,
    stop: GracefulStop | None = None,
) -> None:
    """A generator rank's whole run: ``drawer`` holds its frozen model (in the dtype the
    trainers send), engine, reward pool and prompt sampler; it draws steps until the
    trainers stop it, or until a draw fails (sent in the step's place, then the stop waited
    for). ``staleness``, ``steps``: ``train.async_staleness``, ``train.steps``; ``stop``: the
    stop signal this rank (or another generator) received is sent on."""
    k, limit = staleness, steps
    start = roles.broadcast_json(None)
    drawer.sampler.load_state_dict(start["sampler"])
    prior = tuple(start["prior"])
    outbox = _Outbox()
    moving = lora.moving_names(drawer.model)  # with LoRA only the adapters move
    # Posted now, and again after each version is taken: the trainers' broadcast is done
    # while this rank draws (weight_sync: nothing waits on a GPU).
    weights = weight_sync.Receiver(drawer.model, device, moving)
    version = -1
    step = int(start["next"])
    while step < limit:
        t0 = time.perf_counter()
        had = version
        while version < max(0, step - k):
            version = weights.take()
            if version == weight_sync.STOP:
                return outbox.wait()
        if version != had:  # an engine with weights of its own (vllm) loads the new ones
            drawer.engine.sync_weights(drawer.model)
        idle = time.perf_counter() - t0
        cursor = drawer.sampler.state_dict()
        try:
            drawn, after, signum = _draw(drawer, step, version, prior, idle, stop)
        except StepAborted:  # a second stop signal stops this rank
            raise
        except Exception as exc:
            if roles.lost_peer(exc):  # another generator is gone: not this step's draw failing
                raise
            # Its prompts go back, as the generator thread's do: a save before this step
            # holds the position a resumed run draws it from again.
            drawer.sampler.load_state_dict(cursor)
            empty = StepRollouts(step, version, SamplingResult(groups=[]), {}, 0.0, idle)
            failed = {"failed": failure(exc, step), "sampler": cursor, "prior": list(prior)}
            outbox.post(empty, {**failed, "signal": (stop.signum if stop else None) or 0})
            break
        prior = after
        extra = {"sampler": drawer.sampler.state_dict(), "prior": list(prior)}
        outbox.post(drawn, {**extra, "signal": signum})
        step += 1
    while weights.take() != weight_sync.STOP:
        pass  # weights no step needs (a trainer past the limit, or a failed draw): unused
    outbox.wait()


class _Outbox:
    """The messages the first generator sends every trainer (the others send none)."""

    def __init__(self) -> None:
        self.trainers = roles.roles().trainers
        self.sends = dist.global_rank() == roles.roles().first_generator
        self.pending: list = []

    def post(self, drawn: StepRollouts, extra: dict[str, Any]) -> None:
        if self.sends:
            message = encode(drawn, extra)
            roles.release_sent(self.pending)
            for dst in range(self.trainers):
                roles.send_bytes(message, dst, self.pending)

    def wait(self) -> None:
        roles.wait_sent(self.pending)


def _draw(
    drawer: Drawer,
    step: int,
    version: int,
    prior: tuple[int, int],
    idle: float,
    stop: GracefulStop | None,
) -> tuple[StepRollouts, tuple[int, int], int]:
    """Step ``step``'s rollouts (``idle``: the seconds this rank waited for its weights), the
    kept fraction after it, and the stop signal any generator received (0: none)."""
    drawer.timers = {}
    t0 = time.perf_counter()
    local = LocalGroups()
    result = draw_step(drawer, step=step, version=version, prior=prior, local=local)
    prior = (result.groups_mixed, result.prompts_drawn)
    result = _whole(result, local)
    signum = (stop.signum if stop else None) or 0
    if dist.world_size() > 1:
        drawer.timers["gen_slots"] = dist.all_reduce_sum(drawer.timers.get("gen_slots", 0.0))
        signum = dist.all_reduce_max(signum)  # a signal to any generator
    seconds = time.perf_counter() - t0
    return StepRollouts(step, version, result, dict(drawer.timers), seconds, idle), prior, signum


def _whole(result: SamplingResult, local: LocalGroups) -> SamplingResult:
    """``result`` with whole groups in the place of the summaries of several generators."""
    if dist.world_size() == 1:
        return result
    here = list(local.groups.items())
    whole = {key: g for key, g in dist.gather_lists(here, patient=True)}
    swap = {id(g): whole[g.origin[:2]] for g in result.generated}
    result.groups = [swap[id(g)] for g in result.groups]
    result.generated = [swap[id(g)] for g in result.generated]
    return result
