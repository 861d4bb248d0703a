"""The ``env`` section: multi-turn episodes, in which the model calls tools (dapo.env)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class EnvConfig:
    """The environment a rollout's episodes run in; empty ``class`` (the default): one model
    turn per response, as in the paper."""

    class_: str = ""
    """The environment: ``math_tool`` (the built-in Python tool: a fenced python block that
    closes a turn runs in the code sandbox, and what it prints comes back as context),
    ``PATH.py:NAME`` or ``package.module:NAME`` (a subclass of ``dapo.env.Environment`` of
    your own), or empty: single-turn."""
    max_turns: int = 8
    """Model turns an episode may take (each ends at an observation: a tool call, the text an
    environment answers; or at the end of the message); the episode ends after the last. A
    stop the environment answers with nothing (a code block's opening fence) is a pause, not a
    turn; an episode pauses at most 4 x ``max_turns`` times."""
    max_observation_tokens: int = 256
    """Tokens one observation (a tool's output) may add; a longer one is cut, with a marker.
    The whole episode, model and environment tokens together, stays within
    ``rollout.max_new_tokens``."""
    workers: int = 4
    """Tool calls run at once (threads, each waiting on a sandboxed process): rows whose
    turn ended at the same time call their tools concurrently."""
    tool_wall_s: float = 3.0
    """Seconds one call of the Python tool may run (its earlier blocks, replayed, included)."""
    step_timeout_s: float = 60.0
    """Seconds an environment's ``step`` may take for one row (a tool call included); past
    it the run stops, naming the row and the turn: a ``step`` that hangs on the model's text
    (a regex that backtracks, a loop) would hang the run without a word. Above
    ``tool_wall_s``."""
    tool_memory_mb: int = 512
    """Address space of the Python tool's process, MiB."""
    tool_instruction: bool = True
    """Add the Python tool's instruction (how to call it) to each problem's first user
    message, for a model never shown the tool; false for one warm-started on its format
    (the tools demo)."""
    tool_sandbox: Literal["auto", "bwrap", "unshare", "process"] = "auto"
    """The Python tool's isolation, as ``code.sandbox`` (docs/guides/code-sandbox.md)."""

    def check(self) -> list[str]:
        errors = []
        if self.max_turns < 1:
            errors.append(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.max_observation_tokens < 1:
            errors.append(
                f"env.max_observation_tokens must be >= 1, got {self.max_observation_tokens}"
            )
        if self.workers < 1:
            errors.append(f"env.workers must be >= 1, got {self.workers}")
        if not self.tool_wall_s > 0 or self.tool_memory_mb < 64:
            errors.append("env.tool_wall_s must be > 0 and env.tool_memory_mb >= 64")
        if not self.step_timeout_s > self.tool_wall_s:
            errors.append(
                f"env.step_timeout_s={self.step_timeout_s:g} must be above env.tool_wall_s="
                f"{self.tool_wall_s:g}: a tool call at its limit must still be answered"
            )
        return errors
