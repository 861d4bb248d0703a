"""R_correct with forgiving rules: the ``lenient`` mode, and the embedded arith task's grader.

    R_correct(o, a) = +1 if the answer extracted from o is equivalent to a, else -1

Like the paper's verifier (:mod:`dapo.reward.tasks.math_dapo`), the model is told to end with a
line ``Answer: <answer>``; we take the last such line, normalise it and the ground truth
with the same function, and compare strings; nothing is parsed as a number or evaluated.
But the rules forgive what the paper's count wrong, so this is a different reward (the
reward-mode table of docs/guides/data-and-verifiers.md lists every difference): a trailing
full stop (``Answer: 7.``), a percent or degree sign (``12\\%``, ``90^\\circ``), a unit from a
short list after a number, ``\boxed{}`` and other wrappers anywhere, thousands separators and
a leading ``+``. It reads the answer on the marker's own line only (``Answer:`` then a
newline is no answer) and never falls back to a ``\boxed{}`` without a marker.

Model outputs are untrusted input (spec: "a verifier must return in bounded time
and memory on any string ... and never take the training run down"), hence:

- only the last ``TAIL_CHARS`` characters of a response are read, so the cost of
  grading does not grow with the response, however long or hostile it is;
- normalisation works on at most ``MAX_ANSWER_CHARS`` characters, uses only
  deletions, linear scans and regexes without nested quantifiers, and never calls
  ``int()``, ``eval`` or a CAS (``int("9" * 10**6)`` alone is slow, and raises
  above 4300 digits);
- ``lenient_score`` returns an incorrect ``Score`` for ``None`` or non-string input
  instead of raising.

The task is registered as ``math_lenient`` (alias ``lenient``); see :mod:`dapo.reward.tasks`.
"""

from __future__ import annotations

import re

from dapo.reward.tasks.base import NO_ANSWER, Score, Task, ground_truth_text

__all__ = [
    "MAX_ANSWER_CHARS",
    "TAIL_CHARS",
    "TASKS",
    "extract_answer",
    "lenient_score",
    "normalize_answer",
]

# The reference reads only the last 300 characters of a response: the answer line
# is at the end by instruction, and it bounds the work on a megabyte of output. An
# "Answer:" line followed by more than this much text is therefore not seen.
TAIL_CHARS = 300

# Longer strings are not answers (the tail window caps a prediction at 300
# characters); normalize_answer returns them only stripped, which keeps its
# worst case small and is still idempotent.
MAX_ANSWER_CHARS = 1000

# The marker may sit anywhere on a line ("The final answer: 34" counts), as in the
# reference; the answer is the rest of that line. re.ASCII keeps IGNORECASE from
# matching look-alikes such as U+017F for "s". One quantifier on each side of ":"
# and none nested, so matching is linear: no catastrophic backtracking.
_ANSWER_RE = re.compile(r"answer[ \t]*:([^\n]*)", re.IGNORECASE | re.ASCII)

# Formatting commands whose argument is the answer itself. Each prefix has exactly
# one backslash, at its start, so two occurrences can never overlap.
_WRAPPERS = (
    "\\boxed{",
    "\\text{",
    "\\textbf{",
    "\\textrm{",
    "\\mathrm{",
    "\\mathbf{",
    "\\mbox{",
)

# \left( and \right) size delimiters and change nothing else; the lookahead
# spares \leftarrow, \rightarrow and the like.
_SIZING_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")

# Thin, medium, thick, negative and explicit spaces: typesetting, not content.
_LATEX_SPACES = ("\\!", "\\,", "\\;", "\\:", "\\ ")

# Units and degree/percent signs after a number, a short fixed list in the spirit
# of the reference's: "90^\circ", "50\%" and "12 cm" all mean the bare number.
# Longer spellings come first so "\%" is removed whole, not as "%" leaving "\".
_UNITS = (
    "^{\\circ}",
    "^\\circ",
    "\\circ",
    "\u00b0",  # degree sign
    "\\%",
    "%",
    "degrees",
    "degree",
    "dollars",
    "cents",
    "units",
    "inches",
    "feet",
    "meters",
    "cm",
    "km",
    "mph",
    "hours",
    "minutes",
    "seconds",
)

# "1,000" and "-12,345.5": thousands separators, removed only when the whole
# answer is one number grouped by threes, so "1,2" (a list) is left alone. ASCII
# digits only: Python's \d would also match full-width and other Unicode digits.
_GROUPED_NUMBER_RE = re.compile(r"[+-]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")

# "+5" is 5. Only before a digit, so "+x" or "++5" keep their (odd) spelling.
_PLUS_RE = re.compile(r"^\+(?=[0-9])")


def _is_ascii_digit(ch: str) -> bool:
    # str.isdigit() accepts full-width and superscript digits, which we keep as
    # text (see normalize_answer), so test the ASCII range explicitly.
    return "0" <= ch <= "9"


def _brace_matches(text: str) -> dict[int, int]:
    """Map the index of each balanced '{' to the index of its '}'; one linear pass."""
    open_stack: list[int] = []
    matches: dict[int, int] = {}
    for i, ch in enumerate(text):
        if ch == "{":
            open_stack.append(i)
        elif ch == "}" and open_stack:
            matches[open_stack.pop()] = i
    return matches


def _unwrap_commands(text: str) -> str:
    r"""Replace every ``\boxed{X}`` (and the other ``_WRAPPERS``) by ``X``.

    Nested wrappers all go in one pass: we only mark the prefix and its matching
    closing brace for deletion, so cost is linear and nesting depth is irrelevant
    (no recursion). A wrapper without a matching '}' is left as written.
    """
    starts: list[tuple[int, int]] = []
    for prefix in _WRAPPERS:
        pos = text.find(prefix)
        while pos != -1:
            starts.append((pos, len(prefix)))
            pos = text.find(prefix, pos + len(prefix))
    if not starts:
        return text
    matches = _brace_matches(text)
    drop = bytearray(len(text))
    for pos, prefix_len in starts:
        close = matches.get(pos + prefix_len - 1)
        if close is None:
            continue
        drop[pos : pos + prefix_len] = b"\x01" * prefix_len
        drop[close] = 1
    return "".join(ch for ch, dropped in zip(text, drop, strict=True) if not dropped)


def _strip_units(text: str) -> str:
    """Drop unit suffixes while what precedes them ends in an ASCII digit."""
    changed = True
    while changed:
        changed = False
        for unit in _UNITS:
            if text.endswith(unit) and _is_ascii_digit(text[-len(unit) - 1 : -len(unit)]):
                text = text[: -len(unit)]
                changed = True
                break
    return text


def _normalize_once(text: str) -> str:
    """One pass of every rule. Each rule only deletes characters (see normalize_answer)."""
    text = text.strip()
    # "\$" is a currency sign; remove it before stripping math-mode "$" so that
    # "5\$" does not lose its "$" and leave a dangling backslash.
    text = text.replace("\\$", "")
    text = text.strip().strip("$")
    text = _unwrap_commands(text)
    text = _SIZING_RE.sub("", text)
    for space in _LATEX_SPACES:
        text = text.replace(space, "")
    # \dfrac and \tfrac are display sizes of \frac; one spelling for all three.
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    # All whitespace (Python's definition, so also NBSP and U+3000): "1 000", "- 7"
    # and "12 cm" should not differ from "1000", "-7" and "12cm".
    text = "".join(text.split())
    # "x = 5" answers 5; the reference also keeps what follows the last "=".
    text = text.rsplit("=", 1)[-1]
    # A sentence-final full stop is punctuation, not part of the answer.
    text = text.rstrip(".")
    text = _strip_units(text)
    if _GROUPED_NUMBER_RE.fullmatch(text):
        text = text.replace(",", "")
    text = _PLUS_RE.sub("", text)
    return text


def normalize_answer(text: str) -> str:
    r"""Normalise an answer string so equal answers compare equal as strings.

    Rules, applied until nothing changes:

    - strip whitespace, then remove all whitespace inside ("1 000" -> "1000");
    - remove ``\$`` (currency) and strip surrounding ``$`` (math mode);
    - unwrap ``\boxed{}``, ``\text{}``, ``\textbf{}``, ``\textrm{}``, ``\mathrm{}``,
      ``\mathbf{}``, ``\mbox{}`` (balanced braces only; any nesting, one linear pass);
    - remove ``\left``/``\right`` and the spacing commands ``\! \, \; \: \ ``;
      ``\dfrac``/``\tfrac`` -> ``\frac``;
    - keep what follows the last ``=`` ("x=5" -> "5");
    - remove trailing ``.``;
    - remove a unit or degree/percent sign after a number ("90^\circ" -> "90",
      "50\%" -> "50", "12cm" -> "12"; list in ``_UNITS``);
    - remove thousands commas when the whole answer is one grouped number
      ("1,000" -> "1000", but "1,2" is kept);
    - drop a leading ``+`` before a digit ("+5" -> "5").

    Deliberately not done, to stay a string comparison like the reference: no
    numeric canonicalisation ("10.0", "010" and "10" differ; parsing numbers is
    what we must not do on untrusted input), no case folding, no Unicode
    normalisation (full-width digits "３４", U+2212 minus, zero-width and
    bidirectional marks, combining characters are kept as written, so they do
    not match ASCII answers), no markdown ("**34**" is a format error, as in the
    reference).

    Every rule only deletes characters, so each pass that changes the text makes
    it shorter and a fixed point is reached within ``len(text) + 1`` passes. The
    result is that fixed point, which makes the function idempotent. Inputs
    longer than ``MAX_ANSWER_CHARS`` after stripping are returned stripped only.

    Example:
        >>> normalize_answer(" $\\boxed{1,000}$. ")
        '1000'
    """
    text = text.strip()
    if len(text) > MAX_ANSWER_CHARS:
        return text
    for _ in range(len(text) + 1):
        new_text = _normalize_once(text)
        if new_text == text:
            break
        text = new_text
    return text


def extract_answer(response: str) -> str | None:
    """The rest of the last non-blank ``Answer:`` line in the tail, or None."""
    tail = response[-TAIL_CHARS:]
    # Walk back from the last marker: a bare "Answer:" with nothing after it is
    # not an answer (the reference's pattern needs at least one character).
    for match in reversed(_ANSWER_RE.findall(tail)):
        if match.strip():
            return match
    return None


def lenient_score(response: str, ground_truth: str) -> Score:
    """Grade ``response`` against ``ground_truth`` with the forgiving rules (R_correct).

    Args:
        response: the decoded model output; anything that is not a ``str``
            (e.g. None) is graded incorrect.
        ground_truth: the reference answer; an int is accepted and passed to ``str``;
            any other type (None, float, bytes) grades every response incorrect.

    Returns:
        ``Score(1.0, True, pred)`` if the normalised answer of the last
        ``Answer:`` line within the final ``TAIL_CHARS`` characters equals the
        normalised ground truth, else ``Score(-1.0, False, pred)``, with
        ``pred == ""`` when no answer was found. Never raises.

    Example:
        >>> lenient_score("so 5 * 7 - 1 = 34.\\nAnswer: $34$", "34")
        Score(score=1.0, correct=True, pred='34', vote=None)
    """
    truth_text = ground_truth_text(response, ground_truth)
    if truth_text is None:
        return NO_ANSWER
    raw_answer = extract_answer(response)
    if raw_answer is None:
        return NO_ANSWER
    pred = normalize_answer(raw_answer)
    # An answer that normalises to "" (e.g. "Answer: $$") is no answer, even
    # against an empty ground truth.
    correct = pred != "" and pred == normalize_answer(truth_text)
    return Score(score=1.0 if correct else -1.0, correct=correct, pred=pred)


TASKS = (
    Task(
        "math_lenient",
        lenient_score,
        "the last 'Answer:' line, normalised with forgiving rules (full stops, units, %, "
        "wrappers), equals the ground truth as a string",
        aliases=("lenient",),
    ),
)
