"""The DAPO training step and loop. No maths here: every formula is in :mod:`dapo.algo`.

One step, top to bottom (spec, "One training step"):

1. draw prompts, sample G responses each, grade them, shape rewards      ``rollout_round``
2. dynamic sampling: repeat 1 until N mixed groups are kept              ``sampling.collect_groups``
3. group-normalised advantages                                           ``assign_advantages``
4. pi_old (and pi_ref) log-probs, then mu epochs of mini-batch updates   ``update``

Data-parallel ranks only add all-reduces: the divisor of each mini-batch (``num_tokens``) and
the group decisions are explicit values computed here, not hidden inside the loss.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dapo import algo, checkpoint
from dapo.batch import Episode, collate, length_sorted, split_microbatches, split_minibatches
from dapo.config import Config
from dapo.data import Problem, PromptSampler
from dapo.eval_metrics import pick_samples
from dapo.evaluate import evaluate, grading_job, render_prompt
from dapo.interrupt import GracefulStop, RunStopped, StepAborted
from dapo.metrics import MetricsLogger
from dapo.model import batch_logprobs, distinct_prompts
from dapo.progress import LiveProgress
from dapo.reward_pool import RewardPool
from dapo.rollout import generate
from dapo.sampling import (
    DynamicSamplingExhausted,
    Group,
    SamplingResult,
    collect_groups,
    oversampled_round,
)

MAX_OVERSAMPLE = 4
"""A round draws at most this many times prompts_per_step prompts (rollout.rows_per_generate
bounds the rows generated at once)."""


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from (run seed, step, round, ...), so a resumed run repeats the sequence."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class TrainState:
    cfg: Config
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    sampler: PromptSampler
    ref_model: torch.nn.Module | None = None
    pool: RewardPool | None = None
    """Grades responses; None grades in-process (exceptions caught, hangs not stoppable)."""
    step: int = 0
    consecutive_skips: int = 0
    """Updates skipped in a row for a non-finite loss or gradient norm."""
    on_phase: Callable[[str], None] = lambda _phase: None
    """Told each phase of a step as it starts (generate, reward, train, eval, save)."""
    timers: dict[str, float] = field(default_factory=dict)
    """Seconds (and counts) of the running step's phases, for the perf/* metrics."""
    sampling_prior: tuple[int, int] = (0, 0)
    """(mixed groups, prompts drawn) of the last step: the kept fraction that sizes rounds."""
    sampler_logprobs_checked: bool = False
    """Whether the sampler's log-probs were compared with a forward pass in this process."""


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient norm."""


# ----------------------------------------------------------------------------- 1. rollout


def shape_rewards(episodes: Sequence[Episode], cfg: Config) -> None:
    """R = R_correct + R_length (soft overlong punishment), or overlong filtering, in place.

    With neither technique on, a truncated response scores a hard -1 (the naive baseline).
    """
    a = cfg.algo
    if a.overlong_shaping:
        lengths = torch.tensor([e.length for e in episodes])
        penalty = algo.overlong_penalty(
            lengths, cfg.rollout.max_new_tokens, a.l_cache, a.overlong_factor
        )
        for e, p in zip(episodes, penalty.tolist(), strict=True):
            e.reward += p
    if a.overlong_filter:
        for e in episodes:
            e.trainable = not e.truncated
    if not a.overlong_shaping and not a.overlong_filter:
        for e in episodes:
            if e.truncated:
                e.reward = -1.0


@dataclass
class _Sample:
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    logprobs: torch.Tensor
    truncated: bool
    text: str


def _sample(state: TrainState, problems: list[Problem], *, seed: int) -> list[_Sample]:
    """G responses per problem (rows i*G .. i*G+G-1 are problem i), generated in calls of at
    most ``rollout.rows_per_generate`` rows, each call seeded from ``seed`` and its index."""
    cfg, tok = state.cfg, state.tokenizer
    G, rows_cap = cfg.rollout.group_size, cfg.rollout.rows_per_generate
    per_call = max(1, rows_cap // G) if rows_cap else len(problems)
    samples = []
    for call, start in enumerate(range(0, len(problems), per_call)):
        chunk = problems[start : start + per_call]
        ro = generate(
            state.model,
            tok,
            [render_prompt(tok, p, chat_template=cfg.data.apply_chat_template) for p in chunk],
            group_size=G,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=seed if call == 0 else derive_seed(seed, "call", call),
            ignore_eos=cfg.rollout.ignore_eos,
            engine=cfg.rollout.engine,
        )
        _add(state.timers, "gen_slots", float(ro.slots))
        for b in range(len(chunk) * G):
            length = int(ro.lengths_B[b])
            samples.append(
                _Sample(
                    prompt_ids=ro.prompt_ids_BP[b][ro.prompt_mask_BP[b].bool()].cpu(),
                    response_ids=ro.response_ids_BT[b, :length].cpu(),
                    logprobs=ro.logprobs_BT[b, :length].float().cpu(),
                    truncated=bool(ro.truncated_B[b]),
                    text=ro.texts[b],
                )
            )
    return samples


def rollout_round(state: TrainState, problems: list[Problem], *, seed: int) -> list[Group]:
    """G responses for each problem, graded and shaped, as one group per problem."""
    cfg = state.cfg
    G = cfg.rollout.group_size
    state.model.eval()
    state.on_phase("generate")
    samples = _sample(state, problems, seed=seed)
    jobs = [grading_job(problems[b // G], x.text, cfg.reward.mode) for b, x in enumerate(samples)]
    state.on_phase("reward")
    t_reward = time.perf_counter()
    graded = (state.pool or RewardPool(workers=0)).grade(jobs)
    _add(state.timers, "reward", time.perf_counter() - t_reward)
    if graded.faults:
        first = graded.faults[0]
        print(
            f"dapo: warning: step {state.step + 1}: the verifier failed on "
            f"{len(graded.faults)} response(s), graded incorrect; first: {first.kind}: "
            f"{first.detail}",
            file=sys.stderr,
        )
    fault_of = {f.index: f.kind for f in graded.faults}
    groups = []
    for i, problem in enumerate(problems):
        episodes = []
        for b in range(i * G, (i + 1) * G):
            x, score = samples[b], graded.scores[b]
            episodes.append(
                Episode(
                    prompt_ids=x.prompt_ids,
                    response_ids=x.response_ids,
                    sampler_logprobs=x.logprobs,
                    truncated=x.truncated,
                    correct=score.correct,
                    reward=score.score,
                    text=x.text,
                    reward_fault=fault_of.get(b, ""),
                )
            )
        shape_rewards(episodes, cfg)
        groups.append(Group(problem.uid, episodes))
    return groups


# ----------------------------------------------------------------------------- 3. advantages


def assign_advantages(groups: Sequence[Group], *, eps: float) -> None:
    """Â_i = (R_i - mean(R_group)) / (std(R_group) + eps), the same for every token of o_i."""
    if not groups:
        return
    scores_nG = torch.tensor([[e.reward for e in g.episodes] for g in groups], dtype=torch.float64)
    adv_nG = algo.group_advantages(scores_nG, eps=eps)
    for g, row in zip(groups, adv_nG.tolist(), strict=True):
        for e, a in zip(g.episodes, row, strict=True):
            e.advantage = a


# ----------------------------------------------------------------------------- 4. update


SAMPLER_LOGPROB_TOLERANCE = 1e-3
"""Largest |sampler - forward| log-prob gap that lets the sampler's stand in for pi_old."""


@torch.no_grad()
def _fill_logprobs(model, episodes: list[Episode], attr: str, state: TrainState) -> None:
    """Forward passes without gradient to store pi_old or pi_ref log-probs on each episode."""
    cfg, pad_id = state.cfg, state.tokenizer.pad_token_id
    device = next(model.parameters()).device
    model.eval()
    order = length_sorted(episodes, range(len(episodes)))
    for micro in split_microbatches(episodes, order, max_tokens=cfg.train.tokens_per_microbatch):
        b = collate([episodes[i] for i in micro], pad_id=pad_id).to(device)
        logp_BT, _ = batch_logprobs(
            model, b, temperature=cfg.rollout.temperature, share_prompts=cfg.train.share_prompts
        )
        for row, i in enumerate(micro):
            setattr(episodes[i], attr, logp_BT[row, : episodes[i].length].float().cpu())


def _old_logprobs(state: TrainState, episodes: list[Episode]) -> dict[str, float]:
    """pi_old: recomputed by a forward pass, or the sampler's once they are shown to match it.

    The check runs on the first step of each process (one forward pass) and stops the run on a
    gap above the tolerance; otherwise the sampler's values are used, the ones an uninterrupted
    run used, and only the run's first step logs the gap, so a resumed run stays bit-identical.
    """
    if state.cfg.train.recompute_old_logprobs:
        _fill_logprobs(state.model, episodes, "old_logprobs", state)
        return {}
    out = {}
    if not state.sampler_logprobs_checked:
        _fill_logprobs(state.model, episodes, "old_logprobs", state)
        gap = max(
            float((e.old_logprobs - e.sampler_logprobs).abs().amax()) if e.length else 0.0
            for e in episodes
        )
        if not gap <= SAMPLER_LOGPROB_TOLERANCE:
            raise ValueError(
                f"train.recompute_old_logprobs=false: the sampler's log-probs differ from a "
                f"forward pass by up to {gap:.3g} (tolerance {SAMPLER_LOGPROB_TOLERANCE}) at "
                f"model.dtype={state.cfg.model.dtype}, so they cannot stand in for pi_old. "
                "Set train.recompute_old_logprobs=true (needed in bfloat16 and float16)."
            )
        state.sampler_logprobs_checked = True
        if state.step == 0:
            out["train/sampler_logprob_gap"] = gap
    for e in episodes:
        e.old_logprobs = e.sampler_logprobs
    return out


def update(state: TrainState, episodes: list[Episode], *, lr: float) -> dict[str, float]:
    """mu epochs over the step's responses, one optimizer update per mini-batch.

    Each micro-batch loss is divided by the token count (token-mean) or sequence count
    (seq-mean-token-mean) of its whole mini-batch, so the accumulated gradient is exactly the
    mini-batch gradient, whatever the micro-batch split (DAPO §3.3).
    """
    cfg, model = state.cfg, state.model
    t_logprobs = time.perf_counter()
    check = _old_logprobs(state, episodes)
    if state.ref_model is not None:
        _fill_logprobs(state.ref_model, episodes, "ref_logprobs", state)
    _add(state.timers, "logprobs", time.perf_counter() - t_logprobs)
    for group in state.optimizer.param_groups:
        group["lr"] = lr

    model.train()
    gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, state.step, "minibatch"))
    sums: dict[str, float] = {}
    for _epoch in range(cfg.train.epochs):
        for mini in split_minibatches(
            len(episodes), cfg.train.responses_per_minibatch, generator=gen
        ):
            batch = [episodes[i] for i in mini]
            # The loss divisors of the whole mini-batch (with data-parallel ranks: all-reduced
            # sums), fixed before the first micro-batch; DAPO §3.3.
            num_tokens = sum(e.num_loss_tokens for e in batch)
            num_seqs = sum(1 for e in batch if e.num_loss_tokens > 0)
            if num_tokens == 0:
                continue  # every response of this mini-batch was overlong-filtered
            mini_sums = accumulate_gradients(state, batch, num_tokens=num_tokens, num_seqs=num_seqs)
            # An infinite max_norm measures the norm without clipping (grad_clip = 0: off).
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            if not (math.isfinite(mini_sums["loss"]) and math.isfinite(norm)):
                # One NaN step poisons Adam's moments for good: drop this update, keep going.
                state.optimizer.zero_grad(set_to_none=True)
                sums["skipped"] = sums.get("skipped", 0.0) + 1.0
                state.consecutive_skips += 1
                if state.consecutive_skips >= cfg.train.max_consecutive_skips:
                    raise NonFiniteError(
                        f"step {state.step + 1}: {state.consecutive_skips} updates in a row had "
                        f"a non-finite loss or gradient norm (loss {mini_sums['loss']}, grad "
                        f"norm {norm}), so training stopped. The last checkpoint is untouched. "
                        "Try a lower optim.lr, optim.grad_clip > 0, or model.dtype=float32 or "
                        "bfloat16 instead of float16, and check the data and the model."
                    )
                continue
            state.consecutive_skips = 0
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            mini_sums["grad_norm"] = norm
            mini_sums["updates"] = 1.0
            for k, v in mini_sums.items():
                sums[k] = sums.get(k, 0.0) + v

    updates = max(sums.get("updates", 0.0), 1.0)
    tokens = max(sums.get("tokens", 0.0), 1.0)
    out = {
        "train/loss": sums.get("loss", 0.0) / updates,
        "train/entropy": sums.get("entropy_sum", 0.0) / tokens,
        "train/token_prob_mean": sums.get("prob_sum", 0.0) / tokens,
        "train/grad_norm": sums.get("grad_norm", 0.0) / updates,
        "train/updates": sums.get("updates", 0.0),
        "train/skipped_updates": sums.get("skipped", 0.0),
        "train/lr": lr,
        "train/tokens": sums.get("tokens", 0.0) / cfg.train.epochs,
        "perf/train_padding_frac": 1.0 - sums.get("real", 0.0) / max(sums.get("slots", 0.0), 1.0),
        "clip/low_frac": sums.get("clip_low", 0.0) / tokens,
        "clip/high_frac": sums.get("clip_high", 0.0) / tokens,
        "clip/high_prob_mean": sums.get("clip_high_prob_sum", 0.0)
        / max(sums.get("num_clip_high", 0.0), 1.0),
    }
    if state.ref_model is not None:
        out["train/kl"] = sums.get("kl_sum", 0.0) / max(sums.get("kl_den", 0.0), 1.0)
    return out | check


def accumulate_gradients(
    state: TrainState, episodes: list[Episode], *, num_tokens: int, num_seqs: int
) -> dict[str, float]:
    """Backward over the micro-batches of ``episodes``; returns metric sums.

    Every micro-batch loss is divided by ``num_tokens`` (token-mean) or ``num_seqs``
    (seq-mean-token-mean) of the whole mini-batch, never by its own count, so the accumulated
    gradient is the mini-batch gradient whatever the split.
    """
    cfg, model = state.cfg, state.model
    device = next(model.parameters()).device
    seq_agg = cfg.algo.loss_agg == "seq-mean-token-mean"
    sums: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value

    # A sum over the mini-batch does not depend on the order: rows of similar length (and a
    # group's rows) go together, for less padding and more shared prompts.
    order = length_sorted(episodes, range(len(episodes)))
    for micro in split_microbatches(episodes, order, max_tokens=cfg.train.tokens_per_microbatch):
        eps = [episodes[i] for i in micro]
        b = collate(eps, pad_id=state.tokenizer.pad_token_id).to(device)
        logp_BT, entropy_BT = batch_logprobs(
            model,
            b,
            temperature=cfg.rollout.temperature,
            with_entropy=True,
            share_prompts=cfg.train.share_prompts,
        )
        loss, stats = algo.policy_loss(
            logp_BT,
            b.old_logprobs_BT,
            b.advantages_B,
            b.loss_mask_BT,
            eps_low=cfg.algo.eps_low,
            eps_high=cfg.algo.eps_high,
            agg=cfg.algo.loss_agg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            return_stats=True,
        )
        if state.ref_model is not None:
            kl = algo.aggregate(
                algo.kl_k3(logp_BT, b.ref_logprobs_BT),
                b.loss_mask_BT,
                agg=cfg.algo.loss_agg,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
            )
            loss = loss + cfg.algo.kl_coef * kl
            add("kl_sum", float(kl.detach()) * (num_seqs if seq_agg else num_tokens))
        loss.backward()
        slots, real = _forward_slots(b, shared=cfg.train.share_prompts)
        add("slots", slots)
        add("real", real)
        n = float(stats["num_tokens"])
        mask = b.loss_mask_BT
        add("tokens", n)
        add("loss", float(loss.detach()))
        add("entropy_sum", float(entropy_BT[mask].sum()))
        add("prob_sum", float(b.old_logprobs_BT.exp()[mask].sum()))
        add("clip_low", float(stats["clip_low_frac"]) * n)
        add("clip_high", float(stats["clip_high_frac"]) * n)
        add("clip_high_prob_sum", float(stats["clip_high_prob_mean"] * stats["num_clip_high"]))
        add("num_clip_high", float(stats["num_clip_high"]))
    if state.ref_model is not None:
        add("kl_den", float(num_seqs if seq_agg else num_tokens))
    return sums


def _forward_slots(b, *, shared: bool) -> tuple[float, float]:
    """(padded, real) token positions a micro-batch's forward pass computes; a shared prompt
    counts once."""
    prompts = b.prompt_mask_BP  # [B, P], or [N, P] over the N distinct prompts when shared
    if shared:
        _, prompts, _ = distinct_prompts(b.prompt_ids_BP, b.prompt_mask_BP)
    resp = b.response_mask_BT
    return float(prompts.numel() + resp.numel()), float(prompts.sum() + resp.sum())


# ----------------------------------------------------------------------------- the step


def lr_at(cfg: Config, step: int) -> float:
    """Linear warm-up over ``optim.warmup_steps`` rollout steps, then constant (paper)."""
    if cfg.optim.warmup_steps == 0:
        return cfg.optim.lr
    return cfg.optim.lr * min(1.0, (step + 1) / cfg.optim.warmup_steps)


def _add(timers: dict[str, float], key: str, value: float) -> None:
    timers[key] = timers.get(key, 0.0) + value


def train_step(state: TrainState) -> dict[str, float]:
    cfg = state.cfg
    state.timers.clear()
    t0 = time.perf_counter()
    s, n = cfg.sampling, cfg.train.prompts_per_step

    def round_size(so_far: SamplingResult) -> int:
        # Without dynamic sampling every group is kept, so one round of exactly N prompts.
        if not s.dynamic:
            return n
        default = s.prompts_per_round or n
        if not s.oversample:
            return default
        mixed = so_far.groups_mixed + state.sampling_prior[0]
        drawn = so_far.prompts_drawn + state.sampling_prior[1]
        kept_frac = mixed / drawn if drawn else None
        need = n - len(so_far.groups)
        return oversampled_round(need, kept_frac, default=default, cap=MAX_OVERSAMPLE * n)

    def draw_round(round_index: int, num_prompts: int) -> list[Group]:
        problems = state.sampler.next(num_prompts)
        seed = derive_seed(cfg.train.seed, state.step, round_index, "rollout")
        return rollout_round(state, problems, seed=seed)

    result = collect_groups(
        draw_round,
        num_groups=n,
        dynamic=s.dynamic,
        max_rounds=s.max_rounds,
        on_max_rounds=s.on_max_rounds,
        round_size=round_size,
    )
    state.sampling_prior = (result.groups_mixed, result.prompts_drawn)
    t_gen = time.perf_counter() - t0

    assign_advantages(result.groups, eps=cfg.algo.adv_eps)
    episodes = [e for g in result.groups for e in g.episodes]
    t1 = time.perf_counter()
    state.on_phase("train")
    metrics = update(state, episodes, lr=lr_at(cfg, state.step)) if episodes else {}
    t_train = time.perf_counter() - t1

    metrics.update(rollout_metrics(result))
    step_s = time.perf_counter() - t0
    timers = state.timers
    # Phases of the step: generate and reward split the rollout, logprobs (pi_old, pi_ref
    # forward passes) and train split the update; other is the rest (advantages, bookkeeping).
    generate_s = t_gen - timers.get("reward", 0.0)
    train_s = t_train - timers.get("logprobs", 0.0)
    metrics.update(
        {
            "perf/step_s": step_s,
            "perf/generate_s": generate_s,
            "perf/reward_s": timers.get("reward", 0.0),
            "perf/logprobs_s": timers.get("logprobs", 0.0),
            "perf/train_s": train_s,
            "perf/other_s": step_s - t_gen - t_train,
            "perf/gen_tokens_per_s": result.tokens_generated / max(generate_s, 1e-9),
            "perf/gen_padding_frac": 1.0
            - result.tokens_generated / max(timers.get("gen_slots", 0.0), 1.0),
            "perf/train_tokens_per_s": metrics.get("train/tokens", 0.0)
            * cfg.train.epochs
            / max(train_s, 1e-9),
        }
    )
    state.step += 1
    return metrics


def rollout_metrics(result: SamplingResult) -> dict[str, float]:
    """Figures over every response generated this step, and what dynamic sampling cost."""
    eps = [e for g in result.generated for e in g.episodes]
    lengths = torch.tensor([e.length for e in eps], dtype=torch.float64)
    kept = len(result.groups)
    return {
        "rollout/accuracy": sum(e.correct for e in eps) / len(eps),
        "rollout/reward_mean": sum(e.reward for e in eps) / len(eps),
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/truncated_frac": sum(e.truncated for e in eps) / len(eps),
        "reward/faults": float(sum(1 for e in eps if e.reward_fault)),
        "sampling/rounds": float(result.rounds),
        "sampling/prompts_drawn": float(result.prompts_drawn),
        "sampling/groups_mixed": float(result.groups_mixed),
        "sampling/groups_kept": float(kept),
        "sampling/kept_frac": kept / max(result.prompts_drawn, 1),
        "sampling/tokens_generated": float(result.tokens_generated),
        "sampling/tokens_per_kept_group": result.tokens_generated / max(kept, 1),
        "sampling/groups_surplus": float(result.groups_mixed - kept),
        "sampling/exhausted": float(result.exhausted),
    }


# ----------------------------------------------------------------------------- the loop


def build_state(cfg: Config, model, tokenizer, train_problems: list[Problem]) -> TrainState:
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        weight_decay=cfg.optim.weight_decay,
    )
    ref_model = None
    if cfg.algo.kl_coef > 0:
        # The naive-GRPO KL anchor: a frozen copy of the starting policy.
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    sampler = PromptSampler(train_problems, seed=cfg.train.seed)
    return TrainState(cfg, model, tokenizer, optimizer, sampler, ref_model=ref_model)


def fit(
    cfg: Config,
    model,
    tokenizer,
    train_problems: list[Problem],
    val_problems: list[Problem],
    *,
    run_dir: Path,
    stream=None,
    resume: bool = False,
) -> dict[str, float]:
    """Train for ``cfg.train.steps`` steps, evaluating at start, every ``eval.every`` and end.

    With ``resume``, the latest complete checkpoint in ``run_dir`` is restored first (the model
    given must be the starting policy: it is the KL reference) and ``metrics.jsonl`` is cut back
    to what that checkpoint had logged, so no step is missing or logged twice.
    """
    stream = stream or sys.stdout
    run_dir = Path(run_dir)
    state = build_state(cfg, model, tokenizer, train_problems)
    r = cfg.reward
    state.pool = RewardPool(workers=r.workers, timeout_s=r.timeout_s, memory_mb=r.memory_mb)
    try:
        return _run(state, val_problems, run_dir=run_dir, stream=stream, resume=resume)
    except (NonFiniteError, DynamicSamplingExhausted) as exc:
        nan = isinstance(exc, NonFiniteError)
        fix = "optim.lr=<lower>" if nan else "sampling.max_rounds=<more>"
        raise type(exc)(
            f"{exc} The run directory is intact; resume from its last checkpoint with a changed "
            f"config: dapo train --resume {run_dir} {fix} --force"
        ) from None
    finally:
        state.pool.close()


def _wandb_run(cfg: Config, run_dir: Path):
    """A W&B run named (and identified) by the run directory, so a resume continues it."""
    import wandb

    return wandb.init(
        project=cfg.run.wandb_project,
        name=run_dir.name,
        id=run_dir.name,
        resume="allow",
        dir=str(run_dir),
        config=cfg.to_dict(),
    )


def _run(state: TrainState, val_problems, *, run_dir: Path, stream, resume: bool) -> dict:
    cfg, model, tokenizer = state.cfg, state.model, state.tokenizer
    t = cfg.train

    last_records: list[dict] = []  # of the latest evaluation, for samples.jsonl

    def validate_now() -> dict[str, float]:
        state.on_phase("eval")
        return evaluate(
            model,
            tokenizer,
            val_problems,
            num_samples=cfg.eval.num_samples,
            temperature=cfg.eval.temperature,
            top_p=cfg.eval.top_p,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
            seed=derive_seed(cfg.train.seed, "eval"),
            pool=state.pool,
            chat_template=cfg.data.apply_chat_template,
            reward_mode=cfg.reward.mode,
            records_out=last_records,
            engine=cfg.rollout.engine,
        )

    tb_dir = run_dir / "tensorboard" if cfg.run.tensorboard else None
    live = cfg.run.progress == "auto" and getattr(stream, "isatty", lambda: False)()
    # Live: the rich display replaces the plain per-step lines; everything else is printed
    # through it so the two never interleave.
    logger = MetricsLogger(
        run_dir / "metrics.jsonl",
        stream=None if live else stream,
        tensorboard_dir=tb_dir,
        wandb_run=_wandb_run(cfg, run_dir) if cfg.run.wandb else None,
    )
    progress = None

    def say(text: str) -> None:
        if progress is not None:
            progress.print(text)
        else:
            print(text, file=stream)

    t_start = time.perf_counter()
    elapsed_before = 0.0
    saved_at: int | None = None
    if resume:
        ckpt = checkpoint.find_latest(run_dir)
        if ckpt is None:
            raise checkpoint.CheckpointError(
                f"{run_dir} has no complete checkpoint to resume from; start it again with "
                f"--overwrite, or choose another run.name"
            )
        info = checkpoint.load(ckpt, model=model, optimizer=state.optimizer)
        state.step = info["step"]
        state.sampler.load_state_dict(info["sampler"])
        state.consecutive_skips = info["consecutive_skips"]
        state.sampling_prior = tuple(info.get("sampling_prior", (0, 0)))
        start, last = info["val_start"], info["val_last"]
        elapsed_before = info["train_seconds"]
        logger.truncate(info["metrics_bytes"])
        logger.purge_step = state.step + 1
        saved_at = state.step
        print(f"resumed from {ckpt} at step {state.step}", file=stream)
    if live:
        progress = LiveProgress(total=t.steps, done=state.step, stream=stream)
        state.on_phase = progress.phase

    def save() -> Path:
        nonlocal saved_at
        state.on_phase("save")
        ckpt = checkpoint.save(
            run_dir,
            step=state.step,
            model=model,
            tokenizer=tokenizer,
            optimizer=state.optimizer,
            trainer_state={
                "sampler": state.sampler.state_dict(),
                "consecutive_skips": state.consecutive_skips,
                "sampling_prior": list(state.sampling_prior),
                "val_start": start,
                "val_last": last,
                "train_seconds": elapsed_before + time.perf_counter() - t_start,
                "metrics_bytes": logger.sync(),
            },
            keep=t.keep_checkpoints,
        )
        saved_at = state.step
        return ckpt

    stop = GracefulStop()
    try:
        with stop:
            if not resume:
                start = last = validate_now()
                logger.log(0, start)
                say(
                    f"held-out accuracy at start: {start['val/accuracy']:.3f} "
                    f"(avg@{cfg.eval.num_samples} over {len(val_problems)} problems)"
                )
            while state.step < t.steps and not stop.requested:
                metrics = train_step(state)
                is_last = state.step == t.steps
                if is_last or (cfg.eval.every and state.step % cfg.eval.every == 0):
                    last = validate_now()
                    metrics.update(last)
                logger.log(state.step, metrics)
                if progress is not None:
                    progress.step_done(state.step, metrics)
                if is_last or stop.requested or (t.save_every and state.step % t.save_every == 0):
                    save()
            if saved_at != state.step:
                save()
            if stop.requested and state.step < t.steps:
                raise RunStopped(
                    f"stopped by {stop.name} after step {state.step} of {t.steps}; checkpoint "
                    f"saved. Resume with: dapo train --resume {run_dir}",
                    stop.signum,
                )
            checkpoint.export_model(model, tokenizer, run_dir / "model")
    except StepAborted:
        ckpt = checkpoint.read_pointer(run_dir)
        where = f"the last checkpoint is {ckpt.name}" if ckpt else "no checkpoint was written"
        raise RunStopped(
            f"{stop.name} received twice: step {state.step + 1} aborted and not saved; {where}. "
            f"Resume with: dapo train --resume {run_dir}",
            stop.signum or 2,
        ) from None
    finally:
        logger.close()
        if progress is not None:
            progress.close()

    summary = {
        "steps": state.step,
        "val/accuracy_start": start["val/accuracy"],
        "val/accuracy_end": last["val/accuracy"],
        "train_seconds": elapsed_before + time.perf_counter() - t_start,
    }
    checkpoint.write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    if last_records:  # responses worth reading, for dapo report
        samples = pick_samples(last_records)
        text = "".join(json.dumps({"step": state.step, **x}) + "\n" for x in samples)
        checkpoint.write_atomic(run_dir / "samples.jsonl", text)
    print(
        f"held-out accuracy: {summary['val/accuracy_start']:.3f} -> "
        f"{summary['val/accuracy_end']:.3f} "
        f"({100 * (summary['val/accuracy_end'] - summary['val/accuracy_start']):+.1f} points) "
        f"after {state.step} steps; model saved to {run_dir / 'model'}",
        file=stream,
    )
    return summary
