"""Validating a config: each section's own checks, the choices of ``Literal`` fields, finite
numbers, and the rules that span sections; and the settings that work but cost what a user may
not expect."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal

from dapo.config import presets
from dapo.config.sections import Config, attr_of, field_types, is_subsection, leaves
from dapo.config.yaml_files import clipped_repr

PATH_FIELDS = (
    "run.out_dir",
    "model.path",
    "model.revision",
    "embedded.cache_dir",
    "data.train_file",
    "data.val_file",
    "reward.function",
    "env.class",
)
"""The fields that name a file, a directory or a Hub revision (``run.name``: its section's
check): each becomes a path the operating system is given."""


def _choice_errors(name: str, section: Any) -> list[str]:
    """A field typed ``Literal[...]`` must hold one of its values (in subsections too)."""
    errors = []
    for key, typ in field_types(section).items():
        value = getattr(section, attr_of(key))
        if is_subsection(typ):
            errors += _choice_errors(f"{name}.{key}", value)
        elif typing.get_origin(typ) is Literal and value not in typing.get_args(typ):
            errors.append(f"{name}.{key} must be one of {typing.get_args(typ)}, got {value!r}")
    return errors


def _finite_errors(name: str, section: Any) -> list[str]:
    """A number field must hold a finite number: a NaN passes every ``x < 0`` check and then
    poisons the loss, and no field means anything by infinity."""
    errors = []
    for key, typ in field_types(section).items():
        value = getattr(section, attr_of(key))
        if is_subsection(typ):
            errors += _finite_errors(f"{name}.{key}", value)
        elif isinstance(value, float) and not math.isfinite(value):
            errors.append(f"{name}.{key} must be a finite number, got {value}")
    return errors


def _nul_errors(cfg: Config) -> list[str]:
    """A path field holding a NUL character: no file system takes one, and the first use of
    it, once the config had loaded, said only "embedded null byte" (or named a file with the
    NUL in its name)."""
    values = leaves(cfg)
    return [
        f"{key} must not hold a NUL character (no file system takes one), got "
        f"{clipped_repr(values[key])}"
        for key in PATH_FIELDS
        if "\0" in (values[key] or "")
    ]


def _preset_errors(run: Any) -> list[str]:
    errors = []
    if run.preset not in presets.ALGORITHMS:
        errors.append(f"run.preset must be one of {tuple(presets.ALGORITHMS)}")
    if run.base not in presets.BASES:
        errors.append(f"run.base must be one of {tuple(presets.BASES)}")
    return errors


MAX_SHOWN_ERRORS = 20
"""At most this many errors are listed (then how many more): a file of 300,000 unknown keys
printed 47 MB of them."""


def invalid_config(errors: list[str]) -> str:
    """The message of ``errors``: one line each, the first :data:`MAX_SHOWN_ERRORS` of them."""
    shown = errors[:MAX_SHOWN_ERRORS]
    if len(errors) > len(shown):
        shown.append(f"... and {len(errors) - len(shown)} more")
    return "invalid config:\n  " + "\n  ".join(shown)


def validate(cfg: Config) -> None:
    """Reject values that cannot work, all at once, naming each field and what is allowed:
    each section's own checks, then the rules that span sections."""
    errors = config_errors(cfg)
    if errors:
        raise ValueError(invalid_config(errors))


def config_errors(cfg: Config) -> list[str]:
    """What :func:`validate` refuses, one message per bad value."""
    errors = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        errors += _choice_errors(f.name, section) + _finite_errors(f.name, section)
        errors += section.check()
        if f.name == "run":  # names of the presets (which set fields of every section)
            errors += _preset_errors(section)
    errors += _nul_errors(cfg)
    a, r, m = cfg.algo, cfg.rollout, cfg.model
    if a.overlong_shaping and not 0 < a.l_cache <= r.max_new_tokens:
        errors.append(
            f"algo.l_cache must be in (0, rollout.max_new_tokens={r.max_new_tokens}] when "
            f"algo.overlong_shaping is on, got {a.l_cache}"
        )
    if not (cfg.train.recompute_old_logprobs or m.param_dtype == m.compute_dtype == "float32"):
        errors.append(
            "train.recompute_old_logprobs=false needs model.param_dtype and model.compute_dtype "
            f"float32 (got {m.param_dtype}, {m.compute_dtype}): in bfloat16 or float16 the "
            "sampler's log-probs differ from a forward pass's; set "
            "train.recompute_old_logprobs=true"
        )
    k = cfg.train.async_staleness
    if k > 0 and r.engine != "dapo" and not cfg.dist.rollout_ranks:
        why = {
            "hf": "its sampling draws from torch's global generator, which evaluation shares",
            "vllm": "its weights live in vLLM, not in a copy the generator thread owns",
        }[r.engine]
        errors.append(
            f"train.async_staleness={k} generates in a thread beside training, and rollout."
            f"engine={r.engine} cannot ({why}): use rollout.engine=dapo, or "
            "train.async_staleness=0 (or generate on ranks of their own: dist.rollout_ranks)"
        )
    errors += _dtype_errors(m)
    if cfg.data.train_file and m.path == "embedded":
        errors.append(
            "data.train_file needs a real model: the embedded model only knows the arith "
            "task's words; set model.path to a Hugging Face model directory"
        )
    errors += _sampling_errors(cfg)
    return errors


def _dtype_errors(m: Any) -> list[str]:
    """The weights' and the computation's dtypes that cannot train (``m``: the model section)."""
    # Adapters stay float32 whatever the base's dtype: only full fine-tuning steps float16.
    if m.param_dtype == "float16" and not m.lora.rank:
        return [
            "model.param_dtype=float16: AdamW would step float16 weights, whose state "
            "underflows (its eps, 1e-8, is 0 in float16), so the first update turns the "
            "weights to NaN or inf; set model.param_dtype=float32 model.compute_dtype=float16 "
            "(float16 compute on float32 weights, with a loss scaler)"
        ]
    if m.param_dtype != "float32" and m.compute_dtype != m.param_dtype:
        return [
            f"model.compute_dtype={m.compute_dtype} with model.param_dtype={m.param_dtype}: "
            "autocast computes in a dtype narrower than float32 weights, not wider or other "
            f"than the weights; set model.compute_dtype={m.param_dtype}"
        ]
    return []


def _sampling_errors(cfg: Config) -> list[str]:
    """Rounds that can never keep N groups (a round keeps at most one group per prompt it
    draws): with ``on_max_rounds=error`` every step would stop, after generating."""
    s, n = cfg.sampling, cfg.train.prompts_per_step
    per_round = s.prompts_per_round or n
    if not (s.dynamic and not s.oversample and s.max_rounds and s.on_max_rounds == "error"):
        return []
    if s.max_rounds * per_round >= n:
        return []
    return [
        f"sampling.max_rounds={s.max_rounds} rounds of sampling.prompts_per_round={per_round} "
        f"prompts keep at most {s.max_rounds * per_round} groups, fewer than "
        f"train.prompts_per_step={n}: every step would stop; draw more (max_rounds, "
        "prompts_per_round or sampling.oversample=true) or set sampling.on_max_rounds=train"
    ]


def config_warnings(cfg: Config) -> list[str]:
    """Settings that work but cost what a user may not expect, one line each."""
    m = cfg.model
    if m.param_dtype == "float32" or m.lora.rank:  # LoRA's adapters stay float32
        return []
    return [
        f"model.param_dtype={m.param_dtype}: AdamW steps {m.param_dtype} weights, whose "
        "spacing is ~0.4% of their size, so small updates round away (at lr 1e-6 almost all "
        "do: one update on a tiny Qwen2 changed 2.6% of its bf16 weights). Keep "
        "param_dtype=float32 and set "
        f"compute_dtype={m.param_dtype} to compute in it."
    ]
