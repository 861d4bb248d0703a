"""The Python API: what ``dapo train``, ``dapo eval`` and ``dapo export`` run, callable from
a script.

    import dapo

    def reward(response: str, ground_truth: str) -> float:   # top level of a .py file
        return 1.0 if response.strip().endswith(ground_truth) else -1.0

    if __name__ == "__main__":   # reward workers import this file: its work runs only here
        cfg = dapo.load_config("recipes/smollm2-135m-arith.yaml", ["train.steps=10"])
        result = dapo.train(cfg, reward_fn=reward)
        print(result.run_dir, result.start_accuracy, result.end_accuracy)
        scores = dapo.evaluate(result.run_dir / "model", "val.jsonl", k=8, reward_fn=reward)
        dapo.export(result.run_dir, "exports/step-10", step=10)   # a checkpoint as a HF model

The command line parses its flags into exactly these calls, so a script and a command with
the same settings make the same run. ``reward_fn`` must be a function at the top level of a
module or script: reward workers are separate processes that import it by name (a lambda is
refused with that message). Under ``torchrun`` every rank calls :func:`train` alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapo.api.evaluation import EvalResult, evaluate
from dapo.config import Config, apply_overrides, validate
from dapo.config import load_config as _load

if TYPE_CHECKING:
    from dapo.api.exporting import ExportResult

__all__ = [
    "EvalResult",
    "ExportResult",
    "TrainResult",
    "evaluate",
    "export",
    "load_config",
    "train",
]


def __getattr__(name: str) -> Any:
    if name == "ExportResult":  # loaded on first use: the export's module imports torch
        from dapo.api.exporting import ExportResult

        return ExportResult
    raise AttributeError(f"module 'dapo.api' has no attribute {name!r}")


def export(run_dir: str | Path, out: str | Path, **options: Any) -> ExportResult:
    """Write a checkpoint of the run in ``run_dir`` as a Hugging Face model directory
    ``out``, as ``dapo export`` does (``step``, ``overwrite``, ``dtype``, ``merge``,
    ``base``: its flags; ``log``: a function given each progress line, default printing it
    to stderr)."""
    from dapo.api.exporting import export as export_

    return export_(run_dir, out, **options)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    *,
    base: str | None = None,
    preset: str | None = None,
) -> Config:
    """The config ``dapo train`` would run: the demo (no ``path``) or a YAML file, under
    dotted ``overrides`` such as ``"optim.lr=1e-5"``; ValueError lists every bad value."""
    return _load(path, as_overrides(overrides), base=base, preset=preset)


@dataclass(frozen=True)
class TrainResult:
    """What a finished run left: its directory and its held-out accuracy at start and end
    (``summary.json``, here as ``summary``). None where this rank wrote no summary (the
    ranks other than 0 under torchrun)."""

    run_dir: Path
    steps: int | None
    start_accuracy: float | None
    end_accuracy: float | None
    summary: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """``result["run_dir"]`` as ``result.run_dir``; any other key from ``summary``."""
        return getattr(self, key) if key in _TRAIN_FIELDS else self.summary[key]


_TRAIN_FIELDS = ("run_dir", "steps", "start_accuracy", "end_accuracy", "summary")


def as_overrides(overrides: Sequence[str] | Mapping[str, Any]) -> list[str]:
    """Dotted overrides as ``section.field=value`` strings; a mapping's values are written
    as YAML reads them back (``{"train.steps": 2}`` is ``train.steps=2``)."""
    if isinstance(overrides, str):
        raise ValueError(f"overrides must be a list of section.field=value, not {overrides!r}")
    if isinstance(overrides, Mapping):
        return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides.items()]
    return list(overrides)


def train(
    config: Config | str | Path | None = None,
    *,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    reward_fn: Callable[..., Any] | None = None,
    base: str | None = None,
    preset: str | None = None,
    resume: str | Path | None = None,
    overwrite: bool = False,
    force: bool = False,
    quiet: bool = False,
) -> TrainResult:
    """Train as ``dapo train`` does and return the run's summary.

    Args:
        config: a :class:`~dapo.config.Config` (copied, not changed), a YAML file, or None
            for the embedded CPU demo.
        overrides: dotted ``section.field=value`` settings applied last (or a mapping of
            ``section.field`` to value).
        reward_fn: a function ``(response, ground_truth) -> float | bool | Score | dict``
            that grades every row in place of the verifiers, as ``reward.function`` does.
        base, preset: as ``--base`` and ``--preset`` (a file or Config picks its own).
        resume: a run directory to continue from its latest checkpoint (its saved config,
            under ``overrides``); ``force`` accepts overrides that change the run.
        overwrite: replace the run already in the run directory (default: refuse).
        quiet: one plain line per step instead of the live display.
    """
    from dapo.api import training
    from dapo.api.process_state import kept_process_state

    items = as_overrides(overrides)
    cfg, resume_dir = _config(config, items, base, preset, resume, overwrite, force)
    if reward_fn is not None:
        _set_reward_fn(cfg, reward_fn)
    if quiet:
        cfg.run.progress = "plain"
    with kept_process_state():  # the caller's threads, kernels and generator, as they were
        run_dir = training.run(cfg, resume_dir, overwrite=overwrite, reward_fn=reward_fn)
    assert run_dir is not None
    return _result(run_dir)


def _config(
    config: Config | str | Path | None,
    overrides: Sequence[str],
    base: str | None,
    preset: str | None,
    resume: str | Path | None,
    overwrite: bool,
    force: bool,
) -> tuple[Config, Path | None]:
    from dapo.api import run_config

    if not isinstance(config, Config):
        return run_config.resolve_config(
            config,
            list(overrides),
            base=base,
            preset=preset,
            resume=resume,
            overwrite=overwrite,
            force=force,
        )
    if resume or base or preset:
        raise ValueError(
            "train(config=Config, ...) runs that config as it is: give resume, base and preset "
            "with a YAML path or None instead"
        )
    return apply_overrides(config, overrides), None


def _set_reward_fn(cfg: Config, reward_fn: Callable[..., Any]) -> None:
    from dapo.reward import custom

    cfg.reward.function = custom.spec_for(reward_fn, cfg.reward.function)
    validate(cfg)


def _result(run_dir: Path) -> TrainResult:
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    return TrainResult(
        run_dir=run_dir,
        steps=summary.get("steps"),
        start_accuracy=summary.get("val/accuracy_start"),
        end_accuracy=summary.get("val/accuracy_end"),
        summary=summary,
    )
