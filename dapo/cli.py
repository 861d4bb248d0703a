"""Command line: ``dapo train [--config FILE] [--preset dapo|grpo] [section.field=value ...]``.

With no arguments, ``dapo train`` runs the embedded CPU demo end to end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# Only the standard library at module level: verifier worker processes re-run the ``dapo``
# console script (multiprocessing's spawn/forkserver do that to a __main__ script), and each
# one would otherwise import torch and transformers, seconds per worker.
if TYPE_CHECKING:
    from dapo.config import Config
    from dapo.data import Problem


def _describe(cfg: Config) -> str:
    t, r = cfg.train, cfg.rollout
    return (
        f"preset {cfg.run.preset} on base {cfg.run.base}: {t.prompts_per_step} prompts/step x "
        f"{r.group_size} responses/prompt = {cfg.responses_per_step} responses/step; "
        f"{t.responses_per_minibatch} responses/mini-batch x {t.epochs} epoch(s) = "
        f"{cfg.updates_per_step} gradient updates/step; micro-batches of <= "
        f"{t.tokens_per_microbatch} padded tokens; L_max {r.max_new_tokens} tokens"
    )


def _check_model_path(cfg: Config) -> Path:
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.path={path} is not a Hugging Face model directory (no config.json); "
            "give a directory written by save_pretrained, or model.path=embedded"
        )
    return path


def load_policy(cfg: Config, warmup_pairs: list[tuple[Problem, str]], tokenizer=None, log=print):
    """The policy and tokenizer: the embedded tiny Qwen2, warm-started on ``warmup_pairs``
    (problem, worked solution), or the causal LM in the local directory ``model.path``."""
    from dapo import arith, demo, inputs

    d = cfg.data
    if cfg.model.path == "embedded":
        spec = demo.WarmupSpec(steps=cfg.model.sft_steps, seed=cfg.train.seed)
        shape = demo.TinyModelSpec(
            hidden_size=cfg.model.embedded_hidden,
            intermediate_size=2 * cfg.model.embedded_hidden,
            num_layers=cfg.model.embedded_layers,
        )
        return demo.load_embedded(
            warmup_pairs,
            cache_dir=cfg.model.cache_dir,
            spec=shape,
            warmup=spec,
            # Only what shapes the warm-up examples: RL and held-out sizes don't.
            task_key=(
                arith.TASK_VERSION,
                d.seed,
                d.min_terms,
                d.max_terms,
                d.operators,
                d.solution,
                d.num_warmup,
            ),
            log=log,
        )
    from transformers import AutoModelForCausalLM

    from dapo.model import DTYPES

    path = _check_model_path(cfg)
    tokenizer = tokenizer or inputs.load_tokenizer(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.model.dtype])
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"model.path={path}: not a causal language model transformers can load "
            f"({str(exc).splitlines()[0]})"
        ) from None
    return model, tokenizer


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device={name} but no CUDA device is visible; use model.device=cpu")
    return torch.device(name)


def _resolve_config(args: argparse.Namespace) -> tuple[Config, Path | None]:
    """The run's config; with --resume, the saved one under any flags and overrides given."""
    from dapo import rundir
    from dapo.config import load_config, run_changing_differences

    if not args.resume:
        return load_config(args.config, args.overrides, base=args.base, preset=args.preset), None
    if args.overwrite:
        raise ValueError("--resume continues a run and --overwrite replaces it: give one")
    run_dir = rundir.existing_run_dir(args.resume)
    saved_path = run_dir / "config.yaml"
    saved = load_config(saved_path)
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
    import torch

    from dapo import checkpoint, inputs, rundir
    from dapo.config import dump_yaml
    from dapo.model import DTYPES
    from dapo.trainer import fit

    # Everything that can be wrong with the command is checked before a model is loaded.
    cfg, run_dir = _resolve_config(args)
    if args.quiet:
        cfg.run.progress = "plain"
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    resume = run_dir is not None
    if args.dry_run:
        pass  # writes nothing: no run directory
    elif run_dir is None:
        run_dir = rundir.new_run_dir(cfg, overwrite=args.overwrite)
    elif checkpoint.find_latest(run_dir) is None:
        raise ValueError(
            f"--resume {run_dir}: no complete checkpoint there (it stopped before its first "
            "one); start it again with --overwrite"
        )
    if run_dir is not None:
        rundir.check_writable(run_dir)
        rundir.check_space(run_dir, cfg)
    device = _device(cfg.model.device)
    if cfg.model.path != "embedded":
        _check_model_path(cfg)
    if cfg.run.wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ValueError("run.wandb=true needs the wandb package: pip install wandb")
    data = inputs.load_run_data(cfg)
    if cfg.eval.num_samples == 0:
        cfg.eval.num_samples = data.val_copies
    inputs.check_verifiers(cfg, data)
    tokenizer = inputs.load_tokenizer(cfg)
    lengths = inputs.check_context(cfg, data, tokenizer)
    if args.dry_run:
        print(dump_yaml(cfg), end="")
        print(_describe(cfg))
        for line in data.notes:
            print(line)
        print(
            f"train {len(data.train)} problems, val {len(data.val)} problems x "
            f"{cfg.eval.num_samples} samples; prompt tokens min {lengths['prompt_tokens_min']}, "
            f"median {lengths['prompt_tokens_median']:.0f}, max {lengths['prompt_tokens_max']} "
            f"(model context {lengths['context']:.0f})"
        )
        print(inputs.describe_budget(cfg, lengths))
        print("dry run: config, tokenizer and data are valid; nothing was trained or written")
        return 0
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.train.seed)
    print(_describe(cfg))
    for line in data.notes:
        print(line)
    print(f"run directory: {run_dir}")
    rundir.write_config(run_dir, cfg)
    # A resumed run starts from the same policy (it is the KL reference) and then loads the
    # checkpoint's weights over it.
    model, tokenizer = load_policy(cfg, data.warmup_pairs, tokenizer)
    model.to(device, dtype=DTYPES[cfg.model.dtype])
    fit(cfg, model, tokenizer, data.train, data.val, run_dir=run_dir, resume=resume)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from dapo.config import BASES, PRESETS

    parser = argparse.ArgumentParser(prog="dapo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy with DAPO (default: the CPU demo)")
    train.add_argument("--config", type=Path, help="YAML file of config sections")
    train.add_argument("--preset", choices=PRESETS, help="algorithm preset (default dapo)")
    train.add_argument(
        "--base", choices=BASES, help="starting scale: demo (default without --config) or paper"
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
    from dapo.bench import add_bench_parser
    from dapo.data_cli import add_data_parser
    from dapo.eval_cli import add_eval_parser
    from dapo.report import add_report_parser

    add_bench_parser(sub)
    add_data_parser(sub)
    add_eval_parser(sub)
    add_report_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    from dapo.checkpoint import CheckpointError
    from dapo.interrupt import RunStopped
    from dapo.sampling import DynamicSamplingExhausted
    from dapo.trainer import NonFiniteError

    # Loading/saving bars of a tiny model are noise in a log that prints one line per step.
    hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (ValueError, FileExistsError) as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return 2
    except (DynamicSamplingExhausted, CheckpointError, NonFiniteError) as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return 1
    except RunStopped as exc:
        print(f"dapo: {exc}", file=sys.stderr)
        return exc.exit_code
