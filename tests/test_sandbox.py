"""The sandbox (dapo.reward.sandbox): limits, cleanup, and what each isolation mode blocks.

Every test of a mode runs in each mode available here and is skipped where a mode is not
(CI without bubblewrap); ``process`` mode works on every Linux machine. The hostile programs
run with the audit hook off where a test checks a claim about the layer under it (the
namespaces, the uid, the limits), and with it on where the claim is the hook's.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest

from dapo.reward.sandbox import (
    ISOLATING,
    MODES,
    UID_BASE,
    SandboxLimits,
    SandboxUnavailable,
    available_modes,
    disk_used,
    forget_probes,
    kernel_layers,
    pick_mode,
    run_python,
)
from dapo.reward.sandbox_runs import markers_dir, process_alive

HERE = available_modes()
ROOT = os.geteuid() == 0
FAST = SandboxLimits(wall_s=1.0, cpu_s=2.0)  # the wall clock, not the CPU limit, ends a loop
MARGIN_S = 1.5  # start, cleanup and a loaded 2-core machine, on top of wall_s


def every_mode(*, root: tuple[str, ...] = ()) -> list:
    """Each mode as a parameter, skipped where it does not work here, or (the modes in
    ``root``) where the claim needs a uid of its own and we are not root."""
    params = []
    for mode in MODES:
        marks = [pytest.mark.skipif(mode not in HERE, reason=f"{mode} mode does not work here")]
        if mode in root:
            marks.append(pytest.mark.skipif(not ROOT, reason="needs root (a uid per run)"))
        params.append(pytest.param(mode, marks=marks))
    return params


def leftovers(marker: str) -> list[int]:
    """Live processes of a sandbox: their command line holds ``marker``, or (root) their uid
    is one of the runs this process started (another test session may be running its own)."""
    ours = range(UID_BASE + (os.getpid() << 6), UID_BASE + (os.getpid() + 1 << 6))
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b") ", 1)[1]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            owner = os.stat(f"/proc/{pid}").st_uid
        except (OSError, IndexError):
            continue
        if stat[:1] != b"Z" and (marker.encode() in cmdline or owner in ours):
            found.append(int(pid))
    return found


IO_URING_SOCKET = """\
import importlib.util, os, platform, struct
_ctypes = importlib.util.module_from_spec(importlib.util.find_spec("_ctypes"))
MMAP, SENDTO = {"x86_64": (9, 44), "aarch64": (222, 206)}[platform.machine()]
class L(_ctypes._SimpleCData): _type_ = "l"
class U(_ctypes._SimpleCData): _type_ = "I"
class C(_ctypes._SimpleCData): _type_ = "c"
class F(_ctypes.CFuncPtr): _flags_, _restype_ = 1 | 8, L  # cdecl, errno kept
syscall = F(_ctypes.dlsym(-1, "syscall"))
def call(*a): return syscall(*[L(x) if isinstance(x, int) else x for x in a])
params = (C * 120)()
ring = call(425, 4, params)  # io_uring_setup: a ring of 4 entries
if ring < 0:
    raise SystemExit("io_uring_setup: " + os.strerror(_ctypes.get_errno()))
p = bytes(params)
sq_n, cq_n = struct.unpack_from("2I", p, 0)
sq_off, cq_off = struct.unpack_from("7IIQ", p, 40), struct.unpack_from("6IIIQ", p, 80)
def mmap(size, offset): return call(MMAP, 0, size, 3, 0x8001, ring, offset)
sq, cq = mmap(sq_off[6] + sq_n * 4, 0), mmap(cq_off[5] + cq_n * 16, 0x8000000)
sqes = mmap(sq_n * 64, 0x10000000)
# One entry: IORING_OP_SOCKET (45) of AF_INET (2), SOCK_DGRAM (2); then wait for it.
(C * 64).from_address(sqes)[:] = struct.pack("BBHiQQIIQ", 45, 0, 0, 2, 2, 0, 0, 0, 7) + bytes(24)
tail, mask = U.from_address(sq + sq_off[1]).value, U.from_address(sq + sq_off[2]).value
U.from_address(sq + sq_off[6] + 4 * (tail & mask)).value = 0
U.from_address(sq + sq_off[1]).value = tail + 1
call(426, ring, 1, 1, 1, 0, 0)  # io_uring_enter
head, cmask = U.from_address(cq + cq_off[0]).value, U.from_address(cq + cq_off[2]).value
entry = bytes((C * 16).from_address(cq + cq_off[5] + 16 * (head & cmask)))
fd = struct.unpack_from("i", entry, 8)[0]
address = struct.pack("<H", 2) + struct.pack(">H", PORT) + bytes([127, 0, 0, 1]) + bytes(8)
print("socket", fd, "sent", call(SENDTO, fd, b"out", 3, 0, address, 16))
"""
"""A UDP socket made by io_uring's IORING_OP_SOCKET, which no ``socket`` call makes, sent a
datagram to the test: ``_ctypes`` loaded around the hook's import rule, ``syscall`` found by
``dlsym`` (x86-64 and AArch64 numbers)."""


class Trap:
    """What the hostile programs aim at, and how to tell whether one got through."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.marker = f"dapo-hostile-{secrets.token_hex(6)}"
        self.secret = f"secret-{secrets.token_hex(8)}"
        monkeypatch.setenv("DAPO_TEST_SECRET", self.secret)
        roots = ("/tmp", "/var/tmp", "/dev/shm", str(tmp_path))
        self.outside = [Path(root) / self.marker for root in roots if os.path.isdir(root)]
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        # Landlock refuses TCP but not UDP: a datagram through a socket that got past the filter.
        self.datagrams = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.datagrams.bind(("127.0.0.1", 0))
        self.datagrams.setblocking(False)  # a datagram sent on loopback is there at once
        self.victim = subprocess.Popen(["sleep", "60"])

    def programs(self) -> dict[str, str]:
        """Each hostile program's source, by name."""
        victims = (os.getpid(), self.victim.pid)
        return {
            "infinite loop": "while True:\n    pass\n",
            "fork bomb": f"import os, time  # {self.marker}\nn = 0\nfor _ in range(300):\n"
            "    try:\n        if os.fork() == 0:\n            time.sleep(30)\n"
            "            os._exit(0)\n        n += 1\n    except OSError:\n        break\n"
            "print('forked', n)\n",
            "8 GB allocation": "x = bytearray(8 * 2**30)\nprint('allocated')\n",
            "write outside": f"for path in {[str(p) for p in self.outside]!r}:\n"
            "    try:\n        open(path, 'w').write('x')\n    except OSError as e:\n"
            "        print(path, e)\n",
            "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {self.port}), 1)\n",
            "environment": "import os\nprint(dict(os.environ))\nfor pid in os.listdir('/proc'):\n"
            "    try:\n        print(open('/proc/%s/environ' % pid, 'rb').read())\n"
            "    except Exception:\n        pass\n",
            "kill the parent": f"import os\nfor pid in (os.getppid(), 1, *{victims!r}):\n"
            "    try:\n        os.kill(pid, 9)\n    except Exception as e:\n"
            "        print(pid, e)\n",
            "daemon": f"import os, subprocess, time\ntry:\n    subprocess.Popen(['/bin/sh', '-c',"
            f" 'sleep 30; : {self.marker}'], start_new_session=True)\nexcept Exception:\n"
            "    pass\nif os.fork() == 0:\n    os.setsid()\n"
            f"    time.sleep(30)  # {self.marker}\nprint('left a daemon')\n",
            "1 GB of output": "import sys\nchunk = b'x' * 2**20\nfor _ in range(1024):\n"
            "    sys.stdout.buffer.write(chunk)\n",
            "io_uring socket": IO_URING_SOCKET.replace(
                "PORT", str(self.datagrams.getsockname()[1])
            ),
            **self.past_the_hook(),
        }

    def past_the_hook(self) -> dict[str, str]:
        """Programs that go around the audit hook (each got out of ``process`` mode before the
        kernel's layers): a fresh ``_posixsubprocess`` whose ``fork_exec`` nothing audits,
        ``posixpath.normpath`` rebound so that the hook sees every path inside, and a signal
        through a pidfd, which nothing audits either."""
        outside = " ".join(str(p) for p in self.outside)
        shell = f"for p in {outside}; do echo x > $p; done; sleep 30  # {self.marker}"
        victims = (os.getpid(), self.victim.pid)
        return {
            "fresh _posixsubprocess": "import importlib.machinery as m, os\n"
            "spec = m.BuiltinImporter.find_spec('_posixsubprocess') or "
            "m.PathFinder.find_spec('_posixsubprocess')\nps = spec.loader.create_module(spec)\n"
            f"cmd = [b'/bin/sh', b'-c', {shell.encode()!r}]\nr, w = os.pipe()\n"
            "args = [cmd, [cmd[0]], True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w,\n"
            "        False, True, -1, None, None, None, -1, None]\n"
            "for extra in ([], [False]):\n    try:\n        print(ps.fork_exec(*args, *extra))\n"
            "        break\n    except TypeError:\n        pass\n",
            "rebound normpath": "import os, posixpath\n"
            "posixpath.normpath = lambda path: os.getcwd()  # the hook sees every path inside\n"
            f"for path in {[str(p) for p in self.outside]!r}:\n"
            "    try:\n        open(path, 'w').write('x')\n    except OSError as e:\n"
            "        print(path, e)\nfor pid in os.listdir('/proc'):\n"
            "    try:\n        print(open('/proc/%s/environ' % pid, 'rb').read())\n"
            "    except Exception:\n        pass\n",
            "pidfd signal": "import os, signal\n"
            f"for pid in {victims!r}:\n    try:\n"
            "        signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)\n"
            "    except Exception as e:\n        print(pid, e)\n",
        }

    def escaped(self, output: bytes = b"") -> list[str]:
        """Everything that got out: files, a connection, a dead victim, live processes, the
        secret in ``output``; empty when nothing did."""
        found = [f"created {p}" for p in self.outside if p.exists()]
        try:
            self.server.accept()[0].close()
            found.append("connected to the test server")
        except TimeoutError:
            pass
        try:
            self.datagrams.recv(64)
            found.append("sent a datagram to the test server")
        except BlockingIOError:
            pass
        if self.victim.poll() is not None:
            found.append("killed the victim process")
        found += [f"left process {pid}" for pid in leftovers(self.marker)]
        if self.secret.encode() in output:
            found.append("read the test process's environment")
        return found

    def close(self) -> None:
        self.server.close()
        self.datagrams.close()
        self.victim.kill()
        self.victim.wait()
        for path in self.outside:
            path.unlink(missing_ok=True)


@pytest.fixture
def trap(tmp_path, monkeypatch):
    trap = Trap(tmp_path, monkeypatch)
    yield trap
    trap.close()


# --- modes -----------------------------------------------------------------------------------


def test_process_mode_works_everywhere_and_auto_is_the_strongest_that_isolates():
    assert "process" in HERE
    assert HERE == tuple(m for m in MODES if m in HERE)
    isolating = [m for m in HERE if m in ISOLATING]
    if not isolating:
        pytest.skip("no mode that isolates works here")
    assert pick_mode() == pick_mode("auto") == isolating[0] != "process"
    assert run_python("print(6 * 7)").mode == isolating[0]


def test_an_unavailable_mode_is_refused_naming_the_fix(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="must be auto or one of bwrap, unshare, process"):
        pick_mode("docker")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither bwrap nor unshare can be found
    forget_probes()
    try:
        assert available_modes() == ("process",)
        with pytest.raises(SandboxUnavailable, match=r"apt-get install bubblewrap"):
            pick_mode("bwrap")
        with pytest.raises(SandboxUnavailable, match=r"apt-get install util-linux"):
            run_python("pass", mode="unshare")
        # auto never falls back to a mode that does not isolate: it names the fixes and the
        # explicit opt-in instead.
        fixes = r"bubblewrap.*user namespaces.*util-linux.*ask for code\.sandbox=process"
        with pytest.raises(SandboxUnavailable, match=fixes):
            pick_mode()
        with pytest.raises(SandboxUnavailable, match=fixes):
            run_python("pass")
        assert pick_mode("process") == "process"
    finally:
        monkeypatch.undo()
        forget_probes()
    assert available_modes() == HERE


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="SandboxLimits.memory_mb must be > 0"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(ValueError, match="under 100000 bytes, without NUL"):
        run_python("x = 1\0")
    with pytest.raises(ValueError, match="under 100000 bytes"):
        run_python("#" * 100_001)


# --- every run ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", every_mode())
def test_a_run_is_fresh_isolated_python_and_leaves_nothing(mode, trap):
    program = (
        "import os, sys\nprint(sys.stdin.read().upper())\nprint(os.getcwd())\n"
        "print(sorted(os.environ))\nprint(sys.flags.isolated, sys.flags.no_site)\n"
        "open('note.txt', 'w').write('mine')\nprint(sorted(os.listdir('.')))\n"
        "try:\n    import pytest\nexcept ImportError:\n    print('no site-packages')\n"
        "print(open('/proc/self/status').read().count('NoNewPrivs:\\t1'))\n"
        "sys.stderr.write('to stderr')\nsys.exit(3)\n"
    )
    result = run_python(program, stdin=b"hello", mode=mode, limits=FAST)
    lines = result.stdout.decode().splitlines()
    assert (result.returncode, result.mode, result.timed_out) == (3, mode, False)
    assert lines[0] == "HELLO" and lines[4] == "['note.txt']" and lines[5] == "no site-packages"
    assert set(eval(lines[2])) <= {"PATH", "LANG", "PWD", "LC_CTYPE"}  # nothing of ours
    assert lines[3] == "1 1"  # -I -S: isolated, no site
    assert lines[6] == "1"  # no_new_privs: a setuid binary would run with our uid
    assert result.stderr == b"to stderr"
    assert not os.path.exists(os.path.join(lines[1], "note.txt"))  # removed (or never here)
    assert trap.escaped(result.stdout) == []


@pytest.mark.parametrize("mode", every_mode(root=MODES))
def test_each_run_has_a_uid_of_its_own(mode):
    uids = [int(run_python("import os; print(os.getuid())", mode=mode).stdout) for _ in "ab"]
    assert uids[0] != uids[1] and min(uids) >= UID_BASE


@pytest.mark.parametrize("mode", every_mode())
def test_the_limits_end_the_run_not_the_caller(mode):
    limits = SandboxLimits(wall_s=2.0, memory_mb=256, file_bytes=2**20, open_files=32)
    big_file = "import os\nfd = os.open('big', os.O_WRONLY | os.O_CREAT)\n"
    big_file += "print(os.write(fd, b'x' * (2**20 + 1)))\nos.write(fd, b'x')\n"
    result = run_python(big_file, mode=mode, limits=limits)
    assert result.stdout == b"1048576\n" and result.returncode == 1  # cut at file_bytes
    assert result.stderr.endswith(b"OSError: [Errno 27] File too large\n")
    files = "fs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\n"
    result = run_python(files + "except OSError as e:\n    print(e.errno, len(fs))\n", mode=mode)
    errno, opened = result.stdout.split()
    assert errno == b"24" and 50 < int(opened) < 64  # EMFILE at open_files (64)
    result = run_python("x = bytearray(300 * 2**20)\n", mode=mode, limits=limits)
    assert result.returncode == 1 and result.stderr.endswith(b"MemoryError\n")
    # A CPU-bound loop ends at cpu_s, before wall_s (5 s), in every mode (in unshare's it is PID
    # 1, which SIGXCPU never reaches). It prints its own CPU time every tenth of a second: on a
    # busy machine a CPU second takes longer on the wall clock, which cannot tell the limits apart.
    loop = "import time\nmark = 0.0\nwhile True:\n    if time.process_time() >= mark:\n"
    loop += "        print(round(mark, 1), flush=True)\n        mark += 0.1\n"
    result = run_python(loop, mode=mode, limits=SandboxLimits(cpu_s=1))
    assert result.returncode != 0 and not result.timed_out
    assert 0.9 <= float(result.stdout.split()[-1]) < 1.5


# Files of 1 MiB, each announced once written, up to 400 MiB, then a wait for the wall clock.
FILL_DISK = (
    "import time\nfor i in range(400):\n    with open(f'f{i}', 'wb') as f:\n"
    "        f.write(b'x' * 2**20)\n    print(i + 1, flush=True)\ntime.sleep(60)\n"
)


@pytest.mark.parametrize("mode", every_mode())
def test_the_files_a_run_writes_are_bounded_in_total(mode):
    """tmp_bytes bounds the disk a run fills in every mode: bwrap's tmpfs refuses the write;
    in unshare and process modes the working directory is on the host's disk, measured every
    DISK_POLL_S, and the run is killed past it (it filled 400 MiB here, and 707 MiB in 1.5 s
    when measured, within file_bytes per file)."""
    limits = SandboxLimits(wall_s=4.0, tmp_bytes=16 * 2**20)
    result = run_python(FILL_DISK, mode=mode, limits=limits)
    written = int(result.stdout.split()[-1]) if result.stdout.split() else 0
    if mode == "bwrap":
        assert result.stderr.endswith(b"OSError: [Errno 28] No space left on device\n")
        assert written <= 16 and not result.disk_exceeded
    else:
        assert result.disk_exceeded and not result.timed_out and result.returncode < 0
        assert 16 <= written < 200, written  # past 16 MiB, stopped within a few polls
    assert result.elapsed_s < limits.wall_s + MARGIN_S


def test_disk_used_counts_allocated_blocks_and_refuses_a_directory_it_cannot_count(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 8192)
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(2**30)  # 1 GiB long, no block written
    used = disk_used(str(tmp_path))
    assert 8192 <= used < 64 * 1024  # the file's blocks and the directory's own
    for i in range(10_001):
        (tmp_path / "d" / str(i)).touch()
    assert disk_used(str(tmp_path)) == float("inf")  # too many files to count: over


@pytest.mark.parametrize("mode", every_mode(root=MODES))
def test_threads_and_processes_are_counted_together(mode):
    program = (
        "import threading, time\nn = 0\ntry:\n    for _ in range(100):\n"
        "        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "        n += 1\nexcept RuntimeError:\n    pass\nprint(n)\n"
    )
    result = run_python(program, mode=mode, limits=SandboxLimits(processes=8))
    assert 0 < int(result.stdout) < 8, result


# --- hostile programs, the layers under the audit hook ------------------------------------------

BOUND_S = FAST.wall_s + MARGIN_S
LANDLOCK, SECCOMP = kernel_layers()
CONFINED = LANDLOCK >= 1 and SECCOMP  # the kernel's layers hold in every mode, for any user
PAST_THE_HOOK = ("fresh _posixsubprocess", "rebound normpath", "pidfd signal")
# (program, the modes whose layers under the hook block it on their own, as root)
OS_LAYER = {
    "infinite loop": MODES,
    "fork bomb": MODES,
    "8 GB allocation": MODES,
    "write outside": MODES,
    "socket": MODES if CONFINED else ("bwrap", "unshare"),
    "io_uring socket": MODES if CONFINED else ("bwrap", "unshare"),
    "environment": MODES,
    "kill the parent": MODES,
    "daemon": MODES,
    "1 GB of output": MODES,
    **dict.fromkeys(PAST_THE_HOOK, MODES if CONFINED else ("bwrap",)),
}
NEEDS_ROOT = {  # the modes whose claim rests on the run's own uid (file permissions, signals)
    "write outside": ("unshare", "process"),
    "environment": ("process",),
    "kill the parent": ("process",),
    "fork bomb": MODES,
}
if CONFINED:  # Landlock and seccomp need no uid of the run's own
    NEEDS_ROOT = {}


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        pytest.param(name, p.values[0], marks=p.marks, id=f"{name}-{p.values[0]}")
        for name, modes in OS_LAYER.items()
        for p in every_mode(root=NEEDS_ROOT.get(name, ()))
        if p.values[0] in modes
    ],
)
def test_the_layers_under_the_hook_contain_a_hostile_program(name, mode, trap):
    tracemalloc.start()
    result = run_python(trap.programs()[name], mode=mode, limits=FAST, audit=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert result.elapsed_s < BOUND_S, result
    assert trap.escaped(result.stdout + result.stderr) == [], result
    assert peak < FAST.output_bytes + 2**20  # 1 GB of output never sat in our memory
    if name == "fork bomb":  # the filter refuses every fork; the process limit, some
        forked = int(result.stdout.split()[-1])
        assert forked == 0 if CONFINED else 0 < forked < FAST.processes
    if name == "8 GB allocation":
        assert b"MemoryError" in result.stderr and b"allocated" not in result.stdout
    if name == "1 GB of output":
        assert result.output_exceeded and len(result.stdout) == FAST.output_bytes
    if name == "infinite loop":
        assert result.timed_out


def test_process_mode_has_the_hosts_network_and_only_the_kernels_filter_refuses_it(trap):
    # The honest row of the table: process mode shares the host's network; without the hook,
    # only seccomp (where the kernel takes a filter) refuses the socket.
    result = run_python(trap.programs()["socket"], mode="process", limits=FAST, audit=False)
    if SECCOMP:
        assert b"Operation not permitted" in result.stderr and trap.escaped() == []
    else:
        assert result.returncode == 0 and trap.escaped() == ["connected to the test server"]


@pytest.mark.parametrize("mode", every_mode())
def test_the_filter_refuses_memory_files_that_no_limit_counts(mode):
    # A memfd's pages are in no address space (RLIMIT_AS), no tmpfs (tmp_bytes) and no working
    # directory (the disk poll): with the hook off, the kernel's filter refuses the call.
    if not SECCOMP:
        pytest.skip("no seccomp filter here: only the audit hook refuses memfd_create")
    program = "import os\nos.memfd_create('m')\nprint('made a memory file')\n"
    result = run_python(program, mode=mode, limits=FAST, audit=False)
    assert result.returncode == 1 and b"Operation not permitted" in result.stderr, result


@pytest.mark.parametrize("name", PAST_THE_HOOK)
@pytest.mark.parametrize("mode", every_mode())
def test_what_goes_around_the_hook_meets_the_kernels_layers(name, mode, trap):
    if not CONFINED and mode != "bwrap":
        pytest.skip("without Landlock and seccomp only bwrap's namespaces contain these")
    result = run_python(trap.programs()[name], mode=mode, limits=FAST)  # the hook on
    assert trap.escaped(result.stdout + result.stderr) == [], result
    refused = (b"Operation not permitted", b"Permission denied")  # seccomp's, Landlock's
    assert any(r in result.stdout + result.stderr for r in refused) or mode == "bwrap"


# --- as an ordinary user ------------------------------------------------------------------------

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


def as_ordinary_user(source: str, *, audit: bool) -> dict[str, dict]:
    """Run ``source`` in each mode through ``tests/sandbox_as_user.py``, started as uid 65534
    on the system's Python (the trainer's may sit in root's home): what a trainer that is
    not root gets, with no uid per run."""
    job = {"source": source, "modes": list(MODES), "audit": audit}
    job.update(wall_s=FAST.wall_s, cpu_s=FAST.cpu_s)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[1])}
    ids = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    done = subprocess.run(
        [SYSTEM_PYTHON, str(Path(__file__).with_name("sandbox_as_user.py"))],
        input=json.dumps(job), capture_output=True, text=True, env=env, cwd="/", timeout=120,
        **ids,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not ROOT or not os.path.exists(SYSTEM_PYTHON), reason="needs root")
@pytest.mark.parametrize("name", [*OS_LAYER])
def test_an_ordinary_users_runs_are_contained_too(name, trap):
    """Every hostile program, the hook off, in every mode an ordinary user has: with the
    kernel's layers nothing rests on root (no uid per run), and nothing gets out."""
    if not CONFINED:
        pytest.skip("without Landlock and seccomp an ordinary user's process mode is weaker")
    results = as_ordinary_user(trap.programs()[name], audit=False)
    assert "process" in results, results
    for mode, result in results.items():
        assert result["elapsed_s"] < BOUND_S, (mode, result)
        assert trap.escaped(result["output"].encode("latin-1")) == [], (mode, result)


CHANGE_THE_PARENT = """import os, resource
own = os.sched_getaffinity(0)
resource.prlimit(0, resource.RLIMIT_CORE, (0, 0))
os.sched_setaffinity(0, own)
os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 1)
print('changed itself')
parent = os.getppid()
calls = {
    'prlimit': lambda: resource.prlimit(parent, resource.RLIMIT_CORE, (0, 0)),
    'affinity': lambda: os.sched_setaffinity(parent, own),
    'priority': lambda: os.setpriority(
        os.PRIO_PROCESS, parent, os.getpriority(os.PRIO_PROCESS, parent)),
    'user priority': lambda: os.setpriority(
        os.PRIO_USER, 0, os.getpriority(os.PRIO_USER, 0)),
}
for name, call in calls.items() if parent > 1 else ():
    try:
        call()
        print(name, 'changed the parent')
    except OSError as e:
        print(name, e)
"""
"""Harmless values (a core limit of 0, the affinity and priority it has), but each call that
succeeds could as well cap the parent's CPU time (then SIGKILL) or pin it to one core."""


@pytest.mark.skipif(not ROOT or not os.path.exists(SYSTEM_PYTHON), reason="needs root")
def test_an_ordinary_users_program_changes_itself_but_no_process_of_its_user():
    """Without root the program has the trainer's uid: in process mode the kernel let it set
    the limits, affinity and priority of the trainer's processes (prlimit64 and friends)."""
    if not SECCOMP:
        pytest.skip("no seccomp filter here: an ordinary user's process mode is weaker")
    results = as_ordinary_user(CHANGE_THE_PARENT, audit=False)
    assert "process" in results, results
    for mode, result in results.items():
        assert "changed itself" in result["output"], (mode, result)
        assert "changed the parent" not in result["output"], (mode, result)
    assert results["process"]["output"].count("Operation not permitted") == 4, results


# --- the audit hook ----------------------------------------------------------------------------

REFUSED = {
    "import socket": "import socket is not allowed",
    "import subprocess; subprocess.run(['true'])": "import _posixsubprocess is not allowed",
    "import os; os.fork()": "os.fork is not allowed",
    "import os; os.system('true')": "os.system is not allowed",
    "import os; os.kill(os.getpid(), 0)": "os.kill is not allowed",
    "import ctypes": "import ctypes is not allowed",
    "import importlib.util as u\nu.module_from_spec(u.find_spec('_ctypes')).dlsym(-1, 'syscall')": (
        "ctypes.dlsym/handle is not allowed"
    ),
    "import os; os.symlink('/etc', 'etc')": "os.symlink is not allowed",
    "open('/var/tmp/x', 'w')": "writes outside the working directory",
    "import os; os.open('/var/tmp', os.O_RDONLY)": "writes outside the working directory",
    "import os; os.mkdir('../escape')": "os.mkdir outside the working directory",
    "import os; open(f'/proc/{os.getpid() + 1}/environ')": "other processes are not readable",
    "import os; os.memfd_create('m')": "os.memfd_create is not allowed",
    "import posix; posix.memfd_create('m')": "os.memfd_create is not allowed",
}


@pytest.mark.parametrize("mode", every_mode())
def test_the_audit_hook_refuses_what_it_lists_and_allows_the_rest(mode):
    for program, message in REFUSED.items():
        result = run_python(program, mode=mode, limits=FAST)
        assert result.returncode == 1 and message.encode() in result.stderr, program
    allowed = (
        "import json, os, threading\nos.mkdir('d')\nwith open('d/a', 'w') as f:\n"
        "    f.write(json.dumps([1]))\nos.rename('d/a', 'b')\n"
        "print(open('b').read(), open('/proc/self/status').read()[:4], os.listdir('/usr'))\n"
    )
    result = run_python(allowed, mode=mode, limits=FAST)
    assert result.returncode == 0 and result.stdout.startswith(b"[1] Name ['"), result


# --- the sandbox dies with its caller ----------------------------------------------------------


@pytest.mark.parametrize("mode", every_mode())
def test_a_killed_caller_takes_its_sandbox_with_it(mode):
    marker = f"dapo-orphan-{secrets.token_hex(6)}"
    caller = (
        "from dapo.reward.sandbox import SandboxLimits, run_python\n"
        f"run_python('import time\\ntime.sleep(90)  # {marker}', mode={mode!r},"
        " limits=SandboxLimits(wall_s=90, cpu_s=90))\n"
    )
    tree = {"bwrap": 4, "unshare": 3, "process": 2}[mode]  # the caller, wrappers, the program
    process = subprocess.Popen([sys.executable, "-c", caller], cwd=Path(__file__).parents[1])
    try:
        # A loaded machine once took over 10 s to start the caller and its sandbox.
        deadline = time.monotonic() + 60
        while len(leftovers(marker)) < tree and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(leftovers(marker)) == tree
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + 2
    while leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert leftovers(marker) == []


def _sleeper_as(uid: int, marker: str) -> subprocess.Popen:
    """A process of ``uid`` whose command line holds ``marker``, waiting until killed. It
    never forks: sh blocks in its ``read`` builtin on a pipe no one writes. (``sleep 30; :
    marker`` forked a child whose command line was sh's until it exec'd sleep, and a check
    before the fork saw one process, then two: review r29a.)"""
    options = {"user": uid, "group": uid, "extra_groups": [], "stdin": subprocess.PIPE}
    sleeper = subprocess.Popen(["/bin/sh", "-c", "read -r _", marker], **options)
    deadline = time.monotonic() + 2
    while leftovers(marker) != [sleeper.pid] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert leftovers(marker) == [sleeper.pid]
    return sleeper


def _end(sleeper: subprocess.Popen) -> None:
    sleeper.kill()
    sleeper.wait()
    sleeper.stdin.close()


@pytest.mark.skipif(not ROOT, reason="needs root (a uid per run)")
def test_the_next_run_ends_what_a_killed_caller_left_as_its_marker_names_it():
    # bwrap arms its init's parent-death signal a moment after starting it: a caller killed
    # in that moment leaves the sandbox running until the next run on the machine sweeps it.
    marker = f"dapo-orphan-{secrets.token_hex(6)}"
    orphan_uid = UID_BASE + (2**22 << 6)  # a caller pid above pid_max: never alive
    orphan = _sleeper_as(orphan_uid, marker)
    left = Path(tempfile.gettempdir()) / f"{marker}.txt"
    left.write_text("x")
    os.chown(left, orphan_uid, orphan_uid)
    record = {"uid": orphan_uid, "workdir": None, "caller": 2**22 + 1, "caller_start": "1"}
    (markers_dir() / f"{orphan_uid}.json").write_text(json.dumps(record))
    try:
        assert run_python("pass").returncode == 0
        assert orphan.wait(timeout=2) == -signal.SIGKILL and leftovers(marker) == []
        assert not left.exists() and not (markers_dir() / f"{orphan_uid}.json").exists()
    finally:
        _end(orphan)
        left.unlink(missing_ok=True)


@pytest.mark.skipif(not ROOT, reason="needs root (a uid per run)")
def test_processes_and_files_of_a_large_uid_without_a_marker_are_never_touched():
    """Another container's (or namespace's) processes may have uids as large as a run's:
    the cleanup touches only uids that a marker names, never a range."""
    marker = f"dapo-stranger-{secrets.token_hex(6)}"
    stranger_uid = UID_BASE + (2**22 << 6) + 1  # would look orphaned to a uid-range sweep
    stranger = _sleeper_as(stranger_uid, marker)
    theirs = Path(tempfile.gettempdir()) / f"{marker}.txt"
    theirs.write_text("x")
    os.chown(theirs, stranger_uid, stranger_uid)
    try:
        assert run_python("pass").returncode == 0
        assert stranger.poll() is None and leftovers(marker) == [stranger.pid]
        assert theirs.exists()
    finally:
        _end(stranger)
        theirs.unlink(missing_ok=True)


def test_process_alive_tells_a_running_process_from_a_reaped_one():
    """The liveness check of export's stale copies and of a tool helper's trainer watch."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_alive(os.getpid()) and process_alive(child.pid)
        assert process_alive(1)  # init: another user's process when not root
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)  # reaped: its pid names no process
