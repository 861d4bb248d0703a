"""The native rollout engine (``rollout.engine=dapo``), this project's own decoding loop: one
prefill per prompt, finished rows leave the batch.

Three things make it cheaper than ``model.generate`` for GRPO-style groups, none of which
changes what is sampled:

- the G responses of a prompt share its prefill: the prompt goes through the model once and
  its KV cache is repeated G times (a group's prompt is most of the tokens in a short rollout);
- a row that has emitted EOS is removed from the batch and its KV cache, so no compute is
  spent on padding after a finished response; the cache is written in place and a finished
  row leaves it without the cache being copied (:mod:`dapo.rollout.kv_cache`);
- each row draws one uniform number per step (from a generator seeded for the whole batch, or,
  with one seed per prompt, from that prompt's own stream, so that a prompt's samples do not
  depend on the prompts batched with it: ranks split a round and still draw what one process
  draws), and turns it into a token by inverting the CDF (float64 throughout: the exact
  softmax, up to a total variation below 1e-11 on a 152k vocabulary; 8e-13 measured on a long
  tail). Row b's token at step t depends only on its own logits and ``u[t, b]``, never on
  which other rows are still running or batched: removing finished rows gives the same tokens
  as keeping them (``drop_finished=False``, tested), and a prompt alone the same as in a batch.
  That is exact in float32 (tested); in bf16 it holds up to rounding: a batch of another shape
  may round a logit differently, and a ``u`` within that rounding of a CDF boundary then picks
  the neighbouring token (3 of 80 rows of a tiny model's 60 tokens differed alone and
  batched). A rerun repeats the same batch shapes, so a seed's tokens are reproducible,
  resumes included.

The log-prob recorded for each token is that of the temperature-scaled distribution before
top-p truncation and with EOS unmasked: the policy's own probability, the one the objective's
ratio divides by and that a fresh forward pass recomputes.

Shapes: n = prompts, B = n x G rows, A = rows still running, P = prompt tokens (left padded),
T = steps, V = vocabulary.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dapo.models.compiled_layers import COMPILER_ERRORS
from dapo.models.logprobs import (
    autocast,
    cache_argument,
    prompt_pass,
    returned_cache,
    row_sliceable,
)
from dapo.rollout.base import (
    LiveModelEngine,
    Prompts,
    Rollout,
    check_request,
    encode_prompts,
    finish_rollout,
)
from dapo.rollout.decoder_step import unsupported_reason
from dapo.rollout.kv_cache import RowCache
from dapo.rollout.parking import Parked, Parking, prefix_cache
from dapo.rollout.sampling import (  # noqa: F401  (where the tests and callers found them)
    CDF_CHUNK_ELEMENTS,
    NONFINITE_LOGITS,
    Uniforms,
    draw_tokens,
    sample_from_logits,
    sampling_cdf,
)
from dapo.rollout.static_decode import static_decode


class NativeEngine(LiveModelEngine):
    """Samples with :func:`decode` on the trainer's live module (nothing to sync); its
    log-probs are the policy's own (a float32 forward pass gives them to 1e-5, tested).

    The module may be a tensor-parallel copy (:mod:`dapo.dist.tensor_parallel`), unchanged:
    every rank of its group calls ``generate`` with the same prompts and seeds, sees the same
    logits, and so finishes the same rows at the same steps as the others."""

    cuda_graphs: bool = True
    """On CUDA, decode with :func:`dapo.rollout.static_decode.static_decode` when
    :class:`~dapo.rollout.decoder_step.DecoderStep` can run the model (``rollout.cuda_graphs``)."""

    compile_step: bool = True
    """On the CUDA-graph path, compile the step's layer and draw with inductor
    (``rollout.compile_step``); off after a compiler error, with a warning."""

    compile_mode: str | None = None
    """``torch.compile``'s mode for the compiled step (None: inductor's default; see
    :class:`~dapo.rollout.decoder_step.DecoderStep`). ``benchmarks/gpu.py --variants`` times
    ``"max-autotune-no-cudagraphs"``."""

    width_step: int | None = None
    """The CUDA-graph path's attention reads cache columns in multiples of this (None:
    :data:`~dapo.rollout.static_decode.WIDTH_STEP`): smaller reads fewer unfilled columns and
    captures more graphs. ``benchmarks/gpu.py --variants`` times 128."""

    continues_from_cache = True
    """``generate`` parks the rows that stop at ``park_at`` and continues rows from their
    ``prefixes`` (:mod:`dapo.rollout.parking`): an episode's next turn prefills only the
    tokens added since its last (the episode runner asks for it)."""

    def static_path(self) -> bool:
        """Whether ``generate`` takes the CUDA-graph path (once per engine, a warning when a
        CUDA model cannot)."""
        if not self.cuda_graphs or self.device.type != "cuda":
            return False
        if not hasattr(self, "_static_reason"):
            self._static_reason = unsupported_reason(self.model)
            if self._static_reason is not None:
                warnings.warn(
                    f"rollout.engine=dapo decodes eagerly (a read on the host per token): "
                    f"the CUDA-graph path cannot run this model: {self._static_reason}",
                    stacklevel=2,
                )
        return self._static_reason is None

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
        park_at: Sequence[int] = (),
        prefixes: Sequence[Parked | None] | None = None,
    ) -> Rollout:
        """See :class:`dapo.rollout.base.Engine`; ``greedy`` decodes the argmax. The rows that
        stop at one of ``park_at`` keep their KV cache (``Rollout.parked``); ``prefixes``: a
        parked cache (or None) for each prompt (given as token ids) that begins with its
        tokens, which the prefill then does not compute again."""
        check_request(prompts, group_size, max_new_tokens, temperature, top_p, greedy)
        tok = self.tokenizer
        ids_nP, mask_nP = encode_prompts(tok, prompts, self.device)
        prefix = None
        if prefixes is not None:
            prefix, _ = prefix_cache(prefixes, prompts, ids_nP.shape[1])
        parking = Parking(park_at, self.device) if park_at else None
        options = dict(
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            pad_token_id=tok.pad_token_id,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            greedy=greedy,
            ignore_eos=ignore_eos,
            parking=parking,
            prefix=prefix,
        )
        if self.static_path():
            decoded = self._static_decode(ids_nP, mask_nP, options)
        else:
            with self.sampling_model() as model, autocast(model, self.compute_dtype, self.device):
                decoded = decode(model, ids_nP, mask_nP, **options)
        response_ids_BT, logprobs_BT, slots = decoded
        out = finish_rollout(
            tok,
            ids_nP.repeat_interleave(group_size, dim=0),
            mask_nP.repeat_interleave(group_size, dim=0),
            response_ids_BT,
            logprobs_BT,
            slots,
            self.stop_token_ids,
        )
        if parking is not None:
            out.parked = parking.rows(
                out.prompt_ids_BP, out.prompt_mask_BP, out.response_ids_BT, out.lengths_B
            )
        return out

    def _static_decode(self, ids_nP: torch.Tensor, mask_nP: torch.Tensor, options: dict):
        """The CUDA-graph path, compiled unless ``compile_step`` is off; a compiler error
        turns compilation off for this engine and decodes again uncompiled (nothing of the
        failed call is kept: its buffers and uniforms are its own; the columns its prefill
        added to a continuation's prefix cache and the rows it parked are taken back)."""
        compile = COMPILE_BACKEND if self.compile_step else None
        prefix = options["prefix"]
        cached = None if prefix is None else prefix.get_seq_length()
        try:
            return static_decode(
                self.model,
                ids_nP,
                mask_nP,
                compute_dtype=self.compute_dtype,
                compile=compile,
                compile_mode=self.compile_mode,
                width_step=self.width_step,
                **options,
            )
        except COMPILER_ERRORS as err:
            if compile is None:
                raise
            # A backend's failure wraps the compiler's own error: that one says what is missing.
            cause = getattr(err, "inner_exception", None) or err
            first_line = (str(cause).strip().splitlines() or [""])[0]
            warnings.warn(
                f"rollout.compile_step: torch.compile failed ({type(cause).__name__}: "
                f"{first_line}); the dapo engine decodes with the uncompiled step from now on "
                "(rollout.compile_step=false skips compiling)",
                stacklevel=3,
            )
            self.compile_step = False
            if prefix is not None:  # the failed call's prefill appended its columns to it
                for layer in prefix.layers:  # (crop's argument means another thing in 5.x)
                    layer.keys = layer.keys[..., :cached, :]
                    layer.values = layer.values[..., :cached, :]
            if options["parking"] is not None:  # and may have parked rows
                options["parking"].held.clear()
            return static_decode(
                self.model,
                ids_nP,
                mask_nP,
                compute_dtype=self.compute_dtype,
                width_step=self.width_step,
                **options,
            )


COMPILE_BACKEND = "inductor"
"""``torch.compile``'s backend for the step: Triton kernels on a GPU."""


@torch.inference_mode()
def decode(
    model,
    prompt_ids_nP: torch.Tensor,
    prompt_mask_nP: torch.Tensor,
    *,
    group_size: int,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    greedy: bool = False,
    ignore_eos: bool = False,
    drop_finished: bool = True,
    parking: Parking | None = None,
    prefix=None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sample ``group_size`` responses per prompt (rows i*G .. i*G+G-1 are prompt i).

    Returns (response ids [B, T], log-probs [B, T], slots): tokens after a row's EOS are
    ``pad_token_id`` with log-prob 0; T is the longest response, at most ``max_new_tokens``;
    slots counts the (row, step) positions sampled, finished rows included when kept.
    A row finishes at the first of ``stop_token_ids``. ``ignore_eos`` masks every stop token
    at every step (fixed-length benchmarks). ``drop_finished=False``
    keeps finished rows in the batch (fed padding, as ``generate`` does): the reference the
    removal is tested against. ``seed``: one for the batch, or one per prompt
    (:class:`Uniforms`). ``parking`` collects the caches of the rows that stop at its tokens;
    ``prefix``: the KV cache of the prompts' first columns (:func:`prefix_cache`).
    """
    device = prompt_ids_nP.device
    num_rows = prompt_ids_nP.shape[0] * group_size
    stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=device)
    width = prompt_ids_nP.shape[1] + max_new_tokens
    cache, logits_AV = _prefill(model, prompt_ids_nP, prompt_mask_nP, group_size, width, prefix)
    live = _Rows.start(prompt_mask_nP, group_size, width)
    tokens_BT = torch.full(
        (num_rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device
    )
    logprobs_BT = torch.zeros((num_rows, max_new_tokens), dtype=torch.float32, device=device)
    uniforms = Uniforms(seed, num_prompts=prompt_ids_nP.shape[0], group_size=group_size)
    steps = slots = 0
    for t in range(max_new_tokens):
        u_B = uniforms.step(t).to(device)
        token_A, logp_A = draw_tokens(
            logits_AV,
            u_B[live.rows_A],
            temperature=temperature,
            top_p=top_p,
            greedy=greedy,
            masked_tokens=stops if ignore_eos else None,
        )
        running_A = ~live.done_A
        tokens_BT[live.rows_A[running_A], t] = token_A[running_A]
        logprobs_BT[live.rows_A[running_A], t] = logp_A[running_A]
        steps = t + 1
        slots += live.rows_A.numel()
        finished_A = running_A & torch.isin(token_A, stops)
        if ignore_eos:
            finished_A = torch.zeros_like(running_A)
        if parking is not None:
            live.park(parking, finished_A & torch.isin(token_A, parking.stops), cache)
        if t == max_new_tokens - 1:
            break
        token_A = live.retire(finished_A, token_A, cache, drop=drop_finished, pad=pad_token_id)
        if token_A is None:
            break
        logits_AV = live.forward(model, cache, token_A)
    return tokens_BT[:, :steps], logprobs_BT[:, :steps], slots


@dataclass
class _Rows:
    """The batch rows still decoding: the output row each one is, its attention mask (the
    ``prompt`` positions first, ``width`` positions in use) and next position, and (only when
    finished rows are kept) whether it has finished."""

    rows_A: torch.Tensor
    mask_AW: torch.Tensor
    prompt: int
    width: int
    next_pos_A: torch.Tensor
    done_A: torch.Tensor

    @classmethod
    def start(cls, prompt_mask_nP: torch.Tensor, group_size: int, width: int) -> _Rows:
        """Every row running; the mask has room for ``width`` positions: the prompt's, then
        ones (a finished row leaves the batch, so a running row attends to all its response)."""
        prompt = prompt_mask_nP.shape[1]
        mask_BP = prompt_mask_nP.repeat_interleave(group_size, dim=0)
        mask_BW = mask_BP.new_ones((mask_BP.shape[0], width))
        mask_BW[:, :prompt] = mask_BP
        return cls(
            rows_A=torch.arange(mask_BP.shape[0], device=mask_BP.device),
            mask_AW=mask_BW,
            prompt=prompt,
            width=prompt,
            next_pos_A=mask_BP.long().sum(dim=1),
            done_A=torch.zeros(mask_BP.shape[0], dtype=torch.bool, device=mask_BP.device),
        )

    def retire(self, finished_A, token_A, cache: RowCache, *, drop: bool, pad: int):
        """Remove the rows that just finished from the batch and its cache (``drop``), or mark
        them done and feed them padding; the tokens to feed next, or None when none runs."""
        if not drop:
            self.done_A = self.done_A | finished_A
            return None if self.done_A.all() else token_A.masked_fill(self.done_A, pad)
        if finished_A.any():
            keep_A = ~finished_A
            if not keep_A.any():
                return None
            order_A = cache.keep(keep_A)  # rows change places: the per-row state follows
            self.rows_A, token_A = self.rows_A[order_A], token_A[order_A]
            # Past the prompt every running row's mask is ones: only the prompt's part moves.
            prompt_AP = self.mask_AW[order_A, : self.prompt]
            self.mask_AW = self.mask_AW[: order_A.numel()]
            self.mask_AW[:, : self.prompt] = prompt_AP
            self.next_pos_A, self.done_A = self.next_pos_A[order_A], self.done_A[order_A]
        return token_A

    def park(self, parking: Parking, park_A: torch.Tensor, cache: RowCache) -> None:
        """Hand ``parking`` the caches of the rows ``park_A`` (they just stopped at a turn
        end: their stop token is not in the cache)."""
        slots = park_A.nonzero().squeeze(1)
        if slots.numel():
            first = self.prompt - self.mask_AW[slots, : self.prompt].sum(dim=1)
            layers = cache.cache.layers
            buffers = [buf for layer in layers for buf in (layer.key_buf, layer.value_buf)]
            parking.take(slots, self.rows_A[slots].tolist(), buffers, self.width, first.tolist())

    def forward(self, model, cache: RowCache, token_A) -> torch.Tensor:
        """One decoding step of every row in the batch; the next logits [A, V] in float32."""
        self.width += 1
        out = model(
            input_ids=token_A[:, None],
            attention_mask=self.mask_AW[:, : self.width],
            position_ids=self.next_pos_A[:, None],
            use_cache=True,
            **cache_argument(model, cache.cache),
        )
        self.next_pos_A = self.next_pos_A + 1
        return out.logits[:, -1].float()


def _prefill(model, prompt_ids_nP, prompt_mask_nP, group_size: int, width: int, prefix=None):
    """One forward pass per prompt (after the ``prefix`` columns, when given); its KV cache
    (room for ``width`` positions) and last logits repeated G times."""
    out = prompt_pass(model, prompt_ids_nP, prompt_mask_nP, prefix)
    cache = returned_cache(out)
    if not row_sliceable(cache):
        raise ValueError(
            f"rollout.engine=dapo: {type(model).__name__}'s KV cache "
            f"({type(cache).__name__}) cannot be repeated or sliced by row; "
            "set rollout.engine=hf (transformers generate)"
        )
    device = prompt_ids_nP.device.type
    held = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    rows = RowCache(cache, group_size=group_size, max_length=width, dtype=held)
    return rows, out.logits[:, -1].float().repeat_interleave(group_size, dim=0)
