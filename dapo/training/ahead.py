"""Generation ahead of training (``train.async_staleness`` = k >= 1), in one process.

A generator thread draws the rollouts of later steps while the trainer updates. Step t samples
from the policy after update max(0, t - k): a fixed schedule rather than "the newest weights
when a round starts", so that a run repeats itself at a fixed ``run.threads`` and a resumed
run continues exactly as the uninterrupted one. The generator waits when it would need weights
the trainer has not made yet; the trainer waits when the rollouts of its step are not done.

- **Weights.** The generator samples from its own frozen copy of the policy. After each step
  the trainer hands over a clone of the new weights; the generator loads the one its next step
  needs. At most k clones wait at once, so memory holds up to k + 1 extra copies of the model.
- **Off-policy.** pi_old is the trainer's own forward pass; the sampler's log-probs are an
  older policy's, which ``algo.rollout_correction`` weighs (auto: token_tis) and the
  ``mismatch/*`` metrics measure (:func:`dapo.training.old_logprobs.sampler_is_policy`).
- **Dynamic sampling.** The generator runs each step's rounds exactly as a synchronous step
  does (:func:`dapo.training.step.collect_step`): the same seeds, the same round sizes from its
  own kept fraction, the same metrics.
- **Checkpoints.** Before a save the generator finishes every step it can (through step s + k,
  whose weights are all made) and waits; those rollouts go into the checkpoint
  (``rollouts.safetensors`` beside ``trainer.json``: tensors and JSON, nothing pickled). A
  resumed run starts from them and regenerates nothing.
- **Threads.** torch's intra-op thread count is per thread: on a CPU the generator and the
  trainer each take half the cores, or half of ``run.threads`` (one each at 1).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dapo.data.batch import Episode
from dapo.models.policy import DTYPES, stop_token_ids
from dapo.rollout import make_engine
from dapo.run.checkpoint import CheckpointError
from dapo.training import exchange
from dapo.training.copies import frozen_dtype
from dapo.training.sampling import Group, SamplingResult

if TYPE_CHECKING:
    from dapo.reward.pool import RewardPool
    from dapo.training.step import TrainState


@dataclass
class Drawn:
    """The rollouts of one step, and how they were made."""

    step: int
    version: int
    """The policy that drew them: the weights after this many steps."""
    result: SamplingResult
    timers: dict[str, float]
    """The generator's ``gen_slots`` and ``reward`` for this step (the perf/* metrics)."""
    seconds: float
    """Wall time of the step's rounds, grading included."""
    idle: float
    """Seconds the generator waited for this step's weights before it started."""


class Ahead:
    """The generator thread and its queue; see the module docstring."""

    def __init__(
        self,
        state: TrainState,
        *,
        pool: RewardPool | None,
        threads: int,
        restored: tuple[list[Drawn], tuple[int, int]] | None = None,
    ) -> None:
        cfg = state.cfg
        self.k, self.limit, self.threads = cfg.train.async_staleness, cfg.train.steps, threads
        compute = DTYPES[cfg.model.compute_dtype]
        self.held = frozen_dtype(state.model, compute)  # as the copies under torchrun are
        model = copy.deepcopy(state.model).to(self.held).eval().requires_grad_(False)
        # Its own tokenizer too: a fast tokenizer used from two threads at once can raise
        # ("Already borrowed"), and evaluation uses the trainer's meanwhile.
        tokenizer = copy.deepcopy(state.tokenizer)
        engine = make_engine(
            cfg.rollout.engine,
            model,
            tokenizer,
            stop_token_ids(model, tokenizer, cfg.rollout.stop_token_ids),
            compute,
            device=state.device,
        )
        self.device = state.device
        # The generator's own view of the run: its model, engine, pool, timers and kept
        # fraction; the prompt sampler is shared (only the generator draws prompts).
        self.gen = dataclasses.replace(
            state,
            model=model,
            tokenizer=tokenizer,
            engine=engine,
            pool=pool,
            timers={},
            on_phase=self._before_round,
        )
        self.version = state.step
        self.ready: dict[int, Drawn] = {}
        if restored is not None:
            drawn, self.gen.sampling_prior = restored
            self.ready = {d.step: d for d in drawn}
        self.next_step = state.step + len(self.ready)
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.current: Drawn | None = None
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
        except _Closed:
            return
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
                _load(self.gen.model, weights)
            idle = time.perf_counter() - t0
            drawn = self._draw(self.next_step, idle)
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

    def _before_round(self, phase: str) -> None:
        """Told each phase of the generator's rounds: a closing run stops it between two."""
        if self.closing:
            raise _Closed

    def _draw(self, step: int, idle: float) -> Drawn:
        from dapo.training.step import collect_step  # the step module imports this one

        gen = self.gen
        gen.step, gen.timers = step, {}
        t0 = time.perf_counter()
        result = collect_step(gen, exchange.Held())
        seconds = time.perf_counter() - t0
        return Drawn(step, self.version, result, dict(gen.timers), seconds, idle)

    # ------------------------------------------------------------------ the trainer's side

    def take(self, state: TrainState) -> SamplingResult:
        """The rollouts of step ``state.step``, once drawn (their timers go to the step's)."""
        drawn = self._wait(lambda: state.step in self.ready, pop=state.step)
        state.timers.update(drawn.timers)
        self.current = drawn
        return drawn.result

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
        self, state: TrainState, result: SamplingResult, metrics: dict[str, float], waited: float
    ) -> dict[str, float]:
        """Hand the new weights to the generator (if a later step samples from them); this
        step's async metrics, and its generation figures as the generator measured them."""
        version = state.step + 1
        if version + self.k < self.limit:
            snapshot = {
                n: t.detach().to(self.held if t.is_floating_point() else t.dtype, copy=True)
                for n, t in state.model.state_dict().items()
            }
            if self.device.type == "cuda":  # made on the trainer's stream, read on another
                torch.cuda.current_stream(self.device).synchronize()
            with self.cond:
                self.snapshots[version] = snapshot
                self.cond.notify_all()
        return drawn_metrics(state, self.current, result, waited)

    def settle(self, state: TrainState) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Before a save at step ``state.step``: wait for every step the saved weights can
        draw (through step + k), then its rollouts as (JSON, tensors) for the checkpoint."""
        last = min(state.step + self.k, self.limit - 1)
        self._wait(lambda: self.next_step > last)
        with self.cond:
            drawn = [self.ready[t] for t in sorted(self.ready)]
            prior = list(self.gen.sampling_prior)
        meta, tensors = rollouts_to_files(drawn)
        return {"prior": prior, "rollouts": meta}, tensors

    def close(self) -> None:
        """Stop the thread after the round it is in; close its reward pool."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join()
        if self.gen.pool is not None:
            self.gen.pool.close()


def drawn_metrics(
    state: TrainState, drawn: Drawn, result: SamplingResult, waited: float
) -> dict[str, float]:
    """The async/* metrics of a step trained on ``drawn``, and its generation figures as the
    generator measured them; ``waited``: the trainer's seconds waiting for the rollouts."""
    generate_s = drawn.seconds - drawn.timers.get("reward", 0.0)
    staleness = float(state.step - drawn.version)
    return {
        "async/staleness_mean": staleness,
        "async/staleness_max": staleness,
        "async/trainer_idle_s": waited,
        "async/generator_idle_s": drawn.idle,
        "perf/generate_s": generate_s,
        "perf/gen_tokens_per_s": result.tokens_generated / max(generate_s, 1e-9),
    }


class _Closed(Exception):
    """The run is closing: the generator stops between two rounds."""


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(weights[name])
    if tensor.is_cuda:  # the snapshot is freed after this; its copies must be done
        torch.cuda.current_stream(tensor.device).synchronize()


# ----------------------------------------------------------------------------- checkpoints

_TENSORS = ("prompt_ids", "response_ids", "sampler_logprobs")
_FIELDS = ("truncated", "correct", "reward", "text", "trainable", "reward_fault")


def rollouts_to_files(drawn: list[Drawn]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Steps' rollouts as JSON (per step, group and episode) and flat tensors (each episode's
    tokens and log-probs concatenated, with their lengths)."""
    meta, parts = [], {name: [] for name in _TENSORS}
    for d in drawn:
        r = d.result
        kept = {id(g) for g in r.groups}
        meta.append(
            {
                "step": d.step,
                "version": d.version,
                "timers": d.timers,
                "seconds": d.seconds,
                "idle": d.idle,
                "rounds": r.rounds,
                "prompts_drawn": r.prompts_drawn,
                "groups_mixed": r.groups_mixed,
                "exhausted": r.exhausted,
                "kept": [i for i, g in enumerate(r.generated) if id(g) in kept],
                "groups": [
                    {
                        "uid": g.uid,
                        "episodes": [{f: getattr(e, f) for f in _FIELDS} for e in g.episodes],
                    }
                    for g in r.generated
                ],
            }
        )
        for g in r.generated:
            for e in g.episodes:
                for name in _TENSORS:
                    parts[name].append(getattr(e, name))
    tensors = {}
    for name, values in parts.items():
        tensors[name] = torch.cat(values) if values else torch.zeros(0)
        tensors[f"{name}_lengths"] = torch.tensor([v.numel() for v in values], dtype=torch.long)
    return meta, tensors


def rollouts_from_files(
    meta: list[dict], tensors: dict[str, torch.Tensor], path: Any
) -> list[Drawn]:
    """The steps :func:`rollouts_to_files` wrote, from the JSON ``meta`` and the ``tensors``
    read from ``path``; a file that does not match its JSON is an error naming it (a damaged
    checkpoint), never a wrong rollout."""
    if not meta:
        return []
    split = {}
    try:
        for name in _TENSORS:
            lengths = tensors[f"{name}_lengths"].tolist()
            split[name] = list(torch.split(tensors[name], lengths))
        episodes = sum(len(g["episodes"]) for m in meta for g in m["groups"])
        if any(len(v) != episodes for v in split.values()):
            raise ValueError(f"{episodes} episodes in trainer.json, other counts in the file")
        drawn, n = [], 0
        for m in meta:
            groups = []
            for g in m["groups"]:
                episodes_g = []
                for fields in g["episodes"]:
                    tensors_e = {name: split[name][n].clone() for name in _TENSORS}
                    episodes_g.append(Episode(**tensors_e, **{f: fields[f] for f in _FIELDS}))
                    n += 1
                groups.append(Group(str(g["uid"]), episodes_g))
            result = SamplingResult(
                groups=[groups[i] for i in m["kept"]],
                rounds=int(m["rounds"]),
                prompts_drawn=int(m["prompts_drawn"]),
                groups_mixed=int(m["groups_mixed"]),
                exhausted=bool(m["exhausted"]),
                generated=groups,
            )
            timers = {str(k): float(v) for k, v in m["timers"].items()}
            drawn.append(
                Drawn(int(m["step"]), int(m["version"]), result, timers, m["seconds"], m["idle"])
            )
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path} does not match the rollouts its trainer.json lists ({exc!r}): the "
            "checkpoint is damaged; resume from an earlier one (delete this step's directory)"
        ) from None
    return drawn
