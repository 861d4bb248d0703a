"""Tasks: ONE registry from a name to its verifier (R_correct).

A row's ``data_source`` picks its verifier, unless ``reward.mode`` names one for every row;
both are looked up here, among each task's name and aliases:

    math_dapo (alias dapo)  the paper's verifier (verl 0.4.1's math_dapo, rule for rule): the
                            last ``Answer:`` line, Minerva-normalised
    math_dapo_boxed         verl 0.9.1's: the same, else the last \\boxed{}
    math_lenient (lenient)  forgiving rules (full stops, units, percent, wrappers)
    math_verify             value equality by math-verify (fractions, radicals, sets, ...)
    arith                   the embedded arithmetic task, graded by the lenient rules

A new task is one file in this package that defines ``TASKS``, a tuple of
:class:`~dapo.reward.tasks.base.Task`: every module here is imported and registered when the
package is. Verifiers run in worker processes, so nothing in this package imports torch; a
task with settings of its own defines them as a dataclass beside its verifier (see
``arith.ArithConfig``) and :mod:`dapo.config` adds it as a section.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from dapo.reward.tasks.base import RewardFn, Score, Task

__all__ = [
    "REGISTRY",
    "RewardFn",
    "Score",
    "Task",
    "get_task",
    "get_verifier",
    "names",
    "register",
    "tasks",
    "truth_rule",
    "truth_rules",
]

_NOT_TASKS = frozenset({"base"})

REGISTRY: dict[str, Task] = {}
"""Every name and alias -> its task, filled when the package is imported."""


def register(task: Task) -> None:
    """Add ``task`` under its name and aliases; a name taken twice is an error, and then
    none of the task's names is added."""
    names_ = (task.name, *task.aliases)
    for name in names_:
        if name in REGISTRY:
            raise ValueError(
                f"task name {name!r} is taken twice ({REGISTRY[name].name} and {task.name})"
            )
    REGISTRY.update(dict.fromkeys(names_, task))


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name not in _NOT_TASKS:
            module = importlib.import_module(f"{__name__}.{info.name}")
            for task in getattr(module, "TASKS", ()):
                register(task)


_discover()


def names() -> tuple[str, ...]:
    """Every name a data_source or reward.mode may use, sorted."""
    return tuple(sorted(REGISTRY))


def tasks() -> tuple[Task, ...]:
    """The registered tasks, each once, by name."""
    return tuple(sorted({t.name: t for t in REGISTRY.values()}.values(), key=lambda t: t.name))


def get_task(name: str) -> Task:
    """The task registered as ``name`` (a data_source or a reward.mode).

    Raises:
        ValueError: if none is; grading with a silent fallback would train on the wrong reward.
    """
    task = REGISTRY.get(name)
    if task is None:
        known = "".join(f"\n  {t.name}: {t.summary}" for t in tasks())
        raise ValueError(
            f"no reward function for data_source {name!r}; known tasks: {', '.join(names())}. "
            "Set reward.mode=dapo (or math_verify) to grade every row with one verifier, "
            "convert the file with `dapo data convert --to dapo` (data_source math_dapo), or "
            f"add a task: one file in dapo/reward/tasks/ that defines TASKS. The tasks:{known}"
        )
    return task


def get_verifier(name: str) -> RewardFn:
    """The verifier of the task registered as ``name``; picklable, the reward pool's default."""
    return get_task(name).verify


def truth_rule(name: str) -> Callable[[str], str | None] | None:
    """The rule a ground truth graded by the task ``name`` follows (``Task.check_truth``: why
    one is ungradable, or None); None for a task that grades any text, or a name no task has
    (refused where its verifier is looked up)."""
    task = REGISTRY.get(name)
    return None if task is None else task.check_truth


def truth_rules(mode: str = "", function: str = "") -> Callable[[str], Any] | None:
    """A row's data_source -> the rule of the task that grades the row (:func:`truth_rule`):
    ``mode``'s (reward.mode) for every row, else the data_source's own; None when a reward
    function of the user's (reward.function) grades every row: it may take any text. What
    :class:`dapo.data.usable.Screen` takes, so that a run refuses the rows ``dapo data
    check`` lists."""
    if function:
        return None
    return lambda data_source: truth_rule(mode or data_source)
