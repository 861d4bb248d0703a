import json
import math

import pytest
import torch
from helpers import plus_one_problems

from dapo.config import AlgoConfig, load_config
from dapo.data.batch import Episode, collate, length_sorted, split_microbatches
from dapo.data.problems import Problem
from dapo.run.seeding import derive_seed
from dapo.training import step as trainer
from dapo.training.old_logprobs import fill_logprobs, set_old_logprobs
from dapo.training.rounds import sample_round, shape_group
from dapo.training.sampling import Group
from dapo.training.sources import InTurn
from dapo.training.state import build_state
from dapo.training.step import assign_advantages, lr_at
from dapo.training.update import accumulate_gradients, micro_loss, update


def _episode(length: int, *, correct=True, truncated=False, prompt_len=5, seed=0) -> Episode:
    g = torch.Generator().manual_seed(seed)
    return Episode(
        prompt_ids=torch.randint(5, 60, (prompt_len,), generator=g),
        response_ids=torch.randint(5, 60, (length,), generator=g),
        sampler_logprobs=-torch.rand(length, generator=g),
        truncated=truncated,
        correct=correct,
        reward=1.0 if correct else -1.0,
    )


def _cfg(*overrides: str):
    return load_config(None, ["rollout.max_new_tokens=20", "algo.l_cache=4", *overrides])


def _shape(episodes, cfg) -> None:
    shape_group(episodes, cfg.algo, l_max=cfg.rollout.max_new_tokens)


def test_soft_overlong_punishment_adds_to_the_correctness_reward():
    # l_max 20, l_cache 4: free up to 16, then -1/4 per token, -1 at 20.
    eps = [_episode(16), _episode(17), _episode(18, correct=False), _episode(20, truncated=True)]
    _shape(eps, _cfg())
    assert [e.reward for e in eps] == [1.0, 0.75, -1.5, 0.0]
    assert all(e.trainable for e in eps)


def test_overlong_filter_masks_truncated_responses_only():
    eps = [_episode(20, truncated=True), _episode(19, correct=False)]
    _shape(eps, _cfg("algo.overlong_shaping=false", "algo.overlong_filter=true"))
    assert [e.trainable for e in eps] == [False, True]
    assert [e.reward for e in eps] == [1.0, -1.0]  # filtered, not punished
    assert [e.num_loss_tokens for e in eps] == [0, 19]
    b = collate(eps, pad_id=0)
    assert b.loss_mask_BT.sum(dim=1).tolist() == [0, 19]
    assert b.response_mask_BT.sum(dim=1).tolist() == [20, 19]


def test_naive_baseline_scores_truncation_minus_one():
    eps = [_episode(20, truncated=True, correct=True), _episode(18)]
    _shape(eps, _cfg("run.preset=grpo"))
    assert [e.reward for e in eps] == [-1.0, 1.0]
    # A truncated response is wrong too: a group is kept or dropped on the reward it gets.
    assert [e.correct for e in eps] == [False, True]


def test_group_advantages_are_assigned_per_group():
    groups = [
        Group("a", [_episode(3, correct=c) for c in (True, False, False, False)]),
        Group("b", [_episode(3, correct=True) for _ in range(4)]),
    ]
    assign_advantages(groups, eps=0.0)
    # rewards [1,-1,-1,-1]: mean -0.5, unbiased std 1 -> [1.5, -0.5, -0.5, -0.5]
    assert [e.advantage for e in groups[0].episodes] == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert [e.advantage for e in groups[1].episodes] == [0.0] * 4


def test_microbatches_cover_every_index_within_the_budget():
    eps = [_episode(n, prompt_len=2 + n % 5, seed=n) for n in (10, 3, 8, 1, 12, 6)]
    chunks = split_microbatches(eps, range(6), max_tokens=40)
    assert sorted(i for c in chunks for i in c) == list(range(6))
    for c in chunks:
        width = max(eps[i].prompt_ids.numel() for i in c) + max(eps[i].length for i in c)
        assert len(c) == 1 or width * len(c) <= 40


def _grads_after_accumulation(tiny_model, tokenizer, episodes, *overrides):
    cfg = _cfg(*overrides)
    state = build_state(cfg, tiny_model, tokenizer, [Problem("p", (), "1")])
    tiny_model.zero_grad(set_to_none=True)
    sums = accumulate_gradients(
        state,
        episodes,
        num_tokens=sum(e.num_loss_tokens for e in episodes),
        num_seqs=len(episodes),
    ).read()
    return [p.grad.clone() for p in tiny_model.parameters()], sums


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gradient_is_independent_of_the_microbatch_split(tiny_model, tokenizer, agg):
    """DAPO's token-level loss divides by the whole mini-batch's token count: one micro-batch or
    many must give the same gradient through a real transformer."""
    torch.manual_seed(0)
    eps = [
        _episode(n, seed=n, prompt_len=3 + n % 4, correct=n % 2 == 0) for n in (12, 2, 7, 1, 9, 4)
    ]
    for i, e in enumerate(eps):
        e.advantage = (-1.0) ** i * (0.5 + i / 10)
        e.old_logprobs = e.sampler_logprobs
    whole, s1 = _grads_after_accumulation(
        tiny_model, tokenizer, eps, f"algo.loss_agg={agg}", "train.tokens_per_microbatch=100000"
    )
    split, s2 = _grads_after_accumulation(
        tiny_model, tokenizer, eps, f"algo.loss_agg={agg}", "train.tokens_per_microbatch=16"
    )
    assert s2["tokens"] == s1["tokens"] == sum(e.length for e in eps)
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert s1["loss"] == pytest.approx(s2["loss"], rel=1e-5)


def test_lr_warms_up_linearly_over_rollout_steps():
    cfg = load_config(None, ["optim.lr=1e-3", "optim.warmup_steps=4"])
    assert [lr_at(cfg.optim, s) for s in range(6)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    )


def test_seeds_differ_per_step_and_round_and_repeat():
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    assert len({derive_seed(0, s, r) for s in range(10) for r in range(10)}) == 100


def test_length_sorted_keeps_a_prompts_rows_together_longest_first():
    a, b = torch.tensor([7, 8, 9]), torch.tensor([7, 8])
    eps = [
        Episode(p, torch.ones(n, dtype=torch.long), torch.zeros(n), False, True, 1.0)
        for p, n in [(a, 2), (b, 3), (a, 6), (b, 1), (a, 2), (b, 6)]
    ]
    # Prompt a's rows (0, 2, 4; longest total 9) before b's (1, 3, 5; longest 8), each
    # group's rows by decreasing response length, ties in input order.
    assert length_sorted(eps, range(6)) == [2, 0, 4, 5, 1, 3]

    # Sorted, a budget of 20 padded tokens needs fewer micro-batches and pads less.
    def padded(chunks):
        return sum(
            len(c) * (max(eps[i].prompt_ids.numel() for i in c) + max(eps[i].length for i in c))
            for c in chunks
        )

    plain = split_microbatches(eps, range(6), max_tokens=20)
    sorted_ = split_microbatches(eps, length_sorted(eps, range(6)), max_tokens=20)
    assert padded(sorted_) < padded(plain)


def _grouped_episodes():
    """3 groups of 4 responses; a group's rows share their prompt tensor values."""
    eps = []
    for g in range(3):
        prompt = torch.randint(5, 60, (3 + g,), generator=torch.Generator().manual_seed(100 + g))
        for i in range(4):
            e = _episode(2 + (5 * g + 3 * i) % 9, seed=10 * g + i, correct=i % 2 == 0)
            e.prompt_ids = prompt.clone()
            e.advantage = (-1.0) ** i * (0.5 + g / 10)
            e.old_logprobs = e.sampler_logprobs
            eps.append(e)
    return eps


def test_gradient_is_independent_of_prompt_sharing_order_and_budget(tiny_model, tokenizer):
    """Shared-prompt forward passes, length sorting and the token budget change the cost only:
    the accumulated gradient and loss match one unshared micro-batch in input order."""
    eps = _grouped_episodes()
    ref, s_ref = _grads_after_accumulation(
        tiny_model,
        tokenizer,
        eps,
        "train.share_prompts=false",
        "train.tokens_per_microbatch=100000",
    )
    for overrides, order in [
        (["train.share_prompts=true", "train.tokens_per_microbatch=100000"], eps),
        (["train.share_prompts=true", "train.tokens_per_microbatch=48"], eps),
        (["train.share_prompts=true", "train.tokens_per_microbatch=48"], eps[::-1]),
    ]:
        got, s = _grads_after_accumulation(tiny_model, tokenizer, order, *overrides)
        for a, b in zip(ref, got, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
        assert s["loss"] == pytest.approx(s_ref["loss"], rel=1e-5)
        assert s["tokens"] == s_ref["tokens"]


def _checked_state(tiny_model, tokenizer):
    cfg = _cfg("train.recompute_old_logprobs=false")
    return build_state(cfg, tiny_model, tokenizer, [Problem("p", (), "1")])


def test_sampler_logprobs_are_checked_once_then_used(tiny_model, tokenizer):
    eps = _grouped_episodes()
    state = _checked_state(tiny_model, tokenizer)
    fill_logprobs(tiny_model, eps, "sampler_logprobs", state)  # exact ones
    for e in eps:
        e.sampler_logprobs = e.sampler_logprobs + 1e-4  # within the tolerance
    out = set_old_logprobs(state, eps)
    assert out["train/sampler_logprob_gap"] == pytest.approx(1e-4, rel=1e-2)
    assert all(e.old_logprobs is e.sampler_logprobs for e in eps)  # the sampler's are used
    assert set_old_logprobs(state, eps) == {}  # checked once per process


def test_sampler_logprobs_that_disagree_stop_the_run_with_the_fix(tiny_model, tokenizer):
    eps = _grouped_episodes()
    state = _checked_state(tiny_model, tokenizer)
    fill_logprobs(tiny_model, eps, "sampler_logprobs", state)
    eps[5].sampler_logprobs = eps[5].sampler_logprobs - 0.05  # as bf16 sampling would be
    with pytest.raises(ValueError, match=r"up to 0\.05.*recompute_old_logprobs=true"):
        set_old_logprobs(state, eps)


def test_a_problems_samples_do_not_depend_on_the_calls_or_the_other_problems(tiny_model, tokenizer):
    problems = plus_one_problems(5)
    seeds = [11, 12, 13, 14, 15]

    def texts(*overrides, which=range(5)):
        cfg = _cfg("rollout.group_size=2", *overrides)
        state = build_state(cfg, tiny_model, tokenizer, problems)
        chosen = [problems[i] for i in which]
        samples = sample_round(InTurn.drawer(state), chosen, seeds=[seeds[i] for i in which])
        return [x.text for x in samples], state.timers

    whole, _ = texts()
    split, timers = texts("rollout.rows_per_generate=4")  # 2 prompts per call: 3 calls
    assert split == whole  # each problem reads its own stream: the calls change nothing
    assert timers["gen_slots"] >= len(split)
    # Problems 1 and 3 alone (as one rank of two might draw them): their rows of the round.
    assert texts(which=[1, 3])[0] == whole[2:4] + whole[6:8]
    assert len(set(whole)) > 2  # and the draws are random, not one text repeated


def test_reusing_sampler_logprobs_needs_float32():
    with pytest.raises(ValueError, match="recompute_old_logprobs=false needs model.param_dtype"):
        _cfg("model.compute_dtype=bfloat16")
    with pytest.raises(ValueError, match="recompute_old_logprobs=false needs model.param_dtype"):
        _cfg("model.param_dtype=bfloat16")
    cfg = _cfg("model.compute_dtype=bfloat16", "train.recompute_old_logprobs=true")
    assert (cfg.model.param_dtype, cfg.model.compute_dtype) == ("float32", "bfloat16")


def test_train_state_round_trips_what_a_resume_needs(tiny_model, tokenizer):
    problems = [Problem(f"p{i}", (), "1") for i in range(5)]
    state = build_state(_cfg(), tiny_model, tokenizer, problems)
    state.sampler.next(7)  # into the second epoch
    state.step, state.consecutive_skips, state.sampling_prior = 3, 2, (5, 9)
    saved = json.loads(json.dumps(state.state_dict()))  # what trainer.json holds
    fresh = build_state(_cfg(), tiny_model, tokenizer, problems)
    fresh.load_state_dict(saved)
    assert (fresh.step, fresh.consecutive_skips, fresh.sampling_prior) == (3, 2, (5, 9))
    assert [p.uid for p in fresh.sampler.next(6)] == [p.uid for p in state.sampler.next(6)]


class RecordingEngine:
    """The native engine, noting every generate and sync_weights call in order."""

    def __init__(self, inner, *, exact: bool = True):
        self.inner, self.exact_logprobs, self.calls = inner, exact, []

    def generate(self, prompts, **kwargs):
        self.calls.append("generate")
        return self.inner.generate(prompts, **kwargs)

    def sync_weights(self, model):
        self.calls.append("sync")


def test_the_engine_is_synced_after_each_steps_updates(tiny_model, tokenizer):
    problems = plus_one_problems(8)
    cfg = _cfg("rollout.group_size=2", "train.prompts_per_step=2", "sampling.dynamic=false")
    state = build_state(cfg, tiny_model, tokenizer, problems)
    state.engine = RecordingEngine(state.engine)
    for _ in range(2):
        trainer.train_step(state)
    assert state.engine.calls == ["generate", "sync", "generate", "sync"]


def test_an_engine_without_exact_logprobs_never_stands_in_for_pi_old(tiny_model, tokenizer):
    eps = _grouped_episodes()
    state = _checked_state(tiny_model, tokenizer)  # recompute_old_logprobs=false
    state.engine = RecordingEngine(state.engine, exact=False)
    assert set_old_logprobs(state, eps) == {}  # no check, no gap logged: recomputed
    assert all(e.old_logprobs is not e.sampler_logprobs for e in eps)
    fresh = [e.old_logprobs for e in eps]
    fill_logprobs(tiny_model, eps, "old_logprobs", state)
    assert all(torch.equal(a, e.old_logprobs) for a, e in zip(fresh, eps, strict=True))


def test_the_run_settings_reach_rollout(tiny_model, tokenizer):
    problems = plus_one_problems(2)
    cfg = _cfg(
        "rollout.group_size=2", "rollout.stop_token_ids=[7, 9]", "data.system_prompt=Be brief."
    )
    state = build_state(cfg, tiny_model, tokenizer, problems)
    assert {7, 9, tokenizer.eos_token_id} <= set(state.engine.stop_token_ids)
    prompts = []
    real_generate = state.engine.generate

    def recording(batch, **kwargs):
        prompts.extend(batch)
        return real_generate(batch, **kwargs)

    state.engine.generate = recording
    sample_round(InTurn.drawer(state), problems, seeds=[1, 2])
    assert prompts and all(p.startswith("System: Be brief.\nUser: ") for p in prompts)


def test_dual_clip_reaches_the_update_metrics(tiny_model, tokenizer):
    eps = _grouped_episodes()
    state = build_state(
        _cfg("algo.clip_ratio_c=3.0", "train.responses_per_minibatch=12"),
        tiny_model,
        tokenizer,
        [Problem("p", (), "1")],
    )
    fill_logprobs(tiny_model, eps, "old_logprobs", state)
    for e in eps:  # pi_old far below pi: ratios of e^5, so every negative advantage is capped
        e.old_logprobs = e.old_logprobs - 5.0
    state.cfg.train.recompute_old_logprobs = False
    state.sampler_logprobs_checked = True
    for e in eps:
        e.sampler_logprobs = e.old_logprobs
    out = update(state, eps, lr=1e-3)
    negative = sum(e.length for e in eps if e.advantage < 0) / sum(e.length for e in eps)
    assert out["clip/dual_frac"] == pytest.approx(negative)


def test_a_step_that_trains_no_token_reports_no_entropy(tiny_model, tokenizer):
    # Every row overlong-filtered: no token trained. The entropy, mean token probability and
    # loss were 0.0, which reads as a collapsed entropy; they are NaN (null in metrics.jsonl).
    eps = _grouped_episodes()
    for e in eps:
        e.trainable = False
    state = build_state(_cfg(), tiny_model, tokenizer, [Problem("p", (), "1")])
    state.cfg.train.recompute_old_logprobs = False  # the episodes' made-up pi_old as it is
    state.sampler_logprobs_checked = True
    out = update(state, eps, lr=1e-3)
    assert out["train/updates"] == 0.0 and out["train/tokens"] == 0.0
    for name in ("train/entropy", "train/token_prob_mean", "train/loss"):
        assert out[name] != out[name], name  # NaN
    assert out["perf/train_padding_frac"] != out["perf/train_padding_frac"]  # it read 1.0
    eps[0].trainable = True  # one row trained: figures again
    out = update(state, eps, lr=1e-3)
    assert out["train/tokens"] == eps[0].length and 0 < out["train/entropy"] < 10


def test_a_step_that_keeps_no_group_logs_the_same_train_keys(tiny_model, tokenizer):
    """sampling.on_max_rounds=train with no mixed group (an answer no response gives): the
    step trains nothing and logs every train/* key a trained step does (it logged none)."""
    cfg = _cfg(
        *("rollout.group_size=2", "rollout.max_new_tokens=4", "algo.l_cache=2"),
        *("train.prompts_per_step=2", "sampling.prompts_per_round=2", "sampling.oversample=false"),
        *("sampling.max_rounds=1", "sampling.on_max_rounds=train", "reward.workers=0"),
    )
    question = ({"role": "user", "content": "What is the word?"},)
    problem = Problem("p", question, "a phrase four tokens of a random model never spell")
    state = build_state(cfg, tiny_model, tokenizer, [problem])
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    metrics = trainer.train_step(state)
    assert metrics["sampling/groups_kept"] == 0.0 and metrics["sampling/prompts_drawn"] == 2.0
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in before.items())
    assert (metrics["train/updates"], metrics["train/tokens"], metrics["train/lr"]) == (
        0.0, 0.0, lr_at(cfg.optim, 0))  # fmt: skip
    nulls = ("train/loss", "train/entropy", "perf/train_padding_frac", "train/grad_norm")
    nulls += ("clip/low_frac", "clip/high_frac", "clip/dual_frac", "clip/high_prob_mean")
    for name in (*nulls, "sampling/tokens_per_kept_group"):  # grad_norm, clip/* read 0.0
        assert metrics[name] != metrics[name], name  # NaN: null in metrics.jsonl
    eps = _grouped_episodes()
    state.cfg.train.recompute_old_logprobs = False
    state.sampler_logprobs_checked = True
    keys = {k for k in update(state, eps, lr=1e-3) if k.startswith(("train/", "clip/"))}
    assert keys == {k for k in metrics if k.startswith(("train/", "clip/"))}


def test_the_kl_term_adds_beta_times_the_mean_k3_with_its_gradient():
    """Naive GRPO's loss is -J + beta KL(pi_theta || pi_ref), k3 per token (spec, "Naive
    GRPO"). One response of 2 tokens with advantage 0, so -J and its gradient are 0, and
    d = log pi_ref - log pi_theta = [-0.5, +0.5]:
        k3(d) = e^d - d - 1: k3(-0.5) = e^-0.5 - 0.5 = 0.1065307, k3(0.5) = e^0.5 - 1.5 = 0.1487213
        loss = beta * (k3(-0.5) + k3(0.5)) / 2 = 0.001 * 0.1276260 = 1.27626e-4
        d loss / d log pi_theta = beta * (d k3 / d d) * (d d / d log pi_theta) / 2
                                = beta * (e^d - 1) * (-1) / 2 = beta * (1 - e^d) / 2
    so descent lowers the token pi_theta over-weights (d < 0) and raises the other."""
    e = Episode(torch.tensor([1]), torch.tensor([2, 3]), torch.zeros(2), False, True, 1.0)
    e.advantage = 0.0
    e.old_logprobs = torch.tensor([-1.0, -1.0])
    e.ref_logprobs = torch.tensor([-1.5, -0.5])
    b = collate([e], pad_id=0)
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    beta = 0.001
    loss, _, kl = micro_loss(
        logp,
        b,
        algo_cfg=AlgoConfig(kl_coef=beta),
        ref_BT=b.ref_logprobs_BT,
        num_tokens=2,
        num_seqs=1,
        norm_len=8,
    )
    k3 = [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5]
    assert kl.item() == pytest.approx(sum(k3) / 2, rel=1e-6)  # 0.1276260
    assert loss.item() == pytest.approx(1.27626e-4, rel=1e-5)
    assert loss.item() == pytest.approx(beta * sum(k3) / 2, rel=1e-6)
    loss.backward()
    expected = [beta * (1 - math.exp(-0.5)) / 2, beta * (1 - math.exp(0.5)) / 2]
    torch.testing.assert_close(logp.grad, torch.tensor([expected]), rtol=1e-5, atol=0)
    assert logp.grad[0, 0] > 0 > logp.grad[0, 1]  # [1.96735e-4, -3.24361e-4]


def test_clip_metrics_weigh_each_micro_batch_by_its_tokens(tiny_model, tokenizer):
    """clip/high_frac, clip/low_frac and clip/high_prob_mean of a mini-batch split into
    micro-batches of different token counts are the whole mini-batch's figures (spec, "What
    to watch"; the paper's Clip-Higher diagnostic), not sums or means of micro-batch ones."""
    eps = _grouped_episodes()  # 12 rows of 2-10 tokens; advantage > 0 on even rows
    state = build_state(
        _cfg("train.responses_per_minibatch=12", "train.tokens_per_microbatch=24"),
        tiny_model,
        tokenizer,
        [Problem("p", (), "1")],
    )
    fill_logprobs(tiny_model, eps, "old_logprobs", state)  # pi itself: ratio 1
    assert all(float(e.old_logprobs.min()) > -9.0 for e in eps)  # the premise below
    pos = [e for e in eps if e.advantage > 0]
    neg = [e for e in eps if e.advantage < 0]
    for k, e in enumerate(pos):  # pi_old = e^-(10 + k): r = pi / pi_old > e > 1 + 0.28
        e.old_logprobs = torch.full_like(e.old_logprobs, -10.0 - k)
    for e in neg[:2]:  # pi_old = e * pi: r = 1/e < 1 - 0.2, clipped low; the other 4 at r = 1
        e.old_logprobs = e.old_logprobs + 1.0
    for e in eps:
        e.sampler_logprobs = e.old_logprobs
    state.cfg.train.recompute_old_logprobs = False
    state.sampler_logprobs_checked = True
    out = update(state, eps, lr=0.0)
    # Lengths 2 + (5g + 3i) % 9 (group g, row i): A > 0 rows (i = 0, 2) are 2, 8 | 7, 4 | 3, 9
    # = 33 tokens; A < 0 rows 5, 2 | 10, 7 | 6, 3 = 33, of which the first two (5 + 2 = 7
    # tokens) are clipped low. 66 tokens in all.
    assert [e.length for e in pos] == [2, 8, 7, 4, 3, 9]
    assert [e.length for e in neg[:2]] == [5, 2] and sum(e.length for e in eps) == 66
    assert out["clip/high_frac"] == pytest.approx(33 / 66, rel=1e-6)  # float32 sums
    assert out["clip/low_frac"] == pytest.approx(7 / 66, rel=1e-6)
    assert out["clip/dual_frac"] == 0.0
    # The mean pi_old of the 33 tokens clipped high: row k's tokens all have e^-(10 + k).
    high = (2, 8, 7, 4, 3, 9)
    prob_mean = sum(n * math.exp(-10.0 - k) for k, n in enumerate(high)) / 33
    assert out["clip/high_prob_mean"] == pytest.approx(prob_mean, rel=1e-5)  # 1.1e-5


def test_sample_level_loss_divides_by_the_responses_with_loss_tokens(tiny_model, tokenizer):
    """GRPO's sample-level loss (seq-mean-token-mean) with overlong filtering: a masked
    truncated response is out of the loss and out of its divisor, the responses counted."""
    eps = [_episode(5, seed=1), _episode(7, seed=2), _episode(20, seed=3, truncated=True)]
    for e, a in zip(eps, (1.0, 0.5, 2.0), strict=True):
        e.advantage = a
    eps[2].trainable = False  # overlong-filtered
    cfg = _cfg("algo.loss_agg=seq-mean-token-mean", "train.responses_per_minibatch=3")
    state = build_state(cfg, tiny_model, tokenizer, [Problem("p", (), "1")])
    fill_logprobs(tiny_model, eps, "old_logprobs", state)
    for e in eps:
        e.sampler_logprobs = e.old_logprobs
    state.cfg.train.recompute_old_logprobs = False
    state.sampler_logprobs_checked = True
    out = update(state, eps, lr=0.0)
    # pi_old = pi: r = 1, inside the clip, so each token's loss is -A_i and so is each
    # response's token mean. Two responses count: (-1.0 - 0.5) / 2 = -0.75 (over all three
    # rows it would read -0.5).
    assert out["train/updates"] == 1.0 and out["train/tokens"] == 12.0
    assert out["train/loss"] == pytest.approx(-0.75, rel=1e-6)
