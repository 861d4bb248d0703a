"""Run an untrusted Python program in a fresh, bounded, isolated process (Linux only).

``run_python`` starts one process per call in one of ``MODES`` (``bwrap``: bubblewrap's
namespaces and a read-only file system; ``unshare``: network and PID namespaces; ``process``:
none), each with an empty environment, a fresh working directory, ``python -I -S -B`` (the
standard library only), resource limits, ``no_new_privs``, death with the caller and, when
the caller is root, a uid of its own (:mod:`dapo.reward.sandbox_runs`). In every mode, where
the kernel offers them, Landlock and a seccomp filter confine the program: the boundary the
kernel enforces (:mod:`dapo.reward.confine`). An audit hook refuses processes, signals,
sockets, ctypes and writes outside the working directory: defence in depth, not a boundary.
``auto`` picks only a mode that isolates; ``process`` runs only when asked for by name.
docs/guides/code-sandbox.md says what each mode isolates.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from dapo.reward import confine
from dapo.reward.sandbox_boot import BOOT
from dapo.reward.sandbox_runs import UID_BASE, WORLD_WRITABLE, clean_up, open_run, reap_orphans

try:
    import ctypes
    import resource

    _PRCTL: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (ImportError, OSError, AttributeError):  # not Linux: no mode is available
    resource, _PRCTL = None, None  # type: ignore[assignment]

MODES = ("bwrap", "unshare", "process")
"""The isolation modes, strongest first."""
ISOLATING = ("bwrap", "unshare")
"""The modes ``auto`` picks from: the program has namespaces of its own. ``process`` has
none; it runs only when asked for by name (``code.sandbox=process``)."""
_PROBE_UID = UID_BASE - 1
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_CONFINE = Path(confine.__file__).read_text(encoding="utf-8")  # sent to the sandbox's Python
_MAX_SOURCE_BYTES = 100_000  # the source travels as one argv string (Linux caps it at 128 KiB)
_NS = " and allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
_FIX = {"bwrap": "apt-get install bubblewrap" + _NS, "unshare": "apt-get install util-linux" + _NS}
_FIX["process"] = "run on Linux with a python3 every user may execute (apt-get install python3)"
_OPT_IN = (
    "or, knowing that a program then shares the host's network, processes and file system "
    "(Landlock and seccomp, where the kernel has them, are its only confinement), ask for "
    "code.sandbox=process"
)


class SandboxUnavailable(ValueError):
    """This machine cannot run the requested sandbox; the message names the fix."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. Each limit ends the run, never the caller."""

    wall_s: float = 5.0
    """Wall-clock seconds before the run is killed; below reward.timeout_s (10 s by default),
    so that a run that hits it still answers before the reward pool's own deadline."""
    cpu_s: float = 4.0
    """CPU seconds per process (RLIMIT_CPU, rounded up): SIGKILL when they are used."""
    memory_mb: int = 512
    """Address space of each process (RLIMIT_AS), MiB: a larger allocation is a MemoryError."""
    processes: int = 32
    """Processes and threads of the run (RLIMIT_NPROC); enforced only when the caller is root
    and the run has a uid of its own (otherwise it would count the caller's own tasks)."""
    output_bytes: int = 64 * 1024
    """stdout and stderr together: past this the run is killed and ``output_exceeded`` set;
    no more than this (plus one 64 KiB read) is ever held in memory."""
    file_bytes: int = 16 * 2**20
    """Largest file the run may write (RLIMIT_FSIZE)."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    tmp_bytes: int = 64 * 2**20
    """Size of each private tmpfs of bwrap mode: /tmp (which holds the working directory),
    /var/tmp and /dev/shm. In the other modes, the most the working directory may hold on
    the host's disk: it is measured every ``DISK_POLL_S`` and the run killed past it
    (``disk_exceeded``)."""

    def __post_init__(self) -> None:
        for field in fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"SandboxLimits.{field.name} must be > 0")


@dataclass(frozen=True)
class RunResult:
    """How one run ended: the outermost process's exit status (negative: the signal that killed
    it; bwrap reports the program's signal as 128 + its number), stdout (at most output_bytes),
    the last 4 KiB of stderr, whether it was killed at wall_s or for writing past output_bytes,
    the seconds from its start to the end of its cleanup, and the isolation mode it ran in."""

    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_exceeded: bool
    elapsed_s: float
    mode: str
    disk_exceeded: bool = False
    """Killed for filling its working directory past ``tmp_bytes`` (unshare and process
    modes; bwrap's tmpfs refuses the write instead)."""


DISK_POLL_S = 0.05
"""How often the working directory of an unshare or process run is measured: a run may go past
``tmp_bytes`` by what it writes in this time (each file within ``file_bytes``)."""
_MAX_ENTRIES = 10_000  # more files than this in the working directory end the run as over
_SLOTS = itertools.count()
_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0  # only root can give a run its own uid


def _child_setup(limits: SandboxLimits, own_uid: bool) -> Callable[[], None]:
    """What the child runs between fork and exec, after the uid change."""
    prctl, parent = _PRCTL, os.getpid()
    cpu, memory = math.ceil(limits.cpu_s), limits.memory_mb * 2**20
    settings = [
        # SIGKILL at the limit, not SIGXCPU first: a program can catch SIGXCPU, and as PID 1 of
        # unshare's namespace it never receives it (the kernel does not signal a namespace's init).
        (resource.RLIMIT_CPU, cpu, cpu),
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if own_uid:
        settings.append((resource.RLIMIT_NPROC, limits.processes, limits.processes))

    def setup() -> None:
        if prctl is not None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the caller
            prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries grant nothing
        if os.getppid() != parent:  # the caller died before the signal was armed
            os._exit(1)
        for what, soft, hard in settings:  # soft == hard: the program cannot raise them
            resource.setrlimit(what, (soft, hard))

    return setup


def _wrapper(mode: str, limits: SandboxLimits) -> list[str]:
    """The command line that puts the interpreter in ``mode``'s namespaces."""
    if mode == "unshare":
        return [shutil.which("unshare") or "unshare", *_unshare_flags(), "--"]
    if mode != "bwrap":
        return []
    args = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    args += ["--clearenv", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for path in WORLD_WRITABLE:  # --size: bwrap 0.7 and later; older ones fail the probe
        if os.path.isdir(path):
            args += ["--perms", "1777", "--size", str(limits.tmp_bytes), "--tmpfs", path]
    args += ["--dir", "/tmp/work", "--chdir", "/tmp/work"]
    args += [arg for name, value in _ENV.items() for arg in ("--setenv", name, value)]
    return [*args, "--"]


@functools.cache
def _unshare_flags() -> tuple[str, ...]:
    # --map-current-user (util-linux 2.38) keeps the program unprivileged inside; older
    # versions map to root, a root over nothing but the new namespaces.
    base = ("--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc")
    for mapping in ("--map-current-user", "--map-root-user"):
        if _probe(["unshare", "--user", mapping, *base, "--", "true"]):
            return ("--user", mapping, *base)
    return ("--user", "--map-root-user", *base)


def _probe(command: list[str]) -> bool:
    """Whether ``command`` succeeds started as runs are (as a run's uid, when root)."""
    ids = {"user": _PROBE_UID, "group": _PROBE_UID, "extra_groups": []} if _ROOT else {}
    try:
        done = subprocess.run(command, capture_output=True, timeout=20, env=_ENV, cwd="/", **ids)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@functools.cache
def _interpreter(mode: str) -> str:
    """A Python the run's uid may execute (sys.executable may sit in a home only root reads)
    and ``mode`` can see (bwrap's private tmpfs hides a venv under /tmp), or "" if none."""
    candidates = [sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3"]
    candidates.append(shutil.which("python3", path=_ENV["PATH"]) or "")
    for path in dict.fromkeys(c for c in candidates if c):
        seen = {path, os.path.realpath(path)}
        if mode == "bwrap" and any(
            os.path.commonpath([p, top]) == top for p in seen for top in WORLD_WRITABLE
        ):
            continue
        if _probe([path, "-I", "-S", "-B", "-c", "import json, sys; sys.addaudithook"]):
            return path
    return ""


@functools.cache
def kernel_layers() -> tuple[int, bool]:
    """:func:`dapo.reward.confine.offered`, probed once: what confinement every mode adds."""
    return confine.offered() if _PRCTL is not None else (0, False)


def _command(mode: str, limits: SandboxLimits, source: str, audit: bool) -> list[str]:
    """The command line of a run: the wrapper, the interpreter, the boot script, its args."""
    landlock, seccomp = kernel_layers()
    layers = [str(landlock), "1" if seccomp else "0", _CONFINE]
    interpreter = [_interpreter(mode), "-I", "-S", "-B", "-c", BOOT]
    return [*_wrapper(mode, limits), *interpreter, source, "1" if audit else "0", *layers]


@functools.cache
def _mode_works(mode: str) -> bool:
    """Whether ``mode`` runs a program here, confined by the kernel's layers where it has
    them (a mode that cannot be confined where they exist does not work)."""
    if resource is None or not sys.platform.startswith("linux") or not _interpreter(mode):
        return False
    if mode != "process" and shutil.which(mode) is None:
        return False
    return _probe(_command(mode, SandboxLimits(), "pass", True))


def forget_probes() -> None:
    """Probe the machine again on the next call (after installing bubblewrap, say)."""
    for probe in (_mode_works, _interpreter, _unshare_flags, kernel_layers):
        probe.cache_clear()


def available_modes() -> tuple[str, ...]:
    """The modes that work on this machine, strongest first (probed once per process)."""
    return tuple(mode for mode in MODES if _mode_works(mode))


def process_mode_warning() -> str:
    """What ``code.sandbox=process`` leaves a program, said in the log and the run's summary."""
    landlock, seccomp = kernel_layers()
    if landlock and seccomp:
        layers = f"confined only by the kernel's Landlock (ABI {landlock}) and seccomp filter"
    else:
        layers = "bounded only by its limits and an audit hook, which is no boundary"
    return (
        "code.sandbox=process: each program runs without namespaces of its own, on the host's "
        f"network, processes and file system, {layers} (docs/guides/code-sandbox.md)"
    )


def pick_mode(requested: str = "auto") -> str:
    """``requested`` if it works here; for ``auto``, the strongest mode that isolates
    (``ISOLATING``): never ``process``, which runs only when asked for by name.

    Raises:
        ValueError: an unknown mode. SandboxUnavailable (a ValueError) naming the fix: the
            requested mode, or for ``auto`` every isolating mode, does not work here.
    """
    if requested == "auto":
        for mode in filter(_mode_works, ISOLATING):
            return mode
        raise SandboxUnavailable(
            f"no sandbox mode that isolates a program works here: {_FIX['bwrap']}, or "
            f"{_FIX['unshare']}; {_OPT_IN}"
        )
    if requested not in MODES:
        raise ValueError(f"sandbox mode must be auto or one of {', '.join(MODES)}: {requested!r}")
    if not _mode_works(requested):
        raise SandboxUnavailable(f"sandbox mode {requested} does not work here: {_FIX[requested]}")
    return requested


def run_python(
    source: str,
    *,
    stdin: bytes = b"",
    limits: SandboxLimits = SandboxLimits(),  # noqa: B008 - frozen, so safely shared
    mode: str = "auto",
    audit: bool = True,
) -> RunResult:
    """Run ``source`` as a program in a fresh sandboxed process; wait for its end.

    ``stdin`` is its standard input. However the run ends, nothing of it is left: its
    processes are killed and its working directory removed. ``audit=False`` leaves out the
    audit hook, to test the layers under it.

    Raises:
        ValueError: a source over 100,000 bytes or holding NUL; an unknown mode.
        SandboxUnavailable: the mode does not work here (the message names the fix).
        OSError: the process could not start (the machine is out of processes or memory).
    """
    mode = pick_mode(mode)
    if "\0" in source or len(source.encode("utf-8", "surrogatepass")) > _MAX_SOURCE_BYTES:
        raise ValueError(f"source must be under {_MAX_SOURCE_BYTES} bytes, without NUL")
    # A uid unique on the machine: pids are (pid_max <= 2**22), a process runs at most 64 at
    # a time, and next() of a count is atomic.
    uid = UID_BASE + (os.getpid() << 6) + next(_SLOTS) % 64 if _ROOT else None
    options = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    if uid is not None:
        reap_orphans()  # what runs of killed callers left (this uid's earlier owner too)
    command = _command(mode, limits, source, audit)
    workdir = open_run(uid, needs_workdir=mode != "bwrap")
    start = time.monotonic()
    # stdin from an unnamed file, not a pipe: nothing to feed while reading the output.
    with tempfile.TemporaryFile() as feed:
        feed.write(stdin)
        feed.seek(0)
        try:
            if workdir is not None and uid is not None:
                os.chown(workdir, uid, uid)
            proc = subprocess.Popen(
                command, stdin=feed, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=workdir or "/", env=_ENV, start_new_session=True,
                preexec_fn=_child_setup(limits, uid is not None), **options,
            )  # fmt: skip
        except BaseException:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            raise
    with proc:
        out, err, timed_out, exceeded, full = _watch(proc, limits, uid, workdir)
    elapsed = time.monotonic() - start
    return RunResult(proc.returncode, out, err, timed_out, exceeded, elapsed, mode, full)


def _watch(
    proc: subprocess.Popen, limits: SandboxLimits, uid: int | None, workdir: str | None
) -> tuple[bytes, bytes, bool, bool, bool]:
    """Read ``proc``'s output until it ends, overruns ``wall_s``, writes more than
    ``output_bytes`` or fills ``workdir`` past ``tmp_bytes``; clean up everything of the run;
    read what is left (at most 1 s)."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    out, err = buffers.values()
    total, timed_out, cleaned, full = 0, False, False, False
    deadline = time.monotonic() + limits.wall_s
    measured = time.monotonic()
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while (selector.get_map() or not cleaned) and total <= limits.output_bytes:
                now = time.monotonic()
                if not cleaned and workdir is not None and now - measured >= DISK_POLL_S:
                    measured, full = now, disk_used(workdir) > limits.tmp_bytes
                if not cleaned and (proc.poll() is not None or now >= deadline or full):
                    # Ended, or out of time: whatever still holds the pipes dies now.
                    timed_out, cleaned = proc.returncode is None and not full, True
                    clean_up(proc, uid, workdir)
                    deadline = now + 1.0
                elif cleaned and now >= deadline:
                    break
                if not selector.get_map():  # the pipes are closed: only the exit is left
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(max(0.0, deadline - now))
                    continue
                # The pipes' end of file wakes this at once when the program exits.
                for key, _ in selector.select(min(deadline - now, 0.05)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fd)
                    total += len(chunk)
                    buffers[key.fd].extend(chunk)
                    del err[:-4096]  # stderr: only its tail
        finally:
            if not cleaned:
                clean_up(proc, uid, workdir)
    exceeded = total > limits.output_bytes
    return bytes(out[: limits.output_bytes]), bytes(err), timed_out, exceeded, full


def disk_used(path: str) -> float:
    """Bytes of disk the files under ``path`` hold (their allocated blocks); infinite when it
    holds more than ``_MAX_ENTRIES`` entries or a directory that cannot be read (a program
    that hides its files from the count is over the limit)."""
    used, entries, todo = 0, 0, [path]
    while todo:
        try:
            with os.scandir(todo.pop()) as listing:
                for entry in listing:
                    entries += 1
                    if entries > _MAX_ENTRIES:
                        return math.inf
                    with contextlib.suppress(FileNotFoundError):  # removed since listed
                        used += entry.stat(follow_symlinks=False).st_blocks * 512
                        if entry.is_dir(follow_symlinks=False):
                            todo.append(entry.path)
        except FileNotFoundError:  # removed since listed
            continue
        except OSError:
            return math.inf
    return used
