"""Command line: ``dapo train [--config FILE] [--preset dapo|grpo] [section.field=value ...]``.

With no arguments, ``dapo train`` runs the embedded CPU demo end to end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from dapo.config import BASES, PRESETS, Config, dump_yaml, load_config
from dapo.data import Problem
from dapo.model import DTYPES
from dapo.sampling import DynamicSamplingExhausted


def _describe(cfg: Config) -> str:
    t, r = cfg.train, cfg.rollout
    return (
        f"preset {cfg.run.preset} on base {cfg.run.base}: {t.prompts_per_step} prompts/step x "
        f"{r.group_size} responses/prompt = {cfg.responses_per_step} responses/step; "
        f"{t.responses_per_minibatch} responses/mini-batch x {t.epochs} epoch(s) = "
        f"{cfg.updates_per_step} gradient updates/step; micro-batches of <= "
        f"{t.tokens_per_microbatch} padded tokens; L_max {r.max_new_tokens} tokens"
    )


def load_policy(cfg: Config, warmup_pairs: list[tuple[Problem, str]], log=print):
    """The policy and tokenizer: the embedded tiny Qwen2, warm-started on ``warmup_pairs``
    (problem, worked solution), or a local Hugging Face directory."""
    from dapo import arith, demo

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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(cfg.model.path)
    if not (path / "config.json").exists():
        raise ValueError(
            f"model.path={path} is not a Hugging Face model directory (no config.json); "
            "give a directory written by save_pretrained, or model.path=embedded"
        )
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.model.dtype])
    return model, tokenizer


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device={name} but no CUDA device is visible; use model.device=cpu")
    return torch.device(name)


def cmd_train(args: argparse.Namespace) -> int:
    from dapo import arith
    from dapo.trainer import fit, make_run_dir

    cfg = load_config(args.config, args.overrides, base=args.base, preset=args.preset)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.train.seed)
    print(_describe(cfg))
    run_dir = make_run_dir(cfg)
    print(f"run directory: {run_dir}")

    d = cfg.data
    train_pairs, val_pairs, warmup_pairs = arith.make_splits(
        d.num_train,
        d.num_val,
        d.num_warmup if cfg.model.path == "embedded" else 0,
        seed=d.seed,
        min_terms=d.min_terms,
        max_terms=d.max_terms,
        operators=d.operators,
        style=d.solution,
    )
    train_problems = [p for p, _ in train_pairs]
    val_problems = [p for p, _ in val_pairs]
    model, tokenizer = load_policy(cfg, warmup_pairs)
    model.to(_device(cfg.model.device), dtype=DTYPES[cfg.model.dtype])
    fit(cfg, model, tokenizer, train_problems, val_problems, run_dir=run_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
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
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="config overrides applied last, e.g. optim.lr=1e-5 algo.eps_high=0.28",
    )
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    # Loading/saving bars of a tiny model are noise in a log that prints one line per step.
    hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except (ValueError, FileExistsError, DynamicSamplingExhausted) as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return 2
