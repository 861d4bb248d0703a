"""Generation ahead of training (``train.async_staleness`` = k >= 1), in one process.

A generator thread draws the rollouts of later steps while the trainer updates. Step t (from
0) samples from the weights after step max(0, t - k): a fixed schedule rather than "the
newest weights when a round starts", so that a run repeats itself at a fixed ``run.threads``
and a resumed run continues exactly as the uninterrupted one. The generator waits when it
would need weights the trainer has not made yet; the trainer waits when the rollouts of its
step are not done.

- **Weights.** The generator samples from its own frozen copy of the policy. After each step
  the trainer hands over a clone of the new weights; the generator loads the one its next step
  needs. At most k clones wait at once, so memory holds up to k + 1 extra copies of the model.
- **Off-policy.** pi_old is the trainer's own forward pass; the sampler's log-probs are an
  older policy's (:attr:`~dapo.training.sources.StepRollouts.sampler_is_policy` is False),
  which ``algo.rollout_correction`` weighs (auto: token_tis) and the ``mismatch/*`` metrics
  measure.
- **Dynamic sampling.** The generator draws each step's rounds exactly as a step drawn in turn
  does (:func:`dapo.training.rounds.draw_step`), with a drawer of its own: the same seeds,
  the same round sizes from its own mixed share, the same metrics.
- **Checkpoints.** Before a save the generator finishes every step it can (through step s + k,
  whose weights are all made) and waits; those rollouts go into the checkpoint
  (:mod:`dapo.training.rollout_files`). A resumed run starts from them and regenerates nothing.
- **Failures.** A step whose draw fails gives its prompts back to the sampler, and the error
  waits for the trainer to take that step: a save before it keeps the steps drawn until then
  and the sampler's position before the failed step, which a resumed run draws again: from
  its own weights when they are the checkpoint's (step s + k), else from the checkpoint's
  (less stale: older weights are not kept). A run that ends before that step ends as it
  would have without drawing it.
- **Stopping.** Closing the source stops the generator between two rounds: its drawer asks
  before each round.
- **Threads.** torch's intra-op thread count is per thread: on a CPU the generator and the
  trainer each take half the cores, or half of ``run.threads`` (one each at 1).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from dapo.data.batch import Episode
from dapo.models import lora
from dapo.models.policy import DTYPES, stop_token_ids
from dapo.rollout import make_engine
from dapo.training.copies import frozen_dtype
from dapo.training.exchange import MiniBatch
from dapo.training.rollout_files import rollouts_to_files
from dapo.training.rounds import draw_step
from dapo.training.sources import StepRollouts, drawn_ahead_metrics
from dapo.training.state import (
    TrainState,
    close_episodes,
    drawer_for,
    engine_options,
    engine_stops,
)

FAILED_CLOSE_S = 5.0
"""How long a failing run waits for the generator thread's round in flight."""


def share_cores(cfg: Config, *, beside: bool) -> tuple[int, int | None]:
    """The threads of a generator thread (half the cores: ``run.threads``, else torch's
    count; one at least), and the trainer's beside it (the rest), or None for the trainer's
    when ``beside`` is False: no generator thread runs in this process."""
    cores = cfg.run.threads or torch.get_num_threads()
    generator = max(1, cores // 2)
    return generator, max(1, cores - generator) if beside else None


if TYPE_CHECKING:
    from dapo.config import Config
    from dapo.reward.pool import RewardPool


class GeneratorThread:
    """The generator thread and the steps it has drawn; see the module docstring."""

    signal_received = 0  # a thread of this process: its signals are the process's

    def __init__(
        self,
        state: TrainState,
        *,
        pool: RewardPool | None,
        threads: int,
        restored: tuple[list[StepRollouts], tuple[int, int]] | None = None,
    ) -> None:
        cfg = state.cfg
        self.k, self.limit, self.threads = cfg.train.async_staleness, cfg.train.steps, threads
        compute = DTYPES[cfg.model.compute_dtype]
        self.dtype = frozen_dtype(state.model, compute)  # as the copies under torchrun are
        model = copy.deepcopy(state.model).to(self.dtype).eval().requires_grad_(False)
        if state.device.type == "cuda":  # made on this stream, read on the thread's own
            torch.cuda.current_stream(state.device).synchronize()
        # Its own tokenizer too: a fast tokenizer used from two threads at once can raise
        # ("Already borrowed"), and evaluation uses the trainer's meanwhile.
        tokenizer = copy.deepcopy(state.tokenizer)
        stops = engine_stops(
            stop_token_ids(model, tokenizer, cfg.rollout.stop_token_ids), tokenizer, cfg.env
        )
        engine = make_engine(
            cfg.rollout.engine,
            model,
            tokenizer,
            stops,
            compute,
            device=state.device,
            **engine_options(cfg),
        )
        self.device = state.device
        # The generator's own model, engine, pool and timers; the prompt sampler is shared
        # (only the generator draws prompts).
        self.drawer = drawer_for(
            cfg,
            tokenizer=tokenizer,
            engine=engine,
            sampler=state.sampler,
            model=model,
            pool=pool,
            tp_mesh=state.tp_mesh,
            stopping=lambda: self.closing,
        )
        self.prior = state.sampling_prior  # the generator's kept fraction, for round sizes
        self.version = state.step
        self.ready: dict[int, StepRollouts] = {}
        if restored is not None:
            steps, self.prior = restored
            self.ready = {s.step: s for s in steps}
        self.next_step = state.step + len(self.ready)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.current: StepRollouts | None = None
        self.error: BaseException | None = None
        self.closing = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="dapo-generator", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the generator thread

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        # On a GPU the generator's kernels go to a stream of their own, so that they overlap
        # the trainer's instead of queueing behind them on the default stream.
        cuda = self.device.type == "cuda"
        stream = torch.cuda.stream(torch.cuda.Stream(self.device)) if cuda else nullcontext()
        try:
            with stream:
                self._loop()
        except BaseException as exc:  # handed to the trainer, which raises it
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _loop(self) -> None:
        while self.next_step < self.limit:
            t0 = time.perf_counter()
            weights = self._weights_for(self.next_step)
            if self.closing:
                return
            if weights is not None:
                _load(self.drawer.model, weights)
            drawn = self._draw(self.next_step, idle=time.perf_counter() - t0)
            if drawn is None:  # closed between two rounds
                return
            with self.cond:
                self.ready[drawn.step] = drawn
                self.next_step += 1
                self.cond.notify_all()

    def _weights_for(self, step: int) -> dict[str, torch.Tensor] | None:
        """Wait until the weights step ``step`` samples from are made; those to load (None:
        the copy holds them). A step past a resumed run's original end, whose weights were
        not kept, samples from the newest the copy has (less stale, never more)."""
        need = max(0, step - self.k)
        with self.cond:
            while need > self.version and need not in self.snapshots and not self.closing:
                self.cond.wait()
            if self.closing or need <= self.version:
                return None
            for old in [v for v in self.snapshots if v < need]:
                del self.snapshots[old]
            self.version = need
            return self.snapshots.pop(need)

    def _draw(self, step: int, idle: float) -> StepRollouts | None:
        self.drawer.timers = {}
        t0 = time.perf_counter()
        cursor = self.drawer.sampler.state_dict()
        try:
            result = draw_step(self.drawer, step=step, version=self.version, prior=self.prior)
        except BaseException:
            # Its prompts go back: a save before the trainer reaches this step holds the
            # position a resumed run draws it from again, as the failed draw did.
            self.drawer.sampler.load_state_dict(cursor)
            raise
        if result is None:
            return None
        self.prior = (result.groups_mixed, result.prompts_drawn)
        seconds = time.perf_counter() - t0
        return StepRollouts(step, self.version, result, dict(self.drawer.timers), seconds, idle)

    # ------------------------------------------------------------------ the trainer's side

    def take(self, state: TrainState) -> StepRollouts:
        """The rollouts of step ``state.step``, once drawn (their timers go to the step's)."""
        drawn = self._wait(lambda: state.step in self.ready, pop=state.step)
        state.timers.update(drawn.timers)
        self.current = drawn
        return drawn

    def episodes(self, rollouts: StepRollouts, plan: list[MiniBatch]) -> list[Episode]:
        return [e for g in rollouts.result.groups for e in g.episodes]

    def weights_changed(self, state: TrainState) -> None:
        state.sync_engine()  # the trainer's engine evaluates

    def _wait(self, done: Callable[[], bool], pop: int | None = None) -> Any:
        with self.cond:
            while not done() and self.error is None and self.thread.is_alive():
                self.cond.wait(timeout=1.0)
            if done():  # a failure on a later step waits for the step it belongs to
                return self.ready.pop(pop) if pop is not None else None
            if self.error is not None:  # as the step would have raised it (fit names the fix)
                raise self.error
            raise RuntimeError("the generator thread stopped before drawing the rollouts")

    def finish_step(
        self, state: TrainState, rollouts: StepRollouts, metrics: dict[str, float], waited: float
    ) -> dict[str, float]:
        """Hand the new weights to the generator (if a later step samples from them); this
        step's metrics, and its generation figures as the generator measured them."""
        version = state.step + 1
        if version + self.k < self.limit:
            moving = lora.moving_names(state.model)  # with LoRA only the adapters move
            snapshot = {
                n: t.detach().to(self.dtype if t.is_floating_point() else t.dtype, copy=True)
                for n, t in state.model.state_dict().items()
                if moving is None or n in moving
            }
            if self.device.type == "cuda":  # made on the trainer's stream, read on another
                torch.cuda.current_stream(self.device).synchronize()
            with self.cond:
                self.snapshots[version] = snapshot
                self.cond.notify_all()
        return drawn_ahead_metrics(state, rollouts, waited)

    def settle(self, state: TrainState) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Before a save at step ``state.step``: wait for every step the saved weights can
        draw (through step + k), or up to the step whose draw failed, then their rollouts as
        (JSON, tensors) for the checkpoint."""
        last = min(state.step + self.k, self.limit - 1)
        # A failed draw (of a step not trained yet) saves the steps before it; the error is
        # raised when the trainer takes that step (never, if the run ends first).
        self._wait(lambda: self.next_step > last or self.error is not None)
        with self.cond:
            drawn = [self.ready[t] for t in sorted(self.ready)]
            prior = list(self.prior)
        meta, tensors = rollouts_to_files(drawn)
        return {"prior": prior, "rollouts": meta}, tensors

    def close(self, *, failed: bool = False) -> None:
        """Stop the thread between two rounds; close its reward pool. A failing run (a second
        Ctrl-C) waits ``FAILED_CLOSE_S`` at most: the round in flight may take minutes (its
        generation, grading up to reward.batch_timeout_s), and is left to the daemon thread;
        the pool it grades with and its environment's tool helpers are then not closed here
        (they end with this process)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join(FAILED_CLOSE_S if failed else None)
        if self.thread.is_alive():
            return
        if self.drawer.pool is not None:
            self.drawer.pool.close()
        close_episodes(self.drawer.episodes)  # its own engine's runner, not the trainer's


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    own = model.state_dict()
    with torch.no_grad():
        for name, source in weights.items():
            tensor = own[name]
            tensor.copy_(source)
    if tensor.is_cuda:  # the snapshot is freed after this; its copies must be done
        torch.cuda.current_stream(tensor.device).synchronize()
