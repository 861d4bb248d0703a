"""The ablation table: per row, the mean over seeds of each run's end-of-run numbers, with a
percentile-bootstrap interval over seeds, and the paired difference (seed by seed) to the row
it is compared with, with its interval and a sign-flip p-value (:mod:`dapo.eval_metrics`).

With one seed an interval is the point itself and a p-value is not given: a single run says
nothing about run-to-run noise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from dapo.ablate.plans import Row
from dapo.eval_metrics import (
    Interval,
    bootstrap_ci,
    paired_bootstrap_ci,
    paired_permutation_pvalue,
)

COLUMNS = ("accuracy", "gen_tokens", "seconds", "tokens_per_kept_group", "entropy", "truncated")


def read_result(run_dir: Path) -> dict[str, float]:
    """A finished run's numbers: held-out accuracy at the end, generated tokens and training
    seconds in all, dynamic sampling's generated tokens per kept group (mean over steps), and
    the last step's entropy and truncated fraction."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [
        m
        for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "sampling/tokens_generated" in m
    ]
    last = steps[-1] if steps else {}
    kept = [m["sampling/tokens_per_kept_group"] for m in steps]
    return {
        "accuracy": summary["val/accuracy_end"],
        "gen_tokens": sum(m["sampling/tokens_generated"] for m in steps),
        "seconds": summary.get("train_seconds", math.nan),
        "tokens_per_kept_group": sum(kept) / len(kept) if kept else math.nan,
        "entropy": last.get("train/entropy", math.nan),
        "truncated": last.get("rollout/truncated_frac", math.nan),
    }


def _interval(values: Sequence[float], resamples: int) -> Interval:
    if len(values) == 1:
        return Interval(values[0], values[0], values[0])
    return bootstrap_ci(values, resamples=resamples)


def ablation_table(
    rows: Sequence[Row], results: dict[str, dict[int, dict[str, float]]], resamples: int = 10_000
) -> list[dict]:
    """One record per row from ``results[row name][seed]``; rows without results are left out
    (and the differences to them)."""
    table = []
    for row in rows:
        runs = results.get(row.name, {})
        if not runs:
            continue
        seeds = sorted(runs)
        record: dict = {"row": row.name, "seeds": len(seeds), "compare_to": row.compare_to}
        acc = [runs[s]["accuracy"] for s in seeds]
        record["accuracy"] = _interval(acc, resamples)
        for column in COLUMNS[1:]:
            record[column] = sum(runs[s][column] for s in seeds) / len(seeds)
        base = results.get(row.compare_to or "", {})
        paired = [s for s in seeds if s in base]
        if paired:
            a = [base[s]["accuracy"] for s in paired]
            b = [runs[s]["accuracy"] for s in paired]
            if len(paired) == 1:
                record["diff"] = _interval([b[0] - a[0]], resamples)
            else:
                record["diff"] = paired_bootstrap_ci(a, b, resamples=resamples)
                record["p"] = paired_permutation_pvalue(a, b, resamples=resamples)
        table.append(record)
    return table


def as_json(table: list[dict]) -> str:
    def plain(value):
        if isinstance(value, Interval):
            return {"mean": value.mean, "low": value.low, "high": value.high}
        return value

    return json.dumps([{k: plain(v) for k, v in r.items()} for r in table], indent=2) + "\n"


def markdown(table: list[dict]) -> str:
    """The table as markdown: accuracy in points with its 95% interval over seeds."""

    def points(i: Interval, sign: bool = False) -> str:
        fmt = "{:+.1f}" if sign else "{:.1f}"
        mean, low, high = (fmt.format(100 * x) for x in (i.mean, i.low, i.high))
        return mean if i.low == i.high else f"{mean} [{low}, {high}]"

    lines = [
        "| configuration | seeds | held-out accuracy [95% over seeds] | vs | difference [95%] | p "
        "| generated tokens | seconds | tokens per kept group | entropy | truncated |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        diff = points(r["diff"], sign=True) if "diff" in r else ""
        p = f"{r['p']:.3f}" if "p" in r else ""
        lines.append(
            f"| {r['row']} | {r['seeds']} | {points(r['accuracy'])} | {r['compare_to'] or ''} "
            f"| {diff} | {p} | {r['gen_tokens']:,.0f} | {r['seconds']:.0f} "
            f"| {r['tokens_per_kept_group']:.0f} | {r['entropy']:.3f} | {r['truncated']:.3f} |"
        )
    return "\n".join(lines) + "\n"
