"""What an environment is: the first messages of a row, then an observation after each turn.

An episode alternates model turns and observations. A model turn ends at one of the policy's
stop tokens (the end of its message) or at a token whose text is one of the environment's
``turn_ends`` (the closing fence of a code block); the environment then answers with an
:class:`Observation`: text to append (context for the model, never trained), or the end of
the episode. The rollout driver (:mod:`dapo.rollout.episodes`) runs the episodes; an
environment only reads text and writes text.

Environments are stateless: :meth:`Environment.step` sees the whole episode so far (a
:class:`History`), so that one object serves every row, in threads at once, and a resumed
run needs nothing of it but its settings.

Standard library only, and no torch: a config is checked without loading the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dapo.data.problems import Problem


@dataclass(frozen=True)
class History:
    """An episode so far, as :meth:`Environment.step` sees it after a model turn."""

    problem: Problem
    model_text: str
    """Every model turn so far, joined; the observations left out, except that a turn after
    an observation that ended its line starts a line here too."""
    transcript: str
    """The response so far, the observations in their places."""
    turns: int
    """Model turns so far (this one included). A stop answered with nothing (an empty,
    unfinished :class:`Observation`) is a pause: the turn goes on, and is counted once."""
    finished: bool
    """The last turn ended at a stop token of the policy (the end of its message), not at
    one of the environment's ``turn_ends``."""


@dataclass(frozen=True)
class Observation:
    """What the environment answers to a model turn."""

    text: str = ""
    """Appended to the episode after the model's turn, as context (no loss, no advantage);
    empty with ``done`` and ``tool_call`` False: a pause, the model goes on in the same turn
    with nothing added."""
    done: bool = False
    """The episode ends here; ``text`` is then ignored."""
    reward: float | None = None
    """With ``done``: the episode's score in place of the row's verifier (correct when > 0);
    None: the verifier grades the model's text."""
    tool_call: bool = False
    """This answer ran a tool (counted in ``tools/calls_per_response``)."""
    error: bool = False
    """The tool failed: an exception, a deadline, a memory limit (``tools/error_frac``)."""
    seconds: float = 0.0
    """Wall-clock seconds the tool took (``tools/seconds``)."""


class Environment:
    """The base of every environment; alone, it is single-turn: the row's own messages, and
    the episode ends after the first turn.

    A subclass overrides what it changes: :meth:`messages` (the first messages of a row),
    ``turn_ends`` (texts whose token ends a model turn early) and :meth:`step`. It is made
    with no arguments, or with the run's ``env`` settings when its ``__init__`` takes one
    (:func:`dapo.env.load_environment`)."""

    turn_ends: tuple[str, ...] = ()
    """A token ends a model turn when its text, without surrounding whitespace, is one of
    these (besides the policy's stop tokens, which end the model's message)."""

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """The chat messages an episode of ``problem`` starts from."""
        return list(problem.messages)

    def step(self, history: History) -> Observation:
        """The answer to the model's last turn."""
        return Observation(done=True)

    def close(self) -> None:
        """Release what the environment holds (a tool's helper processes): called when the run
        or evaluation that made it ends, on success or error. An environment given as an
        instance serves every runner of the process (the trainer's, the generator thread's,
        a later run's), so a close may come more than once and a call after it: a later call
        starts again what it needs. The base holds nothing."""


def model_text_of(segments: list[tuple[str, bool]]) -> str:
    """:attr:`History.model_text` of an episode's ``segments`` (each turn's or observation's
    text, and whether the environment wrote it)."""
    parts: list[str] = []
    after_line = False  # the last segment was an observation that ended its line
    for text, by_env in segments:
        if not by_env:
            # The turn starts a line, as the model saw it: glued to the last turn's closing
            # fence, it would keep that fence from closing its block (the Python tool's).
            if after_line and parts and not parts[-1].endswith("\n"):
                parts.append("\n")
            parts.append(text)
        after_line = by_env and text.endswith("\n")
    return "".join(parts)


def turn_end_ids(tokenizer: Any, texts: tuple[str, ...]) -> list[int]:
    """The ids of every vocabulary token whose text, stripped of whitespace, is one of
    ``texts`` (for "```": the fence alone and with a newline or a space around it); a
    ValueError naming each of ``texts`` that no token is."""
    if not texts:
        return []
    wanted = set(texts)
    ids, found = [], set()
    for token, i in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token]).strip()
        if text in wanted:
            ids.append(i)
            found.add(text)
    if missing := sorted(wanted - found):
        # Then that text would never end a turn (nor run a tool), without a word.
        raise ValueError(
            f"env.class: turn_ends {missing} match no token of the tokenizer: each must be "
            "the text of one token (a string the tokenizer splits never ends a turn)"
        )
    return sorted(ids)


_FIELD_TYPES = {"text": str, "done": bool, "tool_call": bool, "error": bool}


def checked_observation(answer: Observation, where: str) -> Observation:
    """``answer`` when its fields are of their types (``reward`` is checked apart); else a
    TypeError naming ``where`` (the environment's step and row): a text of bytes or a
    ``seconds`` of None failed deep in the tokenizer or a sum, naming neither."""
    for name, kind in _FIELD_TYPES.items():
        if not isinstance(getattr(answer, name), kind):
            value = getattr(answer, name)
            raise TypeError(
                f"{where}: Observation.{name} is {type(value).__name__} {str(value)[:60]!r}, "
                f"not {kind.__name__}"
            )
    seconds = answer.seconds
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(
            f"{where}: Observation.seconds is {type(seconds).__name__}, not a number of seconds"
        )
    return answer


def messages_of(env: Environment, problem: Problem) -> list[dict[str, str]]:
    """``env.messages(problem)``, checked: what it raises, or a value that is not a list of
    chat messages (a string was blamed on the tokenizer's chat template), is named with the
    environment and the row."""
    where = f"env.class: {type(env).__name__}.messages on row {problem.uid}"
    try:
        messages = env.messages(problem)
    except Exception as exc:
        raise RuntimeError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    listed = list(messages) if isinstance(messages, list | tuple) else None
    ok = listed is not None and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in listed
    )
    if not ok or not listed:
        raise TypeError(
            f"{where} returned {type(messages).__name__} {str(messages)[:60]!r}; return a "
            'non-empty list of messages, each {"role": str, "content": str}'
        )
    return listed
