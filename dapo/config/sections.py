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
import difflib
import functools
import keyword
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dapo.config.env import EnvConfig
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
    env: EnvConfig = field(default_factory=EnvConfig)
    # A task with settings of its own adds its section here, named after the task.
    arith: ArithConfig = field(default_factory=ArithConfig)
    code: CodeConfig = field(default_factory=CodeConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every section as a mapping by its keys (``env.class``, not ``class_``)."""
        return _keyed(dataclasses.asdict(self))

    # Derived figures, printed at start so the units are never in doubt.
    @property
    def responses_per_step(self) -> int:
        return self.train.prompts_per_step * self.rollout.group_size

    @property
    def updates_per_step(self) -> int:
        per_epoch = -(-self.responses_per_step // self.train.responses_per_minibatch)
        return per_epoch * self.train.epochs


def key_of(name: str) -> str:
    """The config key of a field: a Python keyword is held in a field with a trailing
    underscore (``env.class`` in ``EnvConfig.class_``)."""
    stem = name[:-1]
    return stem if name.endswith("_") and keyword.iskeyword(stem) else name


def attr_of(key: str) -> str:
    """The field that holds config key ``key``: the inverse of :func:`key_of`."""
    return key + "_" if keyword.iskeyword(key) else key


def _keyed(tree: Any) -> Any:
    if not isinstance(tree, dict):
        return tree
    return {key_of(k): _keyed(v) for k, v in tree.items()}


def field_types(section: Any) -> dict[str, Any]:
    """The resolved type of every field of a config section, by its key (:func:`key_of`)."""
    return dict(_types_of(type(section)))


@functools.cache  # resolving the hints costs ~0.3 ms, and a file sets each key on its own
def _types_of(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {key_of(f.name): hints[f.name] for f in dataclasses.fields(cls)}


def is_subsection(typ: Any) -> bool:
    """Whether a field's type is itself a section of fields (``model.lora``)."""
    return isinstance(typ, type) and dataclasses.is_dataclass(typ)


def leaves(section: Any, prefix: str = "") -> dict[str, Any]:
    """Every field of ``section`` (a :class:`Config` too) by its dotted key, fields of
    subsections included: ``{"model.path": ..., "model.lora.rank": ...}``."""
    out: dict[str, Any] = {}
    for name, typ in field_types(section).items():
        value = getattr(section, attr_of(name))
        if is_subsection(typ):
            out |= leaves(value, f"{prefix}{name}.")
        else:
            out[f"{prefix}{name}"] = value
    return out


def choices(section: type, name: str) -> tuple[str, ...]:
    """The values a ``Literal``-typed field allows: ``choices(RolloutConfig, "engine")``."""
    return typing.get_args(typing.get_type_hints(section)[name])


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """ ". Did you mean PREFIX+NAME?" for the known name closest to a misspelt ``name`` (a
    short one: a file's key may be megabytes, and comparing it would take minutes), or ""."""
    close = difflib.get_close_matches(name, list(known), n=1) if len(name) <= 64 else []
    return f". Did you mean {prefix}{close[0]}?" if close else ""
