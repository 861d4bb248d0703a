"""The memory plan against measurement: the peak resident memory of each rank over a few
training steps, next to what ``dapo.training.gpu_memory`` says for the same config and world
size. On a CPU everything the plan counts per "GPU" is host memory, so the comparison is
peak RSS minus the process's own baseline (Python, torch, transformers, the data and the
tokenizer, measured just before the model loads) against the plan's peak.

    python benchmarks/memory_check.py [--steps 2] [--json] [OVERRIDES ...]
    torchrun --standalone --nproc-per-node 2 benchmarks/memory_check.py [OVERRIDES ...]

OVERRIDES are ``dapo train``'s (``--config RECIPE``, ``section.field=value``). Each rank
prints one line (with ``--json``, one JSON object): baseline, peak and used MiB, the plan's
peaks in training and generation, and used / plan.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch

from dapo import dist
from dapo.config import load_config
from dapo.models import policy
from dapo.training import inputs
from dapo.training.gpu_memory import model_shape, plan_memory, settings_from_config
from dapo.training.state import build_state
from dapo.training.step import train_step

MIB = 2**20


def rss_mib() -> float:
    """This process's resident memory now (/proc/self/statm), in MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / MIB


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    dist.init_from_env(timeout_s=cfg.dist.timeout_s, wait_timeout_s=cfg.dist.wait_timeout_s)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    data = inputs.load_run_data(cfg)
    tokenizer = policy.load_tokenizer(cfg)
    prompts = inputs.prompt_lengths(cfg, tokenizer, data.train)
    baseline = rss_mib()
    if not dist.is_main():  # rank 0 builds (and caches) the embedded model first
        dist.wait_for_all()
    model, tokenizer = policy.load_policy(
        cfg, data.warmup_pairs, tokenizer, log=lambda _: None, shard=dist.active()
    )
    if dist.is_main():
        dist.wait_for_all()
    state = build_state(cfg, model, tokenizer, data.train)
    for _ in range(args.steps):
        train_step(state)
    peak = peak_rss_mib()
    # On a GPU the plan's per-device figure is what the allocator held at most there.
    on_cuda = next(state.model.parameters()).device.type == "cuda"
    cuda_peak = torch.cuda.max_memory_allocated() / MIB if on_cuda else None
    settings = settings_from_config(cfg, world_size=dist.world_size(), prompt_tokens=max(prompts))
    plan = plan_memory(model_shape(cfg), settings)
    row = {
        "rank": dist.rank(),
        "world_size": dist.world_size(),
        "model": cfg.model.path,
        "baseline_mib": round(baseline, 1),
        "peak_mib": round(peak, 1),
        "used_mib": round(peak - baseline, 1),
        "plan_train_mib": round(plan.training_peak / MIB, 1),
        "plan_generate_mib": round(plan.generation_peak / MIB, 1),
        "used_over_plan": round((peak - baseline) / (plan.total / MIB), 3),
        "cuda_peak_mib": None if cuda_peak is None else round(cuda_peak, 1),
        "cuda_over_plan": None if cuda_peak is None else round(cuda_peak / (plan.total / MIB), 3),
    }
    print(json.dumps(row) if args.json else " ".join(f"{k}={v}" for k, v in row.items()))
    sys.stdout.flush()
    dist.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
