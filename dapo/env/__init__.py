"""Environments: multi-turn episodes in which the model calls tools (``env.class``).

    Environment, History, Observation   :mod:`dapo.env.base`, the interface
    MathTool (``math_tool``)            :mod:`dapo.env.python_tool`, Python in the sandbox

A user's environment is a subclass of :class:`Environment` in a file of theirs
(``env.class=PATH.py:NAME``) or an importable module (``package.module:NAME``), checked
when the run starts the way a reward function is.
"""

from __future__ import annotations

import inspect
from typing import Any

from dapo.env.base import Environment, History, Observation, turn_end_ids
from dapo.env.python_tool import MathTool
from dapo.reward import custom

__all__ = [
    "BUILTIN",
    "Environment",
    "History",
    "MathTool",
    "Observation",
    "load_environment",
    "turn_end_ids",
]

BUILTIN: dict[str, type[Environment]] = {"math_tool": MathTool}
"""The environments ``env.class`` names without a file."""
FIX = (
    "give env.class as a built-in name (" + ", ".join(BUILTIN) + "), PATH.py:NAME (a Python "
    "file and a subclass of dapo.env.Environment in it) or package.module:NAME"
)


def load_environment(spec: str, settings: Any = None) -> Environment | None:
    """The environment ``spec`` names (``env.class``), made with ``settings`` (the run's
    ``env`` section) when its class takes an argument; None for an empty ``spec`` (single
    turn). ValueError naming the fix for anything else."""
    if not spec:
        return None
    if spec in BUILTIN:
        cls: Any = BUILTIN[spec]
    else:
        try:
            cls = custom.load_function(spec, "env.class", FIX)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(
                f"env.class={spec!r}: importing it raised {type(exc).__name__}: {exc}"
            ) from exc
    if isinstance(cls, Environment):
        return cls
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"env.class={spec!r} is a {type(cls).__name__}; {FIX}")
    takes_settings = len(inspect.signature(cls).parameters) > 0
    if spec in BUILTIN:
        return cls(settings) if takes_settings else cls()
    try:
        return cls(settings) if takes_settings else cls()
    except Exception as exc:
        raise ValueError(
            f"env.class={spec!r}: constructing {cls.__name__} raised {type(exc).__name__}: {exc}"
        ) from exc
