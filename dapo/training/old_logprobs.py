"""Before the updates: pi_old (and pi_ref) log-probs, and the rollout correction's weights.

pi_old is recomputed by a forward pass, or the sampler's own log-probs stand in for it once a
forward pass has shown that they match (an exact engine). An engine whose log-probs are not
the trainer's (vLLM) gets per-token correction weights (``algo.rollout_correction``). Under
ranks each rank computes these for the episodes it trains
(:func:`dapo.training.exchange.trained_by`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from dapo import algo, dist
from dapo.config import AlgoConfig
from dapo.data.batch import Episode
from dapo.models.logprobs import autocast, batch_logprobs
from dapo.models.policy import DTYPES
from dapo.run.metrics import accumulate
from dapo.training.microbatches import micro_batches

if TYPE_CHECKING:
    from dapo.training.state import TrainState


SAMPLER_LOGPROB_TOLERANCE = 1e-3
"""Largest |sampler - forward| log-prob gap that lets the sampler's stand in for pi_old."""


@torch.no_grad()
def fill_logprobs(
    model,
    episodes: list[Episode],
    attr: str,
    state: TrainState,
    share: list[int] | None = None,
) -> None:
    """Forward passes without gradient to store pi_old or pi_ref log-probs on the episodes
    ``share`` (default: all; under ranks those this rank trains, and no rank needs another's).
    The micro-batches' log-probs stay on the device and come back to the host in one transfer,
    after the last."""
    cfg, device = state.cfg, state.device
    model.eval()
    share = list(range(len(episodes))) if share is None else share
    compute = DTYPES[cfg.model.compute_dtype]
    pad_id = state.tokenizer.pad_token_id
    rows: list[int] = []
    parts: list[torch.Tensor] = []
    for micro in micro_batches(
        episodes,
        share,
        max_tokens=cfg.train.tokens_per_microbatch,
        pad_id=pad_id,
        device=device,
        packed=cfg.train.packing,
    ):
        with autocast(model, compute, device):
            logp_BT, _ = batch_logprobs(
                model,
                micro.batch,
                temperature=cfg.rollout.temperature,
                share_prompts=cfg.train.share_prompts,
            )
        for row, i in enumerate(micro.rows):  # an idle pass has none: nothing kept
            rows.append(i)
            parts.append(logp_BT[row, : episodes[i].length].float())
    if not rows:
        return
    flat = torch.cat(parts).cpu()
    for i, logp in zip(rows, flat.split([episodes[i].length for i in rows]), strict=True):
        setattr(episodes[i], attr, logp)


def set_old_logprobs(
    state: TrainState,
    episodes: list[Episode],
    share: list[int] | None = None,
    *,
    sampler_is_policy: bool | None = None,
) -> dict[str, float]:
    """pi_old: recomputed by a forward pass, or the sampler's once they are shown to match it.

    The check runs on the first step of each process (one forward pass) and stops the run on a
    gap above the tolerance; otherwise the sampler's values are used, the ones an uninterrupted
    run used, and only the run's first step logs the gap, so a resumed run stays bit-identical.
    Rollouts whose sampler is not the policy (``sampler_is_policy`` False: an inexact engine,
    or drawn ahead from older weights; the rollout source says, default: the engine's
    exactness, as drawn in turn) never stand in for pi_old.
    """
    share = list(range(len(episodes))) if share is None else share
    if sampler_is_policy is None:
        sampler_is_policy = state.engine.exact_logprobs
    if state.cfg.train.recompute_old_logprobs or not sampler_is_policy:
        fill_logprobs(state.model, episodes, "old_logprobs", state, share)
        return {}
    out = {}
    if not state.sampler_logprobs_checked:
        fill_logprobs(state.model, episodes, "old_logprobs", state, share)
        gaps = [  # over the model's tokens: an environment's have no sampler log-prob
            algo.max_abs_gap(
                episodes[i].old_logprobs[episodes[i].model_mask()],
                episodes[i].sampler_logprobs[episodes[i].model_mask()],
            )
            for i in share
        ]
        gap = dist.all_reduce_max(max((float(g) for g in gaps), default=0.0))
        if not gap <= SAMPLER_LOGPROB_TOLERANCE:
            raise ValueError(
                f"train.recompute_old_logprobs=false: the sampler's log-probs differ from a "
                f"forward pass by up to {gap:.3g} (tolerance {SAMPLER_LOGPROB_TOLERANCE}) at "
                f"model.compute_dtype={state.cfg.model.compute_dtype}, so they cannot stand in "
                "for pi_old. "
                "Set train.recompute_old_logprobs=true (needed in bfloat16 and float16)."
            )
        state.sampler_logprobs_checked = True
        if state.step == 0:
            out["train/sampler_logprob_gap"] = gap
    for i in share:
        episodes[i].old_logprobs = episodes[i].sampler_logprobs
    return out


def correction_mode(algo_cfg: AlgoConfig, sampler_is_policy: bool) -> str:
    """``algo.rollout_correction`` with auto resolved: token_tis when the sampler's log-probs
    are not the trainer's (an inexact engine, or generation ahead of training), none when
    they are."""
    mode = algo_cfg.rollout_correction
    if mode == "auto":
        return "none" if sampler_is_policy else "token_tis"
    return mode


CORRECTION_CHUNK = 256
"""Responses padded together to compute their correction weights."""


def set_loss_weights(
    state: TrainState,
    episodes: list[Episode],
    share: list[int],
    counted: list[int],
    *,
    sampler_is_policy: bool | None = None,
) -> dict[str, float]:
    """The rollout correction's weights on the episodes ``share`` (``algo.rollout_correction``)
    and the mismatch between the sampler's log-probs and pi_old over the episodes ``counted``
    (each episode on one rank), for rollouts whose sampler is not the policy or when a
    correction is asked for; nothing otherwise."""
    exact = state.engine.exact_logprobs if sampler_is_policy is None else sampler_is_policy
    mode = correction_mode(state.cfg.algo, exact)
    if mode == "none" and exact:
        return {}
    sums = dict.fromkeys(("mismatch_abs", "mismatch_kl", "corrected_frac", "tokens"), 0.0)
    rest = sorted(set(share) - set(counted))  # trained here again in a later epoch
    for indices, stats_too in ((counted, True), (rest, False)):
        _correct(state, [episodes[i] for i in indices], mode, sums if stats_too else {})
    sums = dist.sum_dict(sums)
    tokens = max(sums.get("tokens", 0.0), 1.0)
    return {
        "mismatch/abs_log_ratio": sums.get("mismatch_abs", 0.0) / tokens,
        "mismatch/kl": sums.get("mismatch_kl", 0.0) / tokens,
        "mismatch/corrected_frac": sums.get("corrected_frac", 0.0) / tokens,
    }


def _correct(state: TrainState, episodes: list[Episode], mode: str, sums: dict) -> None:
    """Set ``episodes``' correction weights; add their mismatch statistics to ``sums``."""
    for start in range(0, len(episodes), CORRECTION_CHUNK):
        chunk = episodes[start : start + CORRECTION_CHUNK]
        old_BT = pad_sequence([e.old_logprobs for e in chunk], batch_first=True)
        rollout_BT = pad_sequence([e.sampler_logprobs for e in chunk], batch_first=True)
        # The tokens the loss keeps: an environment's tokens, and the responses overlong
        # filtering drops, are neither corrected nor counted ("per trained token").
        masks = [e.model_mask() & e.trainable for e in chunk]
        model_BT = pad_sequence(masks, batch_first=True)
        weights_BT, stats = algo.rollout_correction(
            old_BT,
            rollout_BT,
            model_BT,
            mode=mode,
            threshold=state.cfg.algo.rollout_correction_threshold,
        )
        n = float(stats["num_tokens"])
        for key in ("mismatch_abs", "mismatch_kl", "corrected_frac"):
            accumulate(sums, key, float(stats[key]) * n)
        accumulate(sums, "tokens", n)
        for row, e in enumerate(chunk):
            e.loss_weights = None if mode == "none" else weights_BT[row, : e.length].clone()
