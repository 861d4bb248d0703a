"""Tests for dapo.algo: hand-computed values and the properties the spec asks for."""

import math

import pytest
import torch

from dapo import algo
from dapo.algo import (
    AGG_MODES,
    aggregate,
    entropy_from_logits,
    group_advantages,
    kl_k3,
    mixed_groups,
    overlong_penalty,
    policy_loss,
    token_logprobs_from_logits,
)

F64 = torch.float64


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# --------------------------------------------------------------------------- advantages


def test_group_advantages_hand_values():
    scores_nG = t64([[1, -1, 1, -1], [1, 1, 1, 1], [2, 0, 0, 0]])
    # row 0: mean 0, Σ(r-mean)^2 = 4, unbiased var 4/3, std 2/√3 -> ±1/(2/√3) = ±√3/2
    # row 1: constant -> 0
    # row 2: mean 0.5, deviations [1.5, -0.5, -0.5, -0.5], Σ^2 = 3, var 3/3 = 1, std 1
    h = math.sqrt(3) / 2
    expected = t64([[h, -h, h, -h], [0, 0, 0, 0], [1.5, -0.5, -0.5, -0.5]])
    torch.testing.assert_close(group_advantages(scores_nG, eps=0.0), expected)
    # default eps=1e-6 only perturbs the 6th digit
    torch.testing.assert_close(group_advantages(scores_nG), expected, rtol=2e-6, atol=0)


def test_group_advantages_constant_group_is_exactly_zero():
    # mean(0.1, 0.1, 0.1) = 0.10000000000000002 != 0.1: zero must be enforced, even with eps=0
    scores_nG = t64([[0.1, 0.1, 0.1], [-1.0, -1.0, -1.0]])
    for eps in (0.0, 1e-6):
        adv = group_advantages(scores_nG, eps=eps)
        assert torch.equal(adv, torch.zeros_like(adv))


def test_group_advantages_single_response_group_is_zero_not_nan():
    adv = group_advantages(t64([[1.0], [-1.0]]))
    assert torch.equal(adv, torch.zeros(2, 1, dtype=F64))


def test_group_advantages_int_scores_and_bad_shape():
    adv = group_advantages(torch.tensor([[1, 0]]), eps=0.0)
    # mean 0.5, unbiased std √0.5 -> ±0.5/√0.5 = ±1/√2
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0]]) / math.sqrt(2))
    with pytest.raises(ValueError, match="n_groups, G"):
        group_advantages(torch.ones(4))


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_group_advantages_add_eps_to_the_std_not_to_the_variance(norm):
    # Spec: Â = (R - mean) / (std + eps), eps = 1e-6. Rewards [1, 1 - δ], δ = 1/4096 (a
    # correct response one token into the L_cache = 4096 buffer beside a penalty-free one):
    # mean 1 - δ/2, deviations ±δ/2, unbiased var 2 (δ/2)^2 / 1 = δ²/2, std δ/√2 = 1.72633e-4,
    # so Â = ±(δ/2) / (δ/√2 + 1e-6) = ±1.22070e-4 / 1.73633e-4 = ±0.7030343711. One row: the
    # batch's std is the group's. (δ/2) / sqrt(δ²/2 + 1e-6) would be ±0.1203.
    d = 1 / 4096
    expected = (d / 2) / (d / math.sqrt(2) + 1e-6)
    assert expected == pytest.approx(0.7030343711, rel=1e-10)
    adv = group_advantages(t64([[1.0, 1.0 - d]]), norm=norm)
    torch.testing.assert_close(adv, t64([[expected, -expected]]), rtol=1e-9, atol=0)


# --------------------------------------------------------------------------- overlong


def test_overlong_penalty_boundaries():
    lengths = torch.tensor([0, 16, 17, 18, 19, 20, 25])
    # l_max - l_cache = 16 penalty-free; then (16 - len) / 4; beyond 20 -> -1
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0])
    out = overlong_penalty(lengths, l_max=20, l_cache=4)
    assert out.dtype == torch.get_default_dtype()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        overlong_penalty(lengths, l_max=20, l_cache=4, factor=0.5), expected * 0.5, rtol=0, atol=0
    )
    # float lengths keep their dtype
    assert overlong_penalty(lengths.to(F64), 20, 4).dtype == F64


def test_overlong_penalty_paper_values():
    lengths = torch.tensor([16384, 18432, 20480, 30000])
    out = overlong_penalty(lengths, l_max=20480, l_cache=4096)
    # (16384 - 18432) / 4096 = -0.5
    torch.testing.assert_close(out, torch.tensor([0.0, -0.5, -1.0, -1.0]), rtol=0, atol=0)


def test_overlong_penalty_validation():
    with pytest.raises(ValueError, match="overlong filtering"):
        overlong_penalty(torch.tensor([1]), l_max=20, l_cache=0)
    with pytest.raises(ValueError, match="l_cache <= l_max"):
        overlong_penalty(torch.tensor([1]), l_max=20, l_cache=21)
    with pytest.raises(ValueError, match="l_cache <= l_max"):
        overlong_penalty(torch.tensor([1]), l_max=20, l_cache=-1)
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(torch.tensor([1]), l_max=20, l_cache=4, factor=-1.0)
    # l_cache == l_max is allowed: the ramp starts at length 0
    torch.testing.assert_close(
        overlong_penalty(torch.tensor([0, 5, 10]), l_max=10, l_cache=10),
        torch.tensor([0.0, -0.5, -1.0]),
    )


# --------------------------------------------------------------------------- dynamic sampling


def test_mixed_groups():
    correct_nG = torch.tensor(
        [
            [True, True, True, True],  # all correct -> drop
            [False, False, False, False],  # all wrong -> drop
            [True, False, False, False],  # 1 of 4 -> keep
            [True, True, True, False],  # 3 of 4 -> keep
            [False, True, False, True],  # 2 of 4 -> keep
        ]
    )
    assert mixed_groups(correct_nG).tolist() == [False, False, True, True, True]
    # G = 1 can never be mixed
    assert mixed_groups(torch.tensor([[True], [False]])).tolist() == [False, False]
    with pytest.raises(ValueError, match="bool"):
        mixed_groups(torch.ones(2, 4))


# --------------------------------------------------------------------------- policy loss

# Hand example, eps_low = 0.2, eps_high = 0.28 -> clip range [0.8, 1.28]
#   seq 0, Â = +1, old p [0.5, 0.6, 0.4], new p [0.5, 0.9, 0.3] -> r [1, 1.5, 0.75]
#     t0: min(1·1, 1·1)          =  1     loss -1
#     t1: min(1.5, 1.28)         =  1.28  loss -1.28   (clip high, old p 0.6)
#     t2: min(0.75, 0.8)         =  0.75  loss -0.75   (Â > 0: lower clip inactive)
#   seq 1, Â = -2, old p [0.25, 0.6, 0.3], new p [0.125, 0.9, masked] -> r [0.5, 1.5, -]
#     t0: min(-1, 0.8·-2 = -1.6) = -1.6   loss  1.6    (clip low)
#     t1: min(-3, 1.28·-2=-2.56) = -3     loss  3      (Â < 0: upper clip inactive)
#   token-mean:          (-1 - 1.28 - 0.75 + 1.6 + 3) / 5 = 1.57 / 5 = 0.314
#   seq-mean-token-mean: ((-3.03 / 3) + (4.6 / 2)) / 2 = (-1.01 + 2.3) / 2 = 0.645
#   d loss / d logp = -Â·r / N where unclipped, 0 where clipped (token-mean, N = 5):
#     seq 0: [-1/5, 0, -0.75/5] = [-0.2, 0, -0.15]; seq 1: [0, 3/5, 0] = [0, 0.6, 0]
EPS_LOW, EPS_HIGH = 0.2, 0.28


def hand_example():
    old = t64([[0.5, 0.6, 0.4], [0.25, 0.6, 0.3]]).log()
    new = t64([[0.5, 0.9, 0.3], [0.125, 0.9, 0.7]]).log().requires_grad_()
    adv = t64([1.0, -2.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return new, old, adv, mask


def test_policy_loss_hand_token_mean():
    new, old, adv, mask = hand_example()
    loss = policy_loss(new, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    torch.testing.assert_close(loss, t64(0.314))
    loss.backward()
    torch.testing.assert_close(new.grad, t64([[-0.2, 0.0, -0.15], [0.0, 0.6, 0.0]]))


def test_policy_loss_hand_seq_mean_token_mean():
    new, old, adv, mask = hand_example()
    loss = policy_loss(
        new, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, agg="seq-mean-token-mean"
    )
    torch.testing.assert_close(loss, t64(0.645))
    loss.backward()
    # seq 0 tokens weigh 1/(3·2), seq 1 tokens 1/(2·2)
    torch.testing.assert_close(new.grad, t64([[-1 / 6, 0.0, -0.75 / 6], [0.0, 3 / 4, 0.0]]))


def test_policy_loss_advantages_per_token_equal_broadcast():
    new, old, adv, mask = hand_example()
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH)
    loss_B = policy_loss(new, old, adv, mask, **kw)
    loss_BT = policy_loss(new, old, adv[:, None].expand(2, 3), mask, **kw)
    torch.testing.assert_close(loss_B, loss_BT, rtol=0, atol=0)


def test_policy_loss_hand_stats():
    new, old, adv, mask = hand_example()
    loss, stats = policy_loss(
        new, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, return_stats=True
    )
    torch.testing.assert_close(loss, t64(0.314))
    expected = {
        "clip_low_frac": 1 / 5,  # seq 1 t0
        "clip_high_frac": 1 / 5,  # seq 0 t1 (seq 1 t1 has r > 1.28 but Â < 0: not clipped)
        "clip_high_prob_mean": 0.6,  # old p of seq 0 t1
        "ratio_mean": (1 + 1.5 + 0.75 + 0.5 + 1.5) / 5,  # = 1.05
        "num_tokens": 5.0,
        "num_clip_high": 1.0,
        "dual_clip_frac": 0.0,  # dual-clip off
    }
    assert set(stats) == set(expected)
    for name, value in expected.items():
        assert stats[name].ndim == 0 and not stats[name].requires_grad, name
        assert stats[name].is_floating_point(), name
        torch.testing.assert_close(stats[name], t64(value), msg=name)


def test_policy_loss_stats_no_clip_high_gives_zero_prob_mean():
    logp = t64([[-1.0, -2.0]])
    _, stats = policy_loss(
        logp,
        logp,
        t64([1.0]),
        torch.ones(1, 2, dtype=torch.bool),
        eps_low=0.2,
        eps_high=0.28,
        return_stats=True,
    )
    assert stats["clip_high_prob_mean"].item() == 0.0
    assert stats["num_clip_high"].item() == 0.0
    assert stats["ratio_mean"].item() == 1.0


def one_token_grad(ratio: float, adv: float, eps_low: float, eps_high: float) -> float:
    old = t64([[math.log(0.5)]])
    new = (old + math.log(ratio)).detach().requires_grad_()
    loss = policy_loss(
        new,
        old,
        t64([adv]),
        torch.ones(1, 1, dtype=torch.bool),
        eps_low=eps_low,
        eps_high=eps_high,
    )
    loss.backward()
    return new.grad.item()


def test_clip_higher_asymmetry():
    # Â > 0, r = 1.25: inside [0.8, 1.28] under Clip-Higher -> gradient -Â·r = -1.25
    assert one_token_grad(1.25, 1.0, 0.2, 0.28) == pytest.approx(-1.25)
    # ... but clipped under the symmetric (0.2, 0.2) -> no gradient
    assert one_token_grad(1.25, 1.0, 0.2, 0.2) == 0.0
    # Â < 0, r = 0.75 < 0.8: clipped at the lower bound -> no gradient
    assert one_token_grad(0.75, -1.0, 0.2, 0.28) == 0.0
    # Â < 0, r = 0.85: inside -> gradient -Â·r = 0.85
    assert one_token_grad(0.85, -1.0, 0.2, 0.28) == pytest.approx(0.85)


def test_masked_garbage_gives_finite_loss_and_zero_grad():
    new, old, adv, mask = hand_example()
    ref = policy_loss(new, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    bad_new = new.detach().clone()
    bad_old = old.clone()
    bad_new[1, 2] = -math.inf
    bad_old[1, 2] = -math.inf  # -inf - -inf = NaN at the masked position
    bad_adv_BT = adv[:, None].expand(2, 3).clone()
    bad_adv_BT[1, 2] = math.nan
    variants = [(a, r, f) for a in AGG_MODES for r in algo.RATIO_LEVELS for f in algo.LOSS_FNS]
    for agg, ratio_level, loss_fn in variants:
        leaf = bad_new.clone().requires_grad_()
        loss, stats = policy_loss(
            leaf,
            bad_old,
            bad_adv_BT,
            mask,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            ratio_level=ratio_level,
            loss_fn=loss_fn,
            agg=agg,
            norm_len=3,
            return_stats=True,
        )
        loss.backward()
        assert torch.isfinite(loss)
        assert torch.isfinite(leaf.grad).all()
        assert leaf.grad[1, 2].item() == 0.0
        assert all(torch.isfinite(v) for v in stats.values())
        if (agg, ratio_level, loss_fn) == ("token-mean", "token", "clip"):
            torch.testing.assert_close(loss, ref.detach())


def test_policy_loss_validation():
    new, old, adv, mask = hand_example()
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.28, agg="seq-sum")
    with pytest.raises(ValueError, match=">= 0"):
        policy_loss(new, old, adv, mask, eps_low=-0.1, eps_high=0.28)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(new, old, adv[:1], mask, eps_low=0.2, eps_high=0.28)
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.28, num_tokens=0)


# --------------------------------------------------------------------------- exact accumulation

LENGTHS = [50, 3, 17, 1, 40, 8, 29, 12]  # very different response lengths
MICRO_SLICES = [slice(0, 3), slice(3, 5), slice(5, 8)]
RANK_SLICES = [slice(0, 4), slice(4, 8)]
TIGHT = dict(rtol=1e-6, atol=1e-7)


def random_minibatch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    # ratios spread over ~[0.6, 1.6] so both clips are active somewhere
    new = old + (torch.rand(B, T, generator=gen, dtype=F64) - 0.5)
    adv = torch.randn(B, generator=gen, dtype=F64)
    return new, old, adv, mask


def leaf_grad(new, old, adv, mask, sl, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = new[sl].clone().requires_grad_()
    loss = policy_loss(leaf, old[sl], adv[sl], mask[sl], eps_low=0.2, eps_high=0.28, **kw)
    loss.backward()
    return loss.detach(), leaf.grad


def full_and_split(split, agg, **count):
    """Loss and grad of the whole batch, and of the slices concatenated (summed losses)."""
    new, old, adv, mask = random_minibatch()
    full_loss, full_grad = leaf_grad(new, old, adv, mask, slice(None), agg=agg)
    parts = [leaf_grad(new, old, adv, mask, sl, agg=agg, **count) for sl in split]
    split_loss = sum(loss for loss, _ in parts)
    split_grad = torch.cat([grad for _, grad in parts])
    return full_loss, full_grad, split_loss, split_grad


@pytest.mark.parametrize("split", [MICRO_SLICES, RANK_SLICES], ids=["micro", "ranks"])
def test_token_mean_accumulates_exactly_with_global_token_count(split):
    _, _, _, mask = random_minibatch()
    num_tokens = int(mask.sum())  # whole mini-batch, all micro-batches / ranks
    assert num_tokens == sum(LENGTHS)
    full_loss, full_grad, split_loss, split_grad = full_and_split(
        split, "token-mean", num_tokens=num_tokens
    )
    torch.testing.assert_close(split_loss, full_loss, **TIGHT)
    torch.testing.assert_close(split_grad, full_grad, **TIGHT)


def test_token_mean_with_local_counts_is_not_the_batch_gradient():
    # The verl #5625-style bug: each micro-batch normalised by its own count, then averaged.
    new, old, adv, mask = random_minibatch()
    _, full_grad = leaf_grad(new, old, adv, mask, slice(None), agg="token-mean")
    parts = [leaf_grad(new, old, adv, mask, sl, agg="token-mean") for sl in MICRO_SLICES]
    naive_grad = torch.cat([grad for _, grad in parts]) / len(MICRO_SLICES)
    assert not torch.allclose(naive_grad, full_grad, rtol=1e-3, atol=1e-6)
    # e.g. the 50-token sequence: 1/103 per token in the batch, 1/(3·68) when averaged
    assert not torch.allclose(naive_grad[0], full_grad[0], rtol=1e-3)


@pytest.mark.parametrize("split", [MICRO_SLICES, RANK_SLICES], ids=["micro", "ranks"])
def test_seq_mean_token_mean_accumulates_exactly_with_global_seq_count(split):
    full_loss, full_grad, split_loss, split_grad = full_and_split(
        split, "seq-mean-token-mean", num_seqs=len(LENGTHS)
    )
    torch.testing.assert_close(split_loss, full_loss, **TIGHT)
    torch.testing.assert_close(split_grad, full_grad, **TIGHT)


def test_token_mean_accumulates_exactly_through_a_model():
    # Gradients w.r.t. parameters of a tiny model producing the logprobs, via the
    # same token_logprobs_from_logits path a trainer uses.
    torch.manual_seed(0)
    B, T, F, V = len(LENGTHS), max(LENGTHS), 6, 11
    model = torch.nn.Linear(F, V, dtype=F64)
    feats_BTF = torch.randn(B, T, F, dtype=F64)
    tokens_BT = torch.randint(0, V, (B, T))
    _, _, adv, mask = random_minibatch()
    with torch.no_grad():
        old_BT = token_logprobs_from_logits(model(feats_BTF), tokens_BT) + 0.3 * torch.randn(B, T)
    num_tokens = mask.sum()  # a tensor, as an all-reduced count would be

    def grads(slices, **kw):
        model.zero_grad()
        total = 0.0
        for sl in slices:
            logp_BT = token_logprobs_from_logits(model(feats_BTF[sl]), tokens_BT[sl])
            loss = policy_loss(
                logp_BT, old_BT[sl], adv[sl], mask[sl], eps_low=0.2, eps_high=0.28, **kw
            )
            loss.backward()
            total = total + loss.detach()
        return total, [p.grad.clone() for p in model.parameters()]

    full_loss, full_grads = grads([slice(None)])
    micro_loss, micro_grads = grads(MICRO_SLICES, num_tokens=num_tokens)
    torch.testing.assert_close(micro_loss, full_loss, **TIGHT)
    for micro, full in zip(micro_grads, full_grads, strict=True):
        assert full.abs().sum() > 0
        torch.testing.assert_close(micro, full, **TIGHT)


def test_token_level_vs_sample_level_loss():
    new, old, adv, mask = random_minibatch()
    kw = dict(eps_low=0.2, eps_high=0.28)
    token = policy_loss(new, old, adv, mask, agg="token-mean", **kw)
    sample = policy_loss(new, old, adv, mask, agg="seq-mean-token-mean", **kw)
    assert not torch.allclose(token, sample, rtol=1e-3)
    # with equal lengths, Σ/(B·L) is the mean of the per-sequence means
    equal_mask = torch.zeros_like(mask)
    equal_mask[:, :10] = True
    token = policy_loss(new, old, adv, equal_mask, agg="token-mean", **kw)
    sample = policy_loss(new, old, adv, equal_mask, agg="seq-mean-token-mean", **kw)
    torch.testing.assert_close(token, sample, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------------------- aggregate


def test_aggregate_hand_values_and_empty_rows():
    values = t64([[1.0, 2.0, 3.0], [4.0, math.inf, math.nan], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    torch.testing.assert_close(aggregate(values, mask), t64(2.5))
    torch.testing.assert_close(aggregate(values, mask, num_tokens=10), t64(1.0))
    torch.testing.assert_close(aggregate(values, mask, num_tokens=torch.tensor(20)), t64(0.5))
    # seq-mean-token-mean: seq means [2, 4, 0 (empty row)] summed / B=3 = 2
    agg = "seq-mean-token-mean"
    torch.testing.assert_close(aggregate(values, mask, agg=agg), t64(2.0))
    torch.testing.assert_close(aggregate(values, mask, agg=agg, num_seqs=2), t64(3.0))


def test_aggregate_all_masked_is_zero_not_nan():
    values = torch.randn(2, 3, dtype=F64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for agg in AGG_MODES:
        out = aggregate(values, mask, agg=agg, norm_len=3)
        assert out.item() == 0.0
        (grad,) = torch.autograd.grad(out, values)
        assert torch.equal(grad, torch.zeros_like(grad))


def test_aggregate_validation():
    values, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(values, mask, agg="mean")
    with pytest.raises(ValueError, match="bool"):
        aggregate(values, mask.float())
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(values, mask[:, :2])
    with pytest.raises(ValueError, match="num_seqs"):
        aggregate(values, mask, agg="seq-mean-token-mean", num_seqs=0)


# --------------------------------------------------------------------------- kl, entropy, logprobs


def test_kl_k3_values():
    logp = torch.randn(4, 5, dtype=F64)
    assert torch.equal(kl_k3(logp, logp), torch.zeros_like(logp))
    # d = ref - logp = log 2: kl = 2 - log 2 - 1
    kl = kl_k3(t64([math.log(0.25)]), t64([math.log(0.5)]))
    torch.testing.assert_close(kl, t64([1 - math.log(2)]))
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1000, generator=gen, dtype=F64) * 5 for _ in range(2))
    assert (kl_k3(a, b) >= 0).all()
    # clamped, so no overflow on absurd inputs
    assert torch.isfinite(kl_k3(t64([-1e4, 0.0]), t64([0.0, -1e4]))).all()


def test_entropy_uniform_and_one_hot():
    V = 7
    torch.testing.assert_close(
        entropy_from_logits(torch.zeros(2, 3, V, dtype=F64)),
        torch.full((2, 3), math.log(V), dtype=F64),
    )
    logits = torch.full((2, V), -math.inf, dtype=F64)
    logits[:, 0] = 0.0
    logits.requires_grad_()
    ent = entropy_from_logits(logits)
    assert torch.equal(ent.detach(), torch.zeros(2, dtype=F64))
    ent.sum().backward()
    assert not torch.isnan(logits.grad).any()


def test_entropy_matches_definition_and_upcasts_bf16():
    logits = torch.randn(3, 4, 50, dtype=F64)
    p = torch.softmax(logits, -1)
    expected = -(p * p.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    out = entropy_from_logits(logits.to(torch.bfloat16))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, entropy_from_logits(logits.to(torch.bfloat16).float()))


def test_token_logprobs_match_log_softmax_gather():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 17, generator=gen, dtype=F64) * 4).requires_grad_()
    tokens = torch.randint(0, 17, (3, 5), generator=gen)
    out = token_logprobs_from_logits(logits, tokens)
    ref = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref)
    (g_out,) = torch.autograd.grad(out.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(g_out, g_ref)


def test_token_logprobs_bf16_is_float32():
    logits = torch.randn(2, 3, 19).to(torch.bfloat16)
    tokens = torch.randint(0, 19, (2, 3))
    out = token_logprobs_from_logits(logits, tokens)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="long"):
        token_logprobs_from_logits(logits, tokens.int())
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs_from_logits(logits, tokens[:, :2])


def test_entropy_is_computed_in_blocks_with_the_same_values(monkeypatch):
    """Several row blocks (as with a 151k vocabulary) give the one-block values exactly."""
    logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    whole = algo.entropy_from_logits(logits)
    monkeypatch.setattr(algo.logits, "UPCAST_CHUNK_ELEMENTS", 2 * 7)  # 2 rows per block: 8 blocks
    blocks = algo.entropy_from_logits(logits)
    assert blocks.dtype == torch.float32 and blocks.shape == (3, 5)
    assert torch.equal(blocks, whole)
    assert algo.entropy_from_logits(logits[:0]).shape == (0, 5)


# ----------------------------------------------------------------------------- reward shaping


def _shaped(scores, correct, lengths, truncated, **kwargs):
    return algo.shape_rewards(
        torch.tensor(scores, dtype=torch.float64),
        torch.tensor(correct),
        torch.tensor(lengths),
        torch.tensor(truncated),
        **kwargs,
    )


def test_shape_rewards_soft_punishment_hand_values():
    # L_max 20, L_cache 4: free up to 16 tokens, then -1/4 per token, -1 at 20 (and beyond).
    args = ([1.0, 1.0, -1.0, 1.0], [True, True, False, True], [16, 17, 18, 20])
    truncated = [False, False, False, True]
    rewards, correct, trainable = _shaped(*args, truncated, l_max=20, l_cache=4)
    assert rewards.dtype == torch.float64
    assert rewards.tolist() == [1.0, 0.75, -1.5, 0.0]
    assert correct.tolist() == [True, True, False, True]  # correctness is the verifier's
    assert trainable.tolist() == [True] * 4
    half, _, _ = _shaped(*args, truncated, l_max=20, l_cache=4, factor=0.5)
    assert half.tolist() == [1.0, 0.875, -1.25, 0.5]


def test_shape_rewards_is_correctness_plus_the_overlong_penalty():
    g = torch.Generator().manual_seed(0)
    correct = torch.rand(64, generator=g) < 0.5
    scores = torch.where(correct, 1.0, -1.0).double()
    lengths = torch.randint(1, 31, (64,), generator=g)
    truncated = lengths > 28
    rewards, same, _ = algo.shape_rewards(scores, correct, lengths, truncated, l_max=28, l_cache=8)
    expected = scores + algo.overlong_penalty(lengths, 28, 8).double()
    assert torch.equal(rewards, expected) and torch.equal(same, correct)


def test_shape_rewards_overlong_filter_masks_truncated_only_and_keeps_rewards():
    rewards, correct, trainable = _shaped(
        [1.0, -1.0, 1.0],
        [True, False, True],
        [20, 19, 5],
        [True, False, False],
        l_max=20,
        l_cache=0,
        soft_punish=False,
        filter_truncated=True,
    )
    assert rewards.tolist() == [1.0, -1.0, 1.0]  # filtered, not punished
    assert correct.tolist() == [True, False, True]
    assert trainable.tolist() == [False, True, True]


def test_shape_rewards_without_either_technique_scores_truncation_minus_one_and_wrong():
    # The naive baseline; l_cache is not used, so an invalid one is no error.
    rewards, correct, trainable = _shaped(
        [1.0, 1.0, -1.0],
        [True, True, False],
        [20, 18, 20],
        [True, False, True],
        l_max=20,
        l_cache=0,
        soft_punish=False,
    )
    assert rewards.tolist() == [-1.0, 1.0, -1.0]
    assert correct.tolist() == [False, True, False]  # the filter sees the reward trained on
    assert trainable.tolist() == [True, True, True]
    with pytest.raises(ValueError, match="bool"):
        _shaped([1.0], [1], [3], [False], l_max=4, l_cache=2)


def test_shape_rewards_soft_punishment_and_filter_together():
    rewards, _, trainable = _shaped(
        [1.0, 1.0],
        [True, True],
        [18, 20],
        [False, True],
        l_max=20,
        l_cache=4,
        filter_truncated=True,
    )
    assert rewards.tolist() == [0.5, 0.0] and trainable.tolist() == [True, False]


def test_token_sums_over_the_loss_tokens():
    entropy = torch.tensor([[0.5, 1.0, 9.0], [2.0, 9.0, 9.0]])
    old_logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.125, 0.9, 0.9]]))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    sums = algo.token_sums(entropy, old_logprobs, mask)
    assert sums["entropy_sum"].item() == pytest.approx(3.5)
    assert sums["prob_sum"].item() == pytest.approx(0.875)


def test_max_abs_gap():
    a, b = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.25, -2.0, -2.5])
    assert algo.max_abs_gap(a, b).item() == 0.5
    assert algo.max_abs_gap(a[:0], b[:0]).item() == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        algo.max_abs_gap(a, b[:2])


# ----------------------------------------------------------------------------- dual-clip


def _one_token(ratio: float, advantage: float, *, clip_ratio_c: float):
    """The loss, its gradient with respect to log pi, and the stats, for a single token."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(
        logp,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        eps_low=0.2,
        eps_high=0.28,
        clip_ratio_c=clip_ratio_c,
        return_stats=True,
    )
    loss.backward()
    return loss.item(), logp.grad.item(), stats["dual_clip_frac"].item()


def test_dual_clip_caps_a_negative_advantage_tokens_loss_at_minus_c_a():
    # A = -1, r = 12: unclipped the loss is -min(12 * -1, 1.28 * -1) = 12, gradient
    # -A r = 12 in log pi; with c = 10 the loss is -c A = 10 and the gradient 0.
    assert _one_token(12.0, -1.0, clip_ratio_c=0.0) == pytest.approx((12.0, 12.0, 0.0))
    assert _one_token(12.0, -1.0, clip_ratio_c=10.0) == pytest.approx((10.0, 0.0, 1.0))
    # Below c the bound is not active: r = 3, A = -0.5 gives loss 1.5, gradient 1.5.
    assert _one_token(3.0, -0.5, clip_ratio_c=10.0) == pytest.approx((1.5, 1.5, 0.0))


def test_dual_clip_leaves_positive_advantages_alone():
    # A = 2, r = 12: the upper clip already holds the loss at -1.28 * 2 with zero gradient.
    assert _one_token(12.0, 2.0, clip_ratio_c=10.0) == _one_token(12.0, 2.0, clip_ratio_c=0.0)
    assert _one_token(12.0, 2.0, clip_ratio_c=10.0) == pytest.approx((-2.56, 0.0, 0.0))
    # r = 0.9 within the clip range: loss -r A = -1.8, gradient -r A = -1.8.
    assert _one_token(0.9, 2.0, clip_ratio_c=10.0) == pytest.approx((-1.8, -1.8, 0.0))


def test_dual_clip_bound_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be 0"):
        _one_token(1.0, 1.0, clip_ratio_c=0.5)


def test_kl_k3_is_capped_at_ten():
    kl = kl_k3(torch.tensor([0.0]), torch.tensor([15.0]))  # exp(15) - 16 is about 3.3e6
    assert kl.item() == 10.0


@pytest.mark.parametrize(("log_ratio", "expected"), [(15.0, math.exp(15)), (25.0, math.exp(20))])
def test_the_log_ratio_is_clamped_at_twenty(log_ratio, expected):
    # LOG_RATIO_CLAMP = 20, as verl: A = -1 and r = e^15 (log-ratio 15, inside the clamp):
    # min(r A, clip(r, 0.8, 1.28) A) = min(-e^15, -1.28) = -e^15, so the loss is e^15 and its
    # gradient in log pi is -A r = e^15. A log-ratio of 25 is clamped to 20: loss e^20, and no
    # gradient past the clamp.
    logp = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    loss = policy_loss(
        logp,
        t64([[-1.0 - log_ratio]]),
        t64([-1.0]),
        torch.ones(1, 1, dtype=torch.bool),
        eps_low=0.2,
        eps_high=0.28,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert logp.grad.item() == pytest.approx(expected if log_ratio < 20 else 0.0, rel=1e-12)
