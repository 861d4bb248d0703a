"""``dapo train [--config FILE] [--preset NAME] [section.field=value ...]``.

The flags become a call of :mod:`dapo.api.training` (what :func:`dapo.train` runs too), which
checks everything that can be wrong before a model is loaded: the config (every bad value at
once), the run directory, the disk, the model path, the data, the verifiers or the reward
function, the tokenizer and the context length.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dapo.cli.flags import GivenOnce


def add_parser(sub: argparse._SubParsersAction) -> None:
    from dapo.config import presets  # the standard library only

    train = sub.add_parser(
        "train", help="train a policy with DAPO (default: the CPU demo)", description=__doc__
    )
    train.add_argument("--config", type=Path, action=GivenOnce, help="YAML file of config sections")
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


def _refuse_flags_that_would_do_nothing(args: argparse.Namespace) -> None:
    if args.world_size is not None and not args.dry_run:
        raise ValueError(
            "--world-size plans memory with --dry-run only; a run's ranks are torchrun's "
            "(torchrun --nproc-per-node N -m dapo train ...)"
        )
    if args.force and not args.resume:
        raise ValueError("--force accepts config changes on --resume only; drop it")
    if args.print_config and args.dry_run:
        raise ValueError(
            "--print-config prints the config and exits, --dry-run checks the run: give one"
        )


def cmd_train(args: argparse.Namespace) -> int:
    from dapo.api import run_config, training

    _refuse_flags_that_would_do_nothing(args)
    cfg, resume_dir = run_config.resolve_config(
        args.config,
        args.overrides,
        base=args.base,
        preset=args.preset,
        resume=args.resume,
        overwrite=args.overwrite,
        force=args.force,
    )
    if args.quiet:
        cfg.run.progress = "plain"
    if args.print_config:
        from dapo.config import config_warnings, dump_yaml

        for warning in config_warnings(cfg):
            print(f"dapo: warning: {warning}", file=sys.stderr)
        print(dump_yaml(cfg), end="")
        return 0
    training.run(
        cfg,
        resume_dir,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        world_size=args.world_size,
    )
    return 0
