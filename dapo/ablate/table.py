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
from pathlib import Path
from typing import Any

import numpy as np

from dapo.ablate.plans import Row
from dapo.ablate.runs import read_summary
from dapo.eval.intervals import (
    Interval,
    bootstrap_ci,
    crossed_bootstrap_ci,
    holm_adjusted,
    paired_bootstrap_ci,
    paired_permutation_pvalue,
)

COLUMNS = ("accuracy", "gen_tokens", "seconds", "tokens_per_kept_group", "entropy", "truncated")


def _number(value: Any) -> float:
    """A metric as logged: null (a NaN: nothing trained that step) or absent is NaN, and so
    is anything else that is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def _count(value: Any) -> float:
    """A step's share of a sum: absent (a line that is not a step's) or not a number is 0."""
    number = _number(value)
    return number if math.isfinite(number) else 0.0


def read_result(run_dir: Path) -> dict:
    """A finished run's numbers: held-out accuracy at the end, generated tokens and seconds of
    training steps in all, dynamic sampling's generated tokens per kept group (mean over steps), the
    last step's entropy and truncated fraction; ``problems`` (uid -> accuracy at the end, when
    the run wrote ``val_problems.json``) and ``curve``: (step, held-out accuracy, generated
    tokens and training seconds up to that step) at every evaluation.

    Only the steps summary.json counts are read (a later, stopped extension of the run logged
    more), each once (its last line). A file that is not what dapo writes is a ValueError
    naming it."""
    summary = read_summary(run_dir)
    if summary is None or "val/accuracy_end" not in summary:
        raise ValueError(
            f"{run_dir / 'summary.json'}: no held-out accuracy at the end (val/accuracy_end): "
            f"the run did not finish; remove {run_dir}, or finish it with dapo train --resume "
            f"{run_dir}"
        )
    lines = metrics_lines(run_dir, summary["steps"])
    steps = [m for m in lines if "sampling/tokens_generated" in m]
    last = steps[-1] if steps else {}
    # The steps that kept a group (a step that kept none logs null).
    kept = [_number(m.get("sampling/tokens_per_kept_group")) for m in steps]
    kept = [k for k in kept if math.isfinite(k)]
    curve, tokens, seconds = [], 0.0, 0.0
    for m in lines:
        tokens += _count(m.get("sampling/tokens_generated"))
        seconds += _count(m.get("perf/step_s"))
        if "val/accuracy" in m:
            curve.append((m["step"], _number(m["val/accuracy"]), tokens, seconds))
    result = {
        "accuracy": summary["val/accuracy_end"],
        # What the trainer counted against a tokens=N budget (its lines' sum if not written).
        "gen_tokens": summary.get("gen_tokens", tokens),
        # The seconds of its steps, as a seconds=S budget and the cost to a target count them
        # (the run's wall time, train_seconds, adds evaluations, checkpoints and the export).
        "seconds": summary.get("step_seconds", seconds),
        "tokens_per_kept_group": sum(kept) / len(kept) if kept else math.nan,
        "entropy": _number(last.get("train/entropy")),
        "truncated": _number(last.get("rollout/truncated_frac")),
        "curve": curve,
    }
    problems = _read_problems(run_dir, summary["steps"])
    if problems is not None:
        result["problems"] = problems
    return result


def metrics_lines(run_dir: Path, last_step: int) -> list[dict]:
    """``metrics.jsonl``'s lines of steps 0 to ``last_step``, the last line of each step, in
    step order. A half-written last line (a run killed mid-write) is skipped; any other line
    that is not an object with a whole-number step is a ValueError naming the file."""
    path = run_dir / "metrics.jsonl"
    fix = f"remove {run_dir} (ablate then runs it again)"
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror}); {fix}") from None
    by_step: dict[int, dict] = {}
    raw = text.split("\n")
    for number, line in enumerate(raw, 1):
        if not line.strip():
            continue
        try:
            m = json.loads(line)
        except (ValueError, RecursionError):
            if number == len(raw):  # no newline after it: cut off mid-write
                continue
            raise ValueError(f"{path}, line {number}: not JSON; {fix}") from None
        step = m.get("step") if isinstance(m, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{path}, line {number}: not a metrics line with a step; {fix}")
        if step <= last_step:
            by_step[step] = m
    return [by_step[step] for step in sorted(by_step)]


def _read_problems(run_dir: Path, last_step: int) -> dict | None:
    """``val_problems.json``'s uid -> accuracy, when it is of the run's last step."""
    path = run_dir / "val_problems.json"
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError):
        doc = None
    uids, accs = (doc.get("uid"), doc.get("accuracy")) if isinstance(doc, dict) else (0, 0)
    if not (isinstance(uids, list) and isinstance(accs, list) and len(uids) == len(accs)):
        raise ValueError(
            f"{path} is not an object of equally long uid and accuracy lists: it is damaged; "
            f"remove it (the table's intervals are then over seeds alone), or remove {run_dir}"
        )
    if doc.get("step") != last_step:
        return None
    if not all(math.isfinite(_number(a)) for a in accs) or not all(
        isinstance(u, str | int) for u in uids
    ):
        raise ValueError(
            f"{path}: a uid that is not text or an accuracy that is not a number; remove it "
            f"(the table's intervals are then over seeds alone), or remove {run_dir}"
        )
    return dict(zip(uids, accs, strict=True))


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
    """The first evaluation at which each run's held-out accuracy reached ``target``: how
    many runs did, and the mean over those of the steps, generated tokens and training seconds
    it took (NaN when none did)."""
    # A mean of accuracies is rounded: a run at exactly the first row's mean has reached it.
    hits = [next((c for c in r["curve"] if c[1] >= target - 1e-9), None) for r in runs]
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
        for column in COLUMNS[1:]:
            record[column] = sum(runs[s][column] for s in seeds) / len(seeds)
        record["target"] = target
        record["to_target"] = to_target([runs[s] for s in seeds], target)
        base = results.get(row.compare_to or "", {})
        paired = [s for s in seeds if s in base]
        if paired:
            _difference(record, [base[s] for s in paired], [runs[s] for s in paired], resamples)
            record["expect"], record["paper"] = row.expect, row.paper
        table.append(record)
    judge(table)
    return table


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


def markdown(table: list[dict]) -> str:
    """The table as markdown: accuracy in points with its 95% interval (over seeds and
    problems, or over seeds: the column header says which), then the cost of reaching the
    target accuracy."""
    if not table:
        return "(no finished runs)\n"
    over = {r["interval"] for r in table}
    over_text = over.pop() if len(over) == 1 else "seeds x problems, or seeds"
    lines = [
        f"| configuration | seeds | held-out accuracy [95% over {over_text}] | vs "
        "| difference [95%] | p (seeds) | generated tokens | seconds | tokens per kept group "
        "| entropy | truncated |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        diff = _points(r["diff"], sign=True) if "diff" in r else ""
        p = f"{r['p']:.3f}" if "p" in r else ""
        lines.append(
            f"| {r['row']} | {r['seeds']} | {_points(r['accuracy'])} | {r['compare_to'] or ''} "
            f"| {diff} | {p} | {r['gen_tokens']:,.0f} | {r['seconds']:.0f} "
            f"| {r['tokens_per_kept_group']:.0f} | {r['entropy']:.3f} | {r['truncated']:.3f} |"
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
    return "\n".join(lines + _verdict_lines(table)) + "\n"


def _verdict_lines(table: list[dict]) -> list[str]:
    """The verdicts (:func:`judge`) as a third table: each difference beside the paper's."""
    judged = [r for r in table if "verdict" in r]
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
        p = f"{r['p']:.3f} | {r['p_holm']:.3f}" if "p" in r else "- | -"
        paper = r.get("paper") or ("no claim" if r.get("expect") is None else "")
        lines.append(
            f"| {r['row']} | {r['compare_to']} | {paper} | {_points(r['diff'], True)} | {p} "
            f"| {r['verdict']} |"
        )
    return lines
