"""What the reward pool grades and what it returns: a job per response, a score per job, and
a fault for each job whose verifier failed (:mod:`dapo.reward.pool` runs them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dapo.reward.tasks import Score

if TYPE_CHECKING:
    from dapo.data.problems import Problem

FAULT_KINDS = ("error", "timeout", "memory", "crash")

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
            segfault, ``os._exit``, the kernel's OOM killer).
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


def grading_job(problem: Problem, response: str, reward_mode: str = "") -> Job:
    """What the pool grades: ``reward_mode`` for every row, else the row's data_source."""
    return Job(reward_mode or problem.data_source, response, problem.answer)
