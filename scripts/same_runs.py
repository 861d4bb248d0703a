"""Whether a change left training bit-identical: the demo run every way it can run, fingerprinted.

    python scripts/same_runs.py --out /tmp/before            # on the commit before the change
    python scripts/same_runs.py --out /tmp/after --against /tmp/before/fingerprints.json

Each way is a short demo run at ``run.threads=1`` (several micro-batches per update, dynamic
sampling, an evaluation and a checkpoint mid-run): in one process taking turns; with a
generator thread (``train.async_staleness=1``); on 2 gloo ranks under ``torchrun``; with
one generator rank of 3 (``dist.rollout_ranks=1``) at k = 0 and k = 1; and the grpo (a KL
reference), gspo and cispo presets in one process. A fingerprint is every metrics line with
the timings left out (``perf/*``, and the ``async/*_idle_s`` seconds that earlier versions
logged outside ``perf/``) and the SHA-256 of every tensor of the final model. ``--against``
compares two sets and exits 1 on any difference, naming the way, the step and the key.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "train.steps=6",
    "eval.every=3",
    "train.save_every=3",
    "train.tokens_per_microbatch=2048",  # several micro-batches per update
    "arith.num_val=32",
    "run.threads=1",
]
WAYS: dict[str, tuple[int, list[str]]] = {
    "in-turn": (0, []),
    "thread-k1": (0, ["train.async_staleness=1"]),
    "ranks-2": (2, []),
    "generator-rank-k0": (3, ["dist.rollout_ranks=1"]),
    "generator-rank-k1": (3, ["dist.rollout_ranks=1", "train.async_staleness=1"]),
    "grpo": (0, ["--preset", "grpo", "train.steps=3"]),
    "gspo": (0, ["--preset", "gspo", "train.steps=3"]),
    "cispo": (0, ["--preset", "cispo", "train.steps=3"]),
}


def timing(key: str) -> bool:
    return key.startswith("perf/") or key in ("async/trainer_idle_s", "async/generator_idle_s")


def train(name: str, ranks: int, args: list[str], out: Path, cache: Path) -> Path:
    run_dir = out / name
    launch = [sys.executable, "-m", "dapo"]
    if ranks:
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
        launch += ["--standalone", "-m", "dapo"]
    cmd = [*launch, "train", *COMMON, *args, f"run.out_dir={out}", f"run.name={name}"]
    cmd += [f"embedded.cache_dir={cache}", "--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    print(f"{name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return run_dir


def fingerprint(run_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    lines = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        lines.append({k: v for k, v in row.items() if not timing(k)})
    weights = {}
    for path in sorted((run_dir / "model").glob("*.safetensors")):
        for name, tensor in sorted(load_file(path).items()):
            data = tensor.contiguous().view(-1).view(dtype=torch.uint8).numpy()
            weights[name] = hashlib.sha256(data.tobytes()).hexdigest()
    return {"metrics": lines, "weights": weights}


def differences(name: str, old: dict, new: dict) -> list[str]:
    out = []
    if len(old["metrics"]) != len(new["metrics"]):
        out.append(f"{name}: {len(old['metrics'])} metrics lines against {len(new['metrics'])}")
    for a, b in zip(old["metrics"], new["metrics"], strict=False):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                out.append(f"{name}: step {a.get('step')}: {key}: {a.get(key)} -> {b.get(key)}")
    names = sorted(set(old["weights"]) | set(new["weights"]))
    changed = [k for k in names if old["weights"].get(k) != new["weights"].get(k)]
    if changed:
        out.append(f"{name}: {len(changed)} weight tensors differ, first {changed[0]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--against", type=Path, help="fingerprints.json of an earlier commit")
    parser.add_argument("--ways", default=",".join(WAYS), help="which ways, by name")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    cache = opts.out / "embedded-cache"
    prints = {}
    for name in opts.ways.split(","):
        ranks, args = WAYS[name]
        prints[name] = fingerprint(train(name, ranks, args, opts.out, cache))
        (opts.out / "fingerprints.json").write_text(json.dumps(prints, indent=1))
    print(f"wrote {opts.out / 'fingerprints.json'} ({len(prints)} ways)")
    if opts.against is None:
        return
    old = json.loads(opts.against.read_text())
    compared = [n for n in prints if n in old]
    found = [line for n in compared for line in differences(n, old[n], prints[n])]
    for line in found:
        print(line)
    print(f"{len(compared)} ways compared: {'identical' if not found else 'DIFFERENT'}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
