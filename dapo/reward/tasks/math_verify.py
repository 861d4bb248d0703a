r"""A general verifier for answers that are not integers, built on ``math-verify``.

Why: the string modes (:mod:`dapo.reward.tasks.math_dapo`,
:mod:`dapo.reward.tasks.math_lenient`) compare
normalised strings, which is exact for DAPO-Math-17k's integer answers but grades ``0.5``
against ``\frac{1}{2}``, ``2\sqrt{3}`` against ``\sqrt{12}`` or ``\{3,2,1\}`` against
``\{1,2,3\}`` as wrong. This mode parses both answers into SymPy objects with HuggingFace's
``math-verify`` (LaTeX, fractions, radicals, sets, intervals, equations, percentages) and
asks its ``verify`` whether they are equal, numerically or symbolically.

What is graded: the same bounded tail as the string modes (``TAIL_CHARS``, the last 300
characters). The answer is the text after the last ``Answer:`` marker in it, found by the
lenient mode's extraction (on the marker's own line); without one,
the content of the last ``\boxed{...}`` in the tail (none if its braces never
close). 300 characters are enough: the answer ends the response by instruction, and
typical non-integer answers (intervals, sets, radicals, a small matrix) are far
shorter. The reference (verl's ``math_dapo.py``) reads the same 300 characters in
both its "Answer:" and its boxed modes, and a larger window would only hand SymPy
longer untrusted input. An answer followed by more than 300 characters of text is
not seen.

Threat model: model outputs are untrusted, and SymPy is not built for hostile input.
``9^{9^{9^{9^{9}}}}`` parses in milliseconds (evaluation is lazy), then ``verify``
tries to evaluate the tower (still running after 10 s); ``1000000!`` takes 6 s; and
nothing bounds the memory such work allocates. So this verifier is meant to run under
``dapo.reward.pool.RewardPool`` with ``workers >= 1``: the pool kills a worker past
its per-response deadline and caps its address space, and the response then grades
incorrect with a ``Fault`` ("timeout", "memory" or "crash") that the trainer counts.
With ``workers=0`` nothing bounds time or memory.

math-verify's own timeouts are switched off (``parsing_timeout=None``,
``timeout_seconds=None``). They use ``SIGALRM``, which raises ``ValueError`` off the
main thread and counts whole seconds only, and math-verify catches its own timeout
and answers "not equal" without telling anyone, so a timeout would never reach the
metrics. The pool's deadline replaces them; the price is that a timeout costs a
worker restart. Under :func:`resolve` a worker imports math-verify and grades once as it
starts (the pool's ``prepare``), so no response's deadline pays for that; under the task
registry's resolver (training, where most rows take another mode) a restarted worker's
first math-verify response pays the imports again (about 0.5 s, more under load).

Like the string modes, ``math_verify_score`` grades any input (``None``, bytes, garbage)
without raising, with two deliberate exceptions: ``MemoryError`` propagates, so that
the pool reports a "memory" fault and replaces the worker (which may have kept
memory in caches); and ``ImportError`` propagates when math-verify is not installed,
since grading every response wrong without a word would silently ruin a training run.

math-verify (and SymPy with it, about 0.5 s) is imported on the first call, not with
this module: importing ``dapo.reward.tasks`` or starting a reward worker costs nothing
unless this mode is used.

The module shares its name with the ``math_verify`` package it wraps; ``from math_verify
import ...`` below is the package (imports are absolute).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from dapo.reward.tasks.base import NO_ANSWER, RewardFn, Score, Task, ground_truth_text
from dapo.reward.tasks.math_lenient import TAIL_CHARS, extract_answer

__all__ = ["GOLD_CACHE_SIZE", "MODE_NAME", "TASKS", "math_verify_score", "resolve"]

# The name this verifier is registered under (reward.mode, or a row's data_source).
MODE_NAME = "math_verify"

# Parsed ground truths kept per process. A group of G responses shares one answer and
# the pool gives each worker a contiguous chunk of the batch, so most lookups hit; an
# entry is a few small SymPy objects, so this bounds the cache to a few megabytes.
GOLD_CACHE_SIZE = 4096

_BOXED = "\\boxed{"

# math-verify logs this warning once per process when its timeouts are disabled. We
# disable them on purpose (see the module docstring); every new reward worker would
# otherwise print it to stderr.
_TIMEOUT_DISABLED_PREFIX = "Timeout is disabled"


class _DropTimeoutDisabled(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIMEOUT_DISABLED_PREFIX)


@functools.lru_cache(maxsize=1)
def math_verify_api() -> tuple[Any, Any, Any]:
    """Import math-verify on first use; return ``(parse, verify, extraction_config)``."""
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as exc:
        raise ImportError(
            f"the {MODE_NAME!r} reward mode needs the math-verify package: "
            f"pip install math-verify ({exc})"
        ) from exc
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabled())
    # Answers reach math-verify as "\boxed{<answer>}" (see _parse), so only its boxed
    # pattern should match: no search for "final answer is" or for bare numbers,
    # which could pick a stray digit out of an answer that does not parse.
    config = (LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),)
    return parse, verify, config


def _parse(answer: str) -> tuple[Any, ...]:
    r"""Parse one answer; ``()`` when math-verify finds nothing in it.

    The answer is wrapped in ``\boxed{}`` so that math-verify reads all of it as LaTeX:
    its extraction otherwise needs ``$...$`` and friends and would take
    ``\sqrt{2}/2`` as the bare number 2. An answer that is already boxed, or wrapped
    in ``$``, parses the same. The result is the parsed SymPy object, then
    math-verify's normalised string of the answer (compared as a string by
    ``verify`` when SymPy cannot parse either side).
    """
    parse, _, config = math_verify_api()
    try:
        return tuple(
            parse(
                _BOXED + answer + "}",
                extraction_config=config,
                parsing_timeout=None,
                raise_on_error=True,
            )
        )
    except MemoryError:
        raise
    except Exception:
        return ()


@functools.lru_cache(maxsize=GOLD_CACHE_SIZE)
def parse_gold(ground_truth: str) -> tuple[Any, ...]:
    # A MemoryError propagates and is not cached; anything else is caught in _parse.
    return _parse(ground_truth)


def _equal(gold: tuple[Any, ...], pred: tuple[Any, ...]) -> bool:
    """math-verify's ``verify`` over every (gold, pred) pair, MemoryError kept.

    ``verify(gold_list, pred_list)`` does the same loop but, unless asked to raise,
    turns every exception into "not equal", MemoryError included. Asking it to raise
    and looping here keeps its verdicts while letting MemoryError reach the pool.
    """
    _, verify, _ = math_verify_api()
    for gold_item in gold:
        for pred_item in pred:
            try:
                if verify(gold_item, pred_item, timeout_seconds=None, raise_on_error=True):
                    return True
            except MemoryError:
                raise
            except Exception:
                continue
    return False


def _last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` in ``text``, or None if its braces never close.

    Only the last one counts: when it is cut off (a truncated response), an earlier
    box is an intermediate result, not the answer. Escaped braces (``\{``, ``\}``, as
    in a set) do not count. One linear scan.
    """
    start = text.rfind(_BOXED)
    if start == -1:
        return None
    depth = 1
    i = start + len(_BOXED)
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # a command or an escaped character: "\{" opens nothing
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED) : i]
        i += 1
    return None


def _extract(response: str) -> str | None:
    r"""The answer in the tail of ``response``: the ``Answer:`` line, else the last ``\boxed{}``."""
    answer = extract_answer(response)
    if answer is None:
        answer = _last_boxed(response[-TAIL_CHARS:])
        if answer is None:
            return None
    # A sentence-final full stop is punctuation ("Answer: $\frac{1}{2}$."), and
    # math-verify cannot parse "\frac{1}{2}." as a number.
    answer = answer.strip().rstrip(".").strip()
    return answer or None


def math_verify_score(response: str, ground_truth: str) -> Score:
    r"""Grade ``response`` against ``ground_truth`` by mathematical equivalence.

    Args:
        response: the decoded model output; anything that is not a ``str`` is graded
            incorrect.
        ground_truth: the reference answer, LaTeX or plain (``\frac{1}{2}``,
            ``(0, 1]``, ``\{1,2,3\}``, ``x=5``); an int is passed to ``str``; any
            other type grades every response incorrect.

    Returns:
        ``Score(1.0, True, pred)`` if math-verify finds the answer (the last
        ``Answer:`` line in the final ``TAIL_CHARS`` characters, else the last
        ``\boxed{}`` there) equal to the ground truth, else ``Score(-1.0, False,
        pred)``. ``pred`` is the extracted answer as written, stripped (at most
        ``TAIL_CHARS`` characters), or ``""`` when none was found; ``vote`` is SymPy's
        form of it, which equal answers written differently share in maj@k.

    Raises:
        MemoryError: let through so that ``RewardPool`` counts a "memory" fault.
        ImportError: math-verify is not installed.

    Example:
        >>> math_verify_score("so x = 1/2.\nAnswer: $\\frac{1}{2}$", "0.5")
        Score(score=1.0, correct=True, pred='$\\frac{1}{2}$', vote='1/2')
    """
    truth_text = ground_truth_text(response, ground_truth)
    if truth_text is None:
        return NO_ANSWER
    pred = _extract(response)
    if pred is None:
        return NO_ANSWER
    gold = parse_gold(truth_text.strip())
    parsed = _parse(pred)
    # An unparseable ground truth (empty, garbage) matches nothing.
    correct = bool(gold) and _equal(gold, parsed)
    return Score(score=1.0 if correct else -1.0, correct=correct, pred=pred, vote=_vote(parsed))


def _vote(parsed: tuple[Any, ...]) -> str | None:
    r"""SymPy's printed form of a parsed answer, which ``\frac12``, ``1/2`` and ``0.5`` share
    (so they vote together in maj@k); None (vote with ``pred``) when nothing parsed."""
    if not parsed:
        return None
    try:
        return str(parsed[0])
    except MemoryError:
        raise
    except Exception:
        return None


def resolve(data_source: str) -> RewardFn:
    """A ``RewardPool`` resolver that grades every data source with ``math_verify_score``.

    Module-level, hence picklable, so workers can receive it:
    ``RewardPool(resolve=dapo.reward.tasks.math_verify.resolve)``.
    """
    return math_verify_score


def _warm() -> None:
    """:func:`resolve`'s start-up in a reward worker (``RewardPool`` calls it before the
    worker reports ready): import math-verify and SymPy, and build the parser's tables."""
    math_verify_score(r"Answer: \frac{1}{2}", "0.5")


resolve.prepare = _warm  # type: ignore[attr-defined]


TASKS = (
    Task(
        MODE_NAME,
        math_verify_score,
        "the answer (Answer: line, else the last \\boxed{}) equals the ground truth as a "
        "value, by math-verify (SymPy): fractions, radicals, sets, intervals",
    ),
)
