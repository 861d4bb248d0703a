"""The memory plan shown: the dry run's text table, JSON rows, and docs/scale-out.md's table.

The plan itself (what each part counts) is :mod:`dapo.training.gpu_memory`; this module only
lays it out, every part on its own line, row key or column.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dapo.training.fixed_memory import communicators, usable_gib
from dapo.training.gpu_memory import (
    GIB,
    MemoryPlan,
    PlanSettings,
    copies_gqa,
    generator_bytes,
    model_shape,
    plan_memory,
    round_prompts,
    rows_per_rank,
    settings_from_config,
)
from dapo.training.model_shape import KNOWN_SHAPES, ModelShape

if TYPE_CHECKING:
    from dapo.config import Config

SPARE_GIB = 4.0
"""What a plan must leave free on its card, for what it cannot see: the CUDA runtime, NCCL's
buffers and the allocator's reserve are in the plan (:mod:`dapo.training.fixed_memory`), but
as estimates."""

COMPONENTS = (
    "weights",
    "gradients",
    "accumulated_gradients",
    "optimizer",
    "generation_copy",
    "gathered_layers",
    "activations",
    "output_head",
    "kv_cache",
    "decode_workspace",
    "reference",
    "ahead",
    "runtime",
    "allocator_slack",
    "vllm_generating",
    "vllm_training",
)
"""The parts of a plan on the GPU, each a ``<part>_gib`` key of a JSON row."""


def _in(unit: int) -> Callable[[int], str]:
    return lambda n: f"{n / unit:.2f}"


def _size(n: int) -> str:
    """``n`` bytes in GiB, or MiB under 1 GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def describe_settings(s: PlanSettings) -> str:
    """The settings a plan depends on besides the model, in one line."""
    ckpt = "on" if s.activation_checkpointing else "off"
    if not s.sharded:
        dist = "one process (no FSDP: dist.grad_sync and rollout.tp_size > 1 need torchrun)"
    else:
        dist = f"rollout.tp_size {s.tp_size}, dist.grad_sync {s.grad_sync}"
    return (
        f"settings: {dist}, activation checkpointing {ckpt}, micro-batches of up to "
        f"{s.microbatch_tokens} tokens, {s.rows} rows per engine call"
    )


def copy_dtype(s: PlanSettings) -> str:
    """The dtype of frozen copies: bfloat16 when it computes, else the weights'."""
    return "bfloat16" if s.compute_dtype == "bfloat16" else s.param_dtype


def _workspace(plan: MemoryPlan) -> str:
    # The forward's part is a layer's keys and values either way: copied per query head
    # (transformers before 5.23), else the old buffer of a layer whose cache grows.
    copied = copies_gqa(plan.shape, plan.settings) and plan.shape.heads > plan.shape.kv_heads
    per_head = " per query head" if copied else ""
    return f"decoding workspace (logits and sampling, or one layer's keys and values{per_head})"


def _part_rows(plan: MemoryPlan) -> list[tuple[str, int, str]]:
    s = plan.settings
    master, compute, k = s.param_dtype, s.compute_dtype, s.tp_size
    share = f"1/{s.world_size} shard" if s.sharded else "whole"
    where = "host" if plan.offloaded else "GPU"
    ckpt = ", checkpointed" if s.activation_checkpointing else ""
    ckpt += ", compiled: counted as eager, an upper bound" if s.compiled else ""
    if not s.sharded:
        copy = f"autocast's {compute} weight copy"
    else:
        copy = "generation copy (whole)" if k == 1 else f"generation copy (tp {k}: 1/{k} split)"
    kv = f"KV cache ({s.rows} rows x {s.prompt_tokens + s.max_new_tokens} tokens"
    kv += f", 1/{k} of the KV heads" if k > 1 else ""
    kv += ", twice: parked episodes)" if s.episodes and s.engine != "vllm" else ")"
    head = "the weight's" if s.sharded else f"the {compute} weight, its"
    frozen = "a logit chunk" + ("" if s.sharded else f", the {compute} weight") + "; frozen"
    head = frozen if s.lora_rank else f"a logit chunk, {head} float32 gradient"
    return [
        (f"weights ({master}, {share})", plan.weights, where + ", always"),
        (f"gradients ({master}, {share})", plan.gradients, where + ", training"),
        ("unsharded float32 gradients (grad_sync minibatch)", plan.accumulated_gradients,
         "GPU, training"),
        (f"AdamW state (2 x {master}, {share})", plan.optimizer, where + ", always"),
        (copy, plan.generation_copy, "GPU, always"),
        (f"FSDP gathered layers ({compute})", plan.gathered_layers, "GPU, training"),
        (f"activations ({s.microbatch_tokens} tokens{ckpt})", plan.activations, "GPU, training"),
        (f"output head ({head})", plan.output_head,
         "GPU, training"),
        (kv, plan.kv_cache, "GPU, generation"),
        (_workspace(plan), plan.decode_workspace, "GPU, generation"),
        (f"GRPO reference ({share})", plan.reference, where + ", always"),
        (_ahead(s), plan.ahead, "GPU, always"),
        (f"CUDA runtime and NCCL buffers ({communicators(s)} communicators)", plan.runtime,
         "GPU, always"),
        ("caching allocator's reserve (20% of the transient)", plan.allocator_slack,
         "GPU, training"),
        (f"vllm engine ({s.vllm_fraction:g} of the card)", plan.vllm_generating,
         "GPU, generation"),
        ("vllm engine asleep" if s.vllm_sleep else "vllm engine (no sleep)", plan.vllm_training,
         "GPU, training"),
    ]  # fmt: skip


def _ahead(s: PlanSettings) -> str:
    if s.generators:  # trainer rank 0 keeps what it sends until the generators take it
        n = max(1, s.staleness)
        return f"weights sent to the generator ranks, not yet taken: up to {n} ({copy_dtype(s)})"
    return f"generating ahead: its copy and up to {s.staleness} clones ({copy_dtype(s)})"


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a small text table, in GiB (MiB for a plan under 1 GiB)."""
    s, count = plan.settings, plan.shape.num_parameters
    big = max(plan.total, plan.host, plan.load_host) >= GIB
    unit, size = ("GiB", _in(GIB)) if big else ("MiB", _in(2**20))
    rows = _part_rows(plan) + [
        ("peak in generation", plan.generation_peak, ""),
        ("peak in training", plan.training_peak, ""),
        ("peak per GPU", plan.total, ""),
    ]
    if plan.offloaded:
        rows.append(("host memory per rank", plan.host, ""))
    rows.append(("host memory per rank while loading", plan.load_host, ""))
    rows = [row for row in rows if row[1] or not row[2]]  # parts this run does not have: out
    width = max(len(name) for name, _, _ in rows) + 2
    count_text = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
    head = f"memory per GPU on paper, world size {s.world_size}: {count_text} parameters, "
    head += f"{s.compute_dtype} compute, {s.param_dtype} weights ({unit}; the model: "
    head += "dapo/training/gpu_memory.py)"
    lines = (f"  {name:<{width}}{size(n):>9}  {when}".rstrip() for name, n, when in rows)
    return "\n".join([head, "  " + describe_settings(s), *lines])


def the_card(cfg: Config) -> tuple[str, int]:
    """(device type, bytes of its memory) a dry run plans for: where the run would compute
    (``model.device``; ``auto`` on a machine without CUDA is the CPU), with the GPU's memory
    when this machine has the GPU (else 0: not known)."""
    if cfg.model.device == "cpu":
        return "cpu", 0
    import torch

    if not torch.cuda.is_available():
        return ("cpu" if cfg.model.device == "auto" else "cuda"), 0
    index = torch.device(cfg.model.device if cfg.model.device != "auto" else "cuda").index
    return "cuda", torch.cuda.get_device_properties(index or 0).total_memory


def print_plan(cfg: Config, *, world_size: int, prompt_tokens: int) -> None:
    """The dry run's memory table (or why there is none)."""
    device, card = the_card(cfg)
    settings = settings_from_config(
        cfg, world_size=world_size, prompt_tokens=prompt_tokens, device=device, gpu_bytes=card
    )
    try:
        plan = plan_memory(model_shape(cfg), settings)
    except (OSError, ValueError, KeyError) as exc:
        print(f"memory plan: not available ({exc})")
        return
    print(format_plan(plan))
    if card:
        spare = (card - plan.total) / GIB
        verdict = "fits" if spare >= SPARE_GIB else f"leaves less than the {SPARE_GIB:g} GiB asked"
        print(f"  this machine's GPU: {card / GIB:.2f} GiB, {spare:.2f} GiB spare: {verdict}")
    elif device == "cuda":
        print("  no GPU here: python -m dapo.memory_plan --config RECIPE plans a recipe's card")
    elif cfg.model.device == "auto" and cfg.model.path != "embedded":
        print(
            "  note: planned for this machine's CPU, which has no CUDA; on GPUs a plan adds "
            "the CUDA runtime, NCCL's buffers and the allocator's reserve: python -m "
            "dapo.memory_plan --config RECIPE plans a recipe on the GPUs it states"
        )
    packed = plan_memory(plan.shape, replace(settings, gqa_copy=False))
    if (saved := plan.decode_workspace - packed.decode_workspace) > 0:
        print(
            f"  note: this transformers copies each layer's keys and values to every query head "
            f"while decoding; 5.23 or later does not, which would save {_size(saved)} here"
        )
    if settings.engine == "vllm" and device == "cuda" and not card:
        print(
            f"  note: the vllm engine reserves {settings.vllm_fraction:g} of the card "
            "(vllm.gpu_memory_utilization) on top of this; no GPU here to size it"
        )
    if settings.generators:
        print(generator_line(cfg, plan, settings))
    if not settings.sharded and cfg.dist.cpu_offload:
        print("  note: dist.cpu_offload applies from 2 ranks")
    if cfg.rollout.rows_per_generate == 0:
        groups = settings.generators or world_size // settings.tp_size
        print(
            f"  note: KV cache of a whole round per generating group (up to {round_prompts(cfg)}"
            f" prompts x {cfg.rollout.group_size} / {groups}), every row at the longest prompt "
            "+ L_max: an upper bound; rollout.rows_per_generate bounds it"
        )


def generator_line(cfg: Config, plan: MemoryPlan, trainer: PlanSettings) -> str:
    """The dry run's line for a generator rank (``dist.rollout_ranks``); the table above is a
    trainer rank's."""
    r = trainer.generators
    gen = replace(trainer, world_size=1, rows=rows_per_rank(cfg, r), tp_size=1, generators=0)
    parts = generator_bytes(plan.shape, gen)
    names = {"policy": "the policy, whole", "kv_cache": f"KV cache ({gen.rows} rows)"}
    names |= {"decode_workspace": "decoding workspace", "vllm": "the vllm engine"}
    names |= {"runtime": "CUDA runtime"}
    text = " + ".join(f"{names[k]} {_size(v).strip()}" for k, v in parts.items() if v)
    return (
        f"  a generator rank (dist.rollout_ranks={r}; the table is a trainer rank's): {text} "
        f"= {_size(sum(parts.values())).strip()} (the next weights arrive in host memory)"
    )


def plan_row(plan: MemoryPlan, *, gpu_gib: float) -> dict[str, Any]:
    """The plan as one JSON row: its settings, every part and the peaks in GiB, and whether
    it leaves ``SPARE_GIB`` of a ``gpu_gib`` card free."""
    s = plan.settings
    gib = lambda n: round(n / GIB, 2)  # noqa: E731
    row: dict[str, Any] = {
        "params": plan.shape.num_parameters,
        "tp_size": s.tp_size,
        "grad_sync": s.grad_sync,
        "activation_checkpointing": s.activation_checkpointing,
        "cpu_offload": s.cpu_offload,
        "microbatch_tokens": s.microbatch_tokens,
        "rows_per_generate": s.rows,
        "prompt_tokens": s.prompt_tokens,
        "max_new_tokens": s.max_new_tokens,
    }
    row |= {f"{part}_gib": gib(getattr(plan, part)) for part in COMPONENTS}
    row |= {"offloaded_host_gib": gib(plan.host), "load_host_gib": gib(plan.load_host)}
    row |= {
        "peak_train_gib": gib(plan.training_peak),
        "peak_generate_gib": gib(plan.generation_peak),
        "spare_gib": round(gpu_gib - plan.total / GIB, 2),
        "fits": gpu_gib - plan.total / GIB >= SPARE_GIB,
    }
    return row


def table_settings(
    world_size: int, recipe: Config | None, prompt_tokens: int = 512
) -> PlanSettings:
    """A row's settings: the defaults of ``PlanSettings`` (the paper's lengths, 16 rows, no
    checkpointing), or a recipe's at ``world_size`` (one process: ``tp_size`` 1). Every row
    counts the keys and values transformers before 5.23 copies per query head while decoding:
    the table is the same whichever transformers prints it, and holds for all of them."""
    if recipe is None:
        return replace(PlanSettings(), world_size=world_size, device="cuda")
    tp = min(recipe.rollout.tp_size, world_size) if world_size > 1 else 1
    settings = settings_from_config(
        recipe, world_size=world_size, prompt_tokens=prompt_tokens, tp_size=tp
    )
    return replace(settings, gqa_copy=True, device="cuda")


def table_rows(
    recipes: Mapping[str, Config],
    names: Sequence[str] = tuple(KNOWN_SHAPES),
    world_sizes: Sequence[int] = (1, 8, 64),
    gpu_gib: float = 80.0,
) -> list[dict[str, Any]]:
    """A row per model of ``KNOWN_SHAPES`` and world size, with the settings of the model's
    recipe in ``recipes`` (by name), else the defaults; ``gpu_gib``: cards sold as that many
    GB (an "80 GB" card offers 79.19 GiB to CUDA)."""
    usable = usable_gib(gpu_gib)
    rows = []
    for name in names:
        shape = ModelShape.from_hf_config(KNOWN_SHAPES[name])
        for w in world_sizes:
            settings = replace(table_settings(w, recipes.get(name)), gpu_bytes=int(usable * GIB))
            plan = plan_memory(shape, settings)
            row = {"model": name, "gpus": w, "gpu_gib": gpu_gib, "usable_gib": usable}
            rows.append(row | plan_row(plan, gpu_gib=usable))
    return rows


_COLUMNS = (
    ("model", "model"),
    ("params", "params"),
    ("GPUs", "gpus"),
    ("settings", ""),
    ("weights + grads + AdamW", ""),
    ("unsharded grads", "accumulated_gradients_gib"),
    ("generation copy", "generation_copy_gib"),
    ("gathered layers", "gathered_layers_gib"),
    ("activations", "activations_gib"),
    ("output head", "output_head_gib"),
    ("KV cache", "kv_cache_gib"),
    ("decoding workspace", "decode_workspace_gib"),
    ("CUDA runtime, NCCL", "runtime_gib"),
    ("allocator's reserve", "allocator_slack_gib"),
    ("peak in training", "peak_train_gib"),
    ("peak in generation", "peak_generate_gib"),
    ("fits 80 GB (79.19 GiB)", ""),
    ("host while loading", "load_host_gib"),
)


def _settings_cell(row: Mapping[str, Any]) -> str:
    parts = [] if row["gpus"] == 1 else [f"tp {row['tp_size']}", f"sync per {row['grad_sync']}"]
    parts += ["ckpt"] if row["activation_checkpointing"] else []
    return ", ".join([*parts, f"{row['rows_per_generate']} rows"])


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """GiB per GPU of ``table_rows`` (docs/scale-out.md's table)."""
    lines = ["| " + " | ".join(title for title, _ in _COLUMNS) + " |"]
    left = ("model", "settings", "fits 80 GB (79.19 GiB)")
    lines.append("|" + "".join("---|" if t in left else "---:|" for t, _ in _COLUMNS))
    for row in rows:
        states = row["weights_gib"] + row["gradients_gib"] + row["optimizer_gib"]
        computed = {
            "params": f"{row['params'] / 1e9:.2f}B",
            "settings": _settings_cell(row),
            "weights + grads + AdamW": f"{states:.2f}",
            "fits 80 GB (79.19 GiB)": f"yes ({row['spare_gib']:.2f} spare)"
            if row["fits"]
            else "no",
        }
        cells = [
            computed.get(title) or (f"{row[key]:.2f}" if key.endswith("_gib") else str(row[key]))
            for title, key in _COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
