"""A rank ends with its launcher.

torchrun starts each rank in a session of its own, so a signal to the launcher's process
group does not reach the ranks, and a launcher killed with SIGKILL (a scheduler's time limit,
the OOM killer) leaves them training as orphans: writing checkpoints into a run directory
that a ``--resume`` may be writing at the same time. A daemon thread of each rank watches its
parent process and ends the rank within ``poll_s`` seconds of the parent's death (the rank is
then re-parented, so its parent pid changes). Nothing is saved: the other ranks end at the
same moment, and the run resumes from its last checkpoint.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from pathlib import Path

_watching: list[threading.Thread] = []


def watch_launcher(rank: int, *, poll_s: float = 1.0) -> None:
    """End this process when the process that started it is gone (once per process)."""
    if _watching:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(
            f"dapo: rank {rank}: its launcher (pid {parent}) is gone; exiting so that no "
            "orphan keeps writing the run directory (resume from the last checkpoint)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)  # at once: the other ranks are ending too, no collective can finish

    thread = threading.Thread(target=watch, name="dapo-launcher-watch", daemon=True)
    thread.start()
    _watching.append(thread)


def resume_command(run_dir: Path | str) -> str:
    """The command that continues the run in ``run_dir``: under torchrun, the job's launch
    again (one process refuses a job's settings, ``dist.rollout_ranks`` say). The path is
    quoted for a shell: one with a space or a quote is pasted back whole."""
    path = shlex.quote(str(run_dir))
    if not {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= os.environ.keys():  # dist.launched()
        return f"dapo train --resume {path}"
    ranks = os.environ["WORLD_SIZE"]
    if os.environ.get("LOCAL_WORLD_SIZE", ranks) == ranks:  # one node
        return f"torchrun --nproc-per-node {ranks} -m dapo train --resume {path}"
    return f"the job's torchrun launch on every node, with -m dapo train --resume {path}"


def retry_hint(run_dir: Path | str, fix: str, *, resumable: bool) -> str:
    """How to go on after a run stopped on a failure that ``fix`` (a changed setting) cures:
    resume from its last checkpoint (``resumable``: it has one), or start it again."""
    if resumable:
        return (
            "The run directory is intact; resume from its last checkpoint with a changed "
            f"config: {resume_command(run_dir)} {fix} --force"
        )
    return (
        f"It stopped before its first checkpoint, so there is nothing to resume: start it "
        f"again with the same command, {fix} and --overwrite"
    )


def nonfinite_refusal(step: int, *, resumable: bool, run_dir: Path | str) -> str:
    """Why the checkpoint of ``step`` is not written, and how to go on."""
    return (
        f"refusing to save the checkpoint of step {step}: the weights hold NaN or inf, and a "
        "checkpoint of broken weights would overwrite good ones. "
        + retry_hint(run_dir, "optim.lr=<lower>", resumable=resumable)
    )
