"""The cost of grading real model outputs with the ``code`` task: every response of a
``dapo eval`` (its ``problems.jsonl``, or the journal ``problems.partial.jsonl`` of one still
running) graded again, one at a time, in the sandbox mode given.

    python benchmarks/grade_code.py evals/he-smollm2/problems.jsonl [--mode auto] [--json]

Prints the milliseconds per response (median, mean, 95th percentile, the slowest), the
outcome of each (``Score.pred``: passed, failed, error, timeout, ...), and whether the
verdicts equal the ones the evaluation recorded. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from dapo.reward import sandbox
from dapo.reward.tasks.code import grade_code


def records(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "responses" in r]  # a journal's first line is its protocol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("problems", type=Path, help="a dapo eval's problems.jsonl (or journal)")
    parser.add_argument("--mode", default="auto", choices=("auto", *sandbox.MODES))
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    mode = sandbox.pick_mode(args.mode)
    times, outcomes, agree, total = [], Counter(), 0, 0
    rows = records(args.problems)
    for i, rec in enumerate(rows):
        for response, correct in zip(rec["responses"], rec["correct"], strict=True):
            start = time.perf_counter()
            score = grade_code(response, rec["ground_truth"], mode=mode)
            times.append(1000 * (time.perf_counter() - start))
            outcomes[score.pred] += 1
            agree += score.correct == bool(correct)
            total += 1
        print(f"  {i + 1}/{len(rows)} problems, {total} responses", file=sys.stderr, flush=True)
    ordered = sorted(times)
    result = {
        "mode": mode,
        "problems": len(rows),
        "responses": total,
        "ms_median": round(statistics.median(times), 1),
        "ms_mean": round(statistics.fmean(times), 1),
        "ms_p95": round(ordered[int(0.95 * (len(ordered) - 1))], 1),
        "ms_max": round(ordered[-1], 1),
        "outcomes": dict(outcomes.most_common()),
        "same_verdicts": f"{agree}/{total}",
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{total} responses of {len(rows)} problems, graded one at a time in {mode} mode")
    print(
        f"ms per response: median {result['ms_median']}, mean {result['ms_mean']}, "
        f"p95 {result['ms_p95']}, max {result['ms_max']}"
    )
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()))
    print(f"verdicts equal to the evaluation's: {result['same_verdicts']}")


if __name__ == "__main__":
    main()
