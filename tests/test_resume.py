"""Kill a real training process and resume it: the run must end exactly where an uninterrupted
one does. CPU with one thread is deterministic, so the comparison is exact (==), not approximate;
only the perf/* timings may differ."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import RESUMABLE_DEMO, finish_run, logged_metrics, start_run
from safetensors.torch import load_file

TINY = RESUMABLE_DEMO


def _start(out_dir: Path, name: str, cache: Path, *extra: str) -> subprocess.Popen:
    return start_run(out_dir, name, cache, TINY, *extra)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    return finish_run(proc, timeout)


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


def _same_run(a: Path, b: Path) -> bool:
    wa, wb = (
        load_file(a / "model" / "model.safetensors"),
        load_file(b / "model" / "model.safetensors"),
    )
    weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return weights and logged_metrics(a) == logged_metrics(b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_cache):
    """One uninterrupted run, and the session's cache of the embedded model."""
    root = tmp_path_factory.mktemp("resume")
    cache = demo_cache
    t0 = time.monotonic()
    code, out, err = _finish(_start(root, "reference", cache))
    assert code == 0, err
    # A resume test is only as good as the state it carries: updates, kept groups, the
    # sampler-log-prob check (logged on the first step only) and over-sampled rounds.
    steps = logged_metrics(root / "reference")[1:]
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


def test_kill_9_just_after_the_final_checkpoint_resumes_with_every_output(tmp_path, reference):
    """The final evaluation's samples.jsonl and val_problems.json are written before the final
    checkpoint: a run killed just after it resumes with no step left, and has them too."""
    ref, cache, _ = reference
    proc = _start(tmp_path, "run", cache)
    run_dir = tmp_path / "run"
    latest, outputs = run_dir / "checkpoints" / "latest", ("samples.jsonl", "val_problems.json")
    deadline = time.monotonic() + 300
    while proc.poll() is None and not (latest.exists() and "06" in latest.read_text()):
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.005)
    present = [(run_dir / name).is_file() for name in outputs]
    proc.send_signal(signal.SIGKILL)
    if _finish(proc)[0] != 0:  # killed before it finished: resume it
        code, out, err = _finish(_start(tmp_path, "run", cache, "--resume", str(run_dir)))
        assert code == 0 and "at step 6" in out, err
    assert present == [True, True]  # already there when the final checkpoint was
    for name in outputs:
        assert (run_dir / name).read_text() == (ref / name).read_text(), name


def test_a_resume_that_cannot_read_its_checkpoint_changes_nothing(tmp_path, reference):
    """A forced resume writes its changed config.yaml only once the checkpoint is read: one
    that fails on a damaged file leaves the run directory as it was."""
    ref, cache, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref, run_dir)
    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    data = bytearray((ckpt / "rng.json").read_bytes())
    data[-3] ^= 1  # a digit: the same size, still JSON, another digest
    (ckpt / "rng.json").write_bytes(bytes(data))
    before = _file_bytes(run_dir)
    resumed = _start(tmp_path, "run", cache, "--resume", str(run_dir), "optim.lr=1e-5", "--force")
    code, _, err = _finish(resumed)
    assert code != 0 and "rng.json is not the file that was written" in err, err
    assert _changed(run_dir, before) == []  # config.yaml was rewritten


def test_a_resume_refused_by_its_metrics_log_changes_nothing(tmp_path, reference):
    """metrics.jsonl cut short since the checkpoint refuses the resume, which had written the
    forced config.yaml (and kept the earlier as config.before-resume-1.yaml) first: the next
    plain resume then trained with optim.lr=1e-5, never given without --force."""
    ref, cache, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref, run_dir)
    metrics = run_dir / "metrics.jsonl"
    logged = metrics.read_bytes()
    metrics.write_bytes(logged[: logged.rindex(b"\n", 0, -1) + 1])  # its last line dropped
    before = _file_bytes(run_dir)
    resumed = _start(tmp_path, "run", cache, "--resume", str(run_dir), "optim.lr=1e-5", "--force")
    code, _, err = _finish(resumed)
    cut = f"{metrics} is {metrics.stat().st_size} bytes but the checkpoint logged"
    assert code != 0 and cut in err and "start the run again with --overwrite" in err, err
    assert _changed(run_dir, before) == []  # config.yaml was rewritten
    assert not list(run_dir.glob("config.before-resume-*"))


def _file_bytes(run_dir: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def _changed(run_dir: Path, before: dict[Path, bytes]) -> list[Path]:
    """The files under ``run_dir`` added, removed or changed since ``before``, but the lock
    the resume held (its holder's pid): the only one that is dapo's to change."""
    after = _file_bytes(run_dir)
    changed = [p for p in before.keys() | after.keys() if before.get(p) != after.get(p)]
    return sorted(p.relative_to(run_dir) for p in changed if p.name != ".dapo-lock")


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
