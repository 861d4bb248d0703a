"""The CUDA-graph path's token draw in two levels, from the float32 logits themselves.

A decoding step's draw is memory-bound: the float32 logits [A, V] are the only large input
(156 MB for 256 rows of a 152k vocabulary), and what the draw needs of them is one mass per
block of :func:`block_tokens` tokens and the tokens of one block per row. Building the
float64 softmax first (:func:`dapo.rollout.sampling.sampling_probs`) writes and reads a
float64 copy and a float64 softmax of every row (measured on an H200 at 256 rows: ~1 ms of a
5.2 ms step). Here :func:`block_masses` reads the logits once and writes [A, K] float64
masses; compiled (``torch.compile``, as the decoding step is) its reductions and float64
arithmetic fuse (inductor on a CPU: one kernel), and no float64 value of a token is stored.
The masses are unnormalised, exp(l - max) summed per block, so the total is not 1: the
target is u x total, and the token is the one the normalised probabilities give, up to
float64 rounding of the partial sums.

Shapes: A = rows, V = vocabulary, K = blocks, B = tokens per block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dapo.rollout.decoder_step import compiled, dynamic

BLOCK_TOKENS = 256
"""Most tokens per block of the two-level inversion."""


def block_tokens(vocab: int) -> int:
    """Tokens per block for a vocabulary of ``vocab``: the largest power of two from 64 to
    ``BLOCK_TOKENS`` that divides it (Qwen2.5's and Qwen3's 151,936 tokens: 128; Llama 3's
    128,256 and SmolLM2's 49,152: 256), so that the blocks are a view of the probabilities;
    ``BLOCK_TOKENS`` when none does (the vocabulary is then padded)."""
    block = BLOCK_TOKENS
    while block >= 64:
        if vocab % block == 0:
            return block
        block //= 2
    return BLOCK_TOKENS


def just_below(x: torch.Tensor) -> torch.Tensor:
    """The largest float below each (positive) element."""
    return torch.nextafter(x, torch.zeros_like(x))


def block_masses(logits_AV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass [A, K] in float64, max [A, 1] in float32): each block's sum of
    exp(double(l) - double(max)), the row's softmax times its normaliser, from one read of
    the logits (a vocabulary no block size divides is padded with -inf: zero mass).

    Each block is first taken relative to its own maximum, then scaled by exp(its maximum -
    the row's), so that a kernel needs only the block it reads, not the row's maximum first
    (a second pass over the logits). Eagerly this holds a float64 [A, V] temporary (callers
    split the rows); compiled, the float64 values stay in registers. A row of NaN (or of
    only -inf, or with +inf) gets NaN masses, as the softmax does."""
    rows, vocab = logits_AV.shape
    block = block_tokens(vocab)
    if vocab % block:
        logits_AV = F.pad(logits_AV, (0, block - vocab % block), value=float("-inf"))
    blocks_AKB = logits_AV.reshape(rows, -1, block)
    top_AK1 = blocks_AKB.amax(dim=-1, keepdim=True)
    # A block of only -inf (masked tokens, padding) is offset by 0: -inf - -inf is NaN.
    offset_AK1 = torch.where(top_AK1 == float("-inf"), 0.0, top_AK1).double()
    # A copy even of float64 logits: the in-place steps keep one [A, V] temporary eagerly.
    sums_AK = blocks_AKB.to(torch.float64, copy=True).sub_(offset_AK1).exp_().sum(dim=-1)
    max_A1 = top_AK1.amax(dim=1)
    # exp(-inf - max) = 0: a block of only -inf keeps zero mass whatever the row's maximum.
    return sums_AK * (top_AK1[..., 0].double() - max_A1.double()).exp(), max_A1


def compiled_masses(backend: str | Callable, mode: str | None = None) -> Callable:
    """:func:`block_masses` compiled by ``backend`` in ``mode`` (the decoding step's), traced
    once for every number of rows (2 and up: a size-1 dimension is traced as a constant)."""
    masses = compiled(block_masses, backend, mode)

    def call(logits_AV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic(logits_AV, dims=(0,))
        return masses(logits_AV)

    return call


def pick_block(mass_AK: torch.Tensor, u_A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block [A, 1], target within it [A, 1]): the block whose interval of the running sum
    of ``mass`` holds ``u`` x (total mass), and how far into that block's mass the target is.

    Targets stay strictly below the mass they are compared with, and never below zero, so a
    block (and then a token) of zero mass is never picked. right=True: the first block whose
    running sum exceeds the target (it has mass). The clamp only acts on a row of NaN logits
    (no target is below a NaN sum): its block is then a valid one, not one past the end,
    which on CUDA would be a device-side assert where the caller means to raise
    FloatingPointError at its next check."""
    cdf_AK = mass_AK.cumsum(dim=-1)
    target_A1 = u_A.double()[:, None] * cdf_AK[:, -1:]
    target_A1 = torch.minimum(target_A1, just_below(cdf_AK[:, -1:]))
    block_A1 = torch.searchsorted(cdf_AK, target_A1, right=True).clamp_(max=cdf_AK.shape[1] - 1)
    before_A1 = cdf_AK.gather(1, block_A1) - mass_AK.gather(1, block_A1)
    return block_A1, (target_A1 - before_A1).clamp(min=0.0)


def pick_within(within_AB: torch.Tensor, inner_A1: torch.Tensor) -> torch.Tensor:
    """The token [A, 1] of a block (its masses ``within``) whose interval of their running
    sum holds ``inner``, kept strictly below the block's total (a row of NaN: B, which the
    caller clamps)."""
    within_cdf_AB = within_AB.cumsum(dim=-1)
    inner_A1 = torch.minimum(inner_A1, just_below(within_cdf_AB[:, -1:]))
    return torch.searchsorted(within_cdf_AB, inner_A1, right=True)


def draw_by_blocks(
    logits_AV: torch.Tensor, u_A: torch.Tensor, masses: Callable = block_masses
) -> torch.Tensor:
    """Token [A] drawn from softmax(logits) by inverse CDF of ``u``, in two levels: the block
    from ``masses`` (:func:`block_masses`, or its compiled form), then the token from the
    chosen block's logits, exponentiated again in float64 relative to the row's maximum.

    The same token as inverting the float64 softmax by blocks
    (:func:`dapo.rollout.sampling.invert_by_blocks`) up to float64 rounding (a ``u`` within
    ~1e-16 of a boundary). A token of zero probability (-inf) is never drawn; a row of NaN
    draws a valid index. A block's largest token has exp(its maximum - the row's) as its
    within-block mass, the factor its block mass is scaled by: a block of nonzero mass always
    has a token of nonzero mass, even where that factor underflows."""
    rows, vocab = logits_AV.shape
    block = block_tokens(vocab)
    mass_AK, max_A1 = masses(logits_AV)
    block_A1, inner_A1 = pick_block(mass_AK, u_A)
    index_AB = block_A1 * block + torch.arange(block, device=logits_AV.device)
    # Past the vocabulary (the padded last block) the last token is read again: after every
    # real token in the running sum, so a target reaches it only by rounding, and the clamp
    # below then gives that last token, which has mass (else the copies have none either).
    chosen_AB = logits_AV.gather(1, index_AB.clamp(max=vocab - 1))
    within_AB = (chosen_AB.double() - max_A1.double()).exp()
    token_A1 = pick_within(within_AB, inner_A1)
    return (block_A1 * block + token_A1)[:, 0].clamp_(max=vocab - 1)
