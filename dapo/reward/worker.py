"""The worker side of :mod:`dapo.reward.pool`: grade one response, reduce the verdict (or
the failure) to primitives, and serve chunks of jobs under an address-space limit.

Only the standard library and :mod:`dapo.reward.tasks` are imported, so a worker loads no torch.
"""

from __future__ import annotations

import contextlib
import io
import math
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from dapo.data.limits import limit_address_space
from dapo.reward.jobs import MAX_ABS_SCORE
from dapo.reward.tasks import RewardFn, Score

# Results cross a pipe once per response: keep them small whatever a verifier returns.
MAX_PRED_CHARS = 1000
MAX_DETAIL_CHARS = 300
MAX_OUTPUT_CHARS = 4096  # what grading one response may print and have kept


class CappedText(io.TextIOBase):
    """A text stream that keeps the first ``limit`` characters written since the last
    :meth:`take` and counts the rest: a verifier's ``print`` never floods the log."""

    def __init__(self, limit: int = MAX_OUTPUT_CHARS) -> None:
        self.limit, self.parts, self.size, self.dropped = limit, [], 0, 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # as a real text stream: the verifier's error, not ours
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        keep = text[: max(0, self.limit - self.size)]
        self.parts.append(keep)
        self.size += len(keep)
        self.dropped += len(text) - len(keep)
        return len(text)

    def take(self) -> tuple[str, int]:
        """(what was kept, how many characters were dropped) since the last take."""
        text, dropped = "".join(self.parts), self.dropped
        self.parts, self.size, self.dropped = [], 0, 0
        return text, dropped


class _ByThread:
    """A standard stream that sends what a grading thread writes to that thread's sink and
    what any other thread writes to the stream it stands in for: grading in the trainer's
    process (``reward.workers=0``, a generator thread's pool) must not swallow the lines the
    main thread prints meanwhile, as a process-wide redirect did."""

    def __init__(self, original: Any) -> None:
        self._original = original

    def _target(self) -> Any:
        return _SINKS.get(threading.get_ident(), self._original)

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)


_SINKS: dict[int, CappedText] = {}
"""The sink of each thread grading now, by thread id; the streams stand in while any does."""
_ROUTING = threading.Lock()
_ORIGINALS: list[Any] = []


def captured(sink: CappedText, grade: Callable[[], Outcome]) -> Outcome:
    """``grade()`` with what this thread writes to Python's standard output and error going
    to ``sink``; other threads' writes reach the streams as before."""
    me = threading.get_ident()
    with _ROUTING:
        if not _SINKS:
            _ORIGINALS[:] = [sys.stdout, sys.stderr]
            sys.stdout, sys.stderr = _ByThread(sys.stdout), _ByThread(sys.stderr)
        _SINKS[me] = sink
    try:
        return grade()
    finally:
        with _ROUTING:
            del _SINKS[me]
            if not _SINKS:
                sys.stdout, sys.stderr = _ORIGINALS


def one_line(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    # Details end up in log lines and metrics: one line, bounded however long or
    # multi-line an exception message (which may quote the response) is.
    flat = " ".join(text[: 4 * limit].split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def is_bool(value: Any) -> bool:
    """Whether ``value`` is a bool: Python's or numpy's (``numpy.bool_``, told by its type's
    module and name, so that numpy need not be imported)."""
    kind = type(value)
    numpy_bool = kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")
    return isinstance(value, bool) or numpy_bool


def type_name(value: Any) -> str:
    """``value``'s type for a message, with its module unless a builtin: ``str``,
    ``numpy.bool``, ``numpy.ndarray``."""
    kind = type(value)
    module = getattr(kind, "__module__", None)
    name = getattr(kind, "__qualname__", kind.__name__)
    return name if module in (None, "builtins") else f"{module}.{name}"


def exception_text(exc: BaseException) -> str:
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable message>"
    name = type(exc).__name__
    return f"{name}: {message}" if message else name


# Marks a MemoryError seen inside the except clause (see grade_one).
_OUT_OF_MEMORY = object()

# A result message: ("ok", score, correct, pred, vote) or ("fault", kind, detail).
Outcome = tuple[Any, ...]


def grade_one(
    resolve: Callable[[str], RewardFn],
    data_source: str,
    response: str,
    answer: str,
    catch: type[BaseException] | tuple[type[BaseException], ...],
    max_abs: float = MAX_ABS_SCORE,
) -> Outcome:
    """Run one verifier and reduce its verdict, or its failure, to primitives; a finite
    score beyond ``max_abs`` is an "out_of_bounds" fault, not a reward."""
    try:
        result = resolve(data_source)(response, answer)
    except MemoryError:
        # Format nothing here: until the except clause ends, the traceback keeps the
        # verifier's frames, and with them the allocations that hit the limit, alive.
        result = _OUT_OF_MEMORY
    except catch as exc:
        detail = f"verifier {data_source!r} raised {exception_text(exc)}"
        return ("fault", "error", one_line(detail))
    if result is _OUT_OF_MEMORY:
        return ("fault", "memory", one_line(f"verifier {data_source!r} raised MemoryError"))
    if not isinstance(result, Score):
        kind = type_name(result)
        return ("fault", "error", one_line(f"verifier {data_source!r} returned {kind}, not Score"))
    try:
        score = float(result.score)
        if not is_bool(result.correct):  # "False" or 0.0 must not pass as a verdict
            raise TypeError(f"correct is {type_name(result.correct)}, not bool")
        correct = bool(result.correct)
        pred, vote = result.pred, result.vote
        # A NaN or infinite reward would poison the advantages of the whole group.
        if not math.isfinite(score):
            raise ValueError(f"score is {score}")
        if pred is not None and not isinstance(pred, str):
            raise TypeError(f"pred is {type_name(pred)}, not str")
        if vote is not None and not isinstance(vote, str):
            raise TypeError(f"vote is {type_name(vote)}, not str")
    except catch as exc:
        detail = f"verifier {data_source!r} returned a malformed Score: {exception_text(exc)}"
        return ("fault", "error", one_line(detail))
    if abs(score) > max_abs:
        detail = (
            f"verifier {data_source!r} returned score {score:g}, beyond reward.max_abs="
            f"{max_abs:g}: graded incorrect (a reward that large would zero or NaN its group's "
            "advantages); scale the reward, or raise reward.max_abs"
        )
        return ("fault", "out_of_bounds", one_line(detail))
    pred, vote = (None if v is None else v[:MAX_PRED_CHARS] for v in (pred, vote))
    return ("ok", score, correct, pred, vote)


def to_score(outcome: Outcome) -> Score:
    return Score(score=outcome[1], correct=outcome[2], pred=outcome[3], vote=outcome[4])


def _silence_descriptors() -> None:
    """Point file descriptors 1 and 2 at /dev/null: output a verifier's C code writes there
    directly is discarded (Python's is captured, capped and sent to the parent)."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)


def prepare(resolve: Callable[[str], RewardFn]) -> str | None:
    """Load what ``resolve`` needs before the worker reports ready (a user's reward file is
    imported here, under the pool's start-up allowance and before the address-space limit,
    so no response's deadline pays for it): None, or why it failed, naming the file."""
    load = getattr(resolve, "prepare", None)
    if load is None:
        return None
    try:
        load()
    except BaseException as exc:  # SystemExit and KeyboardInterrupt in a module too
        return one_line(exception_text(exc), MAX_PRED_CHARS)
    return None


def worker_main(
    conn: Connection,
    resolve: Callable[[str], RewardFn],
    memory_mb: int,
    max_abs: float = MAX_ABS_SCORE,
) -> None:
    """Worker loop: receive a chunk of jobs, send one result message per job (preceded by
    ``("output", index, text, dropped)`` when grading it printed); it ends with its parent."""
    # Ctrl-C reaches the whole process group; only the parent should act on it
    # (and it kills the workers), or workers would report it as a verifier fault.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    _silence_descriptors()
    sink = CappedText()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        failure = prepare(resolve)
    sink.take()  # what loading printed belongs to no response
    if failure is not None:
        conn.send(("failed", failure))
        return
    limit_address_space(memory_mb)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the parent is gone
            return
        if chunk is None:
            return
        for index, data_source, response, answer in chunk:
            # BaseException: a verifier calling sys.exit() is a fault in that verifier.
            job = (resolve, data_source, response, answer, BaseException, max_abs)
            outcome = captured(sink, lambda job=job: grade_one(*job))
            text, dropped = sink.take()
            if text or dropped:
                conn.send(("output", index, text, dropped))
            conn.send((index, *outcome))


def exit_with_parent() -> None:
    """End this worker when the process that started it ends. A worker stuck in a verifier
    reads no pipe, and the pool that would kill it at its deadline died with a trainer killed
    by SIGKILL (the OOM killer, a preemption): it spun on, and its forkserver parent (held
    open by the workers themselves) never exited to take it along. A daemon thread waits on
    multiprocessing's sentinel of the starting process; it needs the GIL, which a verifier's
    Python code yields every few milliseconds."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing: nothing to watch
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="dapo-parent-watch", daemon=True).start()


def describe_exit(code: int | None) -> str:
    """How a worker process ended, for a fault's detail."""
    if code is None:
        return "still running; killed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
