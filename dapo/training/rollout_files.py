"""Rollouts drawn ahead of training, as files and as messages: nothing pickled.

A checkpoint holds the steps drawn ahead of it (a generator thread's or the generator ranks',
through step + k) in ``rollouts.safetensors`` beside ``trainer.json``: each episode's tokens
and log-probs as flat tensors, everything else as JSON. The generator ranks send each step
to the trainers in the same format (:func:`encode`, :func:`decode`). A file or a message that
does not match its JSON is an error naming it, never a wrong rollout.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dapo.data.batch import Episode, Trace
from dapo.run.checkpoint import ROLLOUTS_FILE, CheckpointError, load_rollouts
from dapo.training.sampling import Group, SamplingResult
from dapo.training.sources import StepRollouts

_TENSORS = ("prompt_ids", "response_ids", "sampler_logprobs")
_FIELDS = ("truncated", "correct", "reward", "text", "trainable", "reward_fault")
_ENV_MASK = "env_mask"
"""Multi-turn episodes' masks (written when any episode has one; a file of single-turn
episodes, or of an earlier version, has none)."""


def _episode_json(e: Episode) -> dict[str, Any]:
    out = {f: getattr(e, f) for f in _FIELDS}
    if e.trace is not None:
        out["trace"] = dataclasses.asdict(e.trace)
    return out


def rollouts_to_files(drawn: list[StepRollouts]) -> tuple[list[dict], dict[str, torch.Tensor]]:
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
                        "episodes": [_episode_json(e) for e in g.episodes],
                    }
                    for g in r.generated
                ],
            }
        )
        for g in r.generated:
            for e in g.episodes:
                for name in _TENSORS:
                    parts[name].append(getattr(e, name))
    episodes = [e for d in drawn for g in d.result.generated for e in g.episodes]
    if any(e.env_mask is not None for e in episodes):
        parts[_ENV_MASK] = [e.model_mask().logical_not().to(torch.uint8) for e in episodes]
    tensors = {}
    for name, values in parts.items():
        tensors[name] = torch.cat(values) if values else torch.zeros(0)
        tensors[f"{name}_lengths"] = torch.tensor([v.numel() for v in values], dtype=torch.long)
    return meta, tensors


def rollouts_from_files(
    meta: list[dict], tensors: dict[str, torch.Tensor], path: Any
) -> list[StepRollouts]:
    """The steps :func:`rollouts_to_files` wrote, from the JSON ``meta`` and the ``tensors``
    read from ``path``; a file that does not match its JSON is an error naming it (a damaged
    checkpoint), never a wrong rollout."""
    if not meta:
        return []
    split = {}
    try:
        for name in _TENSORS + ((_ENV_MASK,) if _ENV_MASK in tensors else ()):
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
                    episodes_g.append(_episode(split, n, fields))
                    n += 1
                groups.append(Group(str(g["uid"]), episodes_g, version=int(m["version"])))
            kept = m["kept"]
            if sorted(set(kept)) != kept or not set(kept) <= set(range(len(groups))):
                raise ValueError(f"step {m['step']}: kept groups {kept} of {len(groups)}")
            result = SamplingResult(
                groups=[groups[i] for i in kept],
                rounds=int(m["rounds"]),
                prompts_drawn=int(m["prompts_drawn"]),
                groups_mixed=int(m["groups_mixed"]),
                exhausted=bool(m["exhausted"]),
                generated=groups,
            )
            timers = {str(k): float(v) for k, v in m["timers"].items()}
            step, version = int(m["step"]), int(m["version"])
            drawn.append(StepRollouts(step, version, result, timers, m["seconds"], m["idle"]))
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path} does not match the rollouts its trainer.json lists ({exc!r}): the "
            "checkpoint is damaged; resume from an earlier one (delete this step's directory)"
        ) from None
    return drawn


def _episode(split: dict[str, list[torch.Tensor]], n: int, fields: dict) -> Episode:
    """Episode ``n`` of a file: its tensors from ``split``, the rest from its JSON, each
    checked against what an episode is (a file's lengths moved by one would shift every
    later episode's log-probs against its tokens)."""
    tensors = {name: split[name][n].clone() for name in _TENSORS}
    ids, logprobs = tensors["response_ids"], tensors["sampler_logprobs"]
    if tensors["prompt_ids"].is_floating_point() or ids.is_floating_point():
        raise ValueError(f"episode {n}: token ids that are not integers")
    if not logprobs.is_floating_point() or logprobs.numel() != ids.numel():
        raise ValueError(f"episode {n}: {logprobs.numel()} log-probs for {ids.numel()} tokens")
    trace = fields.get("trace")
    trace = None if trace is None else Trace(**trace)
    env_mask = split[_ENV_MASK][n].bool() if _ENV_MASK in split else None
    if env_mask is not None and env_mask.numel() != ids.numel():
        raise ValueError(f"episode {n}: its env_mask and its response differ in length")
    if trace is None and env_mask is not None and bool(env_mask.any()):
        # Without the trace the mask would be dropped and the observations trained on.
        raise ValueError(f"episode {n}: its env_mask marks observations, but it has no trace")
    env_mask = env_mask if trace is not None else None
    if trace is not None and trace.env_tokens != (0 if env_mask is None else int(env_mask.sum())):
        # The mask is what training reads, the trace what is counted: they must agree.
        raise ValueError(f"episode {n}: its trace and its env_mask count other tokens")
    return Episode(**tensors, **_checked_fields(fields, n), env_mask=env_mask, trace=trace)


def _checked_fields(fields: dict, n: int) -> dict[str, Any]:
    """An episode's JSON fields, with the types an episode has: a NaN reward or a "no" for
    ``correct`` would pass into the advantages as they are."""
    out = {f: fields[f] for f in _FIELDS}
    flags, texts = ("truncated", "correct", "trainable"), ("text", "reward_fault")
    if not all(type(out[f]) is bool for f in flags) or not all(type(out[f]) is str for f in texts):
        raise ValueError(f"episode {n}: a flag that is not true or false, or a text not text")
    reward = out["reward"]
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"episode {n}: reward {reward!r} is not a finite number")
    return out


EMPTY_TENSORS = "empty_tensors"
"""The key of a message's JSON naming its tensors of no element, (dtype, shape) by name: they
travel there, not in the safetensors part, which safetensors 0.4.3 (the floor) cannot read back
(``torch.frombuffer`` of no byte raises). A failed draw's message has only such tensors."""


def encode(drawn: StepRollouts, extra: dict[str, Any]) -> torch.Tensor:
    """A step's rollouts and ``extra`` (JSON) as bytes: 8 bytes of JSON length, the JSON,
    then the tensors in safetensors (those of no element in the JSON: ``EMPTY_TENSORS``)."""
    meta, tensors = rollouts_to_files([drawn])
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    empty = {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()}
    empty = {k: v for k, v in empty.items() if tensors[k].numel() == 0}
    text = json.dumps({"rollouts": meta, EMPTY_TENSORS: empty, **extra}).encode()
    blob = st_save({k: v for k, v in tensors.items() if k not in empty})
    head = len(text).to_bytes(8, "little")
    return torch.frombuffer(bytearray(head + text + blob), dtype=torch.uint8)


def decode(buffer: torch.Tensor) -> tuple[StepRollouts, dict[str, Any]]:
    """What :func:`encode` made."""
    data = buffer.numpy().tobytes()
    n = int.from_bytes(data[:8], "little")
    message = json.loads(data[8 : 8 + n])
    tensors = st_load(data[8 + n :])
    for name, (dtype, shape) in message.pop(EMPTY_TENSORS, {}).items():
        kind = getattr(torch, str(dtype), None)
        if not isinstance(kind, torch.dtype) or 0 not in shape:
            raise ValueError(f"a message: tensor {name!r} is not empty ({dtype}, {shape})")
        tensors[name] = torch.empty(shape, dtype=kind)
    (drawn,) = rollouts_from_files(message.pop("rollouts"), tensors, "a message")
    return drawn, message


def restore_ahead(
    info: dict[str, Any], ckpt: Path, *, step: int, staleness: int, consumed: bool
) -> tuple[list[StepRollouts], tuple[int, int]] | None:
    """The steps a checkpoint holds drawn ahead (``info["ahead"]``, from trainer.json) and
    their drawer's kept fraction, checked: consecutive from ``step`` (the next to train), each
    drawn from weights no older than ``staleness`` steps. None when it holds none. ``consumed``:
    whether this run's rollout source takes them; one drawing in turn would pass over their
    prompts (never trained), so that resume is refused."""
    ahead = info.get("ahead")
    if ahead is None or not (consumed or ahead.get("rollouts")):
        return None
    if not consumed:
        raise CheckpointError(
            f"{ckpt}: it holds {len(ahead['rollouts'])} step(s) of rollouts drawn ahead (by "
            "generator ranks or a generator thread), which rollouts drawn in turn would pass "
            "over, their prompts never trained; resume with the dist.rollout_ranks and "
            "train.async_staleness the run was saved with"
        )
    path = ckpt / ROLLOUTS_FILE
    drawn = rollouts_from_files(ahead.get("rollouts") or [], load_rollouts(ckpt), path)
    steps, versions = [d.step for d in drawn], [d.version for d in drawn]
    unborn = [d.step for d in drawn if not 0 <= d.version <= d.step]
    prior = ahead.get("prior")
    good_prior = isinstance(prior, list) and len(prior) == 2
    good_prior = good_prior and all(type(v) is int and v >= 0 for v in prior)
    if steps != list(range(step, step + len(drawn))) or unborn or not good_prior:
        raise CheckpointError(
            f"{path}: the rollouts drawn ahead are for steps {steps} (weights of steps "
            f"{versions}, kept fraction {prior!r}), where the run goes on at step {step} with "
            f"train.async_staleness={staleness}: the checkpoint is damaged; resume from an "
            "earlier one (delete this step's directory)"
        )
    if any(d.version < d.step - staleness for d in drawn):
        raise _staler_than(drawn, path, staleness)
    return drawn, (prior[0], prior[1])


def _staler_than(drawn: list[StepRollouts], path: Path, staleness: int) -> CheckpointError:
    """Sound rollouts drawn further behind than ``staleness`` allows: the run was saved with a
    larger ``train.async_staleness``, at least the one its rollouts show (a step trains
    k steps behind, and the steps through step + k are saved)."""
    saved = max(max(d.step - d.version for d in drawn), len(drawn) - 1)
    return CheckpointError(
        f"{path}: the rollouts drawn ahead for steps {[d.step for d in drawn]} come from the "
        f"weights of steps {[d.version for d in drawn]}, drawn with train.async_staleness="
        f"{saved} (or more), and this run resumes with train.async_staleness={staleness}: "
        "those steps would train on staler rollouts than it allows. The checkpoint is sound; "
        f"resume with train.async_staleness={saved} (every checkpoint of the run holds such "
        "rollouts: a smaller staleness needs a new run)"
    )
