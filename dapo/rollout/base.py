"""What every rollout engine returns, and the protocol an engine follows.

Shapes: n = prompts, B = responses (n x G, each group contiguous), P = prompt tokens (left
padded), T = response tokens (right padded after the stop token).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from dapo.data.batch import Trace
from dapo.models import lora

Prompts = list[str] | list[list[int]]
"""What ``Engine.generate`` takes: each prompt's text, or its token ids."""


@dataclass
class Sample:
    """One response, unpadded: what the trainer grades and turns into an episode."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    logprobs: torch.Tensor
    """The sampler's log pi of each token (float32)."""
    truncated: bool
    text: str
    env_mask: torch.Tensor | None = None
    """True at the tokens an environment wrote (multi-turn episodes); None: single turn."""
    trace: Trace | None = None


@dataclass
class Rollout:
    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    response_ids_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    """True for generated tokens up to and including EOS."""
    logprobs_BT: torch.Tensor
    """log pi_old of each sampled token at the sampling temperature (0 where masked). With
    top_p < 1 the native and hf engines record it under the temperature-scaled policy before
    the top-p cut (verl's convention: top-p is a sampling device, the policy is the whole
    distribution); vLLM's are of the truncated distribution (``exact_logprobs`` False)."""
    lengths_B: torch.Tensor
    truncated_B: torch.Tensor
    """True where no EOS came within max_new_tokens."""
    texts: list[str]
    slots: int = 0
    """(row, step) positions the engine computed: generated tokens plus any padding after EOS
    (finished rows still in the batch, and the static loop's padding copies)."""
    env_mask_BT: torch.Tensor | None = None
    """Multi-turn episodes (:mod:`dapo.rollout.episodes`): True at the response tokens the
    environment wrote, whose ``logprobs_BT`` are 0; ``texts`` are then the model's text
    alone, each row's whole response in ``traces``."""
    traces: list[Trace] | None = None
    parked: list[Any] | None = None
    """The native engine asked to park (:mod:`dapo.rollout.parking`): each row's KV cache
    when it stopped at a turn end, else None."""

    def samples(self) -> list[Sample]:
        """Every row unpadded, on the CPU, in row order."""
        out = []
        for b in range(len(self.texts)):
            length = int(self.lengths_B[b])
            env = self.env_mask_BT
            out.append(
                Sample(
                    prompt_ids=self.prompt_ids_BP[b][self.prompt_mask_BP[b].bool()].cpu(),
                    response_ids=self.response_ids_BT[b, :length].cpu(),
                    logprobs=self.logprobs_BT[b, :length].float().cpu(),
                    truncated=bool(self.truncated_B[b]),
                    text=self.texts[b],
                    env_mask=None if env is None else env[b, :length].cpu(),
                    trace=None if self.traces is None else self.traces[b],
                )
            )
        return out


@runtime_checkable
class Engine(Protocol):
    """Draws G responses per prompt from the policy being trained.

    An engine that reads the trainer's live module (native, hf) has nothing to do in
    ``sync_weights``; one that holds its own copy of the weights (an inference server) loads
    the new ones there, and must be told after every optimizer update, before it generates
    again. ``exact_logprobs`` says whether the log-probs it returns are the policy's own (a
    forward pass gives the same to float rounding), so that they may stand in for pi_old.
    """

    exact_logprobs: bool

    def generate(
        self,
        prompts: Prompts,
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | Sequence[int] = 0,
        greedy: bool = False,
        ignore_eos: bool = False,
    ) -> Rollout:
        """``group_size`` responses for each prompt (rows i*G .. i*G+G-1 are prompt i; a
        prompt is its text, or its token ids, which are used as they are),
        reproducible for a given seed and policy. With one seed per prompt, a prompt's
        responses do not depend on the other prompts of the call (so not on how a round is
        split into calls or across ranks)."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the next ``generate`` sample from ``model``'s current weights."""
        ...

    def close(self) -> None:
        """Release what the engine holds (an inference server's memory and processes); it
        generates no more after this."""
        ...


class LiveModelEngine:
    """An engine that samples from the trainer's own module, as the native and hf engines do:
    the weights it reads are the trained ones (nothing to sync), and its log-probs are the
    policy's own. A response ends at the first of ``stop_token_ids`` (default: the
    tokenizer's EOS); the model runs in ``compute_dtype`` (autocast) when one is given."""

    exact_logprobs = True

    merged_sampling: bool = True
    """With LoRA adapters on float32 weights, sample from a copy with the adapters merged in
    (:meth:`sampling_model`), not through them (``model.lora.merged_sampling``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        stop_token_ids: Sequence[int] = (),
        compute_dtype: torch.dtype | None = None,
        *,
        device: torch.device | None = None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self._merged: torch.nn.Module | None = None
        self.stop_token_ids = tuple(stop_token_ids) or (tokenizer.eos_token_id,)
        self.compute_dtype = compute_dtype
        """Autocast to this when it differs from the weights' dtype, as training computes."""
        self.device = device or next(model.parameters()).device
        """Where prompts go and sampling runs: the run's compute device (a bare engine made
        in a test or a script takes its model's)."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to copy: generation runs the trainer's own module."""

    @contextlib.contextmanager
    def sampling_model(self) -> Iterator[torch.nn.Module]:
        """The module to sample from in the block: the model; with LoRA adapters that can be
        merged (:func:`dapo.models.lora.can_merge`, ``merged_sampling``), a copy of it with
        each adapted weight merged (:func:`dapo.models.lora.merged_copy`: the adapted
        layers' weights once more, the rest shared), made for the block and dropped after
        it, so it never outlives the weights it was made from (a block inside the block
        reuses it). One matrix product per layer instead of three: faster where the
        products dominate (measured in docs/guides/lora.md)."""
        if self._merged is not None:
            yield self._merged
            return
        if not (self.merged_sampling and lora.enabled(self.model) and lora.can_merge(self.model)):
            yield self.model
            return
        self._merged = lora.merged_copy(self.model)
        try:
            yield self._merged
        finally:
            lora.release(self._merged)
            self._merged = None

    def close(self) -> None:
        """Nothing to release: the module is the trainer's."""


def check_request(
    prompts: Prompts,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    greedy: bool,
) -> None:
    """Refuse what no engine can draw, naming the argument: no prompts, an empty prompt (no
    token to continue from), no rows, no tokens; sampling at a temperature that is not a
    positive number (0 is ``greedy=True``) or with a top-p outside (0, 1] (top-p 0 kept no
    token, and the draw then took the least likely)."""
    if not len(prompts):
        raise ValueError("generate() needs at least one prompt, got none")
    for i, prompt in enumerate(prompts):
        if not len(prompt):
            raise ValueError(
                f"prompt {i} has no tokens, so the model has nothing to continue from: drop "
                "it, or give it at least one token (e.g. the tokenizer's BOS token)"
            )
    if group_size < 1 or max_new_tokens < 1:
        raise ValueError(
            f"group_size and max_new_tokens must be >= 1, got {group_size} and {max_new_tokens}"
        )
    if not greedy and not (0 < temperature < math.inf):
        raise ValueError(
            f"temperature must be a positive number, got {temperature}; for argmax decoding "
            "pass greedy=True"
        )
    if not greedy and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p} (1: the whole distribution)")


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]], device: torch.device
):
    """(ids [n, P], mask [n, P]) of the prompts, left padded, on ``device``. A prompt is its
    text, or its token ids (an episode continued after an observation: the tokens sampled,
    which a decode and encode could change)."""
    if prompts and not isinstance(prompts[0], str):
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if len(p):
                ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
                mask[i, width - len(p) :] = 1
        return ids.to(device), mask.to(device)
    # Left, whatever the tokenizer's padding_side says: generation continues from the last
    # column, which right padding would make a pad for every shorter prompt.
    enc = tokenizer(
        list(prompts),
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=False,
    )
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def finish_rollout(
    tokenizer: Any,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    logprobs_BT: torch.Tensor,
    slots: int,
    stop_token_ids: Sequence[int],
) -> Rollout:
    """Masks, lengths and texts of generated ids: a response is its tokens up to and including
    the first stop token, and is truncated when it has none; what follows becomes padding."""
    stops = torch.tensor(list(stop_token_ids), device=response_ids_BT.device)
    is_stop_BT = torch.isin(response_ids_BT, stops)
    after_stop_BT = (is_stop_BT.cumsum(dim=1) - is_stop_BT.long()) > 0
    response_mask_BT = ~after_stop_BT
    lengths_B = response_mask_BT.sum(dim=1)
    truncated_B = ~is_stop_BT.any(dim=1)
    response_ids_BT = response_ids_BT.masked_fill(~response_mask_BT, tokenizer.pad_token_id)
    logprobs_BT = logprobs_BT.masked_fill(~response_mask_BT, 0.0)
    texts = tokenizer.batch_decode(response_ids_BT, skip_special_tokens=True)
    return Rollout(
        prompt_ids_BP=prompt_ids_BP,
        prompt_mask_BP=prompt_mask_BP,
        response_ids_BT=response_ids_BT,
        response_mask_BT=response_mask_BT,
        logprobs_BT=logprobs_BT,
        lengths_B=lengths_B,
        truncated_B=truncated_B,
        texts=texts,
        slots=slots,
    )


def concat_rollouts(parts: Sequence[Rollout], pad_token_id: int) -> Rollout:
    """The rows of ``parts`` in order, as one rollout: prompts left padded, responses right
    padded to the longest of any part."""
    P = max(r.prompt_ids_BP.shape[1] for r in parts)
    T = max(r.response_ids_BT.shape[1] for r in parts)

    def pad(x: torch.Tensor, width: int, value, *, left: bool) -> torch.Tensor:
        extra = width - x.shape[1]
        return torch.nn.functional.pad(x, (extra, 0) if left else (0, extra), value=value)

    return Rollout(
        prompt_ids_BP=torch.cat([pad(r.prompt_ids_BP, P, pad_token_id, left=True) for r in parts]),
        prompt_mask_BP=torch.cat([pad(r.prompt_mask_BP, P, 0, left=True) for r in parts]),
        response_ids_BT=torch.cat(
            [pad(r.response_ids_BT, T, pad_token_id, left=False) for r in parts]
        ),
        response_mask_BT=torch.cat([pad(r.response_mask_BT, T, False, left=False) for r in parts]),
        logprobs_BT=torch.cat([pad(r.logprobs_BT, T, 0.0, left=False) for r in parts]),
        lengths_B=torch.cat([r.lengths_B for r in parts]),
        truncated_B=torch.cat([r.truncated_B for r in parts]),
        texts=[t for r in parts for t in r.texts],
        slots=sum(r.slots for r in parts),
        parked=None
        if all(r.parked is None for r in parts)
        else [p for r in parts for p in (r.parked or [None] * len(r.texts))],
    )


def close_engine(engine: Any, *, failed: bool) -> None:
    """Close ``engine`` (when it has ``close``), except on a failing rank of a ``torchrun``
    job: a vllm engine's teardown destroys the process group while the rank's peers may wait
    in a collective on it; the process's exit, which makes torchrun stop the job, ends it."""
    from dapo import dist

    if failed and dist.launched():
        return
    close = getattr(engine, "close", None)  # engines written before the protocol had it
    if close is not None:
        close()
