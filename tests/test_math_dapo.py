"""The paper's verifier (dapo.reward.tasks.math_dapo) in both of its reference versions:
hand-written cases, and agreement with each reference on a corpus of model-like responses and
on fuzzing. ``math_score`` is verl 0.4.1's ``math_dapo.py`` (the DAPO era's: the answer line
only), ``math_score_boxed`` verl 0.9.1's (a ``\\boxed{}`` fallback).

The references are the files themselves, read alone (importing verl would pull in its
training stack): ``.ci/run`` downloads both wheels with ``pip download --no-deps`` and
extracts ``math_dapo-0.4.1.py`` and ``math_dapo-0.9.1.py`` into ``.verl-reference/`` (or
``$DAPO_VERL_REFERENCE``); an installed verl 0.9.1 serves for that version too. A test whose
reference is absent skips."""

from __future__ import annotations

import functools
import importlib.util
import os
import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo.reward.tasks import get_verifier
from dapo.reward.tasks.base import Score
from dapo.reward.tasks.math_dapo import math_score, math_score_boxed, normalize
from dapo.reward.tasks.math_lenient import lenient_score


def _score(response: str, truth: str, grade=math_score) -> tuple[bool, str]:
    s = grade(response, truth)
    return s.correct, s.pred


INVALID = (False, "[INVALID]")


@pytest.mark.parametrize(
    ("response", "truth", "v041", "v091"),
    [
        ("so the sum is 34.\nAnswer: 34", "34", (True, "34"), None),
        ("Answer:\n34", "34", (True, "34"), None),  # the whitespace after the colon spans lines
        ("answer : 34", "34", (True, "34"), None),  # case and spaces
        ("Answer: 7.", "7", (False, "7."), None),  # a trailing full stop stays
        ("Answer: 12\\%", "12", (False, "12\\%"), None),  # so does a percent sign
        ("Answer: 12 students", "12", (True, "12"), None),  # a listed word goes
        ("Answer: 90^\\circ", "90", (True, "90"), None),
        ("Answer: $1,000$", "1000", (True, "1000"), None),
        ("Answer: x = 5", "5", (True, "5"), None),
        ("Answer: \\boxed{72}", "72", (True, "72"), None),
        ("Answer: \\frac12", "\\frac{1}{2}", (True, "\\frac{1}{2}"), None),
        ("Answer: 3\nAnswer: 4", "4", (True, "4"), None),  # the last answer line
        ("Answer: 3 then more\nno answer here", "3", (False, "3thenmore"), None),
        # Without an answer line, 0.4.1 has no answer; 0.9.1 takes the last box, as written.
        ("The answer is \\boxed{9}.", "9", INVALID, (True, "9")),
        ("\\boxed{ 9 }", "9", INVALID, (False, " 9 ")),
        ("Answer: 8\n\\boxed{9}", "9", (False, "8"), None),  # an answer line wins over a box
        ("no answer at all", "5", INVALID, None),
        ("\\boxed{5" + "x" * 120, "5", INVALID, None),  # a box that never closes
    ],
)
def test_the_reference_rules_by_hand(response, truth, v041, v091):
    assert _score(response, truth) == v041
    assert _score(response, truth, math_score_boxed) == (v091 or v041)


def test_only_the_tails_are_read():
    pad = "x" * 400
    assert _score("Answer: 5\n" + pad, "5") == INVALID  # past 300 characters
    box = "\\boxed{5} " + "y" * 95  # the box starts 105 characters from the end
    assert _score(box, "5", math_score_boxed) == INVALID
    assert _score(box[10:] + "\\boxed{5}", "5", math_score_boxed) == (True, "5")


# The box's backslash exactly BOX_TAIL_CHARS = 100 characters from the end ("\\boxed{9}" is 9
# characters, then 91 more), and one further back.
BOX_AT_100 = "work... \\boxed{9}" + "z" * 91
BOX_AT_101 = "work... \\boxed{9}" + "z" * 92


def test_a_box_that_starts_exactly_100_characters_from_the_end_is_read():
    # verl 0.9.1 searches the last 100 characters (pred[-100:]) for the last "\\boxed{": one
    # that starts at the 100th character from the end is inside, one at the 101st is not.
    assert len(BOX_AT_100) - BOX_AT_100.rfind("\\") == 100
    assert _score(BOX_AT_100, "9", math_score_boxed) == (True, "9")
    assert _score(BOX_AT_101, "9", math_score_boxed) == INVALID
    assert _score(BOX_AT_100, "9") == INVALID  # 0.4.1 reads no box at all


# Ground truths written as the reference normalises them (Minerva rules, applied to the truth
# as to the answer line): "$34$" loses its dollars, "1,000" is all digits once its comma goes
# so it loses the comma, and "\\boxed{34}" its box. Each then equals the answer line's "34" or
# "1000"; compared as written, none would.
TRUTHS_TO_NORMALISE = [
    ("Answer: 34", "$34$", (True, "34")),
    ("Answer: 1000", "1,000", (True, "1000")),
    ("Answer: 34", "\\boxed{34}", (True, "34")),
    ("Answer: 35", "$34$", (False, "35")),
]


@pytest.mark.parametrize(("response", "truth", "expected"), TRUTHS_TO_NORMALISE)
def test_the_ground_truth_is_normalised_like_the_answer(response, truth, expected):
    assert _score(response, truth) == expected
    assert _score(response, truth, math_score_boxed) == expected


@pytest.mark.parametrize("grade", [math_score, math_score_boxed])
def test_input_that_cannot_be_graded_is_wrong_without_raising(grade):
    assert grade(None, "5") == Score(-1.0, False, "")  # type: ignore[arg-type]
    assert grade("Answer: None", None) == Score(-1.0, False, "")  # type: ignore[arg-type]
    assert grade("Answer: 5", 5).correct  # an int ground truth is its digits


def test_registered_as_the_default_for_dapo_files_and_mode():
    assert get_verifier("math_dapo") is math_score and get_verifier("dapo") is math_score
    assert get_verifier("math_dapo_boxed") is math_score_boxed


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
    for grade in (math_score, math_score_boxed):
        start = time.process_time()  # CPU time: the work, however busy the machine is
        grade(hostile, "1")
        assert time.process_time() - start < 0.5


# ----------------------------------------------------------------------------- the reference


REFERENCE_DIR = Path(
    os.environ.get("DAPO_VERL_REFERENCE", Path(__file__).resolve().parents[1] / ".verl-reference")
)
VERSIONS = {"0.4.1": math_score, "0.9.1": math_score_boxed}


def _installed_verl(version: str) -> Path | None:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    metadata = list(root.parent.glob(f"verl-{version}.dist-info"))
    return root / "utils/reward_score/math_dapo.py" if metadata else None


@functools.cache
def _reference(version: str):
    path = REFERENCE_DIR / f"math_dapo-{version}.py"
    if not path.is_file():
        path = _installed_verl(version)
    if path is None:
        pytest.skip(
            f"verl {version}'s math_dapo.py is absent: pip download --no-deps verl=={version}, "
            f"then extract verl/utils/reward_score/math_dapo.py as {REFERENCE_DIR}/"
            f"math_dapo-{version}.py (.ci/run does)"
        )
    # The file alone: importing the verl package would pull in its training stack.
    module_spec = importlib.util.spec_from_file_location(f"verl_math_dapo_{version}", path)
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


def model_like_corpus(n: int, seed: int) -> list[tuple[str, str]]:
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


@pytest.mark.parametrize("version", VERSIONS)
def test_agrees_with_the_reference_on_a_corpus_of_model_like_responses(version):
    reference, ours = _reference(version), VERSIONS[version]
    corpus = model_like_corpus(5000, seed=0)
    disagree = []
    for response, truth in corpus:
        ref = reference(response, truth)
        mine = ours(response, truth)
        if (ref["acc"], ref["score"], ref["pred"]) != (mine.correct, mine.score, mine.pred):
            disagree.append((response[-80:], truth, ref, mine))
    assert disagree == []


def test_the_corpus_exercises_where_the_modes_part_ways():
    corpus = model_like_corpus(5000, seed=0)
    differ = sum(lenient_score(r, t).correct != math_score(r, t).correct for r, t in corpus)
    assert differ > 200
    # The boxed fallback changes the grade of every boxed answer without an answer line.
    versions = sum(math_score(r, t).correct != math_score_boxed(r, t).correct for r, t in corpus)
    assert versions > 200


_PIECES = st.sampled_from(
    ["Answer", "answer", ":", " ", "\n", "\t", "$", "\\boxed{", "{", "}", "=", ".", ",", "5", "12"]
    + ["\\text{", "points", "\\%", "frac", "sqrt", "a ", "\\$", "^\\circ", "[INVALID]", "\u00a0"]
)


@pytest.mark.parametrize("version", VERSIONS)
@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=60).map("".join), st.sampled_from(["5", "12", "5.", " 12"]))
def test_agrees_with_the_reference_on_fuzzed_responses(version, response, truth):
    ref = _reference(version)(response, truth)
    ours = VERSIONS[version](response, truth)
    assert (ours.correct, ours.score, ours.pred) == (ref["acc"], ref["score"], ref["pred"])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("response", "truth"),
    [(BOX_AT_100, "9"), (BOX_AT_101, "9")] + [(r, t) for r, t, _ in TRUTHS_TO_NORMALISE],
    ids=["box-at-100", "box-at-101", "dollars", "comma", "boxed", "dollars-wrong"],
)
def test_agrees_with_the_reference_on_the_box_window_and_normalised_truths(
    version, response, truth
):
    ref = _reference(version)(response, truth)
    ours = VERSIONS[version](response, truth)
    assert (ours.correct, ours.score, ours.pred) == (ref["acc"], ref["score"], ref["pred"])


def test_the_first_releases_name_grades_as_the_dapo_verifier():
    from dapo import rewards
    from dapo.reward.tasks import math_dapo

    assert rewards.math_score is math_dapo.math_score
    assert rewards.math_score_boxed is math_dapo.math_score_boxed
    assert rewards.math_score("5 * 7 = 35, minus 1.\nAnswer: 34", "34") == rewards.Score(
        1.0, True, "34"
    )
    wrong = rewards.math_score("Answer: 35", "34")
    assert (wrong.score, wrong.correct, wrong.pred) == (-1.0, False, "35")
