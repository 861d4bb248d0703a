"""Room on the disk for a run's checkpoints, checked before the model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dapo.config import Config

__all__ = ["DTYPE_BYTES", "check_space", "estimate_checkpoint_bytes"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def estimate_checkpoint_bytes(cfg: Config, weights_dir: Path | None) -> int:
    """About what one checkpoint takes: weights plus AdamW's two moments, in model.param_dtype.

    Estimated from the weight files on disk in ``weights_dir`` (the model's directory, a Hub
    id's snapshot; None for the embedded model, from its shape), so it needs no model in
    memory.
    """
    per_param = DTYPE_BYTES[cfg.model.param_dtype]
    if weights_dir is None:
        h, layers = cfg.embedded.hidden, cfg.embedded.layers
        vocab = 4096  # an upper bound of the word-level demo vocabulary
        params = vocab * h + layers * (4 * h * h + 3 * h * 2 * h)
    else:
        path = weights_dir
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


def check_space(
    run_dir: Path, cfg: Config, weights_dir: Path | None, *, resume: bool = False
) -> None:
    """Refuse to start when the disk cannot hold two checkpoints (the newest being written
    while the previous one is still the safe copy) of the model in ``weights_dir``; a resume's
    safe copy is on the disk already, and it needs room for one more."""
    copies = 1 if resume else 2
    need = copies * estimate_checkpoint_bytes(cfg, weights_dir)
    # A new run's directory does not exist yet: its nearest ancestor is on the same disk.
    where = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    free = shutil.disk_usage(where).free
    if free < need:
        raise ValueError(
            f"run directory {run_dir} has {free / 2**20:.0f} MiB free, but checkpointing needs "
            f"about {need / 2**20:.0f} MiB ({('one more', 'two')[copies - 1]} checkpoint"
            f"{'s' * (copies - 1)} of weights and optimiser state); free "
            f"space or set run.out_dir to a larger disk (train.keep_checkpoints="
            f"{cfg.train.keep_checkpoints} will keep up to {cfg.train.keep_checkpoints + 1} at "
            "once)"
        )
