"""Evaluation statistics: per-problem metrics from sampled responses, and intervals over problems.

Everything here is a pure function of its arguments (no I/O, no model, no torch), so an
evaluation run can be re-scored or compared offline from its saved records.

The unit of resampling is always the *problem*: the n responses to one problem are strongly
correlated (same prompt, same difficulty), so treating responses as independent would make
the intervals far too narrow. Each problem first collapses to its own metrics
(:func:`problem_metrics`), then :func:`summarize` and :func:`compare` bootstrap over problems
(:mod:`dapo.eval.intervals`).
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dapo.eval.intervals import (
    Interval,
    bootstrap_ci,
    check_resampling,
    fraction_ci,
    paired_bootstrap_ci,
    paired_fraction_ci,
    paired_permutation_pvalue,
)
from dapo.reward.tasks.base import gave_answer

MAJORITY = "maj@k"

_FRACTIONS = ("avg@k", MAJORITY, "greedy", "truncated_frac", "reflective_frac", "tool_call_frac")

REFLECTIVE_PHRASES: tuple[str, ...] = (
    "wait",
    "let me check",
    "re-check",
    "recheck",
    "verify",
    "let me verify",
    "double-check",
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples of which ``c`` are correct (Chen et al. 2021).

    The probability that a uniformly drawn k-subset of the n samples contains at least one
    correct one: ``1 - C(n - c, k) / C(n, k)``. It is computed with exact integers and a single
    correctly rounded division, so the result is the float nearest the exact rational value.
    """
    n, c, k = operator.index(n), operator.index(c), operator.index(k)
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if k > n:
        raise ValueError(f"pass@k needs k <= n, got k={k} with only n={n} samples")
    if not 0 <= c <= n:
        raise ValueError(f"number correct c={c} must lie in [0, n={n}]")
    if n - c < k:
        return 1.0  # every k-subset must contain a correct sample
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total


def majority_vote(
    answers: Sequence[str | None], correct: Sequence[bool]
) -> tuple[str | None, bool]:
    """The most frequent vote (a verifier's ``Score.vote``, else its extracted answer) and
    whether it was graded correct.

    ``None``, ``""`` and math_dapo's ``"[INVALID]"`` (no answer extracted:
    :data:`dapo.reward.tasks.base.NO_ANSWER_PREDS`) do not vote. Answers are compared exactly as
    given; normalisation is the verifier's job. Ties in vote count go to the tied answer whose
    *first occurrence comes earliest* in ``answers``, which keeps the result deterministic and
    independent of hashing. The flag is True when any response giving the winning answer was
    graded correct (for a consistent verifier these all agree). Returns ``(None, False)`` when
    no response produced an answer.
    """
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} correctness flags")
    counts: dict[str, int] = {}
    winner_correct: dict[str, bool] = {}
    # dicts keep insertion order, i.e. order of first occurrence, which max() uses on ties
    for answer, ok in zip(answers, correct, strict=True):
        if not gave_answer(answer):
            continue
        counts[answer] = counts.get(answer, 0) + 1
        winner_correct[answer] = winner_correct.get(answer, False) or bool(ok)
    if not counts:
        return None, False
    best = max(counts, key=counts.__getitem__)  # max returns the first maximal item
    return best, winner_correct[best]


@functools.lru_cache(maxsize=64)
def _phrase_patterns(phrases: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    patterns = []
    for phrase in phrases:
        words = phrase.split()
        if not words:
            raise ValueError("reflective phrases must be non-empty")
        # Any run of whitespace may separate the words ("let me\ncheck" still counts); the
        # lookarounds are \b for word-character edges and also behave for punctuation edges.
        body = r"\s+".join(re.escape(word) for word in words)
        patterns.append(re.compile(rf"(?<!\w){body}(?!\w)", re.IGNORECASE))
    return tuple(patterns)


def reflection_count(text: str, phrases: Sequence[str] = REFLECTIVE_PHRASES) -> int:
    """Case-insensitive count of whole-word occurrences of the reflective ``phrases`` in ``text``.

    A phrase only matches between word boundaries, so "waiting" is not a "wait" and
    "double-checking" is not a "double-check". Each phrase is counted separately, so
    overlapping phrases both count: "let me verify" adds one for "let me verify" and one for
    "verify". Words inside a phrase may be separated by any whitespace.
    """
    return sum(len(p.findall(text)) for p in _phrase_patterns(tuple(phrases)))


def problem_metrics(
    correct: Sequence[bool],
    answers: Sequence[str | None],
    lengths: Sequence[int],
    truncated: Sequence[bool],
    texts: Sequence[str],
    *,
    ks: Sequence[int],
    phrases: Sequence[str] = REFLECTIVE_PHRASES,
) -> dict[str, float]:
    """Metrics of one problem from its n sampled responses (all sequences index the responses).

    Keys: ``"avg@k"`` (fraction correct, i.e. avg@n; the key is literal so records from runs
    with different n line up), ``"pass@{k}"`` for each k in ``ks``, ``"maj@k"`` (1.0 when the
    majority answer is correct), ``"len_mean"``, ``"len_max"``, ``"truncated_frac"``,
    ``"reflections"`` (mean :func:`reflection_count` per response) and ``"reflective_frac"``
    (fraction of responses with at least one reflective phrase). A problem where no response
    gave an answer has ``"maj@k"`` 0.0; an evaluation where none did drops it
    (:func:`without_unvoted_majority`).
    """
    n = len(correct)
    sizes = {
        "answers": len(answers),
        "lengths": len(lengths),
        "truncated": len(truncated),
        "texts": len(texts),
    }
    mismatched = {name: size for name, size in sizes.items() if size != n}
    if mismatched:
        raise ValueError(f"{n} correctness flags but {mismatched}")
    if n == 0:
        raise ValueError("a problem needs at least one sampled response")
    for k in ks:
        if not 1 <= k <= n:
            raise ValueError(f"pass@{k} needs 1 <= k <= n, but the problem has n={n} samples")

    n_correct = sum(bool(ok) for ok in correct)
    _, maj_correct = majority_vote(answers, correct)
    reflections = [reflection_count(text, phrases) for text in texts]
    metrics: dict[str, float] = {"avg@k": n_correct / n}
    for k in ks:
        metrics[f"pass@{k}"] = pass_at_k(n, n_correct, k)
    metrics[MAJORITY] = 1.0 if maj_correct else 0.0
    metrics["len_mean"] = sum(lengths) / n
    metrics["len_max"] = float(max(lengths))
    metrics["truncated_frac"] = sum(bool(t) for t in truncated) / n
    metrics["reflections"] = sum(reflections) / n
    metrics["reflective_frac"] = sum(r > 0 for r in reflections) / n
    return metrics


def without_unvoted_majority(
    per_problem: Sequence[dict[str, float]], records: Sequence[Mapping[str, Any]]
) -> list[dict[str, float]]:
    """``per_problem`` (the metrics of ``records``, the whole evaluation's) without ``"maj@k"``
    when no response of any record cast a vote: a grader without a ``pred`` (a reward
    function returning a bool or a float), or the code task, whose responses vote ``""``,
    lets nothing vote, and maj@k would read 0 however right the responses were. Unchanged
    when any response voted."""
    if any(gave_answer(a) for record in records for a in votes(record)):
        return list(per_problem)
    return [{k: v for k, v in metrics.items() if k != MAJORITY} for metrics in per_problem]


def interval_of(key: str) -> Callable[..., Interval]:
    """How the metric ``key`` is summarised over problems: :func:`~dapo.eval.intervals.fraction_ci`
    for the fractions (avg@k, pass@k, maj@k, greedy and the shares), whose interval keeps a width
    where every problem scores the same, else :func:`~dapo.eval.intervals.bootstrap_ci`."""
    return fraction_ci if key in _FRACTIONS or key.startswith("pass@") else bootstrap_ci


def paired_interval_of(key: str) -> Callable[..., Interval]:
    """The paired interval of B - A for the metric ``key``, as :func:`interval_of` chooses."""
    return paired_fraction_ci if interval_of(key) is fraction_ci else paired_bootstrap_ci


def summarize(
    per_problem: Sequence[dict[str, float]],
    *,
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Interval]:
    """Mean over problems with a bootstrap interval (:func:`interval_of`), for every key present
    in all records.

    The treatment is uniform: every key is averaged over problems, so ``"len_max"`` summarises
    to the mean of the per-problem maxima, not the longest response overall. Keys keep the
    order of the first record.
    """
    if not per_problem:
        raise ValueError("no problems to summarize")
    check_resampling(resamples, level)
    shared = [key for key in per_problem[0] if all(key in record for record in per_problem)]
    return {
        key: interval_of(key)(
            [record[key] for record in per_problem],
            resamples=resamples,
            seed=seed,
            level=level,
            name=key,
        )
        for key in shared
    }


def compare(
    a: Mapping[str, dict[str, float]],
    b: Mapping[str, dict[str, float]],
    *,
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, Any]:
    """Compare two evaluations (``uid -> problem_metrics``) on the problems they share.

    Only uids present in both are used (ValueError if there are none); the caller is expected
    to report how many were dropped. Problems are taken in sorted uid order so the result does
    not depend on mapping order. For each metric key present in every shared record of both,
    the entry is ``{"a": Interval, "b": Interval, "diff": Interval, "p": float}`` with ``diff``
    the paired interval of b - a and ``p`` the paired sign-flip p-value. ``a`` and ``b``
    resample each side's shared problems in its mapping's order: where no problem is left
    out, a side read from ``dapo eval``'s problems.jsonl gets its summary.json's interval
    (same seed and resamples), not one drawn anew in uid order. ``"changed"`` lists
    ``(uid, a_value, b_value)`` for every problem whose ``"avg@k"`` differs, largest
    improvement first (ties by uid).
    """
    check_resampling(resamples, level)
    uids = sorted(set(a) & set(b))
    if not uids:
        raise ValueError(f"the evaluations share no problems ({len(a)} vs {len(b)} uids)")
    records_a = [a[uid] for uid in uids]
    records_b = [b[uid] for uid in uids]
    keys = [
        key
        for key in records_a[0]
        if all(key in record for record in records_a) and all(key in r for r in records_b)
    ]

    in_order_a = [record for uid, record in a.items() if uid in b]
    in_order_b = [record for uid, record in b.items() if uid in a]
    result: dict[str, Any] = {}
    for key in keys:
        values_a = [record[key] for record in records_a]
        values_b = [record[key] for record in records_b]
        result[key] = {
            "a": interval_of(key)(
                [r[key] for r in in_order_a], resamples=resamples, seed=seed, level=level
            ),
            "b": interval_of(key)(
                [r[key] for r in in_order_b], resamples=resamples, seed=seed, level=level
            ),
            "diff": paired_interval_of(key)(
                values_a, values_b, resamples=resamples, seed=seed, level=level
            ),
            "p": paired_permutation_pvalue(values_a, values_b, resamples=resamples, seed=seed),
        }

    changed: list[tuple[str, float, float]] = []
    if "avg@k" in keys:
        changed = [
            (uid, ra["avg@k"], rb["avg@k"])
            for uid, ra, rb in zip(uids, records_a, records_b, strict=True)
            if ra["avg@k"] != rb["avg@k"]
        ]
        changed.sort(key=lambda item: item[2] - item[1], reverse=True)  # stable: uid on ties
    result["changed"] = changed
    return result


def pick_samples(
    records: Sequence[Mapping[str, Any]],
    *,
    per_kind: int = 3,
    phrases: Sequence[str] = REFLECTIVE_PHRASES,
) -> list[dict[str, Any]]:
    """A few responses worth reading from evaluation records (``dapo eval``'s problems.jsonl
    format): the shortest correct ones, the first wrong ones, and the first with reflective
    phrases. Each: kind, uid, ground_truth, answer, correct, response. Records without their
    responses (another rank's, under torchrun) are passed over."""
    flat = [
        {
            "uid": r["uid"],
            "ground_truth": r["ground_truth"],
            "answer": answer,
            "correct": bool(correct),
            "response": text,
        }
        for r in records
        if "responses" in r
        for text, answer, correct in zip(r["responses"], r["answers"], r["correct"], strict=True)
    ]
    correct = sorted((s for s in flat if s["correct"]), key=lambda s: len(s["response"]))
    wrong = [s for s in flat if not s["correct"]]
    reflective = [s for s in flat if reflection_count(s["response"], phrases) > 0]
    out = []
    for kind, chosen in (("correct", correct), ("wrong", wrong), ("reflective", reflective)):
        out.extend({"kind": kind, **s} for s in chosen[:per_kind])
    return out


def votes(record: Mapping[str, Any]) -> Sequence[str | None]:
    """What each response of an evaluation record votes with in maj@k: its ``"votes"``
    (:func:`dapo.reward.tasks.base.vote_key`), else, in records written before votes were,
    its ``"answers"``."""
    return record.get("votes", record.get("answers", ()))


def record_metrics(
    record: Mapping[str, Any], *, ks: Sequence[int], phrases: Sequence[str] = REFLECTIVE_PHRASES
) -> dict[str, float]:
    """``problem_metrics`` of one evaluation record (``dapo eval``'s problems.jsonl format),
    plus ``greedy`` when the record has a greedy verdict, and ``tool_call_frac`` (the share
    of its samples that called a tool) when its samples are episodes with a tool."""
    out = problem_metrics(
        record["correct"],
        votes(record),
        record["lengths"],
        record["truncated"],
        record["responses"],
        ks=ks,
        phrases=phrases,
    )
    if "greedy_correct" in record:
        out["greedy"] = float(record["greedy_correct"])
    if "tool_calls" in record:
        calls = record["tool_calls"]
        out["tool_call_frac"] = sum(c > 0 for c in calls) / max(len(calls), 1)
    return out
