"""The files a run writes beside its metrics and checkpoints: ``config.yaml`` as it starts or
resumes, and as it ends ``summary.json``, ``samples.jsonl`` and ``val_problems.json`` (what
``dapo report`` and ``dapo ablate`` read)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dapo.config import Config, dump_yaml
from dapo.run.nofollow import no_link, open_binary, write_atomic


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


def write_config(run_dir: Path, cfg: Config) -> None:
    """Write ``config.yaml``; a different one already there (a forced resume) is kept aside."""
    path = no_link(run_dir / "config.yaml")
    text = dump_yaml(cfg)
    if path.is_file() and path.read_text() != text:
        k = 1
        while os.path.lexists(run_dir / f"config.before-resume-{k}.yaml"):  # links count
            k += 1
        # A copy, not a move: killed right here, the run must still have a config.yaml.
        with open_binary(run_dir / f"config.before-resume-{k}.yaml", exclusive=True) as f:
            f.write(path.read_bytes())
    write_atomic(path, text)
