"""How a run trains: rollout, the algorithm, dynamic sampling, updates, optimiser, evaluation.

Every default is the paper's (Qwen2.5-32B, spec table). A field whose values are a fixed set
declares them in its type (``Literal``); each section checks its own values (``check``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

MIN_TEMPERATURE = 1e-5
"""The lowest sampling temperature: logits divided by less overflow to inf (1e-300: NaN
probabilities mid-run); vLLM treats temperatures below this as greedy."""


def temperature_error(where: str, value: float) -> str:
    return f"{where} must be a finite number >= {MIN_TEMPERATURE:g}, got {value}"


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
    The stop tokens are masked for the draw only: the native and hf engines still record the
    policy's own log-probs (with the stop tokens' mass)."""
    rows_per_generate: int = 0
    """Responses generated at once (0 = a whole round): bounds generation memory, as a round
    runs in calls of floor(this / G) whole groups (one below G), each seeded from the round's
    seed."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response besides the tokenizer's EOS and the model's
    generation_config.eos_token_id (instruct models list several, e.g. Qwen2.5's <|im_end|>
    and <|endoftext|>)."""
    engine: Literal["dapo", "hf", "vllm"] = "dapo"
    """dapo (one prefill per prompt, finished rows leave the batch), hf (transformers
    generate, for a model whose KV cache cannot be repeated or sliced by row) or vllm (an
    inference engine: the ``vllm`` section and the ``[vllm]`` extra; its log-probs are not
    the trainer's, see ``algo.rollout_correction``)."""
    cuda_graphs: bool = True
    """On CUDA, the dapo engine decodes on static buffers with each step replayed as a CUDA
    graph and the host reading which rows run every 16 steps, not at every token
    (``dapo.rollout.static_decode``; Llama, Qwen2 and Qwen3 decoders, else the eager loop).
    false: the eager loop everywhere. The same tokens to rounding; on a CPU, always eager."""
    compile_step: bool = True
    """On the CUDA-graph path, the decoding step's layer and its draw compiled by
    ``torch.compile`` (inductor's Triton kernels): the norms, residual adds, rotary embedding,
    cache writes and sampling arithmetic between the matmuls fuse into a few kernels instead
    of ~40 a layer. A process's first rollout pays the compilation (see
    docs/guides/gpus.md); a compiler error falls back to the uncompiled step with a warning.
    The same tokens to rounding (the fused sums run in another order)."""
    tp_size: int = 1
    """Under torchrun: ranks that generate together, tensor parallel, k at a time (one engine
    per group of k consecutive ranks, each holding 1/k of every split weight and of the KV
    cache) instead of a whole copy of the model on every rank. Must divide the world size and
    the model's attention and key-value heads. The native engine (PyTorch tensor parallelism)
    or vllm (its ``tensor_parallel_size``, one engine per group through vLLM's external
    launcher). 1 = every rank its own whole copy."""

    def check(self) -> list[str]:
        errors = []
        if self.tp_size < 1:
            errors.append(
                f"rollout.tp_size must be >= 1 (1 = no tensor parallelism), got {self.tp_size}"
            )
        if self.group_size < 2:
            errors.append(
                "rollout.group_size must be >= 2 (advantages compare within a group), "
                f"got {self.group_size}"
            )
        if self.max_new_tokens < 1:
            errors.append("rollout.max_new_tokens must be >= 1")
        if not MIN_TEMPERATURE <= self.temperature < math.inf:
            errors.append(temperature_error("rollout.temperature", self.temperature))
        if not 0 < self.top_p <= 1:
            errors.append("rollout.top_p must be in (0, 1]")
        if self.rows_per_generate < 0:
            errors.append("rollout.rows_per_generate must be >= 0 (0 = a whole round)")
        if any(i < 0 for i in self.stop_token_ids):
            errors.append(
                f"rollout.stop_token_ids must be token ids >= 0, got {self.stop_token_ids}"
            )
        return errors


@dataclass
class AlgoConfig:
    eps_low: float = 0.2
    """Lower clip range epsilon_low (paper: 0.2)."""
    eps_high: float = 0.28
    """Upper clip range epsilon_high; Clip-Higher when above eps_low (paper: 0.28)."""
    clip_ratio_c: float = 0.0
    """Dual-clip bound c: a token with a negative advantage loses at most -c A (0 = off, the
    paper's text; the reference's DAPO recipes set 10)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """token-mean (DAPO token-level loss), seq-mean-token-mean (GRPO sample-level loss) or
    seq-mean-token-sum-norm (Dr. GRPO: each response's sum over rollout.max_new_tokens)."""
    adv_norm: Literal["group", "batch", "none"] = "group"
    """The advantage's divisor: its group's reward std (GRPO, DAPO), the whole batch's, or
    none (Dr. GRPO)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """The importance ratio per token (DAPO) or per response, length-normalised (GSPO)."""
    loss_fn: Literal["clip", "cispo"] = "clip"
    """The clipped surrogate (DAPO) or CISPO's clipped stop-gradient weight on log pi (its
    eps_low = 1 sets no lower bound)."""
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
    rollout_correction: Literal["auto", "none", "token_tis", "seq_tis", "token_mis", "seq_mis"] = (
        "auto"
    )
    """Weigh each token's loss by pi_old / pi_rollout, truncated (tis) or masked (mis) per token
    or per sequence (``dapo/algo/correction.py``), for an engine whose log-probs are not the
    trainer's. auto: token_tis for such an engine (vllm), none for an exact one (dapo, hf)."""
    rollout_correction_threshold: float = 2.0
    """C: tis caps the weight at C; mis keeps a token or sequence whose ratio is within
    [1/C, C] (TIS's paper: 2)."""

    def check(self) -> list[str]:
        errors = []
        if self.eps_low < 0:
            errors.append(f"algo.eps_low must be >= 0, got {self.eps_low}")
        if self.eps_high < self.eps_low and self.loss_fn == "clip":
            errors.append(f"algo.eps_high must be >= algo.eps_low, got {self.eps_high}")
        if self.clip_ratio_c != 0 and not self.clip_ratio_c > 1:
            errors.append(f"algo.clip_ratio_c must be 0 (off) or > 1, got {self.clip_ratio_c}")
        if self.clip_ratio_c and self.loss_fn == "cispo":
            errors.append("algo.clip_ratio_c (dual-clip) does not apply to algo.loss_fn=cispo")
        if self.kl_coef < 0:
            errors.append(f"algo.kl_coef must be >= 0, got {self.kl_coef}")
        if self.overlong_factor < 0:
            errors.append("algo.overlong_factor must be >= 0")
        if self.adv_eps < 0:
            errors.append(f"algo.adv_eps must be >= 0, got {self.adv_eps}")
        if not self.rollout_correction_threshold > 1:
            errors.append(
                "algo.rollout_correction_threshold must be > 1, got "
                f"{self.rollout_correction_threshold}"
            )
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
    round's size until a mixed share (see oversample) has been measured."""
    oversample: bool = True
    """Size each round as (groups still needed) / (mixed share measured last step and this
    one), at most 4 x prompts_per_step, so that one round usually suffices. The mixed share
    is the share of drawn groups neither all correct nor all wrong: sampling/groups_mixed /
    sampling/prompts_drawn, not sampling/kept_frac (kept / drawn, at most N / drawn)."""

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
    max_gen_tokens: int = 0
    """Also stop after the step at which the tokens generated for training (every response
    sampled, kept or not) reach this many: a budget of equal generation (0 = none)."""
    max_seconds: float = 0.0
    """Also stop after the step at which the training steps' time (evaluations and
    checkpoints not counted) reaches this many seconds (0 = none)."""
    prompts_per_step: int = 512
    """N, prompts (groups) trained on per step (paper: 512)."""
    responses_per_minibatch: int = 512
    """Responses per gradient update (paper: 512, so 16 updates per step at G=16)."""
    tokens_per_microbatch: int = 16384
    """Tokens per forward/backward, padding included (real tokens alone with
    ``train.packing``); only memory, never the gradient, depends on it."""
    epochs: int = 1
    """mu, passes over each step's responses."""
    recompute_old_logprobs: bool = True
    """Recompute pi_old log-probs with a forward pass. False reuses the sampler's, after
    checking on the first step that they match a forward pass (float32: they do), where the
    sampler is the policy itself (not vllm, not ``train.async_staleness`` > 0)."""
    share_prompts: bool = True
    """Forward passes run each distinct prompt of a micro-batch once for all its responses."""
    packing: bool = False
    """Lay a micro-batch's rows end to end, with no padding, attention kept within each row
    (``dapo/models/packing.py``): the same log-probs, loss and gradient as padded, to float
    rounding. A group's prompt runs once for all its rows, whatever ``share_prompts`` says.
    Needs the model's SDPA attention (the default). The SmolLM2 and GPU recipes turn it on
    (SmolLM2-135M on a CPU: 42% less training time; one H200, a realistic length mix of the
    Qwen2.5-1.5B shape: 14% less a step; docs/guides/speed.md)."""
    compile: bool = False
    """Compile each decoder layer of the policy with ``torch.compile`` (inductor) for the
    passes that train and score (``dapo/models/compiled_layers.py``): the forwards without a
    KV cache, i.e. packed micro-batches, or padded ones with no shared prompt. Same values as
    eager to float rounding; the first step pays the compile (SmolLM2-135M on a 2-core CPU:
    about 25 s, then 2-6% less training time and 0.4 GiB less peak; one H200, the packed
    Qwen2.5-1.5B shape: 20% less, 9 GiB less peak; docs/guides/speed.md). Off by default
    (the demo and short CPU runs gain nothing); the 1.5B and larger GPU recipes turn it on."""
    seed: int = 0
    """Seed of prompt order, sampling and initialisation."""
    async_staleness: int = 0
    """k: generate the rollouts of later steps while this one trains, from weights at most k
    steps old, not updates: a step makes epochs x mini-batches updates (``train/updates``).
    Step t, counted from 0, samples from the policy after step max(0, t - k); pi_old is
    recomputed and ``algo.rollout_correction`` (auto: token_tis) weighs the older sampler.
    0 = generation and training take turns (the paper's loop). One process, native engine
    (``dapo/training/generator_thread.py``)."""
    save_every: int = 20
    """Checkpoint every this many steps, and always after the last; 0 = only after the last."""
    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep; older ones are deleted once a newer is safe
    (one holding a file dapo did not write is kept, with a warning naming it)."""
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
        if self.max_gen_tokens < 0:
            errors.append("train.max_gen_tokens must be >= 0 (0 = no limit)")
        if not self.max_seconds >= 0:
            errors.append("train.max_seconds must be >= 0 (0 = no limit)")
        if self.async_staleness < 0:
            errors.append(
                f"train.async_staleness must be >= 0 (0 = generation and training take "
                f"turns), got {self.async_staleness}"
            )
        if not 0 <= self.seed < 2**63:  # torch's generators take no more
            errors.append(f"train.seed must be an integer in [0, 2**63), got {self.seed}")
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
    """AdamW's first-moment decay (torch's default; the paper does not say)."""
    beta2: float = 0.999
    """AdamW's second-moment decay (torch's default; the paper does not say)."""
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
        if not MIN_TEMPERATURE <= self.temperature < math.inf:
            errors.append(temperature_error("eval.temperature", self.temperature))
        if self.max_new_tokens < 0:
            errors.append("eval.max_new_tokens must be >= 0 (0 = rollout.max_new_tokens)")
        return errors
