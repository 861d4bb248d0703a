"""A finished run's numbers as the ablation table reads them from its directory
(``summary.json``, ``metrics.jsonl``, ``val_problems.json``), each file checked: one that is
not what dapo writes, or that disagrees with another (a log cut before the step the summary
names), is a ValueError naming it and the fix, never a table of wrong figures."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dapo.ablate.runs import read_summary


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
    training steps in all, dynamic sampling's generated tokens per kept group (the run's
    tokens over its kept groups: a step that kept none still cost its tokens), the last
    step's entropy and truncated fraction; ``problems`` (uid -> accuracy at the end, when
    the run wrote ``val_problems.json``) and ``curve``: (step, held-out accuracy, generated
    tokens and training seconds up to that step) at every evaluation.

    Only the steps summary.json counts are read (a later, stopped extension of the run logged
    more), each once (its last line). A file that is not what dapo writes, or a metrics.jsonl
    that stops before summary.json's last step (its line of that step cut off mid-write
    included), is a ValueError naming it."""
    summary = read_summary(run_dir)
    if summary is None or "val/accuracy_end" not in summary:
        raise ValueError(
            f"{run_dir / 'summary.json'}: no held-out accuracy at the end (val/accuracy_end): "
            f"the run did not finish; remove {run_dir}, or finish it with dapo train --resume "
            f"{run_dir}"
        )
    lines = metrics_lines(run_dir, summary["steps"])
    _check_logged_to(run_dir, lines, summary["steps"])
    steps = [m for m in lines if "sampling/tokens_generated" in m]
    last = steps[-1] if steps else {}
    # Summed, not a mean of the steps' ratios: a step that kept no group (null ratio) counts.
    kept = sum(_count(m.get("sampling/groups_kept")) for m in steps)
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
        "tokens_per_kept_group": tokens / kept if kept else math.nan,
        "entropy": _number(last.get("train/entropy")),
        "truncated": _number(last.get("rollout/truncated_frac")),
        "curve": curve,
    }
    problems = _read_problems(run_dir, summary["steps"])
    if problems is not None:
        result["problems"] = problems
    return result


def _check_logged_to(run_dir: Path, lines: list[dict], last_step: int) -> None:
    """A ValueError unless ``metrics.jsonl`` goes as far as the step summary.json says the run
    finished at: a log cut (or emptied) since would give the table an earlier step's
    entropy, truncated share and tokens, and a curve that never reaches the target."""
    logged = lines[-1]["step"] if lines else None
    if logged is not None and logged >= last_step:
        return
    ends = "holds no step" if logged is None else f"ends at step {logged}"
    raise ValueError(
        f"{run_dir / 'metrics.jsonl'} {ends} but {run_dir / 'summary.json'} says the run "
        f"finished at step {last_step}: the log was cut or emptied since; remove {run_dir} "
        "(ablate then runs it again)"
    )


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
    # dapo's uids are text (a problem's extra_info.index is read as text): any other is a
    # file not dapo's, and would not sort or match with the others' uids.
    if not all(math.isfinite(_number(a)) for a in accs) or not all(
        isinstance(u, str) for u in uids
    ):
        raise ValueError(
            f"{path}: a uid that is not text or an accuracy that is not a number; remove it "
            f"(the table's intervals are then over seeds alone), or remove {run_dir}"
        )
    return dict(zip(uids, accs, strict=True))
