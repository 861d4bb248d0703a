"""Command line: ``dapo train [--config FILE] [--preset dapo|grpo] [section.field=value ...]``.

With no arguments, ``dapo train`` runs the embedded CPU demo end to end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from dapo.config import BASES, PRESETS, Config, dump_yaml, load_config


def _describe(cfg: Config) -> str:
    t, r = cfg.train, cfg.rollout
    return (
        f"preset {cfg.run.preset} on base {cfg.run.base}: {t.prompts_per_step} prompts/step x "
        f"{r.group_size} responses/prompt = {cfg.responses_per_step} responses/step; "
        f"{t.responses_per_minibatch} responses/mini-batch x {t.epochs} epoch(s) = "
        f"{cfg.updates_per_step} gradient updates/step; micro-batches of <= "
        f"{t.tokens_per_microbatch} padded tokens; L_max {r.max_new_tokens} tokens"
    )


def load_policy(cfg: Config, train_examples: list[tuple[str, str]] | None = None, log=print):
    """The policy and tokenizer: the embedded tiny Qwen2 (warm-started) or a local HF directory."""
    from dapo import demo

    if cfg.model.path == "embedded":
        spec = demo.WarmupSpec(steps=cfg.model.warmup_steps, seed=cfg.train.seed)
        return demo.load_embedded(
            train_examples or [],
            cache_dir=cfg.model.cache_dir,
            warmup=spec,
            task_key=vars(cfg.data),
            log=log,
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.model import DTYPES

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


def cmd_train(args: argparse.Namespace) -> int:
    from dapo import arith
    from dapo.evaluate import render_prompt
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
    train_pairs, val_pairs = arith.make_splits(
        d.num_train,
        d.num_val,
        seed=d.seed,
        min_terms=d.min_terms,
        max_terms=d.max_terms,
        operators=d.operators,
    )
    train_problems = [p for p, _ in train_pairs]
    val_problems = [p for p, _ in val_pairs]
    tokenizer_for_prompts = None
    if cfg.model.path == "embedded":
        from dapo.demo import build_tokenizer

        tokenizer_for_prompts = build_tokenizer()
    examples = (
        [(render_prompt(tokenizer_for_prompts, p), s) for p, s in train_pairs]
        if tokenizer_for_prompts is not None
        else None
    )
    model, tokenizer = load_policy(cfg, examples)
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
    train.add_argument("overrides", nargs="*", metavar="section.field=value")
    train.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError) as exc:
        print(f"dapo: error: {exc}", file=sys.stderr)
        return 2
