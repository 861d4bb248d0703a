"""The policy's files in a checkpoint's ``model/``: ``save_pretrained``'s, or, when part of
the policy is frozen (LoRA's base model), the trained parameters alone.

Frozen parameters never change in a run, so a checkpoint need not hold them: with adapters
``model/`` holds the config, the generation config, the tokenizer and
:data:`TRAINED_FILE`; the base's weights are the base model's own files, which
``trainer.json`` names (``base_model``: path, revision and digest) and a resume checks.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dapo.run import manifest

TRAINED_FILE = "trained.safetensors"
"""With frozen parameters (LoRA): the trained ones alone, by their names in the model."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and the fix."""


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` of a checkpoint; one that cannot be read
    (garbled, cut, not safetensors) is a :class:`CheckpointError` naming it."""
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise unreadable_file(path, exc) from None


def unreadable_file(path: Path, exc: Exception) -> CheckpointError:
    """The error for a checkpoint's safetensors file that safetensors could not read."""
    return CheckpointError(
        f"{path} is not a readable safetensors file ({exc}): the checkpoint is damaged; "
        "restore it, or resume from an earlier checkpoint"
    )


def trained_only(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The parameters that train, by name, when some are frozen (LoRA: the adapters); None
    when every parameter trains."""
    params = list(model.named_parameters())
    if all(p.requires_grad for _, p in params):
        return None
    return {name: p.detach() for name, p in params if p.requires_grad}


def save(model: torch.nn.Module, tokenizer: Any, dest: Path) -> None:
    """The policy into ``dest``: ``save_pretrained``'s files, or with frozen parameters the
    config, the generation config and the trained parameters alone (:data:`TRAINED_FILE`);
    the tokenizer in both."""
    trained = trained_only(model)
    if trained is None:
        model.save_pretrained(dest, safe_serialization=True)
    else:
        model.config.save_pretrained(dest)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(dest)
        save_file({k: v.contiguous() for k, v in trained.items()}, dest / TRAINED_FILE)
    tokenizer.save_pretrained(dest)


def load(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy the safetensors weights in ``model_dir`` (one file or shards, or the trained
    parameters alone: :data:`TRAINED_FILE`) into ``model``.

    Loading into the live module keeps its construction (attention kernel, dtype, device), so
    a resumed run computes exactly what the uninterrupted one would.
    """
    if (model_dir / TRAINED_FILE).is_file():
        _load_trained(model, model_dir / TRAINED_FILE)
        return
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model_dir} holds no .safetensors weights")
    if trained_only(model) is not None:
        raise CheckpointError(
            f"{model_dir} holds a whole model, but this run trains adapters (model.lora.rank "
            "> 0): was model.lora changed since the run began?"
        )
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(read_tensors(shard))
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise CheckpointError(
            f"the weights in {model_dir} do not fit this model: {str(exc).splitlines()[1:3]}; "
            "was model.* changed since the run began?"
        ) from None
    # save_pretrained stores a tied weight (lm_head = embeddings) once; anything else missing
    # means the checkpoint does not belong to this model.
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded_ptrs]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"the weights in {model_dir} do not fit this model (missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}); was model.* changed since the run began?"
        )


@torch.no_grad()
def _load_trained(model: torch.nn.Module, path: Path) -> None:
    """The trained parameters alone, into a model whose frozen ones are already the base's:
    exactly the same names, shapes and dtypes, or refused."""
    saved = read_tensors(path)
    params = dict(model.named_parameters())
    own = {name for name, p in params.items() if p.requires_grad}
    wrong = sorted(
        n
        for n in saved.keys() & own
        if saved[n].shape != params[n].shape or saved[n].dtype != params[n].dtype
    )
    if saved.keys() != own or wrong:
        raise CheckpointError(
            f"the trained parameters in {path} do not fit this model (missing "
            f"{sorted(own - saved.keys())[:3]}, unexpected {sorted(saved.keys() - own)[:3]}, "
            f"other shapes {wrong[:3]}); was model.lora or model.* changed since the run began?"
        )
    for name, tensor in saved.items():
        params[name].copy_(tensor)


def weights_digest(model_dir: Path) -> str:
    """A SHA-256 of the base model's weights and config (``model.lora``'s checkpoints name
    the base by it): of each ``*.safetensors`` file's SHA-256 and ``config.json``. A file in
    the Hugging Face cache is a link to a blob named by its SHA-256, read from the name."""
    digest = hashlib.sha256()
    for path in sorted([*model_dir.glob("*.safetensors"), model_dir / "config.json"]):
        target = path.resolve()
        own = (
            target.name
            if _is_sha256(target.name) and path.is_symlink()
            else manifest.sha256(target)
        )
        digest.update(f"{path.name} {own}\n".encode())
    return digest.hexdigest()


def _is_sha256(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def base_reference(
    path: str, revision: str | None, model_dir: Path | None, model: torch.nn.Module
) -> dict[str, Any]:
    """What a LoRA checkpoint records of its base: ``model.path``, ``model.revision`` and a
    digest of the frozen weights, of the files in ``model_dir`` (:func:`weights_digest`), or
    without a directory (the embedded model, rebuilt from its settings) of the frozen
    tensors themselves."""
    if model_dir is not None:
        digest = weights_digest(model_dir)
    else:
        h = hashlib.sha256()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # a shard: gathered
                h.update(name.encode())
                h.update(whole.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digest = h.hexdigest()
    return {"path": path, "revision": revision, "sha256": digest}


def check_base(
    saved: dict[str, Any] | None,
    now: dict[str, Any],
    where: Path,
    fix: str = "resume with the same base model (model.path, model.revision)",
) -> str | None:
    """Why the adapters in the checkpoint ``where`` do not belong on this base (None: they
    do), ending with ``fix``: what to do about it."""
    if saved is None:
        return f"{where} holds no adapters' base model (it was not written with model.lora)"
    if saved.get("sha256") != now["sha256"]:
        dtype, loads = saved.get("param_dtype"), now.get("param_dtype")
        if now["path"] == "embedded" and dtype is not None and loads not in (None, dtype):
            # The embedded base has no files: its digest is of its weights as loaded.
            fix = f"resume with model.param_dtype={dtype}, the dtype its adapters trained on"
        return (
            f"{where} trained adapters on model.path={saved.get('path')} (weights sha256 "
            f"{str(saved.get('sha256'))[:12]}...), but this run's base is "
            f"model.path={now['path']} (sha256 {now['sha256'][:12]}...): {fix}"
        )
    return None
