"""The files a run writes as it ends, beside its metrics: ``summary.json``, ``samples.jsonl``
and ``val_problems.json`` (what ``dapo report`` and ``dapo ablate`` read)."""

from __future__ import annotations

import json
from pathlib import Path

from dapo.run.nofollow import write_atomic


def write_summary(run_dir: Path, summary: dict[str, float]) -> None:
    """``summary.json``: the run's steps, held-out accuracy at start and end, and time."""
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")


def write_samples(run_dir: Path, step: int, samples: list[dict]) -> None:
    """``samples.jsonl``: a few responses of the final evaluation, for ``dapo report``."""
    text = "".join(json.dumps({"step": step, **x}) + "\n" for x in samples)
    write_atomic(run_dir / "samples.jsonl", text)


def write_val_problems(run_dir: Path, step: int, records: list[dict]) -> None:
    """``val_problems.json``: each held-out problem's accuracy (the mean correctness of its k
    samples) at the final evaluation, by uid, so that runs can be compared problem by problem."""
    doc = {
        "step": step,
        "uid": [r["uid"] for r in records],
        "accuracy": [sum(r["correct"]) / len(r["correct"]) for r in records],
    }
    write_atomic(run_dir / "val_problems.json", json.dumps(doc) + "\n")
