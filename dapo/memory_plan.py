"""``python -m dapo.memory_plan``: memory per GPU on paper, before anything is loaded.

    python -m dapo.memory_plan [--json]                      # 0.5B to 32B at 1, 8, 64 GPUs
    python -m dapo.memory_plan --config RECIPE [--json]      # a recipe on its hardware

A recipe states the hardware it is written for in a top-level ``hardware:`` mapping
(``gpus`` and ``gpu_gib``; ``gpus: 0`` and ``memory_gib`` for a CPU one). The recipe's plan
needs neither weights nor data: the model's shape comes from ``<model.path>/config.json``, or
from the built-in shapes when the directory is absent and its name is a known model; the
longest prompt is taken as ``--prompt-tokens``, by default the longest the run can get: the
model's context less ``rollout.max_new_tokens`` (a longer prompt is refused or dropped), at
most the recipe's ``hardware.prompt_tokens`` or :data:`PROMPT_TOKENS`. ``--json`` prints a
list of rows with ``model``, ``prompt_tokens``, ``gpus``, ``gpu_gib``, ``peak_train_gib``,
``peak_generate_gib``, ``spare_gib`` and ``fits`` (4 GiB to spare, which CI asks of every
recipe), the settings the plan used
(``tp_size``, ``grad_sync``, ``activation_checkpointing``, ``microbatch_tokens``, ...) and
every part in GiB (``weights_gib``, ``gradients_gib``, ... ``load_host_gib``). The table's
7B and 32B rows take the settings of their recipes (``TABLE_RECIPES``), the others the
defaults. The plan itself is :mod:`dapo.training.gpu_memory`, its layout
:mod:`dapo.training.memory_table`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dapo.config import load_config
from dapo.config.loading import read_hardware
from dapo.training.fixed_memory import usable_gib
from dapo.training.gpu_memory import (
    model_shape,
    plan_memory,
    settings_from_config,
)
from dapo.training.memory_table import SPARE_GIB, markdown_table, plan_row, table_rows
from dapo.training.model_shape import KNOWN_SHAPES, ModelShape

_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_FIELDS += ("num_key_value_heads", "vocab_size", "tie_word_embeddings")
RECIPE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-math-1.5b": KNOWN_SHAPES["qwen2.5-1.5b"],  # the same sizes as the base model
    "smollm2-135m": {
        "model_type": "llama",
        **dict(zip(_FIELDS, (576, 1536, 30, 9, 3, 49152, True), strict=True)),
    },
}
"""Models the recipes name besides the table's, sized when their directory is absent."""

CONTEXTS = {"qwen2.5-math-1.5b": 4096, "qwen2.5-0.5b": 32768, "smollm2-135m": 8192}
"""The context (``max_position_embeddings``) of the recipes' models, for when their directory
is absent; another model's is taken as unbounded (the 7B and 32B bases hold 32k or more)."""
PROMPT_TOKENS = 2048
"""The longest prompt a recipe is planned for when its context allows more and it states no
``hardware.prompt_tokens``: DAPO-Math-17k's longest takes ~1,600 tokens (1,643 of SmolLM2's
tokenizer, a stand-in for Qwen's, with the DAPO template and a chat template)."""

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TABLE_RECIPES = {"qwen2.5-7b": "dapo-qwen2.5-7b.yaml", "qwen2.5-32b": "dapo-qwen2.5-32b.yaml"}
"""The table's models that take their recipe's settings (``recipes/`` of the repository)."""


def the_table_rows() -> list[dict[str, Any]]:
    """docs/scale-out.md's table as rows, the 7B and 32B ones at their recipes' settings."""
    missing = [name for name in TABLE_RECIPES.values() if not (RECIPES / name).is_file()]
    if missing:
        raise OSError(
            f"the table takes the settings of {', '.join(missing)}, absent from {RECIPES}: "
            "run it from a checkout of the repository"
        )
    return table_rows({m: load_config(RECIPES / name) for m, name in TABLE_RECIPES.items()})


def recipe_shape(cfg: Any) -> ModelShape:
    """The recipe's model: its config.json (a Hub id's only when in the cache: the plan
    downloads nothing), or the built-in shape of a known model's name."""
    from dapo.models import hub

    if cfg.model.path != "embedded":
        try:
            path = hub.resolve(cfg.model.path, cfg.model.revision, download=False)
        except hub.HubModelError:
            path = Path(cfg.model.path)
        if (path / "config.json").is_file():
            return ModelShape.from_hf_config(json.loads((path / "config.json").read_text()))
    else:
        return model_shape(cfg)
    shapes = {**KNOWN_SHAPES, **RECIPE_SHAPES}
    name = Path(cfg.model.path).name
    known = shapes.get(name.lower())
    if known is None:
        raise ValueError(
            f"model.path={cfg.model.path}: no config.json there (nor in the Hugging Face cache) "
            f"and {name!r} is none of the built-in shapes ({', '.join(shapes)}); point "
            "model.path at the model's directory"
        )
    return ModelShape.from_hf_config(known)


def recipe_context(cfg: Any) -> int | None:
    """The recipe's model's context: its config.json's (a Hub id's only when in the cache),
    the embedded model's, or :data:`CONTEXTS`; None when unknown."""
    from dapo.models import hub
    from dapo.models.demo import TinyModelSpec

    if cfg.model.path == "embedded":
        return TinyModelSpec().max_positions
    try:
        path = hub.resolve(cfg.model.path, cfg.model.revision, download=False)
    except hub.HubModelError:
        path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    return CONTEXTS.get(Path(cfg.model.path).name.lower())


def planned_prompt_tokens(cfg: Any, hardware: dict[str, Any]) -> int:
    """The longest prompt the recipe's run can get: its context less ``rollout.max_new_tokens``
    (longer ones are refused, or dropped with ``data.on_long_prompt=skip``), at most
    ``hardware.prompt_tokens`` (:data:`PROMPT_TOKENS` unless stated)."""
    stated = hardware.get("prompt_tokens", PROMPT_TOKENS)
    context = recipe_context(cfg)
    return stated if context is None else max(1, min(stated, context - cfg.rollout.max_new_tokens))


def recipe_plan(recipe: Path, *, prompt_tokens: int | None = None) -> dict[str, Any]:
    """The plan of ``recipe`` on the hardware it states, as one JSON row; ``prompt_tokens``:
    the longest prompt (None: :func:`planned_prompt_tokens`)."""
    cfg = load_config(recipe)
    hardware = read_hardware(recipe)
    if prompt_tokens is None:
        prompt_tokens = planned_prompt_tokens(cfg, hardware)
    gpus = hardware["gpus"]
    budget = usable_gib(hardware["gpu_gib"]) if gpus else hardware["memory_gib"]
    settings = settings_from_config(
        cfg,
        world_size=max(gpus, 1),
        prompt_tokens=prompt_tokens,
        device="cuda" if gpus else "cpu",
        gpu_bytes=int(budget * 2**30) if gpus else 0,
    )
    plan = plan_memory(recipe_shape(cfg), settings)
    row = {"recipe": str(recipe), "model": Path(cfg.model.path).name}
    row |= {"prompt_tokens": prompt_tokens}
    row |= {"device": "cuda" if gpus else "cpu", "gpus": gpus}
    row |= {"gpu_gib": hardware["gpu_gib"] if gpus else budget, "usable_gib": round(budget, 2)}
    return row | plan_row(plan, gpu_gib=budget)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dapo.memory_plan", description=__doc__)
    parser.add_argument("--config", type=Path, action="append", metavar="RECIPE")
    parser.add_argument("--json", action="store_true", help="one JSON list of rows")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        metavar="T",
        help="the longest prompt; default: the recipe's context less rollout.max_new_tokens, "
        f"at most hardware.prompt_tokens ({PROMPT_TOKENS} unless stated); the table: 512",
    )
    args = parser.parse_args(argv)
    try:
        if not args.config:
            table = the_table_rows()
            print(json.dumps(table, indent=1) if args.json else markdown_table(table))
            return 0
        rows = [recipe_plan(r, prompt_tokens=args.prompt_tokens) for r in args.config]
    except (OSError, ValueError) as exc:
        parser.exit(2, f"dapo: error: {exc}\n")
    if args.json:
        print(json.dumps(rows, indent=1))
    for row in [] if args.json else rows:
        where = "CPU"
        if row["gpus"]:
            where = f"{row['gpus']} x {row['gpu_gib']:g} GB ({row['usable_gib']} GiB usable)"
        print(
            f"{row['recipe']}: {row['model']} on {where}, prompts of {row['prompt_tokens']} "
            f"tokens: peak {row['peak_train_gib']} GiB "
            f"training, {row['peak_generate_gib']} GiB generating; {row['spare_gib']} GiB spare"
            + ("" if row["fits"] else f" (less than the {SPARE_GIB:g} GiB a recipe must leave)")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
