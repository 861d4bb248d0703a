"""An earlier run that a killed ``--overwrite`` start left aside, found and put back.

``--overwrite`` renames the earlier run to ``.<name>.replaced-<id>`` beside the run
directory, and deletes it once the new run has started or renames it back when the start
fails. A start killed before either (kill -9, a lost node, a scheduler's time limit) left it
aside, hidden, with a run directory holding only what a start writes first: its mark, lock
and ``config.yaml``. The process that moves a run aside holds the aside's lock until it holds
the new run directory's, and that one for as long as it runs: when neither lock is held, the
start is over, and the next start or resume of that name puts the earlier run back (when the
run directory holds only an aborted start) or names it (a run has started there since).
"""

from __future__ import annotations

import os
import shlex
import shutil
import uuid
from pathlib import Path

from dapo.run.lock import LOCK_NAME, RunLock, in_use_by
from dapo.run.own_files import MARK, is_probe

REPLACED = ".replaced-"
# What a start writes in the run directory before its run begins (the model loads meanwhile).
START_FILES = frozenset({MARK, LOCK_NAME, "config.yaml"})


def aside_path(run_dir: Path) -> Path:
    """Where ``--overwrite`` keeps the earlier run of ``run_dir`` until the new one starts."""
    return run_dir.with_name(f".{run_dir.name}{REPLACED}{uuid.uuid4().hex[:8]}")


def asides_of(run_dir: Path) -> list[Path]:
    """The earlier runs of ``run_dir`` set aside by ``--overwrite``, newest first."""
    prefix = f".{run_dir.name}{REPLACED}"
    try:
        with os.scandir(run_dir.parent) as listing:
            found = [
                (e.stat(follow_symlinks=False).st_ctime, Path(e.path))
                for e in listing
                if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)
            ]
    except OSError:  # no parent yet, or not readable: nothing was set aside there
        return []
    return [path for _, path in sorted(found, reverse=True)]


def only_a_start(run_dir: Path, *, config: bool = True) -> bool:
    """Whether the directory ``run_dir`` holds nothing but what a start writes before its run
    begins (with ``config``: its config.yaml too), so no run ever ran there."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return False
    own = START_FILES if config else {MARK, LOCK_NAME}
    # ".<name>.tmp": an atomic write of one of them, cut short or under way.
    return all(n in own or is_probe(n) or _writing(n, own) for n in names)


def _writing(name: str, own: frozenset[str] | set[str]) -> bool:
    """Whether ``name`` is the temporary of an atomic write of a file of ``own``."""
    return name.startswith(".") and name.endswith(".tmp") and name[1:-4] in own


def put_back(run_dir: Path) -> None:
    """The earlier run an interrupted ``--overwrite`` start left aside, put back in place of
    that aborted start; when a run has started there since, the aside is named, not moved."""
    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        return  # refused by the caller, naming it
    for aside in asides_of(run_dir):
        if in_use_by(aside) or (run_dir.is_dir() and in_use_by(run_dir)):
            continue  # its start is under way, or its run is running
        if not run_dir.exists() or only_a_start(run_dir):
            if _restore(run_dir, aside):
                print(
                    f"dapo: {run_dir} held only a start that was interrupted before its run "
                    f"began (an --overwrite killed early); the earlier run it replaced, kept at "
                    f"{aside}, is put back"
                )
            continue
        print(
            f"dapo: warning: {aside} holds the earlier run that --overwrite replaced with the "
            f"run in {run_dir}, whose start was interrupted before deleting it. Delete it if "
            f"you no longer need it (rm -rf {shlex.quote(str(aside))}), or move it back in "
            "place of the run directory"
        )


def _restore(run_dir: Path, aside: Path) -> bool:
    """Rename ``aside`` to ``run_dir``, under the run directory's lock, when ``run_dir`` still
    holds only an aborted start (or nothing); whether it was."""
    try:
        run_dir.mkdir(exist_ok=True)  # a start killed before it made it: locked like the rest
        lock = RunLock(run_dir).acquire()
    except (ValueError, OSError):
        return False  # another start took it meanwhile: it decides
    aborted = run_dir.with_name(f".{run_dir.name}.aborted-{uuid.uuid4().hex[:8]}")
    try:
        if not aside.is_dir() or not only_a_start(run_dir):
            return False  # put back by another process meanwhile
        os.rename(run_dir, aborted)
        try:
            os.rename(aside, run_dir)
        except OSError:
            os.rename(aborted, run_dir)
            raise
    finally:
        lock.release()
    shutil.rmtree(aborted, ignore_errors=True)  # a mark, a lock, perhaps a config.yaml
    return True
