"""``dapo bench [--steps N] [--warmup W] [--fixed-length] [overrides]``: where a step's time goes.

Runs W untimed steps, then N timed ones, of the configured training (the embedded demo by
default), writing nothing, and prints one JSON object: median seconds per step and per phase
(generate, reward, logprobs = the pi_old / pi_ref forward passes, train, other) with shares,
generated and trained tokens/s, padding in generation and in training micro-batches, and peak
memory (MiB). With train.async_staleness=k the steps are drawn ahead by a generator thread, as
in ``dapo train``: the phases add trainer_idle (the trainer's wait), and generate and reward
overlap the rest. ``--fixed-length`` ignores EOS so every response is max_new_tokens long, and turns
dynamic sampling off: equal work for comparisons between systems. Train prompts that with
rollout.max_new_tokens overrun the model's context are refused before the model loads, as by
``dapo train`` (data.on_long_prompt=skip drops them).
"""

from __future__ import annotations

import argparse
import json
import sys

from dapo.cli.flags import GivenOnce


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="time training steps by phase and print one JSON object", description=__doc__
    )
    bench.add_argument("--config", action=GivenOnce, help="YAML file of config sections")
    bench.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    bench.add_argument(
        "--fixed-length", action="store_true", help="ignore EOS: every response max_new_tokens"
    )
    bench.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="config overrides applied last, e.g. rollout.engine=hf",
    )
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from dapo.config import load_config
    from dapo.training.bench import bench_steps

    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0")
    # Equal work also means no dynamic sampling: how many rounds it takes depends on the policy.
    fixed = ["rollout.ignore_eos=true", "sampling.dynamic=false"] if args.fixed_length else []
    cfg = load_config(args.config, list(args.overrides) + fixed)
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731 - stdout is the JSON only
    items = list(bench_steps(cfg, steps=args.steps, warmup=args.warmup, log=log).items())
    # The setting first, then what was measured under it: fixed_length before the machine.
    at = [key for key, _ in items].index("threads")
    items.insert(at, ("fixed_length", args.fixed_length))
    print(json.dumps(dict(items), indent=2))
    return 0
