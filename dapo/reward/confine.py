"""The kernel's own limits on a sandboxed program: Landlock and a seccomp filter.

The sandbox (:mod:`dapo.reward.sandbox`) sends this file's source to the sandboxed interpreter,
which runs :func:`confine` before the program: its limits then hold for the program and for
anything it starts, whatever it does in Python (the audit hook is defence in depth; these are
the boundary the kernel enforces). Neither needs root nor namespaces: they hold in every
mode, ``process`` included, wherever the kernel offers them.

- **Landlock** (Linux 5.13 and later): the program may write only inside its working
  directory; it may read the system's programs and libraries, ``/etc``, its interpreter's
  own tree and its own ``/proc/PID``, and nothing else: not the user's home, not other
  processes' ``/proc``. From Landlock ABI 4 it may neither bind nor connect a TCP port, and
  from ABI 6 it may signal no process outside its domain and reach no abstract UNIX socket
  outside it.
- **seccomp** (x86-64 and AArch64): no socket but ``AF_UNIX``, no new process (threads only:
  ``clone`` without ``CLONE_THREAD``, ``fork``, ``vfork`` and ``execve`` fail), no signal to a
  process but itself or its own process group, no change to another process's limits, CPU
  affinity, scheduling, priority or pages (``prlimit64``, ``sched_setaffinity``,
  ``setpriority``...: without root the program has the trainer's uid), no ``ptrace``, ``kcmp``
  or reading another process's memory, no mount, namespace, BPF, key ring, kernel module or
  reboot calls, no io_uring (whose ``IORING_OP_SOCKET`` makes a socket without the ``socket``
  call), no ``memfd_create`` (a memory file's pages are in no address space, no tmpfs and no
  working directory: they would escape ``RLIMIT_AS``, ``tmp_bytes`` and the disk poll). A
  syscall of another ABI (x86's 32-bit ``int 0x80``) kills the process.

Both need ``PR_SET_NO_NEW_PRIVS``, which :func:`confine` sets first. Pure standard library,
for any Python from 3.8: the sandboxed interpreter may be the system's, not the trainer's.
"""

import ctypes
import os
import platform
import struct
import sys

LANDLOCK_CREATE_RULESET_VERSION = 1
_SYS = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # every architecture
_FS_READ = (1 << 0) | (1 << 2) | (1 << 3)  # EXECUTE, READ_FILE, READ_DIR
_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)  # those a file may have


def _fs_rights(abi):
    """Every file-system right Landlock ABI ``abi`` knows (so every one is restricted)."""
    rights = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        rights |= 1 << 13  # REFER
    if abi >= 3:
        rights |= 1 << 14  # TRUNCATE
    if abi >= 5:
        rights |= 1 << 15  # IOCTL_DEV
    return rights


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    return libc


def offered():
    """(the Landlock ABI the kernel offers, 0 for none; whether a seccomp filter is written
    for this machine and the kernel takes one)."""
    if not sys.platform.startswith("linux"):
        return 0, False
    seccomp = seccomp_arch() is not None and _libc().prctl(21, 0, 0, 0, 0) >= 0  # GET_SECCOMP
    return landlock_abi(), seccomp


def landlock_abi():
    """The Landlock ABI version the kernel offers; 0 without Landlock."""
    libc = _libc()
    abi = libc.syscall(
        _SYS["create_ruleset"], None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    return max(int(abi), 0)


def _readable_roots():
    """What a program may read: the system's programs, libraries and settings, its
    interpreter's tree (which may live in a home directory), its own /proc entry."""
    roots = ["/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc"]
    for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        roots.append(prefix)
    roots.append(os.path.dirname(os.path.realpath(sys.executable)))
    roots.append(f"/proc/{os.getpid()}")
    return [r for r in dict.fromkeys(roots) if r and os.path.exists(r)]


def _add_rule(libc, ruleset, path, rights):
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS
        attr = struct.pack("=Qi", rights, fd)  # landlock_path_beneath_attr, packed
        buf = ctypes.create_string_buffer(attr, len(attr))
        if libc.syscall(_SYS["add_rule"], ruleset, 1, buf, 0) != 0:  # PATH_BENEATH
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
    finally:
        os.close(fd)


def apply_landlock(abi, workdir):
    """Restrict this process (and what it starts) as the module docstring says."""
    libc = _libc()
    handled = _fs_rights(abi)
    fields = [handled]
    if abi >= 4:
        fields.append((1 << 0) | (1 << 1))  # handled_access_net: BIND_TCP, CONNECT_TCP
    if abi >= 6:
        fields.append((1 << 0) | (1 << 1))  # scoped: ABSTRACT_UNIX_SOCKET, SIGNAL
    attr = struct.pack(f"={len(fields)}Q", *fields)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(_SYS["create_ruleset"], buf, ctypes.c_size_t(len(attr)), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for root in _readable_roots():
            _add_rule(libc, ruleset, root, _FS_READ)
        for device in ("/dev/null", "/dev/zero", "/dev/urandom"):
            if os.path.exists(device):
                _add_rule(libc, ruleset, device, (1 << 1) | (1 << 2))  # WRITE_FILE, READ_FILE
        _add_rule(libc, ruleset, workdir, handled)
        if libc.syscall(_SYS["restrict_self"], ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)


# --------------------------------------------------------------------------------- seccomp

_ARCH = {  # machine -> (AUDIT_ARCH_*, syscall numbers)
    "x86_64": (
        0xC000003E,
        dict(
            socket=41, socketpair=53, clone=56, fork=57, vfork=58, execve=59, kill=62,
            ptrace=101, rt_sigqueueinfo=129, tkill=200, tgkill=234, rt_tgsigqueueinfo=297,
            execveat=322, clone3=435, pidfd_send_signal=424, pidfd_open=434, pidfd_getfd=438,
            process_vm_readv=310, process_vm_writev=311, mount=165, umount2=166,
            pivot_root=155, chroot=161, unshare=272, setns=308, bpf=321, perf_event_open=298,
            keyctl=250, add_key=248, request_key=249, init_module=175, finit_module=313,
            delete_module=176, kexec_load=246, kexec_file_load=320, reboot=169, swapon=167,
            swapoff=168, iopl=172, ioperm=173, userfaultfd=323, open_by_handle_at=304,
            name_to_handle_at=303, quotactl=179, mount_setattr=442, move_mount=429,
            open_tree=428, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
            io_uring_setup=425, io_uring_enter=426, io_uring_register=427, memfd_create=319,
            prlimit64=302, sched_setaffinity=203, sched_setparam=142, sched_setscheduler=144,
            sched_setattr=314, setpriority=141, ioprio_set=251, migrate_pages=256,
            move_pages=279, kcmp=312,
        ),
    ),
    "aarch64": (
        0xC00000B7,
        dict(
            socket=198, socketpair=199, clone=220, execve=221, kill=129, ptrace=117,
            rt_sigqueueinfo=138, tkill=130, tgkill=131, rt_tgsigqueueinfo=240, execveat=281,
            clone3=435, pidfd_send_signal=424, pidfd_open=434, pidfd_getfd=438,
            process_vm_readv=270, process_vm_writev=271, mount=40, umount2=39, pivot_root=41,
            chroot=51, unshare=97, setns=268, bpf=280, perf_event_open=241, keyctl=219,
            add_key=217, request_key=218, init_module=105, finit_module=273,
            delete_module=106, kexec_load=104, kexec_file_load=294, reboot=142, swapon=224,
            swapoff=225, userfaultfd=282, open_by_handle_at=265, name_to_handle_at=264,
            quotactl=60, mount_setattr=442, move_mount=429, open_tree=428, fsopen=430,
            fsconfig=431, fsmount=432, fspick=433, io_uring_setup=425, io_uring_enter=426,
            io_uring_register=427, memfd_create=279, prlimit64=261, sched_setaffinity=122,
            sched_setparam=118, sched_setscheduler=119, sched_setattr=274, setpriority=140,
            ioprio_set=30, migrate_pages=238, move_pages=239, kcmp=272,
        ),
    ),
}  # fmt: skip
_ALLOW, _KILL = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
_EPERM, _ENOSYS = 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ERRNO | errno
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, RET
_NR, _ARCH_OFFSET, _ARG0, _ARG1 = 0, 4, 16, 24  # offsets in struct seccomp_data (low 32 bits)
_AF_UNIX, _CLONE_THREAD = 1, 0x10000
_DENIED = (
    "fork", "vfork", "execve", "execveat", "ptrace", "pidfd_send_signal", "pidfd_open",
    "pidfd_getfd", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root",
    "chroot", "unshare", "setns", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "iopl", "ioperm", "userfaultfd", "open_by_handle_at",
    "name_to_handle_at", "quotactl", "mount_setattr", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "memfd_create", "kcmp",
)  # fmt: skip
# Calls that change another process named by pid (0: the caller). Without root the program
# keeps the trainer's uid, and the kernel lets it cap the trainer's CPU time (prlimit64: then
# SIGKILL), pin or deprioritise it: allowed on the program itself only, by 0 or its pid. A
# thread named by its own thread id is refused too (a filter cannot tell a thread of the
# program from another process); a thread changes its own affinity or priority with 0.
_OWN_PID = (
    "prlimit64", "sched_setaffinity", "sched_setparam", "sched_setscheduler", "sched_setattr",
    "migrate_pages", "move_pages",
)  # fmt: skip


def seccomp_arch():
    """(AUDIT_ARCH, syscall numbers) of this machine, or None where no filter is written."""
    return _ARCH.get(platform.machine())


def _program(arch, numbers, pid, pgid):
    """The filter as (code, jt, jf, k) instructions. Jumps name labels; ``_assemble`` turns
    them into offsets. Each checked syscall jumps to a block that decides on its arguments."""
    code = [(_LD, None, None, _ARCH_OFFSET), (_JEQ, None, "die", arch), (_LD, None, None, _NR)]
    if arch == _ARCH["x86_64"][0]:
        code.append((_JGE, "deny", None, 0x40000000))  # the x32 ABI's numbers
    blocks = {
        "socket": [(_LD, None, None, _ARG0), (_JEQ, "allow", "deny", _AF_UNIX)],
        "clone": [(_LD, None, None, _ARG0), (_JSET, "allow", "deny", _CLONE_THREAD)],
        "clone3": [(_RET, None, None, _ENOSYS)],  # libc falls back to clone
        "signal": [
            (_LD, None, None, _ARG0),
            (_JEQ, "allow", None, 0),
            (_JEQ, "allow", None, pid),
            (_JEQ, "allow", "deny", (-pgid) & 0xFFFFFFFF),
        ],
        "self": [(_LD, None, None, _ARG0), (_JEQ, "allow", "deny", pid)],
        "own": [(_LD, None, None, _ARG0), (_JEQ, "allow", None, 0), (_JEQ, "allow", "deny", pid)],
        # which (arg 0) must be one process, PRIO_PROCESS or IOPRIO_WHO_PROCESS; then who.
        "priority": [(_LD, None, None, _ARG0), (_JEQ, "who", "deny", 0)],
        "ioprio": [(_LD, None, None, _ARG0), (_JEQ, "who", "deny", 1)],
        "who": [(_LD, None, None, _ARG1), (_JEQ, "allow", None, 0), (_JEQ, "allow", "deny", pid)],
    }
    route = {"socket": "socket", "socketpair": "socket", "clone": "clone", "clone3": "clone3"}
    route.update(kill="signal", rt_sigqueueinfo="signal", tkill="self", tgkill="self")
    route.update(rt_tgsigqueueinfo="self", setpriority="priority", ioprio_set="ioprio")
    route.update((name, "own") for name in _OWN_PID)
    route.update((name, "deny") for name in _DENIED)
    for name, target in route.items():
        if name in numbers:
            code.append((_JEQ, target, None, numbers[name]))
    code.append((_RET, None, None, _ALLOW))
    labels = {"allow": [(_RET, None, None, _ALLOW)], "deny": [(_RET, None, None, _EPERM)]}
    labels["die"] = [(_RET, None, None, _KILL)]
    return code, {**blocks, **labels}


def _assemble(code, blocks):
    """Lay out ``code`` then each block, and resolve label jumps (None: the next one)."""
    out, at = list(code), {}
    for name, block in blocks.items():
        at[name] = len(out)
        out.extend(block)
    packed = []
    for i, (op, jt, jf, k) in enumerate(out):
        offsets = [0 if j is None else at[j] - (i + 1) for j in (jt, jf)]
        if not all(0 <= o < 256 for o in offsets):
            raise ValueError("seccomp filter jump out of range")
        packed.append(struct.pack("HBBI", op, offsets[0], offsets[1], k & 0xFFFFFFFF))
    return b"".join(packed)


def apply_seccomp():
    """Install the filter on this process (inherited by its threads and children)."""
    arch, numbers = seccomp_arch()
    code, blocks = _program(arch, numbers, os.getpid(), os.getpgid(0))
    program = _assemble(code, blocks)
    filters = ctypes.create_string_buffer(program, len(program))
    prog = struct.pack("HxxxxxxP", len(program) // 8, ctypes.addressof(filters))
    fprog = ctypes.create_string_buffer(prog, len(prog))
    if _libc().prctl(22, 2, fprog, 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "seccomp")


def confine(landlock, seccomp, workdir):
    """Apply the layers asked for (``landlock``: the ABI to use, 0 for none): the caller
    asks only for what the kernel offers, so a failure here stops the program unrun."""
    if _libc().prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS (the caller's may be lost)
        raise OSError(ctypes.get_errno(), "no_new_privs")
    if landlock:
        apply_landlock(landlock, workdir)
    if seccomp:
        apply_seccomp()
