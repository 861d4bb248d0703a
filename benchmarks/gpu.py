"""Measure a GPU: a bf16 training step, decoding, the chunked head, a one-rank FSDP step.

    python benchmarks/gpu.py                       # on CUDA: Qwen2.5-0.5B and 1.5B shapes
    python benchmarks/gpu.py --shapes qwen2.5-0.5b --steps 10 --json
    python benchmarks/gpu.py --tiny --json         # any machine: the same code, tiny sizes
    python benchmarks/gpu.py --shapes qwen2.5-1.5b --sections mix --steps 3 --profile
    python benchmarks/gpu.py --shapes qwen2.5-1.5b qwen2.5-0.5b --sections mix --compile

Random weights of the shapes in ``dapo.training.gpu_memory.KNOWN_SHAPES`` (a transformers
``Qwen2Config`` with their fields; nothing is downloaded). Without CUDA, or with ``--tiny``,
the same code runs a tiny Qwen2 (hidden 64, 2 layers, vocabulary 512) in seconds, so CI keeps
it working (``tests/test_gpu_bench.py``). Per shape:

1. **matmul peak** (once): the best of a few timed batches of square matmuls in the compute
   dtype (bf16 on CUDA, float32 on a CPU): the denominator of MFU.
2. **train**: ``dapo.training.update.minibatch_update`` (the DAPO loss over the micro-batches,
   backward, gradient clipping, AdamW) on a fixed synthetic mini-batch: float32 master weights
   under bf16 autocast on CUDA (float32 on a CPU), every row a distinct prompt (nothing shared)
   and a response of the same length; pi_old comes from one untimed forward pass plus noise
   (so that ratios differ from 1). One untimed step, then ``--steps`` timed ones (median).
   tokens/s counts prompt and response tokens. MFU = model FLOPs per step / step time / peak,
   model FLOPs = 6 N_layers S + 6 V H R + 6 L q S_row^2 summed over rows: the decoder layers'
   weights over every position S, the output head (V x H) over the R response positions it
   runs on, and causal attention (q = heads x head_dim); no recompute counted. Peak memory is
   ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``: the allocator's cache
   and fragmentation too) over the timed steps, beside the memory plan's training
   peak for the same settings (``settings_from_config``, ``plan_memory``); null on a CPU.
   **mix**: the same step on a realistic length mix (``benchmarks/length_mix.py``: 32 rows,
   prompts from DAPO-Math-17k's lengths, long-tailed responses up to 2,048 tokens), padded
   then packed (``train.packing``, with the packed attention path it took): positions computed
   per real token and MFU on the real tokens alone; with ``--compile``, both again with
   compiled decoder layers (``train.compile``); with ``--bf16-weights``, the packed step
   again on the model cast to bf16 without autocast (a speed figure only: AdamW on bf16
   weights loses the paper's small updates; what a bf16 residual stream over float32 master
   weights would approach).
3. **decode**: the native engine (``make_engine("dapo", ...)``) drawing 64 and 256 rows (4
   and 16 prompts x 16) of 1,024 new tokens, EOS ignored; tokens/s after an untimed warm-up
   (the same rollout, once). The prompts
   come from the demo tokenizer (a small vocabulary: the model's 152k-row head still runs).
   With ``--profile``, each row count's graph path once more for 128 tokens under the
   profiler (``benchmarks/step_profile.py``), its step compiled but launched without graphs
   (the kernels the graphs replay, with their device times): kernel time per step by kind,
   kernels per step, the top 12. With ``--variants`` (CUDA), two more runs at 64 rows:
   attention widths in steps of 128, and the step compiled in inductor's
   ``max-autotune-no-cudagraphs`` mode.
4. **head**: the log-prob pass, forward and backward, over 16,384 response positions at the
   shape's hidden size and vocabulary: ``token_logprobs_from_hidden`` (chunked) against the
   full logits and ``token_logprobs_from_logits``; peak memory above the inputs (on CUDA the
   allocator's; on a Linux CPU the rise of the resident high-water mark, reset through
   ``/proc/self/clear_refs``), and the largest log-prob gap between the two.
5. **fsdp**: a process group of one rank (NCCL for CUDA, gloo on a CPU), the model sharded by
   ``dapo.dist.fsdp`` through ``build_state``, two steps on the same mini-batch; the first
   step's loss and gradient norm beside the one-process step's from the same weights.

``--json`` makes the last line of stdout one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import length_mix
import step_profile
import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo import dist
from dapo.algo import token_logprobs_from_hidden, token_logprobs_from_logits
from dapo.config import Config, load_config
from dapo.data.batch import Episode
from dapo.data.problems import Problem
from dapo.dist import fsdp
from dapo.models.demo import build_tokenizer
from dapo.models.packing import PACKED_ATTENTION, varlen_dtype
from dapo.models.policy import DTYPES, compute_device
from dapo.rollout import make_engine
from dapo.rollout.base import encode_prompts
from dapo.rollout.native import COMPILE_BACKEND
from dapo.rollout.static_decode import static_decode
from dapo.training.gpu_memory import (
    DTYPE_BYTES,
    PlanSettings,
    decode_workspace_bytes,
    kv_cache_bytes,
    output_head_bytes,
    plan_memory,
    settings_from_config,
    transformers_copies_gqa,
)
from dapo.training.model_shape import KNOWN_SHAPES, ModelShape
from dapo.training.old_logprobs import fill_logprobs
from dapo.training.state import TrainState, build_state
from dapo.training.update import minibatch_update

MIB = 2**20
DEFAULT_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
SECTIONS = ("train", "mix", "decode", "head", "fsdp")
HOST = torch.device("cpu")
"""Episodes live in host memory, as in a run: collate moves each micro-batch to the device."""
TINY_FIELDS: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class Sizes:
    """How much work each section does."""

    rows: int  # responses of the training mini-batch
    prompt: int  # tokens of each training prompt
    response: int  # tokens of each training response
    microbatch_tokens: int  # train.tokens_per_microbatch
    decode_prompt_counts: tuple[int, ...]  # prompts of each timed decoding run
    decode_group: int  # responses per decoding prompt
    decode_prompt: int  # tokens of each decoding prompt
    decode_new: int  # new tokens per decoded row
    eager_new: int  # new tokens per row of the eager loop's run (CUDA only)
    head_tokens: int
    head_chunk: int | None  # positions per chunk of the head; None: the project's default
    matmul_n: int
    mix_rows: int  # responses of the length-mix mini-batch (each its own prompt)
    mix_prompt: float  # the length mix's mean prompt (benchmarks/length_mix.py)
    mix_l_max: int  # the length mix's L_max
    profile_new: int  # new tokens per row of a profiled decoding call (--profile)


REAL = Sizes(
    16, 256, 768, 8192, (4, 16), 16, 256, 1024, 128, 16384, None, 8192, 32, 134.2, 2048, 128
)
# The tiny head keeps 16k positions but a chunk of 512 (1/32 of them, as the default's 441
# positions are of 16k at a 152k vocabulary): the default would be one chunk at V = 512.
TINY = Sizes(4, 16, 48, 128, (2, 8), 4, 16, 32, 32, 16384, 512, 512, 8, 16.0, 48, 8)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _proc_status(field: str) -> int | None:
    """A ``/proc/self/status`` memory field in bytes, or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak(device: torch.device) -> int | None:
    """Start a peak-memory window; the bytes in use now (None where it cannot be measured)."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:  # "5" resets the resident high-water mark to the current resident size (Linux)
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status("VmRSS")


def read_peak(device: torch.device) -> int | None:
    """The peak bytes of the window :func:`reset_peak` started."""
    sync(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status("VmHWM")


def read_reserved_peak(device: torch.device) -> int | None:
    """The most bytes the caching allocator reserved in the window (allocated plus what it
    keeps cached and fragmented: what the card must really hold); None off CUDA."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


def mib(n: float | None) -> float | None:
    return None if n is None else round(n / MIB, 1)


def best_seconds(device: torch.device, work: Callable[[], Any], batches: int, reps: int) -> float:
    """Seconds of one ``work()``: the best of ``batches`` timed batches of ``reps`` calls,
    after one untimed call (which picks and loads its kernels)."""
    work()
    best = float("inf")
    for _ in range(batches):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            work()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def matmul_peak(
    device: torch.device, dtype: torch.dtype, n: int, *, batches: int = 3, reps: int = 10
) -> dict:
    """FLOP/s of ``n x n`` matmuls in ``dtype``: the best of ``batches`` timed batches."""
    g = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    best = best_seconds(device, lambda: torch.matmul(a, b, out=out), batches, reps)
    flops = 2 * n**3 / best
    return {"dtype": str(dtype).removeprefix("torch."), "n": n, "tflops": flops / 1e12}


def build_model(fields: dict[str, Any], tokenizer: Any, device: torch.device) -> torch.nn.Module:
    """A Qwen2 of ``fields`` with random float32 weights (seed 0), made on ``device``."""
    config = Qwen2Config(
        **{k: v for k, v in fields.items() if k != "model_type"},
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with device:  # made there: a 1.5B model's init on the CPU and a copy would take minutes
        return Qwen2ForCausalLM(config)


def run_config(sizes: Sizes, compute: str, *extra: str) -> Config:
    """The run settings the training step reads (and the memory plan plans from); ``extra``
    dotted overrides last."""
    return load_config(
        None,
        [
            f"model.compute_dtype={compute}",
            "model.param_dtype=float32",
            "train.recompute_old_logprobs=true",  # required in bf16; the steps never read it
            f"rollout.max_new_tokens={sizes.response}",
            f"algo.l_cache={max(1, sizes.response // 4)}",
            f"train.responses_per_minibatch={sizes.rows}",
            f"train.tokens_per_microbatch={sizes.microbatch_tokens}",
            "optim.lr=1e-6",
            "optim.warmup_steps=0",
            "reward.workers=0",
            *extra,
        ],
    )


def train_state(cfg: Config, model: torch.nn.Module, tok: Any, device: torch.device) -> TrainState:
    """The trainer's state around ``model`` (sharded when a process group is active)."""
    problem = Problem(uid="bench", messages=({"role": "user", "content": "1 + 1"},), answer="2")
    return build_state(cfg, model, tok, [problem], device)


def random_episodes(
    lengths: list[tuple[int, int]], vocab: int, *, seed: int, l_max: int | None = None
) -> list[Episode]:
    """Responses of random tokens of the given (prompt, response) ``lengths``, each after its
    own random prompt (nothing shared, so the FLOPs are those of the formula), advantages
    drawn from N(0, 1); a response of ``l_max`` tokens counts as truncated."""
    g = torch.Generator(HOST).manual_seed(seed)
    out = []
    for p, t in lengths:
        prompt = torch.randint(3, vocab, (p,), generator=g, device=HOST)
        response = torch.randint(3, vocab, (t,), generator=g, device=HOST)
        advantage = float(torch.randn((), generator=g, device=HOST))
        out.append(
            Episode(
                prompt_ids=prompt,
                response_ids=response,
                sampler_logprobs=torch.zeros(t, device=HOST),
                truncated=l_max is not None and t == l_max,
                correct=advantage > 0,
                reward=advantage,
                advantage=advantage,
            )
        )
    return out


def synthetic_episodes(sizes: Sizes, vocab: int) -> list[Episode]:
    """``rows`` random responses of ``response`` tokens after prompts of ``prompt``."""
    lengths = [(sizes.prompt, sizes.response)] * sizes.rows
    return random_episodes(lengths, vocab, seed=1)


def set_old_logprobs(state: TrainState, episodes: list[Episode]) -> None:
    """pi_old: a forward pass of the starting weights, moved by noise of 0.1 so that the
    ratios are not all 1 (where the loss would not depend on the weights) and some clip."""
    fill_logprobs(state.model, episodes, "old_logprobs", state)
    g = torch.Generator(HOST).manual_seed(2)
    for e in episodes:
        e.old_logprobs = e.old_logprobs + 0.1 * torch.randn(e.length, generator=g, device=HOST)


def row_flops(shape: ModelShape, prompt: int, response: int) -> int:
    """Model FLOPs of training one row (forward and backward), as the module docstring says."""
    seq = prompt + response
    dense = 6 * shape.layers * shape.layer_parameters * seq
    head = 6 * shape.vocab * shape.hidden * response
    attention = 6 * shape.layers * shape.heads * shape.head_dim * seq**2
    return dense + head + attention


def model_flops(shape: ModelShape, sizes: Sizes) -> float:
    """Model FLOPs of one training step of the fixed-length mini-batch."""
    return float(sizes.rows * row_flops(shape, sizes.prompt, sizes.response))


def timed_steps(state: TrainState, episodes: list[Episode], steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        sync(state.device)
        t0 = time.perf_counter()
        minibatch_update(state, episodes)
        sync(state.device)
        out.append(time.perf_counter() - t0)
    return out


def measured_updates(state: TrainState, episodes: list[Episode], steps: int):
    """(the first update's metrics, the median seconds of ``steps`` more, CUDA's peak bytes
    over them or None): pi_old set first, the first update untimed (AdamW makes its state)."""
    set_old_logprobs(state, episodes)
    first = minibatch_update(state, episodes)
    reset_peak(state.device)
    seconds = statistics.median(timed_steps(state, episodes, steps))
    peak = read_peak(state.device) if state.device.type == "cuda" else None
    return first, seconds, peak


def train_section(
    shape: ModelShape,
    model: torch.nn.Module,
    tok: Any,
    sizes: Sizes,
    device: torch.device,
    compute: str,
    steps: int,
) -> tuple[dict, list[Episode]]:
    """Figures of the timed steps, and the mini-batch (with pi_old) they trained on."""
    cfg = run_config(sizes, compute)
    state = train_state(cfg, model, tok, device)
    episodes = synthetic_episodes(sizes, shape.vocab)
    first, seconds, peak = measured_updates(state, episodes, steps)
    reserved = read_reserved_peak(device)
    tokens = sizes.rows * (sizes.prompt + sizes.response)
    flops = model_flops(shape, sizes)
    settings = settings_from_config(cfg, world_size=1, prompt_tokens=sizes.prompt)
    plan = plan_memory(shape, settings)
    # The allocator reserves beyond its peak: checked against the plan's reserve (on CUDA).
    on_card = plan_memory(shape, replace(settings, device="cuda"))
    state.optimizer.zero_grad(set_to_none=True)
    del state
    return {
        "rows": sizes.rows,
        "tokens_per_row": sizes.prompt + sizes.response,
        "microbatch_tokens": sizes.microbatch_tokens,
        "steps": steps,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "flops_per_step": flops,
        "tflops": flops / seconds / 1e12,
        "loss_first_step": first["loss"],
        "grad_norm_first_step": first["grad_norm"],
        "peak_mib": mib(peak),
        "reserved_peak_mib": mib(reserved),
        "plan_training_peak_mib": mib(plan.training_peak),
        "plan_reserved_mib": mib(on_card.training_peak - on_card.runtime),
        "plan_activations_mib": mib(plan.activations),
    }, episodes


def mix_episodes(sizes: Sizes, vocab: int) -> list[Episode]:
    """``mix_rows`` random responses of the realistic length mix (:mod:`length_mix`)."""
    lengths = length_mix.draw(sizes.mix_rows, prompt_mean=sizes.mix_prompt, l_max=sizes.mix_l_max)
    return random_episodes(lengths, vocab, seed=4, l_max=sizes.mix_l_max)


def mix_flops(shape: ModelShape, episodes: list[Episode]) -> float:
    """Model FLOPs of a training step over the real tokens alone: each row's at its lengths."""
    return float(sum(row_flops(shape, e.prompt_length, e.length) for e in episodes))


def attention_path(shape: ModelShape, device: torch.device, compute: str) -> str:
    """Which packed attention the training step takes (``dapo.models.packing.varlen_dtype``
    on a query of the shape, under the step's autocast): one variable-length flash call, or
    an SDPA call per response."""
    query = torch.empty(1, shape.heads, 1, shape.head_dim, device=device)
    with torch.autocast(device.type, dtype=DTYPES[compute], enabled=device.type == "cuda"):
        return "varlen" if varlen_dtype(query) is not None else "sdpa per response"


def mix_section(
    shape: ModelShape,
    model: torch.nn.Module,
    tok: Any,
    sizes: Sizes,
    device: torch.device,
    compute: str,
    steps: int,
    peak_tflops: float,
    profile: bool = False,
    compile: bool = False,
    bf16_weights: bool = False,
) -> list[dict]:
    """The training step on the realistic length mix, padded then packed (``train.packing``):
    positions computed per real token, and MFU counted on the real tokens alone; with
    ``compile``, both again with compiled decoder layers (``train.compile``: the first step,
    untimed, compiles); with ``bf16_weights``, the packed step(s) again on the model cast to
    bf16 (no autocast: the residual stream, norms and AdamW in bf16, a speed figure only:
    what a bf16 residual stream over float32 master weights would approach; the model is cast
    back to float32 after); with ``profile``, one more step of each under the profiler
    (:mod:`step_profile`). A kind or a profile that fails prints an error line and leaves an
    ``error`` entry (:func:`guarded`); the next kind starts from the model as it was."""
    episodes = mix_episodes(sizes, shape.vocab)
    flops = mix_flops(shape, episodes)
    kinds = [(False, False), (True, False)] + ([(False, True), (True, True)] if compile else [])
    kinds = [(p, c, torch.float32) for p, c in kinds]
    if bf16_weights:
        kinds += [(True, c, torch.bfloat16) for c in ([False, True] if compile else [False])]

    def measured(packing: bool, compiled: bool, weights: torch.dtype) -> dict:
        if next(model.parameters()).dtype != weights:
            model.to(weights)
        try:
            return timed_kind(packing, compiled, weights)
        finally:  # the next kind starts from the model as it was, whether this one ran or not
            model.zero_grad(set_to_none=True)
            for layer in fsdp.decoder_layers(model):  # eager unless the next kind compiles
                layer.__dict__.pop("forward", None)
            attend_unpacked(model)  # a padded kind after a packed one attends as a real run
            release(device)

    def timed_kind(packing: bool, compiled: bool, weights: torch.dtype) -> dict:
        cfg = run_config(
            sizes,
            "bfloat16" if weights == torch.bfloat16 else compute,
            f"rollout.max_new_tokens={sizes.mix_l_max}",
            f"algo.l_cache={max(1, sizes.mix_l_max // 4)}",
            f"train.responses_per_minibatch={sizes.mix_rows}",
            f"train.packing={str(packing).lower()}",
            f"train.compile={str(compiled).lower()}",
        )
        state = train_state(cfg, model, tok, device)
        first, seconds, peak = measured_updates(state, episodes, steps)
        run = {
            "packing": packing,
            "compiled": compiled,
            "weights": str(weights).removeprefix("torch."),
            "attention": attention_path(shape, device, cfg.model.compute_dtype)
            if packing
            else "sdpa",
            "rows": len(episodes),
            "real_tokens": sum(e.prompt_length + e.length for e in episodes),
            "microbatch_tokens": sizes.microbatch_tokens,
            "step_s": seconds,
            "positions_per_real_token": first["slots"] / first["real"],
            "tflops_real": flops / seconds / 1e12,
            "mfu_real": flops / seconds / 1e12 / peak_tflops,
            "peak_mib": mib(peak),
        }
        print(describe("mix", run), flush=True)
        if profile:  # one more step, after the timed ones: a fault costs only the profile
            label = mix_label(packing, compiled, weights)
            step = functools.partial(minibatch_update, state, episodes)
            profiled = guarded(
                functools.partial(step_profile.profile_call, step, device), label, "profile"
            )
            run["profile"] = profiled
            if "error" not in profiled:
                print(step_profile.describe(label, profiled), flush=True)
        return run

    runs = []
    for packing, compiled, weights in kinds:
        kind = functools.partial(measured, packing, compiled, weights)
        runs.append(guarded(kind, mix_label(packing, compiled, weights), "length mix"))
    # The later sections take float32 weights (rounded to bf16 and trained by the bf16 runs:
    # their figures do not depend on the values).
    model.to(torch.float32)
    release(device)
    return runs


def mix_label(packing: bool, compiled: bool, weights: torch.dtype) -> str:
    label = ("packed" if packing else "padded") + (", compiled" if compiled else "")
    return label + (", bf16 weights" if weights == torch.bfloat16 else "")


def attend_unpacked(model: torch.nn.Module) -> None:
    """Undoes ``use_packing`` (``train.packing``): the model and its sub-models attend
    through SDPA again, as a run with ``train.packing=false`` does."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) == PACKED_ATTENTION:
            config._attn_implementation = "sdpa"


def decode_prompts(sizes: Sizes, count: int) -> list[str]:
    """``count`` prompts of ``decode_prompt`` demo-tokenizer tokens ("3", " 4", ...: a digit
    each)."""
    digits = range(1, sizes.decode_prompt)
    return [str(i % 10) + "".join(f" {(i + k) % 10}" for k in digits) for i in range(count)]


def copy_bandwidth(device: torch.device, nbytes: int, *, batches: int = 5, reps: int = 5) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (random data), counting the bytes read
    and the bytes written: the best of ``batches`` timed batches. What a decoding step that
    reads its weights and cache once can at best move."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_seconds(device, lambda: dst.copy_(src), batches, reps)


def decode_step_bytes(shape: ModelShape, *, rows: int, tokens: float, compute: int) -> int:
    """The fewest bytes a decoding step of ``rows`` rows must read: every decoder layer's
    weights and the output head's (an embedding row per row aside) in the compute dtype, and
    the keys and values of ``tokens`` positions per row (the mean length over the rollout)."""
    weights = compute * (shape.layers * shape.layer_parameters + shape.vocab * shape.hidden)
    cache = kv_cache_bytes(shape, tokens=1, rows=rows, compute=compute) * tokens
    return int(weights + cache)


def decode_run(
    engine: Any,
    shape: ModelShape,
    prompts: list[str],
    sizes: Sizes,
    new_tokens: int,
    device: torch.device,
    compute: str,
    bandwidth: float,
) -> dict:
    """One timed ``generate`` (EOS ignored) after the same one untimed: tokens/s against the
    bound that the copy ``bandwidth`` sets for the bytes each step must read."""
    options = dict(group_size=sizes.decode_group, seed=0, ignore_eos=True)
    t0 = time.perf_counter()
    # Untimed, the same rollout: kernels loaded, the step compiled, cuDNN's attention plans
    # built for each width (a first rollout of new widths pays ~20% more).
    engine.generate(prompts, max_new_tokens=new_tokens, **options)
    sync(device)
    warm_up = time.perf_counter() - t0
    start = reset_peak(device)
    t0 = time.perf_counter()
    rollout = engine.generate(prompts, max_new_tokens=new_tokens, **options)
    sync(device)
    seconds = time.perf_counter() - t0
    peak = read_peak(device) if device.type == "cuda" else None
    rows, tokens = len(rollout.texts), int(rollout.lengths_B.sum())
    prompt_tokens = int(rollout.prompt_mask_BP[0].sum())
    width = DTYPE_BYTES[compute]
    kv = kv_cache_bytes(shape, tokens=prompt_tokens + new_tokens, rows=rows, compute=width)
    settings = PlanSettings(
        compute_dtype=compute,
        prompt_tokens=prompt_tokens,
        max_new_tokens=new_tokens,
        rows=rows,
        gqa_copy=transformers_copies_gqa(),
        device=device.type,
        cuda_graphs=engine.static_path(),  # the graph path never copies keys per query head
    )
    workspace = decode_workspace_bytes(shape, settings, compute=width)
    step_bytes = decode_step_bytes(
        shape, rows=rows, tokens=prompt_tokens + (new_tokens - 1) / 2, compute=width
    )
    bound = rows * bandwidth / step_bytes
    path = "eager"
    if engine.static_path():
        path = "cuda graphs, compiled" if engine.compile_step else "cuda graphs"
        if engine.width_step:
            path += f", widths in steps of {engine.width_step}"
        if engine.compile_step and engine.compile_mode:
            path += f", {engine.compile_mode}"
    return {
        "path": path,
        "warm_up_s": warm_up,
        "rows": rows,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "step_ms": 1000 * seconds / new_tokens,
        "bytes_per_step": step_bytes,
        "bound_tokens_per_s": bound,
        "decode_bound_frac": tokens / seconds / bound,
        "peak_mib": mib(peak),
        "rise_mib": mib(None if peak is None or start is None else peak - start),
        "plan_kv_cache_mib": mib(kv),
        "plan_decode_mib": mib(kv + workspace),
    }


AUTOTUNE = "max-autotune-no-cudagraphs"
"""``--variants``: the compiled step's ``torch.compile`` mode that times inductor's own matmul
kernels against cuBLAS's."""


def decode_plans(sizes: Sizes, device: torch.device, variants: bool) -> list[dict]:
    """The decoding runs of a shape: each of ``decode_prompt_counts`` on the default path; on
    CUDA also, at the first count, the uncompiled step's graphs and the eager loop (for
    ``eager_new`` tokens); with ``variants`` (CUDA), the compiled step's graphs with attention
    widths in steps of 128 and in inductor's autotuning mode."""
    default = dict(new_tokens=sizes.decode_new, cuda_graphs=True, compile_step=True)
    plans = [dict(default, count=count) for count in sizes.decode_prompt_counts]
    first = sizes.decode_prompt_counts[0]
    if device.type == "cuda":
        plans.append(dict(default, count=first, compile_step=False))
        eager = dict(new_tokens=sizes.eager_new, cuda_graphs=False, compile_step=False)
        plans.append(dict(eager, count=first))
    if device.type == "cuda" and variants:
        plans.append(dict(default, count=first, width_step=128))
        plans.append(dict(default, count=first, compile_mode=AUTOTUNE))
    return plans


def decode_section(
    shape: ModelShape,
    model: torch.nn.Module,
    tok: Any,
    sizes: Sizes,
    device: torch.device,
    compute: str,
    bandwidth: float,
    profile: bool = False,
    variants: bool = False,
) -> list[dict]:
    """The native engine's runs of :func:`decode_plans`: the standing ones; with ``profile``
    each count's graph path once more under the profiler for ``profile_new`` tokens
    (:func:`decode_profile`); then the variants, each of which may fail (an error line and
    an ``error`` entry) without costing the figures after it."""
    engine = make_engine("dapo", model, tok, (tok.eos_token_id,), DTYPES[compute], device=device)
    model.eval()
    plans = decode_plans(sizes, device, variants)

    def timed(plan: dict) -> dict:
        set_engine(engine, plan)
        prompts = decode_prompts(sizes, plan["count"])
        run = decode_run(
            engine, shape, prompts, sizes, plan["new_tokens"], device, compute, bandwidth
        )
        print(describe("decode", run), flush=True)
        release(device)
        return run

    standing = [plan for plan in plans if not is_variant(plan)]
    runs = [timed(plan) for plan in standing]
    if profile:  # after every timed run: a profiler fault cannot cost their figures
        for run, plan in zip(runs, standing, strict=True):
            if plan["cuda_graphs"] and plan["compile_step"]:  # the default path
                # compiled as the timed run was (not when its compiling failed there)
                set_engine(engine, dict(plan, compile_step="compiled" in run["path"]))
                prompts = decode_prompts(sizes, plan["count"])
                compiled = device.type == "cuda" and engine.compile_step
                label = f"decode, {run['rows']} rows (the graph path's "
                label += f"{'compiled ' if compiled else ''}step, no graphs)"
                work = functools.partial(decode_profile, engine, prompts, sizes, device)
                run["profile"] = guarded(work, label, "profile")
                if "error" not in run["profile"]:
                    print(step_profile.describe_steps(label, run["profile"], sizes.profile_new))
                release(device)
    for plan in filter(is_variant, plans):
        runs.append(guarded(functools.partial(timed, plan), variant_name(plan)))
    return runs


def is_variant(plan: dict) -> bool:
    return bool(plan.get("width_step") or plan.get("compile_mode"))


def variant_name(plan: dict) -> str:
    if plan.get("width_step"):
        return f"widths in steps of {plan['width_step']}"
    return str(plan.get("compile_mode"))


def guarded(run: Callable[[], dict], name: str, what: str = "decode variant") -> dict:
    """``run()``, or, when it raises, an error line (``what (name) failed: ...``) and
    ``{"variant": name, "error"}``: a decoding variant, a length-mix kind, a profile or a
    shape may fail on a card where none has run before, and its failure must not cost the
    figures after it (one GPU call is all a session may get)."""
    try:
        return run()
    except Exception as err:  # noqa: BLE001 (any failure of an experiment is reported)
        error = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
        print(f"  {what} ({name}) failed: {error}", flush=True)
        return {"variant": name, "error": error}


def set_engine(engine: Any, plan: dict) -> None:
    """The engine's path for ``plan``: graphs, compiled, and the variants' settings (their
    defaults when the plan has none)."""
    engine.cuda_graphs, engine.compile_step = plan["cuda_graphs"], plan["compile_step"]
    engine.width_step = plan.get("width_step")
    engine.compile_mode = plan.get("compile_mode")


def decode_profile(engine: Any, prompts: list[str], sizes: Sizes, device: torch.device) -> dict:
    """The engine's CUDA-graph path for ``profile_new`` tokens (EOS ignored) under the
    profiler, its step compiled on CUDA but launched without graphs: the same kernels as the
    graphs replay, with their device times (no graph is captured or replayed under the
    profiler, which has known faults with graphs), the prompts' prefill among them; after
    the same call untimed. The caller divides by the steps."""
    ids_nP, mask_nP = encode_prompts(engine.tokenizer, prompts, device)
    compiled = device.type == "cuda" and engine.compile_step
    work = functools.partial(
        torch.inference_mode()(static_decode),
        engine.model,
        ids_nP,
        mask_nP,
        group_size=sizes.decode_group,
        max_new_tokens=sizes.profile_new,
        stop_token_ids=engine.stop_token_ids,
        pad_token_id=engine.tokenizer.pad_token_id,
        compute_dtype=engine.compute_dtype,
        seed=0,
        ignore_eos=True,
        graphs=False,
        compile=COMPILE_BACKEND if compiled else None,
    )
    work()
    sync(device)
    return step_profile.profile_call(work, device, top=12)


def head_pass(
    way: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    sizes: Sizes,
    compute: str,
) -> torch.Tensor:
    """Log-probs of ``tokens`` through the head, forward and backward (gradients accumulate
    in ``hidden`` and ``weight``), as the chunked head or through the full logits."""
    device_type = hidden.device.type
    with torch.autocast(device_type, dtype=DTYPES[compute], enabled=compute != "float32"):
        if way == "chunked":
            logp, _ = token_logprobs_from_hidden(
                hidden, weight, tokens, chunk_tokens=sizes.head_chunk
            )
        else:  # what a model's own forward computes: the [N, V] logits, in the compute dtype
            logp = token_logprobs_from_logits(torch.nn.functional.linear(hidden, weight), tokens)
    logp.sum().backward()
    return logp.detach()


def head_section(shape: ModelShape, sizes: Sizes, device: torch.device, compute: str) -> dict:
    """Peak memory above the inputs of the chunked head and of the full logits, at
    ``head_tokens`` positions; the chunked one first, so that it never reuses what the other
    freed (on a CPU, freed memory that stays resident is not counted again)."""
    n, h, v = sizes.head_tokens, shape.hidden, shape.vocab
    g = torch.Generator(device).manual_seed(3)
    hidden = torch.randn(n, h, device=device, generator=g).requires_grad_()
    weight = (0.02 * torch.randn(v, h, device=device, generator=g)).requires_grad_()
    tokens = torch.randint(0, v, (n,), device=device, generator=g)
    out: dict[str, Any] = {"tokens": n, "chunk_tokens": sizes.head_chunk}
    logps = {}
    for way in ("chunked", "full"):
        hidden.grad = weight.grad = None
        start = reset_peak(device)
        logps[way] = head_pass(way, hidden, weight, tokens, sizes, compute)
        peak = read_peak(device)
        out[f"{way}_mib"] = mib(None if peak is None or start is None else peak - start)
    out["max_logprob_gap"] = float((logps["chunked"] - logps["full"]).abs().max())
    out["full_logits_mib"] = mib(n * v * DTYPE_BYTES[compute])
    if sizes.head_chunk is None:  # the plan counts the project's default chunk
        settings = PlanSettings(compute_dtype=compute, microbatch_tokens=n)
        out["plan_chunked_mib"] = mib(
            output_head_bytes(shape, settings, compute=DTYPE_BYTES[compute])
        )
    out["measured_by"] = "cuda allocator" if device.type == "cuda" else "resident high-water"
    return out


FSDP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_one_rank_group(device: torch.device, body: Callable[[torch.device], dict]) -> dict:
    """``body(device)`` inside a process group of one rank, joined as ``torchrun`` would
    (``dapo.dist.init_from_env``: NCCL beside gloo on CUDA); the environment is put back."""
    saved = {k: os.environ.get(k) for k in FSDP_ENV}
    port = str(free_port())
    # LOCAL_RANK picks the rank's GPU among the visible ones: the one the other sections use.
    local = str(device.index or 0)
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK=local, MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )
    try:
        device = dist.init_from_env(timeout_s=600)
        if device is None:
            raise RuntimeError("the one-rank process group did not start")
        return body(device)
    finally:
        dist.shutdown()
        for k, value in saved.items():
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value


def fsdp_section(
    fields: dict[str, Any],
    tok: Any,
    sizes: Sizes,
    device: torch.device,
    compute: str,
    episodes: list[Episode],
    train: dict,
) -> dict:
    """Two steps of the sharded model on the training mini-batch; the first one's loss and
    gradient norm against the one-process first step (the same starting weights, seed 0)."""

    def body(rank_device: torch.device) -> dict:
        if rank_device != device:
            raise RuntimeError(f"the rank computes on {rank_device}, not {device}")
        cfg = run_config(sizes, compute)
        state = train_state(cfg, build_model(fields, tok, device), tok, device)
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        first = minibatch_update(state, episodes)
        sync(device)
        first_s = time.perf_counter() - t0
        (step_s,) = timed_steps(state, episodes, 1)
        peak = read_peak(device) if device.type == "cuda" else None
        return {
            "backend": "nccl" if device.type == "cuda" else "gloo",
            "sharded": fsdp.is_sharded(state.model),
            "first_step_s": first_s,
            "step_s": step_s,
            "peak_mib": mib(peak),
            "loss": first["loss"],
            "loss_one_process": train["loss_first_step"],
            "loss_gap": abs(first["loss"] - train["loss_first_step"]),
            "grad_norm": first["grad_norm"],
            "grad_norm_one_process": train["grad_norm_first_step"],
        }

    return in_one_rank_group(device, body)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gib_or_mib(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value / 1024:.2f} GiB" if value >= 1024 else f"{value:.1f} MiB"


def describe(section: str, r: dict) -> str:
    """One line of figures per section."""
    if section == "train":
        return (
            f"  train: {r['rows']} rows x {r['tokens_per_row']} tokens, micro-batches of "
            f"{r['microbatch_tokens']}: {r['step_s']:.3f} s/step (median of {r['steps']}), "
            f"{r['tokens_per_s']:,.0f} tokens/s, {r['tflops']:.3g} TFLOP/s, MFU {r['mfu']:.3f};"
            f" peak {gib_or_mib(r['peak_mib'])} (reserved {gib_or_mib(r['reserved_peak_mib'])}),"
            f" plan {gib_or_mib(r['plan_training_peak_mib'])} (with the allocator's reserve "
            f"{gib_or_mib(r['plan_reserved_mib'])})"
        )
    if section == "mix":
        return (
            f"  length mix, {'packed' if r['packing'] else 'padded'} ({r['attention']}"
            f"{', compiled layers' if r['compiled'] else ''}"
            f"{', bf16 weights, no autocast' if r.get('weights') == 'bfloat16' else ''}): "
            f"{r['rows']} rows, {r['real_tokens']} real tokens, micro-batches of "
            f"{r['microbatch_tokens']}: {r['step_s']:.3f} s/step, "
            f"{r['positions_per_real_token']:.3f} positions per real token, MFU on real tokens "
            f"{r['mfu_real']:.3f}; peak {gib_or_mib(r['peak_mib'])}"
        )
    if section == "decode":
        return (
            f"  decode: {r['rows']} rows x {r['new_tokens']} new tokens after "
            f"{r['prompt_tokens']} ({r['path']}; warm-up {r['warm_up_s']:.1f} s): "
            f"{r['seconds']:.2f} s, "
            f"{r['tokens_per_s']:,.0f} tokens/s "
            f"({r['step_ms']:.2f} ms a step), bound {r['bound_tokens_per_s']:,.0f} "
            f"({r['bytes_per_step'] / 2**30:.2f} GiB a step), fraction "
            f"{r['decode_bound_frac']:.3f}; "
            f"rise {gib_or_mib(r['rise_mib'])}, plan {gib_or_mib(r['plan_decode_mib'])} (KV "
            f"cache {gib_or_mib(r['plan_kv_cache_mib'])} and the decoding workspace)"
        )
    if section == "head":
        return (
            f"  head at {r['tokens']} tokens: chunked {gib_or_mib(r['chunked_mib'])}, full "
            f"logits {gib_or_mib(r['full_mib'])} ({r['measured_by']}; the logits alone "
            f"{gib_or_mib(r['full_logits_mib'])}); max log-prob gap {r['max_logprob_gap']:.2e}"
        )
    return (
        f"  fsdp ({r['backend']}, 1 rank): {r['step_s']:.3f} s/step (first "
        f"{r['first_step_s']:.2f} s), peak {gib_or_mib(r['peak_mib'])}; loss {r['loss']:.6g} "
        f"vs {r['loss_one_process']:.6g} in one process (gap {r['loss_gap']:.1e}), grad norm "
        f"{r['grad_norm']:.6g} vs {r['grad_norm_one_process']:.6g}"
    )


def run_shape(
    name: str,
    fields: dict[str, Any],
    sizes: Sizes,
    device: torch.device,
    compute: str,
    steps: int,
    peak_tflops: float,
    bandwidth: float,
    sections: frozenset[str] = frozenset(SECTIONS),
    profile: bool = False,
    compile: bool = False,
    variants: bool = False,
    bf16_weights: bool = False,
) -> dict:
    """The ``sections`` on one shape, printing a line each as it ends; MFU against
    ``peak_tflops``. The fsdp section compares with the train section's step, so it runs it."""
    # A shape after another would otherwise reuse the compiled steps' caches, and dynamo would
    # trace them again with the weights' sizes symbolic: neither this shape's alone nor a run's.
    torch._dynamo.reset()
    tok = build_tokenizer()
    shape = ModelShape.from_hf_config(fields)
    print(f"{name}: {shape.num_parameters / 1e6:,.1f}M parameters", flush=True)
    model = build_model(fields, tok, device)
    out: dict[str, Any] = {}
    if sections & {"train", "fsdp"}:
        log(f"{name}: training step")
        train, episodes = train_section(shape, model, tok, sizes, device, compute, steps)
        train["mfu"] = train["tflops"] / peak_tflops
        print(describe("train", train), flush=True)
        out["train"] = train
    if "mix" in sections:
        log(f"{name}: training on a realistic length mix, padded and packed")
        out["mix"] = mix_section(
            shape, model, tok, sizes, device, compute, steps, peak_tflops, profile, compile,
            bf16_weights,
        )  # fmt: skip
    if "decode" in sections:
        log(f"{name}: decoding")
        decode_runs = decode_section(
            shape, model, tok, sizes, device, compute, bandwidth, profile, variants
        )
        out |= {"decode": decode_runs[0], "decode_runs": decode_runs}
    del model
    release(device)
    if "head" in sections:
        log(f"{name}: output head")
        out["head"] = head_section(shape, sizes, device, compute)
        print(describe("head", out["head"]), flush=True)
        release(device)
    if "fsdp" in sections:
        log(f"{name}: one-rank FSDP step")
        out["fsdp"] = fsdp_section(fields, tok, sizes, device, compute, episodes, out["train"])
        print(describe("fsdp", out["fsdp"]), flush=True)
        release(device)
    return {"params": shape.num_parameters, "sizes": asdict(sizes), **out}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(KNOWN_SHAPES), default=list(DEFAULT_SHAPES)
    )
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the default off CUDA)")
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    parser.add_argument("--decode-only", action="store_true", help="the decoding section alone")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="(all)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one more length-mix step of each kind, and a short decoding call",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the length-mix step also with compiled decoder layers (train.compile)",
    )
    parser.add_argument(
        "--bf16-weights",
        action="store_true",
        help="the packed length-mix step also on the model cast to bf16, without autocast "
        "(a speed figure: what a bf16 residual stream would approach)",
    )
    parser.add_argument(
        "--variants",
        action="store_true",
        help="on CUDA, the decoding step also with attention widths in steps of 128 and "
        "with inductor's autotuned matmuls",
    )
    parser.add_argument(
        "--microbatch-tokens",
        type=int,
        help="train.tokens_per_microbatch of the training sections (8192; tiny: 128): fewer, "
        "larger micro-batches launch fewer kernels a step",
    )
    parser.add_argument("--steps", type=int, help="timed training steps (5; tiny: 2)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument("--compute-dtype", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default auto)")
    args = parser.parse_args(argv)
    if args.microbatch_tokens is not None and args.microbatch_tokens < 1:
        parser.error(f"--microbatch-tokens must be at least 1, got {args.microbatch_tokens}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if dist.launched():  # the fsdp section makes its own group; torchrun's ranks would clash
        raise SystemExit("benchmarks/gpu.py starts its own one-rank group: run it without torchrun")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = compute_device(args.device)
    cuda = device.type == "cuda"
    tiny = args.tiny or not cuda
    if not cuda and not args.tiny:
        log("no CUDA device: the tiny shape runs")
    compute = args.compute_dtype or ("bfloat16" if cuda else "float32")
    steps = args.steps or (2 if tiny else 5)
    cpu_name = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    name = torch.cuda.get_device_name(device) if cuda else cpu_name
    result: dict[str, Any] = {
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
        "tiny": tiny,
        "threads": torch.get_num_threads(),
        "compute_dtype": compute,
    }
    print(f"{name} ({device}), torch {torch.__version__}, {result['date']}", flush=True)
    matmul = matmul_peak(device, DTYPES[compute], (TINY if tiny else REAL).matmul_n)
    print(f"matmul peak: {matmul['tflops']:.4g} TFLOP/s ({matmul['dtype']})", flush=True)
    result["matmul"] = matmul
    bandwidth = copy_bandwidth(device, 2**30 if cuda else 2**26)
    print(f"copy bandwidth: {bandwidth / 1e9:,.0f} GB/s (read + written)", flush=True)
    result["copy_bandwidth_gb_s"] = bandwidth / 1e9
    shapes = {"tiny-qwen2": TINY_FIELDS} if tiny else {s: KNOWN_SHAPES[s] for s in args.shapes}
    sections = frozenset(["decode"] if args.decode_only else args.sections)
    options = (args.profile, args.compile, args.variants, args.bf16_weights)
    sizes = TINY if tiny else REAL
    if args.microbatch_tokens is not None:
        sizes = replace(sizes, microbatch_tokens=args.microbatch_tokens)
    result["shapes"] = {}
    for s, f in shapes.items():  # a shape that fails still leaves the next its figures
        run = functools.partial(
            run_shape, s, f, sizes, device, compute, steps, matmul["tflops"], bandwidth,
            sections, *options,
        )  # fmt: skip
        result["shapes"][s] = guarded(run, s, "shape")
        release(device)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
