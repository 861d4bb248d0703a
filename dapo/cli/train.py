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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dapo.config import Config
    from dapo.run.rundir import NewRun
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

    cfg, resume_dir = resolve_config(args)
    if args.quiet:
        cfg.run.progress = "plain"
    if dist.launched() and not args.dry_run and not args.print_config:
        try:
            return _train_ranks(args, cfg, resume_dir)
        finally:
            dist.shutdown()
    for warning in config_warnings(cfg):
        print(f"dapo: warning: {warning}", file=sys.stderr)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    return _train(args, cfg, resume_dir)


def _checked_inputs(cfg: Config) -> tuple[RunData, Any, dict[str, float]]:
    """The device, model path, optional packages, data, verifiers, tokenizer and context,
    checked: everything but the run directory, before anything on disk changes."""
    import importlib.util

    from dapo.models import policy
    from dapo.train import inputs

    policy.compute_device(cfg.model.device)  # raises now if it is absent or not this rank's
    if cfg.model.path != "embedded":
        policy.check_model_path(cfg)
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
    return data, tokenizer, inputs.check_context(cfg, data, tokenizer)


def _train(args: argparse.Namespace, cfg: Config, resume_dir: Path | None) -> int:
    """Check every input, then open the run directory (rank 0) and train; with --dry-run,
    print what the run would be. An earlier run that --overwrite replaces is moved aside
    only after every check, and removed only once the new run has started."""
    import torch

    from dapo import dist
    from dapo.models import policy
    from dapo.run import rundir
    from dapo.train.loop import fit

    data, tokenizer, lengths = _checked_inputs(cfg)
    if args.dry_run:
        if dist.is_main():
            _checked_run_dir(args, cfg, resume_dir)
        world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
        _print_dry_run(cfg, data, lengths, world_size)
        return 0
    opened = _open_run_dir(args, cfg, resume_dir) if dist.is_main() else None
    run_dir = dist.broadcast(opened.path if opened else None)
    started = False
    try:
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        torch.manual_seed(cfg.train.seed)
        _print_plan(cfg, data)
        print(f"run directory: {run_dir}")
        if dist.is_main():
            rundir.write_config(run_dir, cfg)
        # A resumed run starts from the same policy (it is the KL reference) and then loads
        # the checkpoint's weights over it. Under torchrun, rank 0 builds (and caches) the
        # embedded one before the other ranks load it.
        if not dist.is_main():
            dist.wait_for_all()
        model, tokenizer = policy.load_policy(cfg, data.warmup_pairs, tokenizer)
        if dist.is_main():
            dist.wait_for_all()
        started = True
        if opened is not None and resume_dir is None:
            rundir.finish_replacing(opened)
        fit(cfg, model, tokenizer, data.train, data.val, run_dir=run_dir, resume=bool(resume_dir))
    finally:
        if opened is not None:
            if not started and resume_dir is None:
                rundir.undo_new_run(opened)
            elif opened.lock is not None:
                opened.lock.release()
    return 0


def _train_ranks(args: argparse.Namespace, cfg: Config, resume_dir: Path | None) -> int:
    """``dapo train`` as one rank of a ``torchrun`` job: rank 0 checks and creates the run
    directory and prints; the other ranks follow it with their standard output silenced
    (their errors still reach standard error, naming the rank)."""
    from dapo import dist
    from dapo.config import config_warnings
    from dapo.run.launcher import watch_launcher

    dist.init_from_env(timeout_s=cfg.dist.timeout_s, wait_timeout_s=cfg.dist.wait_timeout_s)
    watch_launcher(dist.rank())
    if not dist.is_main():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    else:
        for warning in config_warnings(cfg):
            print(f"dapo: warning: {warning}", file=sys.stderr)
    try:
        return _train(args, cfg, resume_dir)
    except Exception:
        if dist.world_size() > 1:
            print(f"dapo: rank {dist.rank()} of {dist.world_size()} failed:", file=sys.stderr)
        raise


def _checked_run_dir(args: argparse.Namespace, cfg: Config, resume_dir: Path | None) -> None:
    """What --dry-run can tell of the run directory without changing anything: a new run's
    would be refused, or a resumed one has no checkpoint or no room."""
    from dapo.run import checkpoint, rundir

    if resume_dir is None:
        rundir.plan_new_run(cfg, overwrite=args.overwrite)
        return
    if checkpoint.find_latest(resume_dir) is None:
        raise ValueError(
            f"--resume {resume_dir}: no complete checkpoint there (it stopped before its first "
            "one); start it again with --overwrite"
        )
    rundir.check_writable(resume_dir)
    rundir.check_space(resume_dir, cfg)


def _open_run_dir(args: argparse.Namespace, cfg: Config, resume_dir: Path | None) -> NewRun:
    """The run directory, locked for this process: a new one created (an earlier run it
    replaces moved aside), or the resumed one checked to hold a checkpoint; both checked to
    be writable with room for checkpoints."""
    from dapo.run import rundir
    from dapo.run.lock import RunLock

    if resume_dir is not None:
        _checked_run_dir(args, cfg, resume_dir)
        return rundir.NewRun(resume_dir, lock=RunLock(resume_dir).acquire())
    # Planned once: an automatic name holds the time, and a second plan could name another.
    opened = rundir.plan_new_run(cfg, overwrite=args.overwrite)
    run_dir = rundir.start_new_run(opened)
    try:
        rundir.check_space(run_dir, cfg)
    except Exception:
        rundir.undo_new_run(opened)
        raise
    return opened


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
