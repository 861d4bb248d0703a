"""What a run says when it cannot write its run directory (a full disk, a spent quota, a file
size limit): why, in words, and the fix that applies to that cause. A full disk is cured by
freeing space, a file size limit (``ulimit -f``) only by lifting it; and lowering
``train.keep_checkpoints`` frees nothing, as old checkpoints are pruned only after a save
succeeds."""

from __future__ import annotations

import errno
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from dapo.run.launcher import resume_command

try:
    import resource
except ImportError:  # not on Windows: no ulimit there
    resource = None

_OS_ERROR = re.compile(r"(?:\(os error |Os \{ code: )(\d+)")
OLDEST_NAMED = 10
"""How many of a run's older checkpoints a full-disk message names to delete, the oldest
first: all of them, unless train.keep_checkpoints keeps many."""


def error_number(exc: BaseException) -> int | None:
    """The errno of a failed write: an OSError's, or the one safetensors (whose SafetensorError
    is no OSError) gives only in its text: "(os error 28)"; before 0.5, "Os { code: 28"."""
    if isinstance(exc, OSError):
        return exc.errno
    found = _OS_ERROR.search(str(exc))
    return int(found.group(1)) if found else None


def size_limit() -> int | None:
    """This process's file size limit (``ulimit -f``) in bytes; None when there is none."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def write_failure(exc: BaseException) -> str:
    """Why a write failed, in words: "the disk is full" for ENOSPC, the file size limit for
    EFBIG (in KiB: ``ulimit -f`` counts in KiB in bash, in 512-byte blocks in dash); otherwise
    the error's own words."""
    number = error_number(exc)
    if number == errno.ENOSPC:
        return "the disk is full"
    if number == errno.EFBIG:
        limit = size_limit()
        if limit is not None:
            return f"a file reached the file size limit of {limit // 1024} KiB (ulimit -f)"
        return "a file grew past the largest size its file system allows (File too large)"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def remedy(exc: BaseException, older: Sequence[Path] = ()) -> str:
    """The fix for ``exc``, a clause that the next step follows ("... and resume with"):
    lift the file size limit (EFBIG), else free space, naming the run's ``older``
    checkpoints (those before the one a resume uses), whose deletion frees it."""
    if error_number(exc) == errno.EFBIG:
        if size_limit() is not None:
            return "Lift the limit (ulimit -f unlimited, in the shell that starts dapo)"
        # No ulimit: the file system's own largest file (FAT32's 4 GiB).
        return "Move the run directory to a file system that allows larger files"
    if not older:
        return "Free space"
    doomed = " ".join(shlex.quote(str(p)) for p in older[:OLDEST_NAMED])
    which = "older checkpoints" if len(older) <= OLDEST_NAMED else "oldest checkpoints"
    return (
        f"Free space, for example by deleting this run's {which} (rm -r {doomed}; lowering "
        "train.keep_checkpoints frees nothing, as it prunes only after a save)"
    )


def going_on(
    run_dir: Path | str, exc: BaseException, previous: Path | None, older: Sequence[Path] = ()
) -> str:
    """The fix and the command that continues a run stopped by the failed write ``exc``: a
    resume from ``previous`` (the checkpoint a resume uses), or, with none, a start again."""
    if previous is None:
        return (
            f"{remedy(exc)} and start the run again with the same command and --overwrite: "
            "it stopped before its first checkpoint, so there is nothing to resume"
        )
    return f"{remedy(exc, older)} and resume with: {resume_command(run_dir)}"


def export_failed(dest: Path, exc: BaseException) -> str:
    """The message of a run's ``model/`` (``dest``) that could not be written: nothing
    half-written is left, and the checkpoints (the last one written before) are whole."""
    return (
        f"could not write the model {dest}: {write_failure(exc)}; nothing was left there, and "
        f"the run's checkpoints are as they were. {remedy(exc)} and finish the run with: dapo "
        f"train --resume {shlex.quote(str(dest.parent))} (or export its last checkpoint: dapo "
        f"export {shlex.quote(str(dest.parent))} --out {shlex.quote(str(dest))})"
    )
