"""Evaluation statistics: exact estimators, voting, phrase counting and bootstrap behaviour."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from dapo.eval.intervals import (
    crossed_bootstrap_ci,
    fraction_ci,
    paired_fraction_ci,
)
from dapo.eval.metrics import (
    REFLECTIVE_PHRASES,
    Interval,
    bootstrap_ci,
    compare,
    majority_vote,
    paired_bootstrap_ci,
    paired_permutation_pvalue,
    pass_at_k,
    problem_metrics,
    reflection_count,
    summarize,
)


def _brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    # samples 0..c-1 are the correct ones; count the k-subsets that contain one of them
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in subset) for subset in subsets)
    return Fraction(hits, len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_brute_force_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            # the estimator rounds once from the exact rational, so equality is exact
            assert pass_at_k(n, c, k) == float(_brute_force_pass_at_k(n, c, k)), (n, c, k)
    for k in range(1, n + 1):
        assert pass_at_k(n, 0, k) == 0.0
        assert pass_at_k(n, n, k) == 1.0


def test_pass_at_k_large_n_stays_exact_and_in_range():
    value = pass_at_k(1024, 3, 512)
    exact = 1 - Fraction(math.comb(1021, 512), math.comb(1024, 512))
    assert value == float(exact)
    assert pass_at_k(1024, 1, 1) == 1 / 1024


@pytest.mark.parametrize(
    ("n", "c", "k", "fragment"),
    [
        (4, 1, 5, "k <= n"),
        (4, 1, 0, "k >= 1"),
        (4, -1, 2, "c=-1"),
        (4, 5, 2, "c=5"),
    ],
)
def test_pass_at_k_rejects_invalid_arguments(n, c, k, fragment):
    with pytest.raises(ValueError, match=fragment):
        pass_at_k(n, c, k)


def test_majority_vote_clear_winner():
    answers = ["3", "5", "5", "7", "5"]
    correct = [False, True, True, False, True]
    assert majority_vote(answers, correct) == ("5", True)


def test_majority_vote_tie_goes_to_answer_whose_first_occurrence_is_earliest():
    # "9" and "4" both get two votes; "9" appears first
    answers = ["9", "4", "4", "9"]
    assert majority_vote(answers, [False, True, True, False]) == ("9", False)
    assert majority_vote(list(reversed(answers)), [False, True, True, False]) == ("9", False)
    assert majority_vote(["4", "9", "9", "4"], [True, False, False, True]) == ("4", True)


def test_majority_vote_ignores_missing_answers():
    answers = [None, "", None, "2", ""]
    assert majority_vote(answers, [False, False, False, True, False]) == ("2", True)


def test_majority_vote_nobody_answered():
    assert majority_vote([None, "", None], [False, False, False]) == (None, False)
    assert majority_vote([], []) == (None, False)


def test_majority_vote_correct_flag_follows_the_winner():
    # the single correct response loses the vote, so maj is wrong
    answers = ["1", "2", "2", "3"]
    assert majority_vote(answers, [True, False, False, False]) == ("2", False)
    assert majority_vote(answers, [False, True, True, False]) == ("2", True)
    with pytest.raises(ValueError):
        majority_vote(["1", "2"], [True])


def test_reflection_count_is_case_insensitive():
    assert reflection_count("WAIT. Wait, wait") == 3
    assert reflection_count("Let Me Check the sum") == 1


def test_reflection_count_respects_word_boundaries():
    assert reflection_count("waiting for the awaited result") == 0
    assert reflection_count("I am double-checking; verifying") == 0
    assert reflection_count("(wait) re-check, recheck!") == 3
    assert reflection_count("") == 0


def test_reflection_count_counts_overlapping_phrases_per_phrase():
    # "let me verify" matches both "let me verify" and "verify"
    assert reflection_count("Let me verify.") == 2
    # "let me check" and "re-check" share nothing; "double-check" is one phrase
    assert reflection_count("let me check, then double-check") == 2
    assert reflection_count("let me\n  verify") == 2
    assert reflection_count("wait wait", phrases=("wait", "wait wait")) == 3
    assert "verify" in REFLECTIVE_PHRASES


def test_problem_metrics_on_hand_made_problem():
    metrics = problem_metrics(
        correct=[True, False, True, False],
        answers=["42", "41", "42", None],
        lengths=[10, 20, 30, 40],
        truncated=[False, False, False, True],
        texts=["Wait, let me verify.", "waiting", "Let me check. Wait. wait", ""],
        ks=(1, 2, 4),
    )
    expected = {
        "avg@k": 0.5,
        "pass@1": 0.5,
        "pass@2": 5 / 6,  # 1 - C(2, 2) / C(4, 2)
        "pass@4": 1.0,
        "maj@k": 1.0,
        "len_mean": 25.0,
        "len_max": 40.0,
        "truncated_frac": 0.25,
        "reflections": 1.5,  # (3 + 0 + 3 + 0) / 4
        "reflective_frac": 0.5,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-15), key


def test_problem_metrics_wrong_majority_and_errors():
    metrics = problem_metrics(
        correct=[True, False, False],
        answers=["1", "2", "2"],
        lengths=[5, 5, 5],
        truncated=[False] * 3,
        texts=["", "", ""],
        ks=(1,),
    )
    assert metrics["maj@k"] == 0.0
    assert metrics["pass@1"] == pytest.approx(1 / 3)
    assert metrics["reflective_frac"] == 0.0
    with pytest.raises(ValueError, match=r"pass@4.*n=3"):
        problem_metrics([True] * 3, ["1"] * 3, [1] * 3, [False] * 3, [""] * 3, ks=(1, 4))
    with pytest.raises(ValueError):
        problem_metrics([True] * 3, ["1"] * 2, [1] * 3, [False] * 3, [""] * 3, ks=(1,))


def test_interval_str():
    assert str(Interval(0.40625, 0.3521, 0.4609)) == "0.406 [0.352, 0.461]"


def test_bootstrap_coverage_and_width_for_bernoulli_mean():
    p, n, trials = 0.3, 200, 200
    covered = 0
    widths = []
    for trial in range(trials):
        values = np.random.default_rng(1000 + trial).binomial(1, p, size=n).astype(float)
        interval = bootstrap_ci(values, resamples=2000, seed=trial)
        assert interval.low <= interval.mean <= interval.high
        covered += interval.low <= p <= interval.high
        widths.append(interval.high - interval.low)
    coverage = covered / trials
    mean_width = float(np.mean(widths))
    normal_width = 2 * 1.96 * math.sqrt(p * (1 - p) / n)
    print(f"coverage {coverage:.3f}, mean width {mean_width:.4f} (normal {normal_width:.4f})")
    assert coverage >= 0.90
    assert abs(mean_width - normal_width) <= 0.15 * normal_width


def test_bootstrap_is_reproducible_per_seed():
    values = np.random.default_rng(7).normal(size=150)
    first = bootstrap_ci(values, resamples=1000, seed=3)
    assert bootstrap_ci(values, resamples=1000, seed=3) == first
    other = bootstrap_ci(values, resamples=1000, seed=4)
    assert other.mean == first.mean
    assert (other.low, other.high) != (first.low, first.high)


def test_bootstrap_chunking_and_edge_cases():
    # more resamples than fit in one chunk for this many problems still fills every slot
    values = np.arange(5000, dtype=float) % 2
    interval = bootstrap_ci(values, resamples=2000, seed=0)
    assert interval.mean == 0.5
    assert 0.48 < interval.low < 0.5 < interval.high < 0.52
    assert bootstrap_ci([0.25], resamples=10) == Interval(0.25, 0.25, 0.25)
    with pytest.raises(ValueError):
        bootstrap_ci([])
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, float("nan")])
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, 0.0], level=1.0)


def test_fraction_interval_keeps_a_width_where_every_problem_scores_the_same():
    # Wilson's score interval, z = 1.959964 (z^2 = 3.841459): at p = 0 its upper end is
    # z^2 / (n + z^2), at p = 1 its lower end 1 minus that; the bootstrap's was [0, 0] / [1, 1].
    z2 = 1.959963984540054**2
    none = fraction_ci([0.0] * 30, resamples=100)
    assert (none.mean, none.low) == (0.0, 0.0)
    assert none.high == pytest.approx(z2 / (30 + z2), rel=1e-12)
    assert none.high == pytest.approx(0.113513, abs=1e-6)
    every = fraction_ci([1.0] * 30, resamples=100)
    assert (every.mean, every.high) == (1.0, 1.0)
    assert every.low == pytest.approx(30 / (30 + z2), rel=1e-12)
    # one problem at 0.5: centre 0.5, half width sqrt(z^2 / 4 + z^4 / 4) / (1 + z^2) = 0.445379
    one = fraction_ci([0.5], resamples=100)
    assert one.mean == 0.5
    assert one.low == pytest.approx(0.5 - 0.445379, abs=1e-6)
    assert one.high == pytest.approx(0.5 + 0.445379, abs=1e-6)
    # with any spread it is the bootstrap, draw for draw
    values = [0.0, 0.25, 1.0, 1.0, 0.5]
    assert fraction_ci(values, resamples=500, seed=3) == bootstrap_ci(values, resamples=500, seed=3)
    with pytest.raises(ValueError, match=r"avg@k must be fractions in \[0, 1\]"):
        fraction_ci([0.5, 1.5], name="avg@k")


def test_summary_of_an_evaluation_nothing_solved_has_an_interval_of_some_width():
    records = [{"avg@k": 0.0, "pass@32": 0.0, "len_mean": 12.0} for _ in range(30)]
    summary = summarize(records, resamples=500, seed=0)
    assert summary["avg@k"].high == summary["pass@32"].high == pytest.approx(0.113513, abs=1e-6)
    # a length is no fraction: where every problem has the same, so has the interval
    assert summary["len_mean"] == Interval(12.0, 12.0, 12.0)
    both = compare({i: r for i, r in enumerate(records)}, {i: r for i, r in enumerate(records)})
    assert both["avg@k"]["a"] == summary["avg@k"]


def test_a_paired_fraction_difference_keeps_a_width_where_every_difference_is_the_same():
    """Two evaluations solving nothing, or one problem, read B - A as 0.000 [0.000, 0.000]:
    certainty that the same problems do not give (each side kept a width, the difference not).
    There q = z^2 / (n + z^2) bounds the share of problems whose difference is another, and
    such a difference lies in [-1, 1]."""
    z2 = 1.959963984540054**2
    nothing = paired_fraction_ci([0.0] * 30, [0.0] * 30, resamples=100)
    assert nothing.mean == 0.0
    assert nothing.high == pytest.approx(z2 / (30 + z2), rel=1e-12) == -nothing.low
    assert nothing.high == pytest.approx(0.113513, abs=1e-6)  # each side's own upper end
    # one problem, 0.375 better: q = z^2 / (1 + z^2) = 0.793451
    one = paired_fraction_ci([0.0], [0.375], resamples=100)
    assert one.mean == 0.375
    assert one.low == pytest.approx(0.375 - 0.793451 * 1.375, abs=1e-6)
    assert one.high == pytest.approx(0.375 + 0.793451 * 0.625, abs=1e-6)
    # better by 1/10 on each, in floats that differ in their last bits: the same difference
    tenth = paired_fraction_ci([0.1, 0.3, 0.6], [0.2, 0.4, 0.7], resamples=100)
    q = z2 / (3 + z2)
    assert tenth.mean == pytest.approx(0.1, abs=1e-15)
    assert tenth.low == pytest.approx(0.1 - q * 1.1, abs=1e-12)
    assert tenth.high == pytest.approx(0.1 + q * 0.9, abs=1e-12)
    # all better by 1: the upper end is 1 itself
    assert paired_fraction_ci([0.0] * 3, [1.0] * 3).high == 1.0
    # any spread in the differences: the paired bootstrap, draw for draw
    a, b = [0.0, 0.25, 1.0, 0.5], [0.5, 0.25, 1.0, 1.0]
    assert paired_fraction_ci(a, b, resamples=300, seed=2) == paired_bootstrap_ci(
        a, b, resamples=300, seed=2
    )
    with pytest.raises(ValueError, match=r"b must be fractions in \[0, 1\]"):
        paired_fraction_ci([0.5], [1.5])
    records_a = {i: {"avg@k": 0.0, "len_mean": 12.0} for i in range(30)}
    records_b = {i: {"avg@k": 0.0, "len_mean": 14.0} for i in range(30)}
    both = compare(records_a, records_b, resamples=200)
    assert both["avg@k"]["diff"] == nothing
    assert both["len_mean"]["diff"] == Interval(2.0, 2.0, 2.0)  # no fraction: no bound to take


def test_summarize_uses_keys_shared_by_all_records():
    records = [
        {"avg@k": 1.0, "len_max": 10.0, "extra": 1.0},
        {"avg@k": 0.0, "len_max": 30.0},
    ]
    summary = summarize(records, resamples=500, seed=0)
    assert list(summary) == ["avg@k", "len_max"]
    assert summary["avg@k"].mean == 0.5
    assert summary["len_max"].mean == 20.0  # mean of per-problem maxima
    assert summary["avg@k"] == bootstrap_ci([1.0, 0.0], resamples=500, seed=0)
    with pytest.raises(ValueError):
        summarize([])


def test_permutation_pvalue_identical_inputs():
    a = [1.0, 0.0, 0.5, 1.0]
    assert paired_permutation_pvalue(a, list(a)) == 1.0
    assert paired_bootstrap_ci(a, list(a)) == Interval(0.0, 0.0, 0.0)


def test_permutation_pvalue_clear_improvement():
    a = np.array([1.0] * 50 + [0.0] * 50)
    b = a.copy()
    b[50:80] = 1.0  # thirty wrong problems become right
    p = paired_permutation_pvalue(a, b)
    assert p < 0.01
    assert p == pytest.approx(1 / 10_001)
    diff = paired_bootstrap_ci(a, b)
    assert diff.mean == pytest.approx(0.3)
    assert diff.low > 0


def test_permutation_pvalue_small_symmetric_difference():
    a = np.zeros(100)
    b = a.copy()
    b[:3] = 1.0
    b[3:5] = -1.0  # net difference of one problem in a hundred
    assert paired_permutation_pvalue(a, b) > 0.5
    b_balanced = a.copy()
    b_balanced[:2], b_balanced[2:4] = 1.0, -1.0
    assert paired_permutation_pvalue(a, b_balanced) == 1.0
    with pytest.raises(ValueError, match="length"):
        paired_permutation_pvalue([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="length"):
        paired_bootstrap_ci([1.0, 0.0], [1.0])


def test_compare_on_hand_made_evaluations():
    a = {
        "p1": {"avg@k": 0.0, "len_mean": 100.0},
        "p2": {"avg@k": 0.5, "len_mean": 120.0},
        "p3": {"avg@k": 1.0, "len_mean": 90.0},
        "p4": {"avg@k": 0.25, "len_mean": 200.0},
        "only_a": {"avg@k": 1.0, "len_mean": 50.0},
    }
    b = {
        "p4": {"avg@k": 0.5, "len_mean": 150.0, "extra": 1.0},
        "p3": {"avg@k": 1.0, "len_mean": 80.0, "extra": 1.0},
        "p2": {"avg@k": 0.75, "len_mean": 110.0, "extra": 1.0},
        "p1": {"avg@k": 1.0, "len_mean": 60.0, "extra": 1.0},
        "only_b": {"avg@k": 0.0, "len_mean": 10.0, "extra": 1.0},
    }
    result = compare(a, b, resamples=2000, seed=0)
    assert set(result) == {"avg@k", "len_mean", "changed"}

    accuracy = result["avg@k"]
    assert set(accuracy) == {"a", "b", "diff", "p"}
    assert accuracy["a"].mean == pytest.approx((0.0 + 0.5 + 1.0 + 0.25) / 4)  # only_a dropped
    assert accuracy["b"].mean == pytest.approx((1.0 + 0.75 + 1.0 + 0.5) / 4)  # only_b dropped
    assert accuracy["diff"].mean == pytest.approx(0.375)
    assert 0.0 <= accuracy["diff"].low <= accuracy["diff"].mean <= accuracy["diff"].high
    assert 0.0 < accuracy["p"] <= 1.0

    length = result["len_mean"]
    assert length["diff"].mean == pytest.approx(-27.5)  # (-40 - 10 - 10 - 50) / 4
    assert length["diff"].high < 0  # b is shorter on every shared problem

    # largest improvement first; p2 and p4 tie at +0.25 and keep uid order; p3 is unchanged
    assert result["changed"] == [("p1", 0.0, 1.0), ("p2", 0.5, 0.75), ("p4", 0.25, 0.5)]

    # mapping order does not matter
    reordered = compare(dict(reversed(list(a.items()))), b, resamples=2000, seed=0)
    assert reordered == result

    with pytest.raises(ValueError, match="share no problems"):
        compare({"x": {"avg@k": 1.0}}, {"y": {"avg@k": 1.0}})


def test_pick_samples_takes_shortest_correct_first_wrong_and_reflective():
    from dapo.eval.metrics import pick_samples

    records = [
        {
            "uid": "p0",
            "ground_truth": "7",
            "responses": ["a long one\nAnswer: 7", "Answer: 7", "Wait, 3 + 4\nAnswer: 8"],
            "answers": ["7", "7", "8"],
            "correct": [True, True, False],
        },
        {"uid": "p1", "ground_truth": "2", "responses": ["x"], "answers": [""], "correct": [False]},
    ]
    picked = pick_samples(records, per_kind=1)
    assert [(x["kind"], x["uid"], x["response"]) for x in picked] == [
        ("correct", "p0", "Answer: 7"),
        ("wrong", "p0", "Wait, 3 + 4\nAnswer: 8"),
        ("reflective", "p0", "Wait, 3 + 4\nAnswer: 8"),
    ]


def test_crossed_bootstrap_matches_the_exact_distribution_of_a_two_by_two_table():
    # Seeds x problems [[0, 0], [0, 1]]: a resample's mean is (times seed 1 is drawn) x
    # (times problem 1 is drawn) / 4, each count 0, 1, 2 with probability 1/4, 1/2, 1/4. So
    # the mean is 0 w.p. 7/16, 1/4 w.p. 1/4, 1/2 w.p. 1/4 and 1 w.p. 1/16 (cumulative 0.4375,
    # 0.6875, 0.9375, 1): quantiles that fall inside one of those steps are exact.
    table = [[0.0, 0.0], [0.0, 1.0]]
    for level, low, high in ((0.95, 0.0, 1.0), (0.5, 0.0, 0.5), (0.2, 0.0, 0.25)):
        got = crossed_bootstrap_ci(table, resamples=20_000, level=level, seed=3)
        assert (got.mean, got.low, got.high) == (0.25, low, high)


def test_crossed_bootstrap_reduces_to_seeds_or_problems_alone():
    rng = np.random.default_rng(0)
    per_problem = rng.random(200)
    # One seed: a bootstrap over problems; identical seeds change nothing.
    alone = bootstrap_ci(per_problem, resamples=20_000)
    for table in ([per_problem], [per_problem, per_problem, per_problem]):
        got = crossed_bootstrap_ci(table, resamples=20_000)
        assert got.mean == pytest.approx(per_problem.mean())
        assert got.low == pytest.approx(alone.low, abs=0.004)
        assert got.high == pytest.approx(alone.high, abs=0.004)
    # Problems alike within a seed: a bootstrap over seeds.
    per_seed = [0.1, 0.3, 0.35, 0.6]
    got = crossed_bootstrap_ci([[v] * 50 for v in per_seed], resamples=20_000)
    want = bootstrap_ci(per_seed, resamples=20_000)
    assert got.low == pytest.approx(want.low, abs=0.01)
    assert got.high == pytest.approx(want.high, abs=0.01)
    # Both sources of noise: wider than either alone.
    seeds = rng.random(10) * 0.4
    by_seed = crossed_bootstrap_ci([[v] * 200 for v in seeds], resamples=20_000)
    both = crossed_bootstrap_ci(np.add.outer(seeds, per_problem - 0.5), resamples=20_000)
    width = both.high - both.low
    assert width > by_seed.high - by_seed.low and width > alone.high - alone.low
    assert crossed_bootstrap_ci([[0.5]]) == Interval(0.5, 0.5, 0.5)


def test_crossed_bootstrap_rejects_what_is_not_a_table():
    for bad in ([], [[]], [0.1, 0.2], [[0.1, float("nan")]]):
        with pytest.raises(ValueError):
            crossed_bootstrap_ci(bad)


def test_permutation_pvalue_is_exact_over_few_seeds():
    # 2^n sign patterns at most resamples: each counted once. All of one sign: only the
    # observed pattern and its mirror are as extreme, 2 / 2^n.
    assert paired_permutation_pvalue([0.0] * 3, [0.1, 0.2, 0.3]) == 0.25
    assert paired_permutation_pvalue([0.0] * 8, [0.1 * i for i in range(1, 9)]) == 2 / 256
    # Sum 34 = 1 - 2 + 3 + ... + 8: as large in size when -2 flips (38), when 1 and -2 flip
    # (36), and the observed one (34): 3 patterns and their 3 mirrors.
    d = [1.0, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert paired_permutation_pvalue([0.0] * 8, d) == 6 / 256
    # Beyond resamples patterns (14 pairs > 10,000 / 2^14): random flips, never exactly 0.
    p = paired_permutation_pvalue([0.0] * 14, [1.0] * 14)
    assert p == pytest.approx(1 / 10_001, abs=3 / 10_001)


def test_permutation_pvalue_of_large_values_counts_the_observed_pattern():
    # Lengths in the thousands: summed in another order, the observed pattern rounds a few
    # 1e-12 away from mean(d); it (and its mirror) must still count as "as extreme".
    a = [1910.9, 1402.2, 3389.1, 9796.2, 4727.9, 17643.4]
    b = [6204.1, 5029.9, 16401.1, 19425.4, 16683.2, 19684.3]
    assert paired_permutation_pvalue(a, b) == 2 / 64
    # Random flips (14 pairs > 4000 / 2^14): the same draws count the same patterns as for
    # the values scaled down by 2^14 (exactly, so rounding scales with them).
    a = [5036.8, 10465.6, 4492.3, 19866.1, 9787.9, 19026.4, 8986.2]
    a += [11837.7, 8646.8, 4261.3, 11735.1, 6468.9, 9724.5, 11307.9]
    b = [7372.3, 14491.7, 6581.8, 24332.5, 10019.3, 23433.0, 9933.0]
    b += [15754.2, 9835.9, 6593.700000000001, 14695.5, 9372.599999999999, 13685.0, 12665.6]
    scale = 2.0**-14
    small = paired_permutation_pvalue([x * scale for x in a], [x * scale for x in b], **_R)
    assert paired_permutation_pvalue(a, b, **_R) == small == 2 / 4001


_R = {"resamples": 4000, "seed": 115}


def test_majority_vote_passes_over_math_dapo_no_answer_marker():
    from dapo.reward.tasks.math_dapo import math_score

    # Three responses ran out of tokens (math_dapo's pred "[INVALID]"); "34" wins 2 to 1.
    responses = ["long reasoning that ran out of tokens ..."] * 3
    responses += ["so\nAnswer: 34", "so\nAnswer: 34", "so\nAnswer: 12"]
    scores = [math_score(r, "34") for r in responses]
    preds, correct = [s.pred for s in scores], [s.correct for s in scores]
    assert preds[:3] == ["[INVALID]"] * 3
    assert majority_vote(preds, correct) == ("34", True)
    metrics = problem_metrics(correct, preds, [10] * 6, [True] * 3 + [False] * 3, responses, ks=[1])
    assert metrics["maj@k"] == 1.0
    assert majority_vote(["[INVALID]", "[INVALID]"], [False, False]) == (None, False)


def test_majority_is_left_out_when_no_response_of_the_evaluation_voted():
    from dapo.eval.evaluate import val_metrics
    from dapo.eval.metrics import without_unvoted_majority

    # A reward function returning a bool gives pred "": every response right, none voted.
    records = [{"answers": ["", ""]}, {"answers": ["", ""]}]
    shared = {"avg@k": 1.0, "pass@2": 1.0, "len_mean": 4.0, "truncated_frac": 0.0}
    per_problem = [{**shared, "maj@k": 0.0}] * 2
    kept = without_unvoted_majority(per_problem, records)
    assert kept == [shared] * 2
    val = val_metrics(summarize(kept, resamples=100), 2, 2, 0)
    assert "val/maj@k" not in val and val["val/accuracy"] == 1.0
    # One answer anywhere (here a problem whose majority is wrong): maj@k stays, 0 included.
    voted = [{"answers": ["", ""]}, {"answers": ["", "7"]}]
    assert without_unvoted_majority(per_problem, voted) == per_problem
    assert val_metrics(summarize(per_problem, resamples=100), 2, 2, 0)["val/maj@k"] == 0.0


def test_values_that_are_not_floats_are_refused_naming_them():
    for bad in ([10**400, 1.0], ["x"], [[1.0], [1.0, 2.0]]):
        with pytest.raises(ValueError, match="avg@k must be numbers"):
            bootstrap_ci(bad, name="avg@k")
    with pytest.raises(ValueError, match="b must be numbers"):
        paired_permutation_pvalue([1.0], [10**400])
