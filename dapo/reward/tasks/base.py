"""What every task shares: the verdict on one response, and the task record itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Score:
    """The verdict on one response.

    Attributes:
        score: R_correct, +1.0 if correct else -1.0 (DAPO §"Reward").
        correct: whether the extracted answer equals the ground truth; dynamic
            sampling filters on this, not on the shaped reward.
        pred: the extracted, normalised answer; "" when none was found.
        vote: what the response votes with in maj@k, where answers that mean the same
            must vote together (math_verify: SymPy's form of the parsed answer, so
            ``\\frac12``, ``1/2`` and ``0.5`` are one vote); ``None`` votes with ``pred``,
            and ``""`` casts no vote (the code task, whose ``pred`` is an outcome label).
    """

    score: float
    correct: bool
    pred: str
    vote: str | None = None


RewardFn = Callable[[str, str], Score]
"""A verifier: (response, ground truth) -> Score. It must never raise on bad input and must
return in bounded time and memory on any string (model outputs are untrusted)."""

NO_ANSWER = Score(score=-1.0, correct=False, pred="")
"""The verdict on a response without an answer, or on a row without a usable ground truth."""

INVALID_PRED = "[INVALID]"
"""The ``pred`` of math_dapo (the reference's placeholder) for a response without an answer
line: no answer either, though the verdict is otherwise graded as usual."""

NO_ANSWER_PREDS = frozenset({NO_ANSWER.pred, INVALID_PRED})
"""Every ``pred`` that means "no answer was found": such a response casts no vote in maj@k."""


def vote_key(score: Score) -> str | None:
    """What ``score``'s response votes with in maj@k: its ``vote``, else its ``pred``."""
    return score.pred if score.vote is None else score.vote


def gave_answer(pred: object) -> bool:
    """Whether ``pred`` (a Score's, or None) is an extracted answer, not a no-answer marker."""
    return isinstance(pred, str) and pred not in NO_ANSWER_PREDS


def ground_truth_text(response: object, ground_truth: object) -> str | None:
    """The ground truth as text, or None when the pair cannot be graded: a response that is
    not a string, or a ground truth that is not a string or an int (None, NaN, bytes, bool).

    Such a pair is graded incorrect (``NO_ANSWER``), so that a row without a usable answer
    never rewards a model that writes "Answer: None". Never raises.
    """
    if not isinstance(response, str):
        return None
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int)):
        return None
    try:
        return ground_truth if isinstance(ground_truth, str) else str(ground_truth)
    except Exception:
        # str() of an int over 4300 digits raises ValueError, and a subclass may raise
        # anything: a bad row must not end the training run.
        return None


@dataclass(frozen=True)
class Task:
    """A task the trainer can grade: a name, its verifier, and the other names that pick it.

    A row's ``data_source`` and the ``reward.mode`` setting are both looked up among the names
    and aliases of the registered tasks (``dapo.reward.tasks.get_verifier``).
    """

    name: str
    verify: RewardFn
    summary: str
    """One line for listings and error messages."""
    aliases: tuple[str, ...] = ()
    check_truth: Callable[[str], str | None] | None = None
    """Why a row's ground truth cannot be graded by this task, or None when it can (``dapo
    data check`` lists such rows as bad); None for a task that grades any text."""
