"""Tests for dapo.reward.tasks.math_verify: math-verify grading of non-integer answers.

The verdicts asserted are what math-verify 0.9.0 really returns. Cases in
``LIMITATIONS`` are graded in a way a human grader would not; they are pinned here so
that a change of behaviour (a math-verify upgrade, an extraction change) is noticed.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("math_verify")

import dapo.reward.tasks.math_verify as mv  # noqa: E402
from dapo.reward.pool import FAULT_SCORE, Job, RewardPool  # noqa: E402
from dapo.reward.tasks.base import Score  # noqa: E402
from dapo.reward.tasks.math_lenient import TAIL_CHARS  # noqa: E402
from dapo.reward.tasks.math_verify import MODE_NAME, math_verify_score, resolve  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

# The pool's per-response deadline in the tests below. A fresh worker imports math-verify
# and SymPy as it starts (resolve.prepare: about 0.5-0.7 s on a 2-core machine, more under
# load), not in its first response's deadline: a normal case after a pathological one was
# graded as a timeout in a CI run on a loaded machine when it did.
TIMEOUT_S = 2.0
# A grade() call that meets the deadline must return within this (kill + restart).
HUNG_CALL_LIMIT_S = TIMEOUT_S + 3.0

# (response, ground truth, expected verdict). Positive and negative cases of each kind.
CASES = [
    # fractions and decimals
    ("Answer: 0.5", r"\frac{1}{2}", True),
    (r"Answer: \frac{1}{2}", "0.5", True),
    ("Answer: 3/4", r"\dfrac{3}{4}", True),
    (r"Answer: \dfrac{3}{4}", "0.75", True),
    ("Answer: 1.5", r"\frac{3}{2}", True),
    ("Answer: 0.51", r"\frac12", False),
    # floats are compared after rounding to 6 decimals: 0.333333 is 1/3, 0.333 is not
    ("Answer: 1/3", "0.333333", True),
    ("Answer: 0.333", r"\frac13", False),
    # radicals and constants
    (r"Answer: \sqrt{2}/2", r"\frac{\sqrt{2}}{2}", True),
    (r"Answer: 2\sqrt{3}", r"\sqrt{12}", True),
    (r"Answer: 3\sqrt{2}", r"\sqrt{12}", False),
    (r"Answer: \sqrt[3]{2}", "2^{1/3}", True),
    (r"Answer: \pi/2", r"\frac{\pi}{2}", True),
    (r"Answer: \pi", r"\frac{\pi}{2}", False),
    (r"Answer: \log_2 8", "3", True),
    ("Answer: 3!", "6", True),
    # sets, tuples and intervals
    (r"Answer: \{3,2,1\}", r"\{1,2,3\}", True),
    ("Answer: 1, 2, 3", r"\{1,2,3\}", True),
    (r"Answer: \{1,2\}", r"\{1,2,3\}", False),
    ("Answer: (0, 1]", "(0,1]", True),
    ("Answer: [0,1]", "(0,1]", False),
    (r"Answer: (-\infty, 3)", r"(-\infty,3)", True),
    ("Answer: (2, 1)", "(2,1)", True),  # a point, not an empty interval
    ("Answer: (1, 2)", "(2,1)", False),
    (r"Answer: x \in [0,1]", "[0,1]", True),
    (r"Answer: [0,1]", r"0 \le x \le 1", True),
    # integers, negatives, formatting
    ("Answer: 34", "34", True),
    ("Answer: 35", "34", False),
    ("Answer: -7", "-7", True),
    ("Answer: -3", "3", False),
    ("Answer: 1,000", "1000", True),
    ("Answer: 3.0", "3", True),
    ("Answer: 010", "10", True),  # parsed as a number (DAPO mode's string test says no)
    ("Answer: 12", 12, True),  # an int ground truth, as the string modes accept
    # equations
    ("Answer: x=5", "5", True),
    ("Answer: $x = 5$", "5", True),
    ("Answer: 5", "x=5", True),
    ("Answer: y=5", "x=5", False),
    # polynomials and matrices
    ("Answer: (x+1)^2", "x^2+2x+1", True),
    ("Answer: x+2", "x+1", False),
    (r"Answer: \begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    # degrees, percent, currency, choices
    (r"Answer: 90^\circ", "90", True),
    (r"Answer: 50\%", "0.5", True),
    (r"Answer: 0.05", r"5\%", True),
    (r"Answer: \$5", "5", True),
    (r"Answer: \text{(B)}", "B", True),
    ("Answer: C", r"\text{(B)}", False),
    # extraction: the Answer line, else the last \boxed{}
    (r"Answer: \boxed{\frac{1}{2}}", "0.5", True),
    (r"Answer: $\frac{1}{2}$.", r"\frac12", True),  # the full stop is not part of it
    ("So we get \\boxed{\\frac{1}{2}}.\nThat is all.", "0.5", True),
    (r"The set is \boxed{\{1, 2\}}", r"\{2,1\}", True),
    ("Answer:\n\\boxed{4}", "4", True),  # a blank Answer line is no answer: the box is
    ("\\boxed{7}\nAnswer: 8", "8", True),  # the Answer line wins over a box
    ("\\boxed{7}\nAnswer: 8", "7", False),
    (r"\boxed{7} and then \boxed{\frac{1}{2", "7", False),  # only the last box counts
    (r"Answer: \frac{1}{2", "0.5", False),  # unbalanced: math-verify cannot parse it
    ("Answer: 5\n" + "x" * TAIL_CHARS, "5", False),  # the answer is outside the tail
    ("I could not solve it.", "5", False),
    ("", "0", False),
    ("Answer: 5", "", False),  # an empty ground truth matches nothing
]

# Limitations, asserted as they are (see the module docstring of this file).
LIMITATIONS = [
    # "i" is a plain symbol unless the LaTeX looks complex to math-verify, so Euler's
    # identity and sqrt(-1) are not recognised.
    (r"Answer: e^{i\pi}", "-1", False),
    (r"Answer: \sqrt{-1}", "i", False),
    # Plain-text units are read as a product of symbols (DAPO mode strips "dollars";
    # math-verify strips only units it knows in LaTeX, such as \text{ cm}).
    ("Answer: 5 dollars", "5", False),
    # Prose on the Answer line is parsed as symbols too: the line must be the answer.
    ("Answer: The answer is 5", "5", False),
    # Only a full stop is stripped from the end of the answer.
    ("Answer: 3,", "3", False),
    # No conversion between degrees and radians.
    (r"Answer: \frac{\pi}{2}", r"90^\circ", False),
    # A relation in the response is not compared with a set in the ground truth
    # (math-verify's allow_set_relation_comp=False); the other way round works (CASES).
    (r"Answer: 0 \le x \le 1", "[0,1]", False),
    # Percent is lenient: 5% equals both 0.05 (CASES) and 5.
    (r"Answer: 5\%", "5", True),
    # Floats equal after rounding to 6 decimals count as equal.
    ("Answer: 0.5000001", r"\frac12", True),
]


@pytest.mark.parametrize(("response", "ground_truth", "correct"), CASES + LIMITATIONS)
def test_case_table(response, ground_truth, correct):
    score = math_verify_score(response, ground_truth)
    assert score.correct is correct
    assert score.score == (1.0 if correct else -1.0)
    assert isinstance(score.pred, str) and len(score.pred) <= TAIL_CHARS


def test_case_table_is_large_and_mixed():
    verdicts = [correct for *_, correct in CASES]
    assert len(CASES) >= 25 and sum(verdicts) >= 10 and len(verdicts) - sum(verdicts) >= 10


@pytest.mark.parametrize(
    ("response", "pred"),
    [
        (r"Answer: $\frac{1}{2}$.", r"$\frac{1}{2}$"),
        ("so \\boxed{\\frac{\\sqrt{2}}{2}} it is", r"\frac{\sqrt{2}}{2}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
        (r"\boxed{\boxed{5}}", "5"),
        ("\\boxed{7}\nthe answer: 8 ", "8"),
        ("no answer here", ""),
        (r"\boxed{\frac{1}{2", ""),
        ("Answer:   ", ""),
    ],
)
def test_pred_is_the_extracted_answer(response, pred):
    assert math_verify_score(response, "1").pred == pred


@pytest.mark.parametrize("response", [None, b"Answer: 1", 1, 1.0, ["Answer: 1"], object()])
def test_non_str_response_is_incorrect(response):
    assert math_verify_score(response, "1") == Score(score=-1.0, correct=False, pred="")


@pytest.mark.parametrize(
    "ground_truth",
    [None, 1.0, b"1", True, ["1"], object(), 10**5000],
    ids=["None", "float", "bytes", "bool", "list", "object", "huge-int"],
)
def test_unusable_ground_truth_is_incorrect(ground_truth):
    # 10**5000: str() raises ValueError above 4300 digits.
    assert math_verify_score("Answer: 1", ground_truth) == Score(-1.0, False, "")


def test_gold_answers_are_parsed_once():
    mv.parse_gold.cache_clear()
    for response in ("Answer: 0.5", "Answer: 1/2", r"Answer: \frac{2}{4}"):
        assert math_verify_score(response, r"\frac{1}{2}").correct
    info = mv.parse_gold.cache_info()
    assert (info.misses, info.hits, info.maxsize) == (1, 2, mv.GOLD_CACHE_SIZE)


def test_memory_error_reaches_the_pool(monkeypatch):
    # math-verify turns every exception into "not equal" unless told to raise; a
    # MemoryError must instead reach RewardPool, which counts it and replaces the worker.
    parse, _, config = mv.math_verify_api()

    def verify(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(mv, "math_verify_api", lambda: (parse, verify, config))
    with pytest.raises(MemoryError):
        math_verify_score("Answer: 1", "1")
    with RewardPool(workers=0, resolve=resolve) as pool:
        result = pool.grade([Job(MODE_NAME, "Answer: 1", "1")])
    assert result.scores == [FAULT_SCORE]
    assert [fault.kind for fault in result.faults] == ["memory"]


def test_resolve_is_picklable_and_grades_any_source():
    assert pickle.loads(pickle.dumps(resolve)) is resolve
    assert resolve(MODE_NAME) is math_verify_score
    assert resolve("anything") is math_verify_score


def test_a_worker_imports_math_verify_as_it_starts_not_in_a_deadline():
    code = (
        "import sys\n"
        "import dapo.reward.tasks.math_verify as mv\n"
        "assert 'sympy' not in sys.modules\n"
        "mv.resolve.prepare()\n"
        "assert 'sympy' in sys.modules and 'math_verify' in sys.modules\n"
        "assert mv.math_verify_api.cache_info().currsize == 1\n"
    )
    assert_runs_silently(code)


def test_sympy_is_imported_only_on_first_use_and_nothing_is_printed():
    code = (
        "import sys\n"
        "import dapo.reward.tasks, dapo.reward.pool, dapo.reward.tasks.math_verify as mv\n"
        "assert 'sympy' not in sys.modules and 'math_verify' not in sys.modules\n"
        "assert mv.math_verify_score('Answer: 0.5', r'\\frac{1}{2}').correct\n"
        "assert 'sympy' in sys.modules\n"
    )
    # math-verify warns that its timeouts are off, once per process: every new reward
    # worker would print it. The module filters that warning out.
    assert_runs_silently(code)


def assert_runs_silently(code: str) -> None:
    """``code`` passes in a fresh interpreter (its imports counted from nothing) and prints
    nothing."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


# Parses in milliseconds (SymPy evaluates lazily), then verify() tries to evaluate
# the tower and runs on (still running after 10 s when tried outside the pool).
TOWER = "9^{9^{9^{9^{9}}}}"

NORMAL = [
    Job(MODE_NAME, r"Answer: \frac{1}{2}", "0.5"),
    Job(MODE_NAME, r"Answer: \{3,2,1\}", r"\{1,2,3\}"),
    Job(MODE_NAME, "Answer: [0,1]", "(0,1]"),
]


def expected_normal() -> list[Score]:
    expected = [math_verify_score(job.response, job.answer) for job in NORMAL]
    assert [score.correct for score in expected] == [True, True, False]
    return expected


def test_pathological_response_times_out_and_the_pool_recovers():
    expected = expected_normal()
    with RewardPool(workers=1, timeout_s=TIMEOUT_S, resolve=resolve) as pool:
        start = time.monotonic()
        result = pool.grade([Job(MODE_NAME, f"Answer: {TOWER}", "1")])
        assert time.monotonic() - start < HUNG_CALL_LIMIT_S
        assert result.scores == [FAULT_SCORE]
        assert [fault.kind for fault in result.faults] in (["timeout"], ["memory"])
        # The replacement worker grades normally.
        assert pool.grade(NORMAL).scores == expected


def test_faults_mid_batch_cost_only_their_own_responses():
    expected = expected_normal()
    jobs = [
        NORMAL[0],
        Job(MODE_NAME, "Answer: 1", TOWER),  # a hostile ground truth costs the same
        NORMAL[1],
        Job(MODE_NAME, "Answer: (10^{8})!", "1"),  # about 7.6e8 digits
        NORMAL[2],
    ]
    with RewardPool(workers=1, timeout_s=TIMEOUT_S, resolve=resolve) as pool:
        result = pool.grade(jobs)
    assert result.scores == [expected[0], FAULT_SCORE, expected[1], FAULT_SCORE, expected[2]]
    assert [fault.index for fault in result.faults] == [1, 3]
    assert all(fault.kind in ("timeout", "memory") for fault in result.faults)


# maj@k votes with what an answer means, not how it is written -----------------------------


@pytest.mark.parametrize("answer", [r"$\frac{1}{2}$", "1/2", "0.5", r"\dfrac12", r"\frac{2}{4}"])
def test_equal_answers_written_differently_share_a_vote(answer):
    score = math_verify_score(f"Answer: {answer}", "1/2")
    assert (score.correct, score.pred, score.vote) == (True, answer.strip(), "1/2")
    assert math_verify_score("Answer: 3", "1/2").vote == "3"
    assert math_verify_score("no answer here", "1/2").vote is None


class Writes:
    """An engine whose k rows of a prompt write ``texts`` (the tokens are placeholders)."""

    exact_logprobs = True
    stop_token_ids = (0,)

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def generate(self, prompts, *, group_size, **_):
        import torch

        from dapo.rollout import Rollout

        rows = len(prompts) * group_size
        ids = torch.ones((rows, 1), dtype=torch.long)
        return Rollout(
            prompt_ids_BP=ids, prompt_mask_BP=torch.ones_like(ids), response_ids_BT=ids,
            response_mask_BT=torch.ones_like(ids, dtype=torch.bool),
            logprobs_BT=torch.zeros((rows, 1)), lengths_B=torch.ones(rows, dtype=torch.long),
            truncated_B=torch.zeros(rows, dtype=torch.bool), texts=self.texts * len(prompts),
            slots=rows,
        )  # fmt: skip


def test_maj_at_k_of_an_evaluation_counts_equal_answers_as_one():
    """Three responses write 1/2 three ways, two write 3: the majority means 1/2 (maj@k 1),
    where a vote on the text would pick 3 (maj@k 0). Graded by a worker process, so the
    vote also crosses the pool's pipe."""
    from dapo.data.problems import Problem
    from dapo.eval.evaluate import evaluate

    texts = [rf"Answer: {a}" for a in (r"\frac{1}{2}", "3", "1/2", "3", "0.5")]
    problem = Problem("p", ({"role": "user", "content": "half?"},), "1/2", "math")
    records: list[dict] = []
    with RewardPool(workers=1, timeout_s=60) as pool:
        out = evaluate(
            Writes(texts), None, [problem], num_samples=5, temperature=1.0, top_p=1.0,
            max_new_tokens=1, seed=0, pool=pool, reward_mode=MODE_NAME, resamples=10,
            records_out=records, chat_template=False,
        )  # fmt: skip
    assert records[0]["votes"] == ["1/2", "3", "1/2", "3", "1/2"]
    assert records[0]["answers"] == [r"\frac{1}{2}", "3", "1/2", "3", "0.5"]
    assert out["val/maj@k"] == 1.0 and out["val/accuracy"] == pytest.approx(0.6)
