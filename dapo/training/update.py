"""Phase 4 of a step: pi_old (and pi_ref) log-probs, then mu epochs of mini-batch updates.

Each micro-batch loss is divided by the token count (token-mean) or sequence count
(seq-mean-token-mean) of its whole mini-batch, summed over data-parallel ranks, so the
accumulated gradient is exactly the mini-batch gradient whatever the micro-batch split
(DAPO §3.3; tested through a real transformer). The micro-batches are the one loop of
:mod:`dapo.training.microbatches`; a mini-batch's metrics stay on the device and are read
back once, with its gradient norm. No maths here either: the loss, the KL and the token
statistics are :mod:`dapo.algo` functions.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.utils import get_total_norm

from dapo import algo, dist
from dapo.config import AlgoConfig
from dapo.data.batch import Batch, Episode, partition_by_tokens
from dapo.dist import fsdp
from dapo.models import dropout
from dapo.models.logprobs import autocast, batch_logprobs, forward_slots
from dapo.models.policy import DTYPES
from dapo.run.metrics import accumulate
from dapo.training.exchange import MiniBatch, trained_by, training_plan
from dapo.training.microbatches import DeviceSums, micro_batches
from dapo.training.old_logprobs import fill_logprobs, set_loss_weights, set_old_logprobs

if TYPE_CHECKING:
    from dapo.training.state import TrainState


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient norm."""


def update(
    state: TrainState,
    episodes: list[Episode],
    *,
    lr: float,
    plan: list[MiniBatch] | None = None,
    sampler_is_policy: bool | None = None,
) -> dict[str, float]:
    """mu epochs over the step's responses, one optimizer update per mini-batch of ``plan``
    (default: :func:`~dapo.training.exchange.training_plan`; under ranks, only the episodes
    this rank trains need be whole). ``sampler_is_policy``: whether the sampler's log-probs
    are the policy's own (the rollout source says; default: the engine's, drawn in turn).

    Each micro-batch loss is divided by the token count (token-mean) or sequence count
    (seq-mean-token-mean) of its whole mini-batch, so the accumulated gradient is exactly the
    mini-batch gradient, whatever the micro-batch split (DAPO §3.3).
    """
    cfg = state.cfg
    plan = plan or training_plan(cfg.train, cfg.rollout.group_size, state.step, episodes)
    share = trained_by(plan, dist.rank())
    first_epoch = plan[: len(plan) // cfg.train.epochs]
    exact = state.engine.exact_logprobs if sampler_is_policy is None else sampler_is_policy
    t_logprobs = time.perf_counter()
    check = set_old_logprobs(state, episodes, share, sampler_is_policy=exact)
    counted = trained_by(first_epoch, dist.rank())
    check |= set_loss_weights(state, episodes, share, counted, sampler_is_policy=exact)
    if state.has_reference:
        with state.reference() as reference:
            fill_logprobs(reference, episodes, "ref_logprobs", state, share)
    accumulate(state.timers, "logprobs", time.perf_counter() - t_logprobs)
    for group in state.optimizer.param_groups:
        group["lr"] = lr

    dropout.update_mode(state.model)
    sums: dict[str, float] = {}
    for mb in plan:
        batch = [episodes[i] for i in mb.indices]
        for k, v in minibatch_update(state, batch, mb.shares[dist.rank()]).items():
            accumulate(sums, k, v)
    # Finite gradients can still step to NaN (an optimizer state that underflows): stop before
    # the next rollout samples from broken weights. Once a step, not once an update: a
    # mini-batch's one wait for the device is its metrics' read (a later mini-batch on broken
    # weights has a NaN loss and is skipped). The ranks agree on `updates`: one collective.
    if sums.get("updates") and dist.any_rank(not trained_weights_finite(state.optimizer)):
        raise NonFiniteError(_broken_weights_message(state))
    out = update_metrics(sums, cfg.train.epochs, lr=lr, with_kl=state.has_reference)
    if state.scaler is not None:
        out["train/scaler_overflows"] = sums.get("scaler_overflows", 0.0)
        out["train/loss_scale"] = state.scaler.get_scale()
    return out | check


def minibatch_update(
    state: TrainState, batch: list[Episode], share: list[int] | None = None
) -> dict[str, float]:
    """One optimizer update on ``batch``, this rank training ``batch[share]`` (default: its
    share by :func:`partition_by_tokens`), skipped when its loss or gradient norm is not
    finite; returns its metric sums, read back from the device once, with the norm."""
    # The loss divisors of the whole mini-batch (every rank holds all of it), fixed before the
    # first micro-batch; DAPO §3.3. Each rank then computes its share's gradient.
    num_tokens = sum(e.num_loss_tokens for e in batch)
    num_seqs = sum(1 for e in batch if e.num_loss_tokens > 0)
    if num_tokens == 0:
        return {}  # every response of this mini-batch was overlong-filtered
    if share is None:
        share = partition_by_tokens(batch, dist.world_size())[dist.rank()]
    sums = accumulate_gradients(state, batch, share, num_tokens=num_tokens, num_seqs=num_seqs)
    if state.scaler is not None:
        state.scaler.unscale_(state.optimizer)  # clip and measure the true gradient
    # An infinite max_norm measures the norm without clipping (grad_clip = 0: off).
    clip = state.cfg.optim.grad_clip
    norm = fsdp.clip_grad_norm(state.model.parameters(), clip if clip > 0 else float("inf"))
    values = sums.read(grad_norm=norm)  # the mini-batch's one read back to the host
    return _step_or_skip(state, values, values.pop("grad_norm"))


def _step_or_skip(state: TrainState, sums: dict[str, float], norm: float) -> dict[str, float]:
    """The optimizer's step, or none when the loss or the gradient norm is not finite."""
    scaler = state.scaler
    if not (math.isfinite(sums["loss"]) and math.isfinite(norm)):
        # One NaN step poisons Adam's moments for good: drop this update, keep going.
        state.optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update()  # after unscale_ it must run, skip or not; it halves the scale
            if math.isfinite(sums["loss"]) and scaler.get_scale() >= 1.0:
                # Only the scaled gradient overflowed float16: a smaller scale will do.
                return {"skipped": 1.0, "scaler_overflows": 1.0}
        state.consecutive_skips += 1
        if state.consecutive_skips >= state.cfg.train.max_consecutive_skips:
            if dist.any_rank(not trained_weights_finite(state.optimizer)):
                raise NonFiniteError(_broken_weights_message(state))  # the cause, not the skips
            raise NonFiniteError(
                f"step {state.step + 1}: {state.consecutive_skips} updates in a row had "
                f"a non-finite loss or gradient norm (loss {sums['loss']}, grad "
                f"norm {norm}), so training stopped. The failed update was not saved. "
                "Try a lower optim.lr, optim.grad_clip > 0, or model.compute_dtype=float32 or "
                "bfloat16 instead of float16, and check the data and the model."
            )
        return {"skipped": 1.0}
    state.consecutive_skips = 0
    # The gradients are unscaled and finite already, so the scaler's step would only pass its
    # checks on (to a fused AdamW as arguments, which a foreach one refuses: a checkpoint
    # written by the other kind); the optimizer steps itself, and the scaler updates after.
    state.optimizer.step()
    if scaler is not None:
        scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    return sums | {"grad_norm": norm, "updates": 1.0}


def trained_weights_finite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every weight ``optimizer`` steps is finite (this rank's shards only; the caller
    combines ranks): their largest magnitude, by torch's multi-tensor kernel where there is
    one, read back once. Exact, unlike a sum, which finite weights could overflow."""
    weights = [  # a DTensor's own shard (only dapo.dist imports torch.distributed)
        p.to_local() if hasattr(p, "to_local") else p
        for group in optimizer.param_groups
        for p in group["params"]
    ]
    # A rank's shard may be empty, and the max-norm of no element is undefined.
    weights = [w for w in weights if w.numel()]
    if not weights:
        return True
    return bool(torch.isfinite(get_total_norm(weights, norm_type=math.inf)))


def _broken_weights_message(state: TrainState) -> str:
    """What stops a run whose weights an update left NaN or inf, and the fix."""
    m = state.cfg.model
    # Only float16 is too narrow for AdamW's state (bfloat16 has float32's range); the config
    # refuses it, but a Config built in Python may set it after the checks.
    if m.param_dtype == "float16" and not m.lora.rank:
        fix = (
            "AdamW's state in model.param_dtype=float16 underflows; set "
            "model.param_dtype=float32 model.compute_dtype=float16 (float32 weights and "
            "state, float16 compute with a loss scaler)"
        )
    else:
        fix = "Try a lower optim.lr or optim.grad_clip > 0, and check the data and the model"
    return (
        f"step {state.step + 1}: an optimizer update left weights that are NaN or inf (its "
        "loss and gradient norm were finite), so training stopped before generating from "
        f"them. The failed update was not saved. {fix}."
    )


def untrained_metrics(state: TrainState, lr: float) -> dict[str, float]:
    """:func:`update`'s figures for a step that kept no group (``sampling.on_max_rounds=
    train``): no update, no token, and no figure of the policy (NaN: null in metrics.jsonl),
    so that every step logs the same ``train/*`` keys."""
    out = update_metrics({}, state.cfg.train.epochs, lr=lr, with_kl=state.has_reference)
    if state.scaler is not None:
        out["train/scaler_overflows"] = 0.0
        out["train/loss_scale"] = state.scaler.get_scale()
    return out


def update_metrics(
    sums: dict[str, float], epochs: int, *, lr: float, with_kl: bool
) -> dict[str, float]:
    """A step's ``train/*``, ``clip/*`` and padding metrics from its sums over the
    mini-batches (:func:`minibatch_update`'s), NaN (null in metrics.jsonl) where a figure is
    a mean over nothing."""
    updates = max(sums.get("updates", 0.0), 1.0)
    tokens = max(sums.get("tokens", 0.0), 1.0)
    # No token trained (every row overlong-filtered): no figure of the policy, not a 0 that
    # reads as a collapsed entropy (NaN: null in metrics.jsonl).
    seen = 1.0 if sums.get("tokens") else math.nan
    out = {
        "train/loss": seen * sums.get("loss", 0.0) / updates,
        "train/entropy": seen * sums.get("entropy_sum", 0.0) / tokens,
        "train/token_prob_mean": seen * sums.get("prob_sum", 0.0) / tokens,
        # A mean over no applied update is no figure (it read 0.0).
        "train/grad_norm": sums.get("grad_norm", 0.0) / updates
        if sums.get("updates")
        else math.nan,
        "train/updates": sums.get("updates", 0.0),
        "train/skipped_updates": sums.get("skipped", 0.0),
        "train/lr": lr,
        "train/tokens": sums.get("tokens", 0.0) / epochs,
        # No position computed: no share of padding (it read 1.0, all padding).
        "perf/train_padding_frac": 1.0 - sums["real"] / sums["slots"]
        if sums.get("slots")
        else math.nan,
        "clip/low_frac": seen * sums.get("clip_low", 0.0) / tokens,
        "clip/high_frac": seen * sums.get("clip_high", 0.0) / tokens,
        "clip/dual_frac": seen * sums.get("clip_dual", 0.0) / tokens,
        # A mean over the up-clipped tokens: none clipped, no figure (it read 0.0, which a
        # figure draws as the clip binding on tokens of probability 0).
        "clip/high_prob_mean": sums.get("clip_high_prob_sum", 0.0) / sums["num_clip_high"]
        if sums.get("num_clip_high")
        else math.nan,
    }
    if with_kl:
        kl_den = sums.get("kl_den", 0.0)
        out["train/kl"] = sums.get("kl_sum", 0.0) / kl_den if kl_den else math.nan
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
    share: list[int] | None = None,
    *,
    num_tokens: int,
    num_seqs: int,
) -> DeviceSums:
    """Backward over the micro-batches of ``episodes[share]`` (default: all), this rank's
    share of the mini-batch ``episodes``; returns the mini-batch's metric sums over every
    rank, on the device (:meth:`DeviceSums.read` brings them back).

    Every micro-batch loss is divided by ``num_tokens`` (token-mean) or ``num_seqs``
    (seq-mean-token-mean) of the whole mini-batch, never by its own count, so the accumulated
    gradient, summed over ranks, is the mini-batch gradient whatever the split.
    """
    cfg, model = state.cfg, state.model
    a, t = cfg.algo, cfg.train
    denominator = num_tokens if a.loss_agg == "token-mean" else num_seqs
    divisors = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_len=cfg.rollout.max_new_tokens)
    options = _forward_options(state)
    sums = DeviceSums(state.device)
    # A sum over the mini-batch does not depend on the order: rows of similar length (and a
    # group's rows) go together, for less padding and more shared prompts.
    share = list(range(len(episodes))) if share is None else share
    pad_id = state.tokenizer.pad_token_id
    for micro in micro_batches(
        episodes,
        share,
        max_tokens=t.tokens_per_microbatch,
        pad_id=pad_id,
        device=state.device,
        packed=t.packing,
    ):
        if cfg.dist.grad_sync == "minibatch":  # reduce-scatter once, after the last backward
            fsdp.set_grad_sync(model, micro.last)
        if micro.idle:  # another rank has more: a pass with zero gradient, to match it
            with autocast(model, **options["autocast"]):
                logp_BT, _ = batch_logprobs(model, micro.batch, **options["forward"])
            logp_BT.backward(torch.zeros_like(logp_BT))
            continue
        with autocast(model, **options["autocast"]):
            logp_BT, entropy_BT = batch_logprobs(
                model, micro.batch, with_entropy=True, **options["forward"]
            )
        ref_BT = micro.batch.ref_logprobs_BT if state.has_reference else None
        loss, stats, kl = micro_loss(logp_BT, micro.batch, algo_cfg=a, ref_BT=ref_BT, **divisors)
        if kl is not None:
            sums.add("kl_sum", kl.detach().double() * denominator)
        (state.scaler.scale(loss) if state.scaler is not None else loss).backward()
        _add_micro_sums(sums, micro.batch, loss, entropy_BT, stats, shared=t.share_prompts)
    sums = sums.summed_over_ranks(RANK_SUMS)
    if state.has_reference:
        sums.add("kl_den", float(denominator))
    return sums


def _forward_options(state: TrainState) -> dict[str, dict[str, Any]]:
    cfg = state.cfg
    return {
        "autocast": {"compute_dtype": DTYPES[cfg.model.compute_dtype], "device": state.device},
        "forward": {
            "temperature": cfg.rollout.temperature,
            "share_prompts": cfg.train.share_prompts,
        },
    }


def micro_loss(
    logp_BT: torch.Tensor,
    b: Batch,
    *,
    algo_cfg: AlgoConfig,
    ref_BT: torch.Tensor | None = None,
    num_tokens: int,
    num_seqs: int,
    norm_len: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """(loss, the loss's statistics, the KL term or None) of micro-batch ``b`` whose current
    log-probs are ``logp_BT``: ``algo.policy_loss`` as the ``algo`` config section sets it,
    plus ``algo.kl_coef`` times the k3 KL to the reference's ``ref_BT`` where there is one.
    ``num_tokens``, ``num_seqs``: the whole mini-batch's (DAPO §3.3)."""
    a = algo_cfg
    divisors = dict(agg=a.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    loss, stats = algo.policy_loss(
        logp_BT,
        b.old_logprobs_BT,
        b.advantages_B,
        b.loss_mask_BT,
        eps_low=a.eps_low,
        eps_high=a.eps_high,
        clip_ratio_c=a.clip_ratio_c,
        weights=b.loss_weights_BT,
        ratio_level=a.ratio_level,
        loss_fn=a.loss_fn,
        return_stats=True,
        **divisors,
    )
    if ref_BT is None:
        return loss, stats, None
    kl = algo.aggregate(algo.kl_k3(logp_BT, ref_BT), b.loss_mask_BT, **divisors)
    return loss + a.kl_coef * kl, stats, kl


def _add_micro_sums(sums: DeviceSums, b: Batch, loss, entropy_BT, stats, *, shared: bool) -> None:
    """A micro-batch's share of the step's metrics, as sums kept on the device (float64, as a
    host-side sum of the values would be)."""
    slots, real = forward_slots(b, shared=shared)
    n = stats["num_tokens"].double()
    tokens = algo.token_sums(entropy_BT, b.old_logprobs_BT, b.loss_mask_BT, b.loss_index_N)
    sums.add("slots", slots)
    sums.add("real", real)
    sums.add("tokens", n)
    sums.add("loss", loss)
    sums.add("entropy_sum", tokens["entropy_sum"])
    sums.add("prob_sum", tokens["prob_sum"])
    sums.add("clip_low", stats["clip_low_frac"].double() * n)
    sums.add("clip_high", stats["clip_high_frac"].double() * n)
    sums.add("clip_dual", stats["dual_clip_frac"].double() * n)
    sums.add("clip_high_prob_sum", stats["clip_high_prob_mean"] * stats["num_clip_high"])
    sums.add("num_clip_high", stats["num_clip_high"])
