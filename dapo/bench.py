"""``dapo bench [--steps N] [--warmup W] [--fixed-length] [overrides]``: where a step's time goes.

Runs W untimed steps, then N timed ones, of the configured training (the embedded demo by
default), writing nothing, and prints one JSON object: median seconds per step and per phase
(generate, reward, logprobs = the pi_old / pi_ref forward passes, train, other) with shares,
generated and trained tokens/s, padding in generation and in training micro-batches, and peak
memory. ``--fixed-length`` ignores EOS so every response is max_new_tokens long, and turns
dynamic sampling off: equal work for comparisons between systems.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

PHASES = ("generate", "reward", "logprobs", "train", "other")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="time training steps by phase and print one JSON object", description=__doc__
    )
    bench.add_argument("--config", help="YAML file of config sections")
    bench.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    bench.add_argument(
        "--fixed-length", action="store_true", help="ignore EOS: every response max_new_tokens"
    )
    bench.add_argument("overrides", nargs="*", metavar="section.field=value")
    bench.set_defaults(func=cmd_bench)


def summarize_steps(steps: list[dict[str, float]]) -> dict:
    """Medians over timed steps of the trainer's perf/* metrics (a pure function)."""

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steps)

    step_s = med("perf/step_s")
    return {
        "steps": len(steps),
        "step_s": step_s,
        "phases": {
            p: {"s": med(f"perf/{p}_s"), "share": med(f"perf/{p}_s") / step_s if step_s else 0.0}
            for p in PHASES
        },
        "gen_tokens_per_s": med("perf/gen_tokens_per_s"),
        "train_tokens_per_s": med("perf/train_tokens_per_s"),
        "gen_padding_frac": med("perf/gen_padding_frac"),
        "train_padding_frac": med("perf/train_padding_frac"),
        "tokens_generated": med("sampling/tokens_generated"),
        "response_len_mean": med("rollout/response_len_mean"),
    }


def _peak_memory() -> dict[str, float]:
    import resource

    import torch

    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from dapo import inputs
    from dapo.cli import _device, load_policy
    from dapo.config import load_config
    from dapo.model import DTYPES
    from dapo.reward_pool import RewardPool
    from dapo.trainer import build_state, train_step

    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0")
    # Equal work also means no dynamic sampling: how many rounds it takes depends on the policy.
    fixed = ["rollout.ignore_eos=true", "sampling.dynamic=false"] if args.fixed_length else []
    overrides = list(args.overrides) + fixed
    cfg = load_config(args.config, overrides)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    data = inputs.load_run_data(cfg)
    tokenizer = inputs.load_tokenizer(cfg)
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731 - stdout is the JSON only
    model, tokenizer = load_policy(cfg, data.warmup_pairs, tokenizer, log=log)
    model.to(_device(cfg.model.device), dtype=DTYPES[cfg.model.dtype])
    state = build_state(cfg, model, tokenizer, data.train)
    r = cfg.reward
    timed = []
    with RewardPool(workers=r.workers, timeout_s=r.timeout_s, memory_mb=r.memory_mb) as pool:
        state.pool = pool
        for i in range(args.warmup + args.steps):
            metrics = train_step(state)
            if i >= args.warmup:
                timed.append(metrics)
            log(f"bench step {i + 1}/{args.warmup + args.steps}: {metrics['perf/step_s']:.2f} s")
    result = {
        **summarize_steps(timed),
        **_peak_memory(),
        "fixed_length": args.fixed_length,
        "threads": torch.get_num_threads(),
        "device": str(next(model.parameters()).device),
        "responses_per_step": cfg.responses_per_step,
        "max_new_tokens": cfg.rollout.max_new_tokens,
    }
    print(json.dumps(result, indent=2))
    return 0
