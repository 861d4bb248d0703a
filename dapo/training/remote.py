"""Generation on ranks of their own (``dist.rollout_ranks`` = R) under ``torchrun``.

The job's last R ranks generate and the others train (:mod:`dapo.dist.roles`). The schedule
is the one-process generator's (:mod:`dapo.training.ahead`) with k = ``train.async_staleness``:
step t samples from the weights after update max(0, t - k), so a run repeats itself and a
resumed run continues exactly; at k = 0 the two roles take turns.

- **The generators** (:func:`serve`) draw each step's rounds as a synchronous step does
  (:func:`dapo.training.step.collect_step`, split over the generators as over ranks), and the
  first of them sends the step's rollouts to every trainer: JSON and safetensors bytes, the
  format of the checkpoint's ``rollouts.safetensors`` (nothing pickled), with the prompt
  sampler's position after the step. Before a step whose weights they lack, they wait for
  the trainers' next broadcast (:mod:`dapo.dist.weight_sync`).
- **The trainers** (:class:`Remote`, in the place of the one-process :class:`Ahead`) receive
  each step's rollouts, train on them, and after each update start sending the new weights if
  a later step samples from them. Evaluation runs on the trainers, on their own copy.
- **Checkpoints.** Before a save at step s the trainers take every step the generators can
  draw (through s + k) and save them with the generators' sampler position, as the
  one-process generator does; a resumed run tells the generators where to go on.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dapo import dist
from dapo.config import Config
from dapo.data.problems import Problem, PromptSampler
from dapo.dist import roles, weight_sync
from dapo.models.policy import DTYPES, compute_device, stop_token_ids
from dapo.rollout import make_engine
from dapo.training.ahead import Drawn, drawn_metrics, rollouts_from_files, rollouts_to_files
from dapo.training.copies import frozen_dtype
from dapo.training.exchange import Held
from dapo.training.sampling import SamplingResult

if TYPE_CHECKING:
    from dapo.training.step import TrainState


# ----------------------------------------------------------------------------- messages


def encode(drawn: Drawn, extra: dict[str, Any]) -> torch.Tensor:
    """A step's rollouts and ``extra`` (JSON) as bytes: 8 bytes of JSON length, the JSON,
    then the tensors in safetensors."""
    meta, tensors = rollouts_to_files([drawn])
    text = json.dumps({"rollouts": meta, **extra}).encode()
    blob = st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    head = len(text).to_bytes(8, "little")
    return torch.frombuffer(bytearray(head + text + blob), dtype=torch.uint8)


def decode(buffer: torch.Tensor) -> tuple[Drawn, dict[str, Any]]:
    """What :func:`encode` made."""
    data = buffer.numpy().tobytes()
    n = int.from_bytes(data[:8], "little")
    message = json.loads(data[8 : 8 + n])
    (drawn,) = rollouts_from_files(message.pop("rollouts"), st_load(data[8 + n :]), "a message")
    return drawn, message


# ----------------------------------------------------------------------------- the trainers


class Remote:
    """The trainers' side: the :class:`~dapo.training.ahead.Ahead` interface (take,
    finish_step, settle, close) over the generator ranks."""

    generators_elsewhere = True
    """The trainers' own engine only evaluates (``TrainState.engine_behind``)."""

    def __init__(
        self, state: TrainState, *, restored: tuple[list[Drawn], tuple[int, int]] | None
    ) -> None:
        cfg = state.cfg
        self.state = state
        self.k, self.limit = cfg.train.async_staleness, cfg.train.steps
        self.source = roles.roles().first_generator
        self.ready: dict[int, Drawn] = {}
        self.prior = tuple(state.sampling_prior)
        if restored is not None:
            drawn, self.prior = restored
            self.ready = {d.step: d for d in drawn}
        self.received = state.step + len(self.ready) - 1  # the newest step the trainers have
        self.sent: int | None = None  # the newest weights sent
        self.current: Drawn | None = None
        self.sync_s = 0.0
        held = frozen_dtype(state.model, DTYPES[cfg.model.compute_dtype])
        self.sender = weight_sync.Sender(held, state.device)
        nxt = self.received + 1  # the generators' first step
        if dist.is_main():
            start = {"next": nxt, "sampler": state.sampler.state_dict()}
            roles.broadcast_json({**start, "prior": list(self.prior)})
        if nxt < self.limit and max(0, nxt - self.k) <= state.step:
            self._send(state.step)

    def _send(self, version: int) -> None:
        self.sync_s += self.sender.send(self.state.model, version)
        self.sent = version

    def _receive(self) -> None:
        drawn, extra = decode(roles.recv_bytes(self.source))
        self.ready[drawn.step] = drawn
        self.received = drawn.step
        self.state.sampler.load_state_dict(extra["sampler"])
        self.prior = tuple(extra["prior"])

    def _catch_up(self) -> None:
        """Receive every step the generators draw with the weights sent so far."""
        while self.received < self._drawn_through():
            self._receive()

    def take(self, state: TrainState) -> SamplingResult:
        """The rollouts of step ``state.step``, once received."""
        while state.step not in self.ready:
            self._receive()
        drawn = self.current = self.ready.pop(state.step)
        state.timers.update(drawn.timers)
        return drawn.result

    def finish_step(
        self, state: TrainState, result: SamplingResult, metrics: dict[str, float], waited: float
    ) -> dict[str, float]:
        """Start sending the new weights (if a later step samples from them); the async
        metrics, with the seconds the trainers spent on the weights (their engine's copy for
        evaluation and the generators')."""
        self.sync_s = 0.0
        version = state.step + 1
        if version + self.k < self.limit:
            self._send(version)
        out = drawn_metrics(state, self.current, result, waited)
        out["perf/weight_sync_s"] = metrics.get("perf/weight_sync_s", 0.0) + self.sync_s
        return out

    def _drawn_through(self) -> int:
        """The last step the generators draw with the weights sent so far."""
        if self.sent is None:
            return self.received
        return max(self.received, min(self.limit - 1, self.sent + self.k))

    def settle(self, state: TrainState) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Before a save at step ``state.step``: every step the generators can draw (through
        step + k), as (JSON, tensors) for the checkpoint."""
        self._catch_up()
        meta, tensors = rollouts_to_files([self.ready[t] for t in sorted(self.ready)])
        return {"prior": list(self.prior), "rollouts": meta}, tensors

    def close(self) -> None:
        """Stop the generators: take what they still draw, then the stop signal."""
        self.sender.stop()
        self._catch_up()
        self.sender.finish()


# ----------------------------------------------------------------------------- the generators


def run_generator(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer: Any,
    problems: list[Problem],
    reward_fn: Callable[..., Any] | None = None,
) -> None:
    """A generator rank's run, around its own whole copy of the policy (``model``, its
    starting weights, replaced by the trainers' before its first step). A first stop signal
    is left to the trainers (they stop the generators once they have saved); a second one
    stops this rank."""
    from dapo.reward.custom import reward_pool
    from dapo.run.interrupt import GracefulStop
    from dapo.training.step import TrainState

    device = compute_device(cfg.model.device)
    compute = DTYPES[cfg.model.compute_dtype]
    model = model.to(device, frozen_dtype(model, compute)).eval().requires_grad_(False)
    stops = stop_token_ids(model, tokenizer, cfg.rollout.stop_token_ids)
    engine = make_engine(
        cfg.rollout.engine, model, tokenizer, stops, compute, vllm=vars(cfg.vllm), device=device
    )
    sampler = PromptSampler(problems, seed=cfg.train.seed)
    pool = reward_pool(cfg, reward_fn)
    state = TrainState(cfg, model, tokenizer, None, sampler, engine, pool=pool, device=device)
    try:
        with open(os.devnull, "w") as quiet, GracefulStop(stream=quiet):
            serve(state)
    finally:
        pool.close()
        engine.close()


def serve(state: TrainState) -> None:
    """A generator rank's whole run: ``state`` holds its frozen model (in the dtype the
    trainers send), engine, reward pool and prompt sampler; it draws steps until the
    trainers stop it."""
    from dapo.training.step import collect_step  # the step module imports this one's peers

    cfg = state.cfg
    k, limit = cfg.train.async_staleness, cfg.train.steps
    start = roles.broadcast_json(None)
    state.sampler.load_state_dict(start["sampler"])
    state.sampling_prior = tuple(start["prior"])
    trainers = roles.roles().trainers
    sends = dist.global_rank() == roles.roles().first_generator
    version, pending = -1, []
    step = int(start["next"])
    while step < limit:
        t0 = time.perf_counter()
        had = version
        while version < max(0, step - k):
            version = weight_sync.receive(state.model, state.device)
            if version == weight_sync.STOP:
                return roles.wait_sent(pending)
        if version != had:  # an engine with weights of its own (vllm) loads the new ones
            state.engine.sync_weights(state.model)
        idle = time.perf_counter() - t0
        state.step, state.timers = step, {}
        t1 = time.perf_counter()
        held = Held()
        result = _whole(collect_step(state, held), held)
        if dist.world_size() > 1:
            state.timers["gen_slots"] = dist.all_reduce_sum(state.timers.get("gen_slots", 0.0))
        drawn = Drawn(step, version, result, dict(state.timers), time.perf_counter() - t1, idle)
        if sends:
            extra = {"sampler": state.sampler.state_dict(), "prior": list(state.sampling_prior)}
            message = encode(drawn, extra)
            roles.release_sent(pending)
            for dst in range(trainers):
                roles.send_bytes(message, dst, pending)
        step += 1
    while weight_sync.receive(state.model, state.device) != weight_sync.STOP:
        pass  # weights no step needs (a trainer past the limit): taken, unused
    roles.wait_sent(pending)


def _whole(result: SamplingResult, held: Held) -> SamplingResult:
    """``result`` with whole groups in the place of the summaries of several generators."""
    if dist.world_size() == 1:
        return result
    mine = [(key, g) for key, g in held.groups.items()]
    whole = {key: g for key, g in dist.gather_lists(mine, patient=True)}
    swap = {id(g): whole[g.origin[:2]] for g in result.generated}
    result.groups = [swap[id(g)] for g in result.groups]
    result.generated = [swap[id(g)] for g in result.generated]
    return result
