"""The config of a run: the one given, or, with ``--resume``, the run's saved one under any
file and overrides given, refused where they would change the run it continues."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from dapo.config import Config, load_config, run_changing_differences, saved_before_keys_moved
from dapo.config.local_paths import as_settled

__all__ = ["resolve_config"]


def resolve_config(
    config: str | Path | None,
    overrides: Sequence[str],
    *,
    base: str | None = None,
    preset: str | None = None,
    resume: str | Path | None = None,
    overwrite: bool = False,
    force: bool = False,
) -> tuple[Config, Path | None]:
    """The run's config; with ``resume``, the saved one under any file and overrides given."""
    from dapo.run import rundir

    if not resume:
        return load_config(config, overrides, base=base, preset=preset), None
    if overwrite:
        raise ValueError("--resume continues a run and --overwrite replaces it: give one")
    run_dir = rundir.existing_run_dir(resume)
    saved_path = run_dir / "config.yaml"
    saved = load_config(saved_path)
    if saved_before_keys_moved(saved_path):
        print(
            f"dapo: notice: {run_dir} was saved by dapo 0.1, and 0.2 continues it differently: "
            "reward.mode=dapo (and data_source math_dapo) now follows the reference verifier "
            "exactly (0.1's rules are reward.mode=lenient), sampling draws in float64, and "
            "model.dtype is now model.compute_dtype, with float32 weights",
            file=sys.stderr,
        )
    cfg = load_config(config or saved_path, overrides, base=base, preset=preset)
    if config is None and cfg.run.base != saved.run.base:
        raise ValueError(
            f"--resume {run_dir}: run.base {saved.run.base!r} -> {cfg.run.base!r} would change "
            "the run's label only: its config.yaml sets every field a base sets. Give the "
            "fields to change as overrides (with --force), or start a new run"
        )
    differences = run_changing_differences(saved, cfg)
    if differences and not force:
        listing = "\n  ".join(differences)
        raise ValueError(
            f"--resume {run_dir}: the config differs from the run's in fields that change the "
            f"run:\n  {listing}\nthe resumed run would not be the run that was started. Drop "
            "these changes, or add --force to resume with them anyway (the old config.yaml is "
            "kept beside the new one)"
        )
    _refuse_code_from(run_dir, cfg)
    # eval.num_samples=0 is the number the run settled when it started, not what the data
    # holds now: the same settling the comparison above made.
    return as_settled(cfg, saved), run_dir


def _refuse_code_from(run_dir: Path, cfg: Config) -> None:
    """A run directory is data, perhaps from elsewhere: the reward function and the
    environment its config names may not be files inside it (resuming would run code that
    came with the directory)."""
    from dapo.reward import custom

    if found := custom.file_inside(run_dir, cfg):
        key, spec = found
        raise ValueError(
            f"--resume {run_dir}: {key}={spec} is a file inside the run directory, "
            "and dapo runs no code that came with a run directory; copy it elsewhere, "
            f"read it, and resume with {key}=THAT.py:NAME --force"
        )
