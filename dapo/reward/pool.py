"""Grade untrusted model outputs in worker processes, in bounded time and memory.

Model outputs are untrusted input: handed an adversarial response, a verifier may raise, loop
forever or allocate without limit, and a bug in a new verifier does the same on ordinary responses.
``RewardPool`` runs verifiers in worker processes with an address-space limit and a deadline per
response, and the parent kills and replaces a worker that overruns either. Whatever goes wrong
costs only the response being graded: it gets ``FAULT_SCORE`` (graded incorrect) and a ``Fault``
that the trainer can count and log, and ``grade`` always returns one ``Score`` per job.

Workers come from the "forkserver" start method (a fresh, small interpreter, so they neither
inherit the trainer's threads, CUDA state and address space nor start slowly), or "spawn" where
forkserver does not exist or the temporary directory's path is too long for its socket. This
module (and the worker side, ``dapo.reward.worker``) imports only the standard library and
``dapo.reward.tasks``, so it loads no torch into a worker. But
multiprocessing runs a ``__main__`` *script* again in every child it starts (the forkserver's own
preload of it never happens on Python 3.11): that is why ``dapo.cli``, which the ``dapo`` console
script imports, imports nothing heavy at module level. A script of your own that imports torch at
the top makes every worker start cost seconds.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from dapo.reward.jobs import (
    FAULT_KINDS,
    FAULT_SCORE,
    MAX_ABS_SCORE,
    Fault,
    GradeResult,
    Job,
    Printed,
    grading_job,
)
from dapo.reward.start_method import default_start_method
from dapo.reward.tasks import RewardFn, Score, get_verifier
from dapo.reward.worker import (
    CappedText,
    captured,
    describe_exit,
    exception_text,
    grade_one,
    one_line,
    to_score,
    worker_main,
)

__all__ = ["FAULT_KINDS", "FAULT_SCORE", "Fault", "GradeResult", "Job", "RewardPool", "grading_job"]

# Starting a worker is not the verifier's time. It takes milliseconds, or seconds where the
# __main__ script or a user's reward file imports torch (see above and worker.prepare); allow
# far more than that before calling the setup broken.
STARTUP_TIMEOUT_S = 120.0

# A SIGKILLed process is gone in milliseconds; one stuck in uninterruptible I/O is not waited for.
JOIN_TIMEOUT_S = 5.0


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` contiguous runs whose lengths differ by at most one."""
    size, extra = divmod(len(items), parts)
    runs, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        runs.append(items[start:end])
        start = end
    return runs


class _Worker:
    """One worker slot: the process in it (replaced after a fault) and its jobs in flight."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.process: Any = None
        self.conn: Connection | None = None
        self.ready = False
        self.pending: deque[tuple[int, Job]] = deque()
        self.deadline = 0.0


class RewardPool:
    """Grade responses so that no verifier failure can stop or stall training.

    ``workers >= 1``: that many worker processes, started on the first ``grade`` and
    reused across calls. A batch is split into contiguous chunks, one per worker. A
    worker gets ``timeout_s`` for each response (counted from its previous message)
    and an address space of ``memory_mb`` MiB beyond what it maps at start (Linux;
    ``0`` for no limit). A worker past its deadline is killed and the job it was on
    faults as "timeout"; a worker that dies faults its job as "crash"; either way a
    replacement grades the rest of the chunk. One ``grade`` call therefore takes at
    most about ``timeout_s`` longer per hanging response, and never more than
    ``batch_timeout_s`` in all (when > 0): then every worker still busy is killed and each
    job not graded yet faults as "timeout" (a verifier that hangs on every response costs
    one deadline per batch, not one per response).

    ``workers == 0``: grade in this process, one job after another. Exceptions,
    MemoryError included, still become faults, but nothing bounds time or memory:
    a verifier that hangs hangs the caller. Only for tests and trusted verifiers.

    A finite score whose magnitude is above ``max_abs`` faults as "out_of_bounds". What a
    verifier prints is captured, never written to this process's streams: each response
    keeps its first ``MAX_OUTPUT_CHARS`` characters, a batch its first ``MAX_SHOWN_OUTPUT``
    (``GradeResult.output``), and the rest is counted (``output_dropped``); a worker's C code
    writing to its file descriptors directly writes to /dev/null.

    ``resolve(data_source)`` returns the verifier; it must be picklable (a
    module-level function) because workers receive it. ``start_method`` is
    multiprocessing's ("forkserver" where it exists, else "spawn"). Use the pool as a
    context manager, or call ``close``, to kill the workers.

    Example:
        >>> with RewardPool(workers=0) as pool:
        ...     pool.grade([Job("math_dapo", "Answer: 34", "34")]).scores
        [Score(score=1.0, correct=True, pred='34', vote=None)]
    """

    def __init__(
        self,
        *,
        workers: int = 1,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        resolve: Callable[[str], RewardFn] = get_verifier,
        start_method: str | None = None,
        batch_timeout_s: float = 0.0,
        max_abs: float = MAX_ABS_SCORE,
    ) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if memory_mb < 0:
            raise ValueError(f"memory_mb must be >= 0 (0: no limit), got {memory_mb}")
        if batch_timeout_s < 0:
            raise ValueError(f"batch_timeout_s must be >= 0 (0: no limit), got {batch_timeout_s}")
        if not max_abs > 0:
            raise ValueError(f"max_abs must be > 0, got {max_abs}")
        if workers > 0:
            # Fail here, not in a worker mid-training, if resolve cannot travel.
            try:
                pickle.dumps(resolve)
            except Exception as exc:
                raise ValueError(
                    f"resolve must be picklable (a module-level function) to reach "
                    f"worker processes: {exception_text(exc)}"
                ) from exc
        self._timeout_s = float(timeout_s)
        self._batch_timeout_s = float(batch_timeout_s)
        self._memory_mb = int(memory_mb)
        self._max_abs = float(max_abs)
        self._printed = Printed()  # what this grade call's verifiers printed
        self._resolve = resolve
        self._slots = [_Worker(f"dapo-reward-{i}") for i in range(workers)]
        self._start_method = start_method or default_start_method()
        self._context: Any = None
        self._closed = False

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill all workers. Safe to call more than once; ``grade`` then raises."""
        self._closed = True
        for slot in self._slots:
            self._stop(slot)
            slot.pending.clear()

    def grade(self, jobs: Sequence[Job]) -> GradeResult:
        """Grade ``jobs``; one ``Score`` per job, in order, whatever the verifiers do."""
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        jobs = list(jobs)
        self._printed = Printed()
        if not self._slots:
            return self._with_output(self._grade_in_process(jobs))
        scores: list[Score | None] = [None] * len(jobs)
        faults: list[Fault] = []
        try:
            self._grade_in_workers(jobs, scores, faults)
        except BaseException:
            # Interrupted (Ctrl-C) or a worker that cannot start: workers still
            # holding jobs would send stale results into the next call.
            for slot in self._slots:
                if slot.pending:
                    self._stop(slot)
                    slot.pending.clear()
            raise
        faults.sort(key=lambda fault: fault.index)
        return self._with_output(GradeResult(scores=scores, faults=faults))  # type: ignore[arg-type]

    def _with_output(self, result: GradeResult) -> GradeResult:
        result.output, result.output_dropped = self._printed.text(), self._printed.dropped
        return result

    # --- in-process -------------------------------------------------------------------

    def _grade_in_process(self, jobs: list[Job]) -> GradeResult:
        scores: list[Score] = []
        faults: list[Fault] = []
        sink = CappedText()
        for index, job in enumerate(jobs):
            # Not BaseException: Ctrl-C must still stop the caller; sys.exit() is a fault.
            catch = (Exception, SystemExit)
            args = (self._resolve, job.data_source, job.response, job.answer, catch)
            outcome = captured(sink, lambda args=args: grade_one(*args, self._max_abs))
            self._printed.note(*sink.take())
            if outcome[0] == "ok":
                scores.append(to_score(outcome))
            else:
                scores.append(FAULT_SCORE)
                faults.append(Fault(index=index, kind=outcome[1], detail=outcome[2]))
        return GradeResult(scores=scores, faults=faults)

    # --- workers ----------------------------------------------------------------------

    def _grade_in_workers(
        self, jobs: list[Job], scores: list[Score | None], faults: list[Fault]
    ) -> None:
        busy: list[_Worker] = []
        chunks = _split(list(enumerate(jobs)), len(self._slots))
        for slot, chunk in zip(self._slots, chunks, strict=True):
            if not chunk:
                continue
            slot.pending.extend(chunk)
            if slot.process is not None and slot.process.exitcode is not None:
                self._stop(slot)  # it died idle (say the OOM killer): no job of this batch's fault
            if slot.process is None:
                self._start(slot)  # the chunk follows its "ready" message
            else:
                self._send_pending(slot)
            busy.append(slot)

        limit = self._batch_timeout_s
        batch_deadline = time.monotonic() + limit if limit else float("inf")
        while busy:
            by_conn = {slot.conn: slot for slot in busy}
            until = min(batch_deadline, *(slot.deadline for slot in busy))
            for conn in wait(list(by_conn), max(0.0, until - time.monotonic())):
                self._receive(by_conn[conn], scores, faults)
            now = time.monotonic()
            if now >= batch_deadline:
                for slot in busy:
                    self._abandon(slot, scores, faults)
                return
            for slot in busy:
                if slot.pending and slot.deadline <= now:
                    self._expire(slot, scores, faults)
            busy = [slot for slot in busy if slot.pending]

    def _abandon(self, slot: _Worker, scores: list[Score | None], faults: list[Fault]) -> None:
        """The batch's deadline passed: kill ``slot``'s worker, fault the jobs it still holds."""
        if slot.conn is not None and slot.conn.poll():
            self._receive(slot, scores, faults)  # what it finished in time still counts
        detail = (
            f"not graded within the batch's {self._batch_timeout_s:g} s (reward.batch_timeout_s)"
        )
        for index, _job in slot.pending:
            scores[index] = FAULT_SCORE
            faults.append(Fault(index=index, kind="timeout", detail=detail))
        slot.pending.clear()
        self._stop(slot)

    def _start(self, slot: _Worker) -> None:
        if self._context is None:
            self._context = multiprocessing.get_context(self._start_method)
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=worker_main,
            args=(child_conn, self._resolve, self._memory_mb, self._max_abs),
            name=slot.name,
            daemon=True,  # killed at interpreter exit if close() was never called
        )
        process.start()
        # Our copy of the child's end must go, or the pipe never reports EOF when it dies.
        child_conn.close()
        slot.process, slot.conn, slot.ready = process, parent_conn, False
        slot.deadline = time.monotonic() + max(STARTUP_TIMEOUT_S, self._timeout_s)

    def _stop(self, slot: _Worker) -> None:
        process = slot.process
        if process is not None:
            if process.exitcode is None:
                process.kill()
                process.join(JOIN_TIMEOUT_S)
            if process.exitcode is not None:
                process.close()  # its exit-status pipe, now rather than at GC
        if slot.conn is not None:
            slot.conn.close()
        slot.process, slot.conn, slot.ready = None, None, False

    def _send_pending(self, slot: _Worker) -> None:
        assert slot.conn is not None
        chunk = [(i, job.data_source, job.response, job.answer) for i, job in slot.pending]
        try:
            slot.conn.send(chunk)
        except OSError:
            pass  # the worker just died; its EOF is handled like any other crash
        slot.deadline = time.monotonic() + self._timeout_s

    def _receive(self, slot: _Worker, scores: list[Score | None], faults: list[Fault]) -> None:
        """Read every message already waiting from ``slot``'s worker."""
        while slot.pending and slot.conn is not None:
            try:
                message = slot.conn.recv()
            except Exception:
                # EOF: the worker died (segfault, os._exit, OOM killer). Anything
                # else is a garbled stream, which we cannot trust either.
                self._on_death(slot, scores, faults)
                return
            if message[0] == "ready":
                slot.ready = True
                self._send_pending(slot)
            elif message[0] == "failed":  # resolve could not load: no job could be graded
                self._stop(slot)
                raise RuntimeError(f"reward worker {slot.name} could not start: {message[1]}")
            elif message[0] == "output":  # what grading the next result printed
                self._printed.note(str(message[2]), int(message[3]))
            else:
                index, status, *rest = message
                expected, job = slot.pending[0]
                if index != expected:
                    self._on_death(slot, scores, faults)
                    return
                slot.pending.popleft()
                slot.deadline = time.monotonic() + self._timeout_s
                if status == "ok":
                    scores[index] = to_score(message[1:])
                else:
                    kind, detail = rest
                    scores[index] = FAULT_SCORE
                    faults.append(Fault(index=index, kind=kind, detail=detail))
                    if kind == "memory":
                        # The verifier may have kept what it allocated (a global,
                        # a cache), which would fail every later job: start afresh.
                        self._replace(slot)
            if slot.conn is None or not slot.conn.poll():
                return

    def _on_death(self, slot: _Worker, scores: list[Score | None], faults: list[Fault]) -> None:
        slot.process.join(1.0)  # EOF comes as it exits; let the exit code arrive too
        how = describe_exit(slot.process.exitcode)
        if not slot.ready:
            self._stop(slot)
            raise RuntimeError(
                f"reward worker {slot.name} died while starting ({how}); check that "
                f"resolve ({self._resolve!r}) is importable in a fresh interpreter, and "
                "that a script it imports keeps its work under if __name__ == '__main__':"
            )
        index, job = slot.pending.popleft()
        detail = f"worker grading verifier {job.data_source!r} died ({how})"
        self._fault(slot, index, "crash", detail, scores, faults)

    def _expire(self, slot: _Worker, scores: list[Score | None], faults: list[Fault]) -> None:
        assert slot.conn is not None
        # The worker may have answered between wait() returning and now.
        if slot.conn.poll():
            self._receive(slot, scores, faults)
            if not slot.pending or slot.deadline > time.monotonic():
                return
        if not slot.ready:
            self._stop(slot)
            raise RuntimeError(
                f"reward worker {slot.name} did not start within "
                f"{max(STARTUP_TIMEOUT_S, self._timeout_s):g} s (loading {self._resolve!r})"
            )
        index, job = slot.pending.popleft()
        detail = f"verifier {job.data_source!r} ran past {self._timeout_s:g} s"
        self._fault(slot, index, "timeout", detail, scores, faults)

    def _fault(
        self,
        slot: _Worker,
        index: int,
        kind: str,
        detail: str,
        scores: list[Score | None],
        faults: list[Fault],
    ) -> None:
        scores[index] = FAULT_SCORE
        faults.append(Fault(index=index, kind=kind, detail=one_line(detail)))
        self._replace(slot)

    def _replace(self, slot: _Worker) -> None:
        """Kill ``slot``'s worker; start a new one for the rest of its chunk, if any."""
        self._stop(slot)
        if slot.pending:
            self._start(slot)
