"""Phase 4 of a step: pi_old (and pi_ref) log-probs, then mu epochs of mini-batch updates.

Each micro-batch loss is divided by the token count (token-mean) or sequence count
(seq-mean-token-mean) of its whole mini-batch, summed over data-parallel ranks, so the
accumulated gradient is exactly the mini-batch gradient whatever the micro-batch split
(DAPO §3.3; tested through a real transformer). No maths here either: the loss, the KL and
the token statistics are :mod:`dapo.algo` functions.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from dapo import algo, dist
from dapo.config import Config
from dapo.data.batch import (
    Batch,
    Episode,
    collate,
    partition_by_tokens,
)
from dapo.dist import fsdp
from dapo.models.logprobs import autocast, batch_logprobs, forward_slots
from dapo.models.policy import DTYPES
from dapo.run.metrics import accumulate
from dapo.training.exchange import (
    MiniBatch,
    rank_microbatches,
    stand_in,
    trained_by,
    training_plan,
)
from dapo.training.old_logprobs import fill_logprobs, set_loss_weights, set_old_logprobs

if TYPE_CHECKING:
    from dapo.training.step import TrainState


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient norm."""


def update(
    state: TrainState,
    episodes: list[Episode],
    *,
    lr: float,
    plan: list[MiniBatch] | None = None,
) -> dict[str, float]:
    """mu epochs over the step's responses, one optimizer update per mini-batch of ``plan``
    (default: :func:`~dapo.training.exchange.training_plan`; under ranks, only the episodes
    this rank trains need be whole).

    Each micro-batch loss is divided by the token count (token-mean) or sequence count
    (seq-mean-token-mean) of its whole mini-batch, so the accumulated gradient is exactly the
    mini-batch gradient, whatever the micro-batch split (DAPO §3.3).
    """
    cfg = state.cfg
    plan = plan or training_plan(cfg, state.step, episodes)
    mine = trained_by(plan, dist.rank())
    first_epoch = plan[: len(plan) // cfg.train.epochs]
    t_logprobs = time.perf_counter()
    check = set_old_logprobs(state, episodes, mine)
    check |= set_loss_weights(state, episodes, mine, trained_by(first_epoch, dist.rank()))
    if state.ref_model is not None:
        fill_logprobs(state.ref_model, episodes, "ref_logprobs", state, mine)
    accumulate(state.timers, "logprobs", time.perf_counter() - t_logprobs)
    for group in state.optimizer.param_groups:
        group["lr"] = lr

    state.model.train()
    sums: dict[str, float] = {}
    for mb in plan:
        batch = [episodes[i] for i in mb.indices]
        for k, v in minibatch_update(state, batch, mb.shares[dist.rank()]).items():
            accumulate(sums, k, v)
    out = _update_metrics(sums, cfg, lr=lr, with_kl=state.ref_model is not None)
    if state.scaler is not None:
        out["train/scaler_overflows"] = sums.get("scaler_overflows", 0.0)
        out["train/loss_scale"] = state.scaler.get_scale()
    return out | check


def minibatch_update(
    state: TrainState, batch: list[Episode], mine: list[int] | None = None
) -> dict[str, float]:
    """One optimizer update on ``batch``, this rank training ``batch[mine]`` (default: its
    share by :func:`partition_by_tokens`), skipped when its loss or gradient norm is not
    finite; returns its metric sums."""
    cfg = state.cfg
    # The loss divisors of the whole mini-batch (every rank holds all of it), fixed before the
    # first micro-batch; DAPO §3.3. Each rank then computes its share's gradient.
    num_tokens = sum(e.num_loss_tokens for e in batch)
    num_seqs = sum(1 for e in batch if e.num_loss_tokens > 0)
    if num_tokens == 0:
        return {}  # every response of this mini-batch was overlong-filtered
    if mine is None:
        mine = partition_by_tokens(batch, dist.world_size())[dist.rank()]
    sums = accumulate_gradients(state, batch, mine, num_tokens=num_tokens, num_seqs=num_seqs)
    scaler = state.scaler
    if scaler is not None:
        scaler.unscale_(state.optimizer)  # clip and measure the true gradient
    # An infinite max_norm measures the norm without clipping (grad_clip = 0: off).
    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    norm = fsdp.clip_grad_norm(state.model.parameters(), max_norm)
    if not (math.isfinite(sums["loss"]) and math.isfinite(norm)):
        # One NaN step poisons Adam's moments for good: drop this update, keep going.
        state.optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()  # after unscale_ it must run, skip or not; it halves the scale
            if math.isfinite(sums["loss"]) and scaler.get_scale() >= 1.0:
                # Only the scaled gradient overflowed float16: a smaller scale will do.
                return {"skipped": 1.0, "scaler_overflows": 1.0}
        state.consecutive_skips += 1
        if state.consecutive_skips >= cfg.train.max_consecutive_skips:
            raise NonFiniteError(
                f"step {state.step + 1}: {state.consecutive_skips} updates in a row had "
                f"a non-finite loss or gradient norm (loss {sums['loss']}, grad "
                f"norm {norm}), so training stopped. The last checkpoint is untouched. "
                "Try a lower optim.lr, optim.grad_clip > 0, or model.compute_dtype=float32 or "
                "bfloat16 instead of float16, and check the data and the model."
            )
        return {"skipped": 1.0}
    state.consecutive_skips = 0
    if scaler is not None:
        scaler.step(state.optimizer)  # the gradients are unscaled already
        scaler.update()
    else:
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return sums | {"grad_norm": norm, "updates": 1.0}


def _update_metrics(sums: dict[str, float], cfg: Config, *, lr: float, with_kl: bool):
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
        "clip/dual_frac": sums.get("clip_dual", 0.0) / tokens,
        "clip/high_prob_mean": sums.get("clip_high_prob_sum", 0.0)
        / max(sums.get("num_clip_high", 0.0), 1.0),
    }
    if with_kl:
        out["train/kl"] = sums.get("kl_sum", 0.0) / max(sums.get("kl_den", 0.0), 1.0)
    return out


RANK_SUMS = (
    "slots",
    "real",
    "tokens",
    "loss",
    "entropy_sum",
    "prob_sum",
    "clip_low",
    "clip_high",
    "clip_dual",
    "clip_high_prob_sum",
    "num_clip_high",
    "kl_sum",
)
"""Metric sums over a rank's share of a mini-batch, summed over the ranks."""


def accumulate_gradients(
    state: TrainState,
    episodes: list[Episode],
    mine: list[int] | None = None,
    *,
    num_tokens: int,
    num_seqs: int,
) -> dict[str, float]:
    """Backward over the micro-batches of ``episodes[mine]`` (default: all), this rank's share
    of the mini-batch ``episodes``; returns the mini-batch's metric sums over every rank.

    Every micro-batch loss is divided by ``num_tokens`` (token-mean) or ``num_seqs``
    (seq-mean-token-mean) of the whole mini-batch, never by its own count, so the accumulated
    gradient, summed over ranks, is the mini-batch gradient whatever the split.
    """
    cfg, model, device = state.cfg, state.model, state.device
    denominator = num_tokens if cfg.algo.loss_agg == "token-mean" else num_seqs
    divisors = dict(
        agg=cfg.algo.loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_len=cfg.rollout.max_new_tokens,
    )
    sums: dict[str, float] = {}
    # A sum over the mini-batch does not depend on the order: rows of similar length (and a
    # group's rows) go together, for less padding and more shared prompts.
    mine = list(range(len(episodes))) if mine is None else mine
    micros = rank_microbatches(episodes, mine, cfg.train.tokens_per_microbatch)
    for n, micro in enumerate(micros, 1):
        if cfg.dist.grad_sync == "minibatch":  # reduce-scatter once, after the last backward
            fsdp.set_grad_sync(model, n == len(micros))
        if micro is None:  # another rank has more: a pass with zero gradient, to match it
            _idle_pass(state, stand_in(state.tokenizer.pad_token_id), device)
            continue
        b = collate([episodes[i] for i in micro], pad_id=state.tokenizer.pad_token_id).to(device)
        loss, entropy_BT, stats, kl = _micro_loss(state, b, divisors)
        if kl is not None:
            accumulate(sums, "kl_sum", kl * denominator)
        (state.scaler.scale(loss) if state.scaler is not None else loss).backward()
        for k, v in _micro_sums(b, loss, entropy_BT, stats, shared=cfg.train.share_prompts).items():
            accumulate(sums, k, v)
    if dist.world_size() > 1:
        sums = dist.sum_dict({k: sums.get(k, 0.0) for k in RANK_SUMS})
    if state.ref_model is not None:
        accumulate(sums, "kl_den", float(denominator))
    return sums


def _micro_loss(state: TrainState, b: Batch, divisors: dict):
    """(loss, entropies, the loss's statistics, the KL term or None) of micro-batch ``b``."""
    cfg, model = state.cfg, state.model
    with autocast(model, DTYPES[cfg.model.compute_dtype], state.device):
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
        clip_ratio_c=cfg.algo.clip_ratio_c,
        weights=b.loss_weights_BT,
        ratio_level=cfg.algo.ratio_level,
        loss_fn=cfg.algo.loss_fn,
        return_stats=True,
        **divisors,
    )
    if state.ref_model is None:
        return loss, entropy_BT, stats, None
    kl = algo.aggregate(algo.kl_k3(logp_BT, b.ref_logprobs_BT), b.loss_mask_BT, **divisors)
    return loss + cfg.algo.kl_coef * kl, entropy_BT, stats, float(kl.detach())


def _idle_pass(state: TrainState, episode: Episode, device) -> None:
    """A forward and a backward that add nothing to the gradient (a zero upstream gradient)."""
    cfg = state.cfg
    b = collate([episode], pad_id=state.tokenizer.pad_token_id).to(device)
    with autocast(state.model, DTYPES[cfg.model.compute_dtype], state.device):
        logp_BT, _ = batch_logprobs(
            state.model,
            b,
            temperature=cfg.rollout.temperature,
            share_prompts=cfg.train.share_prompts,
        )
    logp_BT.backward(torch.zeros_like(logp_BT))


def _micro_sums(b: Batch, loss, entropy_BT, stats, *, shared: bool) -> dict[str, float]:
    """A micro-batch's share of the step's metrics, as sums to divide once at the end."""
    slots, real = forward_slots(b, shared=shared)
    n = float(stats["num_tokens"])
    tokens = algo.token_sums(entropy_BT, b.old_logprobs_BT, b.loss_mask_BT)
    return {
        "slots": slots,
        "real": real,
        "tokens": n,
        "loss": float(loss.detach()),
        "entropy_sum": float(tokens["entropy_sum"]),
        "prob_sum": float(tokens["prob_sum"]),
        "clip_low": float(stats["clip_low_frac"]) * n,
        "clip_high": float(stats["clip_high_frac"]) * n,
        "clip_dual": float(stats["dual_clip_frac"]) * n,
        "clip_high_prob_sum": float(stats["clip_high_prob_mean"] * stats["num_clip_high"]),
        "num_clip_high": float(stats["num_clip_high"]),
    }
