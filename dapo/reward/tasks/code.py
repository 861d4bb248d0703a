"""The ``code`` task: run the response's program, then the row's tests, in a sandbox.

A row's ``reward_model.ground_truth`` is a JSON object in a string::

    {"entry_point": "add", "tests": "assert add(2, 3) == 5", "prelude": "import math"}

``entry_point`` (an identifier) and ``tests`` (Python source) are required; ``prelude``
(source run before the program, e.g. the ``from typing import List`` a HumanEval prompt
declares) is optional; other keys are ignored. A ground truth that is not such an object is
graded incorrect with an empty ``pred`` (``NO_ANSWER``), like a math row without an answer.

The program is the last fenced block tagged ``python``, ``py`` or ``python3`` in the
response; without one, the last untagged fence (a bare ```` ``` ````); without either, the
whole response. Blocks tagged with another language are never run, and a block left
unclosed at the end of the response counts. Programs over ``MAX_PROGRAM_BYTES`` are not run.

Grading (:func:`grade_code`) runs one sandboxed process (:mod:`dapo.reward.sandbox`) whose
harness executes, in one namespace (``__name__`` is ``"solution"``, so a ``__main__`` block
of the program does not run): the prelude, the program, then the tests. If the tests define
a ``check`` function (the HumanEval convention) and never call it at their top level, the
harness calls ``check(entry_point)`` after them; dapo's HumanEval rows call it themselves.
Builtins are restored between the program and the tests, so a program cannot patch ``len``
or ``print`` under the tests, and the tests' own definitions replace any the program made.
The response is correct only if the process exits 0 *and* the last line of its stdout is a
nonce (``secrets.token_hex``) that the harness prints after the last test: a program that
exits early (``sys.exit``, ``SystemExit``, ``os._exit(0)``), or raises, or is killed, fails.

The nonce reaches the harness on stdin, which it reads to the end and replaces with an empty
stream before the program starts (so ``input()`` sees end of file); it is then held only in
a local variable of the harness. What it cannot stop: a program written against this harness
that walks up the interpreter's frames (``sys._getframe(1).f_locals``) to read it, then
prints it and exits. The program and the harness share one interpreter, so no secret in it
is out of reach; the nonce stops every ordinary way of ending before the tests do. Nor can
it stop a function that returns an object whose ``__eq__`` always answers True: the grader
checks what the tests check.

``Score.pred`` is the outcome: ``passed``, ``failed`` (a test failed), ``error`` (the
program raised, SyntaxError included), ``memory`` (MemoryError), ``no_entry_point``,
``exited_early`` (exit status 0 without the nonce), ``killed`` (a signal or another exit
status), ``timeout``, ``output_limit``, ``disk_limit``, ``no_code``, ``too_long``. An
outcome is not an answer, so no response votes (``vote=""``): a majority of labels would
read as maj@k without being one, and evaluations of code leave maj@k out.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import secrets
import textwrap
from dataclasses import dataclass
from typing import Literal

from dapo.reward.sandbox import RunResult, SandboxLimits, run_python
from dapo.reward.tasks.base import NO_ANSWER, RewardFn, Score, Task, ground_truth_text

__all__ = [
    "HARNESS",
    "MAX_PROGRAM_BYTES",
    "TASKS",
    "CodeConfig",
    "CodeSettings",
    "extract_code",
    "grade_code",
    "verify_code",
]

MAX_PROGRAM_BYTES = 64 * 1024
"""Programs longer than this (UTF-8) are graded ``too_long`` without running."""

_PYTHON_TAGS = frozenset({"python", "py", "python3"})

# Runs inside the sandbox. Everything it needs is bound to locals before the program runs,
# so a program that rebinds os.write, exec or builtins does not change what the harness does.
# Exit statuses: 0 passed (then the nonce), 1 a test failed, 2 the program raised,
# 3 no entry point, 4 MemoryError.
HARNESS = r"""
def _harness():
    import builtins, json, os, sys, traceback
    payload = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    sys.stdin = open(os.devnull)
    write, flush, exit_, compile_, exec_ = os.write, sys.stdout.flush, os._exit, compile, exec
    callable_, saved, nonce = callable, dict(builtins.__dict__), payload.pop("nonce").encode()
    namespace = {"__name__": "solution", "__builtins__": builtins}
    def fail(status):
        try:
            traceback.print_exc(limit=-3)
            sys.stderr.flush()
        finally:
            exit_(status)
    try:
        exec_(compile_(payload["prelude"], "<prelude>", "exec"), namespace)
        exec_(compile_(payload["program"], "<solution>", "exec"), namespace)
    except MemoryError:
        exit_(4)
    except BaseException:
        fail(2)
    builtins.__dict__.clear()
    builtins.__dict__.update(saved)
    namespace["__builtins__"] = builtins
    entry = namespace.get(payload["entry_point"])
    if not callable_(entry):
        exit_(3)
    before = namespace.get("check")
    try:
        exec_(compile_(payload["tests"], "<tests>", "exec"), namespace)
        check = namespace.get("check")
        if payload["call_check"] and check is not before and callable_(check):
            check(entry)
        flush()
        sys.stdout.flush()
    except BaseException:
        fail(1)
    write(1, b"\n" + nonce + b"\n")
    exit_(0)
_harness()
"""

_EXIT_WORDS = {1: "failed", 2: "error", 3: "no_entry_point", 4: "memory"}


def _fences(response: str) -> list[tuple[str, list[str]]]:
    """Every fenced block as (language tag, lines); a scan of lines, linear in the text."""
    blocks: list[tuple[str, list[str]]] = []
    body: list[str] | None = None
    for line in response.splitlines():
        stripped = line.strip()
        if body is None:
            if stripped.startswith("```"):
                tag = stripped[3:].split(maxsplit=1)
                body = []
                blocks.append((tag[0].lower() if tag else "", body))
        elif stripped == "```":
            body = None
        else:
            body.append(line)
    return blocks


def extract_code(response: str) -> str:
    """The program in ``response``: the last ``python``/``py``/``python3`` fence, else the
    last untagged fence, else the whole response (dedented; see the module docstring).

    Example:
        >>> extract_code("Try:\\n```python\\nx = 1\\n```\\nor\\n```py\\nx = 2\\n```")
        'x = 2'
    """
    blocks = _fences(response)
    tagged = [lines for tag, lines in blocks if tag in _PYTHON_TAGS]
    bare = [lines for tag, lines in blocks if tag == ""]
    chosen = tagged or bare
    if not chosen:
        return response
    return textwrap.dedent("\n".join(chosen[-1]))


def _parse_ground_truth(response: object, ground_truth: object) -> dict[str, str] | None:
    text = ground_truth_text(response, ground_truth)
    if text is None:
        return None
    try:
        row = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(row, dict):
        return None
    entry, tests, prelude = row.get("entry_point"), row.get("tests"), row.get("prelude", "")
    if not (isinstance(entry, str) and entry.isidentifier() and isinstance(tests, str)):
        return None
    if not isinstance(prelude, str) or not tests.strip():
        return None
    return {"entry_point": entry, "tests": tests, "prelude": prelude}


def check_truth(ground_truth: str) -> str | None:
    """Why ``ground_truth`` is not a gradable code row (see the module docstring), or None."""
    try:
        row = json.loads(ground_truth)
    except (ValueError, RecursionError):
        return 'not JSON: expected {"entry_point": NAME, "tests": CODE}'
    if not isinstance(row, dict):
        return f'a JSON {type(row).__name__}, not an object {{"entry_point": ..., "tests": ...}}'
    entry, tests, prelude = row.get("entry_point"), row.get("tests"), row.get("prelude", "")
    if not (isinstance(entry, str) and entry.isidentifier()):
        return f"entry_point must be a Python identifier, got {entry!r}"
    if not isinstance(tests, str) or not tests.strip():
        return "tests must be non-empty Python code (a string)"
    if not isinstance(prelude, str):
        return "prelude, when given, must be Python code (a string)"
    for part, code in (("tests", tests), ("prelude", prelude)):
        try:
            ast.parse(code)
        except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
            where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            verb = "do" if part == "tests" else "does"
            return f"{part} {verb} not parse as Python{where}: {getattr(e, 'msg', e)}"
    return None


@functools.lru_cache(maxsize=256)
def _calls_check(tests: str) -> bool:
    """Whether ``tests`` call ``check(...)`` at their top level (dapo's HumanEval rows do)."""
    try:
        body = ast.parse(tests).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False  # the harness reports the broken tests
    calls = (n.value for n in body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call))
    return any(isinstance(c.func, ast.Name) and c.func.id == "check" for c in calls)


# SIGKILL as each mode reports it: process mode's -9, bwrap's 128 + 9; util-linux's unshare
# cannot re-raise SIGKILL on itself, so it exits 1 saying so on stderr.
_SIGKILLED = (-9, 128 + 9)
_UNSHARE_SIGKILLED = b"unshare: sigprocmask unblock failed"


def _exit_status(result: RunResult) -> int:
    """The run's exit status, unshare's SIGKILL read as bwrap's (137)."""
    if result.returncode == 1 and result.stderr.startswith(_UNSHARE_SIGKILLED):
        return 128 + 9
    return result.returncode


def _cpu_limit_ended_a_loop(result: RunResult, limits: SandboxLimits) -> bool:
    """Whether SIGKILL came after at least ``cpu_s`` on the wall clock: the CPU limit ended
    a busy loop (one thread spends no more CPU time than wall time), which is graded
    "timeout" as if the wall clock had ended it; threads that spend it faster are "killed"."""
    killed = _exit_status(result) in _SIGKILLED
    return killed and result.elapsed_s >= math.ceil(limits.cpu_s)


def _outcome(returncode: int, stdout: bytes, nonce: str) -> str:
    if returncode == 0:
        lines = stdout.rstrip(b"\n").split(b"\n")
        return "passed" if lines[-1] == nonce.encode() else "exited_early"
    return _EXIT_WORDS.get(returncode, "killed")


def grade_code(
    response: str,
    ground_truth: str,
    *,
    limits: SandboxLimits = SandboxLimits(),  # noqa: B008 - frozen, shared safely
    mode: str = "auto",
) -> Score:
    """Grade ``response`` against a ``code`` row's ground truth in a sandbox of ``mode``.

    Never raises on any response or ground truth. It raises only when this machine cannot
    run the sandbox at all (``SandboxUnavailable``, naming the fix) or start a process: the
    reward pool reports that as a fault, where grading every response wrong would hide it.

    Example:
        >>> truth = '{"entry_point": "add", "tests": "assert add(2, 3) == 5"}'
        >>> grade_code("```python\\ndef add(a, b):\\n    return a + b\\n```", truth)
        Score(score=1.0, correct=True, pred='passed', vote='')
    """
    row = _parse_ground_truth(response, ground_truth)
    if row is None:
        return NO_ANSWER
    program = extract_code(response)
    if not program.strip():
        return Score(score=-1.0, correct=False, pred="no_code", vote="")
    if len(program.encode("utf-8", "surrogatepass")) > MAX_PROGRAM_BYTES:
        return Score(score=-1.0, correct=False, pred="too_long", vote="")
    nonce = secrets.token_hex(16)
    # ensure_ascii: lone surrogates and NULs travel as escapes, and come back as written.
    payload = {**row, "program": program, "nonce": nonce}
    payload["call_check"] = not _calls_check(row["tests"])
    stdin = json.dumps(payload).encode("ascii")
    result = run_python(HARNESS, stdin=stdin, limits=limits, mode=mode)
    if result.timed_out:
        pred = "timeout"
    elif result.output_exceeded:
        pred = "output_limit"
    elif result.disk_exceeded:
        pred = "disk_limit"
    elif _cpu_limit_ended_a_loop(result, limits):
        pred = "timeout"
    else:
        pred = _outcome(_exit_status(result), result.stdout, nonce)
    correct = pred == "passed"
    return Score(score=1.0 if correct else -1.0, correct=correct, pred=pred, vote="")


@dataclass
class CodeConfig:
    """The ``code`` section: the sandbox of the ``code`` task (docs/guides/code-sandbox.md)."""

    sandbox: Literal["auto", "bwrap", "unshare", "process"] = "auto"
    """Isolation: bwrap (namespaces, read-only file system), unshare (network and PID
    namespaces), process (no namespaces: only when asked for by name, with a warning); auto =
    the strongest of bwrap and unshare that works here. Every mode adds Landlock and a
    seccomp filter where the kernel has them. A mode this machine lacks stops the run before
    any model loads, naming the fix."""
    wall_s: float = 5.0
    """Seconds one program and its tests may run; below reward.timeout_s."""
    memory_mb: int = 512
    """Address space of the program's process, MiB."""

    def check(self) -> list[str]:
        errors = []
        if not self.wall_s > 0 or self.memory_mb < 64:
            errors.append("code.wall_s must be > 0 and code.memory_mb >= 64")
        return errors

    def limits(self) -> SandboxLimits:
        cpu_s = max(1.0, self.wall_s - 1.0)  # a busy loop stopped here is graded "timeout"
        return SandboxLimits(wall_s=self.wall_s, cpu_s=cpu_s, memory_mb=self.memory_mb)

    def is_default(self) -> bool:
        return self == CodeConfig()


class CodeSettings:
    """A reward pool's ``resolve`` that grades ``code`` rows with these settings and every
    other row with its task's verifier (picklable: it travels to the workers)."""

    def __init__(self, config: CodeConfig) -> None:
        self.mode, self.limits = config.sandbox, config.limits()

    def __call__(self, name: str) -> RewardFn:
        from dapo.reward.tasks import get_task  # the registry imports this module

        task = get_task(name)
        if task.name != "code":
            return task.verify
        return functools.partial(grade_code, limits=self.limits, mode=self.mode)


def verify_code(response: str, ground_truth: str) -> Score:
    """:func:`grade_code` with the default limits in the strongest sandbox mode available."""
    return grade_code(response, ground_truth)


TASKS = (
    Task(
        "code",
        verify_code,
        "Python programs: the response's last ```python block, then the row's tests, run in "
        "a sandbox; correct only if every test ran and passed",
        check_truth=check_truth,
    ),
)
