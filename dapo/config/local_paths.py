"""Local paths in a config made absolute: a run's config.yaml then names the model, the data
and the code it read wherever the run is resumed, inspected or evaluated from.

A relative ``model.path`` read from another directory names another model or none, and one
shaped like ``models/tiny`` would be taken for a Hub id; so a run settles each relative
path that exists from where it starts, as it always has settled ``reward.function``'s file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from dapo.config.sections import Config
from dapo.reward.custom import is_path_spec

__all__ = ["absolute_paths", "as_settled"]


def absolute_paths(cfg: Config) -> Config:
    """A copy of ``cfg`` whose local paths that exist from the working directory are absolute
    (``~`` expanded): ``model.path`` (a directory), ``data.train_file`` and ``data.val_file``,
    and the ``PATH.py`` of ``reward.function`` and ``env.class``. A Hub id, ``embedded``, a
    module, a built-in name and a path that does not exist (its error names it as given) are
    kept."""
    model, data = cfg.model, cfg.data
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            model,
            path=model.path if model.path == "embedded" else _absolute(model.path, Path.is_dir),
        ),
        data=dataclasses.replace(
            data,
            train_file=_absolute(data.train_file, Path.is_file),
            val_file=_absolute(data.val_file, Path.is_file),
        ),
        reward=dataclasses.replace(cfg.reward, function=_absolute_spec(cfg.reward.function)),
        env=dataclasses.replace(cfg.env, class_=_absolute_spec(cfg.env.class_)),
    )


def _absolute(path: str, exists: Callable[[Path], bool]) -> str:
    local = Path(path).expanduser()
    # Joined, not normalised: a/../b after a symbolic link a is not b (the kernel follows a).
    return str(Path.cwd() / local) if path and exists(local) else path


def _absolute_spec(spec: str) -> str:
    """``PATH.py:NAME`` with PATH absolute (resolved, as dapo.reward.custom.check writes it)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not is_path_spec(target):
        return spec
    local = Path(target).expanduser()
    return f"{local.resolve()}:{name}" if local.is_file() else spec


def as_settled(cfg: Config, saved: Config) -> Config:
    """``cfg`` as the run settled its own config when it started: each relative path that
    exists from here absolute (the saved ones are), and ``eval.num_samples=0`` (the data's
    copies of each problem) as the number it came to; so the run's own settings, given again
    as written, do not differ from it."""
    settled = absolute_paths(cfg)
    if settled.eval.num_samples == 0:
        samples = dataclasses.replace(settled.eval, num_samples=saved.eval.num_samples)
        settled = dataclasses.replace(settled, eval=samples)
    return settled
