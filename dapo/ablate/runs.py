"""Running an ablation: each job a ``dapo train`` process writing its own run directory under
the ablation's, K at a time, with the machine's cores split between them.

Resumable: a job whose run directory holds a ``summary.json`` for its budget is done and
skipped; a run of another configuration (its config.yaml) or one already past the budget is
refused; one that stopped after a checkpoint is resumed from it (``dapo train --resume``);
anything else starts over (``--overwrite``); each job's state is read again just before it
starts, as a run may have been resumed by hand meanwhile. Each job's output goes to
``<name>.log`` beside its run directory, so a failed one can be read; the others go on, and
the command fails at the end naming them. One ablation at a time runs in a directory
(:func:`ablation_lock`): a second would find the first's runs unfinished and start them over.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from dapo.ablate.plans import Job
from dapo.run.lock import RunLock
from dapo.run.nofollow import LinkRefused, open_binary

if TYPE_CHECKING:
    from dapo.config import Config

LIMITS = {"steps": int, "max_gen_tokens": int, "max_seconds": float}
"""The ``train`` fields that say how long a run goes on, as summary.json records them."""

REACHED = {"steps": "steps", "max_gen_tokens": "gen_tokens", "max_seconds": "step_seconds"}
"""Per limit, the summary.json field that says how far a run went (0 as a limit: none)."""


ABLATION_LOCK = ".dapo-ablate-lock"
"""The lock an ablation holds on its directory for as long as it runs (flock: the kernel drops
it when the process ends, however it ends)."""


def ablation_lock(out_dir: Path) -> RunLock:
    """The lock of the ablation directory ``out_dir`` (made if missing), to take (``with``:
    a ValueError naming the process that holds it). Two ablations on one directory would
    each find the other's runs unfinished and start them over (``--overwrite`` deletes a
    finished run) and write the same ``<run>.log`` at once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = ("ablation directory", "give --out on")
    return RunLock(
        out_dir,
        name=ABLATION_LOCK,
        refusal=_ablation_in_use,
        link_refusal=_ablation_lock_link,
        kind=kind,
    )


def _ablation_in_use(out_dir: Path, holder: str) -> ValueError:
    return ValueError(
        f"ablation directory {out_dir} is in use by {holder}: another dapo ablate runs "
        "there, and a second would start its runs over. Wait for it to end (or stop it), then "
        "run this command again to continue the ablation; or give another --out"
    )


def _ablation_lock_link(path: Path) -> LinkRefused:
    return LinkRefused(
        f"{path} is a symbolic link: dapo takes no lock through a link (it could lead to any "
        "file). Remove the link, or use another ablation directory"
    )


def _remove_or_resume(run_dir: Path) -> str:
    return (
        f"remove {run_dir} (ablate then runs it again), or write it anew with "
        f"dapo train --resume {shlex.quote(str(run_dir))}"
    )


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """``summary.json`` of ``run_dir`` (None when absent), checked: an object whose
    ``steps`` is a whole number, ``limits`` an object, and numbers numbers."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, too deep
        raise ValueError(
            f"{path} is not readable JSON ({str(exc)[:80]}): it is damaged, or was not written "
            f"by dapo; {_remove_or_resume(run_dir)}"
        ) from None
    wrong = _summary_problem(summary)
    if wrong:
        raise ValueError(
            f"{path}: {wrong}: it is damaged, or was not written by dapo; "
            f"{_remove_or_resume(run_dir)}"
        )
    return summary


def _is_number(value: Any) -> bool:
    """A finite number (json reads NaN and Infinity too, which no figure of a table takes)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _summary_problem(summary: Any) -> str:
    """What is wrong with a summary.json's object ("" when nothing)."""
    if not isinstance(summary, dict):
        return f"not an object but {type(summary).__name__}"
    steps = summary.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        return f"steps is {str(steps)[:40]!r}, not a whole number >= 0"
    limits = summary.get("limits", {})
    if not isinstance(limits, dict) or not all(_is_number(v) for v in limits.values()):
        return f"limits is {str(limits)[:80]!r}, not an object of numbers"
    for key in ("val/accuracy_end", "gen_tokens", "step_seconds"):
        if key in summary and not _is_number(summary[key]):
            return f"{key} is {str(summary[key])[:40]!r}, not a number"
    return ""


def state(run_dir: Path, limits: dict[str, float], want: Config | None = None) -> str:
    """``done`` (summary.json, for these ``limits``, its steps within them), ``resume`` (a
    checkpoint: a stopped run, or a finished one given a larger budget) or ``new``. A summary
    from before budgets were recorded is read for its steps alone.

    Refused (ValueError): a run already past ``limits`` (it would not be the run of this
    budget), and, given ``want`` (the job's config), a run of another configuration."""
    summary = read_summary(run_dir)
    resumable = (run_dir / "checkpoints" / "latest").is_file()
    if want is not None and (summary is not None or resumable):
        check_config(run_dir, want)
    if summary is not None:
        recorded, wanted = summary.get("limits"), limits
        if recorded is None:
            recorded, wanted = {"steps": summary["steps"]}, {"steps": limits.get("steps")}
        if all(recorded.get(k) == v for k, v in wanted.items()):
            _refuse_past(run_dir, {"steps": summary["steps"]}, limits)
            return "done"
    if resumable:
        _refuse_past(run_dir, reached(run_dir, summary), limits)
        return "resume"
    return "new"


def reached(run_dir: Path, summary: dict[str, Any] | None) -> dict[str, float]:
    """How far the run went, per limit: what its latest checkpoint (the one a resume goes on
    from) counted, else what its summary says; a limit neither tells is left out."""
    from dapo.run import checkpoint

    try:
        ckpt = checkpoint.find_latest(run_dir)
        trainer = checkpoint.read_trainer_state(ckpt, digests=False) if ckpt else None
    except checkpoint.CheckpointError:
        trainer = None  # the resumed run names what is wrong with it
    if trainer is not None:
        spent = trainer.get("spent", {})
        counted = {"steps": trainer["step"], **spent}
    else:
        counted = summary or {}
    return {k: counted[field] for k, field in REACHED.items() if field in counted}


def _refuse_past(run_dir: Path, went: dict[str, float], limits: dict[str, float]) -> None:
    """A run that went past a limit: resumed or counted as done, it would stand in the table
    for a budget it exceeded (a resume at or past its limit ends at once, at its own length)."""
    over = [
        f"{key} {went[key]:g} > {limit:g}"
        for key, limit in limits.items()
        if limit and key in went and went[key] > limit
    ]
    if over:
        raise ValueError(
            f"{run_dir} has already gone past this budget ({', '.join(over)}): it is not a "
            "run of this budget, and a run is never cut back. Give another --out for this "
            f"budget, or remove {run_dir} to run it again"
        )


def check_config(run_dir: Path, want: Config) -> None:
    """Refuse a run whose config.yaml differs from ``want`` in a field that changes the run
    (the check of ``dapo train --resume``): it is another configuration's run."""
    from dapo.config import load_config, run_changing_differences

    try:
        saved = load_config(run_dir / "config.yaml")
    except ValueError as exc:
        raise ValueError(
            f"{run_dir}: its config.yaml is unreadable ({exc}); remove {run_dir} to run it again"
        ) from None
    differences = run_changing_differences(saved, want)
    if differences:
        listing = "\n  ".join(differences)
        raise ValueError(
            f"{run_dir} was run with another configuration than this job's (saved -> "
            f"wanted):\n  {listing}\nit is not this job's run. Give another --out for this "
            f"ablation, or remove {run_dir} to run it again"
        )


def job_config(job: Job, config: Path | None = None) -> Config:
    """The configuration of ``job``: the YAML ``config`` (or the default) under its
    overrides."""
    from dapo.config import load_config

    return load_config(config, list(job.overrides))


def limits_of(cfg: Config) -> dict[str, float]:
    """``train.steps``, ``train.max_gen_tokens`` and ``train.max_seconds`` of ``cfg``."""
    return {name: kind(getattr(cfg.train, name)) for name, kind in LIMITS.items()}


def job_limits(job: Job, config: Path | None = None) -> dict[str, float]:
    """How long ``job`` goes on: ``train.steps``, ``train.max_gen_tokens`` and
    ``train.max_seconds`` of its configuration (the YAML ``config``, or the default, under
    the job's overrides), so that a recipe edited since a run finished counts too."""
    return limits_of(job_config(job, config))


def job_state(job: Job, out_dir: Path, config: Path | None = None) -> str:
    """:func:`state` of ``job``'s run under ``out_dir``, its config checked."""
    cfg = job_config(job, config)
    return state(out_dir / job.name, limits_of(cfg), cfg)


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
    with open_binary(log) as out:  # a link in the log's place is refused, not written through
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
    launcher: Callable[..., int] | None = None,
) -> list[str]:
    """Run every job not done yet (on the YAML ``config`` when given), ``parallel`` at a time
    with ``cores // parallel`` threads each, and, on a machine with GPUs, each run on one of
    them in turn (``CUDA_VISIBLE_DEVICES``), so that K runs do not all land on the first (at
    most one run per GPU: ``parallel`` above the GPUs runs as many as there are GPUs);
    returns the names of the jobs that failed."""
    stream = stream or sys.stdout
    launcher = launcher or launch  # looked up here: a test replaces it
    out_dir.mkdir(parents=True, exist_ok=True)
    gpus = visible_gpus()
    parallel = _at_once(parallel, gpus, stream)
    own = job_config(jobs[0], config).run.threads if jobs else 0
    threads = own or max(1, (cores or os.cpu_count() or 1) // max(parallel, 1))
    todo = [j for j in jobs if job_state(j, out_dir, config) != "done"]
    print(
        f"ablate: {len(jobs)} runs, {len(jobs) - len(todo)} done already, {len(todo)} to run "
        f"({parallel} at a time, {threads} thread(s) each{' (run.threads)' if own else ''}) "
        f"in {out_dir}",
        file=stream,
    )
    failed: list[str] = []
    t0 = time.perf_counter()
    slots: queue.Queue[int] = queue.Queue()
    for slot in range(max(parallel, 1)):
        slots.put(slot)

    def one(job: Job) -> None:
        slot = slots.get()  # a run's place among those running now: its GPU
        try:
            how = _state_now(job, out_dir, config, stream)
            if how is None:
                return
            if how == "refused":
                failed.append(job.name)
                return
            cmd = command(job, out_dir, threads, how, config)
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


def _at_once(parallel: int, gpus: list[str], stream: TextIO) -> int:
    """Runs at a time: ``parallel``, at most one per GPU on a machine with GPUs (said so)."""
    if gpus and parallel > len(gpus):
        print(
            f"ablate: --parallel {parallel} with {len(gpus)} visible GPU(s): {len(gpus)} at a "
            "time, one run per GPU",
            file=stream,
        )
        return len(gpus)
    return parallel


def _state_now(job: Job, out_dir: Path, config: Path | None, stream: TextIO) -> str | None:
    """``job``'s state read again as it starts: None when it is done by now (a resume by hand
    finished it), ``refused`` (printed) when it is no longer this job's run, else new or
    resume."""
    try:
        how = job_state(job, out_dir, config)
    except ValueError as exc:
        print(f"ablate: {job.name} REFUSED: {exc}", file=stream, flush=True)
        return "refused"
    if how == "done":
        print(
            f"ablate: {job.name} done already (finished since this ablation began)",
            file=stream,
            flush=True,
        )
        return None
    return how
