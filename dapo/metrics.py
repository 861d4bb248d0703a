"""Metric logging: one JSON line per step in the run directory, one readable line on stdout."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; a null is explicit about it
    return value


class MetricsLogger:
    CONSOLE_KEYS = (
        ("rollout/accuracy", "acc", ".3f"),
        ("rollout/reward_mean", "reward", "+.3f"),
        ("rollout/response_len_mean", "len", ".1f"),
        ("sampling/rounds", "rounds", ".0f"),
        ("train/entropy", "entropy", ".3f"),
        ("clip/high_frac", "clip_hi", ".4f"),
        ("val/accuracy", "VAL", ".3f"),
        ("perf/step_s", "s", ".1f"),
    )

    def __init__(self, path: Path, stream: TextIO | None = None) -> None:
        self.path = path
        self.stream = stream
        self._file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.stream is not None:
            parts = [f"step {step:>4}"]
            for key, short, fmt in self.CONSOLE_KEYS:
                if metrics.get(key) is not None:
                    parts.append(f"{short} {format(metrics[key], fmt)}")
            print("  ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        self._file.close()
