"""Local paths in a config made absolute: a run's config.yaml then names the model, the data
and the code it read wherever the run is resumed, inspected or evaluated from.

A relative ``model.path`` read from another directory names another model or none, and one
shaped like ``models/tiny`` would be taken for a Hub id; so a run settles each relative
path that exists from where it starts, as it always has settled ``reward.function``'s file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from dapo.config.sections import Config
from dapo.reward.custom import is_path_spec

__all__ = ["absolute_paths"]


def absolute_paths(cfg: Config) -> Config:
    """A copy of ``cfg`` whose relative local paths that exist from the working directory are
    absolute: ``model.path`` (a directory), ``data.train_file`` and ``data.val_file``, and the
    ``PATH.py`` of ``reward.function`` and ``env.class``. A Hub id, ``embedded``, a module, a
    built-in name and a path that does not exist (its own error names it as written) are kept.
    """
    model, data = cfg.model, cfg.data
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(model, path=_absolute(model.path, Path.is_dir)),
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
    if not path or local.is_absolute() or not exists(local):
        return path
    return os.path.abspath(local)


def _absolute_spec(spec: str) -> str:
    """``PATH.py:NAME`` with PATH absolute (resolved, as dapo.reward.custom.check writes it)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not is_path_spec(target):
        return spec
    local = Path(target).expanduser()
    if local.is_absolute() or not local.is_file():
        return spec
    return f"{local.resolve()}:{name}"
