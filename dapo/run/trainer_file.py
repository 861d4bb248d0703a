"""What ``trainer.json`` (a checkpoint's counters and cursors) must hold: each key of its type,
checked when it is read, so that a damaged or crafted file is named before a model loads."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dapo.run.model_files import CheckpointError


def _number(v: Any, least: float = -math.inf) -> bool:
    """Whether ``v`` is a number (not a bool; NaN too, as a metric may be), >= ``least``."""
    return isinstance(v, int | float) and not isinstance(v, bool) and (v != v or v >= least)


def _numbers(v: Any, n: int | None = None) -> bool:
    """Whether ``v`` is an object (``n`` None) or a list of ``n``, of numbers."""
    ok = isinstance(v, dict) if n is None else isinstance(v, list) and len(v) == n
    return ok and all(_number(x) for x in (v.values() if n is None else v))


def _hex(v: Any) -> bool:
    """Whether ``v`` is a SHA-256 digest in hex."""
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


_COUNT = (lambda v: isinstance(v, int) and _number(v, 0), "a whole number >= 0")
TRAINER_FIELDS = {
    **dict.fromkeys(("step", "consecutive_skips", "metrics_bytes", "val_step"), _COUNT),
    **dict.fromkeys(("val_start", "val_last", "spent"), (_numbers, "an object of numbers")),
    "train_seconds": (lambda v: _number(v, 0), "a number >= 0"),
    "sampling_prior": (lambda v: _numbers(v, 2), "a list of 2 numbers"),
    "sampler": (
        lambda v: isinstance(v, dict) and all(_COUNT[0](v.get(k)) for k in ("epoch", "pos")),
        "{epoch, pos}",
    ),
    "ahead": (lambda v: isinstance(v, dict), "an object"),
    "val_set": (
        lambda v: isinstance(v, dict) and _COUNT[0](v.get("problems")) and _hex(v.get("digest")),
        "{problems, digest}",
    ),
}
"""What resuming and exporting read of ``trainer.json``: each key's check and its type."""

RESUMED = (
    "sampler",
    "consecutive_skips",
    "val_start",
    "val_last",
    "train_seconds",
    "metrics_bytes",
)
"""The keys besides ``step`` that every checkpoint of a training run holds and resuming reads
(:func:`check_resumable`)."""


class TrainerState(dict):
    """``trainer.json``'s object, whose missing key is a :class:`CheckpointError` naming it."""

    def __missing__(self, key: str) -> Any:
        raise CheckpointError(
            f"{self.path} has no {key!r}, which resuming reads: the file is damaged or was "
            "not written by dapo; resume from another checkpoint or start the run again"
        )


def checked_trainer(trainer: Any, path: Path) -> TrainerState:
    """``trainer`` (the object of ``path``) with ``step`` there and every key of
    :data:`TRAINER_FIELDS` it holds of its type; else a :class:`CheckpointError`."""
    if not isinstance(trainer, dict) or "step" not in trainer:
        raise CheckpointError(
            f"{path} holds no step: the file is damaged or was not written by dapo; use "
            "another checkpoint or start the run again"
        )
    for key, (ok, kind) in TRAINER_FIELDS.items():
        if key in trainer and not ok(trainer[key]):
            raise CheckpointError(
                f"{path}: {key} is {str(trainer[key])[:80]!r}, not {kind}: the file is damaged "
                "or was not written by dapo; use another checkpoint or start the run again"
            )
    checked = TrainerState(trainer)
    checked.path = path
    return checked


def check_resumable(trainer: TrainerState) -> None:
    """A :class:`CheckpointError` naming the first key of :data:`RESUMED` that ``trainer``
    lacks: a run checks it before loading a model that resuming would then fail on."""
    for key in RESUMED:
        trainer[key]  # noqa: B018 - TrainerState names a missing key
