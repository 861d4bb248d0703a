"""A sandboxed run's own uid, the marker that names it, and the cleanup of what it left.

When the trainer runs as root, each run gets a uid of its own (no passwd entry):
``UID_BASE + caller pid x 64 + a slot``. At its end every process of that uid is killed and
every file it left in the world-writable directories removed. A run whose caller was killed
(``kill -9`` of a reward worker) can leave both behind; the next run on the machine sweeps
them, but only what a *marker* names: before a run starts, its caller writes
``<tmp>/dapo-sandbox-runs-<euid>/<uid>.json`` naming the run's uid, its working directory and
the caller (pid and start time), and removes it after the run's cleanup. A marker whose
caller is gone is an orphan's: its uid's processes and files go, then the marker. Nothing is
inferred from a uid range, so another container's or namespace's processes (or files) whose
uids happen to be large are never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

UID_BASE = 1 << 29
"""Runs take uids from here up (no passwd entry): UID_BASE + pid * 64 + a slot."""
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")


def markers_dir() -> Path | None:
    """This user's directory of run markers (mode 0700, created if missing); None where it is
    not safely ours (a link, another owner, group or other access): no marker is then
    written or read, and no orphan is swept."""
    path = Path(tempfile.gettempdir()) / f"dapo-sandbox-runs-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    try:
        info = os.lstat(path)
    except OSError:
        return None
    mine = stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
    return path if mine and not info.st_mode & 0o077 else None


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None when it is gone: with
    the pid, it names one process, whatever pids are reused later."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b") ", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether the process ``pid`` exists (another user's too); a zombie counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def mark(uid: int, workdir: str | None) -> None:
    """Record that this process runs a sandbox as ``uid`` in ``workdir``."""
    where = markers_dir()
    if where is None:
        return
    me = os.getpid()
    record = {"uid": uid, "workdir": workdir, "caller": me, "caller_start": _start_time(me)}
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(where / f"{uid}.json", flags, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)


def unmark(uid: int) -> None:
    where = markers_dir()
    if where is not None:
        with contextlib.suppress(FileNotFoundError):
            (where / f"{uid}.json").unlink()


def kill_uid(uid: int) -> bool:
    """SIGKILL every live process of ``uid``; whether there was one."""
    found = False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):  # gone meanwhile
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            # A zombie is dead already, waiting for its parent to reap it.
            if Path(f"/proc/{pid}/stat").read_bytes().rsplit(b") ", 1)[1][:1] != b"Z":
                os.kill(int(pid), signal.SIGKILL)
                found = True
    return found


def _end_uid(uid: int) -> None:
    """Kill ``uid``'s processes until none is left (a fork races the scan), then remove its
    files from the world-writable directories (process and unshare modes share the host's)."""
    for _ in range(1000):
        if not kill_uid(uid):
            break
        time.sleep(0.001)
    for top in {*WORLD_WRITABLE, tempfile.gettempdir()}:
        with contextlib.suppress(OSError), os.scandir(top) as entries:
            for entry in [e for e in entries if e.stat(follow_symlinks=False).st_uid == uid]:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)


def open_run(uid: int | None, needs_workdir: bool) -> str | None:
    """Make a run's working directory (None: ``needs_workdir`` false) and, for a run with a
    uid of its own, its marker, so that the next run on the machine sweeps both should this
    caller die."""
    workdir = None
    if needs_workdir:  # bwrap's is in its own tmpfs
        workdir = tempfile.mkdtemp(prefix="dapo-sandbox-", dir=_workdir_parent(uid is not None))
    if uid is not None:
        mark(uid, workdir)
    return workdir


def _workdir_parent(own_uid: bool) -> str:
    """Where a run's working directory is made: the temporary directory, unless the run has a
    uid of its own that could not reach it (a directory on the way that others may not search,
    such as a TMPDIR of mode 0700 under /root): then /tmp. There every run failed its
    confinement with "Permission denied" (exit status 121), and every program was graded
    wrong."""
    top = tempfile.gettempdir()
    real = Path(top).resolve()
    if own_uid and any(not os.stat(p).st_mode & stat.S_IXOTH for p in (real, *real.parents)):
        return WORLD_WRITABLE[0]
    return top


def remove_workdir(workdir: str | None, *, chmod: bool) -> None:
    """Remove a run's working directory; ``chmod``: first give its owner its permissions
    back (a program that is not its own uid may have taken them away)."""
    if workdir is None:
        return
    if chmod:
        subprocess.run(["chmod", "-R", "u+rwx", workdir], capture_output=True)  # no links
    shutil.rmtree(workdir, ignore_errors=True)


def clean_up(proc: subprocess.Popen, uid: int | None, workdir: str | None) -> None:
    """The end of a run: kill its process group, then (root) every process of its uid (a
    daemon that left the group is still that uid) and its files; remove its working
    directory; drop its marker."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if uid is not None:
        _end_uid(uid)
    remove_workdir(workdir, chmod=uid is None)
    if uid is not None:
        unmark(uid)


def reap_orphans() -> int:
    """End the runs whose caller is gone, as their markers name them; how many."""
    where = markers_dir()
    if where is None:
        return 0
    reaped = 0
    for path in where.glob("*.json"):
        try:
            record = json.loads(path.read_text())
            uid, caller = int(record["uid"]), int(record["caller"])
            workdir = record.get("workdir")
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours to read
        started = _start_time(caller)
        if caller == os.getpid() or (started is not None and started == record.get("caller_start")):
            continue  # its caller runs (this one's own marker included)
        _end_uid(uid)
        if isinstance(workdir, str) and Path(workdir).name.startswith("dapo-sandbox-"):
            remove_workdir(workdir, chmod=False)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        reaped += 1
    return reaped
