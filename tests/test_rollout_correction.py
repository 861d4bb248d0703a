"""algo.rollout_correction: the TIS / MIS weights of an engine's log-probs, by hand."""

import math

import pytest
import torch

from dapo import algo

LN = math.log
# d = log pi_old - log pi_rollout: row 0 has token ratios 3, 1/4, 1 (sequence ratio 3/4),
# row 1 has 1.5, 1.2 (sequence ratio 1.8) and one padding position holding garbage.
ROLLOUT = torch.tensor([[-2.0, -1.0, -3.0], [-1.0, -2.0, 99.0]])
OLD = torch.tensor(
    [[-2.0 + LN(3), -1.0 - LN(4), -3.0], [-1.0 + LN(1.5), -2.0 + LN(1.2), -math.inf]]
)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def weights(mode: str, threshold: float = 2.0):
    return algo.rollout_correction(OLD, ROLLOUT, MASK, mode=mode, threshold=threshold)


@pytest.mark.parametrize(
    ("mode", "threshold", "expected", "frac"),
    [
        ("none", 2.0, [[1, 1, 1], [1, 1, 0]], 0.0),
        ("token_tis", 2.0, [[2, 0.25, 1], [1.5, 1.2, 0]], 1 / 5),
        ("seq_tis", 2.0, [[0.75, 0.75, 0.75], [1.8, 1.8, 0]], 0.0),
        ("seq_tis", 1.5, [[0.75, 0.75, 0.75], [1.5, 1.5, 0]], 2 / 5),
        ("token_mis", 2.0, [[0, 0, 1], [1, 1, 0]], 2 / 5),
        ("seq_mis", 2.0, [[1, 1, 1], [1, 1, 0]], 0.0),
        ("seq_mis", 1.5, [[1, 1, 1], [0, 0, 0]], 2 / 5),
    ],
)
def test_weights_and_corrected_fraction_by_hand(mode, threshold, expected, frac):
    w, stats = weights(mode, threshold)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float32))
    assert float(stats["corrected_frac"]) == pytest.approx(frac)
    assert float(stats["num_tokens"]) == 5


def test_mismatch_metrics_by_hand():
    _, stats = weights("token_tis")
    d = [LN(3), -LN(4), 0.0, LN(1.5), LN(1.2)]
    assert float(stats["mismatch_abs"]) == pytest.approx(sum(abs(x) for x in d) / 5)
    # k3 of KL(pi_rollout || pi_old) from tokens drawn by pi_rollout: exp(d) - d - 1.
    assert float(stats["mismatch_kl"]) == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 5)


def test_identical_policies_give_unit_weights_and_zero_mismatch():
    for mode in algo.CORRECTION_MODES:
        w, stats = algo.rollout_correction(ROLLOUT, ROLLOUT, MASK, mode=mode, threshold=2.0)
        assert torch.equal(w, MASK.float())
        assert float(stats["mismatch_abs"]) == 0 and float(stats["corrected_frac"]) == 0


def test_validation():
    with pytest.raises(ValueError, match="one of"):
        weights("tis")
    with pytest.raises(ValueError, match="> 1"):
        weights("token_tis", 1.0)
    with pytest.raises(ValueError, match="same"):
        algo.rollout_correction(OLD, ROLLOUT[:, :2], MASK, mode="seq_mis", threshold=2.0)


def test_policy_loss_weights_each_tokens_term_and_keeps_the_divisor():
    """At ratio 1 (no clip) loss = -Σ w A / num_tokens and d loss / d logp = -w A / num_tokens."""
    w, _ = weights("token_tis")
    adv = torch.tensor([1.0, -1.0])
    logp = OLD.clone().requires_grad_(True)
    loss = algo.policy_loss(logp, OLD, adv, MASK, eps_low=0.2, eps_high=0.28, weights=w)
    assert float(loss.detach()) == pytest.approx(-(2 + 0.25 + 1 - 1.5 - 1.2) / 5)
    loss.backward()
    expected = -(w * torch.tensor([[1.0], [-1.0]])) / 5
    torch.testing.assert_close(logp.grad, expected)


def test_unit_weights_are_bit_identical_to_none():
    logp = OLD + 0.1 * torch.tensor([[1.0, -2.0, 0.5], [3.0, -1.0, 0.0]])
    adv = torch.tensor([0.7, -1.3])
    kw = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    plain = algo.policy_loss(logp, OLD, adv, MASK, **kw)
    ones, _ = weights("none")
    assert torch.equal(algo.policy_loss(logp, OLD, adv, MASK, weights=ones, **kw), plain)


def test_seq_mis_drops_a_response_but_not_its_share_of_the_divisor():
    w, _ = weights("seq_mis", 1.5)
    logp = OLD + 0.05
    adv = torch.tensor([0.5, 2.0])
    kw = dict(eps_low=0.2, eps_high=0.28)
    kept_only = algo.policy_loss(logp, OLD, adv, MASK & (w > 0), num_tokens=5, **kw)
    assert torch.equal(algo.policy_loss(logp, OLD, adv, MASK, weights=w, **kw), kept_only)


def test_mismatch_metrics_count_the_trained_tokens_only():
    """A response overlong filtering drops is never trained: its gap between the sampler and
    pi_old (1.5 a token here) counted in mismatch/*, documented per trained token."""
    from types import SimpleNamespace

    from dapo.config import load_config
    from dapo.data.batch import Episode
    from dapo.training.old_logprobs import set_loss_weights

    cfg = load_config(None, ["algo.overlong_filter=true", "algo.overlong_shaping=false"])
    state = SimpleNamespace(cfg=cfg, engine=SimpleNamespace(exact_logprobs=False))

    def episode(gap: float, trainable: bool) -> Episode:
        ids = torch.ones(4, dtype=torch.long)
        e = Episode(ids[:3], ids, torch.zeros(4), truncated=True, correct=False, reward=-1.0)
        e.old_logprobs, e.trainable = torch.full((4,), gap), trainable
        return e

    kept, dropped = episode(0.25, True), episode(1.5, False)
    metrics = set_loss_weights(state, [kept, dropped], [0, 1], [0, 1], sampler_is_policy=False)
    assert metrics["mismatch/abs_log_ratio"] == pytest.approx(0.25)
    assert metrics["mismatch/corrected_frac"] == 0.0
