import pytest
import torch

from dapo.data.batch import Episode
from dapo.training.sampling import (
    DynamicSamplingExhausted,
    Group,
    SamplingResult,
    collect_groups,
    oversampled_round,
    rollout_metrics,
    round_size,
)
from dapo.training.step import assign_advantages


def _group(uid: str, correct: list[bool]) -> Group:
    eps = [
        Episode(
            prompt_ids=torch.tensor([1]),
            response_ids=torch.tensor([2, 3]),
            sampler_logprobs=torch.zeros(2),
            truncated=False,
            correct=c,
            reward=1.0 if c else -1.0,
        )
        for c in correct
    ]
    return Group(uid, eps)


def _rounds(patterns: list[list[list[bool]]]):
    """A fake generator: round r returns the groups of patterns[r]."""
    calls = []

    def draw(round_index: int, num_prompts: int) -> list[Group]:
        calls.append(round_index)
        return [_group(f"r{round_index}g{i}", c) for i, c in enumerate(patterns[round_index])]

    return draw, calls


ALL_RIGHT, ALL_WRONG, MIXED = [True] * 4, [False] * 4, [True, False, False, True]


def test_keeps_only_mixed_groups_and_fills_exactly_n():
    draw, calls = _rounds(
        [
            [ALL_RIGHT, MIXED, ALL_WRONG, MIXED],  # 2 mixed
            [MIXED, ALL_WRONG, MIXED, MIXED],  # 3 mixed: 5 total, cut to 4
        ]
    )
    res = collect_groups(draw, num_groups=4, dynamic=True, max_rounds=5, on_max_rounds="error")
    assert calls == [0, 1]
    assert [g.uid for g in res.groups] == ["r0g1", "r0g3", "r1g0", "r1g2"]
    assert all(0 < sum(g.correct) < 4 for g in res.groups)
    assert (res.rounds, res.prompts_drawn, res.groups_mixed) == (2, 8, 5)
    assert len(res.generated) == 8 and not res.exhausted
    assert res.tokens_generated == 8 * 4 * 2


def test_the_filter_is_on_correctness_not_on_the_shaped_reward():
    # Spec "Dynamic sampling": keep a group iff 0 < #correct < G, "not on the shaped reward".
    # Two all-correct responses, one shaped down to 1 - 0.5 = 0.5 by the soft overlong
    # penalty: rewards differ, correctness does not, so it is dropped; likewise two wrong ones
    # at -1 and -1.25. Only the mixed group (1 right, 1 wrong) is kept, and only it counts.
    def group(uid: str, scored: list[tuple[bool, float]]) -> Group:
        def one(c: bool, r: float) -> Episode:
            return Episode(torch.tensor([1]), torch.tensor([2, 3]), torch.zeros(2), False, c, r)

        return Group(uid, [one(c, r) for c, r in scored])

    round0 = [
        group("right-shaped", [(True, 1.0), (True, 0.5)]),
        group("wrong-shaped", [(False, -1.0), (False, -1.25)]),
        group("mixed", [(True, 1.0), (False, -1.0)]),
    ]
    res = collect_groups(
        lambda i, n: round0, num_groups=3, dynamic=True, max_rounds=1, on_max_rounds="train"
    )
    assert [g.uid for g in res.groups] == ["mixed"]
    assert (res.groups_mixed, res.prompts_drawn, res.exhausted) == (1, 3, True)


def test_max_rounds_error_says_what_to_do():
    draw, calls = _rounds([[ALL_RIGHT, MIXED]] * 10)
    with pytest.raises(DynamicSamplingExhausted) as info:
        collect_groups(draw, num_groups=4, dynamic=True, max_rounds=3, on_max_rounds="error")
    assert calls == [0, 1, 2]
    msg = str(info.value)
    assert "kept 3 of 4 groups after 3 rounds" in msg
    assert "sampling.max_rounds" in msg and "sampling.on_max_rounds=train" in msg
    # Half the prompts drawn were mixed: the round cap stopped the step, not the policy.
    assert "(6 prompts drawn): 50% of the prompts drawn gave mixed groups, but too few" in msg
    draw, _ = _rounds([[ALL_RIGHT, ALL_WRONG, ALL_RIGHT, MIXED]] * 10)  # 1 in 4 mixed
    with pytest.raises(DynamicSamplingExhausted) as info:
        collect_groups(draw, num_groups=4, dynamic=True, max_rounds=2, on_max_rounds="error")
    assert "(8 prompts drawn): the policy is all right or all wrong on nearly" in str(info.value)


def test_max_rounds_train_returns_what_was_kept():
    draw, calls = _rounds([[ALL_RIGHT, MIXED]] * 10)
    res = collect_groups(draw, num_groups=4, dynamic=True, max_rounds=2, on_max_rounds="train")
    assert calls == [0, 1] and res.exhausted
    assert [g.uid for g in res.groups] == ["r0g1", "r1g1"]


def test_zero_max_rounds_is_unbounded():
    draw, calls = _rounds([[ALL_WRONG]] * 20 + [[MIXED]])
    res = collect_groups(draw, num_groups=1, dynamic=True, max_rounds=0, on_max_rounds="error")
    assert len(calls) == 21 and len(res.groups) == 1


def test_without_dynamic_sampling_every_group_is_kept_after_one_round():
    draw, calls = _rounds([[ALL_RIGHT, ALL_WRONG, MIXED]])
    res = collect_groups(draw, num_groups=3, dynamic=False, max_rounds=5, on_max_rounds="error")
    assert calls == [0]
    assert [g.uid for g in res.groups] == ["r0g0", "r0g1", "r0g2"]


def test_oversampled_round_sizes_by_the_kept_fraction():
    # Nothing measured: the configured size, but never fewer prompts than groups needed.
    assert oversampled_round(32, None, default=40, cap=128) == 40
    assert oversampled_round(32, None, default=16, cap=128) == 32
    # 32 groups at a kept fraction of 0.8: (32 + sqrt(32 x 0.2)) / 0.8 = 43.16 -> 44 prompts.
    assert oversampled_round(32, 0.8, default=40, cap=128) == 44
    # 4 still needed at 0.5: (4 + sqrt(2)) / 0.5 = 10.83 -> 11.
    assert oversampled_round(4, 0.5, default=40, cap=128) == 11
    assert oversampled_round(32, 1.0, default=40, cap=128) == 32  # all kept: no margin
    assert oversampled_round(32, 0.1, default=40, cap=128) == 128  # capped
    assert oversampled_round(32, 0.0, default=40, cap=128) == 128


def test_round_size_sees_the_result_so_far():
    """Each round is sized from what the rounds before it kept."""
    sizes, seen = [], []

    def draw(round_index: int, num_prompts: int) -> list[Group]:
        sizes.append(num_prompts)
        # Half of every round's groups are mixed.
        return [
            _group(f"r{round_index}g{i}", MIXED if i % 2 else ALL_RIGHT) for i in range(num_prompts)
        ]

    def round_size(so_far) -> int:
        seen.append((so_far.rounds, so_far.prompts_drawn, so_far.groups_mixed, len(so_far.groups)))
        frac = so_far.groups_mixed / so_far.prompts_drawn if so_far.prompts_drawn else None
        return oversampled_round(6 - len(so_far.groups), frac, default=4, cap=24)

    res = collect_groups(
        draw, num_groups=6, dynamic=True, max_rounds=5, on_max_rounds="error", round_size=round_size
    )
    # Round 1: default 4 < 6 needed, so 6 prompts, 3 mixed; round 2: 3 needed at a kept
    # fraction of 3/6 -> (3 + sqrt(1.5)) / 0.5 = 8.45 -> 9 prompts, 4 mixed; done, 1 surplus.
    assert sizes == [6, 9] and seen == [(0, 0, 0, 0), (1, 6, 3, 3)]
    assert len(res.groups) == 6 and res.groups_mixed == 7


def _so_far(kept: int, mixed: int, drawn: int) -> SamplingResult:
    return SamplingResult(groups=[None] * kept, groups_mixed=mixed, prompts_drawn=drawn)


def test_round_size_without_dynamic_sampling_is_exactly_n():
    sizes = dict(num_groups=32, prompts_per_round=40, oversample=True, prior=(10, 100))
    assert round_size(_so_far(0, 0, 0), dynamic=False, **sizes) == 32


def test_round_size_without_oversampling_is_the_configured_round():
    sizes = dict(num_groups=32, dynamic=True, oversample=False, prior=(10, 100))
    assert round_size(_so_far(5, 5, 40), prompts_per_round=40, **sizes) == 40
    assert round_size(_so_far(5, 5, 40), prompts_per_round=0, **sizes) == 32  # 0 = N


def test_round_size_oversamples_by_the_kept_fraction_of_last_step_and_this_one():
    sizes = dict(num_groups=32, dynamic=True, prompts_per_round=40, oversample=True)
    # Nothing measured yet: the configured first round.
    assert round_size(_so_far(0, 0, 0), prior=(0, 0), **sizes) == 40
    # Last step kept 24 of 40, this one 6 of 10: f = 30/50 = 0.6; 26 still needed:
    # ceil((26 + sqrt(26 * 0.4)) / 0.6) = ceil(48.71...) = 49.
    assert round_size(_so_far(6, 6, 10), prior=(24, 40), **sizes) == 49
    # Nothing kept so far: the cap, 4 x N.
    assert round_size(_so_far(0, 0, 40), prior=(0, 40), **sizes) == 128


def test_metrics_count_all_right_all_wrong_and_the_groups_that_carry_a_gradient():
    # Without dynamic sampling every group trains: of 5 groups, 2 all right and 1 all wrong
    # carry no gradient under plain correctness rewards; with soft length shaping an all-right
    # group whose rewards differ does (its advantages are not all zero).
    draw, _ = _rounds([[ALL_RIGHT, MIXED, ALL_WRONG, ALL_RIGHT, MIXED]])
    res = collect_groups(draw, num_groups=5, dynamic=False, max_rounds=5, on_max_rounds="error")
    assign_advantages(res.groups, eps=1e-6)
    metrics = rollout_metrics(res)
    assert metrics["sampling/all_correct_frac"] == 2 / 5
    assert metrics["sampling/all_wrong_frac"] == 1 / 5
    assert metrics["sampling/groups_with_gradient"] == 2.0
    res.groups[0].episodes[0].reward = 0.5  # one response of an all-right group shaped down
    assign_advantages(res.groups, eps=1e-6)
    assert rollout_metrics(res)["sampling/groups_with_gradient"] == 3.0
    # Mixed groups are counted without dynamic sampling too (they were 0), and none of the
    # 5, all kept, is surplus (it was 0 - 5 = -5).
    assert (metrics["sampling/groups_mixed"], metrics["sampling/groups_kept"]) == (2.0, 5.0)
    assert metrics["sampling/groups_surplus"] == 0.0
    # With dynamic sampling only mixed groups train; the shares count every group drawn.
    draw, _ = _rounds([[ALL_RIGHT, MIXED, ALL_WRONG, MIXED], [MIXED, ALL_RIGHT]])
    res = collect_groups(draw, num_groups=3, dynamic=True, max_rounds=5, on_max_rounds="error")
    assign_advantages(res.groups, eps=1e-6)
    metrics = rollout_metrics(res)
    assert metrics["sampling/all_correct_frac"] == 2 / 6
    assert metrics["sampling/all_wrong_frac"] == 1 / 6
    assert metrics["sampling/groups_with_gradient"] == 3.0
    assert metrics["sampling/groups_mixed"] == 3.0 and metrics["sampling/groups_surplus"] == 0.0
    # Overlong filtering masks a response out of the loss: a group whose nonzero advantages
    # are all on masked responses carries no gradient (it counted as one).
    for e in res.groups[0].episodes:
        e.trainable = e.advantage == 0.0
    assert rollout_metrics(res)["sampling/groups_with_gradient"] == 2.0


def test_the_budget_line_counts_an_oversampled_round():
    """With oversampling a round may draw up to 4 x N prompts, and the printed budget says so;
    without it a round draws prompts_per_round (the demo's 40)."""
    from dapo.config import load_config
    from dapo.training.inputs import describe_budget

    lengths = {"train_prompt_tokens_mean": 40.0}
    line = describe_budget(load_config(None, ["train.prompts_per_step=32"]), lengths)
    # 128 prompts x 16 responses x (40 + 28) tokens = 139,264
    assert (
        line.startswith("tokens per step: at most 128 prompts x 16 responses") and "0.14M" in line
    )
    plain = [
        "train.prompts_per_step=32",
        "sampling.oversample=false",
        "sampling.prompts_per_round=40",
    ]
    assert "at most 40 prompts x 16" in describe_budget(load_config(None, plain), lengths)
    no_dynamic = ["train.prompts_per_step=32", "sampling.dynamic=false"]
    assert "at most 32 prompts x 16" in describe_budget(load_config(None, no_dynamic), lengths)
