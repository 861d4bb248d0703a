"""A step's perf/* metrics: where its seconds went, and the throughput of each phase."""

from __future__ import annotations

import time

from dapo.training.sampling import SamplingResult


def step_perf(
    timers: dict[str, float],
    result: SamplingResult,
    metrics: dict[str, float],
    *,
    epochs: int,
    t0: float,
    t_gen: float,
    t_train: float,
) -> dict[str, float]:
    """Phases of the step: generate and reward split the rollout, logprobs (pi_old, pi_ref
    forward passes) and train split the update; other is the rest (advantages, bookkeeping).
    ``timers``: the step's (``TrainState.timers``); ``epochs``: ``train.epochs``."""
    step_s = time.perf_counter() - t0
    generate_s = t_gen - timers.get("reward", 0.0)
    train_s = t_train - timers.get("logprobs", 0.0)
    return {
        "perf/step_s": step_s,
        "perf/generate_s": generate_s,
        "perf/reward_s": timers.get("reward", 0.0),
        "perf/logprobs_s": timers.get("logprobs", 0.0),
        "perf/train_s": train_s,
        "perf/other_s": step_s - t_gen - t_train,
        "perf/gen_tokens_per_s": result.tokens_generated / max(generate_s, 1e-9),
        "perf/gen_padding_frac": 1.0
        - result.tokens_generated / max(timers.get("gen_slots", 0.0), 1.0),
        "perf/train_tokens_per_s": metrics.get("train/tokens", 0.0) * epochs / max(train_s, 1e-9),
    }
