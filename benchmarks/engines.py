"""Decoding speed of each rollout engine at fixed response lengths.

    python benchmarks/engines.py                                   # the embedded demo model
    python benchmarks/engines.py --model models/smollm2-135m --rows 32 --new-tokens 64 256 1024
    python benchmarks/engines.py --model DIR --engines dapo hf --reps 3 --json

Every engine gets the same prompts (the arith task's, in chat form for a ``--model``), the
same rows (``--rows`` = prompts x ``--group``), and samples at temperature 1 with EOS ignored,
so each row is exactly ``T`` tokens long and the work is equal. For each length the engines
run in turn, their order reversed on every other repetition so that drift in the machine hits
them alike; the figure is the median over repetitions of generated tokens per second (prompt
processing included, as in a rollout). Engines: ``dapo`` (the native engine), ``hf``
(transformers ``generate``), ``vllm`` when it is installed (skipped, with a note, when not).

On a CPU every engine samples from the float32 model (``--compute-dtype`` to change it); with
``--device cuda`` in bfloat16 by default, as a run does there, and each length is preceded by
one untimed call identical to the timed ones for every engine (a first call at new widths
pays some 20% more on a GPU: kernels chosen, CUDA graphs captured, attention plans built).

Prints a line per measurement and a table; with ``--json`` the last line is a JSON list of
``{"engine", "rows", "new_tokens", "tokens_per_s"}`` objects (and the repetitions' figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from dapo.models.policy import tokenizer_from_dir
from dapo.reward.tasks import arith
from dapo.rollout import make_engine


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load(model_dir: str):
    """(model in float32 and eval mode, tokenizer): a saved model, or the embedded demo's."""
    if model_dir:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = tokenizer_from_dir(Path(model_dir))
    else:
        from dapo.models import demo

        tokenizer = demo.build_tokenizer()
        model = demo.tiny_qwen2(tokenizer, demo.TinyModelSpec(), seed=0)
    return model.eval(), tokenizer


def prompts_for(tokenizer, count: int, chat: bool) -> list[str]:
    """``count`` arith prompts, rendered as a run renders them."""
    from dapo.data.prompts import render_prompt

    options = dict(prompt="chat", max_terms=3) if chat else {}
    pairs = arith.make_splits(count, 1, 0, seed=1234, **options)[0]
    return [render_prompt(tokenizer, p) for p, _ in pairs]


def available(engines: list[str]) -> list[str]:
    """The engines that can run here; ``vllm`` only where the package is installed."""
    kept = []
    for name in engines:
        if name == "vllm" and importlib.util.find_spec("vllm") is None:
            log("vllm is not installed here: skipped (pip install -e '.[vllm]')")
            continue
        kept.append(name)
    return kept


def time_one(engine, prompts: list[str], group: int, new_tokens: int, seed: int) -> float:
    """Generated tokens per second of one call (every row exactly ``new_tokens`` long)."""
    t0 = time.perf_counter()
    rollout = engine.generate(
        prompts, group_size=group, max_new_tokens=new_tokens, seed=seed, ignore_eos=True
    )
    if engine_device(engine).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = int(rollout.lengths_B.sum())
    if tokens != len(prompts) * group * new_tokens:
        raise RuntimeError(f"expected {len(prompts) * group * new_tokens} tokens, got {tokens}")
    return tokens / seconds


def engine_device(engine) -> torch.device:
    return getattr(engine, "device", None) or torch.device("cpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="", help="a Hugging Face model directory (default: demo)")
    ap.add_argument("--rows", type=int, default=32, help="rows per call (default 32)")
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (default 8)")
    ap.add_argument(
        "--new-tokens", type=int, nargs="+", default=[64, 256], help="lengths (default 64 256)"
    )
    ap.add_argument("--engines", nargs="+", default=["dapo", "hf", "vllm"])
    ap.add_argument("--reps", type=int, default=2, help="repetitions per length (default 2)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument(
        "--compute-dtype",
        default="",
        choices=["", "float32", "bfloat16", "float16"],
        help="the engines' compute dtype (default: bfloat16 on cuda, the float32 model's on cpu)",
    )
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    args = ap.parse_args(argv)
    if args.rows % args.group:
        ap.error(f"--rows {args.rows} is not a multiple of --group {args.group}")
    return args


def prepare(args: argparse.Namespace):
    """(device, model, tokenizer) of ``--device``, ``--model`` and ``--threads``, warnings and
    the tokenizers' threads quiet: what a benchmark of engines sets up first."""
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    model, tokenizer = load(args.model)
    return device, model.to(device), tokenizer


def compute_dtype(args: argparse.Namespace) -> torch.dtype | None:
    """``--compute-dtype``, or bfloat16 on CUDA; None (the float32 model's own) on a CPU."""
    if args.compute_dtype:
        return getattr(torch, args.compute_dtype)
    return torch.bfloat16 if torch.device(args.device).type == "cuda" else None


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device, model, tokenizer = prepare(args)
    prompts = prompts_for(tokenizer, args.rows // args.group, chat=bool(args.model))
    names = available(args.engines)
    dtype = compute_dtype(args)
    stop = (tokenizer.eos_token_id,)
    engines = {
        name: make_engine(name, model, tokenizer, stop, dtype, device=device) for name in names
    }
    for engine in engines.values():  # kernels chosen and loaded before any timing
        engine.generate(prompts, group_size=args.group, max_new_tokens=4, ignore_eos=True)
    rows = []
    for new_tokens in args.new_tokens:
        figures: dict[str, list[float]] = {name: [] for name in names}
        if device.type == "cuda":  # untimed, the timed call itself: widths new to every engine
            for name in names:
                time_one(engines[name], prompts, args.group, new_tokens, seed=0)
        for rep in range(args.reps):
            order = names if rep % 2 == 0 else names[::-1]
            for name in order:
                tps = time_one(engines[name], prompts, args.group, new_tokens, seed=rep)
                figures[name].append(tps)
                log(f"T={new_tokens} rep {rep + 1}/{args.reps} {name}: {tps:,.1f} tokens/s")
        for name in names:
            rows.append(
                {
                    "engine": name,
                    "rows": args.rows,
                    "new_tokens": new_tokens,
                    "tokens_per_s": statistics.median(figures[name]),
                    "reps": figures[name],
                }
            )
    report(rows, args, model)
    if args.json:
        print(json.dumps(rows))
    return rows


def report(rows: list[dict], args: argparse.Namespace, model) -> None:
    import transformers

    params = sum(p.numel() for p in model.parameters())
    dtype = str(compute_dtype(args) or next(model.parameters()).dtype).removeprefix("torch.")
    print(
        f"model {args.model or 'embedded demo'} ({params / 1e6:.1f}M parameters), {args.rows} "
        f"rows ({args.rows // args.group} prompts x {args.group}), EOS ignored, {args.reps} "
        f"reps; threads {torch.get_num_threads()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, device {args.device}, compute {dtype}"
    )
    print(f"{'engine':>6} {'tokens':>6} {'tokens/s':>10} {'vs hf':>6}")
    for r in rows:
        hf = next(
            (x for x in rows if x["engine"] == "hf" and x["new_tokens"] == r["new_tokens"]), None
        )
        ratio = f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf else "-"
        print(f"{r['engine']:>6} {r['new_tokens']:>6} {r['tokens_per_s']:>10,.1f} {ratio:>6}")


if __name__ == "__main__":
    main()
