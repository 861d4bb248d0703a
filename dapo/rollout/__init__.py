"""Rollout: G sampled responses per prompt from the current policy, by a pluggable engine.

Engines follow :class:`~dapo.rollout.base.Engine` (generate; sync weights after an update;
whether their log-probs are exact) and return a :class:`~dapo.rollout.base.Rollout`:

    dapo  :mod:`dapo.rollout.native`, this project's decoding loop: one prefill per prompt,
          finished rows leave the batch (the default)
    hf    :mod:`dapo.rollout.hf`, transformers ``generate``: the reference, and the fallback
          for a model whose KV cache cannot be repeated or sliced by row
    vllm  :mod:`dapo.rollout.vllm_engine`, vLLM colocated in the training process: its own
          copy of the weights, loaded after every update, and log-probs that are not pi_old's
          (an optional dependency, imported when the engine is made)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dapo.data.problems import Problem
from dapo.rollout.base import Engine, Rollout, Sample
from dapo.rollout.episodes import EpisodeRunner
from dapo.rollout.hf import HFEngine
from dapo.rollout.native import NativeEngine
from dapo.rollout.vllm_engine import VLLMEngine
from dapo.run.seeding import derive_seed

__all__ = ["ENGINES", "Engine", "Rollout", "Sample", "generate_samples", "make_engine"]

ENGINES = {"dapo": NativeEngine, "hf": HFEngine, "vllm": VLLMEngine}


def make_engine(
    name: str,
    model: torch.nn.Module,
    tokenizer: Any,
    stop_token_ids: Sequence[int] = (),
    compute_dtype: torch.dtype | None = None,
    *,
    vllm: dict[str, Any] | None = None,
    device: torch.device | None = None,
    cuda_graphs: bool = True,
    compile_step: bool = True,
    merged_sampling: bool = True,
) -> Engine:
    """The engine called ``name``, sampling from ``model`` (in ``compute_dtype`` when given)
    on ``device`` (the run's compute device; default: the model's); a response ends at the
    first of ``stop_token_ids`` (default: the tokenizer's EOS; ``policy.stop_token_ids``
    gives a run's set). ``vllm`` holds the vllm engine's options (the run's ``vllm`` config
    section as a dict; its defaults when None). ``cuda_graphs``, ``compile_step``: the dapo
    engine's ``rollout.cuda_graphs`` and ``rollout.compile_step``; ``merged_sampling``: the
    dapo and hf engines' ``model.lora.merged_sampling``."""
    if name not in ENGINES:
        raise ValueError(f"rollout engine {name!r}: use one of {', '.join(ENGINES)}")
    if name == "vllm":
        options = vllm or {}
        return VLLMEngine(model, tokenizer, stop_token_ids, compute_dtype, device=device, **options)
    engine = ENGINES[name](model, tokenizer, stop_token_ids, compute_dtype, device=device)
    engine.merged_sampling = merged_sampling
    if isinstance(engine, NativeEngine):
        engine.cuda_graphs = cuda_graphs
        engine.compile_step = compile_step
    return engine


def generate_samples(
    engine: Engine,
    prompts: list[str],
    *,
    group_size: int,
    rows_per_call: int,
    seed: int | Sequence[int],
    episodes: EpisodeRunner | None = None,
    problems: Sequence[Problem] = (),
    **sampling: Any,
) -> tuple[list[Sample], int]:
    """G responses per prompt (samples i*G .. i*G+G-1 are prompt i) and the slots computed,
    in engine calls of at most ``rows_per_call`` rows (0 = one call), which bounds memory.
    With ``episodes``, multi-turn episodes of ``problems`` (those the prompts render) on it.

    With one seed per prompt (what training uses), the calls do not change what is drawn.
    With one ``seed``, the first call is seeded with it (so one call is the plain draw), call
    k with a seed derived from (seed, "call", k).
    """
    per_call = max(1, rows_per_call // group_size) if rows_per_call else len(prompts)
    samples, slots = [], 0
    for call, start in enumerate(range(0, len(prompts), per_call)):
        if not isinstance(seed, int):
            call_seed = list(seed[start : start + per_call])
        else:
            call_seed = seed if call == 0 else derive_seed(seed, "call", call)
        part = slice(start, start + per_call)
        if episodes is None:
            ro = engine.generate(prompts[part], group_size=group_size, seed=call_seed, **sampling)
        else:
            ro = episodes.generate(
                problems[part], prompts[part], group_size=group_size, seed=call_seed, **sampling
            )
        slots += ro.slots
        samples.extend(ro.samples())
    return samples, slots
