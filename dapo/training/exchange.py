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
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from dapo import dist
from dapo.data.batch import Episode, partition_by_tokens, split_minibatches
from dapo.run.seeding import derive_seed
from dapo.training.sampling import Group

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
