"""Typed configuration: dataclass defaults are the paper's (Qwen2.5-32B, spec table).

Resolution order, each layer overriding the one before:

1. base scale: ``paper`` (the dataclass defaults) or ``demo`` (the embedded CPU task);
2. algorithm preset: ``dapo`` (default) or ``grpo`` (the spec's naive baseline);
3. a YAML file (``--config``), whose top-level ``base:`` and ``preset:`` pick 1 and 2;
4. dotted command-line overrides, ``optim.lr=1e-5``.

The sections (one dataclass each, every field with a docstring, each section checking its own
values) are in :mod:`dapo.config.sections`; the presets of 1 and 2 in :mod:`dapo.config.presets`;
reading, overriding and the resume rules in :mod:`dapo.config.loading`, validating in
:mod:`dapo.config.validation`.
"""

from dapo.config.loading import (
    RESUME_SAFE_FIELDS,
    apply_overrides,
    config_warnings,
    dump_yaml,
    load_config,
    parse_override,
    run_changing_differences,
    saved_before_keys_moved,
    set_value,
    validate,
)
from dapo.config.moved import MOVED_KEYS
from dapo.config.sections import (
    AlgoConfig,
    Config,
    DataConfig,
    DistConfig,
    EmbeddedConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    TrainConfig,
    choices,
)
from dapo.config.setup import LoraConfig

__all__ = [
    "MOVED_KEYS",
    "RESUME_SAFE_FIELDS",
    "apply_overrides",
    "AlgoConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "EmbeddedConfig",
    "EvalConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "TrainConfig",
    "choices",
    "config_warnings",
    "dump_yaml",
    "load_config",
    "parse_override",
    "run_changing_differences",
    "saved_before_keys_moved",
    "set_value",
    "validate",
]
