"""The ``hf`` rollout engine: transformers ``generate``, the reference and the fallback for a
model whose KV cache cannot be repeated or sliced by row.

Shapes: see :mod:`dapo.rollout.base`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from dapo.models.logprobs import autocast
from dapo.rollout.base import (
    LiveModelEngine,
    Prompts,
    Rollout,
    check_request,
    concat_rollouts,
    encode_prompts,
    finish_rollout,
)


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


class _MaskTokens(LogitsProcessor):
    """``ignore_eos``: the stop tokens never drawn, masked after ``_SampledLogprobs`` recorded
    the policy with them (``min_new_tokens`` would mask them before any custom processor)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = list(token_ids)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ids = torch.tensor(self.token_ids, dtype=torch.long, device=scores.device)
        return scores.index_fill(1, ids, float("-inf"))


def sampling_kwargs(*, max_new_tokens: int, temperature: float, top_p: float) -> dict:
    """Every sampling knob set explicitly: a checkpoint's generation_config.json (Qwen2.5 ships
    top_k=20 and repetition_penalty=1.05) must not silently change the sampling distribution
    (nor may the settings it has and these are not: :func:`checkpoint_settings_off`)."""
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


@contextmanager
def checkpoint_settings_off(model: torch.nn.Module) -> Iterator[None]:
    """``model.generate`` in the block reads none of the model's generation_config but its
    BOS id and cache kind. generate fills every setting it is not given from the checkpoint's
    generation_config.json: ``min_new_tokens``, ``suppress_tokens``, ``bad_words_ids``,
    ``sequence_bias``, ``forced_eos_token_id`` or ``epsilon_cutoff`` there changed the
    distribution the tokens were drawn from, and the recorded log-probs described another."""
    own = getattr(model, "generation_config", None)
    if own is None:
        yield
        return
    model.generation_config = GenerationConfig(
        bos_token_id=own.bos_token_id, cache_implementation=own.cache_implementation
    )
    try:
        yield
    finally:
        model.generation_config = own


class HFEngine(LiveModelEngine):
    """Samples with ``model.generate`` on the trainer's live module (nothing to sync).

    Every row runs to the longest response of its batch, and each of a group's G rows runs
    its prompt again; the native engine avoids both.
    """

    @torch.inference_mode()
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
        """See :class:`dapo.rollout.base.Engine`; ``greedy`` decodes the argmax. ``generate``
        draws from one global generator, so a seed per prompt costs a call per prompt."""
        sampling = dict(
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            greedy=greedy,
            ignore_eos=ignore_eos,
        )
        check_request(prompts, group_size, max_new_tokens, temperature, top_p, greedy)
        if not isinstance(seed, int) and len(seed) != len(prompts):
            raise ValueError(f"{len(seed)} seeds for {len(prompts)} prompts: give one each")
        with self.sampling_model() as model:
            if isinstance(seed, int):
                return self._generate(model, prompts, seed, **sampling)
            pairs = zip(prompts, seed, strict=True)
            parts = [self._generate(model, [p], int(s), **sampling) for p, s in pairs]
            return concat_rollouts(parts, self.tokenizer.pad_token_id)

    def _generate(
        self,
        model: torch.nn.Module,
        prompts: Prompts,
        seed: int,
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        greedy: bool,
        ignore_eos: bool,
    ) -> Rollout:
        """One ``model.generate`` call over ``prompts``, seeded with ``seed``."""
        tokenizer = self.tokenizer
        ids_nP, mask_nP = encode_prompts(tokenizer, prompts, self.device)
        prompt_ids_BP = ids_nP.repeat_interleave(group_size, dim=0)
        prompt_mask_BP = mask_nP.repeat_interleave(group_size, dim=0)
        recorder = _SampledLogprobs(temperature if temperature > 0 else 1.0)  # greedy at 0
        kwargs = sampling_kwargs(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p
        )
        if greedy:  # argmax decoding (evaluation only): the warpers above are then unused
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        processors = [recorder]
        if ignore_eos:  # benchmarks: stop tokens masked until max_new_tokens, fixing the work
            processors.append(_MaskTokens(self.stop_token_ids))
        # generate draws from the global generators: seeded for this call, then put back, so
        # that a rollout leaves the caller's random stream where it was.
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with (
            torch.random.fork_rng(devices=devices),
            autocast(model, self.compute_dtype, self.device),
            checkpoint_settings_off(model),
        ):
            torch.manual_seed(seed)
            out = model.generate(
                input_ids=prompt_ids_BP,
                attention_mask=prompt_mask_BP,
                logits_processor=LogitsProcessorList(processors),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=list(self.stop_token_ids),
                **kwargs,
            )
        response_ids_BT = out[:, prompt_ids_BP.shape[1] :]
        logprobs_BT = recorder.finish(response_ids_BT[:, -1])
        slots = response_ids_BT.numel()  # generate runs every row to the longest response
        return finish_rollout(
            tokenizer,
            prompt_ids_BP,
            prompt_mask_BP,
            response_ids_BT,
            logprobs_BT,
            slots,
            self.stop_token_ids,
        )
