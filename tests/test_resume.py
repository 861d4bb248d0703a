"""Kill a real training process and resume it: the run must end exactly where an uninterrupted
one does. CPU with one thread is deterministic, so the comparison is exact (==), not approximate;
only the perf/* timings may differ."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    # Big enough to be right sometimes: dynamic sampling keeps groups and every step trains.
    "embedded.sft_steps=100",
    "embedded.hidden=64",
    "arith.max_terms=2",
    "arith.num_warmup=256",
    "arith.num_train=200",
    "arith.num_val=8",
    "rollout.group_size=4",
    "train.steps=6",
    "train.prompts_per_step=4",
    "sampling.prompts_per_round=8",
    "sampling.on_max_rounds=train",
    "train.responses_per_minibatch=8",  # 2 updates per step
    "train.tokens_per_microbatch=300",  # several micro-batches per update
    "eval.num_samples=2",
    "eval.every=2",
    "train.save_every=1",
    "train.keep_checkpoints=2",
    "run.threads=1",
    # What a GPU run needs to resume exactly (docs/guides/gpus.md); on a CPU it changes no
    # value, and here it shows every op of training, evaluation and resume has such a kernel.
    "run.deterministic=true",
]


def _start(out_dir: Path, name: str, cache: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dapo", "train", *extra]
    if "--resume" not in extra:
        cmd += [*TINY, f"embedded.cache_dir={cache}", f"run.out_dir={out_dir}", f"run.name={name}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _logged_steps(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_bytes().count(b"\n") - 1
    except FileNotFoundError:
        return -1


def _wait_for(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> bool:
    """Wait until a checkpoint exists and ``step`` is logged; False if the run ended first."""
    deadline = time.monotonic() + timeout
    while not (run_dir / "checkpoints" / "latest").exists() or _logged_steps(run_dir) < step:
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.01)
    return True


def _metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.startswith("perf/")} for x in lines]


def _same_run(a: Path, b: Path) -> bool:
    wa, wb = (
        load_file(a / "model" / "model.safetensors"),
        load_file(b / "model" / "model.safetensors"),
    )
    weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return weights and _metrics(a) == _metrics(b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run (and the warm-up cache every other run shares)."""
    root = tmp_path_factory.mktemp("resume")
    cache = root / "cache"
    t0 = time.monotonic()
    code, out, err = _finish(_start(root, "reference", cache))
    assert code == 0, err
    # A resume test is only as good as the state it carries: updates, kept groups, the
    # sampler-log-prob check (logged on the first step only) and over-sampled rounds.
    steps = _metrics(root / "reference")[1:]
    assert all(m["train/updates"] >= 1 for m in steps)
    assert "train/sampler_logprob_gap" in steps[0]
    assert not any("train/sampler_logprob_gap" in m for m in steps[1:])
    return root / "reference", cache, time.monotonic() - t0


def _kill_and_resume(tmp_path: Path, cache: Path, delay: float, sig=signal.SIGKILL, step=1):
    """Start a run; once it has a checkpoint and has logged ``step``, wait ``delay`` s, send
    ``sig``, then resume it to the end. Returns (run_dir, exit code of the interrupted process,
    step resumed from or None if it finished first, its stderr)."""
    proc = _start(tmp_path, "run", cache)
    run_dir = tmp_path / "run"
    if _wait_for(run_dir, proc, step):
        time.sleep(delay)
        proc.send_signal(sig)
    code, _, err = _finish(proc)
    if code == 0:
        return run_dir, code, None, err  # it finished before the signal landed
    resumed = _start(tmp_path, "run", cache, "--resume", str(run_dir))
    rcode, out, rerr = _finish(resumed)
    assert rcode == 0, rerr
    step = int(out.split("at step ")[1].split()[0])
    return run_dir, code, step, err


def test_kill_9_then_resume_matches_the_uninterrupted_run(tmp_path, reference):
    ref, cache, _ = reference
    run_dir, code, step, _ = _kill_and_resume(tmp_path, cache, delay=0.3)
    assert code == -signal.SIGKILL and step is not None and step >= 1
    assert _same_run(ref, run_dir)


def test_sigterm_saves_then_resume_matches(tmp_path, reference):
    ref, cache, _ = reference
    run_dir, code, step, err = _kill_and_resume(tmp_path, cache, delay=0.0, sig=signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert f"checkpoint saved. Resume with: dapo train --resume {run_dir}" in err
    assert step is not None and f"stopped by SIGTERM after step {step} of 6" in err
    assert _same_run(ref, run_dir)


@pytest.mark.slow
def test_kill_9_at_many_moments(tmp_path, reference):
    """kill -9 after each of steps 1-5, at a random point of the next step (checkpoint writes
    included); every resume must match the uninterrupted run."""
    ref, cache, _ = reference
    rng = random.Random(0)
    # Half the kills within 20 ms of the log line: the checkpoint is being written then.
    moments = [(1 + i % 5, rng.uniform(0.0, 0.02 if i % 2 else 0.6)) for i in range(10)]
    rows, interrupted, matched = [], 0, 0
    for i, (step, delay) in enumerate(moments):
        run_dir, code, resumed, _ = _kill_and_resume(
            tmp_path / str(i), cache, delay=delay, step=step
        )
        when = f"  kill {delay:.2f} s after step {step} was logged"
        if resumed is None:
            rows.append(f"{when}: the run finished first")
            continue
        interrupted += 1
        same = _same_run(ref, run_dir)
        matched += same
        rows.append(f"{when}: resumed from step {resumed}, identical={same}")
    print(f"\nkill -9 resumes identical to the uninterrupted run: {matched} of {interrupted}")
    print("\n".join(rows))
    assert interrupted >= 8 and matched == interrupted
