"""The run directory: created, refused or replaced, and checked before any model is loaded.

A run directory holds ``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, ``model/``,
``summary.json`` and ``samples.jsonl`` (the last two written here too), and two files of
dapo's own: ``.dapo-run``, the mark that dapo created it (``--overwrite`` deletes nothing
without it, nor anything in it, at any depth, that dapo did not write: :mod:`.own_files`),
and ``.dapo-lock``, held by the process that runs in it from its first instant there
(:mod:`dapo.run.lock`). Every check runs before the (possibly long)
model load, so a typo in a path or a full disk costs seconds, not the minutes of loading a
32B model; and every check of the command runs before an earlier run is touched.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from dapo.config import Config
from dapo.run import asides
from dapo.run.checkpoint import CKPT_DIR
from dapo.run.lock import RunLock, in_use_by, in_use_error
from dapo.run.nofollow import LinkRefused, open_binary, write_atomic
from dapo.run.own_files import (
    MARK,
    PROBE,
    TooManyEntries,
    check_replaceable,
    foreign_entries,
    listing,
)

RUN_MARKERS = ("config.yaml", "metrics.jsonl", CKPT_DIR)  # a run, marked or from before marks
NAME_TRIES = 1000  # -2 ... -1000 after an automatic name that another run took first


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in (MARK, *RUN_MARKERS))


def holds_a_run(path: Path) -> bool:
    """Whether files only dapo writes are in ``path`` (its mark, metrics.jsonl,
    checkpoints/): a run's directory, not a folder of the user's holding a config.yaml."""
    return any((path / m).exists() for m in (MARK, *RUN_MARKERS) if m != "config.yaml")


@dataclass
class NewRun:
    """Where a new run goes, decided before anything on disk changes (:func:`plan_new_run`),
    then made (:func:`start_new_run`); an earlier run it replaces is moved aside and removed
    only once the new run has started (:func:`finish_replacing`), or put back
    (:func:`undo_new_run`)."""

    path: Path
    replaces: bool = False
    aside: Path | None = None
    lock: RunLock | None = None
    created: bool = False  # this process made the directory (else it was there, empty)
    auto_name: Path | None = None  # taken meanwhile, the next free -2, -3... after it is used
    made_parents: list[Path] = field(default_factory=list)  # run.out_dir etc., deepest first


def plan_new_run(cfg: Config, *, overwrite: bool = False) -> NewRun:
    """The directory of a new run, checked: free, or (with ``overwrite``) holding a run that
    dapo created and nothing else. Changes nothing on disk, but for putting back an earlier
    run that an interrupted ``--overwrite`` start left aside (:mod:`dapo.run.asides`)."""
    name = cfg.run.name or f"{cfg.run.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    # Absolute from here on (joined, not resolved: a/.. after a link a is not .): a reward
    # function that changes the working directory (reward.workers=0) moves no later write.
    run_dir = Path.cwd() / Path(cfg.run.out_dir).expanduser() / name
    _check_place(cfg, run_dir)
    if not cfg.run.name:  # three seeds started in one second get three directories
        return NewRun(_free_name(run_dir), auto_name=run_dir)
    asides.put_back(run_dir)
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if not entries:
        return NewRun(run_dir)
    if asides.only_a_start(run_dir, config=False):
        refuse_if_running(run_dir)  # another run is starting there
        if MARK not in entries:  # a start that died before it marked it: empty to a new run
            return NewRun(run_dir)
        if not overwrite:
            raise FileExistsError(
                f"run directory {run_dir} holds only a start that was interrupted before it "
                "wrote its config.yaml (dapo's mark and lock): there is no run to continue; "
                "start it again with --overwrite, or pick another run.name"
            )
    if not is_run_dir(run_dir):
        raise ValueError(
            f"run directory {run_dir} is not empty and holds no dapo run; choose another "
            "run.name or run.out_dir (dapo never deletes what it did not write)"
        )
    refuse_if_running(run_dir)  # no resume or overwrite can be offered
    if not overwrite:
        raise FileExistsError(
            f"run directory {run_dir} already holds a run; continue it with "
            f"`{resume_text(run_dir)}`, replace it with --overwrite, or pick another run.name"
        )
    if not (run_dir / MARK).is_file():
        raise ValueError(
            f"--overwrite: {run_dir} has no {MARK} mark, so dapo did not create it (or a dapo "
            "from before runs were marked did) and will not delete it. It holds: "
            f"{listing(entries)}. Delete it yourself if it is an old run you no longer need, "
            "or pick another run.name"
        )
    check_replaceable(run_dir)
    return NewRun(run_dir, replaces=True)


def refuse_if_running(run_dir: Path) -> None:
    """Refuse ``run_dir`` while a run holds its lock, naming the process."""
    holder = in_use_by(run_dir)
    if holder is not None:
        raise in_use_error(run_dir, holder)


def _check_place(cfg: Config, run_dir: Path) -> None:
    """Refuse a run directory that is a link or a file, or under a file."""
    if run_dir.is_symlink():
        raise ValueError(f"run directory {run_dir} is a symbolic link; choose another run.name")
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} is a file; choose another run.name")
    above = next((p for p in run_dir.parents if p.exists() or p.is_symlink()), None)
    if above is not None and not above.is_dir():  # the run could never be created there
        raise ValueError(
            f"run.out_dir={cfg.run.out_dir}: {above} is a file, not a directory; choose "
            "another run.out_dir"
        )


def _free_name(run_dir: Path, after: Path | None = None) -> Path:
    """``run_dir``, or with -2, -3... appended, the first that is free (after ``after``)."""
    names = [run_dir, *(run_dir.with_name(f"{run_dir.name}-{k}") for k in range(2, NAME_TRIES))]
    for path in names[names.index(after) + 1 if after in names else 0 :]:
        if not os.path.lexists(path):
            return path
    raise ValueError(
        f"run directory {run_dir} and {NAME_TRIES - 1} numbered ones after it are taken; "
        "set run.name"
    )


def resume_text(run_dir: Path | str) -> str:
    """The command that continues the run in ``run_dir``, quoted for a shell."""
    return f"dapo train --resume {shlex.quote(str(run_dir))}"


def start_new_run(plan: NewRun) -> Path:
    """Create the run directory of ``plan``, locked for this process and marked. An earlier
    run it replaces is locked (refused while another process uses it) and moved aside; its
    lock is held until the new directory's is, so that no other process takes the aside for
    one whose start was killed (:mod:`dapo.run.asides`)."""
    old_lock = None
    if plan.replaces:
        old_lock = RunLock(plan.path).acquire()
        plan.aside = asides.aside_path(plan.path)
        try:
            os.rename(plan.path, plan.aside)
        except OSError:
            old_lock.release()
            raise
        print(f"dapo: the earlier run in {plan.path} is kept at {plan.aside} until this one starts")
    try:
        _claim(plan)
        check_writable(plan.path, new=True)
        mark = {"run_id": uuid.uuid4().hex, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_atomic(plan.path / MARK, json.dumps(mark) + "\n")
    except Exception:
        undo_new_run(plan)
        raise
    finally:
        if old_lock is not None:
            old_lock.release()
    return plan.path


def _claim(plan: NewRun) -> None:
    """Make the run directory (or take the empty one there) and lock it at once: of two
    starts of one name, the one holding the lock goes on, the other is told who holds it.
    The lock is taken before anything is written there, and nothing is removed without it."""
    _make_parents(plan)
    for _ in range(NAME_TRIES):
        try:
            plan.path.mkdir()
            plan.created = True
        except FileNotFoundError:  # a start that failed there removed run.out_dir, its own
            _make_parents(plan)
            continue
        except FileExistsError:
            if plan.auto_name is not None:  # another run took the name first: the next number
                plan.path = _free_name(plan.auto_name, after=plan.path)
                continue
            if plan.path.is_symlink() or not plan.path.is_dir():
                msg = f"run directory {plan.path} is a file; choose another run.name"
                raise ValueError(msg) from None
        except OSError as exc:
            raise _not_created(plan.path, exc) from exc
        try:
            plan.lock = RunLock(plan.path).acquire()
        except FileNotFoundError:  # a start that failed there removed it meanwhile
            plan.created = False
            continue
        except OSError as exc:
            raise _not_writable(plan.path, exc, new=True) from exc
        if not asides.only_a_start(plan.path, config=False) or (plan.path / MARK).exists():
            # Another run made it, started and ended before this one could lock it.
            plan.lock.release()
            plan.lock, plan.created = None, False
            raise FileExistsError(
                f"run directory {plan.path} was taken by another run meanwhile; pick another "
                "run.name"
            )
        return
    raise ValueError(f"run directory {plan.path} kept disappearing; try again")


def _make_parents(plan: NewRun) -> None:
    """Make the directories the run goes in (run.out_dir), top down, noting each that this
    start's own mkdir made (deepest first; not one it found, nor one another process made
    meanwhile): a start that fails removes them again while they are empty."""
    parent = plan.path.parent
    for path in (*reversed(parent.parents), parent):  # unresolved: a/../b is a, then b
        if path.is_dir():
            continue
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _not_created(plan.path, exc) from exc
        if path not in plan.made_parents:
            plan.made_parents.insert(0, path)


def _not_created(run_dir: Path, exc: OSError) -> ValueError:
    return ValueError(
        f"cannot create run directory {run_dir}: {exc.strerror}; set run.out_dir to a "
        "writable place"
    )


def finish_replacing(plan: NewRun) -> None:
    """The new run has started: remove the run it replaced, checked again in depth to hold
    only what dapo wrote (renamed first, so that a removal cut short is never put back)."""
    if plan.aside is None:
        return
    aside, plan.aside = plan.aside, None
    try:
        foreign = foreign_entries(aside)
    except TooManyEntries as exc:
        foreign = [f"({exc})"]
    if foreign:  # something appeared in it meanwhile: keep it for its owner
        print(
            f"dapo: warning: {aside} holds files dapo did not write ({listing(foreign, 3)}); "
            "it was kept"
        )
        return
    doomed = aside.with_name(aside.name.replace(asides.REPLACED, ".deleting-", 1))
    try:
        os.rename(aside, doomed)
        shutil.rmtree(doomed)
    except OSError as exc:  # the new run has loaded its model: it goes on, naming what is left
        left = doomed if os.path.lexists(doomed) else aside
        why = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror or str(exc)
        print(
            f"dapo: warning: the earlier run that this one replaced could not be deleted ({why}); "
            f"what is left of it is at {left}. "
            f"Delete it yourself once that is fixed: rm -rf {shlex.quote(str(left))}",
            file=sys.stderr,
        )


def undo_new_run(plan: NewRun) -> None:
    """The new run failed before it started: remove what it wrote (its directory, when it
    made it, and run.out_dir, when it made that and it is empty) and put the run it replaced
    back. A directory it found stays, and nothing is
    removed from a directory whose lock it did not hold (two runs started at once under one
    name: the other holds it). Its directory is renamed away and the earlier run put back
    while the lock is held, and only then removed: a start of that name let in before could
    put the earlier run back itself, which this undo would then delete."""
    run_dir, aborted = plan.path, None
    try:
        if plan.lock is not None and _holds_only_own(run_dir):
            if plan.created:
                aborted = run_dir.with_name(f".{run_dir.name}.aborted-{uuid.uuid4().hex[:8]}")
                os.rename(run_dir, aborted)
            else:  # the user's empty directory: emptied again, kept
                for entry in run_dir.iterdir():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
        _put_back(plan)
    finally:
        if plan.lock is not None:
            plan.lock.release()
            plan.lock = None
    if aborted is not None:
        shutil.rmtree(aborted)
    for parent in plan.made_parents:
        try:  # only while empty: another run may have started in it meanwhile
            parent.rmdir()
        except OSError:
            break


def _holds_only_own(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a directory holding only what dapo writes (checked in depth)."""
    try:
        return run_dir.is_dir() and not foreign_entries(run_dir)
    except TooManyEntries:
        return False


def _put_back(plan: NewRun) -> None:
    """The run that ``plan`` replaced, renamed back in place of its run directory."""
    if plan.aside is None:
        return
    if not os.path.lexists(plan.path):
        try:
            os.rename(plan.aside, plan.path)
        except OSError:
            if not os.path.lexists(plan.path):  # not a start that took the name meanwhile
                raise
    if not plan.aside.is_dir():  # back (by a start of that name, when it took the name first)
        plan.aside = None
        return
    print(
        f"dapo: warning: the earlier run of {plan.path} is kept at {plan.aside}: another run "
        "took the directory meanwhile. Move it back yourself once that run is over"
    )


def existing_run_dir(path: str | Path) -> Path:
    """The directory given to ``--resume``, checked to hold a run (an earlier run that an
    interrupted ``--overwrite`` left aside put back first)."""
    run_dir = Path.cwd() / path  # absolute, as a new run's is (plan_new_run)
    if run_dir.is_dir() and not run_dir.is_symlink():
        asides.put_back(run_dir)
    if not (run_dir / "config.yaml").is_file():
        if run_dir.is_dir() and (run_dir / MARK).is_file() and asides.only_a_start(run_dir):
            refuse_if_running(run_dir)
            raise ValueError(
                f"--resume {run_dir}: it holds only a start that was interrupted before it "
                "wrote its config.yaml: there is no run to resume; start it again with the "
                "same command and --overwrite"
            )
        raise ValueError(
            f"--resume {run_dir}: not a dapo run directory (no config.yaml); give the directory "
            "that `dapo train` printed as its run directory"
        )
    return run_dir


def check_writable(run_dir: Path, *, new: bool = False) -> None:
    """Refuse ``run_dir`` when a file cannot be written there (``new``: a new run's, else a
    resumed one's, which cannot move elsewhere: the fix differs). The probe file is this
    process's own, so that two starts or resumes at once do not remove each other's."""
    probe = run_dir / f"{PROBE}-{os.getpid()}"
    try:
        with open_binary(probe) as f:  # never through a link
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except LinkRefused:
        raise
    except OSError as exc:
        raise _not_writable(run_dir, exc, new=new) from exc


def _not_writable(run_dir: Path, exc: OSError, *, new: bool) -> ValueError:
    if new:
        fix = "fix its permissions or set run.out_dir to a writable place"
    else:  # a resume writes into the run's own directory: run.out_dir does not move it
        fix = (
            "fix its permissions, or copy the run directory to a writable place and resume "
            f"the copy: cp -a {shlex.quote(str(run_dir))} COPY && dapo train --resume COPY"
        )
    return ValueError(f"run directory {run_dir} is not writable ({exc.strerror}); {fix}")
