"""Running an ablation: each job a ``dapo train`` process writing its own run directory under
the ablation's, K at a time, with the machine's cores split between them.

Resumable: a job whose run directory holds a ``summary.json`` for its budget is done and
skipped; one that stopped after a checkpoint is resumed from it (``dapo train --resume``);
anything else starts over (``--overwrite``). Each job's output goes to ``<name>.log`` beside
its run directory, so a failed one can be read; the others go on, and the command fails at the
end naming them.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

from dapo.ablate.plans import Job

LIMITS = {"steps": int, "max_gen_tokens": int, "max_seconds": float}
"""The ``train`` fields that say how long a run goes on, as summary.json records them."""


def state(run_dir: Path, limits: dict[str, float]) -> str:
    """``done`` (summary.json, for these ``limits``), ``resume`` (a checkpoint: a stopped run,
    or a finished one given a larger budget) or ``new``. A summary from before budgets were
    recorded is read for its steps alone."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        done = json.loads(summary.read_text())
        recorded = done.get("limits")
        if recorded is None:
            recorded, limits = {"steps": done.get("steps")}, {"steps": limits.get("steps")}
        if all(recorded.get(k) == v for k, v in limits.items()):
            return "done"
    if (run_dir / "checkpoints" / "latest").is_file():
        return "resume"
    return "new"


def job_limits(job: Job, config: Path | None = None) -> dict[str, float]:
    """How long ``job`` goes on: ``train.steps``, ``train.max_gen_tokens`` and
    ``train.max_seconds`` of its configuration (the YAML ``config``, or the default, under
    the job's overrides), so that a recipe edited since a run finished counts too."""
    from dapo.config import load_config

    train = load_config(config, list(job.overrides)).train
    return {name: kind(getattr(train, name)) for name, kind in LIMITS.items()}


def command(
    job: Job, out_dir: Path, threads: int, how: str, config: Path | None = None
) -> list[str]:
    """The ``dapo train`` command line of ``job`` (``how``: new or resume), on ``config``."""
    where = [f"run.out_dir={out_dir}", f"run.name={job.name}", f"run.threads={threads}"]
    start = ["--resume", str(out_dir / job.name)] if how == "resume" else ["--overwrite"]
    start += ["--config", str(config)] if config is not None else []
    return [sys.executable, "-m", "dapo", "train", "--quiet", *start, *job.overrides, *where]


# Set by torchrun for its ranks: a run that inherited them would try to join that job's group.
_LAUNCHER_VARIABLES = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    | {"GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"}
)


def run_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment of each run: this one, less what a launcher set for its ranks."""
    return {
        k: v
        for k, v in environ.items()
        if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")
    }


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` would name them."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def launch(cmd: list[str], log: Path, extra_env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` with its output in ``log`` (and ``extra_env`` set); its exit code."""
    env = {**run_environment(dict(os.environ)), **(extra_env or {})}
    with open(log, "w") as out:
        return subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, check=False, env=env
        ).returncode


def run_jobs(
    jobs: Sequence[Job],
    out_dir: Path,
    *,
    parallel: int = 1,
    cores: int | None = None,
    config: Path | None = None,
    stream: TextIO | None = None,
    launcher: Callable[..., int] = launch,
) -> list[str]:
    """Run every job not done yet (on the YAML ``config`` when given), ``parallel`` at a time
    with ``cores // parallel`` threads each, and, on a machine with GPUs, each run on one of
    them in turn (``CUDA_VISIBLE_DEVICES``), so that K runs do not all land on the first (at
    most one run per GPU: ``parallel`` above the GPUs runs as many as there are GPUs);
    returns the names of the jobs that failed."""
    stream = stream or sys.stdout
    out_dir.mkdir(parents=True, exist_ok=True)
    gpus = visible_gpus()
    if gpus and parallel > len(gpus):
        print(
            f"ablate: --parallel {parallel} with {len(gpus)} visible GPU(s): {len(gpus)} at a "
            "time, one run per GPU",
            file=stream,
        )
        parallel = len(gpus)
    threads = max(1, (cores or os.cpu_count() or 1) // max(parallel, 1))
    todo = [(j, state(out_dir / j.name, job_limits(j, config))) for j in jobs]
    todo = [(j, how) for j, how in todo if how != "done"]
    print(
        f"ablate: {len(jobs)} runs, {len(jobs) - len(todo)} done already, {len(todo)} to run "
        f"({parallel} at a time, {threads} thread(s) each) in {out_dir}",
        file=stream,
    )
    failed: list[str] = []
    t0 = time.perf_counter()
    slots: queue.Queue[int] = queue.Queue()
    for slot in range(max(parallel, 1)):
        slots.put(slot)

    def one(item: tuple[Job, str]) -> None:
        job, how = item
        cmd = command(job, out_dir, threads, how, config)
        slot = slots.get()  # a run's place among those running now: its GPU
        try:
            if gpus:
                gpu = {"CUDA_VISIBLE_DEVICES": gpus[slot % len(gpus)]}
                code = launcher(cmd, out_dir / f"{job.name}.log", gpu)
            else:
                code = launcher(cmd, out_dir / f"{job.name}.log")
        finally:
            slots.put(slot)
        if code != 0:
            failed.append(job.name)
        verdict = "ok" if code == 0 else f"FAILED (exit {code}, see {job.name}.log)"
        print(
            f"ablate: {job.name} {verdict} [{time.perf_counter() - t0:.0f} s]",
            file=stream,
            flush=True,
        )

    with ThreadPoolExecutor(max_workers=max(parallel, 1)) as pool:
        list(pool.map(one, todo))
    return failed
