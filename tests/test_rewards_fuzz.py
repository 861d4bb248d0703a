"""Property-based tests (hypothesis) of answer extraction and normalisation in
dapo.reward.tasks.math_lenient.

The verifier grades untrusted model output, so these tests check, for inputs built
to reach its rules and its bounds (LaTeX fragments, "Answer:" markers, grouped
numbers with units, odd Unicode, strings of up to 1 MB, answer lines at the edge of
the tail window), that it never raises, stays within its time and length bounds,
and extracts and normalises as documented.

Every property runs under two profiles:

- ``test_<property>``: the CI profile, CI_EXAMPLES examples, run by default.
  ``derandomize=True``: CI sees the same examples on every run, so a red run is
  caused by the change under test, never by the luck of the draw.
- ``test_<property>_long``: the long profile, LONG_EXAMPLES (>= 10,000) examples,
  marked ``fuzz`` and so deselected by default (see addopts in pyproject.toml).
  Opt in with ``python -m pytest -m fuzz tests/test_rewards_fuzz.py``. Random
  seeds, so each opt-in run explores new inputs; ``print_blob=True`` prints a
  ``@reproduce_failure`` blob for any failure, since ``database=None`` (no
  .hypothesis directory is written) means failures are not stored for replay.

Both profiles use ``deadline=None``: the time properties below measure the calls
themselves with time.process_time and assert explicit bounds, which is less flaky
than hypothesis' per-example deadline, which also counts input generation.
"""

from __future__ import annotations

import gc
import time

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from dapo.reward.tasks.base import Score
from dapo.reward.tasks.math_lenient import (
    MAX_ANSWER_CHARS,
    TAIL_CHARS,
    lenient_score,
    normalize_answer,
)

CI_EXAMPLES = 200
LONG_EXAMPLES = 10_000

# Largest string built by the strategies below: the spec's "a megabyte of output".
MAX_INPUT_CHARS = 1_000_000

# Wall-clock bounds per call, ~10x the worst case observed on the development
# machine (2 shared cores, under load from other jobs) over one long-profile run
# (10,000 examples each) plus the hand-built ADVERSARIAL_TEXTS:
# - normalize_answer: worst observed 64 ms, on a 984-character string of "\boxed{"
#   (unbalanced) then "\\...$$$x" (_fixed_point_chain). Each pass of its
#   fixed-point loop deletes one "\$" and leaves another, and re-scans the whole
#   string, so the cost grows with MAX_ANSWER_CHARS squared: bounded, but the
#   slowest input there is. Generated inputs, 1 MB ones included, mostly take
#   well under 1 ms.
# - lenient_score with a short ground truth: worst observed 4 ms (the same chain in
#   an answer line; the tail window keeps it under TAIL_CHARS).
# - lenient_score with a hostile ground truth (over 100 characters): worst observed
#   44 ms, one normalize_answer call on the truth; bounded by the sum below.
NORMALIZE_LIMIT_S = 0.7
MATH_SCORE_RESPONSE_LIMIT_S = 0.05
MATH_SCORE_LIMIT_S = MATH_SCORE_RESPONSE_LIMIT_S + NORMALIZE_LIMIT_S

WRONG = Score(score=-1.0, correct=False, pred="")

# The shortest marker the extraction regex accepts, "answer:". A prediction is the
# rest of a marker's line within the last TAIL_CHARS characters, so it is at most
# this much shorter than the window.
MIN_MARKER_CHARS = len("answer:")

_CI = settings(
    max_examples=CI_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    # The strategies build megabyte strings on purpose (cheaply, by repetition).
    # Generation speed depends on the machine; it must not fail the run.
    suppress_health_check=[HealthCheck.too_slow],
)
_LONG = settings(_CI, max_examples=LONG_EXAMPLES, derandomize=False, print_blob=True)


def ci_and_long(*strategies, examples=()):
    """Build two tests from one property: the CI-profile one and the opt-in long one.

    Used as ``test_x, test_x_long = ci_and_long(...)(_x)``; pytest names each test
    after the variable it is bound to. ``examples`` (tuples of arguments) run
    first in both, whatever is generated.
    """

    def one(prop, profile):
        test = given(*strategies)(prop)
        for args in examples:
            test = example(*args)(test)
        return profile(test)

    def build(prop):
        return one(prop, _CI), pytest.mark.fuzz(one(prop, _LONG))

    return build


def timed(fn, *args):
    """Call fn(*args) and return (result, seconds); no garbage collection meanwhile.

    The collector would otherwise charge the call for the test harness's own
    garbage (hypothesis keeps a lot), which is not the cost we are bounding.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        # This process's CPU time: the bound is on the work, which a machine busy with other
        # tests (pytest-xdist's other worker) slows on the wall clock but does not grow.
        start = time.process_time()
        result = fn(*args)
        return result, time.process_time() - start
    finally:
        if was_enabled:
            gc.enable()


def is_subsequence(short: str, long: str) -> bool:
    """Whether ``short`` is ``long`` with some characters deleted."""
    rest = iter(long)
    return all(ch in rest for ch in short)


# --- strategies --------------------------------------------------------------------

# Named functions rather than lambdas throughout: hypothesis describes a lambda by
# finding and compiling its source, which costs more than the tests here.

# Characters that line-splitting, whitespace handling or ASCII-only matching might
# treat specially: NUL, CR, the Unicode line and paragraph separators, NEL, the
# C0 separators that str.split() counts as whitespace, NBSP and other odd spaces,
# zero-width and bidirectional controls, a BOM, a combining mark, look-alikes of
# ASCII ("-", digits, "s", "K"), an emoji and lone surrogates.
SPECIAL_CHARS = [
    "\x00",
    "\r",
    "\n",
    "\t",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x1f",
    "\x85",
    "\xa0",
    "\u1680",
    "\u2003",
    "\u2028",
    "\u2029",
    "\u200b",
    "\u200d",
    "\u202e",
    "\u2066",
    "\u3000",
    "\ufeff",
    "\u0301",
    "\u2212",
    "\uff13",
    "\uff14",
    "\u00b0",
    "\u017f",
    "\u212a",
    "\U0001f389",
    "\ud800",
    "\udfff",
]

characters = st.one_of(
    st.characters(codec="utf-8"),  # the full range, surrogates excluded
    st.characters(max_codepoint=0x7F),
    st.sampled_from(SPECIAL_CHARS),
)
unicode_text = st.text(characters, max_size=20)

# Pieces of LaTeX answers and of the words around them, balanced or not.
LATEX_FRAGMENTS = [
    "\\boxed{",
    "\\text{",
    "\\textbf{",
    "\\textrm{",
    "\\mathrm{",
    "\\mathbf{",
    "\\mbox{",
    "\\boxed {",
    "{",
    "}",
    "}}",
    "\\frac",
    "\\dfrac",
    "\\tfrac",
    "{1}{2}",
    "\\sqrt{2}",
    "\\pi",
    "\\left(",
    "\\right)",
    "\\left[",
    "\\right]",
    "\\left",
    "\\right",
    "\\leftarrow",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\ ",
    "\\\\",
    "\\",
    "$",
    "$$",
    "\\$",
    "^",
    "_",
    "^{",
    "\\circ",
    "^\\circ",
    "^{\\circ}",
    "\u00b0",
    "%",
    "\\%",
    "cm",
    "units",
    "degrees",
    "dollars",
    ".",
    "...",
    ",",
    "=",
    "x=",
    "+",
    "-",
    "(",
    ")",
    "x",
    "0",
    "1",
    "9",
    "000",
    "34",
    " ",
    "\t",
    "\n",
    "\r\n",
    ":",
    "::",
]

# "Answer:" markers in their accepted spellings, and near misses.
markers = st.builds(
    "{}{}{}{}".format,
    st.sampled_from(["", "Final ", "The final ", "**"]),
    st.sampled_from(["Answer", "answer", "ANSWER", "aNsWeR", "Answers", "answ", "an\u017fwer"]),
    st.text(" \t", max_size=3),
    st.sampled_from([":", "::", ": ", ":\t", ":::", ""]),
)

UNITS = ["", "cm", " cm", "km", "^\\circ", "^{\\circ}", "\u00b0", "\\%", "%", " degrees", " units"]


def _number(sign: str, value: int, grouped: bool, fraction: str, unit: str, wrap: str) -> str:
    body = f"{value:,}" if grouped else str(value)
    return wrap.format(sign + body + fraction + unit)


numbers = st.builds(
    _number,
    st.sampled_from(["", "-", "+", "- ", "\u2212"]),
    st.integers(0, 10**15),
    st.booleans(),
    st.sampled_from(["", ".0", ".5", ".25", "."]),
    st.sampled_from(UNITS),
    st.sampled_from(["{}", "${}$", "\\boxed{{{}}}", "$\\boxed{{{}}}$", "\\text{{{}}}", "{} "]),
)

tokens = st.one_of(
    st.sampled_from(LATEX_FRAGMENTS),
    markers,
    numbers,
    characters,
)
# Short strings mixing all of the above: the main source of interesting inputs.
soup = st.lists(tokens, max_size=16).map("".join)
# LaTeX fragments only, so that the rules meet each other more often.
latex_soup = st.lists(st.sampled_from(LATEX_FRAGMENTS), max_size=30).map("".join)


def _repeat(unit: str, count: int, limit: int = MAX_INPUT_CHARS) -> str:
    """``unit * count``, at most ``limit`` characters: cheap to generate, however long."""
    if not unit:
        return ""
    return unit * min(count, limit // len(unit))


def _long(limit: int) -> st.SearchStrategy[str]:
    return st.builds(_repeat, soup, st.integers(0, limit), st.just(limit))


# Strings up to 1 MB, alone or around a short soup: a long run of one pattern
# ("{" * 10**6, "Answer:" * 10**5, "\boxed{" * 10**5, ...) with something else
# at either end.
long_text = st.one_of(
    _long(MAX_INPUT_CHARS),
    st.tuples(_long(MAX_INPUT_CHARS // 2), soup, _long(MAX_INPUT_CHARS // 2)).map("".join),
)


def _fixed_point_chain(wrappers: int, pairs: int, padding: int) -> str:
    r"""The slowest normalize_answer input known: ``pairs`` passes, each a full scan.

    "\\\\$$" loses one "\$" per pass of normalize_answer's fixed-point loop and
    leaves another; the unbalanced "\boxed{" make every pass run the brace
    matcher; the trailing "x" keeps strip("$") away; whitespace padding reaches
    the stripping of megabyte inputs.
    """
    pad = " " * padding
    return pad + "\\boxed{" * wrappers + "\\" * pairs + "$" * pairs + "x" + pad


adversarial = st.builds(
    _fixed_point_chain,
    st.integers(0, 40),
    st.integers(0, MAX_ANSWER_CHARS // 2),
    st.sampled_from([0, 1, MAX_INPUT_CHARS // 2]),
)

# Hand-built worst cases, always run (as explicit examples) by the time properties.
ADVERSARIAL_TEXTS = [
    _fixed_point_chain(10, (MAX_ANSWER_CHARS - 71) // 2, 0),
    _fixed_point_chain(10, (MAX_ANSWER_CHARS - 71) // 2, MAX_INPUT_CHARS // 2 - 500),
    _fixed_point_chain(0, (MAX_ANSWER_CHARS - 1) // 2, 0),
    "Answer: " + _fixed_point_chain(10, (TAIL_CHARS - 80) // 2, 0),
    "{" * MAX_INPUT_CHARS,
    "Answer:" * (MAX_INPUT_CHARS // 7),
    "Answer: " + "\\boxed{" * 100_000 + "}" * 100_000,
    " " * MAX_INPUT_CHARS,
    "9" * MAX_INPUT_CHARS,
]

# Padding that normalize_answer strips before its length check.
padded = st.builds(
    "{}{}{}".format,
    st.builds(_repeat, st.sampled_from([" ", "\n", "\u3000", "\t\r\n"]), st.integers(0, 10**6)),
    soup,
    st.builds(_repeat, st.sampled_from([" ", "\n", "\u2028"]), st.integers(0, 10**6)),
)


# Strings whose stripped length is within a few characters of MAX_ANSWER_CHARS,
# either side: the switch between normalising and returning stripped only.
def _near_max_answer(unit: str, delta: int, pad: str) -> str:
    return pad + (unit * (MAX_ANSWER_CHARS + 3))[: MAX_ANSWER_CHARS + delta] + pad


near_max_answer = st.builds(
    _near_max_answer,
    st.sampled_from(["1", "x.", "\\$", "\\boxed{1}", "1,000", "\\!", "$", "5cm", " 1"]),
    st.integers(-3, 3),
    st.sampled_from(["", " ", "\n"]),
)


def _one_line(text: str) -> str:
    return text.replace("\n", " ")[:200]


def _no_colon_not_blank(text: str) -> str:
    text = text.replace(":", ";")
    return text if text.strip() else text + "0"


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _power_of_ten(exponent: int) -> int:
    return 10**exponent


# Short answers as a model writes them on its "Answer:" line (one line).
answers = st.one_of(numbers, soup, latex_soup, unicode_text).map(_one_line)

# A ground truth: unrelated to the answer, or the answer differently written.
DECORATIONS = [
    "{}",
    " {} ",
    "${}$",
    "\\boxed{{{}}}",
    "$\\boxed{{{}}}$",
    "\\text{{{}}}",
    "{}.",
    "x = {}",
    "{}\\!",
]


@st.composite
def answer_and_truth(draw):
    answer = draw(answers)
    if draw(st.booleans()):
        truth = draw(st.sampled_from(DECORATIONS)).format(answer)
    else:
        truth = draw(st.one_of(numbers, soup))
    return answer, truth


def _answer_near_tail(prefix: str, marker: str, answer: str, offset: int) -> str:
    """``answer`` on a marker line whose start is ``offset`` chars off the window edge."""
    line = prefix + "\n" + marker + " " + answer + "\n"
    pad = max(0, TAIL_CHARS + offset - len(marker + " " + answer + "\n"))
    return line + "." * pad


# Responses for the total properties: every kind of input above, and "Answer:"
# lines near the start of the tail window.
responses = st.one_of(
    soup,
    latex_soup,
    unicode_text,
    st.text(),
    long_text,
    adversarial,
    st.builds(
        _answer_near_tail,
        st.one_of(soup, long_text),
        markers,
        answers,
        st.integers(-8, 8),
    ),
)
truths = st.one_of(numbers, soup, latex_soup, unicode_text, near_max_answer)

# Text after the answer line that is not an answer: nothing, blank lines, or
# markers with nothing after them (skipped, the last non-blank line wins).
TRAILERS = ["", "\n", "\n\n", "\n   ", "\nAnswer:", "\nanswer : \t", "\nANSWER:\n"]


@st.composite
def answered(draw):
    """A response ending in an answer line, and a truth that often matches it."""
    prefix = draw(st.one_of(soup, long_text))
    answer, truth = draw(answer_and_truth())
    response = prefix + "\n" + draw(markers) + " " + answer + draw(st.sampled_from(TRAILERS))
    return response, truth


# (response, ground truth) pairs for the lenient_score properties: independent, or
# a response that answers (rightly or wrongly) a truth drawn with it, so that
# correct grades are common too.
graded = st.one_of(st.tuples(responses, truths), answered())

texts = st.one_of(
    soup, latex_soup, unicode_text, st.text(), long_text, adversarial, padded, near_max_answer
)

non_strings = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.binary(max_size=20),
    st.builds(_encode, soup),
    st.lists(st.text(max_size=5), max_size=3),
    st.builds(object),
)


class _Unprintable:
    def __str__(self):
        raise RuntimeError("no str for you")


# Ground truths that are not strings: lenient_score passes them to str(), which
# raises for an int over CPython's 4300-digit limit and for _Unprintable.
non_string_truths = st.one_of(
    non_strings,
    st.builds(_power_of_ten, st.integers(4290, 4400)),
    st.builds(_Unprintable),
)


# --- lenient_score ----------------------------------------------------------------------


def _math_score_is_total(graded):
    response, truth = graded
    result = lenient_score(response, truth)
    assert isinstance(result, Score)
    assert result.score in (1.0, -1.0)
    assert result.correct == (result.score == 1.0)
    assert isinstance(result.pred, str)
    assert len(result.pred) <= TAIL_CHARS - MIN_MARKER_CHARS
    assert normalize_answer(result.pred) == result.pred
    if result.correct:
        assert result.pred == normalize_answer(truth) != ""
    event(f"correct={result.correct}, found={result.pred != ''}")


test_math_score_is_total, test_math_score_is_total_long = ci_and_long(graded)(_math_score_is_total)


def _non_string_response_is_wrong(response, truth):
    assert lenient_score(response, truth) == WRONG


test_non_string_response_is_wrong, test_non_string_response_is_wrong_long = ci_and_long(
    non_strings, st.one_of(truths, non_string_truths)
)(_non_string_response_is_wrong)


def _non_string_truth_is_passed_to_str(response, truth):
    # An int ground truth is passed to str() (one whose str() raises, over 4300 digits,
    # grades every response wrong); any other type (None, floats, bytes) is no answer.
    result = lenient_score(response, truth)
    if isinstance(truth, bool) or not isinstance(truth, int):
        assert result == WRONG
        return
    try:
        truth_text = str(truth)
    except Exception:
        assert result == WRONG
    else:
        assert result == lenient_score(response, truth_text)


test_non_string_truth_is_passed_to_str, test_non_string_truth_is_passed_to_str_long = ci_and_long(
    responses, non_string_truths
)(_non_string_truth_is_passed_to_str)


def _math_score_reads_only_the_tail(graded):
    response, truth = graded
    assert lenient_score(response, truth) == lenient_score(response[-TAIL_CHARS:], truth)


test_math_score_reads_only_the_tail, test_math_score_reads_only_the_tail_long = ci_and_long(graded)(
    _math_score_reads_only_the_tail
)


def _normalising_truth_first_changes_nothing(graded):
    response, truth = graded
    result = lenient_score(response, truth)
    assert lenient_score(response, normalize_answer(truth)) == result


(
    test_normalising_truth_first_changes_nothing,
    test_normalising_truth_first_changes_nothing_long,
) = ci_and_long(graded)(_normalising_truth_first_changes_nothing)


def _math_score_is_bounded_in_time(graded):
    response, truth = graded
    _, elapsed = timed(lenient_score, response, truth)
    limit = MATH_SCORE_LIMIT_S if len(truth) > 100 else MATH_SCORE_RESPONSE_LIMIT_S
    assert elapsed < limit, (
        f"lenient_score took {elapsed * 1e3:.1f} ms on {len(response)} + {len(truth)} chars"
    )


test_math_score_is_bounded_in_time, test_math_score_is_bounded_in_time_long = ci_and_long(
    graded,
    examples=[((text, "34"),) for text in ADVERSARIAL_TEXTS]
    + [(("Answer: x", text),) for text in ADVERSARIAL_TEXTS],
)(_math_score_is_bounded_in_time)


# --- extraction ----------------------------------------------------------------------


def _final_answer_line_is_graded(prefix, marker_word, spaces, pair, trailer):
    answer, truth = pair
    line = marker_word + spaces + ": " + answer
    response = prefix + "\n" + line + trailer
    assert len(line + trailer) <= TAIL_CHARS  # the whole line is in the window
    result = lenient_score(response, truth)
    if answer.strip():
        expected = normalize_answer(answer)
        assert result.pred == expected
        assert result.correct == (expected != "" and expected == normalize_answer(truth))
        event(f"correct={result.correct}")
    else:
        # A blank answer line is skipped; what is found then depends on the prefix.
        event("blank answer")


test_final_answer_line_is_graded, test_final_answer_line_is_graded_long = ci_and_long(
    st.one_of(soup, long_text),
    st.sampled_from(["Answer", "answer", "ANSWER", "aNsWeR", "Final answer", "The answer"]),
    st.text(" \t", max_size=3),
    answer_and_truth(),
    st.sampled_from(TRAILERS),
)(_final_answer_line_is_graded)


def _answer_line_at_window_edge(prefix, marker_word, spaces, answer, filler, offset):
    # No ":" in the answer or the filler: the only marker near the window edge is ours.
    marker = marker_word + spaces + ":"
    line = marker + " " + answer + "\n"
    # The marker starts TAIL_CHARS - offset characters from the end: in the window
    # for offset >= 0, just outside it for offset < 0 (unless the answer is long).
    pad = max(0, TAIL_CHARS - len(line) - offset)
    after = " " + answer + "\n" + _repeat(filler, TAIL_CHARS)[:pad]
    response = prefix + "\n" + marker + after
    marker_in_window = len(marker + after) <= TAIL_CHARS
    result = lenient_score(response, normalize_answer(answer))
    if marker_in_window:
        assert result.pred == normalize_answer(answer)
        assert result.correct == (result.pred != "")
    else:
        assert result == WRONG
    event(f"marker in window={marker_in_window}")


test_answer_line_at_window_edge, test_answer_line_at_window_edge_long = ci_and_long(
    st.one_of(soup, _long(MAX_INPUT_CHARS)),
    st.sampled_from(["Answer", "answer", "ANSWER"]),
    st.text(" \t", max_size=2),
    answers.map(_no_colon_not_blank),
    st.text(st.characters(exclude_characters=":"), min_size=1, max_size=5),
    st.integers(-8, 8),
)(_answer_line_at_window_edge)


# --- normalize_answer ----------------------------------------------------------------


def _normalize_answer_properties(text):
    once = normalize_answer(text)
    assert isinstance(once, str)
    assert normalize_answer(once) == once  # idempotent
    # Every rule deletes characters, so the output is the input with some
    # characters deleted: never longer.
    assert len(once) <= len(text)
    stripped = text.strip()
    if len(stripped) > MAX_ANSWER_CHARS:
        assert once == stripped
    else:
        assert is_subsequence(once, stripped)
        assert not any(ch.isspace() for ch in once)
    event(f"normalised={len(stripped) <= MAX_ANSWER_CHARS}, changed={once != stripped}")


test_normalize_answer_properties, test_normalize_answer_properties_long = ci_and_long(texts)(
    _normalize_answer_properties
)


def _normalize_answer_is_bounded_in_time(text):
    _, elapsed = timed(normalize_answer, text)
    assert elapsed < NORMALIZE_LIMIT_S, (
        f"normalize_answer took {elapsed * 1e3:.1f} ms on {len(text)} chars"
    )


test_normalize_answer_is_bounded_in_time, test_normalize_answer_is_bounded_in_time_long = (
    ci_and_long(texts, examples=[(text,) for text in ADVERSARIAL_TEXTS])(
        _normalize_answer_is_bounded_in_time
    )
)
