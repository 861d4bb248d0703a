"""Where a step's time goes with generation on ranks of its own (``dist.rollout_ranks``),
against one process: the same run (one seed) four ways, its wall time and the seconds each side
waited, summed over the steps.

    python benchmarks/rollout_ranks.py --steps 40 --out /tmp/rr-bench [overrides ...]
    python benchmarks/rollout_ranks.py --steps 3 --out DIR --ways 0,3 \
        --config recipes/smollm2-135m-arith.yaml model.path=/path/to/smollm2-135m

The four: one process taking turns (``train.async_staleness=0``, ``run.threads=2``); one
process with a generator thread (k = 1, one thread each); and under ``torchrun`` with one
trainer and one generator rank (``dist.rollout_ranks=1``, ``run.threads=1`` each) at k = 0
and k = 1. Runs that finished are read again rather than rerun; delete ``--out`` to measure
afresh. On a machine of 2 cores this gives each configuration the same 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = {
    "one process, k=0, 2 threads": (0, ["train.async_staleness=0", "run.threads=2"]),
    "one process, k=1, 1+1 threads": (0, ["train.async_staleness=1", "run.threads=2"]),
    "2 ranks, k=0, 1 thread each": (2, ["train.async_staleness=0", "dist.rollout_ranks=1"]),
    "2 ranks, k=1, 1 thread each": (2, ["train.async_staleness=1", "dist.rollout_ranks=1"]),
}


def dir_name(name: str) -> str:
    return name.replace(", ", "-").replace(" ", "_").replace("=", "").replace("+", "-")


def run(name: str, ranks: int, args: list[str], out: Path) -> float:
    """Train one way; its wall time in seconds (0 if it had finished before)."""
    run_dir = out / dir_name(name)
    if (run_dir / "summary.json").exists():
        return 0.0
    launch = [sys.executable, "-m", "dapo"]
    if ranks:
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
        launch += ["--standalone", "-m", "dapo"]
    threads = [] if any(a.startswith("run.threads") for a in args) else ["run.threads=1"]
    cmd = [*launch, "train", *args, *threads, f"run.out_dir={out}", f"run.name={run_dir.name}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    print(f"{name}: {' '.join(cmd[-6:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd + ["--overwrite"], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def sums(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("perf/step_s", "perf/train_s", "perf/logprobs_s", "perf/weight_sync_s")
    keys += ("perf/trainer_idle_s", "perf/generator_idle_s")
    out = {k: sum(r.get(k, 0.0) for r in rows) for k in keys}
    ratios = [r["mismatch/abs_log_ratio"] for r in rows if "mismatch/abs_log_ratio" in r]
    out["mismatch"] = sum(ratios) / len(ratios) if ratios else 0.0
    out["val/accuracy"] = rows[-1]["val/accuracy"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", help="a recipe (YAML) for every run")
    parser.add_argument("--ways", default="0,1,2,3", help="which of the four, by index")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    opts = parser.parse_args()
    common = [f"train.steps={opts.steps}", "train.save_every=0", *opts.overrides]
    common = ["--config", opts.config, *common] if opts.config else common
    chosen = [list(WAYS)[int(i)] for i in opts.ways.split(",")]
    print(
        "| way | wall s | steps s | training s | weights s | trainer waiting s "
        "| generator waiting s | held-out accuracy | mismatch (mean abs log ratio) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in chosen:
        ranks, args = WAYS[name]
        wall = run(name, ranks, [*common, *args], opts.out)
        s = sums(opts.out / dir_name(name))
        train = s["perf/train_s"] + s["perf/logprobs_s"]
        print(
            f"| {name} | {f'{wall:.1f}' if wall else 'earlier'} | "
            f"{s['perf/step_s']:.1f} | {train:.1f} | "
            f"{s['perf/weight_sync_s']:.1f} | {s['perf/trainer_idle_s']:.1f} | "
            f"{s['perf/generator_idle_s']:.1f} | {100 * s['val/accuracy']:.1f} | "
            f"{s['mismatch']:.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
