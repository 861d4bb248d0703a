"""The run directory: created, refused or overwritten, and checked before any model is loaded.

A run directory holds ``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, ``model/``,
``summary.json`` and ``samples.jsonl`` (the last two written here too). Every check here runs
before the (possibly long) model load, so a typo in a path or a full disk costs seconds, not
the minutes of loading a 32B model.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from dapo.config import Config, dump_yaml
from dapo.run.checkpoint import CKPT_DIR, write_atomic

RUN_MARKERS = ("config.yaml", "metrics.jsonl", CKPT_DIR)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).exists() for m in RUN_MARKERS)


def new_run_dir(cfg: Config, *, overwrite: bool = False) -> Path:
    """The directory of a new run. One that holds another run is refused unless ``overwrite``;
    a non-empty directory that is not a run is never deleted."""
    name = cfg.run.name or f"{cfg.run.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.run.out_dir) / name
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} is a file; choose another run.name")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not is_run_dir(run_dir):
            raise ValueError(
                f"run directory {run_dir} is not empty and holds no dapo run; choose another "
                "run.name or run.out_dir (dapo never deletes what it did not write)"
            )
        if not overwrite:
            raise FileExistsError(
                f"run directory {run_dir} already holds a run; continue it with "
                f"`dapo train --resume {run_dir}`, replace it with --overwrite, or pick another "
                "run.name"
            )
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"cannot create run directory {run_dir}: {exc.strerror}; set run.out_dir to a "
            "writable place"
        ) from exc
    return run_dir


def existing_run_dir(path: str | Path) -> Path:
    """The directory given to ``--resume``, checked to hold a run."""
    run_dir = Path(path)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(
            f"--resume {run_dir}: not a dapo run directory (no config.yaml); give the directory "
            "that `dapo train` printed as its run directory"
        )
    return run_dir


def check_writable(run_dir: Path) -> None:
    probe = run_dir / ".write-test"
    try:
        with probe.open("w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"run directory {run_dir} is not writable ({exc.strerror}); fix its permissions or "
            "set run.out_dir to a writable place"
        ) from exc


def estimate_checkpoint_bytes(cfg: Config) -> int:
    """About what one checkpoint takes: weights plus AdamW's two moments, in model.param_dtype.

    Estimated from the weight files on disk (or the embedded model's shape), so it needs no
    model in memory.
    """
    per_param = DTYPE_BYTES[cfg.model.param_dtype]
    if cfg.model.path == "embedded":
        h, layers = cfg.embedded.hidden, cfg.embedded.layers
        vocab = 4096  # an upper bound of the word-level demo vocabulary
        params = vocab * h + layers * (4 * h * h + 3 * h * 2 * h)
    else:
        path = Path(cfg.model.path)
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        weights += sum(f.stat().st_size for f in path.glob("*.bin"))
        stored = 2
        try:
            meta = json.loads((path / "config.json").read_text())
            stored = DTYPE_BYTES.get(str(meta.get("torch_dtype") or meta.get("dtype")), 2)
        except (OSError, ValueError):
            pass
        params = weights // stored
    return 3 * params * per_param


def check_space(run_dir: Path, cfg: Config) -> None:
    """Refuse to start when the disk cannot hold two checkpoints (the newest being written
    while the previous one is still the safe copy)."""
    need = 2 * estimate_checkpoint_bytes(cfg)
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise ValueError(
            f"run directory {run_dir} has {free / 2**20:.0f} MiB free, but checkpointing needs "
            f"about {need / 2**20:.0f} MiB (two checkpoints of weights and optimiser state); free "
            f"space or set run.out_dir to a larger disk (train.keep_checkpoints="
            f"{cfg.train.keep_checkpoints} will keep up to {cfg.train.keep_checkpoints + 1} at "
            "once)"
        )


def write_config(run_dir: Path, cfg: Config) -> None:
    """Write ``config.yaml``; a different one already there (a forced resume) is kept aside."""
    path = run_dir / "config.yaml"
    text = dump_yaml(cfg)
    if path.is_file() and path.read_text() != text:
        k = 1
        while (run_dir / f"config.before-resume-{k}.yaml").exists():
            k += 1
        # A copy, not a move: killed right here, the run must still have a config.yaml.
        shutil.copy2(path, run_dir / f"config.before-resume-{k}.yaml")
    write_atomic(path, text)


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
