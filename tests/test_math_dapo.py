"""The paper's verifier (dapo.reward.tasks.math_dapo): hand-written cases, and agreement with the
reference (verl 0.9.1's math_dapo.py, loaded from its file when verl is installed:
``pip install --no-deps verl==0.9.1``) on a corpus of model-like responses and on fuzzing."""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo.reward.tasks import get_verifier
from dapo.reward.tasks.base import Score
from dapo.reward.tasks.math_dapo import math_score, normalize
from dapo.reward.tasks.math_lenient import lenient_score


def _score(response: str, truth: str) -> tuple[bool, str]:
    s = math_score(response, truth)
    return s.correct, s.pred


@pytest.mark.parametrize(
    ("response", "truth", "correct", "pred"),
    [
        ("so the sum is 34.\nAnswer: 34", "34", True, "34"),
        ("Answer:\n34", "34", True, "34"),  # the whitespace after the colon spans lines
        ("answer : 34", "34", True, "34"),  # case and spaces
        ("Answer: 7.", "7", False, "7."),  # a trailing full stop stays
        ("Answer: 12\\%", "12", False, "12\\%"),  # so does a percent sign
        ("Answer: 12 students", "12", True, "12"),  # a listed word goes
        ("Answer: 90^\\circ", "90", True, "90"),
        ("Answer: $1,000$", "1000", True, "1000"),
        ("Answer: x = 5", "5", True, "5"),
        ("Answer: \\boxed{72}", "72", True, "72"),
        ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
        ("Answer: 3\nAnswer: 4", "4", True, "4"),  # the last answer line
        ("Answer: 3 then more\nno answer here", "3", False, "3thenmore"),
        ("The answer is \\boxed{9}.", "9", True, "9"),  # no answer line: the last box
        ("\\boxed{ 9 }", "9", False, " 9 "),  # a box is compared as written
        ("Answer: 8\n\\boxed{9}", "9", False, "8"),  # an answer line wins over a box
        ("no answer at all", "5", False, "[INVALID]"),
        ("\\boxed{5" + "x" * 120, "5", False, "[INVALID]"),  # a box that never closes
    ],
)
def test_the_reference_rules_by_hand(response, truth, correct, pred):
    assert _score(response, truth) == (correct, pred)


def test_only_the_tails_are_read():
    pad = "x" * 400
    assert _score("Answer: 5\n" + pad, "5") == (False, "[INVALID]")  # past 300 characters
    box = "\\boxed{5} " + "y" * 95  # the box starts 105 characters from the end
    assert _score(box, "5") == (False, "[INVALID]")
    assert _score(box[10:] + "\\boxed{5}", "5") == (True, "5")


def test_input_that_cannot_be_graded_is_wrong_without_raising():
    assert math_score(None, "5") == Score(-1.0, False, "")  # type: ignore[arg-type]
    assert math_score("Answer: None", None) == Score(-1.0, False, "")  # type: ignore[arg-type]
    assert math_score("Answer: 5", 5).correct  # an int ground truth is its digits


def test_registered_as_the_default_for_dapo_files_and_mode():
    assert get_verifier("math_dapo") is math_score and get_verifier("dapo") is math_score


def test_normalize_examples():
    assert normalize(" \\text{12} ") == "12"
    assert normalize("\\textbf{3}") == "3"
    assert normalize("\\sqrt2") == "\\sqrt{2}"
    assert normalize("a ways") == ""  # "a " and "ways" both go


@pytest.mark.parametrize(
    "hostile",
    [
        "$" * 10**6,
        "Answer: " + "$a" * 200,
        "Answer:" + " " * 10**6,
        "{" * 10**6 + "\\boxed{",
        "\\boxed{" * 10**5,
        "Answer: " + "frac" * 100,
        "Answer: " + "\\text{" * 100,
    ],
)
def test_hostile_responses_are_graded_in_bounded_time(hostile):
    start = time.perf_counter()
    math_score(hostile, "1")
    assert time.perf_counter() - start < 0.5


# ----------------------------------------------------------------------------- the reference


def _reference():
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    path = Path(next(iter(spec.submodule_search_locations)), "utils/reward_score/math_dapo.py")
    # The file alone: importing the verl package would pull in its training stack.
    module_spec = importlib.util.spec_from_file_location("verl_math_dapo_reference", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.compute_score


ANSWERS = ["34", "7", "1000", "-3", "0", "12", "204", "\\frac{1}{2}", "2\\sqrt{3}", "x+1"]
DECOR = [
    "{a}", "{a}.", "${a}$", "$ {a} $", "\\boxed{{{a}}}", "{a} points", "{a} ways", "{a}\\%",
    "{a}^\\circ", "\\text{{{a}}}", "x = {a}", "{a} students", "**{a}**", "{a} cm", "1,{a}",
    "{a}\n", " {a} ", "\\textbf{{{a}}}", "\\({a}\\)", "{a} square units", "\\overline{{{a}}}",
]  # fmt: skip
MARKERS = [
    "Answer: ",
    "Answer:",
    "answer: ",
    "ANSWER : ",
    "Answer:\n",
    "Answer: \n",
    "Final Answer: ",
]


def _corpus(n: int, seed: int) -> list[tuple[str, str]]:
    """Model-like responses: reasoning, then an answer in one of many spellings (or none)."""
    rng = random.Random(seed)
    words = "so we get the value of x is then wait let me check compute sum".split()
    out = []
    for _ in range(n):
        truth = rng.choice(ANSWERS)
        shown = truth if rng.random() < 0.6 else rng.choice(ANSWERS)
        body = " ".join(rng.choice(words) for _ in range(rng.randint(0, 80)))
        answer = rng.choice(DECOR).format(a=shown)
        kind = rng.random()
        if kind < 0.75:
            tail = rng.choice(MARKERS) + answer
            if rng.random() < 0.2:
                tail += rng.choice(["\n", " I think.", "\nDone.", "\n" + "z" * rng.randint(0, 320)])
        elif kind < 0.9:
            tail = f"The answer is \\boxed{{{shown}}}" + rng.choice(["", ".", " " * 95])
        else:
            tail = rng.choice(["", "I give up.", "Answer:", "\\boxed{"])
        out.append((body + "\n" + tail, truth if rng.random() < 0.9 else f" {truth}"))
    return out


def test_agrees_with_the_reference_on_a_corpus_of_model_like_responses():
    reference = _reference()
    corpus = _corpus(5000, seed=0)
    disagree = []
    for response, truth in corpus:
        ref = reference(response, truth)
        ours = math_score(response, truth)
        if (ref["acc"], ref["score"], ref["pred"]) != (ours.correct, ours.score, ours.pred):
            disagree.append((response[-80:], truth, ref, ours))
    assert disagree == []
    # The corpus exercises the rules where the modes part ways.
    differ = sum(lenient_score(r, t).correct != math_score(r, t).correct for r, t in corpus)
    assert differ > 200


_PIECES = st.sampled_from(
    ["Answer", "answer", ":", " ", "\n", "\t", "$", "\\boxed{", "{", "}", "=", ".", ",", "5", "12"]
    + ["\\text{", "points", "\\%", "frac", "sqrt", "a ", "\\$", "^\\circ", "[INVALID]", "\u00a0"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=60).map("".join), st.sampled_from(["5", "12", "5.", " 12"]))
def test_agrees_with_the_reference_on_fuzzed_responses(response, truth):
    ref = _reference()(response, truth)
    ours = math_score(response, truth)
    assert (ours.correct, ours.score, ours.pred) == (ref["acc"], ref["score"], ref["pred"])
