"""LoRA against full fine-tuning on a real model, and adapters against merged weights in decoding.

    python benchmarks/lora.py runs --model models/smollm2-135m           # the recipe, both ways
    python benchmarks/lora.py runs --model M --only full r16-lr1e-4     # some of the runs
    python benchmarks/lora.py decode --model models/smollm2-135m --rank 16 [--natural]

``runs`` trains ``recipes/smollm2-135m-arith.yaml`` (20 steps) once with every weight and once
per LoRA setting of the sweep (``SWEEP``: rank and learning rate), one run after another in
subprocesses of their own, and prints per run: the held-out avg@4 at start and end and its
gain (95% intervals from the run's own bootstrap), the median step time and its generation
and training parts, the trainer process's peak resident memory (with its reward workers),
the trained parameters and the optimizer state's bytes (the last checkpoint's
``optimizer.safetensors``). A run already in ``--out`` with a ``summary.json`` is read, not
run again. ``decode`` times an engine (``--engine``: dapo or hf) on a model with adapters
(``B`` drawn, not zero), sampling through the adapters against sampling from the copy with
the adapters merged that ``model.lora.merged_sampling`` makes at each call (its making
counted), at equal work: prompts of the arith task, every row exactly ``--new-tokens`` long,
or with ``--natural`` ending at EOS (the same seeds draw the same tokens both ways).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-arith.yaml"
SWEEP = {
    "full": ["optim.lr=1e-5"],  # the recipe as it is
    "r16-lr5e-5": ["model.lora.rank=16", "optim.lr=5e-5"],
    "r16-lr1e-4": ["model.lora.rank=16", "optim.lr=1e-4"],
    "r16-lr2e-4": ["model.lora.rank=16", "optim.lr=2e-4"],
    "r4-lr1e-4": ["model.lora.rank=4", "optim.lr=1e-4"],
}
"""Name -> overrides. LoRA's learning rates bracket 10x the recipe's 1e-5 (the rule of thumb
of "LoRA Without Regret"), at alpha 32; then a smaller rank at the rate that did best."""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def train(name: str, overrides: list[str], model: str, out: Path, steps: int) -> dict:
    """One run of the recipe in a subprocess (skipped when ``out/name`` finished before);
    its figures."""
    run = out / name
    if not (run / "summary.json").is_file():
        cmd = [sys.executable, "-m", "dapo", "train", "--config", str(RECIPE), "--quiet"]
        cmd += [f"model.path={model}", f"run.out_dir={out}", f"run.name={name}", "--overwrite"]
        cmd += [f"train.steps={steps}", *overrides]
        log(f"{name}: {' '.join(cmd[3:])}")
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        if status:
            raise SystemExit(f"{name}: the run failed (status {status})")
        (run / "peak_rss.json").write_text(
            json.dumps({"peak_rss_mib": usage.ru_maxrss / 1024, "wall_s": time.perf_counter() - t0})
        )
    return figures(run)


def figures(run: Path) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "perf/step_s" in r]
    vals = [r for r in rows if "val/accuracy" in r]
    start, end = vals[0], vals[-1]
    ckpt = max((run / "checkpoints").glob("step_*"))
    optim = ckpt / "optimizer.safetensors"
    trained = ckpt / "model" / "trained.safetensors"
    from safetensors import safe_open

    weights = trained if trained.is_file() else next((ckpt / "model").glob("model*.safetensors"))
    with safe_open(str(weights), framework="pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    peak = json.loads((run / "peak_rss.json").read_text())
    median = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    return {
        "run": run.name,
        "start": start["val/accuracy"],
        "end": end["val/accuracy"],
        "end_interval": [end["val/accuracy_low"], end["val/accuracy_high"]],
        "gain": end["val/accuracy"] - start["val/accuracy"],
        "step_s": median("perf/step_s"),
        "generate_s": median("perf/generate_s"),
        "train_s": median("perf/train_s"),
        "peak_rss_mib": peak["peak_rss_mib"],
        "wall_s": peak["wall_s"],
        "trained_parameters": params,
        "optimizer_bytes": optim.stat().st_size,
    }


def runs(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(SWEEP)
    results = [train(n, SWEEP[n], args.model, out, args.steps) for n in names]
    full = next((r for r in results if r["run"] == "full"), None)
    print(f"model {args.model}, recipe {RECIPE.name}, {args.steps} steps, one run each")
    head = f"{'run':>12} {'start':>6} {'end':>6} {'gain':>6} {'step s':>7} {'gen s':>6} "
    print(head + f"{'train s':>7} {'peak MiB':>8} {'trained':>10} {'optim MB':>9} {'vs full':>8}")
    for r in results:
        ratio = f"{full['optimizer_bytes'] / r['optimizer_bytes']:.0f}x" if full else "-"
        print(
            f"{r['run']:>12} {r['start']:>6.3f} {r['end']:>6.3f} {r['gain']:>+6.3f} "
            f"{r['step_s']:>7.1f} {r['generate_s']:>6.1f} {r['train_s']:>7.1f} "
            f"{r['peak_rss_mib']:>8.0f} {r['trained_parameters']:>10,} "
            f"{r['optimizer_bytes'] / 2**20:>9.2f} {ratio:>8}"
        )
    if args.json:
        print(json.dumps(results))


def decode(args: argparse.Namespace) -> None:
    import copy

    import torch
    from engines import load, prompts_for

    from dapo.config import LoraConfig
    from dapo.models import lora
    from dapo.rollout import make_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    base, tokenizer = load(args.model)
    adapted = lora.apply(copy.deepcopy(base), LoraConfig(rank=args.rank), seed=0).eval()
    with torch.no_grad():  # a trained B: the merged weights differ from the base's
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 1e-3, generator=torch.Generator().manual_seed(0))
    prompts = prompts_for(tokenizer, args.rows // args.group, chat=bool(args.model))
    stops = (tokenizer.eos_token_id,)
    engines = {  # the same policy, sampled through its adapters or from a merged copy
        k: make_engine(args.engine, adapted, tokenizer, stops, merged_sampling=k == "merged")
        for k in ("adapters", "merged")
    }
    for engine in engines.values():
        engine.generate(prompts, group_size=args.group, max_new_tokens=4, ignore_eos=True)
    figures: dict[str, list[float]] = {k: [] for k in engines}
    copies = []
    for rep in range(args.reps):
        for name in list(engines) if rep % 2 == 0 else list(engines)[::-1]:
            tps = _tokens_per_s(engines[name], prompts, args, seed=rep)
            figures[name].append(tps)
            log(f"rep {rep + 1}/{args.reps} {name}: {tps:,.1f} tokens/s")
        t0 = time.perf_counter()
        lora.merged_copy(adapted)
        copies.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in base.parameters())
    ends = "at EOS (the same tokens both ways)" if args.natural else "of exactly that length"
    print(
        f"model {args.model} ({params / 1e6:.1f}M), LoRA rank {args.rank} on "
        f"{', '.join(LoraConfig().target_modules)}; {args.engine} engine, {args.rows} rows of "
        f"up to {args.new_tokens} tokens {ends}, {args.reps} reps, "
        f"threads {torch.get_num_threads()}"
    )
    for name, values in figures.items():
        print(f"{name:>9}: {statistics.median(values):>8,.1f} tokens/s (median)")
    ratio = statistics.median(figures["merged"]) / statistics.median(figures["adapters"])
    print(f"merged / adapters: {ratio:.2f} (the copy, made per call: {min(copies):.2f} s)")


def _tokens_per_s(engine, prompts: list[str], args: argparse.Namespace, seed: int) -> float:
    """Generated tokens per second of one call (a merged engine's copy included)."""
    t0 = time.perf_counter()
    rollout = engine.generate(
        prompts,
        group_size=args.group,
        max_new_tokens=args.new_tokens,
        seed=seed,
        ignore_eos=not args.natural,
    )
    return int(rollout.lengths_B.sum()) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("runs", help="the recipe with every weight and with LoRA")
    r.add_argument("--model", required=True, help="the imported SmolLM2 directory")
    r.add_argument(
        "--out", default="runs/lora-bench", help="run directories (default runs/lora-bench)"
    )
    r.add_argument("--steps", type=int, default=20)
    r.add_argument("--only", nargs="+", choices=list(SWEEP), help="some runs of the sweep")
    r.add_argument("--json", action="store_true")
    d = sub.add_parser("decode", help="sampling through the adapters against a merged copy")
    d.add_argument("--model", default="", help="a model directory (default: the demo)")
    d.add_argument("--rank", type=int, default=16)
    d.add_argument("--rows", type=int, default=32)
    d.add_argument("--group", type=int, default=8)
    d.add_argument("--new-tokens", type=int, default=64)
    d.add_argument("--reps", type=int, default=3)
    d.add_argument("--threads", type=int, default=0)
    d.add_argument("--engine", choices=["dapo", "hf"], default="dapo")
    d.add_argument(
        "--natural", action="store_true", help="rows end at EOS, as in training (default: never)"
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/engines.py's helpers
    runs(args) if args.what == "runs" else decode(args)


if __name__ == "__main__":
    main()
