"""The ablation table: per row, the mean over seeds of each run's end-of-run numbers, with a
percentile-bootstrap interval, the paired difference (seed by seed, problem by problem) to the
row it is compared with, with its interval and a sign-flip p-value over seeds, and how much
training each row needed to reach a target accuracy (:mod:`dapo.eval.intervals`).

Intervals are over seeds and problems (:func:`~dapo.eval.intervals.crossed_bootstrap_ci`) when
every run of the rows involved wrote ``val_problems.json`` for the same problems, else over
seeds alone. With one seed and no per-problem file an interval is the point itself, and a
p-value is never given for one seed: a single run says nothing about run-to-run noise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np

from dapo.ablate.plans import Row
from dapo.ablate.result import metrics_lines, read_result
from dapo.eval.intervals import (
    Interval,
    bootstrap_ci,
    crossed_bootstrap_ci,
    holm_adjusted,
    paired_bootstrap_ci,
    paired_permutation_pvalue,
)

__all__ = ["ablation_table", "contrast", "markdown", "metrics_lines", "read_result", "to_target"]

COLUMNS = ("accuracy", "gen_tokens", "seconds", "tokens_per_kept_group", "entropy", "truncated")


def _problem_matrices(*groups: Sequence[dict]) -> list[np.ndarray] | None:
    """Per group of runs, a runs x problems matrix (problems in uid order), when every run of
    every group kept its problems and they are the same problems; else None."""
    runs = [r for group in groups for r in group]
    if not runs or any("problems" not in r for r in runs):
        return None
    uids = sorted(runs[0]["problems"])
    if any(sorted(r["problems"]) != uids for r in runs):
        return None
    return [np.array([[r["problems"][u] for u in uids] for r in g], np.float64) for g in groups]


def _over_seeds(values: Sequence[float], resamples: int) -> Interval:
    if len(values) == 1:
        return Interval(values[0], values[0], values[0])
    return bootstrap_ci(values, resamples=resamples)


def to_target(runs: Sequence[dict], target: float) -> dict:
    """The first evaluation after training began (step 0's is the untrained policy's) at
    which each run's held-out accuracy reached ``target``: how many runs did, and the mean
    over those of the steps, generated tokens and training seconds it took (NaN when none
    did)."""
    # A mean of accuracies is rounded: a run at exactly the first row's mean has reached it.
    trained = [[c for c in r["curve"] if c[0] > 0] for r in runs]
    hits = [next((c for c in curve if c[1] >= target - 1e-9), None) for curve in trained]
    hits = [h for h in hits if h is not None]

    def mean(i: int) -> float:
        return sum(h[i] for h in hits) / len(hits) if hits else math.nan

    return {
        "reached": len(hits),
        "runs": len(runs),
        "steps": mean(0),
        "gen_tokens": mean(2),
        "seconds": mean(3),
    }


def ablation_table(
    rows: Sequence[Row],
    results: dict[str, dict[int, dict]],
    resamples: int = 10_000,
    target: float | None = None,
) -> list[dict]:
    """One record per row from ``results[row name][seed]`` (:func:`read_result`'s); rows
    without results are left out (and the differences to them). ``target``: the held-out
    accuracy whose cost is compared (default: the first row's mean accuracy at the end)."""
    present = [row for row in rows if results.get(row.name)]
    if target is None and present:
        first = results[present[0].name]
        target = sum(r["accuracy"] for r in first.values()) / len(first)
    table = []
    for row in present:
        runs = results[row.name]
        seeds = sorted(runs)
        record: dict = {"row": row.name, "seeds": len(seeds), "compare_to": row.compare_to}
        matrices = _problem_matrices([runs[s] for s in seeds])
        acc = [runs[s]["accuracy"] for s in seeds]
        if matrices is not None:
            record["accuracy"] = crossed_bootstrap_ci(matrices[0], resamples=resamples)
            record["interval"] = "seeds x problems"
        else:
            record["accuracy"] = _over_seeds(acc, resamples)
            record["interval"] = "seeds"
        for column in COLUMNS[1:]:  # over the seeds that logged it (a null: no token)
            logged = [runs[s][column] for s in seeds if math.isfinite(runs[s][column])]
            record[column] = sum(logged) / len(logged) if logged else math.nan
            if len(logged) < len(seeds):
                record[f"{column}_seeds"] = len(logged)
        record["target"] = target
        record["to_target"] = to_target([runs[s] for s in seeds], target)
        if row.compare_to is not None:
            _pair(record, row, runs, results.get(row.compare_to, {}), resamples)
        table.append(record)
    judge(table)
    return table


def _pair(
    record: dict, row: Row, runs: dict[int, dict], base: dict[int, dict], resamples: int
) -> None:
    """The difference to the row compared with over the seeds both rows finished
    (``paired_seeds``: fewer than either row's seeds when a run failed, and the table says
    so), or ``left_out``: why there is none."""
    paired = [s for s in sorted(runs) if s in base]
    record["expect"], record["paper"] = row.expect, row.paper
    if not paired:
        record["left_out"] = (
            f"no finished run of {row.compare_to}" if not base else "no seed finished in both"
        )
        return
    record["paired_seeds"] = len(paired)
    record["fewer_paired"] = len(paired) < max(len(runs), len(base))
    _difference(record, [base[s] for s in paired], [runs[s] for s in paired], resamples)


ALPHA = 0.05
"""The family-wise error rate of a table's verdicts (after Holm's correction)."""


def judge(table: list[dict]) -> None:
    """Add ``p_holm`` (Holm-Bonferroni over every row of the table with a p-value) and a
    ``verdict`` to every row with a difference:

    - ``reproduced`` / ``opposite``: the adjusted p is under ``ALPHA`` and the difference's
      95% interval lies wholly on the paper's side of 0 / wholly on the other side;
    - ``differs``: the same evidence, for a pair the paper makes no claim about;
    - ``not detectable at this scale``: anything less (an interval that spans 0, an adjusted
      p at or over ``ALPHA``, or a single seed, which has no p-value).
    """
    tested = [r for r in table if "p" in r]
    for record, adjusted in zip(tested, holm_adjusted([r["p"] for r in tested]), strict=True):
        record["p_holm"] = adjusted
    for record in table:
        if "diff" not in record:
            continue
        diff: Interval = record["diff"]
        side = 1 if diff.low > 0 else -1 if diff.high < 0 else 0
        if side == 0 or record.get("p_holm", 1.0) >= ALPHA:
            record["verdict"] = "not detectable at this scale"
        elif record.get("expect") is None:
            record["verdict"] = "differs"
        else:
            record["verdict"] = "reproduced" if side == record["expect"] else "opposite"


def _difference(record: dict, a: list[dict], b: list[dict], resamples: int) -> None:
    """``diff`` (b - a, paired by seed and, when both have them, by problem) and ``p``."""
    matrices = _problem_matrices(a, b)
    acc_a, acc_b = [r["accuracy"] for r in a], [r["accuracy"] for r in b]
    record["diff_interval"] = "seeds x problems" if matrices is not None else "seeds"
    if matrices is not None:
        record["diff"] = crossed_bootstrap_ci(matrices[1] - matrices[0], resamples=resamples)
    elif len(a) == 1:
        record["diff"] = _over_seeds([acc_b[0] - acc_a[0]], resamples)
    else:
        record["diff"] = paired_bootstrap_ci(acc_a, acc_b, resamples=resamples)
    if len(a) > 1:
        record["p"] = paired_permutation_pvalue(acc_a, acc_b, resamples=resamples)


def contrast(
    results: dict[str, dict[int, dict]], weights: dict[str, float], resamples: int = 10_000
) -> dict | None:
    """``sum(weight * accuracy)`` over the weighted rows, seed by seed (and problem by problem
    when every run has its problems), with its interval; None unless every row has a result
    at a shared seed."""
    seeds = sorted(set.intersection(*(set(results.get(r, {})) for r in weights)))
    if not seeds:
        return None
    runs = {r: [results[r][s] for s in seeds] for r in weights}
    matrices = _problem_matrices(*runs.values())
    per_seed = [
        sum(w * runs[r][i]["accuracy"] for r, w in weights.items()) for i in range(len(seeds))
    ]
    out = {"seeds": len(seeds)}
    if len(seeds) > 1:  # is the per-seed contrast centred on 0?
        out["p"] = paired_permutation_pvalue([0.0] * len(seeds), per_seed, resamples=resamples)
    if matrices is not None:
        combined = sum(w * m for w, m in zip(weights.values(), matrices, strict=True))
        value = crossed_bootstrap_ci(combined, resamples=resamples)
        return {"value": value, "interval": "seeds x problems", **out}
    return {"value": _over_seeds(per_seed, resamples), "interval": "seeds", **out}


def contrast_line(name: str, weights: dict[str, float], result: dict) -> str:
    """A contrast as one markdown line: the weighted rows, its value in points, interval, p."""
    terms = " ".join(f"{'+' if w > 0 else '-'} ({r})" for r, w in weights.items())
    p = f", p (seeds) {result['p']:.3f}" if "p" in result else ""
    return (
        f"{name.capitalize()}: {terms.removeprefix('+ ')} = {_points(result['value'], True)} "
        f"points (95% over {result['interval']}, {result['seeds']} seeds{p})\n"
    )


def as_json(table: list[dict]) -> str:
    def plain(value):
        if isinstance(value, Interval):
            return {"mean": value.mean, "low": value.low, "high": value.high}
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return json.dumps([{k: plain(v) for k, v in r.items()} for r in table], indent=2) + "\n"


def _points(i: Interval, sign: bool = False) -> str:
    fmt = "{:+.1f}" if sign else "{:.1f}"
    mean, low, high = (fmt.format(100 * x) for x in (i.mean, i.low, i.high))
    return mean if i.low == i.high else f"{mean} [{low}, {high}]"


def _difference_text(r: dict) -> str:
    """A difference in points with its interval, and its seeds when fewer than the rows'."""
    n = r["paired_seeds"]
    fewer = f" ({n} paired seed{'s' if n > 1 else ''})" if r["fewer_paired"] else ""
    return _points(r["diff"], sign=True) + fewer


CELL_FORMATS = {
    "gen_tokens": ",.0f",
    "seconds": ".0f",
    "tokens_per_kept_group": ".0f",
    "entropy": ".3f",
    "truncated": ".3f",
}


def _of(record: dict, column: str, spec: str) -> str:
    """``column``'s mean, and over how many seeds when not all of them logged it."""
    n = record.get(f"{column}_seeds")
    counted = f" ({n} of {record['seeds']} seeds)" if n is not None else ""
    return format(record[column], spec) + counted


def markdown(table: list[dict], missing: Sequence[str] = ()) -> str:
    """The table as markdown: accuracy in points with its 95% interval (over seeds and
    problems, or over seeds: the column header says which), then the cost of reaching the
    target accuracy, the verdicts, and the ``missing`` runs (not finished: failed or not run),
    which the table is without."""
    gone = (
        f"\nNot in the table (not finished: failed, with its log <run>.log beside it, or not "
        f"run): {', '.join(missing)}\n"
        if missing
        else ""
    )
    if not table:
        return "(no finished runs)\n" + gone
    over = {r["interval"] for r in table} | {r["diff_interval"] for r in table if "diff" in r}
    mixed = len(over) > 1  # then each cell over seeds alone says so
    over_text = "seeds x problems; (seeds): over seeds alone" if mixed else over.pop()
    lines = [
        f"| configuration | seeds | held-out accuracy [95% over {over_text}] | vs "
        "| difference [95%] | p (seeds) | generated tokens | seconds | tokens per kept group "
        "| entropy | truncated |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        diff = _difference_text(r) if "diff" in r else ""
        diff += " (seeds)" if mixed and r.get("diff_interval") == "seeds" else ""
        accuracy = _points(r["accuracy"]) + (
            " (seeds)" if mixed and r["interval"] == "seeds" else ""
        )
        p = f"{r['p']:.3f}" if "p" in r else ""
        cells = [_of(r, c, f) for c, f in CELL_FORMATS.items()]
        lines.append(
            f"| {r['row']} | {r['seeds']} | {accuracy} | {r['compare_to'] or ''} | {diff} | {p} | "
            + " | ".join(cells)
            + " |"
        )
    target = table[0]["target"]
    lines += [
        "",
        f"To reach held-out accuracy {100 * target:.1f} (mean over the runs that did):",
        "",
        "| configuration | runs that reached it | steps | generated tokens | seconds |",
        "|---|---|---|---|---|",
    ]
    for r in table:
        t = r["to_target"]
        cost = (
            f"{t['steps']:.0f} | {t['gen_tokens']:,.0f} | {t['seconds']:.0f}"
            if t["reached"]
            else "- | - | -"
        )
        lines.append(f"| {r['row']} | {t['reached']}/{t['runs']} | {cost} |")
    return "\n".join(lines + _verdict_lines(table)) + "\n" + gone


def _verdict_lines(table: list[dict]) -> list[str]:
    """The verdicts (:func:`judge`) as a third table: each difference beside the paper's, and
    each row compared with another but without a difference, with why."""
    judged = [r for r in table if "verdict" in r or "left_out" in r]
    if not judged:
        return []
    lines = [
        "",
        f"Verdicts (Holm-Bonferroni over the table's {sum('p' in r for r in table)} "
        f"p-values; family-wise alpha {ALPHA}):",
        "",
        "| configuration | vs | paper | here [95%] | p (seeds) | p (Holm) | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in judged:
        paper = r.get("paper") or ("no claim" if r.get("expect") is None else "")
        if "left_out" in r:
            here, p, verdict = "-", "- | -", f"left out: {r['left_out']}"
        else:
            here, verdict = _difference_text(r), r["verdict"]
            p = f"{r['p']:.3f} | {r['p_holm']:.3f}" if "p" in r else "- (1 paired seed) | -"
        lines.append(f"| {r['row']} | {r['compare_to']} | {paper} | {here} | {p} | {verdict} |")
    return lines
