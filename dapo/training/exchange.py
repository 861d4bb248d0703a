"""Rollouts across ranks: decide on summaries, then move each episode once.

Under ``torchrun`` every rank generates a share of a round's prompts. What the ranks must
decide together (which groups dynamic sampling keeps, the advantages, which rank trains which
response) needs only a few numbers per response: reward, correctness, lengths. So a round's
groups are all-gathered as summaries (:meth:`~dapo.data.batch.Episode.summary`), and each rank
keeps its own groups whole. Once the step's groups are chosen, the mini-batch plan
(:func:`training_plan`, the one the update follows) says which rank trains each response, and
its tokens and sampler log-probs travel once, from the rank that generated it to the ranks
that train it (:func:`dapo.dist.exchange`); nothing else moves. In one process nothing
changes: groups stay whole and there is nothing to send.

Between generator ranks and trainers (``dist.rollout_ranks``) whole steps travel
(:mod:`dapo.training.generator_ranks`); what goes wrong there is said here: a step whose draw
failed travels as its error (:func:`failure`), which the trainers raise when they reach that
step (:func:`failed_draw`), and a generator that dies or stalls is named in the trainers'
error (:func:`receive_step`).
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from dapo import dist
from dapo.data.batch import Episode, partition_by_tokens, split_minibatches
from dapo.dist import roles
from dapo.run.seeding import derive_seed
from dapo.training.sampling import DynamicSamplingExhausted, Group

if TYPE_CHECKING:
    from dapo.config import TrainConfig


@dataclass
class LocalGroups:
    """The whole groups this rank generated in a step, by (round, index in the round): the
    rounds gather only their summaries, and :func:`deliver` sends each episode from here to
    the rank that trains it."""

    groups: dict[tuple[int, int], Group] = field(default_factory=dict)

    def summarise(self, groups: list[Group], *, round_index: int, start: int) -> list[Group]:
        """Keep ``groups`` (the round's prompts ``start``, ``start + 1`` ...) and return their
        summaries, each naming where its whole episodes are."""
        out = []
        for i, g in enumerate(groups):
            self.groups[(round_index, start + i)] = g
            episodes = [e.summary() for e in g.episodes]
            origin = (round_index, start + i, dist.rank())
            out.append(Group(g.uid, episodes, origin=origin, version=g.version))
        return out


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer update: indices into the step's episodes, and each rank's share (indices
    into ``indices``)."""

    indices: list[int]
    shares: list[list[int]]


def training_plan(
    train: TrainConfig, group_size: int, step: int, episodes: list[Episode]
) -> list[MiniBatch]:
    """The step's updates in order: ``train.epochs`` passes over a seeded permutation cut into
    mini-batches of ``train.responses_per_minibatch``, each split over the ranks in shares of
    about equal work, a group's rows (episodes ``k G .. k G + G - 1``, G = ``group_size``) on
    one rank, where its prompt runs once. The same on every rank, from the episodes'
    summaries alone."""
    gen = torch.Generator().manual_seed(derive_seed(train.seed, step, "minibatch"))
    plan = []
    for _epoch in range(train.epochs):
        for mini in split_minibatches(len(episodes), train.responses_per_minibatch, generator=gen):
            batch = [episodes[i] for i in mini]
            shares = partition_by_tokens(batch, dist.world_size(), [i // group_size for i in mini])
            plan.append(MiniBatch(mini, shares))
    return plan


def trained_by(plan: list[MiniBatch], rank: int) -> list[int]:
    """The episodes ``rank`` trains in some update of ``plan``, in increasing order."""
    return sorted({m.indices[j] for m in plan for j in m.shares[rank]})


def deliver(groups: list[Group], local: LocalGroups, plan: list[MiniBatch]) -> list[Episode]:
    """The step's episodes (``groups``' summaries, in order), with those this rank trains made
    whole: each sent by the rank that generated it to every rank that trains it. The
    summaries' advantages go with them."""
    episodes = [e for g in groups for e in g.episodes]
    size = len(groups[0].episodes) if groups else 0
    outgoing: list[list[tuple[int, Episode]]] = [[] for _ in range(dist.world_size())]
    for r in range(dist.world_size()):
        for k in trained_by(plan, r):
            round_index, index, holder = groups[k // size].origin
            if holder == dist.rank():
                whole = local.groups[(round_index, index)].episodes[k % size]
                outgoing[r].append((k, replace(whole, advantage=episodes[k].advantage)))
    kept_here, outgoing[dist.rank()] = outgoing[dist.rank()], []
    for k, whole in kept_here + dist.exchange(outgoing):
        episodes[k] = whole
    return episodes


# ---------------------------------------------------------- generator ranks and trainers


class GeneratorRankError(RuntimeError):
    """A generator rank failed, died or stalled: the trainers' error, naming the rank and the
    step whose rollouts they awaited."""


REBUILT: dict[str, type[Exception]] = {
    "DynamicSamplingExhausted": DynamicSamplingExhausted,
    "ValueError": ValueError,
}
"""The errors of a failed draw that the trainers raise as the generator thread's trainer
would, by type and text: their text names the fix, and ``fit`` (the resume) and the CLI (one
line) handle them by type. Any other is a :class:`GeneratorRankError`."""


def failure(exc: Exception, step: int) -> dict[str, Any]:
    """What the first generator sends in the place of step ``step`` (from 0), whose draw
    raised ``exc``: its type, text and this rank. An error the trainers do not raise by its
    type (``REBUILT``) leaves its traceback here, in this rank's log."""
    kind = type(exc).__name__
    if kind not in REBUILT:
        print(
            f"dapo: generator rank {dist.global_rank()}: drawing step {step + 1} failed; the "
            "trainers raise it when they reach that step:",
            file=sys.stderr,
        )
        traceback.print_exc()
    return {"type": kind, "message": str(exc), "rank": dist.global_rank(), "step": step}


def failed_draw(sent: dict[str, Any]) -> Exception:
    """The error of step ``sent["step"]``'s failed draw (what :func:`failure` sent) as the
    trainers raise it when they take that step."""
    rebuilt = REBUILT.get(sent["type"])
    if rebuilt is not None:
        return rebuilt(sent["message"])
    return GeneratorRankError(
        f"generator rank {sent['rank']} failed drawing the rollouts of step {sent['step'] + 1}: "
        f"{sent['type']}: {sent['message']} (its traceback is in that rank's log)"
    )


def receive_step(
    source: int, step: int, wait_timeout_s: float, generators: int = 1
) -> torch.Tensor:
    """The message of step ``step`` (from 0) from generator rank ``source``, the first of
    ``generators``, which sends for them all; a receive that fails (a generator died, or
    none was sent for ``dist.wait_timeout_s``) raises a :class:`GeneratorRankError` naming
    the generator ranks, the step and the setting (chained from the gloo error, which the
    traceback shows above it)."""
    try:
        return roles.recv_bytes(source)
    except RuntimeError as exc:
        why = (
            "none came within dist.wait_timeout_s"
            if "timed out" in str(exc).lower()
            else "its connection closed (the rank ended, failed or was killed)"
        )
        who, whose = f"generator rank {source}", "that rank's own error"
        if generators > 1:  # any of them may be the one lost: the first one waits on it too
            last = source + generators - 1
            who = f"generator ranks {source}-{last} (rank {source} sends for them all)"
            whose = "those ranks' own errors"
        raise GeneratorRankError(
            f"{who} sent no rollouts for step {step + 1}: {why}. Look for {whose} in the "
            "job's log, if a rank wrote one; if they were still drawing, raise "
            f"dist.wait_timeout_s (now {wait_timeout_s:g} s)"
        ) from exc
