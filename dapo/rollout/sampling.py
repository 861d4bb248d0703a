"""Drawing a token: inverse-CDF sampling from the policy's exact softmax, in float64.

Shared by the native engine's eager loop (:mod:`dapo.rollout.native`) and its CUDA-graph loop
(:mod:`dapo.rollout.static_decode`), so both draw the same token from the same logits and
uniform number. Nothing here reads a value on the host except the optional finiteness check.

The CUDA-graph path draws in two levels (``by_blocks``: the block of :func:`block_tokens`
tokens, then the token within it). Without top-p it reads the float32 logits once
(:mod:`dapo.rollout.block_draw`): a step's draw is memory-bound, and the float64 softmax of
every row that the other ways build first moves ~5 times the logits' bytes (measured on an
H200, 256 rows of a 152k vocabulary: ~1 ms of a 5.2 ms step).

Shapes: A = rows, V = vocabulary, K = blocks of :func:`block_tokens` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from dapo.rollout.block_draw import (
    block_masses,
    block_tokens,
    compiled_masses,
    draw_by_blocks,
    pick_block,
    pick_within,
)

# Rows of a [rows, V] float64 CDF built at once: 2**24 elements, 128 MiB per array (a few
# such arrays, more with top-p's sort), so a 152k vocabulary never needs float64 copies of
# every running row's distribution.
CDF_CHUNK_ELEMENTS = 1 << 24


NONFINITE_LOGITS = "the policy's logits hold NaN or +inf; cannot sample"


def sampling_cdf(logits_AV: torch.Tensor, *, top_p: float = 1.0):
    """(CDF [A, V] in float64, token order [A, V] or None): what inverse-CDF sampling reads.

    The probabilities and their running sum are float64: in float32 a cumulative sum over a
    152k vocabulary drifts by up to ~1e-3 in total variation, and a token whose probability
    is below the sum's spacing (~6e-8 near 1) is never drawn, while the importance ratio
    assumes the exact softmax. With top-p, tokens are in decreasing probability (the order is
    returned) and the ones outside the nucleus have zero mass: the smallest set of most likely
    tokens whose mass reaches ``top_p`` (a token is kept when the mass strictly above it is
    below ``top_p``), as transformers' TopPLogitsWarper keeps.
    """
    probs_AV, order_AV = sampling_probs(logits_AV, top_p=top_p)
    return probs_AV.cumsum(dim=-1), order_AV


def sampling_probs(logits_AV: torch.Tensor, *, top_p: float = 1.0):
    """(probabilities [A, V] in float64, token order [A, V] or None): the distribution whose
    running sum is :func:`sampling_cdf`."""
    probs_AV = torch.softmax(logits_AV.double(), dim=-1)
    order_AV = None
    if top_p < 1.0:
        # Stable: tied probabilities at the nucleus edge are ordered the same on every run.
        probs_AV, order_AV = probs_AV.sort(dim=-1, descending=True, stable=True)
        mass_above_AV = probs_AV.cumsum(dim=-1) - probs_AV
        probs_AV = probs_AV.masked_fill(mass_above_AV >= top_p, 0.0)
    return probs_AV, order_AV


def invert_by_blocks(probs_AV: torch.Tensor, u_A: torch.Tensor) -> torch.Tensor:
    """The token whose interval of the running sum of ``probs`` holds ``u`` x (total mass),
    found in two levels: the block of :func:`block_tokens` tokens (from the blocks' masses
    and their running sum), then the token within that block (its own running sum).

    A running sum over the whole vocabulary is one long scan per row, the slowest kernel of a
    decoding step on a GPU (measured on an H100: 0.29 ms of a 64-row step of a 152k
    vocabulary, more than a layer's matmuls); block sums are a plain reduction and the two
    scans are short. The draw is the whole-vocabulary inversion's up to float64 rounding of
    the partial sums (a ``u`` within ~1e-16 of a boundary). Targets stay strictly below the
    mass they are compared with, and never below zero, so a token of zero probability (a
    masked one) is never drawn.
    """
    rows, vocab = probs_AV.shape
    block = block_tokens(vocab)
    if vocab % block:  # a copy of every probability: a vocabulary no block size divides
        probs_AV = F.pad(probs_AV, (0, block - vocab % block))
    blocks_AKB = probs_AV.view(rows, -1, block)
    block_A1, inner_A1 = pick_block(blocks_AKB.sum(dim=-1), u_A)
    within_AB = blocks_AKB.gather(1, block_A1[:, :, None].expand(-1, 1, block))[:, 0]
    token_A1 = pick_within(within_AB, inner_A1)
    return (block_A1 * block + token_A1)[:, 0].clamp_(max=vocab - 1)


def sample_from_logits(
    logits_AV: torch.Tensor,
    u_A: torch.Tensor,
    *,
    top_p: float = 1.0,
    check: bool = True,
    by_blocks: bool = False,
    compile: str | Callable | None = None,
    compile_mode: str | None = None,
):
    """Token drawn from softmax(logits) (restricted to the top-p nucleus) by inverse CDF of ``u``.

    ``u`` in [0, 1) (float64 for 53 bits) picks the token whose CDF interval (``sampling_cdf``)
    contains ``u`` x (kept mass); tokens of zero probability are never drawn. Row a's token
    depends only on its logits and ``u[a]``. Rows go through in blocks, so memory is bounded
    by ``CDF_CHUNK_ELEMENTS`` whatever the batch. ``check=False`` leaves out the test for
    NaN and +inf logits (a read on the host: the CUDA-graph path tests on the device).
    ``by_blocks`` finds the token in two levels (fewer bytes, more kernels; the CUDA-graph
    path's choice) instead of one running sum over the vocabulary (fewer kernels: the eager
    loop's, and faster on a CPU): without top-p from the logits' block masses
    (:func:`dapo.rollout.block_draw.draw_by_blocks`), with ``compile`` (a ``torch.compile``
    backend, in ``compile_mode``) with the masses' pass compiled, for all rows at once;
    with top-p from the float64 probabilities (:func:`invert_by_blocks`).
    """
    if check:
        check_finite(logits_AV)
    vocab = logits_AV.shape[-1]
    from_logits = by_blocks and top_p == 1.0
    whole = from_logits and compile is not None  # compiled: no float64 [rows, V] temporary
    rows = max(1, len(logits_AV) if whole else CDF_CHUNK_ELEMENTS // vocab)
    masses = compiled_masses(compile, compile_mode) if whole else block_masses
    out = []
    for logits_block, u_block in zip(logits_AV.split(rows), u_A.split(rows), strict=True):
        if from_logits:
            out.append(draw_by_blocks(logits_block, u_block, masses))
            continue
        probs_AV, order_AV = sampling_probs(logits_block, top_p=top_p)
        if by_blocks:
            idx_A = invert_by_blocks(probs_AV, u_block)
        else:
            cdf_AV = probs_AV.cumsum(dim=-1)
            target_A1 = (u_block.double() * cdf_AV[:, -1]).unsqueeze(1)
            # right=True: the first index whose CDF exceeds the target, never a zero-mass token.
            idx_A = torch.searchsorted(cdf_AV, target_A1, right=True).squeeze(1)
            idx_A = idx_A.clamp(max=vocab - 1)
        if order_AV is not None:
            idx_A = order_AV.gather(1, idx_A[:, None]).squeeze(1)
        out.append(idx_A)
    return torch.cat(out)


def check_finite(logits_AV: torch.Tensor) -> None:
    """Raise ``FloatingPointError`` where a row holds NaN or +inf (fp16 overflow): no
    distribution to draw from (-inf alone is a mask). A read on the host."""
    if not torch.isfinite(logits_AV.amax(dim=-1)).all():
        raise FloatingPointError(NONFINITE_LOGITS)


def draw_tokens(
    logits_AV: torch.Tensor,
    u_A: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    greedy: bool,
    masked_tokens: torch.Tensor | None,
    check: bool = True,
    by_blocks: bool = False,
    compile: str | Callable | None = None,
    compile_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each running row's next token and its log-prob under the temperature-scaled policy
    (before top-p, and with ``masked_tokens`` unmasked: the policy's own probability).
    ``check``: NaN or +inf logits raise ``FloatingPointError``, greedy or sampled;
    ``by_blocks``, ``compile`` and ``compile_mode``: :func:`sample_from_logits`'s."""
    # Dividing by 1 changes nothing: skipped, a pass over [A, V] less a step. Greedy rows
    # record their log-prob at the temperature too (as the hf engine does), unless it is <= 0.
    scale = temperature != 1.0 and temperature > 0
    scaled_AV = logits_AV / temperature if scale else logits_AV
    logz_A1 = torch.logsumexp(scaled_AV, dim=-1, keepdim=True)
    policy_AV = scaled_AV
    if masked_tokens is not None:
        # index_fill_ takes -inf as a kernel argument, not as a tensor copied from the host
        # (which a CUDA graph cannot capture).
        policy_AV = scaled_AV.clone().index_fill_(1, masked_tokens, float("-inf"))
    if greedy:
        if check:  # as sampling does: the argmax of a NaN row is any index
            check_finite(policy_AV)
        token_A = policy_AV.argmax(dim=-1)
    else:
        token_A = sample_from_logits(
            policy_AV,
            u_A,
            top_p=top_p,
            check=check,
            by_blocks=by_blocks,
            compile=compile,
            compile_mode=compile_mode,
        )
    logp_A = (scaled_AV.gather(1, token_A[:, None]) - logz_A1).squeeze(1)
    return token_A, logp_A


class Uniforms:
    """u[t, b], the uniform number row b turns into its token at step t: the stream is
    row-addressed, B numbers a step whatever is still running.

    With one ``seed`` for the batch, step t draws all B from one generator. With a seed per
    prompt, prompt i's G rows read only prompt i's generator, in blocks of ``BLOCK`` steps,
    so a prompt's draws are the same in any batch: alone, beside others, on any rank.
    """

    BLOCK = 64
    """Steps drawn at once from each prompt's generator (one call per prompt per block)."""

    def __init__(self, seed: int | Sequence[int], *, num_prompts: int, group_size: int) -> None:
        self.group_size = group_size
        if isinstance(seed, int):
            self.gens = [torch.Generator().manual_seed(seed)]
        else:
            if len(seed) != num_prompts:
                raise ValueError(f"{len(seed)} seeds for {num_prompts} prompts: give one each")
            self.gens = [torch.Generator().manual_seed(int(s)) for s in seed]
        self.per_prompt = not isinstance(seed, int)
        self.num_rows = num_prompts * group_size
        self.block_KB: torch.Tensor | None = None

    def step(self, t: int) -> torch.Tensor:
        """u [B] (float64, on the CPU) of step t; steps are asked for in order."""
        if not self.per_prompt:
            return torch.rand(self.num_rows, generator=self.gens[0], dtype=torch.float64)
        if t % self.BLOCK == 0:
            blocks = [
                torch.rand((self.BLOCK, self.group_size), generator=g, dtype=torch.float64)
                for g in self.gens
            ]
            self.block_KB = torch.cat(blocks, dim=1)
        return self.block_KB[t % self.BLOCK]
