"""The boot script of a sandboxed run: what the sandbox's interpreter runs before the program.

It applies the kernel's layers (:mod:`dapo.reward.confine`, whose source it is given), drops
``ctypes`` from the modules it loaded for them (so that the program's own import of it meets
the hook), installs the audit hook, then runs the program in a fresh namespace. Any Python
from 3.8 runs it: the sandbox's interpreter may be the system's, not the trainer's.
"""

# Runs in the sandbox's interpreter (any Python >= 3.8) before the program; argv is
# [-c, SOURCE, AUDIT, LANDLOCK_ABI, SECCOMP, CONFINE_SOURCE]. The kernel's layers go on first
# (they need ctypes, which the hook refuses), and a failure there stops the program unrun.
# The hook keeps to string work and calls that audit nothing themselves.
# Refusing to open directories outside the working directory keeps dir_fd tricks out too.
BOOT = r"""
import sys
def _guard(os, root):
    deny = frozenset(("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
        "os.system", "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill",
        "socket.__new__", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "os.symlink",
        "os.link", "resource.prlimit"))
    modules = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "socket", "_socket"))
    paths = {"os.rename": 2, "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1,
        "os.chown": 1, "os.truncate": 1, "os.utime": 1, "os.setxattr": 1,
        "os.removexattr": 1, "os.chflags": 1}
    writing = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    me = str(os.getpid())
    def where(path):
        return os.path.normpath(os.path.join(os.getcwd(), os.fsdecode(path)))
    def inside(path):
        return not isinstance(path, (str, bytes)) or (where(path) + "/").startswith(root + "/")
    def hook(event, args):
        if event in deny:
            raise PermissionError("sandbox: %s is not allowed" % event)
        if event == "import" and args[0].partition(".")[0] in modules:
            raise PermissionError("sandbox: import %s is not allowed" % args[0])
        if event == "open" and isinstance(args[0], (str, bytes)):
            parts = where(args[0]).split("/")
            if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != me:
                raise PermissionError("sandbox: other processes are not readable")
            if not inside(args[0]) and ((args[2] or 0) & writing or os.path.isdir(args[0])):
                raise PermissionError("sandbox: writes outside the working directory")
        elif event in paths and not all(inside(p) for p in args[: paths[event]]):
            raise PermissionError("sandbox: %s outside the working directory" % event)
    sys.addaudithook(hook)
    import posix
    def memfd_create(*args, **kwargs):  # raises no audit event: refused by replacing it
        raise PermissionError("sandbox: os.memfd_create is not allowed")
    for module in (os, posix):
        if hasattr(module, "memfd_create"):
            module.memfd_create = memfd_create
import os
_source, _audit, _landlock, _seccomp, _confine = sys.argv[1:6]
del sys.argv[1:]
if _landlock != "0" or _seccomp == "1":
    _layers = {"__name__": "dapo_confine"}
    try:
        exec(compile(_confine, "<confine>", "exec"), _layers)
        _layers["confine"](int(_landlock), _seccomp == "1", os.getcwd())
    except BaseException as e:
        sys.stderr.write("sandbox: the kernel's confinement failed: %r\n" % (e,))
        os._exit(121)
    del _layers, _confine
    for _name in [n for n in sys.modules if n.partition(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[_name]  # so that the program's own import of ctypes meets the hook
if _audit == "1":
    _guard(os, os.getcwd())
exec(compile(_source, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
