"""Pickled ``.bin`` weights that torch's safe loader refuses: which file, and the safe fix.

``from_pretrained`` reads ``.bin`` weights with ``torch.load(weights_only=True)``, which
refuses a pickle that names more than tensors (nothing in it runs); its own message advises
``weights_only=False``, which would run whatever the pickle names. dapo says instead which
file holds more than tensors, and how to convert the weights safely.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from dapo.exception_chain import found_in_chain


def refused_pickle(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling, torch's safe loader refusing a
    pickle: transformers 5 lets the UnpicklingError through, 4.x raises an OSError from it."""
    return found_in_chain(exc, pickle.UnpicklingError) is not None


def refused_by_torch(file: Path) -> bool:
    """Whether torch's safe loader refuses ``file``: read with ``weights_only`` (nothing
    runs), its tensors mapped rather than read where the format allows (a shard of GBs)."""
    for options in ({"mmap": True}, {}):  # the old, non-zip format cannot be mapped
        try:
            torch.load(file, weights_only=True, map_location="meta", **options)
        except pickle.UnpicklingError:
            return True
        except Exception:  # noqa: BLE001 - not refused as a pickle: try unmapped, then no
            continue
        return False
    return False


def pickled_weights(path: Path) -> ValueError:
    """The error for ``.bin`` weights of ``path`` that torch's ``weights_only`` loader
    refused, naming the files that it refuses (of a sharded model, only those). The torchrun
    loader reads only safetensors files and leaves such a directory to the whole load
    (:func:`dapo.models.sharded_load.load`), which raises this."""
    bins = sorted(path.glob("pytorch_model*.bin"))
    bad = [f.name for f in bins if refused_by_torch(f)] or [f.name for f in bins]
    if len(bad) > 1:
        what, it = f"{', '.join(bad)} are pickles", "them"
    else:
        what, it = f"{bad[0] if bad else 'its weights'} is a pickle", "it"
    return ValueError(
        f"model.path={path}: {what} holding more than tensors; torch's safe loader refused "
        f"{it}, and dapo loads no pickled code (unpickling it could run anything it names). "
        "Convert the weights to safetensors from a copy you trust, in an environment you "
        "trust (there: torch.load(FILE, weights_only=False), load the tensors into the model, "
        "model.save_pretrained(DIR, safe_serialization=True)), or fetch the model's "
        ".safetensors files, and give model.path=DIR"
    )
