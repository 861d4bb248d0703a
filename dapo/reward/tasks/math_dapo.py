r"""R_correct as the paper computed it: the DAPO verifier of verl (``math_dapo.py``).

    R_correct(o, a) = +1 if the answer extracted from o is equivalent to a, else -1

Two versions of the reference, each reproduced rule for rule, including what it rejects:

- ``math_dapo`` (alias ``dapo``; the default, ``reward.mode=dapo`` and ``data_source``
  ``math_dapo``): verl 0.4.1's, the DAPO era's. The answer is the last ``Answer:`` line and
  nothing else (rules 1-3 below): the reward the paper's numbers were made with.
- ``math_dapo_boxed``: verl 0.9.1's, what the peers run today. Without an answer line it
  falls back to the last ``\boxed{}`` (rule 4), so it pays responses 0.4.1 counts wrong.

Written afresh from the references' rules; ``tests/test_math_dapo.py`` compares each with its
verl version's file on a corpus of model-like responses and on fuzzed ones. The rules, in
order:

1. Only the last ``TAIL_CHARS`` (300) characters of the response are read.
2. The answer is the last match of ``Answer``, optional whitespace, ``:``, optional
   whitespace, then the rest of a line, case-insensitive. The whitespace may span lines:
   ``Answer:\n34`` answers 34, and a bare ``Answer:`` takes the next line.
3. The answer and the ground truth are normalised alike (the Minerva rules, ``normalize``)
   and compared as strings. A trailing full stop stays (``Answer: 7.`` is wrong), as does a
   percent sign (``12\%``); a word from ``REMOVED`` is deleted wherever it occurs, so
   ``Answer: 12 students`` is 12, and the word goes from inside longer words too.
4. ``math_dapo_boxed`` only: with no answer line at all, the last ``\boxed{...}`` in the last
   ``BOX_TAIL_CHARS`` (100) characters is the answer, compared to the ground truth as written
   (not normalised).

Model outputs are untrusted input: every rule is a bounded scan or a regular expression run
on at most 300 characters, nothing is parsed as a number or evaluated, and ``math_score``
returns an incorrect ``Score`` on non-string input instead of raising.
"""

from __future__ import annotations

import re

from dapo.reward.tasks.base import INVALID_PRED, NO_ANSWER, Score, Task, ground_truth_text

__all__ = ["BOX_TAIL_CHARS", "TAIL_CHARS", "TASKS", "math_score", "math_score_boxed", "normalize"]

TAIL_CHARS = 300
"""Characters read from the end of a response (the reference's window)."""
BOX_TAIL_CHARS = 100
"""Characters of that window searched for a \\boxed{} answer when there is no answer line."""

# Python's \s and IGNORECASE are Unicode-aware here, as in the reference: an answer line
# may be separated by any whitespace, newlines included.
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_NO_ANSWER_LINE = INVALID_PRED  # what the reference extracts without an answer line

# Plain replacements, applied in this order (spaces go, "mbox" becomes "text", ...).
SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Deleted wherever they occur, in this order: units and words, typesetting remnants.
REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
# Then these rewrites, in order: keep what lies between the first two $ (on a line), unwrap
# the first \text{}, \textbf{}, \overline{} (to their first closing brace) and \boxed{} (to
# the last one), and spell out shorthand fractions and roots (\frac12 -> \frac{1}{2}).
REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),
)


def normalize(answer: str) -> str:
    r"""The Minerva normalisation of the reference, applied to predictions and ground truths.

    What follows the last ``=``; ``SUBSTITUTIONS``; ``REMOVED`` deleted; ``REWRITES``; every
    ``$`` removed; thousands commas dropped when what remains is all digits
    (``str.isdigit``, so Unicode digits count too); surrounding whitespace stripped.

    Example:
        >>> normalize("x = \\boxed{1,000}")
        '1000'
    """
    text = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for word in REMOVED:
        text = text.replace(word, "")
    for pattern, replacement in REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def _last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{`` in ``text`` up to the brace that closes it (every
    ``{`` and ``}`` counts, escaped or not), or None when there is none or it never closes."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{") : i]
    return None


def math_score(response: str, ground_truth: str) -> Score:
    """Grade ``response`` against ``ground_truth`` with the paper's rules (R_correct; verl
    0.4.1): the last answer line, Minerva-normalised, equals the ground truth.

    Returns:
        ``Score(1.0, True, pred)`` or ``Score(-1.0, False, pred)``; ``pred`` is the
        normalised answer line, else ``"[INVALID]"`` (the reference's placeholder); ``""`` for
        input that cannot be graded. Never raises.

    Example:
        >>> math_score("so 5 * 7 - 1 = 34.\\nAnswer:\\n$34$", "34")
        Score(score=1.0, correct=True, pred='34', vote=None)
    """
    return _graded(response, ground_truth, boxed=False)


def math_score_boxed(response: str, ground_truth: str) -> Score:
    """:func:`math_score` with verl 0.9.1's fallback: without an answer line, the last
    ``\\boxed{}`` of the last 100 characters, compared as written. Never raises.

    Example:
        >>> math_score_boxed("The answer is \\\\boxed{9}.", "9")
        Score(score=1.0, correct=True, pred='9', vote=None)
    """
    return _graded(response, ground_truth, boxed=True)


def _graded(response: str, ground_truth: str, *, boxed: bool) -> Score:
    truth = ground_truth_text(response, ground_truth)
    if truth is None:
        return NO_ANSWER
    tail = response[-TAIL_CHARS:]
    lines = _ANSWER_LINE.findall(tail)
    pred = normalize(lines[-1] if lines else _NO_ANSWER_LINE)
    correct = pred == normalize(truth)
    if boxed and pred == _NO_ANSWER_LINE:  # no answer line: the last box, compared as written
        box = _last_boxed(tail[-BOX_TAIL_CHARS:])
        if box is not None:
            pred, correct = box, box == truth
    return Score(score=1.0 if correct else -1.0, correct=correct, pred=pred)


TASKS = (
    Task(
        "math_dapo",
        math_score,
        "the paper's verifier (verl 0.4.1's math_dapo): the last 'Answer:' line, "
        "Minerva-normalised, equals the ground truth",
        aliases=("dapo",),
    ),
    Task(
        "math_dapo_boxed",
        math_score_boxed,
        "verl 0.9.1's math_dapo: as math_dapo, and without an 'Answer:' line the last "
        "\\boxed{} as written",
    ),
)
