"""Where a training step's time goes: W untimed steps, then N timed ones of a configured run,
writing nothing; medians per phase (generate, reward, logprobs = the pi_old / pi_ref forward
passes, train, other), tokens/s, padding, peak memory (the process's peak RSS over its whole
life; on CUDA, PyTorch's peak allocation over the timed steps alone). The command is ``dapo bench``
(:mod:`dapo.cli.bench`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import torch

from dapo.config import Config
from dapo.models import policy
from dapo.run.threads import ThreadGovernor
from dapo.training import inputs
from dapo.training.generator_ranks import rollout_source
from dapo.training.generator_thread import share_cores
from dapo.training.sources import RolloutSource
from dapo.training.state import TrainState, build_state, reward_pool
from dapo.training.step import train_step

PHASES = ("generate", "reward", "logprobs", "train", "other")
AHEAD_PHASES = ("trainer_idle", *PHASES)
"""Drawn ahead, generate and reward are the generator's, overlapped with the trainer's phases."""


def summarize_steps(steps: list[dict[str, float]]) -> dict:
    """Medians over timed steps of the trainer's perf/* metrics (a pure function)."""

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steps)

    step_s = med("perf/step_s")
    ahead = any("perf/trainer_idle_s" in m for m in steps)
    return {
        "steps": len(steps),
        "step_s": step_s,
        "phases": {
            p: {"s": med(f"perf/{p}_s"), "share": med(f"perf/{p}_s") / step_s if step_s else 0.0}
            for p in (AHEAD_PHASES if ahead else PHASES)
        },
        "gen_tokens_per_s": med("perf/gen_tokens_per_s"),
        "train_tokens_per_s": med("perf/train_tokens_per_s"),
        "gen_padding_frac": med("perf/gen_padding_frac"),
        "train_padding_frac": med("perf/train_padding_frac"),
        # Positions a forward pass computes per real token (1.0 packed).
        "train_positions_per_real_token": 1.0 / max(1.0 - med("perf/train_padding_frac"), 1e-9),
        "tokens_generated": med("sampling/tokens_generated"),
        "response_len_mean": med("rollout/response_len_mean"),
        # Drawn ahead: how many updates older than the trained policy the sampler was.
        **({"staleness_mean": med("async/staleness_mean")} if ahead else {}),
    }


def peak_memory(device: torch.device) -> dict[str, float | str]:
    """The process's peak RSS (its whole life: loading and the warm-up steps too) and, when
    ``device`` is a GPU, the most PyTorch allocated there since its peak was last reset
    (:func:`bench_steps` resets it after the warm-up: the timed steps alone)."""
    import resource

    out: dict[str, float | str] = {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    }
    if device.type == "cuda":
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        out["peak_cuda_covers"] = "the timed steps (reset after the model load and warm-up)"
    return out


def bench_steps(cfg: Config, *, steps: int, warmup: int, log: Callable[[str], None]) -> dict:
    """``warmup`` untimed steps, then ``steps`` timed ones; their medians, memory, setting.
    With ``train.async_staleness`` = k > 0 the steps are drawn ahead by a generator thread,
    as ``dapo train`` draws them: its generate and reward phases overlap the trainer's."""
    if cfg.dist.rollout_ranks:
        raise ValueError(
            f"dist.rollout_ranks={cfg.dist.rollout_ranks}: dapo bench runs one process, and "
            "generator ranks need torchrun; bench with dist.rollout_ranks=0 (and "
            "train.async_staleness=k for a generator thread), or read a torchrun run's "
            "perf/* metrics in its metrics.jsonl"
        )
    k = cfg.train.async_staleness
    if k:  # the generator thread draws through train.steps: at least the steps timed here
        steps_at_least = max(cfg.train.steps, warmup + steps)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps_at_least))
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    # The train prompts against the context as `dapo train` checks them, before the model
    # loads: past it a rotary model generates on, and the timing would be of no run's steps.
    # A bench samples no val prompt: those are not checked.
    data = dataclasses.replace(inputs.load_run_data(cfg), val=[])
    tokenizer = policy.load_tokenizer(cfg)
    notes = len(data.notes)
    inputs.check_context(cfg, data, tokenizer)
    for note in data.notes[notes:]:  # data.on_long_prompt=skip's count of what it dropped
        log(note)
    model, tokenizer = policy.load_policy(cfg, data.warmup_pairs, tokenizer, log=log)
    state = build_state(cfg, model, tokenizer, data.train)
    gen_threads, most = share_cores(cfg, beside=bool(k))  # as dapo train splits the cores
    if most and cfg.run.threads:
        torch.set_num_threads(most)
    with reward_pool(cfg) as pool:
        state.pool = pool
        source = rollout_source(
            state, make_pool=lambda: reward_pool(cfg), threads=gen_threads, restored=None
        )
        failed = True
        try:
            timed = _timed_steps(state, source, most, steps=steps, warmup=warmup, log=log)
            failed = False
        finally:
            source.close(failed=failed)
    return {
        **summarize_steps(timed),
        **peak_memory(state.device),
        "threads": statistics.median(m["perf/threads"] for m in timed),
        "device": str(state.device),
        "responses_per_step": cfg.responses_per_step,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "async_staleness": k,
    }


def _timed_steps(
    state: TrainState,
    source: RolloutSource,
    most: int | None,
    *,
    steps: int,
    warmup: int,
    log: Callable[[str], None],
) -> list[dict[str, float]]:
    """The metrics of the timed steps (after ``warmup`` untimed ones) from ``source``."""
    # run.threads=0 as in training: the cores other processes leave free, before each step
    # (``most``: at most the trainer's share beside a generator thread).
    governor = ThreadGovernor(most) if state.cfg.run.threads == 0 else None
    timed = []
    for i in range(warmup + steps):
        if i == warmup and state.device.type == "cuda":  # the timed steps' peak alone
            torch.cuda.reset_peak_memory_stats(state.device)
        if governor is not None:
            governor.adjust()
        metrics = {**train_step(state, source), "perf/threads": float(torch.get_num_threads())}
        if i >= warmup:
            timed.append(metrics)
        log(f"bench step {i + 1}/{warmup + steps}: {metrics['perf/step_s']:.2f} s")
    return timed
