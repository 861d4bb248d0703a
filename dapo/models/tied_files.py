"""A tied weight stored twice: a ``config.json`` that ties the output head to the input
embeddings (``tie_word_embeddings``) beside weight files that hold two different tensors for
them (a head trained apart: LoRA on ``lm_head``, merged, under a config that still says
tied). A loader that ties them reads one tensor for both and silently drops the other, so
the sharded load (:mod:`dapo.models.sharded_load`) refuses such a directory instead."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

CHUNK = 2**24
"""The most values of each tensor compared at a time (64 MB of float32)."""


def stored_names(names: list[str], files: dict[str, Path], prefix: str) -> list[str]:
    """Each name under which the weight files store a tensor known by ``names`` (its tied
    names), as given or without the base model's ``prefix``."""
    found = [n for n in names if n in files]
    bare = [n[len(prefix) + 1 :] for n in names if prefix and n.startswith(prefix + ".")]
    return found + [n for n in bare if n in files and n not in found]


def stored_apart(names: list[str], files: dict[str, Path], prefix: str) -> list[str] | None:
    """The two stored names of one tied weight when the files hold different values under
    them; None when stored once, or twice alike (files that cannot be read are left to the
    load, which names them)."""
    found = stored_names(names, files, prefix)
    if len(found) < 2:
        return None
    try:
        return found[:2] if _differ(files, *found[:2]) else None
    except (SafetensorError, OSError):
        return None


def _differ(files: dict[str, Path], a: str, b: str) -> bool:
    with safe_open(str(files[a]), framework="pt") as f, safe_open(str(files[b]), "pt") as g:
        x, y = f.get_slice(a), g.get_slice(b)
        shape = list(x.get_shape())
        if shape != list(y.get_shape()) or x.get_dtype() != y.get_dtype():
            return True
        if not shape:
            return not torch.equal(f.get_tensor(a), g.get_tensor(b))
        step = max(1, CHUNK // max(1, int(torch.Size(shape[1:]).numel())))
        return any(
            not torch.equal(x[i : i + step], y[i : i + step]) for i in range(0, shape[0], step)
        )


def refusal(path: Path, pair: list[str], files: dict[str, Path]) -> ValueError:
    """The error for a tied weight whose two names hold different tensors in ``path``."""
    where = sorted({files[n].name for n in pair})
    return ValueError(
        f"model.path={path}: config.json ties {pair[0]} and {pair[1]} (tie_word_embeddings), "
        f"but {' and '.join(where)} hold two different tensors under those names (a head "
        "trained apart from the embeddings, as LoRA on lm_head gives); tying them would "
        'silently drop one. Set "tie_word_embeddings": false in its config.json to load both '
        "as they are"
    )
