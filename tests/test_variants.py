"""DAPO's successors as switches, against hand-computed values: batch-level and no std
normalisation (Dr. GRPO), the constant length normaliser (Dr. GRPO), the sequence-level ratio
(GSPO) and the clipped stop-gradient weight (CISPO); each collapses to the DAPO loss where the
formulas coincide."""

import math

import pytest
import torch

from dapo import algo

F64 = torch.float64
SCORES = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]], dtype=F64)


def test_advantage_norms_by_hand():
    group = algo.group_advantages(SCORES, eps=0.0)
    s0, s1 = math.sqrt(1 / 3), 0.5  # unbiased stds of the two groups
    expected = [
        [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0],
        [x / s1 for x in (0.25,) * 3 + (-0.75,)],
    ]
    torch.testing.assert_close(group, torch.tensor(expected, dtype=F64))
    batch = algo.group_advantages(SCORES, eps=0.0, norm="batch")
    sb = math.sqrt((5 * 0.375**2 + 3 * 0.625**2) / 7)  # all eight rewards, mean 0.625
    centred = [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]
    torch.testing.assert_close(batch, torch.tensor(centred, dtype=F64) / sb)
    none = algo.group_advantages(SCORES, eps=0.0, norm="none")
    torch.testing.assert_close(none, torch.tensor(centred, dtype=F64))


def test_advantage_norms_agree_where_they_coincide():
    one_group = SCORES[:1]  # one group: its std is the batch's
    assert torch.equal(
        algo.group_advantages(one_group, norm="batch"), algo.group_advantages(one_group)
    )
    constant = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0]], dtype=F64)
    for norm in algo.ADV_NORMS:  # a constant group is exactly zero however it is divided
        assert torch.equal(algo.group_advantages(constant, norm=norm)[0], torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="norm must be one of"):
        algo.group_advantages(SCORES, norm="global")


def test_constant_length_normaliser_by_hand_and_where_it_coincides():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = algo.aggregate(values, mask, agg="seq-mean-token-sum-norm", norm_len=4)
    assert out.item() == pytest.approx((6 / 4 + 9 / 4) / 2)
    # Split into micro-batches with the mini-batch's count, the parts add up to the whole.
    parts = [
        algo.aggregate(values[i : i + 1], mask[i : i + 1], agg="seq-mean-token-sum-norm",
                       num_seqs=2, norm_len=4)
        for i in range(2)
    ]  # fmt: skip
    assert sum(parts).item() == pytest.approx(out.item())
    full = torch.ones(2, 3, dtype=torch.bool)  # every response exactly norm_len long
    assert algo.aggregate(values, full, agg="seq-mean-token-sum-norm", norm_len=3).item() == (
        pytest.approx(algo.aggregate(values, full, agg="seq-mean-token-mean").item())
    )
    with pytest.raises(ValueError, match="needs norm_len"):
        algo.aggregate(values, mask, agg="seq-mean-token-sum-norm")


OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]], dtype=F64)
DELTA = torch.tensor([[0.1, -0.2, 0.4], [0.3, 0.1, 0.0]], dtype=F64)
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([1.0, -1.0], dtype=F64)


def loss_and_grad(**kw):
    logp = (OLD + DELTA).requires_grad_(True)
    loss = algo.policy_loss(logp, OLD, ADV, MASK, **{"eps_low": 0.2, "eps_high": 0.28, **kw})
    loss.backward()
    return loss.item(), logp.grad


def test_gspo_sequence_ratio_by_hand():
    s0, s1 = math.exp(0.1), math.exp(0.2)  # each response's mean log-ratio
    loss, grad = loss_and_grad(ratio_level="sequence")
    assert loss == pytest.approx(-(3 * s0 - 2 * s1) / 5)  # token-mean over 5 tokens
    expected = torch.tensor([[-s0, -s0, -s0], [s1, s1, 0.0]], dtype=F64) / 5
    torch.testing.assert_close(grad, expected)
    # The clip acts on whole responses: above 1 + eps_high response 0 gives no gradient at all.
    _, grad = loss_and_grad(ratio_level="sequence", eps_high=0.05)
    assert torch.equal(grad[0], torch.zeros(3, dtype=F64)) and grad[1, 0] != 0
    # GSPO's own objective: the mean over responses of min(s A, clip(s) A).
    loss, _ = loss_and_grad(ratio_level="sequence", agg="seq-mean-token-mean")
    assert loss == pytest.approx(-(s0 - s1) / 2)


def test_gspo_is_the_token_ratio_on_one_token_responses():
    logp = (OLD + DELTA)[:, :1]
    for eps_high in (0.28, 0.05):
        kw = dict(eps_low=0.2, eps_high=eps_high)
        a = logp.clone().requires_grad_(True)
        b = logp.clone().requires_grad_(True)
        la = algo.policy_loss(a, OLD[:, :1], ADV, MASK[:, :1], ratio_level="sequence", **kw)
        lb = algo.policy_loss(b, OLD[:, :1], ADV, MASK[:, :1], **kw)
        (la + lb).backward()
        assert la.item() == pytest.approx(lb.item())
        torch.testing.assert_close(a.grad, b.grad)


def test_cispo_by_hand():
    r = torch.exp(DELTA)
    w = r.clamp(0.0, 1.28)  # eps_low = 1: no lower bound, as in MiniMax-M1
    loss, grad = loss_and_grad(loss_fn="cispo", eps_low=1.0)
    sign = torch.tensor([[1.0], [-1.0]], dtype=F64)
    logp = OLD + DELTA
    assert loss == pytest.approx(-float((w * sign * logp)[MASK].sum()) / 5)
    torch.testing.assert_close(grad, torch.where(MASK, -w * sign / 5, torch.zeros_like(w)))
    # Token (0, 2) has ratio e^0.4 > 1.28 with a positive advantage: the clipped surrogate
    # drops its gradient, CISPO keeps it at weight 1.28.
    _, clip_grad = loss_and_grad(eps_low=1.0)
    assert clip_grad[0, 2] == 0 and grad[0, 2] == pytest.approx(-1.28 / 5)


def test_cispo_counts_its_weight_capped_whatever_the_advantages_sign():
    # Ratios e^DELTA: (0, 2) = e^0.4 = 1.49 with Â = +1 and (1, 0) = e^0.3 = 1.35 with Â = -1
    # pass 1 + 0.28. min() clips only the first (Â > 0); CISPO caps both weights at 1.28.
    kw = dict(eps_low=1.0, eps_high=0.28, return_stats=True)
    _, clipped = algo.policy_loss(OLD + DELTA, OLD, ADV, MASK, **kw)
    _, cispo = algo.policy_loss(OLD + DELTA, OLD, ADV, MASK, loss_fn="cispo", **kw)
    assert clipped["clip_high_frac"] == pytest.approx(1 / 5)
    assert clipped["clip_high_prob_mean"] == pytest.approx(math.exp(-0.5))
    assert cispo["clip_high_frac"] == pytest.approx(2 / 5)  # it was 1/5: (1, 0) not counted
    assert cispo["clip_high_prob_mean"] == pytest.approx((math.exp(-0.5) + math.exp(-1.5)) / 2)
    # A lower bound: (0, 1) = e^-0.2 = 0.82 < 0.9 with Â = +1 clips for CISPO only.
    low = dict(eps_low=0.1, eps_high=0.28, return_stats=True)
    assert algo.policy_loss(OLD + DELTA, OLD, ADV, MASK, **low)[1]["clip_low_frac"] == 0
    _, cispo = algo.policy_loss(OLD + DELTA, OLD, ADV, MASK, loss_fn="cispo", **low)
    assert cispo["clip_low_frac"] == pytest.approx(1 / 5)


def test_cispo_has_the_clipped_losss_gradient_where_no_clip_is_active():
    for logp_delta in (torch.zeros_like(DELTA), 0.05 * DELTA):  # on-policy, and slightly off
        logp = OLD + logp_delta
        grads = []
        for loss_fn in algo.LOSS_FNS:
            leaf = logp.clone().requires_grad_(True)
            algo.policy_loss(
                leaf, OLD, ADV, MASK, eps_low=0.2, eps_high=0.28, loss_fn=loss_fn
            ).backward()
            grads.append(leaf.grad)
        torch.testing.assert_close(grads[0], grads[1])


def test_a_loss_variant_is_one_registered_function(monkeypatch):
    """policy_loss composes the registered ratio, objective and aggregation by name: a new
    objective (here the plain policy gradient, J = Â logp) is one function and one line."""
    from dapo.algo import variants

    def vanilla_pg(ratio_BT, adv_BT, logprobs, mask, *, eps_low, eps_high, clip_ratio_c):
        return adv_BT * torch.where(mask, logprobs, torch.zeros_like(logprobs)), None

    monkeypatch.setitem(variants.OBJECTIVES, "vanilla_pg", vanilla_pg)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, -2.0])
    loss = algo.policy_loss(
        logp, logp.detach() - 1.0, adv, mask, eps_low=0.2, eps_high=0.28, loss_fn="vanilla_pg"
    )
    loss.backward()
    # -(1 * -1 + 1 * -2 + -2 * -0.5) / 3 masked tokens; d/dlogp = -Â / 3 where masked.
    assert loss.item() == pytest.approx(2 / 3)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0.0]]))
    assert set(variants.RATIOS) == set(algo.RATIO_LEVELS)
    assert set(variants.AGGREGATIONS) == set(algo.AGG_MODES)
    assert tuple(variants.OBJECTIVES)[: len(algo.LOSS_FNS)] == algo.LOSS_FNS


def test_variant_names_are_checked():
    with pytest.raises(ValueError, match="ratio_level must be one of"):
        loss_and_grad(ratio_level="group")
    with pytest.raises(ValueError, match="loss_fn one of"):
        loss_and_grad(loss_fn="reinforce")


@pytest.mark.parametrize(
    ("ratio_level", "loss_fn", "agg"),
    [
        ("sequence", "clip", "token-mean"),
        ("sequence", "clip", "seq-mean-token-mean"),
        ("token", "cispo", "token-mean"),
        ("token", "clip", "seq-mean-token-sum-norm"),
    ],
)
def test_each_variant_accumulates_exactly_over_micro_batches(ratio_level, loss_fn, agg):
    """Rows split into micro-batches, each divided by the whole mini-batch's counts: the
    gradients add up to the one-batch gradient (a response never spans two micro-batches)."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 5, generator=gen, dtype=F64) * 3
    logp = old + 0.1 * torch.randn(6, 5, generator=gen, dtype=F64)
    adv = torch.randn(6, generator=gen, dtype=F64)
    mask = torch.arange(5) < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]
    kw = dict(eps_low=0.2, eps_high=0.28, ratio_level=ratio_level, loss_fn=loss_fn, agg=agg)
    kw |= dict(num_tokens=int(mask.sum()), num_seqs=6, norm_len=5)
    whole = logp.clone().requires_grad_(True)
    algo.policy_loss(whole, old, adv, mask, **kw).backward()
    parts = logp.clone().requires_grad_(True)
    for rows in ([0, 1], [2, 3, 4], [5]):
        algo.policy_loss(parts[rows], old[rows], adv[rows], mask[rows], **kw).backward()
    torch.testing.assert_close(parts.grad, whole.grad, rtol=0, atol=1e-15)
