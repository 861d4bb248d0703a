"""What the reward pool grades and what it returns: a job per response, a score per job, and
a fault for each job whose verifier failed (:mod:`dapo.reward.pool` runs them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dapo.reward.tasks import Score

if TYPE_CHECKING:
    from dapo.data.problems import Problem

FAULT_KINDS = ("error", "timeout", "memory", "crash", "out_of_bounds")

MAX_ABS_SCORE = 1e6
"""The largest |score| a verifier may return (``reward.max_abs``): beyond it the score is a
fault, not a reward. One score of 1e200 makes its group's standard deviation overflow and
zeroes its advantages; two of 1e308 make them NaN."""

# Same verdict as a response with no answer, so a fault never earns reward; pred is
# None (not "") so that a faulted response can be told from one without an answer.
FAULT_SCORE = Score(score=-1.0, correct=False, pred=None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Job:
    """One response to grade with the verifier registered for ``data_source``."""

    data_source: str
    response: str
    answer: str


@dataclass(frozen=True)
class Fault:
    """Why one job got ``FAULT_SCORE`` instead of its verifier's verdict.

    Attributes:
        index: position of the job in the sequence passed to ``RewardPool.grade``.
        kind: one of ``FAULT_KINDS``: "error" (the verifier or resolver raised, or
            returned something that is not a ``Score``), "timeout" (ran past
            ``timeout_s``; the worker was killed), "memory" (MemoryError, normally
            from the worker's address-space limit), "crash" (the worker died:
            segfault, ``os._exit``, the kernel's OOM killer), "out_of_bounds" (a finite
            score whose magnitude is above the pool's ``max_abs``).
        detail: one line for logs, at most about ``MAX_DETAIL_CHARS`` characters.
    """

    index: int
    kind: str
    detail: str


@dataclass
class GradeResult:
    """Verdicts for a batch: ``scores[i]`` belongs to job ``i``; faults sorted by index."""

    scores: list[Score]
    faults: list[Fault]
    output: str = ""
    """What the verifiers printed while grading the batch, cut to ``MAX_SHOWN_OUTPUT``
    characters (their output is never written to the trainer's streams)."""
    output_dropped: int = 0
    """Characters of that output dropped past the caps (per response, then per batch)."""

    def warnings(self, where: str, uid_of: Callable[[int], str]) -> list[str]:
        """What went wrong grading the batch, for stderr: the faults (the first named by its
        row's uid, ``uid_of(job index)``) and what the verifiers printed (capped)."""
        lines = []
        if self.faults:
            first = self.faults[0]
            lines.append(
                f"dapo: warning: {where}: the verifier failed on {len(self.faults)} "
                f"response(s), graded incorrect; first (row {uid_of(first.index)}): "
                f"{first.kind}: {first.detail}"
            )
        if self.output or self.output_dropped:
            dropped = self.output_dropped
            more = f" ({dropped} more characters dropped)" if dropped else ""
            lines.append(f"dapo: {where}: the verifiers printed{more}:\n{self.output.rstrip()}")
        return lines


MAX_SHOWN_OUTPUT = 4096
"""Characters of a batch's verifier output a ``GradeResult`` keeps."""


class Printed:
    """A batch's verifier output: its first ``MAX_SHOWN_OUTPUT`` characters, and a count of
    the characters dropped (past each response's cap, then past the batch's)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.dropped = 0

    def note(self, text: str, dropped: int) -> None:
        room = MAX_SHOWN_OUTPUT - sum(len(t) for t in self.parts)
        self.parts.append(text[: max(0, room)])
        self.dropped += dropped + len(text) - len(self.parts[-1])

    def text(self) -> str:
        return "".join(self.parts)


def grading_job(problem: Problem, response: str, reward_mode: str = "") -> Job:
    """What the pool grades: ``reward_mode`` for every row, else the row's data_source."""
    return Job(reward_mode or problem.data_source, response, problem.answer)
