"""Low-rank adapters (``model.lora``): peft's LoRA layers injected into the policy in place.

The policy stays the transformers model it was (its class, its modules' names, its forward);
each targeted Linear becomes peft's ``lora.Linear``, holding the frozen layer as
``base_layer`` and the adapters ``lora_A`` and ``lora_B``. Only the adapters require a
gradient, so the optimizer holds their state alone, a checkpoint saves them alone (the frozen
weights are the base model's, named by its path and digest), and every copy of the policy
(the generator's, another rank's) needs only them refreshed after an update. The adapters are
float32 whatever the base's dtype: AdamW's small steps would round away in bfloat16.

The starting policy is the base model exactly (``lora_B`` starts at zero). The KL reference
is the same module with its adapters switched off (:func:`adapters_off`), not a second copy.
An engine with weights of its own gets the base once and the adapters after each update
(vLLM, through its LoRA support) or the merged weights ``W + (alpha / r) B A`` computed into
its copy (a tensor-parallel copy, :func:`merged_weights`); an engine that samples the live
policy does so from a merged copy made for each call (:func:`merged_copy`), or through the
adapters. The policy's own weights are never merged in place, so nothing drifts however many
updates there are.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from dapo.extras import pip_install

if TYPE_CHECKING:
    from dapo.config import LoraConfig

ADAPTER = ".lora_"
"""What every adapter parameter's name holds (``...q_proj.lora_A.default.weight``)."""
BASE = ".base_layer."
"""Where a targeted layer's frozen weight moved (``...q_proj.base_layer.weight``)."""
PEFT_PREFIX = "base_model.model."
"""What peft's saved adapter names start with (its wrapper around the model)."""


def enabled(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters."""
    return any(ADAPTER in name for name, _ in model.named_parameters())


def apply(model: torch.nn.Module, lora: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """Inject adapters of ``lora``'s rank into ``model``'s target layers (in place): every
    other weight frozen, the adapters float32 and trainable; ``A`` drawn as peft draws it
    (Kaiming-uniform) from a generator of its own seeded with ``seed``, on the CPU, so a run
    starts from the same adapters whatever ran before it and on whatever device; ``B`` zero.
    Returns ``model``."""
    LoraSettings, inject_adapter_in_model = _peft()
    linear = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name
    }
    missing = [t for t in lora.target_modules if t not in linear]
    if missing:
        raise ValueError(
            f"model.lora.target_modules: {missing} name no Linear layer of this model; it has "
            f"{sorted(linear)} (set model.lora.target_modules to some of those)"
        )
    inject_adapter_in_model(_settings(LoraSettings, lora), model)
    for name, p in model.named_parameters():
        p.requires_grad_(ADAPTER in name)
        if ADAPTER in name and p.is_meta:  # to be sharded first: float32 placeholders
            p.data = torch.empty(p.shape, dtype=torch.float32, device="meta")
    if not any(p.is_meta for p in model.parameters()):
        set_initial(model, seed)
    return model


@torch.no_grad()
def set_initial(model: torch.nn.Module, seed: int) -> None:
    """The adapters' starting values, into each one whole or into its shard (a model loaded
    straight into FSDP shards gets them once its shards exist): ``A`` Kaiming-uniform as
    peft draws it, from a CPU generator seeded with ``seed``; ``B`` zero; float32."""
    from dapo.dist import fsdp

    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if ADAPTER not in name:
            continue
        whole = torch.zeros(p.shape, dtype=torch.float32)
        if ".lora_A." in name:
            torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
        local, index = fsdp.local_part(p)
        if local is p:
            p.data = whole.to(p.device)
        elif local.numel():
            local.copy_(whole[index] if index else whole)


def _peft() -> tuple[Any, Any]:
    try:
        from peft import LoraConfig as LoraSettings
        from peft import inject_adapter_in_model
    except ImportError:
        raise ValueError(
            f"model.lora.rank > 0 needs peft: {pip_install('lora')} (or pip install peft)"
        ) from None
    return LoraSettings, inject_adapter_in_model


def _settings(cls: Any, lora: LoraConfig, **more: Any) -> Any:
    return cls(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        **more,
    )


def moving_names(model: torch.nn.Module) -> set[str] | None:
    """The parameters an update changes, by name, when some never do (the adapters: a copy
    of the policy needs only them refreshed); None when every parameter trains."""
    if not enabled(model):
        return None
    return {name for name, _ in model.named_parameters() if ADAPTER in name}


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """``model`` as its base model (the adapters bypassed) inside the block: the frozen
    reference of a KL term, without a copy."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # also makes the adapters trainable again


def scales(model: torch.nn.Module) -> dict[str, float]:
    """Each adapted layer's scale (``alpha / r``), by the layer's name."""
    from peft.tuners.lora import LoraLayer

    return {
        name: float(module.scaling["default"])
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


def rank(model: torch.nn.Module) -> int:
    """The rank r of ``model``'s adapters."""
    return int(model.peft_config["default"].r)


def adapter_config(model: torch.nn.Module, base: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of a peft adapter directory holding ``model``'s adapters,
    naming ``base`` as their base model (read off the settings peft keeps on ``model``)."""
    config = copy.copy(model.peft_config["default"])
    config.base_model_name_or_path, config.task_type = base, "CAUSAL_LM"
    return json.loads(json.dumps(config.to_dict(), default=list))


def base_names(names: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(name in the adapted model, name in the base model) of each frozen base tensor among
    ``names``: the adapters left out, ``...q_proj.base_layer.weight`` as ``...q_proj.weight``."""
    for name in names:
        if ADAPTER not in name:
            yield name, name.replace(BASE, ".")


def merge_stream(
    weights: Iterable[tuple[str, torch.Tensor]], scale: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, whole tensor) pairs of an adapted model's state dict, as its base model
    names them, each adapted weight merged: ``W + scale B A``, computed in float32. A
    bfloat16 or float16 base comes out in float32, on the CPU (:func:`widen`): the policy
    trained was ``W`` plus the float32 adapters unmerged, and rounding the merged weight
    back to ``W``'s dtype rounds much of the adapters' update away. ``scale``:
    :func:`scales`. A layer's ``W`` is held until its ``B`` passes (the state dict's order:
    base weight, bias, A, B), so a stream gathered one tensor at a time (under FSDP) holds
    one layer's extra tensors at most."""
    held: dict[str, torch.Tensor] = {}  # layer -> W, then W and A
    widened: dict[tuple, torch.Tensor] = {}  # a tied weight stays one tensor
    for name, tensor in weights:
        layer, _, rest = name.rpartition(".base_layer.")
        if layer in scale and rest == "weight":
            held[layer] = tensor
            continue
        for part in ("lora_A", "lora_B"):
            if f".{part}." in name:
                layer = name.split(f".{part}.")[0]
                break
        else:
            yield name.replace(BASE, "."), widen(tensor, widened)
            continue
        if part == "lora_A":
            held[f"{layer}.A"] = tensor
            continue
        w, a = held.pop(layer), held.pop(f"{layer}.A")
        merged = merge(w, a, tensor, scale[layer])
        yield f"{layer}.weight", merged.cpu() if w.dtype in HALF else merged


HALF = (torch.bfloat16, torch.float16)


def widen(tensor: torch.Tensor, done: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """A bfloat16 or float16 ``tensor`` as float32 on the CPU (a whole float32 copy of the
    model may not fit beside it on its GPU); any other as it is. ``done``: the tensors
    widened so far, by storage, so that two names of one tensor (a tied head) stay one."""
    if tensor.dtype not in HALF:
        return tensor
    key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
    if key not in done:
        done[key] = tensor.to(device="cpu", dtype=torch.float32)
    return done[key]


def whole_reader(
    model: torch.nn.Module, gather: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[str], torch.Tensor]:
    """A reader of ``model``'s parameters by the names of its base model (what a plain copy
    of it holds), each made whole with ``gather`` (a DTensor shard's ``full_tensor``), an
    adapted layer's weight merged: ``W + scale B A`` in float32, from its three tensors
    gathered whole one after another. A name the model lacks raises KeyError."""
    params = dict(model.named_parameters())
    scale = scales(model) if enabled(model) else {}

    def read(name: str) -> torch.Tensor:
        layer, _, leaf = name.rpartition(".")
        if layer not in scale:
            if name not in params:
                raise KeyError(f"the source has no parameter {name!r}")
            return gather(params[name])
        base = gather(params[f"{layer}{BASE}{leaf}"])
        if leaf != "weight":
            return base
        a = gather(params[f"{layer}.lora_A.default.weight"])
        return merge(base, a, gather(params[f"{layer}.lora_B.default.weight"]), scale[layer])

    return read


def merger(model: torch.nn.Module) -> Callable[[dict], dict] | None:
    """A function from ``model``'s whole state dict (gathered from shards) to the merged
    one; None without adapters."""
    if not enabled(model):
        return None
    scale = scales(model)
    return lambda weights: dict(merge_stream(weights.items(), scale))


def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale B A`` in float32 on ``W``'s device, in one pass over ``W`` (``B A`` is
    never made apart): an adapted Linear's weight as one matrix."""
    device = w.device
    return torch.addmm(w.float(), b.float().to(device), a.float().to(device), alpha=scale)


def merged_weight(module: torch.nn.Module) -> torch.Tensor:
    """A LoRA Linear's weight as one matrix: its base weight plus its active adapter's
    ``scaling x B A``, a new float32 tensor (the module is left as it is)."""
    name, base = module.active_adapters[0], module.base_layer
    if module.fan_in_fan_out:  # the weight is stored transposed: peft's general path
        return base.weight.detach().float() + module.get_delta_weight(name).detach().float()
    a, b = module.lora_A[name].weight.detach(), module.lora_B[name].weight.detach()
    return merge(base.weight.detach(), a, b, module.scaling[name])


def can_merge(model: torch.nn.Module) -> bool:
    """Whether a merged copy (:func:`merged_copy`) of ``model`` computes what it computes:
    adapters on, one active adapter per layer, none merged, none with a bias of its own or a
    variant (DoRA and the like), and float32 base weights (in bfloat16 or float16 the merge
    would round the adapters' small updates away)."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    return bool(layers) and all(
        len(m.active_adapters) == 1
        and not m.disable_adapters
        and not m.merged
        and not m.use_dora.get(m.active_adapters[0], False)
        # A bias on B, or a variant that changes the forward (DoRA, aLoRA): not W + s B A.
        and not getattr(m, "lora_bias", {}).get(m.active_adapters[0], False)
        and m.active_adapters[0] not in getattr(m, "lora_variant", {})
        and m.base_layer.weight.dtype == torch.float32
        and type(m.base_layer) is torch.nn.Linear
        for m in layers
    )


@torch.no_grad()
def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in which each LoRA Linear is a plain Linear holding its merged
    weight (:func:`merged_weight`): what a sampler reads faster than the adapters (no second
    pair of products per layer). Every other tensor is ``model``'s own, shared, not copied;
    the policy itself is never merged, so nothing drifts however many updates there are.
    Made fresh after each update (:func:`can_merge` first)."""
    from peft.tuners.lora import LoraLayer

    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    merged: list[torch.nn.Linear] = []
    for module in model.modules():  # tensors held as plain attributes (rotary tables): shared
        memo.update({id(v): v for v in vars(module).values() if isinstance(v, torch.Tensor)})
    for module in model.modules():
        if isinstance(module, LoraLayer):
            base = module.base_layer
            plain = torch.nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
            plain.weight = torch.nn.Parameter(merged_weight(module), requires_grad=False)
            plain.bias = base.bias
            memo[id(module)] = plain  # the deep copy takes it in the adapted layer's place
            merged.append(plain)
    out = copy.deepcopy(model, memo).eval()
    out.__dict__[MERGED_LINEARS] = merged
    return out


MERGED_LINEARS = "_dapo_merged_linears"
"""Where a merged copy lists the Linears that hold its own weights (:func:`release`)."""


def release(merged: torch.nn.Module) -> None:
    """Frees a merged copy's own weights now. Dropping the copy may not: layers wrapped for
    activation checkpointing or compiling hold a reference to themselves (their forward is a
    partial of the layer), the deep copy keeps that cycle, and a cycle waits for Python's
    occasional full collection, so copies made per call would pile up."""
    for plain in merged.__dict__.pop(MERGED_LINEARS, ()):
        plain.weight = None


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as the base model names it, each adapted weight merged
    (:func:`merge_stream`, float32 for a bfloat16 or float16 base): what a model without
    adapters loads to compute what ``model`` computes. The policy itself is left as it is."""
    return dict(merge_stream(model.state_dict().items(), scales(model)))


def describe(model: torch.nn.Module) -> str:
    """One line for the log: trained and frozen parameter counts."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (
        f"LoRA: {trained / 1e6:.2f}M trained parameters of {total / 1e6:.1f}M "
        f"({100 * trained / max(total, 1):.2f}%); the rest frozen"
    )


def peft_name(name: str) -> str:
    """A parameter's name in the model (``...q_proj.lora_A.default.weight``) as peft saves it
    in an adapter directory (``base_model.model....q_proj.lora_A.weight``)."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.default.", f".{part}.")
    return PEFT_PREFIX + name


def peft_config(lora: LoraConfig, base: str, revision: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of a peft adapter directory for these adapters, on the base
    model ``base`` at ``revision`` (``model.revision``; None: the Hub's ``main``), which peft
    loads the base from."""
    LoraSettings, _ = _peft()
    more = dict(base_model_name_or_path=base, revision=revision, task_type="CAUSAL_LM")
    config = _settings(LoraSettings, lora, **more)
    return json.loads(json.dumps(config.to_dict(), default=list))


TRAINED_SETTINGS = ("rank", "alpha", "dropout", "target_modules")
"""The fields of ``model.lora`` that shape and scale the adapters a checkpoint holds."""


def trained_settings(lora: LoraConfig) -> dict[str, Any]:
    """``lora``'s :data:`TRAINED_SETTINGS`, as a checkpoint records them (JSON)."""
    return {name: copy.deepcopy(getattr(lora, name)) for name in TRAINED_SETTINGS}
