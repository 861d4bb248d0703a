"""The config sections: typed dataclasses whose defaults are the paper's (Qwen2.5-32B).

Every batch size names its unit, because unit confusion is what users of other RL frameworks
trip over most: prompts per step, responses per prompt, responses per mini-batch, tokens per
micro-batch. A field whose values are a fixed set declares them in its type (``Literal``), and
each section checks its own values (``check``); :func:`dapo.config.validate` adds the rules
that span sections. Nothing here imports torch: a config loads, and fails, in milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from dapo import presets, tasks
from dapo.tasks.arith import ArithConfig


@dataclass
class ModelConfig:
    path: str = "embedded"
    """A local Hugging Face model directory, or ``embedded`` for the built-in tiny Qwen2."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""

    def check(self) -> list[str]:
        if self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"):
            return []
        return [f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}"]


@dataclass
class EmbeddedConfig:
    """The built-in tiny Qwen2 policy (``model.path=embedded``), warm-started on the arith task."""

    cache_dir: str = "~/.cache/dapo"
    """Where its warm-started weights are cached (rebuilt if absent)."""
    sft_steps: int = 400
    """Supervised warm-start steps (RL needs a policy that is sometimes right)."""
    hidden: int = 128
    """Hidden size (a multiple of its 4 attention heads)."""
    layers: int = 2
    """Decoder layers."""

    def check(self) -> list[str]:
        errors = []
        if self.sft_steps < 1:
            errors.append(f"embedded.sft_steps must be >= 1, got {self.sft_steps}")
        if not (self.hidden >= 4 and self.hidden % 4 == 0):
            errors.append(f"embedded.hidden must be a positive multiple of 4, got {self.hidden}")
        if self.layers < 1:
            errors.append("embedded.layers must be >= 1")
        return errors


@dataclass
class DataConfig:
    task: str = "arith"
    """The embedded task, used when no train_file is given (the only one so far: ``arith``,
    whose settings are the ``arith`` section)."""
    train_file: str = ""
    """Training data file (Parquet or JSONL, DAPO or flat format); empty = the embedded task."""
    val_file: str = ""
    """Held-out data file, e.g. AIME 2024; required with ``train_file``."""
    format: Literal["auto", "dapo", "flat"] = "auto"
    """``dapo`` (chat-message ``prompt``, ``reward_model.ground_truth``), ``flat`` (a question
    and an answer column) or ``auto`` (dapo when the file has ``prompt`` and ``reward_model``)."""
    question_key: str = "question"
    """Question column of a flat file."""
    answer_key: str = "answer"
    """Answer column of a flat file."""
    data_source: str = "math_dapo"
    """Verifier of flat rows (and of rows whose data_source is empty)."""
    wrap_template: bool = False
    """Wrap each problem in the DAPO instruction template (never twice)."""
    dedup: bool = True
    """Train on each distinct problem once, however many rows repeat it."""
    on_bad_row: Literal["error", "skip"] = "error"
    """``error`` stops at the first bad row, naming file, row and field; ``skip`` counts it."""
    apply_chat_template: bool = True
    """Render chat messages with the tokenizer's chat template when it has one (else raw)."""

    def check(self) -> list[str]:
        errors = []
        if self.task != "arith":
            errors.append(f"data.task must be 'arith' (the embedded task), got {self.task!r}")
        if bool(self.train_file) != bool(self.val_file):
            errors.append(
                "data.train_file and data.val_file go together: give both (e.g. DAPO-Math-17k "
                "and AIME 2024), or neither for the embedded task"
            )
        return errors


@dataclass
class RolloutConfig:
    group_size: int = 16
    """G, responses per prompt (paper: 16)."""
    max_new_tokens: int = 20480
    """L_max, the generation limit in tokens (paper: 20480)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (paper: 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts (paper: 1.0)."""
    ignore_eos: bool = False
    """Benchmarks only: every response runs to max_new_tokens, so two systems do equal work.
    The hf engine then records the EOS-masked log-probs, so it needs recompute_old_logprobs."""
    rows_per_generate: int = 0
    """Responses generated at once (0 = a whole round): bounds generation memory, as a round
    of n prompts runs in ceil(n G / this) calls, each seeded from the round's seed."""
    engine: Literal["dapo", "hf"] = "dapo"
    """dapo (one prefill per prompt, finished rows leave the batch) or hf (transformers
    generate, for a model whose KV cache cannot be repeated or sliced by row)."""

    def check(self) -> list[str]:
        errors = []
        if self.group_size < 2:
            errors.append(
                "rollout.group_size must be >= 2 (advantages compare within a group), "
                f"got {self.group_size}"
            )
        if self.max_new_tokens < 1:
            errors.append("rollout.max_new_tokens must be >= 1")
        if not self.temperature > 0:
            errors.append("rollout.temperature must be > 0")
        if not math.isfinite(self.temperature):
            errors.append("rollout.temperature must be finite")
        if not 0 < self.top_p <= 1:
            errors.append("rollout.top_p must be in (0, 1]")
        if self.rows_per_generate < 0:
            errors.append("rollout.rows_per_generate must be >= 0 (0 = a whole round)")
        return errors


@dataclass
class AlgoConfig:
    eps_low: float = 0.2
    """Lower clip range epsilon_low (paper: 0.2)."""
    eps_high: float = 0.28
    """Upper clip range epsilon_high; Clip-Higher when above eps_low (paper: 0.28)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """token-mean (DAPO token-level loss) or seq-mean-token-mean (GRPO sample-level loss)."""
    kl_coef: float = 0.0
    """beta of the k3 KL penalty to a frozen reference model (DAPO: 0, no reference model)."""
    overlong_shaping: bool = True
    """Soft overlong punishment R_length (DAPO §3.4)."""
    l_cache: int = 4096
    """L_cache, the soft-punishment buffer in tokens (paper: 4096)."""
    overlong_factor: float = 1.0
    """Multiplier of the overlong penalty (paper: 1.0)."""
    overlong_filter: bool = False
    """Mask the loss of truncated responses (the ablation's overlong filtering). Off in DAPO,
    which punishes softly instead; when neither is on, truncated responses score -1."""
    adv_eps: float = 1e-6
    """eps in (R - mean) / (std + eps)."""

    def check(self) -> list[str]:
        errors = []
        if self.eps_low < 0:
            errors.append(f"algo.eps_low must be >= 0, got {self.eps_low}")
        if self.eps_high < self.eps_low:
            errors.append(f"algo.eps_high must be >= algo.eps_low, got {self.eps_high}")
        if self.kl_coef < 0:
            errors.append(f"algo.kl_coef must be >= 0, got {self.kl_coef}")
        if self.overlong_factor < 0:
            errors.append("algo.overlong_factor must be >= 0")
        return errors


@dataclass
class SamplingConfig:
    dynamic: bool = True
    """Dynamic sampling: keep only groups with 0 < #correct < G (DAPO §3.2)."""
    max_rounds: int = 10
    """Generation rounds per step before giving up on filling N groups; 0 = unbounded."""
    on_max_rounds: Literal["error", "train"] = "error"
    """After max_rounds: ``error`` stops the run, ``train`` trains on the groups kept so far."""
    prompts_per_round: int = 0
    """Prompts drawn per generation round; 0 = prompts_per_step. With oversample, the first
    round's size until a kept fraction has been measured."""
    oversample: bool = True
    """Size each round as (groups still needed) / (kept fraction measured last step or this
    one), at most 4 x prompts_per_step, so that one round usually suffices."""

    def check(self) -> list[str]:
        errors = []
        if self.max_rounds < 0:
            errors.append("sampling.max_rounds must be >= 0 (0 = unbounded)")
        if self.prompts_per_round < 0:
            errors.append("sampling.prompts_per_round must be >= 0")
        return errors


@dataclass
class TrainConfig:
    steps: int = 100
    """Rollout steps (each: generate, filter, then epochs x mini-batch updates)."""
    prompts_per_step: int = 512
    """N, prompts (groups) trained on per step (paper: 512)."""
    responses_per_minibatch: int = 512
    """Responses per gradient update (paper: 512, so 16 updates per step at G=16)."""
    tokens_per_microbatch: int = 16384
    """Padded tokens per forward/backward; only memory, never the gradient, depends on it."""
    epochs: int = 1
    """mu, passes over each step's responses."""
    recompute_old_logprobs: bool = True
    """Recompute pi_old log-probs with a forward pass. False reuses the sampler's, after
    checking on the first step that they match a forward pass (float32: they do)."""
    share_prompts: bool = True
    """Forward passes run each distinct prompt of a micro-batch once for all its responses."""
    seed: int = 0
    """Seed of prompt order, sampling and initialisation."""
    save_every: int = 20
    """Checkpoint every this many steps, and always after the last; 0 = only after the last."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep; older ones are deleted once a newer is safe."""
    max_consecutive_skips: int = 10
    """Stop after this many updates in a row skipped for a non-finite loss or gradient norm."""

    def check(self) -> list[str]:
        at_least = {
            "steps": 0,
            "prompts_per_step": 1,
            "responses_per_minibatch": 1,
            "tokens_per_microbatch": 1,
            "epochs": 1,
            "keep_checkpoints": 1,
            "max_consecutive_skips": 1,
        }
        errors = [
            f"train.{name} must be >= {low}"
            for name, low in at_least.items()
            if getattr(self, name) < low
        ]
        if self.save_every < 0:
            errors.append("train.save_every must be >= 0 (0 = only after the last step)")
        return errors


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """AdamW learning rate (paper: 1e-6)."""
    warmup_steps: int = 20
    """Linear warm-up, in rollout steps (paper: 20)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    """Clip the gradient norm of each update to this (0 = off)."""

    def check(self) -> list[str]:
        errors = []
        if not self.lr > 0:
            errors.append("optim.lr must be > 0")
        if self.warmup_steps < 0:
            errors.append("optim.warmup_steps must be >= 0")
        if self.grad_clip < 0:
            errors.append("optim.grad_clip must be >= 0 (0 = off)")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            errors.append("optim.beta1 and optim.beta2 must be in [0, 1)")
        if self.weight_decay < 0:
            errors.append("optim.weight_decay must be >= 0")
        return errors


@dataclass
class EvalConfig:
    every: int = 5
    """Held-out evaluation every this many steps (0 = only at start and end)."""
    num_samples: int = 32
    """k of avg@k (paper: 32); 0 = as many as the val file repeats each problem (AIME: 32)."""
    temperature: float = 1.0
    """Paper: 1.0."""
    top_p: float = 0.7
    """Paper: 0.7."""
    max_new_tokens: int = 0
    """0 = the rollout's L_max."""

    def check(self) -> list[str]:
        errors = []
        if self.every < 0:
            errors.append("eval.every must be >= 0")
        if self.num_samples < 0:
            errors.append("eval.num_samples must be >= 0 (0 = the val file's repeats)")
        if not 0 < self.top_p <= 1:
            errors.append("eval.top_p must be in (0, 1]")
        if not self.temperature > 0:
            errors.append("eval.temperature must be > 0")
        if self.max_new_tokens < 0:
            errors.append("eval.max_new_tokens must be >= 0 (0 = rollout.max_new_tokens)")
        return errors


@dataclass
class RewardConfig:
    workers: int = 1
    """Verifier processes. A response that makes the verifier raise, hang or exhaust memory is
    graded incorrect and counted; 0 grades in-process, where a hang cannot be stopped."""
    timeout_s: float = 10.0
    """Seconds one response may take to grade before its worker is killed."""
    memory_mb: int = 2048
    """Address-space limit of each verifier process, MiB; 0 = no limit."""
    mode: str = ""
    """Verifier for every row, a task name (``dapo``, ``math_verify``: see dapo.tasks); empty
    = chosen by each row's ``data_source`` (``math_dapo`` -> the DAPO verifier)."""

    def check(self) -> list[str]:
        errors = []
        if self.workers < 0:
            errors.append("reward.workers must be >= 0 (0 = grade in-process)")
        if not self.timeout_s > 0:
            errors.append("reward.timeout_s must be > 0")
        if self.memory_mb < 0:
            errors.append("reward.memory_mb must be >= 0 (0 = no limit)")
        if self.mode not in ("", *tasks.names()):
            errors.append(
                f"reward.mode must be empty (by data_source) or one of {tasks.names()}, "
                f"got {self.mode!r}"
            )
        return errors


@dataclass
class RunConfig:
    out_dir: str = "runs"
    """Run directories are created under this one."""
    name: str = ""
    """Run directory name; empty = <preset>-<timestamp>."""
    preset: str = "dapo"
    """Algorithm preset applied before the YAML file and overrides: dapo or grpo."""
    base: str = "paper"
    """Scale the config started from: paper or demo."""
    threads: int = 0
    """torch CPU threads; 0 = torch's default."""
    tensorboard: bool = True
    """Also write every metric as TensorBoard scalars in <run dir>/tensorboard."""
    progress: Literal["auto", "plain"] = "auto"
    """``auto``: a live display on a terminal, one line per step otherwise; ``plain``: lines."""
    wandb: bool = False
    """Also log to Weights & Biases (needs ``pip install wandb``; WANDB_MODE=offline works)."""
    wandb_project: str = "dapo"
    """W&B project of the run; the run's name and id are the run directory's name."""

    def check(self) -> list[str]:
        errors = []
        if self.preset not in presets.ALGORITHMS:
            errors.append(f"run.preset must be one of {tuple(presets.ALGORITHMS)}")
        if self.base not in presets.BASES:
            errors.append(f"run.base must be one of {tuple(presets.BASES)}")
        if self.threads < 0:
            errors.append("run.threads must be >= 0 (0 = torch's default)")
        return errors


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
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    # A task with settings of its own adds its section here, named after the task.
    arith: ArithConfig = field(default_factory=ArithConfig)

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


def choices(section: type, name: str) -> tuple[str, ...]:
    """The values a ``Literal``-typed field allows: ``choices(RolloutConfig, "engine")``."""
    return typing.get_args(typing.get_type_hints(section)[name])
