"""Typed configuration: dataclass defaults are the paper's (Qwen2.5-32B, spec table).

Resolution order, each layer overriding the one before:

1. base scale: ``paper`` (the dataclass defaults) or ``demo`` (the embedded CPU task);
2. algorithm preset: ``dapo`` (default) or ``grpo`` (the spec's naive baseline);
3. a YAML file (``--config``), whose top-level ``base:`` and ``preset:`` pick 1 and 2;
4. dotted command-line overrides, ``optim.lr=1e-5``.

Every batch size names its unit, because unit confusion is what users of other RL frameworks
trip over most: prompts per step, responses per prompt, responses per mini-batch, tokens per
micro-batch.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dapo.algo import AGG_MODES
from dapo.model import DTYPES

AGG_CHOICES = AGG_MODES
ON_MAX_ROUNDS_CHOICES = ("error", "train")
DTYPE_CHOICES = tuple(DTYPES)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SOLUTION_CHOICES = ("direct", "steps", "mixed")
FORMAT_CHOICES = ("auto", "dapo", "flat")
BAD_ROW_CHOICES = ("error", "skip")
MODE_CHOICES = ("dapo", "math_verify")
BASES = ("paper", "demo")
PRESETS = ("dapo", "grpo")
ENGINE_CHOICES = ("dapo", "hf")


@dataclass
class ModelConfig:
    path: str = "embedded"
    """A local Hugging Face model directory, or ``embedded`` for the built-in tiny Qwen2."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    cache_dir: str = "~/.cache/dapo"
    """Where the embedded model's warm-started weights are cached (rebuilt if absent)."""
    sft_steps: int = 400
    """Supervised warm-start steps of the embedded model (RL needs a policy that is sometimes
    right); ignored for a model loaded from ``path``."""
    embedded_hidden: int = 128
    """Hidden size of the embedded Qwen2 (a multiple of its 4 attention heads)."""
    embedded_layers: int = 2
    """Decoder layers of the embedded Qwen2."""


@dataclass
class DataConfig:
    task: str = "arith"
    """The embedded task (the only one so far: ``arith``)."""
    num_train: int = 20000
    """RL training problems drawn from the embedded task."""
    num_val: int = 256
    """Held-out problems, disjoint from the training ones."""
    num_warmup: int = 4000
    """Problems of the embedded model's supervised warm-start, disjoint from both."""
    min_terms: int = 2
    """Fewest terms in an embedded arithmetic problem."""
    max_terms: int = 5
    """Most terms in an embedded arithmetic problem (more terms: longer, harder responses)."""
    operators: str = "+"
    """Operators the embedded task draws from (any of ``+-``)."""
    solution: str = "direct"
    """Worked-solution style of the warm-up: ``direct`` (one line), ``steps`` (a line per
    operation) or ``mixed`` (either, at random)."""
    seed: int = 1234
    """Seed of the embedded task's problems."""
    train_file: str = ""
    """Training data file (Parquet or JSONL, DAPO or flat format); empty = the embedded task."""
    val_file: str = ""
    """Held-out data file, e.g. AIME 2024; required with ``train_file``."""
    format: str = "auto"
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
    on_bad_row: str = "error"
    """``error`` stops at the first bad row, naming file, row and field; ``skip`` counts it."""
    apply_chat_template: bool = True
    """Render chat messages with the tokenizer's chat template when it has one (else raw)."""


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
    engine: str = "dapo"
    """dapo (one prefill per prompt, finished rows leave the batch) or hf (transformers
    generate, for a model whose KV cache cannot be repeated or sliced by row)."""


@dataclass
class AlgoConfig:
    eps_low: float = 0.2
    """Lower clip range epsilon_low (paper: 0.2)."""
    eps_high: float = 0.28
    """Upper clip range epsilon_high; Clip-Higher when above eps_low (paper: 0.28)."""
    loss_agg: str = "token-mean"
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


@dataclass
class SamplingConfig:
    dynamic: bool = True
    """Dynamic sampling: keep only groups with 0 < #correct < G (DAPO §3.2)."""
    max_rounds: int = 10
    """Generation rounds per step before giving up on filling N groups; 0 = unbounded."""
    on_max_rounds: str = "error"
    """After max_rounds: ``error`` stops the run, ``train`` trains on the groups kept so far."""
    prompts_per_round: int = 0
    """Prompts drawn per generation round; 0 = prompts_per_step. With oversample, the first
    round's size until a kept fraction has been measured."""
    oversample: bool = True
    """Size each round as (groups still needed) / (kept fraction measured last step or this
    one), at most 4 x prompts_per_step, so that one round usually suffices."""


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
    """Verifier for every row: ``dapo`` or ``math_verify``; empty = chosen by each row's
    ``data_source`` (``math_dapo`` -> dapo)."""


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
    progress: str = "auto"
    """``auto``: a live display on a terminal, one line per step otherwise; ``plain``: lines."""
    wandb: bool = False
    """Also log to Weights & Biases (needs ``pip install wandb``; WANDB_MODE=offline works)."""
    wandb_project: str = "dapo"
    """W&B project of the run; the run's name and id are the run directory's name."""


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


# ----------------------------------------------------------------------------- presets


def paper() -> Config:
    """The paper's Qwen2.5-32B setup (spec, "Paper hyper-parameters")."""
    return Config()


def demo() -> Config:
    """The embedded CPU demo: a 0.3M-parameter Qwen2 on 2- to 5-term additions, minutes.

    L_max 28 with L_cache 8 leaves 20 tokens penalty-free, room for the longest correct answer
    (18 tokens with EOS), so the soft punishment only bites on responses that wander.
    """
    cfg = Config()
    cfg.run.base = "demo"
    cfg.model.sft_steps = 200
    cfg.rollout.group_size = 16
    cfg.rollout.max_new_tokens = 28
    cfg.algo.l_cache = 8
    cfg.train.steps = 120
    cfg.train.prompts_per_step = 32
    cfg.train.responses_per_minibatch = 128
    cfg.train.tokens_per_microbatch = 16384
    cfg.sampling.prompts_per_round = 40
    # float32 on CPU: the sampler's log-probs are the forward pass's to 1e-6 (checked at step 1).
    cfg.train.recompute_old_logprobs = False
    cfg.optim.lr = 3e-4
    cfg.optim.warmup_steps = 2
    cfg.optim.weight_decay = 0.0
    cfg.eval.every = 20
    cfg.eval.num_samples = 4
    # The demo measures the policy it trains: samples at the training temperature, no top-p
    # (the paper's protocol, top_p 0.7, is the paper base's default).
    cfg.eval.top_p = 1.0
    return cfg


def apply_preset(cfg: Config, preset: str) -> None:
    """Set the algorithm fields of ``preset`` in place.

    ``grpo`` is the spec's naive baseline: symmetric clip, sample-level loss, a KL penalty to a
    frozen reference, hard -1 for truncated responses, no dynamic sampling.
    """
    if preset not in PRESETS:
        raise ValueError(f"run.preset: unknown preset {preset!r}; choose one of {PRESETS}")
    cfg.run.preset = preset
    fresh = AlgoConfig()
    if preset == "dapo":
        cfg.algo.eps_high = fresh.eps_high
        cfg.algo.loss_agg = "token-mean"
        cfg.algo.kl_coef = 0.0
        cfg.algo.overlong_shaping = True
        cfg.algo.overlong_filter = False
        cfg.sampling.dynamic = True
    else:
        cfg.algo.eps_high = cfg.algo.eps_low
        cfg.algo.loss_agg = "seq-mean-token-mean"
        cfg.algo.kl_coef = 0.001  # verl's GRPO default kl_loss_coef
        cfg.algo.overlong_shaping = False
        cfg.algo.overlong_filter = False
        cfg.sampling.dynamic = False


# ----------------------------------------------------------------------------- loading


def _field_types(section: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check ``value`` against the field type; ints are accepted where floats are expected."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        typ = next(a for a in args if a is not type(None))
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    name = getattr(typ, "__name__", str(typ))
    raise ValueError(f"{where}: expected {name}, got {value!r} ({type(value).__name__})")


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set ``section.field`` on ``cfg``; unknown names list what exists."""
    section_name, _, name = dotted.partition(".")
    sections = [f.name for f in dataclasses.fields(cfg)]
    if section_name not in sections or not name:
        raise ValueError(f"unknown config key {dotted!r}; sections are {', '.join(sections)}")
    section = getattr(cfg, section_name)
    types_ = _field_types(section)
    if name not in types_:
        raise ValueError(
            f"unknown config key {dotted!r}; {section_name} has {', '.join(sorted(types_))}"
        )
    setattr(section, name, _coerce(value, types_[name], dotted))


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=v`` -> (``a.b``, v) with v read as a YAML scalar (1e-5, true, null, text)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"override {text!r} is not of the form section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    # YAML 1.1 reads "1e-5" as a string; a float field wants the number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.strip(), value


def _flatten(tree: dict[str, Any], where: str) -> list[tuple[str, Any]]:
    out = []
    for section, values in tree.items():
        if not isinstance(values, dict):
            raise ValueError(
                f"{where}: top-level key {section!r} must be a section mapping (e.g. "
                f"'optim: {{lr: 1e-6}}'), or one of base, preset"
            )
        out.extend((f"{section}.{k}", v) for k, v in values.items())
    return out


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    base: str | None = None,
    preset: str | None = None,
) -> Config:
    """Resolve base -> preset -> YAML file -> dotted overrides, then validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ValueError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(tree, dict):
            raise ValueError(f"{path}: the top level must be a mapping of sections")
        tree = dict(tree)
    parsed = [parse_override(o) for o in overrides]
    # base and preset shape everything else, so they are resolved first, from the most
    # specific source: flag, then dotted override, then the file (top level or run section).
    run_section = tree.get("run") if isinstance(tree.get("run"), dict) else {}
    file_base = tree.pop("base", None) or run_section.get("base")
    file_preset = tree.pop("preset", None) or run_section.get("preset")
    base = base or _pick(parsed, "run.base") or file_base
    base = base or ("paper" if path is not None else "demo")
    preset = preset or _pick(parsed, "run.preset") or file_preset or "dapo"
    if base not in BASES:
        raise ValueError(f"run.base: unknown base {base!r}; choose one of {BASES}")
    cfg = demo() if base == "demo" else paper()
    apply_preset(cfg, preset)
    resolved = {"run.base", "run.preset"}
    for key, value in _flatten(tree, str(path)) + parsed:
        if key not in resolved:
            set_value(cfg, key, value)
    validate(cfg)
    return cfg


def _pick(parsed: list[tuple[str, Any]], key: str) -> Any:
    values = [v for k, v in parsed if k == key]
    return values[-1] if values else None


def validate(cfg: Config) -> None:
    """Reject values that cannot work, naming the field and what is allowed."""
    errors = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    a, r, t, s, o, e = cfg.algo, cfg.rollout, cfg.train, cfg.sampling, cfg.optim, cfg.eval
    need(a.eps_low >= 0, f"algo.eps_low must be >= 0, got {a.eps_low}")
    need(a.eps_high >= a.eps_low, f"algo.eps_high must be >= algo.eps_low, got {a.eps_high}")
    need(a.loss_agg in AGG_CHOICES, f"algo.loss_agg must be one of {AGG_CHOICES}")
    need(a.kl_coef >= 0, f"algo.kl_coef must be >= 0, got {a.kl_coef}")
    need(a.overlong_factor >= 0, "algo.overlong_factor must be >= 0")
    if a.overlong_shaping:
        need(
            0 < a.l_cache <= r.max_new_tokens,
            f"algo.l_cache must be in (0, rollout.max_new_tokens={r.max_new_tokens}] when "
            f"algo.overlong_shaping is on, got {a.l_cache}",
        )
    need(
        r.group_size >= 2,
        f"rollout.group_size must be >= 2 (advantages compare within a group), got {r.group_size}",
    )
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    need(r.temperature > 0, "rollout.temperature must be > 0")
    need(0 < r.top_p <= 1, "rollout.top_p must be in (0, 1]")
    need(s.max_rounds >= 0, "sampling.max_rounds must be >= 0 (0 = unbounded)")
    need(
        s.on_max_rounds in ON_MAX_ROUNDS_CHOICES,
        f"sampling.on_max_rounds must be one of {ON_MAX_ROUNDS_CHOICES}",
    )
    need(s.prompts_per_round >= 0, "sampling.prompts_per_round must be >= 0")
    need(r.engine in ENGINE_CHOICES, f"rollout.engine must be one of {ENGINE_CHOICES}")
    need(r.rows_per_generate >= 0, "rollout.rows_per_generate must be >= 0 (0 = a whole round)")
    need(
        t.recompute_old_logprobs or cfg.model.dtype == "float32",
        f"train.recompute_old_logprobs=false needs model.dtype=float32 (got {cfg.model.dtype}): "
        "in bfloat16 or float16 the sampler's log-probs differ from a forward pass's; set "
        "train.recompute_old_logprobs=true",
    )
    need(t.steps >= 0, "train.steps must be >= 0")
    need(t.prompts_per_step >= 1, "train.prompts_per_step must be >= 1")
    need(t.responses_per_minibatch >= 1, "train.responses_per_minibatch must be >= 1")
    need(t.tokens_per_microbatch >= 1, "train.tokens_per_microbatch must be >= 1")
    need(t.epochs >= 1, "train.epochs must be >= 1")
    need(t.save_every >= 0, "train.save_every must be >= 0 (0 = only after the last step)")
    need(t.keep_checkpoints >= 1, "train.keep_checkpoints must be >= 1")
    need(t.max_consecutive_skips >= 1, "train.max_consecutive_skips must be >= 1")
    rw = cfg.reward
    need(rw.workers >= 0, "reward.workers must be >= 0 (0 = grade in-process)")
    need(rw.timeout_s > 0, "reward.timeout_s must be > 0")
    need(rw.memory_mb >= 0, "reward.memory_mb must be >= 0 (0 = no limit)")
    need(o.lr > 0, "optim.lr must be > 0")
    need(o.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
    need(o.grad_clip >= 0, "optim.grad_clip must be >= 0 (0 = off)")
    need(e.every >= 0, "eval.every must be >= 0")
    need(e.num_samples >= 0, "eval.num_samples must be >= 0 (0 = the val file's repeats)")
    need(0 < e.top_p <= 1, "eval.top_p must be in (0, 1]")
    need(e.temperature > 0, "eval.temperature must be > 0")
    need(cfg.model.dtype in DTYPE_CHOICES, f"model.dtype must be one of {DTYPE_CHOICES}")
    need(
        cfg.model.device in ("auto", "cpu", "cuda") or cfg.model.device.startswith("cuda:"),
        f"model.device must be auto, cpu, cuda or cuda:N, got {cfg.model.device!r}",
    )
    need(cfg.run.preset in PRESETS, f"run.preset must be one of {PRESETS}")
    need(cfg.run.base in BASES, f"run.base must be one of {BASES}")
    need(cfg.run.progress in ("auto", "plain"), "run.progress must be auto or plain")
    m, d = cfg.model, cfg.data
    need(m.sft_steps >= 1, f"model.sft_steps must be >= 1, got {m.sft_steps}")
    need(
        m.embedded_hidden >= 4 and m.embedded_hidden % 4 == 0,
        f"model.embedded_hidden must be a positive multiple of 4, got {m.embedded_hidden}",
    )
    need(m.embedded_layers >= 1, "model.embedded_layers must be >= 1")
    need(d.task == "arith", f"data.task must be 'arith' (the embedded task), got {d.task!r}")
    need(d.format in FORMAT_CHOICES, f"data.format must be one of {FORMAT_CHOICES}")
    need(d.on_bad_row in BAD_ROW_CHOICES, f"data.on_bad_row must be one of {BAD_ROW_CHOICES}")
    need(
        bool(d.train_file) == bool(d.val_file),
        "data.train_file and data.val_file go together: give both (e.g. DAPO-Math-17k and "
        "AIME 2024), or neither for the embedded task",
    )
    need(
        not (d.train_file and m.path == "embedded"),
        "data.train_file needs a real model: the embedded model only knows the arith task's "
        "words; set model.path to a Hugging Face model directory",
    )
    need(
        rw.mode in ("", *MODE_CHOICES),
        f"reward.mode must be empty (by data_source) or one of {MODE_CHOICES}, got {rw.mode!r}",
    )
    need(d.solution in SOLUTION_CHOICES, f"data.solution must be one of {SOLUTION_CHOICES}")
    need(d.num_train >= 1 and d.num_val >= 1, "data.num_train and data.num_val must be >= 1")
    need(d.num_warmup >= 1, "data.num_warmup must be >= 1")
    need(math.isfinite(r.temperature), "rollout.temperature must be finite")
    need(e.max_new_tokens >= 0, "eval.max_new_tokens must be >= 0 (0 = rollout.max_new_tokens)")
    need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    need(o.weight_decay >= 0, "optim.weight_decay must be >= 0")
    need(cfg.run.threads >= 0, "run.threads must be >= 0 (0 = torch's default)")
    need(
        set(cfg.data.operators) <= set("+-") and cfg.data.operators != "",
        "data.operators must be a non-empty string of + and -",
    )
    need(
        1 <= cfg.data.min_terms <= cfg.data.max_terms,
        "data.min_terms must be >= 1 and <= data.max_terms",
    )
    if errors:
        raise ValueError("invalid config:\n  " + "\n  ".join(errors))


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------- resume

# Fields a resume may change without changing the trajectory it continues: where things are
# written, how often, how long the run goes on, and how verifier processes are run.
RESUME_SAFE_FIELDS = frozenset(
    {
        "run.out_dir",
        "run.name",
        "run.threads",
        "run.tensorboard",
        "run.progress",
        "run.wandb",
        "run.wandb_project",
        "model.cache_dir",
        "train.steps",
        "train.save_every",
        "train.keep_checkpoints",
        "train.max_consecutive_skips",
        "eval.every",
        "reward.workers",
        "reward.timeout_s",
        "reward.memory_mb",
    }
)


def run_changing_differences(saved: Config, new: Config) -> list[str]:
    """``section.field: saved -> new`` for every difference that would change the run."""
    out = []
    a, b = saved.to_dict(), new.to_dict()
    for section, fields in a.items():
        for name, old in fields.items():
            key = f"{section}.{name}"
            if key not in RESUME_SAFE_FIELDS and b[section][name] != old:
                out.append(f"{key}: {old!r} -> {b[section][name]!r}")
    return out
