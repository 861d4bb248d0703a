"""The built-in Python tool (``env.class=math_tool``): the model runs code while it reasons.

A model turn that ends by closing a fenced block that opened with `````python`` is a tool call:
the block runs in the code sandbox (:mod:`dapo.reward.sandbox`: the same isolation as the
``code`` task, a short deadline of its own, ``env.tool_wall_s``), and what it printed comes
back as the observation, in an ```` ```output ```` block; the model then goes on. The episode
ends when the model ends its message, and the row's verifier grades the model's text (the
observations left out, so that a tool's output is never graded as the answer).

State is kept across the calls of one response by replay: each call runs every earlier block
of the response first, with its output discarded, then the new one. Variables and functions
defined earlier are there, and a process of its own per call keeps the isolation and the
limits whole; nothing outlives a call, so no process waits between turns and no state can
leak from one response to another. The cost is the earlier blocks' time again, bounded by
``env.max_turns`` and the deadline.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import re
import select
import threading
import time
import tokenize
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from dapo.env.base import Environment, History, Observation
from dapo.reward import sandbox
from dapo.reward.sandbox_runs import process_alive
from dapo.reward.start_method import default_start_method

FENCE = "```"
INSTRUCTION = (
    "You may run Python to compute: write a block that starts with ```python and ends with "
    "```; it is run when the block closes, and what it prints is shown to you in an ```output "
    "block. Then go on."
)
"""Added to the first user message, so that a model that was never shown the tool may use it."""
MAX_OUTPUT_CHARS = 2000
"""A tool's output beyond this is cut (env.max_observation_tokens then bounds the tokens)."""
_OPENING_RE = re.compile(r"```([A-Za-z0-9_+-]*)")
_CLOSING_RE = re.compile(r"(?m)```[ \t]*$")
"""A fence that ends its line closes the block when what comes before it on the line is
blank (a line of its own, as in Markdown) or code with no string left open: ``print(x)```
closes (small models write it), ``fence = "```"`` does not (the model stops at that fence
with ``fence = "`` before it, and the string goes on after it)."""


# Runs the earlier blocks with their output discarded, then the last one; an exception of the
# last block shows its last line only (the type and message), as a notebook's cell would.
_PROGRAM = """\
import contextlib, io, sys, traceback
blocks = {blocks!r}
scope = {{"__name__": "__main__"}}
for block in blocks[:-1]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            exec(compile(block, "<cell>", "exec"), scope)
        except BaseException:
            pass
try:
    exec(compile(blocks[-1], "<cell>", "exec"), scope)
except BaseException as exc:
    sys.stdout.flush()
    print("".join(traceback.format_exception_only(type(exc), exc)).strip(), file=sys.stderr)
    sys.exit(1)
"""


def python_blocks(text: str) -> tuple[list[str], bool]:
    """The closed ```python blocks of ``text``, in order, and whether ``text`` ends (but for
    whitespace) with the closing fence of the last of them: a tool call."""
    blocks, ends_with_call, at = [], False, 0
    while opening := _OPENING_RE.search(text, at):
        closing = _closing_fence(text, opening.end())
        if closing is None:  # an opened block is not closed yet
            return blocks, False
        code_end, at = closing
        if opening.group(1) == "python":
            blocks.append(text[opening.end() : code_end].strip("\n"))
        ends_with_call = opening.group(1) == "python" and at >= len(text.rstrip())
    return blocks, ends_with_call


def _closing_fence(text: str, start: int) -> tuple[int, int] | None:
    """Where the first fence after ``start`` that closes a block (:data:`_CLOSING_RE`) is:
    (the end of the code before it, the end of the fence's line)."""
    for fence in _CLOSING_RE.finditer(text, start):
        line_start = max(start, text.rfind("\n", start, fence.start()) + 1)
        line = text[line_start : fence.start()]
        if not line.strip():
            return line_start, fence.end()
        if not _leaves_a_string_open(line):
            return line_start + len(line.rstrip(" \t")), fence.end()
    return None


def _leaves_a_string_open(code: str) -> bool:
    """Whether ``code`` (one line) ends inside a string literal or a bracket."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code + "\n").readline))
    except (tokenize.TokenError, SyntaxError):  # Python >= 3.12: an open string raises
        return True
    return any(t.type == tokenize.ERRORTOKEN and t.string[:1] in "\"'" for t in tokens)


def output_block(stdout: str, stderr: str, note: str = "") -> str:
    """The observation: what the code printed (stdout, then stderr), cut to
    ``MAX_OUTPUT_CHARS``, in an output block."""
    text = (stdout + stderr).strip("\n") + (f"\n{note}" if note else "")
    if len(text) > MAX_OUTPUT_CHARS:
        text = text[:MAX_OUTPUT_CHARS] + "\n... (output cut)"
    return f"\n```output\n{text}\n```\n"


def _exit_with(trainer: int) -> None:
    """A helper's initializer: exit as soon as the process that made it (``trainer``) is
    gone, killed with -9 too. A helper's parent is the forkserver, which outlives the trainer
    while a helper holds its pipe, and the helper waits on its task queue forever: it would
    keep the trainer's stdout and stderr open, and its sandbox runs alive."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(trainer)  # readable once the process has ended
        except OSError:  # already gone, or a kernel without pidfd: poll
            while process_alive(trainer):
                time.sleep(0.5)
        else:
            select.select([fd], [], [])
        os._exit(0)  # its sandbox run, if any, dies with it

    threading.Thread(target=watch, name="dapo-tool-watch", daemon=True).start()


class Launcher:
    """Starts sandbox runs from small helper processes (a forkserver's children, made once):
    forked from the trainer, whose address space holds the model, each run's process took 3x
    as long to start (100 ms against 37, a 1.2 GB parent), all of it system time."""

    def __init__(self, workers: int) -> None:
        self.workers, self._pool, self._lock = workers, None, threading.Lock()

    def run(self, source: str, limits: sandbox.SandboxLimits, mode: str) -> sandbox.RunResult:
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context(default_start_method())
                self._pool = ProcessPoolExecutor(
                    self.workers,
                    mp_context=context,
                    initializer=_exit_with,
                    initargs=(os.getpid(),),
                )
            pool = self._pool
        try:
            return self._submit(pool, source, limits, mode).result()
        except BrokenProcessPool:
            self._drop(pool)
            raise OSError("a helper process of the tool died") from None

    def _submit(
        self, pool: ProcessPoolExecutor, source: str, limits: sandbox.SandboxLimits, mode: str
    ) -> Future:
        try:
            return pool.submit(sandbox.run_python, source, limits=limits, mode=mode)
        except BrokenProcessPool:
            raise
        except RuntimeError:
            with self._lock:
                closed = self._pool is not pool
            if closed:  # shut down since it was taken: a call that raced the run's end
                raise OSError("the tool was closed: the run is ending") from None
            self._drop(pool)  # its own failure (a thread it could not start): raised as it is
            raise

    def _drop(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None  # the next call starts new helpers

    def close(self) -> None:
        """Stop the helpers; a call in flight ends first (within its deadline), and the next
        call starts new ones. Left to the interpreter's exit instead, the pool could hang it:
        Python 3.11 wakes each pool's manager thread there without a lock against the pipe's
        closing (CPython gh-125451, fixed in 3.12 and 3.13), and one error skips the joins,
        leaving a thread that the exit then waits for forever."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            # No cancel_futures: a shutdown after a cancelled call has hung in CPython
            # (gh-94440), and no call waits in the queue (env.workers threads make at most as
            # many calls at once as the pool has helpers).
            pool.shutdown(wait=True)


class MathTool(Environment):
    """A Python tool for math: see the module's docstring."""

    turn_ends = (FENCE,)

    def __init__(self, settings: Any = None) -> None:
        wall_s = getattr(settings, "tool_wall_s", 3.0)
        memory_mb = getattr(settings, "tool_memory_mb", 512)
        self.mode = sandbox.pick_mode(getattr(settings, "tool_sandbox", "auto"))
        self.launcher = Launcher(getattr(settings, "workers", 4))
        self.limits = sandbox.SandboxLimits(
            wall_s=wall_s, cpu_s=max(1.0, wall_s - 0.5), memory_mb=memory_mb
        )
        self.instruction = INSTRUCTION if getattr(settings, "tool_instruction", True) else ""

    def close(self) -> None:
        self.launcher.close()

    def messages(self, problem) -> list[dict[str, str]]:
        messages = [dict(m) for m in problem.messages]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if self.instruction and users:
            first = messages[users[0]]
            first["content"] = f"{first['content']}\n\n{self.instruction}"
        return messages

    def step(self, history: History) -> Observation:
        if history.finished:
            return Observation(done=True)
        blocks, call = python_blocks(history.model_text)
        if not call:
            return Observation()  # a fence that opens or closes another block: go on
        return self.run(blocks)

    def run(self, blocks: list[str]) -> Observation:
        """Run ``blocks`` (the last one's output shown) in the sandbox."""
        start = time.monotonic()
        source = _PROGRAM.format(blocks=blocks)
        try:
            result = self.launcher.run(source, self.limits, self.mode)
        except (ValueError, OSError) as exc:  # a source over the size limit; no process
            return Observation(output_block("", f"not run: {exc}"), tool_call=True, error=True)
        seconds = time.monotonic() - start
        note = ""
        if result.timed_out:
            note = f"(stopped: the code ran past {self.limits.wall_s:g} s)"
        elif result.output_exceeded:
            note = "(stopped: the code printed too much)"
        elif result.disk_exceeded:
            note = (
                f"(stopped: the code wrote more than {self.limits.tmp_bytes // 2**20} MiB of files)"
            )
        elif result.returncode not in (0, 1):
            note = f"(stopped: exit status {result.returncode}; a limit was hit)"
        text = output_block(
            result.stdout.decode("utf-8", "replace"), result.stderr.decode("utf-8", "replace"), note
        )
        error = result.returncode != 0 or result.timed_out or result.output_exceeded
        return Observation(text, tool_call=True, error=error, seconds=seconds)
