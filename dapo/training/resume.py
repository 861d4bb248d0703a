"""What a resume checks against the run it continues, before the checkpoint's weights load,
and how it ends a run that has no step left to train.

Refused: a ``train.steps`` below the checkpoint's step (a run is never cut back), and a
``run.out_dir`` / ``run.name`` that names another directory than the one given to
``--resume`` (the run stays where it is; its config.yaml would record a place it is not in).
Warned: changes that keep the run going but make it no longer bit-identical to an
uninterrupted one. A resume with no step left (``train.steps`` equal to the checkpoint's step,
or a budget already spent) whose policy was not evaluated at that step evaluates it then, so
the run ends with the figures, samples.jsonl and val_problems.json of the policy it saves.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from dapo import dist
from dapo.config import Config, load_config
from dapo.config.loading import RESUME_INEXACT_FIELDS
from dapo.data.problems import Problem, PromptSampler, problems_digest
from dapo.run import checkpoint, launcher
from dapo.run.interrupt import GracefulStop, RunStopped
from dapo.run.nofollow import open_fd


def check_resume(
    cfg: Config,
    run_dir: Path,
    ckpt: Path,
    *,
    warn: bool = True,
    problems: tuple[list[Problem], list[Problem]] | None = None,
) -> None:
    """Refuse a resume of ``ckpt`` (in ``run_dir``) that would cut the run back, name another
    run directory, or read other training or validation ``problems`` than the run did; with
    ``warn``, on the main process, warn on stderr of the changes that leave it no longer
    bit-identical. Reads only trainer.json and config.yaml."""
    trainer = checkpoint.read_trainer_state(ckpt, digests=False)
    step = trainer["step"]
    if problems is not None:
        _check_problems(trainer, *problems, run_dir=run_dir)
    if cfg.train.steps < step:
        raise ValueError(
            f"--resume {run_dir}: train.steps={cfg.train.steps} is below {step}, the step of "
            f"its checkpoint {ckpt.name}, and a run is never cut back. Give train.steps={step} "
            "to end the run there (its policy evaluated and exported), or more to go on; for a "
            "shorter run, start a new one under another run.name"
        )
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():  # fit() called without the command's run directory
        return
    saved = load_config(saved_path)
    _check_place(cfg, saved, run_dir)
    for key, why in RESUME_INEXACT_FIELDS.items() if warn and dist.is_main() else ():
        section, field = key.split(".")
        old, new = getattr(getattr(saved, section), field), getattr(getattr(cfg, section), field)
        if old != new:
            print(
                f"dapo: warning: {key} {old} -> {new} on this resume: the run goes on, but is "
                f"no longer bit-identical to an uninterrupted one ({why}); resume with "
                f"{key}={old} for that",
                file=sys.stderr,
            )


def val_set(problems: list[Problem]) -> dict[str, Any]:
    """What a checkpoint records of the validation problems: their count and digest."""
    return {"problems": len(problems), "digest": problems_digest(problems)}


def _check_problems(
    trainer: dict[str, Any], train: list[Problem], val: list[Problem], *, run_dir: Path
) -> None:
    """The sampler's own check of the training problems, before a model loads; then the
    validation problems, against a checkpoint that recorded them."""
    PromptSampler(train, seed=0).load_state_dict(trainer["sampler"])
    saved, now = trainer.get("val_set"), val_set(val)
    if saved is None or saved == now:  # None: saved before val_set was recorded
        return
    raise ValueError(
        f"--resume {run_dir}: the run was evaluated on {saved['problems']} validation problems "
        f"(digest {saved['digest'][:12]}), and this resume reads {now['problems']} other ones "
        f"(digest {now['digest'][:12]}): data.val_file changed since, or a forced data.* or "
        "arith.* setting reads it otherwise, and the figures after this resume would not "
        "compare with the run's earlier ones (its step-0 baseline among them). Resume with "
        "the file and settings the run started with, or evaluate the run's checkpoints on "
        "the new problems with dapo eval"
    )


def _check_place(cfg: Config, saved: Config, run_dir: Path) -> None:
    """Refuse ``run.out_dir`` / ``run.name`` overrides that name another directory than
    ``run_dir``: the run stays in it, and config.yaml would say otherwise."""
    new, old = (cfg.run.out_dir, cfg.run.name), (saved.run.out_dir, saved.run.name)
    named = Path(cfg.run.out_dir).expanduser() / cfg.run.name
    # Naming the run directory itself is accepted (dapo ablate resumes its runs so).
    if new == old or (cfg.run.name and named.resolve() == Path(run_dir).resolve()):
        return
    changes = [
        f"run.{key}={n!r} (saved: {o!r})"
        for key, n, o in zip(("out_dir", "name"), new, old, strict=True)
        if n != o
    ]
    raise ValueError(
        f"--resume {run_dir}: {' and '.join(changes)} would name another run directory, but "
        f"a resumed run stays in the directory given to --resume, {run_dir}. Drop these "
        "overrides; to continue the run elsewhere, copy its directory there and resume the copy"
    )


def evaluated_at(trainer: dict[str, Any], step: int) -> int:
    """The step at which the checkpoint's last evaluation (``val_last``) was made: its
    ``val_step``; -1 when that is unknown (a checkpoint from before it was recorded, or a
    value that is not a step up to ``step``), so the policy is evaluated again."""
    known = trainer.get("val_step")
    ok = isinstance(known, int) and not isinstance(known, bool) and 0 <= known <= step
    return known if ok else -1


def resumed_from(run_dir: Path, ckpt: Path, step: int) -> str:
    """The line a resume prints once its checkpoint is read (and why one was passed over)."""
    skipped = checkpoint.passed_over(run_dir, ckpt)
    return f"resumed from {ckpt} at step {step}" + (f"; {skipped}" if skipped else "")


def logged_again(run_dir: Path, step: int, figures: dict[str, float]) -> dict[str, Any]:
    """What a resume with no step left logs for ``step`` once it has evaluated its policy:
    ``figures`` over the step's training metrics, the last line of ``metrics.jsonl`` (cut back
    to the checkpoint), so that the last line of each step holds all of them, as in a run
    that ended there. Only the main process reads the file (the others log nothing)."""
    logged = _last_line(run_dir / "metrics.jsonl") if dist.is_main() else {}
    again = {k: v for k, v in logged.items() if k != "step"} if logged.get("step") == step else {}
    return {**again, **figures}


MAX_LINE_BYTES = 1 << 24
"""A last line of ``metrics.jsonl`` longer than this (16 MiB; no metrics line is near it) is
read as damaged: reading it back whole would hold a file's worth of memory for nothing."""


def _last_line(path: Path) -> dict[str, Any]:
    """The last line of ``path`` as an object; {} when there is none, it is not one, or it is
    over :data:`MAX_LINE_BYTES`."""
    fd = open_fd(path, os.O_RDONLY)
    blocks: list[bytes] = []  # from the end back, a block at a time, to the line's start
    try:
        pos, found = os.fstat(fd).st_size, False
        while pos > 0 and not found:
            if len(blocks) << 16 > MAX_LINE_BYTES:
                return {}
            size = min(1 << 16, pos)
            pos -= size
            block = os.pread(fd, size, pos)
            # Only the new block is searched (the file's last byte aside, as it ends the line):
            # searching the whole tail each time took minutes for a line of 256 MiB.
            found = b"\n" in (block if blocks else block[:-1])
            blocks.append(block)
    finally:
        os.close(fd)
    tail = b"".join(reversed(blocks))
    try:
        record = json.loads(tail.rstrip(b"\n").rsplit(b"\n", 1)[-1])
    except (ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def retry_hint(run_dir: Path | str, fix: str) -> str:
    """How to go on after a run stopped on a failure that ``fix`` (a changed setting) cures."""
    resumable = checkpoint.find_latest(Path(run_dir)) is not None
    return launcher.retry_hint(run_dir, fix, resumable=resumable)


def aborted(run_dir: Path, step: int, stepping: bool, stop: GracefulStop) -> RunStopped:
    """The stop of a second signal during ``step`` (``stepping``: in its updates), or after
    them, in its evaluation or checkpoint: either way nothing of it is saved."""
    ckpt = checkpoint.read_pointer(run_dir)
    resume = f"Resume with: {launcher.resume_command(run_dir)}"
    if not stepping and ckpt is not None and ckpt.name == checkpoint.step_dir_name(step):
        return RunStopped(  # what came after the save: the final model/ export, or the stop
            f"{stop.name} received twice after step {step} was saved ({ckpt.name}): what "
            f"followed was aborted (a resume writes the model/ of a run's last step). {resume}",
            stop.signum or 2,
        )
    where = f"the last checkpoint is {ckpt.name}" if ckpt else "no checkpoint was written"
    what = "aborted" if stepping else "ended, but its evaluation or checkpoint was aborted,"
    return RunStopped(
        f"{stop.name} received twice: step {step} {what} and not saved; {where}. {resume}",
        stop.signum or 2,
    )
