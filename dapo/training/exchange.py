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
from dapo.data.batch import (
    Episode,
    length_sorted,
    partition_by_tokens,
    split_microbatches,
    split_minibatches,
)
from dapo.run.seeding import derive_seed

if TYPE_CHECKING:
    from dapo.config import Config
    from dapo.training.sampling import Group


@dataclass
class Held:
    """This rank's whole groups of the step, by (round, index in the round)."""

    groups: dict[tuple[int, int], Group] = field(default_factory=dict)

    def summarise(self, groups: list[Group], *, round_index: int, start: int) -> list[Group]:
        """Keep ``groups`` (the round's prompts ``start``, ``start + 1`` ...) and return their
        summaries, each naming where its whole episodes are."""
        from dapo.training.sampling import Group

        out = []
        for i, g in enumerate(groups):
            self.groups[(round_index, start + i)] = g
            episodes = [e.summary() for e in g.episodes]
            out.append(Group(g.uid, episodes, origin=(round_index, start + i, dist.rank())))
        return out


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer update: indices into the step's episodes, and each rank's share (indices
    into ``indices``)."""

    indices: list[int]
    shares: list[list[int]]


def training_plan(cfg: Config, step: int, episodes: list[Episode]) -> list[MiniBatch]:
    """The step's updates in order: ``train.epochs`` passes over a seeded permutation cut into
    mini-batches, each split over the ranks in shares of about equal tokens, a group's rows
    (episodes ``k G .. k G + G - 1``) on one rank, where its prompt runs once. The same on
    every rank, from the episodes' summaries alone."""
    gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, step, "minibatch"))
    size, plan = cfg.rollout.group_size, []
    for _epoch in range(cfg.train.epochs):
        for mini in split_minibatches(
            len(episodes), cfg.train.responses_per_minibatch, generator=gen
        ):
            batch = [episodes[i] for i in mini]
            shares = partition_by_tokens(batch, dist.world_size(), [i // size for i in mini])
            plan.append(MiniBatch(mini, shares))
    return plan


def trained_by(plan: list[MiniBatch], rank: int) -> list[int]:
    """The episodes ``rank`` trains in some update of ``plan``, in increasing order."""
    return sorted({m.indices[j] for m in plan for j in m.shares[rank]})


def rank_microbatches(episodes: list[Episode], indices: list[int], max_tokens: int):
    """This rank's micro-batches of ``episodes[indices]``, then None (a pass that computes
    nothing) up to the most any rank has: a sharded model's forward and backward are
    collectives, so every rank runs as many."""
    order = length_sorted(episodes, indices)
    micros: list[list[int] | None] = list(
        split_microbatches(episodes, order, max_tokens=max_tokens)
    )
    return micros + [None] * (dist.all_reduce_max(len(micros)) - len(micros))


def stand_in(pad_id: int) -> Episode:
    """A one-token episode for a pass that computes nothing (:func:`rank_microbatches`' None):
    a rank may hold none of the step's whole episodes."""
    one = torch.tensor([pad_id])
    return Episode(one, one, torch.zeros(1), False, False, 0.0)


def deliver(groups: list[Group], held: Held, plan: list[MiniBatch]) -> list[Episode]:
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
                whole = held.groups[(round_index, index)].episodes[k % size]
                outgoing[r].append((k, replace(whole, advantage=episodes[k].advantage)))
    kept_here, outgoing[dist.rank()] = outgoing[dist.rank()], []
    for k, whole in kept_here + dist.exchange(outgoing):
        episodes[k] = whole
    return episodes
