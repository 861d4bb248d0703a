"""What a run trains and where: the model, the embedded demo model, the data, the verifier
and the run's own settings (directory, threads, logging)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dapo.config.yaml_files import clipped_repr
from dapo.reward import custom, tasks

MAX_NAME_BYTES = 255 - len(".") - len(".replaced-12345678")
"""The longest ``run.name``, in bytes: file systems take directory names of 255, and
``--overwrite`` sets the run it replaces aside as ``.NAME.replaced-12345678``
(:mod:`dapo.run.asides`)."""

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every Linear layer of a Qwen2/Qwen3/Llama/Mistral decoder layer: attention and MLP."""


MAX_TIMEOUT_S = 86400.0  # a day: a deadline 292 years on overflowed the clock
MAX_MEMORY_MB = 1 << 24  # 16 TiB: RLIMIT_AS, in bytes, fits 63 bits


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, through peft) trained in place of every weight: the base
    model is frozen (no gradient, no optimizer state), checkpoints hold the adapters only."""

    rank: int = 0
    """The adapters' rank r; 0 (the default) trains every weight (full fine-tuning). Small
    ranks suffice for policy-gradient RL, which learns few bits per episode (Thinking
    Machines, "LoRA Without Regret", 2025: rank 1 to 32 matched full fine-tuning on math
    RL)."""
    alpha: float = 32.0
    """Scale: the adapter's product is multiplied by alpha / rank. With alpha fixed, the
    best learning rate hardly depends on the rank: set ``optim.lr`` to about 10x what full
    fine-tuning uses (the same report's finding for LoRA on every layer, RL included)."""
    dropout: float = 0.0
    """Dropout on the adapters' input. 0: with dropout the policy's own forward is random,
    so the importance ratio of an unchanged policy is not 1 (the first mini-batch's)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Names of the Linear layers that get adapters (the last part of a module's name):
    by default every one of the attention and the MLP, as the report recommends."""
    merged_sampling: bool = True
    """The dapo engine's eager loop (on a CPU) and the hf engine sample from a copy of the
    policy with the adapters merged into its weights (``W + (alpha / rank) B A``, float32),
    made at each generation call and dropped after it, rather than through the adapters: one
    matrix product per layer instead of three; on SmolLM2-135M on a CPU, 1.17x the tokens/s
    with the dapo engine and 1.23x with hf, the copy's 0.2-0.3 s included
    (docs/guides/lora.md), for the adapted layers' weights held once more while it
    generates. Only over float32 weights (a bfloat16 merge would round the adapters' small
    updates away); the CUDA-graph path merges into the copy it makes anyway and vllm serves
    the adapters, whatever this says. false: sample through the adapters, no copy."""

    def check(self) -> list[str]:
        errors = []
        if self.rank < 0:
            errors.append(f"model.lora.rank must be >= 0 (0 = off), got {self.rank}")
        if not self.alpha > 0:
            errors.append(f"model.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            errors.append(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if self.rank and not self.target_modules:
            errors.append("model.lora.target_modules is empty: name the layers to adapt")
        return errors


@dataclass
class ModelConfig:
    path: str = "embedded"
    """A local Hugging Face model directory, a Hugging Face Hub model id
    (``Qwen/Qwen2.5-Math-1.5B``: read from the Hub cache, ``HF_HOME``, and downloaded there
    first unless ``HF_HUB_OFFLINE=1``; safetensors weights only), or ``embedded`` for the
    built-in tiny Qwen2."""
    revision: str | None = None
    """With a Hub model id in ``model.path``: the branch, tag or commit to use (None: main).
    A commit pins the weights a run starts from."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The trained weights and the optimizer state. float32 (the default, as the reference
    keeps them): at lr 1e-6 an AdamW step of a bf16 weight rounds away (one update on a tiny
    Qwen2 changed 2.6% of bf16 weights, every float32 one; tests/test_precision.py).
    float16 is refused unless ``model.lora.rank`` > 0 (the adapters stay float32): AdamW's
    state underflows in float16 and the first update makes the weights NaN; for float16
    compute set ``model.param_dtype=float32 model.compute_dtype=float16``."""
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Forward and backward run under autocast in this dtype (bfloat16 on a GPU, as the GPU
    recipes set), and frozen copies (the GRPO reference) are held in it; float16 adds a loss
    scaler."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters in place of full fine-tuning (``model.lora.rank`` > 0)."""

    def check(self) -> list[str]:
        errors = self.lora.check()
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            errors.append(f"model.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        return errors


@dataclass
class EmbeddedConfig:
    """The built-in tiny Qwen2 policy (``model.path=embedded``), warm-started on the arith task."""

    cache_dir: str = "~/.cache/dapo"
    """Where its warm-started weights are cached (rebuilt if absent)."""
    sft_steps: int = 400
    """Supervised warm-start steps (RL needs a policy that is sometimes right)."""
    hidden: int = 128
    """Hidden size: a multiple of 8 (4 attention heads, each of an even size)."""
    layers: int = 2
    """Decoder layers."""

    def check(self) -> list[str]:
        errors = []
        if self.sft_steps < 1:
            errors.append(f"embedded.sft_steps must be >= 1, got {self.sft_steps}")
        if not (self.hidden >= 8 and self.hidden % 8 == 0):
            errors.append(f"embedded.hidden must be a multiple of 8 (>= 8), got {self.hidden}")
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
    and an answer column) or ``auto`` (dapo when the file has ``prompt`` and ``reward_model``,
    or ``prompt`` without the question column; flat otherwise)."""
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
    on_long_prompt: Literal["error", "skip"] = "error"
    """A train prompt that with ``rollout.max_new_tokens`` overruns the model's context:
    ``error`` refuses the run, naming its file and row; ``skip`` drops it before training and
    counts it (verl's ``data.filter_overlong_prompts``). Val prompts are never dropped."""
    apply_chat_template: bool = True
    """Render chat messages with the tokenizer's chat template when it has one (else raw)."""
    system_prompt: str | None = None
    """A system message put before every problem that has none; None = none (a chat template
    may then add its own: Qwen2.5-Math's asks for \\boxed{}, against the DAPO prompt's
    ``Answer:`` line, and "" replaces it with an empty one)."""

    def check(self) -> list[str]:
        errors = []
        if self.task != "arith":
            errors.append(f"data.task must be 'arith' (the embedded task), got {self.task!r}")
        if bool(self.train_file) != bool(self.val_file):
            errors.append(
                "data.train_file and data.val_file go together: give both (e.g. DAPO-Math-17k "
                "and AIME 2024), or neither for the embedded task"
            )
        # One column read as two fields would make every question its own answer (and
        # `dapo data convert --to flat` would overwrite the questions).
        if len({self.question_key, self.answer_key, "data_source"}) < 3:
            errors.append(
                f"data.question_key ({self.question_key!r}), data.answer_key "
                f"({self.answer_key!r}) and 'data_source' must be three different columns"
            )
        return errors


@dataclass
class RewardConfig:
    workers: int = 1
    """Verifier processes. A response that makes the verifier raise, hang or exhaust memory is
    graded incorrect and counted; 0 grades in-process, where a hang cannot be stopped."""
    timeout_s: float = 10.0
    """Seconds one response may take to grade before its worker is killed."""
    memory_mb: int = 2048
    """Memory each verifier process may map beyond what it maps at start (an address-space
    limit), MiB; 0 = no limit."""
    batch_timeout_s: float = 600.0
    """Seconds one step's grading may take in all: a verifier that hangs on every response
    costs at most this, not responses x timeout_s; what is not graded by then counts as a
    fault (graded incorrect). 0 = no limit. Raise it, or reward.workers, for many slow
    responses (math_verify on sets: about 50 ms each)."""
    mode: str = ""
    """Verifier for every row, a task name (``dapo``: the paper's, verl 0.4.1's;
    ``math_dapo_boxed``: verl 0.9.1's, with a \\boxed{} fallback; ``lenient``;
    ``math_verify``: see dapo.reward.tasks); empty = chosen by each row's ``data_source``
    (``math_dapo`` -> dapo)."""
    function: str = ""
    """A reward function of your own for every row, in place of the verifiers:
    ``PATH.py:NAME`` or ``package.module:NAME``, called as NAME(response, ground_truth) in the
    reward workers (same limits) and returning a float (correct when > 0), a bool, a Score or
    a dict with ``score`` (and optionally ``correct``, ``pred``, ``vote``). Empty = the
    verifiers (reward.mode, data_source)."""
    function_sha256: str = ""
    """Set by dapo when the run starts: the SHA-256 of reward.function's file, so that a resume
    can warn when the file changed since. Leave it empty."""
    max_abs: float = 1e6
    """The largest |score| a verifier or reward.function may return: beyond it the response is
    graded incorrect and counted as a fault (reward/faults), naming the row. One score of 1e200
    would zero its group's advantages, two of 1e308 make them NaN."""

    @property
    def grader(self) -> str:
        """What grades every row (reward.function, else reward.mode); empty: each row's
        data_source picks its verifier."""
        return self.function or self.mode

    def check(self) -> list[str]:
        errors = []
        if self.workers < 0:
            errors.append("reward.workers must be >= 0 (0 = grade in-process)")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            errors.append(f"reward.timeout_s must be in (0, {MAX_TIMEOUT_S}] seconds")
        if not 0 <= self.memory_mb <= MAX_MEMORY_MB:
            errors.append(f"reward.memory_mb must be in [0, {MAX_MEMORY_MB}] (0 = no limit)")
        if not 0 <= self.batch_timeout_s <= MAX_TIMEOUT_S:
            errors.append(
                f"reward.batch_timeout_s must be in [0, {MAX_TIMEOUT_S}] seconds (0 = no limit)"
            )
        if not 0 < self.max_abs < float("inf"):
            errors.append("reward.max_abs must be a positive number (the largest |score|)")
        if self.mode not in ("", *tasks.names()):
            errors.append(
                f"reward.mode must be empty (by data_source) or one of {tasks.names()}, "
                f"got {self.mode!r}"
            )
        if self.function:
            if self.mode:
                errors.append(
                    "reward.function replaces every row's verifier and reward.mode picks one: "
                    "give one of them"
                )
            try:
                custom.split_spec(self.function)
            except ValueError as exc:
                errors.append(str(exc))
        return errors


@dataclass
class DistConfig:
    """Data-parallel training under ``torchrun`` (world size > 1): FSDP2 shards the policy (and
    the GRPO reference) per decoder layer; one process runs without it (activation
    checkpointing aside)."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them:
    activation memory of about one layer per micro-batch, for one more forward pass. In one
    process too. The shared-prompt forward stays on: a recomputed layer reuses the prompt
    pass's keys and values."""
    cpu_offload: bool = False
    """Keep the sharded float32 weights, gradients and optimizer state in CPU memory (FSDP2's
    CPUOffloadPolicy; the optimizer step then runs on the CPU): for a model whose states do not
    fit on the GPUs, at the cost of host-device copies every step."""
    grad_sync: Literal["minibatch", "microbatch"] = "minibatch"
    """When the ranks' gradients are summed and sharded (FSDP2's reduce-scatter): once per
    mini-batch, after its last micro-batch (each rank accumulates an unsharded float32
    gradient of the whole model in between: fastest, and one full gradient of memory), or
    after every micro-batch (memory stays sharded, one reduce-scatter of every gradient per
    micro-batch: for a model whose full gradient does not fit, 32B). The same update either
    way, up to float summation order."""
    reshard_after_forward: bool = True
    """Free each decoder layer's gathered weights after its forward and gather them again for
    its backward (FSDP2's default: memory holds about two layers' weights). False keeps every
    layer gathered from its forward to its backward: fewer all-gathers (a shared prompt's two
    passes and the backward reuse one), for the whole model's weights in the compute dtype on
    every rank during a micro-batch; for a model small beside its GPUs."""
    timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks before the run stops with an error
    (a rank that died or hangs stops the job instead of leaving the others waiting)."""
    rollout_ranks: int = 0
    """R: under torchrun, the last R ranks only generate and the others only train (FSDP over
    the trainer ranks): generation overlaps training, with ``train.async_staleness`` = k
    bounding how old the generating weights are (0: the two roles take turns). Weights go from
    the trainers to the generators after each update, in buckets. 0 = every rank generates and
    trains (``dapo/training/generator_ranks.py``)."""
    wait_timeout_s: float = 7200.0
    """Seconds the other ranks wait while rank 0 alone builds, loads or saves the whole model
    (a 32B model takes longer than timeout_s to load or write), or while one rank still
    generates after the others (its longest response, up to L_max)."""

    def check(self) -> list[str]:
        errors = []
        if not self.timeout_s > 0:
            errors.append(f"dist.timeout_s must be > 0, got {self.timeout_s}")
        if self.rollout_ranks < 0:
            errors.append(
                f"dist.rollout_ranks must be >= 0 (0 = every rank generates and trains), got "
                f"{self.rollout_ranks}"
            )
        if not self.wait_timeout_s > 0:
            errors.append(f"dist.wait_timeout_s must be > 0, got {self.wait_timeout_s}")
        return errors


@dataclass
class VLLMConfig:
    """The vLLM rollout engine (``rollout.engine=vllm``): one engine in each training process,
    beside the policy (colocated), loaded with the new weights after every update."""

    gpu_memory_utilization: float = 0.5
    """GPU: the fraction of the GPU's memory vLLM may hold (its weights and KV cache); the
    trainer needs the rest. Unused on a CPU, where ``kv_cache_gib`` sizes the cache."""
    kv_cache_gib: float = 0.0
    """KV-cache size in GiB; 0 = on a GPU what ``gpu_memory_utilization`` leaves, on a CPU
    1 GiB."""
    max_num_seqs: int = 256
    """Responses decoded at once (vLLM's continuous batch); more waits in the queue."""
    enforce_eager: bool = False
    """GPU: no CUDA graphs (faster start, slower decoding). A CPU engine always runs eager."""
    sleep: bool = True
    """GPU: release the KV cache and the engine's weights while the trainer updates (vLLM's
    sleep mode), and take them back before the next rollout: level 2 (the weights dropped,
    reloaded from the trainer's module) for a whole model, level 1 (the weights kept in host
    memory) when the policy is FSDP-sharded under torchrun or has LoRA adapters (the frozen
    base stays loaded, and each sync moves the adapters alone). vLLM has no sleep mode on a
    CPU: there this does nothing."""

    def check(self) -> list[str]:
        errors = []
        if not 0 < self.gpu_memory_utilization <= 1:
            errors.append(
                f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_gib < 0:
            errors.append(f"vllm.kv_cache_gib must be >= 0 (0 = auto), got {self.kv_cache_gib}")
        if self.max_num_seqs < 1:
            errors.append(f"vllm.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        return errors


@dataclass
class RunConfig:
    out_dir: str = "runs"
    """Run directories are created under this one."""
    name: str = ""
    """Run directory name, one plain directory name under out_dir (no ``/``, not ``.`` or
    ``..``); empty = <preset>-<timestamp>."""
    preset: str = "dapo"
    """Algorithm preset applied before the YAML file and overrides: dapo, grpo, or one of
    DAPO's successors, dr_grpo, gspo and cispo (`dapo/config/presets.py`). A preset's values
    are set once, then the file and the overrides change what they name: grpo's symmetric
    clip is eps_high = eps_low as it applies, so with it ``algo.eps_low=0.1`` alone clips to
    [0.9, 1.2]; give ``algo.eps_high=0.1`` too."""
    base: str = "paper"
    """Scale the config started from: paper or demo."""
    threads: int = 0
    """torch CPU threads; 0 = auto: torch's default (one per core) on a quiet machine, fewer
    while other processes (the reward workers too) keep cores busy, re-checked before each
    step and evaluation batch (``dapo/run/threads.py``). ``1`` repeats a CPU run bit for bit;
    under auto the count, and so the rounding, follows the machine's load."""
    deterministic: bool = False
    """Deterministic kernels (``torch.use_deterministic_algorithms``, a fixed cuBLAS
    workspace; ``dapo/run/determinism.py``): what makes a GPU run repeat itself bit for bit,
    and a run resumed after kill -9 equal the uninterrupted one on a GPU as it is on a CPU at
    a fixed ``run.threads``. Off by default: CUDA's faster kernels differ by rounding from
    run to run."""
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
        # run.preset and run.base name presets: dapo.config.validation.validate checks them.
        if self.threads < 0:
            errors.append("run.threads must be >= 0 (0 = torch's default)")
        if self.name in (".", "..") or "/" in self.name or "\\" in self.name:
            errors.append(
                f"run.name must be one plain directory name (no '/', not '.' or '..'), got "
                f"{clipped_repr(self.name)}; put the parent directories in run.out_dir"
            )
        if "\0" in self.name:  # no file system takes one; open() said "embedded null byte"
            errors.append(f"run.name must not hold a NUL character, got {clipped_repr(self.name)}")
        size = len(self.name.encode("utf-8", "surrogatepass"))
        if size > MAX_NAME_BYTES:  # mkdir's "File name too long" came after the config loaded
            errors.append(
                f"run.name must be at most {MAX_NAME_BYTES} bytes in UTF-8 (a file system takes "
                f"255, and --overwrite adds 19), got {size}: {clipped_repr(self.name)}"
            )
        return errors
