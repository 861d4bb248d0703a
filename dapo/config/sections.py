"""The whole config: one typed section per concern, defaults the paper's (Qwen2.5-32B).

Every batch size names its unit, because unit confusion is what users of other RL frameworks
trip over most: prompts per step, responses per prompt, responses per mini-batch, tokens per
micro-batch. A field whose values are a fixed set declares them in its type (``Literal``), and
each section checks its own values (``check``); :func:`dapo.config.validate` adds the rules
that span sections. Nothing here imports torch: a config loads, and fails, in milliseconds.
The sections: :mod:`dapo.config.training` (how it trains) and :mod:`dapo.config.setup` (what
and where).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from dapo.config.setup import (
    DataConfig,
    DistConfig,
    EmbeddedConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    VLLMConfig,
)
from dapo.config.training import (
    AlgoConfig,
    EvalConfig,
    OptimConfig,
    RolloutConfig,
    SamplingConfig,
    TrainConfig,
)
from dapo.reward.tasks.arith import ArithConfig
from dapo.reward.tasks.code import CodeConfig


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    # A task with settings of its own adds its section here, named after the task.
    arith: ArithConfig = field(default_factory=ArithConfig)
    code: CodeConfig = field(default_factory=CodeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # Derived figures, printed at start so the units are never in doubt.
    @property
    def responses_per_step(self) -> int:
        return self.train.prompts_per_step * self.rollout.group_size

    @property
    def updates_per_step(self) -> int:
        per_epoch = -(-self.responses_per_step // self.train.responses_per_minibatch)
        return per_epoch * self.train.epochs


def field_types(section: Any) -> dict[str, Any]:
    """The resolved type of every field of a config section."""
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def is_subsection(typ: Any) -> bool:
    """Whether a field's type is itself a section of fields (``model.lora``)."""
    return isinstance(typ, type) and dataclasses.is_dataclass(typ)


def leaves(section: Any, prefix: str = "") -> dict[str, Any]:
    """Every field of ``section`` (a :class:`Config` too) by its dotted key, fields of
    subsections included: ``{"model.path": ..., "model.lora.rank": ...}``."""
    out: dict[str, Any] = {}
    for name, typ in field_types(section).items():
        value = getattr(section, name)
        if is_subsection(typ):
            out |= leaves(value, f"{prefix}{name}.")
        else:
            out[f"{prefix}{name}"] = value
    return out


def choices(section: type, name: str) -> tuple[str, ...]:
    """The values a ``Literal``-typed field allows: ``choices(RolloutConfig, "engine")``."""
    return typing.get_args(typing.get_type_hints(section)[name])
