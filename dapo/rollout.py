"""Rollout: G sampled responses per prompt from the current policy.

Two engines draw them: ``dapo`` (:mod:`dapo.decode`: one prefill per prompt, finished rows
leave the batch) and ``hf``, transformers ``generate`` (the reference, and the fallback for a
model whose KV cache cannot be repeated or sliced by row).

Shapes: B = responses (prompts x G, each group contiguous), P = prompt tokens (left padded),
T = response tokens (right padded after EOS), V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from dapo.decode import decode


@dataclass
class Rollout:
    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    response_ids_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    """True for generated tokens up to and including EOS."""
    logprobs_BT: torch.Tensor
    """log pi_old of each sampled token at the sampling temperature (0 where masked)."""
    lengths_B: torch.Tensor
    truncated_B: torch.Tensor
    """True where no EOS came within max_new_tokens."""
    texts: list[str]
    slots: int = 0
    """(row, step) positions the engine computed: generated tokens plus any padding after EOS."""


class _SampledLogprobs(LogitsProcessor):
    """Records log pi(token) of each sampled token without keeping [B, T, V] logits.

    Custom processors run before the temperature / top-p warpers, so ``scores`` are the model's
    logits; step t's distribution is kept until step t+1 reveals which token was drawn. The
    log-prob is of the temperature-scaled distribution before top-p truncation, the policy the
    objective's ratio refers to (top-p is a sampling device, as in the verl reference).
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.prev_BV: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev_BV is not None:
            self.steps.append(self.prev_BV.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev_BV = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens_B: torch.Tensor) -> torch.Tensor:
        assert self.prev_BV is not None
        self.steps.append(self.prev_BV.gather(1, last_tokens_B[:, None]).squeeze(1))
        return torch.stack(self.steps, dim=1)


def sampling_kwargs(*, max_new_tokens: int, temperature: float, top_p: float) -> dict:
    """Every sampling knob set explicitly: a checkpoint's generation_config.json (Qwen2.5 ships
    top_k=20 and repetition_penalty=1.05) must not silently change the sampling distribution."""
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": True,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": 0,
        "min_p": None,
        "typical_p": 1.0,
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "num_beams": 1,
    }


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    greedy: bool = False,
    ignore_eos: bool = False,
    engine: str = "dapo",
) -> Rollout:
    """Sample ``group_size`` responses for each prompt (rows ``i*G .. i*G+G-1`` are prompt i).

    Seeding torch's generator with ``seed`` makes the rollout reproducible for a given policy.
    ``greedy`` decodes the argmax instead (evaluation's greedy accuracy). The two engines sample
    the same distribution but draw different random numbers: a seed's tokens are per engine.
    """
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    device = next(model.parameters()).device
    prompt_ids_BP = enc["input_ids"].repeat_interleave(group_size, dim=0).to(device)
    prompt_mask_BP = enc["attention_mask"].repeat_interleave(group_size, dim=0).to(device)
    if engine == "dapo":
        response_ids_BT, logprobs_BT, slots = decode(
            model,
            enc["input_ids"].to(device),
            enc["attention_mask"].to(device),
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            greedy=greedy,
            ignore_eos=ignore_eos,
        )
        return _finish(
            tokenizer, prompt_ids_BP, prompt_mask_BP, response_ids_BT, logprobs_BT, slots
        )
    if engine != "hf":
        raise ValueError(f"rollout engine {engine!r}: use 'dapo' or 'hf'")
    recorder = _SampledLogprobs(temperature)
    kwargs = sampling_kwargs(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    if greedy:  # argmax decoding (evaluation only): the warpers above are then unused
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if ignore_eos:  # benchmarks: EOS is masked until max_new_tokens, fixing the work done
        kwargs["min_new_tokens"] = max_new_tokens
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=prompt_ids_BP,
        attention_mask=prompt_mask_BP,
        logits_processor=LogitsProcessorList([recorder]),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **kwargs,
    )
    response_ids_BT = out[:, prompt_ids_BP.shape[1] :]
    logprobs_BT = recorder.finish(response_ids_BT[:, -1])
    slots = response_ids_BT.numel()  # generate runs every row to the longest response
    return _finish(tokenizer, prompt_ids_BP, prompt_mask_BP, response_ids_BT, logprobs_BT, slots)


def _finish(
    tokenizer, prompt_ids_BP, prompt_mask_BP, response_ids_BT, logprobs_BT, slots: int
) -> Rollout:
    """Masks, lengths and texts of generated ids; tokens after the first EOS become padding."""
    is_eos_BT = response_ids_BT == tokenizer.eos_token_id
    # Tokens up to and including the first EOS are the response; generate pads after it.
    after_eos_BT = (is_eos_BT.cumsum(dim=1) - is_eos_BT.long()) > 0
    response_mask_BT = ~after_eos_BT
    lengths_B = response_mask_BT.sum(dim=1)
    truncated_B = ~is_eos_BT.any(dim=1)
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
