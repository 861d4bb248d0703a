"""The tensors of a LoRA checkpoint for ``dapo export``: the adapters as a peft adapter
directory names them, or merged into the base model's weights (``--merge``).

A LoRA checkpoint holds the adapters alone (one process's ``model/trained.safetensors``, or
``torchrun``'s DCP shards) and names its base in ``trainer.json`` (``base_model``: path,
revision, digest, and the ``model.lora`` settings the adapters were trained with). Merging
loads that base as the run did (its ``config.yaml``), checks its digest against the
checkpoint's, puts the adapters in, and computes ``W + (alpha / r) B A``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dapo.config import Config, ModelConfig, choices, load_config
from dapo.config.loading import set_value
from dapo.config.yaml_files import clipped_repr
from dapo.dist import dcp
from dapo.models import hub, lora, merged_save
from dapo.run import model_files
from dapo.run.model_files import TRAINED_FILE, CheckpointError

DTYPE_CHOICES = choices(ModelConfig, "param_dtype")
MOVED_BASE = (
    "give that model with --base MODEL (a directory or Hub id), or export without --merge: "
    "a peft adapter directory needs no base"
)
"""How to merge adapters whose base is no longer where the run's ``config.yaml`` says."""


def run_config(run_dir: Path) -> Config:
    """The run's settings, from the ``config.yaml`` it wrote."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ValueError(f"{run_dir}: no config.yaml; give the directory of a dapo run")
    return load_config(path)


def with_trained_settings(cfg: Config, saved_base: Any, ckpt: Path, log) -> Config:
    """``cfg`` with the ``model.lora`` settings the checkpoint's adapters were trained with and
    the ``model.param_dtype`` their base was loaded in (recorded beside ``base_model``): a
    resume with ``--force`` may have changed ``config.yaml``'s since, and a merge with
    another alpha scales the update wrongly, one into a base rounded otherwise is not the
    policy that was trained. A checkpoint that records none (dapo before these records)
    keeps ``config.yaml``'s."""
    if not isinstance(saved_base, dict):
        raise CheckpointError(f"{ckpt}: trainer.json's base_model is not an object: damaged")
    saved = saved_base.get("lora")
    if saved is not None:
        _use_lora_record(cfg, saved, ckpt, log)
    if "param_dtype" in saved_base:
        now, dtype, kinds = cfg.model.param_dtype, saved_base["param_dtype"], DTYPE_CHOICES
        if dtype not in kinds:
            raise CheckpointError(
                f"{ckpt}: trainer.json's base_model.param_dtype is {clipped_repr(dtype)}, not "
                f"one of {', '.join(kinds)}: the file is damaged or was not written by dapo"
            )
        cfg.model.param_dtype = dtype
        if dtype != now:
            log(f"export: the base was loaded in model.param_dtype={dtype} (config.yaml: {now})")
    return cfg


def _use_lora_record(cfg: Config, saved: Any, ckpt: Path, log) -> None:
    """``cfg.model.lora`` set to the checkpoint's record ``saved`` of it, checked."""
    if not isinstance(saved, dict) or set(saved) != set(lora.TRAINED_SETTINGS):
        raise CheckpointError(
            f"{ckpt}: trainer.json's base_model.lora is not {{{', '.join(lora.TRAINED_SETTINGS)}}}:"
            " the file is damaged or was not written by dapo"
        )
    now = lora.trained_settings(cfg.model.lora)
    try:
        for name, value in saved.items():
            set_value(cfg, f"model.lora.{name}", value)
    except ValueError as exc:
        raise CheckpointError(f"{ckpt}: trainer.json's base_model.lora: {exc}") from None
    errors = cfg.model.lora.check()
    if errors:
        raise CheckpointError(f"{ckpt}: trainer.json's base_model.lora: {'; '.join(errors)}")
    changed = [f"{n}={saved[n]!r} (config.yaml: {now[n]!r})" for n in saved if saved[n] != now[n]]
    if changed:
        log(f"export: the adapters were trained with model.lora {', '.join(changed)}: used")


def trained_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The adapters of the checkpoint ``ckpt`` by their names in the model, whichever way it
    was written."""
    if (ckpt / "model" / TRAINED_FILE).is_file():
        return model_files.read_tensors(ckpt / "model" / TRAINED_FILE)
    stored = dcp.stored_tensors(ckpt / "state")
    return {
        n.removeprefix("model."): t for n, t in dcp.read_tensors(ckpt / "state", stored).items()
    }


def adapter_files(cfg: Config, trained: dict[str, torch.Tensor]) -> tuple[dict, dict[str, Any]]:
    """(the tensors of ``adapter_model.safetensors``, ``adapter_config.json``) of a peft
    adapter directory holding ``trained``, on the run's base model."""
    if any(lora.ADAPTER not in name for name in trained):
        raise CheckpointError("the checkpoint holds trained weights that are not LoRA adapters")
    tensors = {lora.peft_name(name): t for name, t in trained.items()}
    return tensors, lora.peft_config(cfg.model.lora, cfg.model.path, cfg.model.revision)


def merged(
    cfg: Config, trained: dict[str, torch.Tensor], saved_base: dict[str, Any], ckpt: Path, log
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The base model's weights with the adapters ``trained`` merged in, by the base's names
    (a tied weight once): loaded on the CPU as the run loaded it, its digest checked against
    the checkpoint's ``saved_base``; and the fields of ``config.json`` that must change to
    describe them: ``dtype`` float32 on a bfloat16 or float16 base (the merge is float32,
    what was trained), ``tie_word_embeddings`` false when the head was adapted."""
    from dapo.models import policy

    cfg.model.device = "cpu"
    warmup = []
    if cfg.model.path == "embedded":  # rebuilt from its cache, or warm-started as the run did
        from dapo.training.inputs import load_run_data

        warmup = load_run_data(cfg).warmup_pairs
    log(f"export: loading the base model {cfg.model.path} to merge the adapters into")
    try:
        where = None if cfg.model.path == "embedded" else policy.model_dir(cfg)
    except hub.HubModelError as exc:  # not in the cache, and not to be fetched
        raise ValueError(f"--merge: the adapters' base: {exc}; {MOVED_BASE}") from None
    # Where the base is missing, another may be given; no other base cures other refusals.
    hint = f"; {MOVED_BASE}" if where and not (where / "config.json").is_file() else ""
    try:
        model, _ = policy.load_policy(cfg, warmup, log=log)
    except ValueError as exc:
        raise ValueError(f"--merge: the adapters' base: {exc}{hint}") from None
    now = model_files.base_reference(cfg.model.path, cfg.model.revision, where, model)
    if wrong := model_files.check_base(saved_base, now, ckpt, MOVED_BASE):
        raise CheckpointError(f"--merge: {wrong}")
    params = dict(model.named_parameters())
    if set(trained) != set(lora.moving_names(model) or ()):
        raise CheckpointError(
            f"{ckpt}: its adapters do not fit the model.lora settings they were recorded with"
            " (trainer.json's base_model.lora, else config.yaml)"
        )
    with torch.no_grad():
        for name, tensor in trained.items():
            params[name].copy_(tensor)
    weights = lora.merged_weights(model)
    for alias in dcp.tied_aliases(weights):
        del weights[alias]  # stored once, as save_pretrained stores it
    changes: dict[str, Any] = {"dtype": "float32"} if merged_save.widened(model) else {}
    if merged_save.head_untied(model, weights):
        changes["tie_word_embeddings"] = False
    return weights, changes
