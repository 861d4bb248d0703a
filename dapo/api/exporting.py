"""``dapo export RUN [--step N] --out DIR``: a checkpoint of a run as a Hugging Face model
directory, what ``from_pretrained``, ``dapo eval`` and ``model.path`` read.

Either kind of checkpoint: one process's (its ``model/`` is ``save_pretrained``'s already:
its weight files are copied) or ``torchrun``'s DCP shards written at any world size (each
whole tensor gathered from every rank's shards here, in one process, a few GB at a time,
and written as safetensors shards with their index). Every file of the checkpoint is checked
against its manifest's SHA-256 before anything is read; nothing in it is unpickled or run.

The directory gets the weights (in their stored dtype, or ``--dtype``), ``config.json``, the
tokenizer (with its named chat templates, ``additional_chat_templates/*.jinja``), a
``generation_config.json`` whose ``eos_token_id`` lists every token the run stopped a
response on (the tokenizer's EOS, the model's, ``rollout.stop_token_ids``), and
``dapo-export.json`` (the run, the step, the checkpoint manifest's SHA-256, every file it
wrote). It is written beside ``--out`` and renamed into place; an existing ``--out`` is
refused unless ``--overwrite``, which replaces only a directory that ``dapo export`` wrote.
Without ``--step``, a newest checkpoint that is not whole is passed over with a
``dapo: warning:`` naming it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dapo.api import adapters
from dapo.api.export_dir import MARKER as MARKER  # what an export's provenance file is named
from dapo.api.export_dir import (
    TEMPLATES_DIR,
    make_parents,
    prepare,
    publish,
    remove_made,
    remove_stale,
    write_marker,
)
from dapo.config.yaml_files import YamlFileError, clipped_repr, read_yaml_file
from dapo.data.output import sigterm_raises
from dapo.dist import dcp
from dapo.models import hub
from dapo.models.policy import DTYPES, generation_stop_ids, tokenizer_from_dir
from dapo.run import checkpoint
from dapo.run.checkpoint import CheckpointError
from dapo.run.model_files import read_tensors, unreadable_file

SHARD_BYTES = 5 * 2**30
"""Weights per safetensors file of an export of DCP shards (``save_pretrained``'s 5 GB)."""
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export` wrote."""

    out_dir: Path
    step: int
    sharded: bool
    """Whether the checkpoint was DCP shards (``torchrun``) rather than one process's."""
    parameters: int
    weight_bytes: int
    stop_token_ids: tuple[int, ...]
    seconds: float


def export(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    overwrite: bool = False,
    dtype: str | None = None,
    merge: bool = False,
    base: str | None = None,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
) -> ExportResult:
    """Write the checkpoint of ``step`` (default: the latest complete one) of the run in
    ``run_dir`` as a Hugging Face model directory ``out``, its weights in ``dtype``
    (``float32``, ``bfloat16``, ``float16``; default: as stored). A LoRA run's checkpoint
    becomes a peft adapter directory, or with ``merge`` a model of the base's shape with the
    adapters merged in, in float32 (by default also on a bfloat16 or float16 base: what was
    trained; ``dtype`` rounds it once, at the end)."""
    started = time.perf_counter()
    run_dir, out = Path(run_dir), Path(os.path.abspath(out))  # "." named; a link kept, not followed
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    if base is not None and not merge:
        raise ValueError("--base names the model --merge merges into; add --merge")
    ckpt, tmp = find_checkpoint(run_dir, step, log), prepare(out, overwrite, run_dir)
    log(f"export: checking {ckpt} against its manifest (SHA-256 of every file)")
    trainer = checkpoint.read_trainer_state(ckpt, digests=True)
    sharded = (ckpt / "state").is_dir()
    adapted = "base_model" in trainer  # LoRA: the checkpoint holds the adapters alone
    if merge and not adapted:
        raise ValueError(
            f"--merge: {ckpt} trained every weight (no LoRA adapters to merge); export it "
            "without --merge"
        )
    changes: dict = {}  # config.json's fields a merge changes
    with sigterm_raises():  # a SIGTERM runs the clean-up: the copy may be gigabytes
        made = make_parents(out)
        try:
            remove_stale(out)
            tmp.mkdir()
            if adapted:
                parameters, size, dtype, changes = _write_lora(
                    run_dir, ckpt, trainer, tmp, dtype, merge, log, base
                )
            elif sharded:
                parameters, size = _write_gathered(ckpt / "state", tmp, dtype, log)
            else:
                parameters, size = _copy_weights(ckpt / "model", tmp, dtype, log)
            as_adapter = adapted and not merge
            stops = _write_configs(
                ckpt / "model", tmp, dtype, _extra_stops(run_dir), as_adapter, changes
            )
            lora = "adapter" if as_adapter else "merged" if merge else None
            write_marker(tmp, run_dir, ckpt, trainer["step"], sharded, lora, dtype, stops)
            checkpoint.fsync_tree(tmp)
            publish(tmp, out, overwrite=overwrite)
            made = []  # --out's, kept
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            remove_made(made)
    seconds = time.perf_counter() - started
    log(f"export: wrote {out} (step {trainer['step']}, {_size(size)}) in {seconds:.1f} s")
    return ExportResult(out, trainer["step"], sharded, parameters, size, stops, seconds)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def find_checkpoint(run_dir: Path, step: int | None, log: Callable[[str], None]) -> Path:
    """The checkpoint of ``step`` in ``run_dir``, or the latest whole one, logging any skipped."""
    root = run_dir / checkpoint.CKPT_DIR
    if not root.is_dir():
        raise ValueError(
            f"{run_dir}: no {checkpoint.CKPT_DIR}/ there; give the directory of a dapo run "
            "(runs/NAME) that saved a checkpoint (train.save_every)"
        )
    if step is None:
        found = checkpoint.find_latest(run_dir)
        if found is None:
            why = checkpoint.unreadable(run_dir) or "none was written"
            raise ValueError(f"{run_dir}: no complete checkpoint in {root}: {why}")
        if skipped := checkpoint.passed_over(run_dir, found):  # an older step, unsaid, misleads
            log(f"dapo: warning: export: {skipped}; exporting {found.name} (or --step N)")
        return found
    ckpt = root / checkpoint.step_dir_name(step)
    if not ckpt.is_dir():
        steps = [int(p.name.split("_")[1]) for p in checkpoint.step_dirs(root)]
        raise ValueError(
            f"{run_dir}: no checkpoint of step {step}; it has {steps or 'none'} "
            f"(train.keep_checkpoints keeps the newest)"
        )
    return ckpt


def _copy_weights(src: Path, tmp: Path, dtype: str | None, log) -> tuple[int, int]:
    """One process's checkpoint: ``save_pretrained``'s weight files, converted when asked;
    their index (when ``src`` has one) rebuilt from their own headers, never read."""
    files = src.is_dir() and sorted(
        f for f in src.iterdir() if f.name.endswith(".safetensors") and f.is_file()
    )
    if not files:
        raise CheckpointError(f"{src} holds no .safetensors weights: the checkpoint is damaged")
    parameters = size = 0
    weight_map: dict[str, str] = {}
    for i, f in enumerate(files, 1):
        if dtype is None:
            shutil.copyfile(f, tmp / f.name)
        else:
            tensors = {k: v.to(DTYPES[dtype]) for k, v in read_tensors(f).items()}
            save_file(tensors, tmp / f.name, metadata={"format": "pt"})
        try:
            with safe_open(tmp / f.name, framework="pt") as written:
                for key in written.keys():  # noqa: SIM118 - safe_open is no mapping
                    parameters += math.prod(written.get_slice(key).get_shape())
                    weight_map[key] = f.name
        except SafetensorError as exc:  # copied as it is: a garbled file is read here first
            raise unreadable_file(f, exc) from None
        size += (tmp / f.name).stat().st_size
        log(f"export: weights {i}/{len(files)} ({_size(size)})")
    if len(files) > 1 or (src / "model.safetensors.index.json").exists():
        _write_index(tmp, weight_map)
    return parameters, size


def _write_gathered(state: Path, tmp: Path, dtype: str | None, log) -> tuple[int, int]:
    """DCP shards: each whole tensor gathered, in files of at most :data:`SHARD_BYTES`."""
    stored = dcp.stored_tensors(state)
    if not stored:
        raise CheckpointError(f"{state}: no model tensors in the checkpoint shards")

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        tensors = dcp.read_tensors(state, {f"model.{n}": stored[f"model.{n}"] for n in names})
        return {n.removeprefix("model."): t for n, t in tensors.items()}

    ours = {n.removeprefix("model."): shape for n, shape in stored.items()}
    return _write_files(ours, read, tmp, dtype, log, "gathered from the shards")


def _write_lora(
    run_dir: Path, ckpt: Path, trainer: dict, tmp: Path, dtype, merge: bool, log, base=None
):
    """A LoRA checkpoint's adapters as a peft adapter directory, or ``merge``d into the base
    (``base``, else the run's ``model.path``): (parameters, bytes, the dtype written, the
    fields of config.json the merge changes). A merge on a bfloat16 or float16 base is
    float32 unless ``dtype`` says otherwise.

    ``base`` replaces the whole reference, ``model.revision`` too: a directory has none, and
    a Hub id is read at its default branch (``--base`` takes no revision; for another one,
    ``hf download ID --revision REV --local-dir DIR`` and ``--base DIR``)."""
    cfg = adapters.run_config(run_dir)
    cfg = adapters.with_trained_settings(cfg, trainer["base_model"], ckpt, log)
    if base is not None:  # the base moved: its digest is checked as the run's would be
        cfg.model.path = os.path.abspath(base) if Path(base).exists() else base
        cfg.model.revision = None  # the run's revision named a commit of its old path
    trained = adapters.trained_tensors(ckpt)
    if not merge:
        return (*_write_adapter(cfg, trained, tmp, dtype, log), dtype, {})
    weights, changes = adapters.merged(cfg, trained, trainer["base_model"], ckpt, log)
    if changes.pop("dtype", None) and dtype is None:  # float32: what was trained, unrounded
        dtype, kind = "float32", cfg.model.param_dtype  # the base as the run loaded it
        log(
            f"export: merged in float32, the trained policy exactly (the base is {kind}, the "
            f"adapters were trained unmerged in float32); --dtype {kind} writes a copy half "
            "the size, rounded"
        )
    return (*_write_merged(weights, tmp, dtype, log), dtype, changes)


def _write_merged(weights: dict[str, torch.Tensor], tmp: Path, dtype: str | None, log):
    """LoRA merged into its base: the weights in memory, in files as :func:`_write_gathered`."""
    shapes = {name: (t.shape, t.dtype) for name, t in weights.items()}
    return _write_files(shapes, lambda names: {n: weights[n] for n in names}, tmp, dtype, log)


def _write_files(
    stored: dict[str, tuple[torch.Size, torch.dtype]],
    read: Callable[[list[str]], dict[str, torch.Tensor]],
    tmp: Path,
    dtype: str | None,
    log: Callable[[str], None],
    how: str = "written",
) -> tuple[int, int]:
    """The tensors ``stored`` names (shape, dtype), ``read`` a file's worth at a time, as
    ``save_pretrained``'s weight files (their index when more than one); in ``dtype``."""
    target = {
        name: (size, DTYPES[dtype] if dtype else kind) for name, (size, kind) in stored.items()
    }
    groups = _groups(target)
    weight_map: dict[str, str] = {}
    parameters = size = 0
    for i, names in enumerate(groups, 1):
        ours = {n: t.to(target[n][1]) for n, t in read(names).items()}
        file = (
            "model.safetensors"
            if len(groups) == 1
            else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        )
        save_file(ours, tmp / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(ours, file)
        parameters += sum(t.numel() for t in ours.values())
        size += (tmp / file).stat().st_size
        log(f"export: weights {i}/{len(groups)} {how} ({_size(size)})")
    if len(groups) > 1:
        _write_index(tmp, weight_map)
    return parameters, size


def _write_adapter(cfg, trained, tmp: Path, dtype: str | None, log) -> tuple[int, int]:
    """A peft adapter directory's weights and ``adapter_config.json``."""
    tensors, config = adapters.adapter_files(cfg, trained)
    tensors = {k: v.to(DTYPES[dtype]) if dtype else v for k, v in tensors.items()}
    save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    size = (tmp / "adapter_model.safetensors").stat().st_size
    log(f"export: the adapters as a peft adapter directory ({_size(size)})")
    return sum(t.numel() for t in tensors.values()), size


def _groups(target: dict[str, tuple[torch.Size, torch.dtype]]) -> list[list[str]]:
    """The tensors' names in order, cut into files of at most :data:`SHARD_BYTES`."""
    groups: list[list[str]] = [[]]
    filled = 0
    for name, (size, kind) in target.items():
        nbytes = size.numel() * kind.itemsize
        if groups[-1] and filled + nbytes > SHARD_BYTES:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += nbytes
    return groups


def _write_index(tmp: Path, weight_map: dict[str, str]) -> None:
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _read_config(src: Path, copied: Path) -> dict:
    """The object of ``config.json`` (``copied`` from ``src``), else a CheckpointError."""
    fix = "the checkpoint is damaged; export another step (--step) or the run's final model/"
    try:
        config = json.loads(copied.read_text())
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise CheckpointError(f"{src} is missing or unreadable ({why}): {fix}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{src} holds a {type(config).__name__}, not a model config: {fix}")
    if "auto_map" in config and not hub.known_model_type(config.get("model_type")):
        raise CheckpointError(
            f"{src} asks for code of its own (auto_map) for a model type transformers does not "
            f"have ({config.get('model_type')!r}); dapo runs no code that comes with a "
            f"checkpoint, and wrote none: {fix}"
        )
    return config


def _extra_stops(run_dir: Path) -> list[int]:
    """``rollout.stop_token_ids`` of the run (its ``config.yaml``)."""
    try:  # aliases refused (a few hundred bytes of them expand to billions of values)
        saved = read_yaml_file(run_dir / "config.yaml") or {}
        extra = (saved.get("rollout") or {}).get("stop_token_ids") or []
    except (OSError, YamlFileError, AttributeError) as exc:
        why = exc.reason if isinstance(exc, YamlFileError) else exc
        raise ValueError(
            f"{run_dir / 'config.yaml'}: unreadable ({why}); the export needs the run's "
            "settings: give the run directory dapo wrote"
        ) from None
    if not isinstance(extra, list) or not all(type(i) is int and i >= 0 for i in extra):
        shown = clipped_repr(extra)  # the file's value, perhaps megabytes of it
        raise ValueError(f"{run_dir / 'config.yaml'}: rollout.stop_token_ids={shown}")
    return extra


def _write_configs(
    src: Path,
    tmp: Path,
    dtype: str | None,
    extra: list[int],
    as_adapter: bool = False,
    changes: dict | None = None,
) -> tuple[int, ...]:
    """``config.json`` (its dtype the weights', and ``changes``: an adapted tied head's
    ``tie_word_embeddings``), the tokenizer's files, and the generation config listing every
    stop token of the run; returns those tokens. A peft adapter directory gets no
    ``config.json`` (transformers would take it for a whole model)."""
    from transformers import AutoConfig, GenerationConfig

    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copyfile(f, tmp / f.name)
    templates = src / TEMPLATES_DIR  # the tokenizer's named chat templates (tool_use, ...)
    if templates.is_dir() and not templates.is_symlink():
        (tmp / TEMPLATES_DIR).mkdir()
        for f in sorted(templates.glob("*.jinja")):
            if f.is_file() and not f.is_symlink():
                shutil.copyfile(f, tmp / TEMPLATES_DIR / f.name)
    config = _read_config(src / "config.json", tmp / "config.json")
    if dtype is not None or changes:
        for key in ("dtype", "torch_dtype"):
            if dtype is not None and (key in config or key == "dtype"):
                config[key] = dtype
        config.update(changes or {})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(src)
    else:
        generation = GenerationConfig.from_model_config(
            AutoConfig.from_pretrained(tmp, trust_remote_code=False)
        )
    tokenizer = tokenizer_from_dir(tmp, setting="the checkpoint's model/")
    stops = generation_stop_ids(generation, tokenizer, extra)
    generation.eos_token_id = list(stops)
    generation.pad_token_id = tokenizer.pad_token_id
    generation.save_pretrained(tmp)
    if as_adapter:
        (tmp / "config.json").unlink()
    return stops
