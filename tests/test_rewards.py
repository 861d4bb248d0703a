"""Tests for dapo.reward.tasks.math_lenient: the forgiving verifier (reward.mode=lenient, the
arith task).

The paper's rules, the default, are tested in test_math_dapo.py."""

import random
import string
import time

import pytest

from dapo.reward.tasks.base import Score
from dapo.reward.tasks.math_lenient import (
    MAX_ANSWER_CHARS,
    TAIL_CHARS,
    lenient_score,
    normalize_answer,
)

# Generous for hostile input; normal answers take microseconds.
TIME_LIMIT_S = 2.0

WRONG = Score(score=-1.0, correct=False, pred="")


def timed_score(response, ground_truth="34"):
    start = time.process_time()  # CPU time: the work, however busy the machine is
    result = lenient_score(response, ground_truth)
    elapsed = time.process_time() - start
    assert elapsed < TIME_LIMIT_S, f"lenient_score took {elapsed:.2f}s"
    return result


# --- basic grading ---------------------------------------------------------------


def test_correct_answer_line():
    assert lenient_score("5 * 7 = 35, minus 1.\nAnswer: 34", "34") == Score(1.0, True, "34")


def test_wrong_answer():
    assert lenient_score("Answer: 35", "34") == Score(-1.0, False, "35")


def test_no_answer_line():
    assert lenient_score("The answer is 34.", "34") == WRONG
    assert lenient_score("", "34") == WRONG


def test_last_answer_line_wins():
    response = "Answer: 34\nWait, let me re-check.\nAnswer: 36"
    assert lenient_score(response, "34") == Score(-1.0, False, "36")
    assert lenient_score(response, "36") == Score(1.0, True, "36")


def test_marker_is_case_insensitive_with_optional_spaces():
    assert lenient_score("ANSWER: 34", "34").correct
    assert lenient_score("answer:34", "34").correct
    assert lenient_score("Answer  :  34", "34").correct


def test_marker_anywhere_on_the_line():
    # As in the reference: "final answer: 34" contains the marker.
    assert lenient_score("So the final answer: 34", "34") == Score(1.0, True, "34")


def test_blank_answer_line_is_skipped():
    assert lenient_score("Answer: 34\nAnswer:", "34") == Score(1.0, True, "34")
    assert lenient_score("Answer:\nAnswer:   ", "34") == WRONG


def test_answer_is_rest_of_the_same_line_only():
    assert lenient_score("Answer:\n34", "34") == WRONG


def test_answer_normalising_to_empty_is_wrong_even_against_empty_truth():
    assert lenient_score("Answer: $$", "") == Score(-1.0, False, "")


@pytest.mark.parametrize(
    ("line", "truth", "pred"),
    [
        ("Answer: $34$", "34", "34"),
        ("Answer: \\boxed{34}", "34", "34"),
        ("Answer: $\\boxed{34}$", "34", "34"),
        ("Answer: 34.", "34", "34"),
        ("Answer: 1,000", "1000", "1000"),
        ("Answer: 1,000,000", "1000000", "1000000"),
        ("Answer: 90^\\circ", "90", "90"),
        ("Answer: 90^{\\circ}", "90", "90"),
        ("Answer: 50\\%", "50", "50"),
        ("Answer: 12 cm", "12", "12"),
        ("Answer: \\$5", "5", "5"),
        ("Answer: x = 5", "5", "5"),
        ("Answer: +5", "5", "5"),
        ("Answer: -7", "-7", "-7"),
        ("Answer: - 7", "-7", "-7"),
        ("Answer: \\text{34}", "34", "34"),
        ("Answer: \\left(3\\right)", "(3)", "(3)"),
        ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}"),
    ],
)
def test_normalised_forms_are_correct(line, truth, pred):
    assert lenient_score("Some work.\n" + line, truth) == Score(1.0, True, pred)


def test_int_ground_truth_is_coerced():
    assert lenient_score("Answer: 34", 34) == Score(1.0, True, "34")
    assert lenient_score("Answer: -7", -7) == Score(1.0, True, "-7")


@pytest.mark.parametrize("truth", [None, float("nan"), b"34", True, 34.0])
def test_a_missing_or_odd_ground_truth_rewards_nothing(truth):
    # A row without an answer must not pay a model for writing "Answer: None" (or "nan").
    for text in ("Answer: None", "Answer: nan", "Answer: b'34'", "Answer: True", "Answer: 34.0"):
        assert lenient_score(text, truth).correct is False


def test_ground_truth_is_normalised_too():
    assert lenient_score("Answer: 1000", "$1,000$").correct


def test_no_prefix_matching():
    assert lenient_score("Answer: 3", "34") == Score(-1.0, False, "3")
    assert lenient_score("Answer: 34", "3") == Score(-1.0, False, "34")


def test_two_answers_on_one_line_are_wrong():
    # Whitespace is removed, so "34 or 35" becomes "34or35", not 34.
    assert lenient_score("Answer: 34 or 35", "34") == Score(-1.0, False, "34or35")


def test_no_numeric_canonicalisation():
    # String comparison, like the reference: nothing is parsed as a number.
    assert not lenient_score("Answer: 34.0", "34").correct
    assert not lenient_score("Answer: 034", "34").correct


def test_full_width_digits_are_not_normalised():
    assert lenient_score("Answer: \uff13\uff14", "34") == Score(-1.0, False, "\uff13\uff14")


def test_answer_outside_tail_window_is_not_seen():
    # Only the last TAIL_CHARS characters are read: an answer followed by more
    # text than that is invisible, by design.
    response = "Answer: 34\n" + "x" * (TAIL_CHARS + 1)
    assert lenient_score(response, "34") == WRONG
    # Just inside the window it is found, however long the text before it.
    padded = "y" * 10_000 + "\n" + "Answer: 34" + "z" * (TAIL_CHARS - len("Answer: 34"))
    assert len(padded) > TAIL_CHARS
    assert lenient_score(padded.replace("z", " "), "34").correct


def test_tail_window_cuts_through_marker():
    # The window starts inside "Answer:", so the marker is not seen.
    response = "Answer: " + "9" * (TAIL_CHARS - 3)
    assert lenient_score(response, "9" * (TAIL_CHARS - 3)) == WRONG


def test_nested_boxes_unwrap():
    line = "Answer: " + "\\boxed{" * 20 + "34" + "}" * 20
    assert lenient_score(line, "34") == Score(1.0, True, "34")


def test_unbalanced_box_is_kept_as_written():
    assert lenient_score("Answer: \\boxed{34", "34") == Score(-1.0, False, "\\boxed{34")


# --- hostile input ---------------------------------------------------------------


def test_megabyte_of_random_text():
    rng = random.Random(0)
    text = "".join(rng.choices(string.printable, k=1_000_000))
    result = timed_score(text)
    assert result.score == -1.0 and not result.correct
    # The same text ending in a proper answer line is graded correct.
    assert timed_score(text + "\nAnswer: 34") == Score(1.0, True, "34")


def test_megabyte_of_open_braces():
    assert timed_score("{" * 1_000_000) == WRONG
    assert timed_score("Answer: " + "{" * 1_000_000) == WRONG


def test_deeply_nested_boxed():
    response = "Answer: " + "\\boxed{" * 100_000 + "}" * 100_000
    # The tail holds only closing braces, so there is no marker.
    assert timed_score(response) == WRONG
    # Graded via normalize_answer directly, the whole string is too long to be an
    # answer and comes back stripped only.
    start = time.process_time()
    assert normalize_answer(response) == response
    assert time.process_time() - start < TIME_LIMIT_S


def test_power_tower_is_not_evaluated():
    assert timed_score("Answer: \\boxed{9^{9^{9^9}}}") == Score(-1.0, False, "9^{9^{9^9}}")
    assert timed_score("Answer: \\boxed{9^{9^{9^9}}}", "9^{9^{9^9}}").correct


def test_huge_digit_string():
    assert timed_score("Answer: " + "9" * 10**6) == WRONG
    nines = "9" * (TAIL_CHARS - 20)
    assert timed_score("Answer: " + nines, nines) == Score(1.0, True, nines)
    # An int ground truth over CPython's 4300-digit str() limit must not raise.
    assert timed_score("Answer: 9", 10**5000) == WRONG


@pytest.mark.parametrize(
    "response",
    [
        "Answer: 34\x00",
        "Answer: \x0034",
        "Answer: 34\u202e",
        "\u202eAnswer: 43",
        "Answer: 3\u03014",
        "Answer: 34 \U0001f389",
        "Answer: \ud800",
        "Answer: 34\ud800",
        "\ud800" * 1000,
        "Answer: \u200b34",
        "\u0301" * 100_000,
    ],
    ids=[
        "nul-after",
        "nul-before",
        "rtl-override-after",
        "rtl-override-before",
        "combining-acute",
        "emoji",
        "lone-surrogate",
        "surrogate-after",
        "many-surrogates",
        "zero-width-space",
        "many-combining-marks",
    ],
)
def test_odd_unicode_is_graded_wrong_without_raising(response):
    result = timed_score(response)
    assert result.score == -1.0 and not result.correct
    assert isinstance(result.pred, str)


def test_odd_unicode_whitespace_is_removed():
    # NBSP and the ideographic space are whitespace to Python, so they go.
    assert timed_score("Answer: 3\u00a04\u3000") == Score(1.0, True, "34")


def test_lines_of_only_markers():
    assert timed_score("Answer:\n" * 200_000) == WRONG
    assert timed_score("Answer:" * 200_000) == Score(-1.0, False, "Answer:" * 41)


@pytest.mark.parametrize("response", [None, 34, b"Answer: 34", ["Answer: 34"], object()])
def test_non_string_response_is_wrong(response):
    assert lenient_score(response, "34") == WRONG


# --- normalize_answer ------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  34  ", "34"),
        ("$34$", "34"),
        ("$$34$$", "34"),
        ("\\boxed{34}", "34"),
        ("\\textbf{\\boxed{34}}", "34"),
        ("\\mathrm{34}", "34"),
        ("34.", "34"),
        ("34...", "34"),
        ("1,000", "1000"),
        ("-12,345.5", "-12345.5"),
        ("1,2", "1,2"),
        ("(1,234)", "(1,234)"),
        ("90^\\circ", "90"),
        ("90\u00b0", "90"),
        ("45 degrees", "45"),
        ("50%", "50"),
        ("7 units", "7"),
        ("100 dollars", "100"),
        ("1,000 dollars.", "1000"),
        ("5\\text{ cm}", "5"),
        ("cm", "cm"),
        ("x^\\circ", "x^\\circ"),
        ("+5", "5"),
        ("++5", "++5"),
        ("\\left( 1 \\right)", "(1)"),
        ("\\leftarrow", "\\leftarrow"),
        ("1\\,000", "1000"),
        ("10.0", "10.0"),
        ("010", "010"),
        ("\uff13\uff14", "\uff13\uff14"),
        ("\u22127", "\u22127"),
        ("", ""),
    ],
)
def test_normalize_answer_rules(raw, expected):
    assert normalize_answer(raw) == expected


def test_long_input_is_only_stripped():
    long_text = " \\boxed{" + "1" * MAX_ANSWER_CHARS + "} "
    assert normalize_answer(long_text) == long_text.strip()


IDEMPOTENCE_CASES = [
    "",
    " ",
    "$",
    "\\$",
    "\\$$5",
    "5\\$",
    "$\\boxed{$34$}$",
    "\\boxed{x=5}",
    "\\boxed{\\boxed{34}.}",
    "\\boxed {34}",
    "\\boxed{34",
    "34}",
    "1,000.",
    "1,000 cm.",
    "1, 000",
    "+1,000",
    "+ 5",
    "90^\\circ.",
    "5cmcm",
    "5.cm",
    "\\left\\right",
    "\\\\ ",
    "\\ \\,",
    "\\\\,,",
    "=",
    "a=\\boxed{b=c}",
    "\\text{\\text{}}",
    ". . .",
    " " + "x" * MAX_ANSWER_CHARS + " ",
    " " + "x" * (MAX_ANSWER_CHARS - 1) + " . ",
    "\\boxed{" + "1" * (MAX_ANSWER_CHARS - 8) + "}",
    "\ud800\x00\u202e",
]


@pytest.mark.parametrize("text", IDEMPOTENCE_CASES)
def test_normalize_answer_is_idempotent_on_edge_cases(text):
    once = normalize_answer(text)
    assert normalize_answer(once) == once


# Property-based (hypothesis) tests of the same functions: tests/test_rewards_fuzz.py.
