"""Reward functions as a user writes them, for tests of reward.function and dapo.train's
reward_fn. A module of their own so that reward worker processes can import them by name
(pytest puts tests/ on sys.path and multiprocessing passes sys.path to children)."""

from __future__ import annotations

import time


def ends_with_answer(response: str, ground_truth: str) -> float:
    """+1.0 when the response ends with the answer, else -1.0."""
    return 1.0 if response.strip().endswith(ground_truth) else -1.0


def as_bool(response: str, ground_truth: str) -> bool:
    return ground_truth in response


def as_dict(response: str, ground_truth: str) -> dict:
    return {"score": 0.5, "correct": False, "pred": response[:3]}


def as_list(response: str, ground_truth: str) -> list:
    return [1.0]


def raises(response: str, ground_truth: str) -> float:
    raise RuntimeError("the user's reward failed")


def sleeps(response: str, ground_truth: str) -> float:
    time.sleep(60)
    return 1.0


def nan(response: str, ground_truth: str) -> float:
    return float("nan")


def one_argument(response: str) -> float:
    return 0.0


NOT_A_FUNCTION = 3


def huge_for_the_right(response: str, ground_truth: str) -> float:
    """1e308 where the response ends with the answer: two in a group overflow its std."""
    return 1e308 if response.strip().endswith(ground_truth) else -1.0
