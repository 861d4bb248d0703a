"""Loading a pretrained policy straight into FSDP2 shards, so that no rank ever holds the whole
model in ``model.param_dtype``.

Under ``torchrun`` every rank used to load the whole model (28 GiB of float32 for 7B) before
sharding it, and then deep-copied it once more for the generation copy. Here the model is
built with its weights on the meta device (its buffers, such as the rotary ``inv_freq``, are
computed for real by the model's own constructor, exactly as in a normal load), sharded with
:func:`dapo.dist.fsdp.shard`, given empty local shards, and each rank reads from the
safetensors files only the rows its shards hold (``safe_open(...).get_slice(name)[rows]``).
A rank's peak is then its shard plus one slice being read. The whole generation copy and the
sharded KL reference are built the same way, empty, and filled from the policy's shards.

Only safetensors files are read (nothing is unpickled); a directory with other weights, a
quantized model, or one whose tensors transformers renames as it loads them, keeps the whole
load (:func:`load` returns None and says why).

Why not ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``: it reads the same
slices with the same ``get_slice`` call, but ``dcp.load`` plans its reads with collectives
(and under ``torchrun`` rank 0 loads the policy while the other ranks wait in a barrier), and
it neither follows a tied weight to the one name the file has nor names the fix when a tensor
is missing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dapo.config import Config
from dapo.dist import fsdp
from dapo.models import compiled_layers, lora, tied_files
from dapo.models.casting import cast_weights

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
"""The file names ``save_pretrained(safe_serialization=True)`` writes: one file, or an index
naming the file of each tensor; ``from_pretrained`` prefers them to ``.bin`` files too."""


def shard_options(cfg: Config) -> dict[str, Any]:
    """The options :func:`fsdp.shard` is given for the policy (the frozen reference drops
    activation checkpointing); refuses float16 compute, which FSDP here does not scale."""
    compute = getattr(torch, cfg.model.compute_dtype)
    if compute == torch.float16:
        raise ValueError(
            "model.compute_dtype=float16 is not supported under torchrun (FSDP); use "
            "bfloat16, which needs no loss scaling"
        )
    return dict(
        compute_dtype=compute,
        activation_checkpointing=cfg.dist.activation_checkpointing,
        cpu_offload=cfg.dist.cpu_offload,
        reshard_after_forward=cfg.dist.reshard_after_forward,
    )


def weight_files(path: Path) -> dict[str, Path] | None:
    """Each stored tensor's name and the safetensors file that holds it, from the index or
    the single file; None when ``path`` has neither (``.bin``/``.pt`` weights, say). An
    index or a file that cannot be read is a ValueError naming it and the fix."""
    if (path / SAFE_INDEX).is_file():
        try:
            entries = json.loads((path / SAFE_INDEX).read_text())["weight_map"]
            return {name: path / file for name, file in entries.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise damaged_weights(path / SAFE_INDEX, path, exc) from None
    if (path / SAFE_WEIGHTS).is_file():
        with open_weights(path / SAFE_WEIGHTS, path) as f:
            return dict.fromkeys(f.keys(), path / SAFE_WEIGHTS)
    return None


@contextlib.contextmanager
def open_weights(file: Path, path: Path) -> Iterator[Any]:
    """``safe_open(file)`` of the model directory ``path``: one that is missing, truncated or
    garbled (its header is checked against its size here) is a ValueError naming it."""
    try:
        opened = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:  # SafetensorError is no OSError
        raise damaged_weights(file, path, exc) from None
    with opened as f:
        yield f


def check_weight_files(path: Path) -> None:
    """Open every safetensors file of the model directory ``path`` (their headers: no
    tensor is read), to name the one a load could not read: a ValueError for it."""
    for file in sorted(set((weight_files(path) or {}).values())):
        with open_weights(file, path):
            pass


def damaged_weights(file: Path | None, path: Path, exc: Exception) -> ValueError:
    """The error for a weights file (or index) of ``path`` that cannot be read: which one
    (None: not known), what the library said, and how to get whole files."""
    if file is not None and file.is_file() and not os.access(file, os.R_OK):
        # safetensors reports a file it may not open as "No such file or directory".
        mode, owner = file.stat().st_mode & 0o777, file.stat().st_uid
        return ValueError(
            f"model.path={path}: {file.name} cannot be read: permission denied (mode "
            f"{mode:04o}, owner uid {owner}); have its owner make it readable "
            f"(chmod a+r {file}), or load the model as that user"
        )
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    what = f"{file.name} cannot be read" if file is not None else "its weights cannot be read"
    return ValueError(
        f"model.path={path}: {what} ({reason}); a file is missing, truncated or damaged, "
        "as an interrupted download or copy leaves it: download the model again "
        "(a Hub model: delete its snapshot from the Hugging Face cache) or re-save it with "
        "model.save_pretrained(DIR, safe_serialization=True)"
    )


def load(
    cfg: Config, path: Path, device: torch.device, log: Callable[[str], None] = print
) -> torch.nn.Module | None:
    """The pretrained policy in the directory ``path`` (``model.path``, checked) as FSDP2
    shards on ``device``, in ``model.param_dtype``, each rank having read only its own rows;
    None (and a note) when only a whole load can do it.

    Needs an active process group; makes no collective call, so the ranks may load one
    after another."""
    from transformers import AutoConfig

    files = weight_files(path)
    note = "each rank loads the whole model, then shards it"
    if files is None:
        log(
            f"note: model.path={path} has no {SAFE_WEIGHTS} (or {SAFE_INDEX}): {note}; "
            "save it with save_pretrained(DIR, safe_serialization=True) to load shards only"
        )
        return None
    options = shard_options(cfg)
    if options["cpu_offload"] and device.type == "cpu":
        raise ValueError(
            "dist.cpu_offload=true keeps a GPU run's shards in host memory; this model "
            "trains on the CPU already: drop dist.cpu_offload"
        )
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        if getattr(config, "quantization_config", None) is not None:
            log(f"note: model.path={path} is quantized: {note} (transformers dequantizes it)")
            return None
        model = empty_model(config, getattr(torch, cfg.model.param_dtype))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"model.path={path}: not a causal language model transformers can load "
            f"({str(exc).splitlines()[0]})"
        ) from None
    if _renames_weights(model):
        log(f"note: transformers renames the tensors of model.path={path} as it loads: {note}")
        return None
    _load_generation_config(model, path)
    if cfg.model.lora.rank:  # adapters before the shards are cut, filled once they exist
        lora.apply(model, cfg.model.lora)
    if cfg.train.compile:  # before the shards' checkpointing, which recomputes it
        compiled_layers.compile_layers(model)
    fsdp.shard(model, **options)
    offload = options["cpu_offload"]
    materialise(model, params_on=torch.device("cpu") if offload else device, buffers_on=device)
    fill_from_files(model, files, path)
    if cfg.model.lora.rank:
        lora.set_initial(model, cfg.train.seed)
        log(lora.describe(model))
    return model


def copies(
    policy: torch.nn.Module,
    cfg: Config,
    held: torch.dtype,
    device: torch.device,
    *,
    whole_copy: bool = True,
) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The frozen KL reference (``algo.kl_coef > 0``, sharded like the policy) and the whole
    generation copy (None without ``whole_copy``: a tensor-parallel one is made apart), both
    in ``held``, made from a sharded ``policy`` with the values a deep copy of the whole
    policy would have, without one ever existing."""
    ref = None
    adapted = lora.enabled(policy)  # its reference is itself with the adapters off
    if cfg.algo.kl_coef > 0 and not adapted:
        options = {**shard_options(cfg), "activation_checkpointing": False}
        options["reshard_after_forward"] = True  # forward only: nothing to keep for a backward
        ref = _empty_copy(policy, held)
        fsdp.shard(ref, **options)
        offload = options["cpu_offload"]
        materialise(ref, params_on=torch.device("cpu") if offload else device, buffers_on=device)
        policy_params = dict(policy.named_parameters())
        with torch.no_grad():
            for name, p in ref.named_parameters():
                fsdp.local_part(p)[0].copy_(fsdp.local_part(policy_params[name])[0])
    if not whole_copy:
        return ref, None
    gen = _empty_copy(policy, held)
    if adapted:  # the same adapters, so that every parameter has its twin by name
        lora.apply(gen, cfg.model.lora).requires_grad_(False)
    materialise(gen, params_on=device, buffers_on=device)
    fsdp.gather_into(policy, gen)  # one whole parameter at a time
    return ref, gen


def empty_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of ``config`` in evaluation mode (as ``from_pretrained`` returns it),
    its parameters on the meta device in ``dtype``, its buffers computed on the CPU by the
    model's own code, kept in their dtype as :func:`dapo.models.casting.cast_weights` keeps a
    loaded model's)."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.dtype = dtype  # the loaded weights' dtype, as from_pretrained records it
    return cast_weights(model, dtype).eval()


def materialise(
    model: torch.nn.Module, *, params_on: torch.device, buffers_on: torch.device
) -> None:
    """Give ``model``'s meta parameters (its local shards, if sharded) uninitialised memory on
    ``params_on`` (the CPU when FSDP offloads them), keeping tied parameters one object, and
    move its buffers, with their values, to ``buffers_on`` (the compute device)."""
    kept = [
        (module, name, buffer)
        for module in model.modules()
        for name, buffer in module.named_buffers(recurse=False)
    ]
    swap = torch.__future__.get_swap_module_params_on_conversion()
    # Swapping keeps each parameter object: to_empty would otherwise give the two modules
    # of a tied weight (lm_head, embed_tokens) two separate parameters.
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=params_on)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for module, name, buffer in kept:
        setattr(module, name, buffer.to(buffers_on))


@torch.no_grad()
def fill_from_files(model: torch.nn.Module, files: dict[str, Path], path: Path) -> None:
    """Copy into every parameter (and persistent buffer) of ``model`` its part from the
    safetensors ``files``, reading only that part; a weight the files lack is a ValueError
    that names it, the file and the fix."""
    plan: list[tuple[Path, str, torch.Tensor]] = []
    prefix = getattr(model, "base_model_prefix", "")
    for names, tensor, required in _targets(model):
        if len(names) > 1 and (apart := tied_files.stored_apart(names, files, prefix)):
            raise tied_files.refusal(path, apart, files)  # not the first of them, silently
        stored = _stored_name(names, files, prefix)
        if stored is None:
            if required:
                single = None if (path / SAFE_INDEX).is_file() else path / SAFE_WEIGHTS
                raise missing_weight(names[0], path, single)
            continue  # a persistent buffer the files lack keeps its constructed value
        plan.append((files[stored], stored, tensor))
    for file, stored, tensor in plan:
        # One tensor per opening: safe_open maps the whole file, and the pages a read
        # touches stay resident (and count in the rank's memory) until it is closed.
        with open_weights(file, path) as f:
            if stored not in f.keys():
                raise missing_weight(stored, path, file)
            _read_into(f, stored, tensor, file)


def _read_into(f: Any, stored: str, tensor: torch.Tensor, file: Path) -> None:
    """Read the part of tensor ``stored`` of the open file ``f`` that ``tensor`` (a whole
    tensor or a shard) holds, and copy it in (casting to its dtype)."""
    local, index = fsdp.local_part(tensor)
    part = f.get_slice(stored)
    shape = tuple(part.get_shape())
    if shape != tuple(tensor.shape):
        raise ValueError(
            f"{file.name}: tensor {stored} has shape {list(shape)}, the model built from "
            f"config.json in {file.parent} expects {list(tensor.shape)}; the config and the "
            "weights do not match (re-save both with save_pretrained)"
        )
    if local.numel() == 0:
        return  # a rank past the end of an unevenly sharded dimension holds nothing
    local.copy_(part[index] if index else f.get_tensor(stored))


def _targets(model: torch.nn.Module) -> Iterator[tuple[list[str], torch.Tensor, bool]]:
    """(every name of a parameter, the parameter, True) once per parameter object (a tied
    weight has two names, and a file stores it under one), then (name, buffer, False) for
    each persistent buffer."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if lora.ADAPTER in name:
            continue  # LoRA's adapters: not the base model's, set apart
        names.setdefault(id(p), []).append(name.replace(lora.BASE, "."))
        tensors[id(p)] = p
    for key, tensor in tensors.items():
        yield names[key], tensor, True
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield [f"{module_name}.{name}" if module_name else name], buffer, False


def _stored_name(names: list[str], files: dict[str, Path], prefix: str) -> str | None:
    """The name under which the files store a tensor known by ``names``: one of them, or
    one without the base model's prefix (a checkpoint saved from the bare base model)."""
    for name in names:
        if name in files:
            return name
    for name in names:
        if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in files:
            return name[len(prefix) + 1 :]
    return None


def missing_weight(name: str, path: Path, file: Path | None) -> ValueError:
    """The error for a weight of the model that the files of ``path`` lack: where it was
    looked for (``file``; None: the index names none, or there are only ``.bin`` weights),
    and how to get files that hold it."""
    if file is not None:
        where = f"{file.name} does not hold it"
        if (path / SAFE_INDEX).is_file():
            where += f" (the file {SAFE_INDEX} names for it)"
    elif (path / SAFE_INDEX).is_file():
        where = f"{SAFE_INDEX} names no file for it"
    else:
        where = "its weights files do not hold it"
    return ValueError(
        f"model.path={path}: the model built from its config.json has the weight {name}, "
        f"but {where}; re-save the model with model.save_pretrained(DIR, "
        "safe_serialization=True) so that its files hold every weight, or check that "
        "config.json belongs to these weights"
    )


def _empty_copy(policy: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen model like ``policy`` (same config, generation config, buffers), its
    parameters on the meta device in ``dtype``: what ``copy.deepcopy(policy).to(dtype)``
    would be, before any weight is in it."""
    weights = next(policy.parameters()).dtype
    model = cast_weights(empty_model(copy.deepcopy(policy.config), weights), dtype)
    model.generation_config = copy.deepcopy(policy.generation_config)
    return model.requires_grad_(False)


def _load_generation_config(model: torch.nn.Module, path: Path) -> None:
    """``generation_config.json`` as ``from_pretrained`` reads it (its EOS ids are stop
    tokens, :func:`dapo.models.policy.stop_token_ids`); the config's defaults without it."""
    from transformers import GenerationConfig

    if model.can_generate() and (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)


def _renames_weights(model: torch.nn.Module) -> bool:
    """Whether transformers maps this model's stored tensor names (or shapes) to others as
    it loads them (a conversion mapping), which reading tensors by name would miss."""
    if getattr(model, "_checkpoint_conversion_mapping", None):  # transformers 4
        return True
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
    except ImportError:  # transformers 4: no other mapping
        return False
    return bool(extract_weight_conversions_for_model(model))


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device, and every buffer stays
    real (accelerate's ``init_empty_weights(include_buffers=False)``): the weights take no
    memory and no time to initialise (an initialiser runs on meta tensors), while
    non-persistent buffers (rotary ``inv_freq``, masks) are the constructor's own values,
    which a model on the meta device alone would lose."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            moved = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            module._parameters[name] = moved

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
