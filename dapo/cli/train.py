"""``dapo train [--config FILE] [--preset dapo|grpo] [section.field=value ...]``.

Everything that can be wrong with the command is checked before a model is loaded: the config
(every bad value at once), the run directory, the disk, the model path, the data, the
verifiers, the tokenizer and the context length. Then the policy is loaded and
:func:`dapo.train.loop.fit` trains it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapo.config import Config
    from dapo.train.inputs import RunData


def add_parser(sub: argparse._SubParsersAction) -> None:
    from dapo.config import presets  # the standard library only

    train = sub.add_parser(
        "train", help="train a policy with DAPO (default: the CPU demo)", description=__doc__
    )
    train.add_argument("--config", type=Path, help="YAML file of config sections")
    train.add_argument(
        "--preset", choices=tuple(presets.ALGORITHMS), help="algorithm preset (default dapo)"
    )
    train.add_argument(
        "--base",
        choices=tuple(presets.BASES),
        help="starting scale: demo (default without --config) or paper",
    )
    train.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve the config, load tokenizer and data, print statistics and exit",
    )
    train.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="with --dry-run: plan memory for N ranks "
        "(default: $WORLD_SIZE under torchrun, else 1)",
    )
    train.add_argument(
        "--quiet",
        action="store_true",
        help="one plain line per step, no live display (same as run.progress=plain)",
    )
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest complete checkpoint",
    )
    train.add_argument(
        "--force",
        action="store_true",
        help="with --resume: accept config changes that make the run differ from the saved one",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in the run directory (default: refuse)",
    )
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="config overrides applied last, e.g. optim.lr=1e-5 algo.eps_high=0.28",
    )
    train.set_defaults(func=cmd_train)


def describe(cfg: Config) -> str:
    """The run's batch sizes in their units, printed at start."""
    t, r = cfg.train, cfg.rollout
    return (
        f"preset {cfg.run.preset} on base {cfg.run.base}: {t.prompts_per_step} prompts/step x "
        f"{r.group_size} responses/prompt = {cfg.responses_per_step} responses/step; "
        f"{t.responses_per_minibatch} responses/mini-batch x {t.epochs} epoch(s) = "
        f"{cfg.updates_per_step} gradient updates/step; micro-batches of <= "
        f"{t.tokens_per_microbatch} padded tokens; L_max {r.max_new_tokens} tokens"
    )


def resolve_config(args: argparse.Namespace) -> tuple[Config, Path | None]:
    """The run's config; with --resume, the saved one under any flags and overrides given."""
    from dapo.config import load_config, run_changing_differences, saved_before_keys_moved
    from dapo.run import rundir

    if not args.resume:
        return load_config(args.config, args.overrides, base=args.base, preset=args.preset), None
    if args.overwrite:
        raise ValueError("--resume continues a run and --overwrite replaces it: give one")
    run_dir = rundir.existing_run_dir(args.resume)
    saved_path = run_dir / "config.yaml"
    saved = load_config(saved_path)
    if saved_before_keys_moved(saved_path):
        print(
            f"dapo: notice: {run_dir} was saved by dapo 0.1, and 0.2 continues it differently: "
            "reward.mode=dapo (and data_source math_dapo) now follows the reference verifier "
            "exactly (0.1's rules are reward.mode=lenient), sampling draws in float64, and "
            "model.dtype is now model.compute_dtype, with float32 weights",
            file=sys.stderr,
        )
    cfg = load_config(args.config or saved_path, args.overrides, base=args.base, preset=args.preset)
    differences = run_changing_differences(saved, cfg)
    if differences and not args.force:
        listing = "\n  ".join(differences)
        raise ValueError(
            f"--resume {run_dir}: the config differs from the run's in fields that change the "
            f"run:\n  {listing}\nthe resumed run would not be the run that was started. Drop "
            "these changes, or add --force to resume with them anyway (the old config.yaml is "
            "kept beside the new one)"
        )
    return cfg, run_dir


def cmd_train(args: argparse.Namespace) -> int:
    from dapo import dist
    from dapo.config import config_warnings, dump_yaml

    cfg, run_dir = resolve_config(args)
    if args.quiet:
        cfg.run.progress = "plain"
    if dist.launched() and not args.dry_run and not args.print_config:
        try:
            return _train_ranks(args, cfg, run_dir)
        finally:
            dist.shutdown()
    for warning in config_warnings(cfg):
        print(f"dapo: warning: {warning}", file=sys.stderr)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    resume = run_dir is not None
    return _train(args, cfg, _checked_run_dir(args, cfg, run_dir), resume)


def _train(args: argparse.Namespace, cfg: Config, run_dir: Path | None, resume: bool) -> int:
    """Check the model path, data, verifiers and context, then train (or, with --dry-run,
    print what the run would be)."""
    import torch

    from dapo import dist
    from dapo.models import policy
    from dapo.run import rundir
    from dapo.train import inputs
    from dapo.train.loop import fit

    policy.device(cfg.model.device)  # raises now if CUDA is asked for and absent
    if cfg.model.path != "embedded":
        policy.check_model_path(cfg)
    import importlib.util

    if cfg.run.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError("run.wandb=true needs the wandb package: pip install wandb")
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        from dapo.rollout.vllm_engine import INSTALL_HINT

        raise ValueError(INSTALL_HINT)
    data = inputs.load_run_data(cfg)
    if cfg.eval.num_samples == 0:
        cfg.eval.num_samples = data.val_copies
    inputs.check_verifiers(cfg, data)
    tokenizer = policy.load_tokenizer(cfg)
    lengths = inputs.check_context(cfg, data, tokenizer)
    if args.dry_run:
        _print_dry_run(
            cfg, data, lengths, args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
        )
        return 0
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.train.seed)
    _print_plan(cfg, data)
    print(f"run directory: {run_dir}")
    if dist.is_main():
        rundir.write_config(run_dir, cfg)
    # A resumed run starts from the same policy (it is the KL reference) and then loads the
    # checkpoint's weights over it. Under torchrun, rank 0 builds (and caches) the embedded
    # one before the other ranks load it.
    if not dist.is_main():
        dist.barrier()
    model, tokenizer = policy.load_policy(cfg, data.warmup_pairs, tokenizer)
    if dist.is_main():
        dist.barrier()
    fit(cfg, model, tokenizer, data.train, data.val, run_dir=run_dir, resume=resume)
    return 0


def _train_ranks(args: argparse.Namespace, cfg: Config, run_dir: Path | None) -> int:
    """``dapo train`` as one rank of a ``torchrun`` job: rank 0 checks and creates the run
    directory and prints; the other ranks follow it with their standard output silenced
    (their errors still reach standard error, naming the rank)."""
    from dapo import dist
    from dapo.config import config_warnings

    dist.init_from_env(timeout_s=cfg.dist.timeout_s)
    resume = run_dir is not None
    if not dist.is_main():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    else:
        for warning in config_warnings(cfg):
            print(f"dapo: warning: {warning}", file=sys.stderr)
    try:
        if dist.is_main():
            run_dir = _checked_run_dir(args, cfg, run_dir)
        return _train(args, cfg, dist.broadcast(run_dir), resume)
    except Exception:
        if dist.world_size() > 1:
            print(f"dapo: rank {dist.rank()} of {dist.world_size()} failed:", file=sys.stderr)
        raise


def _checked_run_dir(args: argparse.Namespace, cfg: Config, run_dir: Path | None) -> Path | None:
    """The run directory, created (a new run) or checked to hold a checkpoint (a resume), and
    checked to be writable with room for checkpoints. A dry run creates nothing (None for a
    new run); a dry resume still checks the run's directory."""
    from dapo.run import checkpoint, rundir

    if not args.dry_run:
        if run_dir is None:
            run_dir = rundir.new_run_dir(cfg, overwrite=args.overwrite)
        elif checkpoint.find_latest(run_dir) is None:
            raise ValueError(
                f"--resume {run_dir}: no complete checkpoint there (it stopped before its first "
                "one); start it again with --overwrite"
            )
    if run_dir is not None:
        rundir.check_writable(run_dir)
        rundir.check_space(run_dir, cfg)
    return run_dir


def _print_plan(cfg: Config, data: RunData) -> None:
    print(describe(cfg))
    for line in data.notes:
        print(line)


def _print_dry_run(cfg: Config, data: RunData, lengths: dict[str, float], world_size: int) -> None:
    from dapo.config import dump_yaml
    from dapo.train import inputs, memory_plan

    print(dump_yaml(cfg), end="")
    _print_plan(cfg, data)
    print(
        f"train {len(data.train)} problems, val {len(data.val)} problems x "
        f"{cfg.eval.num_samples} samples; prompt tokens min {lengths['prompt_tokens_min']}, "
        f"median {lengths['prompt_tokens_median']:.0f}, max {lengths['prompt_tokens_max']} "
        f"(model context {lengths['context']:.0f})"
    )
    print(inputs.describe_budget(cfg, lengths))
    memory_plan.print_plan(
        cfg, world_size=world_size, prompt_tokens=int(lengths["prompt_tokens_max"])
    )
    print("dry run: config, tokenizer and data are valid; nothing was trained or written")
