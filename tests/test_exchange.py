"""The lean rollout exchange: ranks decide on summaries (no tokens, no log-probs), and each
whole episode moves once, from the rank that generated it to the rank that trains it."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import spawn_ranks

from dapo import dist
from dapo.config import load_config
from dapo.data.batch import Episode, collate, partition_by_tokens, split_minibatches
from dapo.run.seeding import derive_seed
from dapo.training import exchange
from dapo.training.sampling import Group

G = 4


def _groups(first_uid: int, count: int) -> list[Group]:
    """``count`` groups of G episodes with prompts and responses of varied lengths."""
    groups = []
    for n in range(first_uid, first_uid + count):
        episodes = []
        for i in range(G):
            length = 3 + (5 * n + 3 * i) % 11
            episodes.append(
                Episode(
                    prompt_ids=torch.arange(2 + n % 3) + 10 * n,
                    response_ids=torch.arange(length) + 100 * n + 20 * i,
                    sampler_logprobs=-torch.rand(
                        length, generator=torch.Generator().manual_seed(n)
                    ),
                    truncated=False,
                    correct=i % 2 == 0,
                    reward=float(i % 2),
                    text=f"response {n}.{i}",
                )
            )
        groups.append(Group(f"uid-{n}", episodes))
    return groups


def test_a_summary_keeps_the_numbers_and_no_tokens():
    e = _groups(0, 1)[0].episodes[1]
    s = e.summary()
    assert (s.prompt_ids, s.response_ids, s.sampler_logprobs, s.text) == (None, None, None, "")
    assert (s.prompt_length, s.length, s.reward, s.correct) == (2, e.length, 1.0, False)
    assert len(pickle.dumps(s)) < len(pickle.dumps(e)) / 3
    with pytest.raises(AttributeError):
        collate([s], pad_id=0)  # a summary cannot be trained on by mistake


def test_the_plan_is_the_updates_own_order():
    cfg = load_config(None, ["train.responses_per_minibatch=3", "train.epochs=2"], base="demo")
    episodes = [e for g in _groups(0, 2) for e in g.episodes]
    plan = exchange.training_plan(cfg.train, G, 5, episodes)
    gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, 5, "minibatch"))
    minis = [m for _ in range(2) for m in split_minibatches(8, 3, generator=gen)]
    assert [m.indices for m in plan] == minis
    assert [m.shares for m in plan] == [[list(range(len(m)))] for m in minis]
    assert exchange.trained_by(plan, 0) == list(range(8))


def _rank(rank: int, port: int, out: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        cfg = load_config(
            None, ["train.responses_per_minibatch=6", f"rollout.group_size={G}"], base="demo"
        )
        generated = _groups(3 * rank, 3)  # rank 0 generated groups 0-2, rank 1 groups 3-5
        local = exchange.LocalGroups()
        summaries = local.summarise(generated, round_index=0, start=3 * rank)
        gathered = dist.gather_lists(summaries)
        for g in gathered:
            for e in g.episodes:
                e.advantage = e.reward - 0.5
        summaries = [e for g in gathered for e in g.episodes]
        plan = exchange.training_plan(cfg.train, G, 0, summaries)
        received = []
        real = dist.exchange

        def counted(outgoing):
            got = real(outgoing)
            received.extend(k for k, _ in got)
            return got

        exchange.dist.exchange = counted
        episodes = exchange.deliver(gathered, local, plan)
        torch.save(
            {"episodes": episodes, "received": received, "plan": plan, "gathered": gathered},
            f"{out}/rank_{rank}.pt",
        )
    finally:
        torch.distributed.destroy_process_group()


def test_each_rank_receives_whole_exactly_the_episodes_it_trains(tmp_path):
    spawn_ranks(_rank, str(tmp_path))
    out = [torch.load(tmp_path / f"rank_{r}.pt", weights_only=False) for r in range(2)]
    originals = [e for g in _groups(0, 6) for e in g.episodes]
    # What every rank decided from: summaries only, the same on both ranks.
    for g in out[0]["gathered"]:
        assert g.origin[2] == (0 if g.uid < "uid-3" else 1)
        assert all(e.response_ids is None for e in g.episodes)
    assert [m.indices for m in out[0]["plan"]] == [m.indices for m in out[1]["plan"]]
    trained = [exchange.trained_by(out[0]["plan"], r) for r in range(2)]
    assert sorted(trained[0] + trained[1]) == list(range(24))  # one epoch: each trained once
    for rank in range(2):
        episodes = out[rank]["episodes"]
        for k, (e, original) in enumerate(zip(episodes, originals, strict=True)):
            if k in trained[rank]:
                assert torch.equal(e.response_ids, original.response_ids)
                assert torch.equal(e.sampler_logprobs, original.sampler_logprobs)
                assert e.advantage == original.reward - 0.5
            else:
                assert e.response_ids is None
        # Only what the other rank generated and this one trains crossed the network.
        from_other = [k for k in trained[rank] if (k // G < 3) != (rank == 0)]
        assert sorted(out[rank]["received"]) == from_other
    # The shares balance tokens, a group's rows on one rank (its prompt runs once).
    mini = out[0]["plan"][0]
    groups = [i // G for i in mini.indices]
    assert mini.shares == partition_by_tokens([originals[i] for i in mini.indices], 2, groups)
    for share in mini.shares:
        other = [j for s in mini.shares if s is not share for j in s]
        assert not {groups[j] for j in share} & {groups[j] for j in other}


def test_shares_balance_padded_work_a_groups_rows_on_one_share_its_prompt_once():
    def episode(prompt: int, response: int) -> Episode:
        return Episode(torch.zeros(prompt), torch.zeros(response), torch.zeros(response), 0, 0, 0.0)

    # A share's work: its prompts + its rows x its longest response. Group 0: prompt 10,
    # responses 3 + 4; group 1: prompt 2, responses 5 + 5 + 1; group 2: prompt 6, response 6.
    # Longest response first: 2 -> share 0 (6 + 1 x 6 = 12, a tie), 1 -> share 1 (2 + 3 x 5
    # = 17 < 8 + 4 x 6 = 32), 0 -> share 0 (16 + 3 x 6 = 34 < 12 + 5 x 5 = 37).
    rows = [episode(10, 3), episode(2, 5), episode(10, 4), episode(2, 5), episode(6, 6)]
    rows.append(episode(2, 1))
    assert partition_by_tokens(rows, 2, [0, 1, 0, 1, 2, 1]) == [[0, 2, 4], [1, 3, 5]]
    # Row by row, longest first (ties: more tokens, then the first): 4 -> 0 (12, a tie),
    # 1 -> 1 (7 < 20), 3 -> 1 (14 < 20), 2 -> 0 (28 < 29), 0 -> 1 (29 < 44), 5 -> 0 (36, a tie).
    assert partition_by_tokens(rows, 2) == [[2, 4, 5], [0, 1, 3]]
    # One long response among short ones: its share takes fewer rows, as padding costs them
    # the long response's width (4 short groups of 2 rows each and one long).
    short = [episode(4, 2) for _ in range(8)]
    mixed = [*short, episode(4, 20), episode(4, 2)]
    shares = partition_by_tokens(mixed, 2, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    assert shares == [[8, 9], [0, 1, 2, 3, 4, 5, 6, 7]]
