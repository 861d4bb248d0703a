"""Episodes (one graded response each), padding, and the mini/micro-batch split.

Shapes: B = responses, P = prompt tokens (left padded), T = response tokens (right padded).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from dapo.data.transfer import to_device


@dataclass(frozen=True)
class Trace:
    """How a multi-turn episode went (``env.class``): what its metrics count."""

    turns: int = 1
    """Model turns."""
    env_tokens: int = 0
    """Response tokens the environment wrote (observations): context, never trained."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    reward: float | None = None
    """The environment's score, which replaces the verifier's; None: the verifier grades."""
    transcript: str = ""
    """The whole response, the observations in their places (the episode's ``text`` is the
    model's alone: what the verifier grades)."""


@dataclass
class Episode:
    """One response with everything the update needs; tensors are 1-D and unpadded."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    sampler_logprobs: torch.Tensor
    truncated: bool
    correct: bool
    reward: float
    text: str = ""
    advantage: float = 0.0
    trainable: bool = True
    """False when overlong filtering masks this response out of the loss."""
    old_logprobs: torch.Tensor | None = None
    """log pi_old, recomputed before the update (or the sampler's)."""
    ref_logprobs: torch.Tensor | None = None
    """log pi_ref of the frozen reference, only with a KL penalty."""
    loss_weights: torch.Tensor | None = None
    """Each token's rollout-correction weight (pi_old / pi_rollout, truncated or masked), only
    when ``algo.rollout_correction`` is on."""
    reward_fault: str = ""
    """Why the verifier failed on this response (graded incorrect), or empty."""
    sizes: tuple[int, int] | None = None
    """(prompt, response) tokens of a :meth:`summary`, whose tensors are None."""
    env_mask: torch.Tensor | None = None
    """True at the response tokens the environment wrote (a multi-turn episode's
    observations): inputs of the forward pass, outside the loss. None: every token is the
    model's."""
    trace: Trace | None = None
    """How the episode's turns went; None for a single-turn response."""

    @property
    def length(self) -> int:
        if self.response_ids is None:
            return self.sizes[1]
        return int(self.response_ids.numel())

    @property
    def prompt_length(self) -> int:
        if self.prompt_ids is None:
            return self.sizes[0]
        return int(self.prompt_ids.numel())

    def summary(self) -> Episode:
        """This episode without its tokens, log-probs and text: what ranks exchange to decide
        together (dynamic sampling, advantages, who trains what). The rank that generated it
        keeps the whole episode and sends it to the rank that trains it; a summary cannot be
        collated by mistake (its tensors are None)."""
        return replace(
            self,
            prompt_ids=None,
            response_ids=None,
            sampler_logprobs=None,
            text="",
            sizes=(self.prompt_length, self.length),
            env_mask=None,
            trace=None if self.trace is None else replace(self.trace, transcript=""),
        )

    @property
    def env_tokens(self) -> int:
        return 0 if self.trace is None else self.trace.env_tokens

    @property
    def model_tokens(self) -> int:
        """The response tokens the model sampled: what is trained, shaped and counted."""
        return self.length - self.env_tokens

    def model_mask(self) -> torch.Tensor:
        """True at the response tokens the model sampled (every one of a single turn)."""
        if self.env_mask is None:
            return torch.ones(self.length, dtype=torch.bool)
        return ~self.env_mask

    @property
    def num_loss_tokens(self) -> int:
        return self.model_tokens if self.trainable else 0


@dataclass
class Packing:
    """Where a micro-batch's real tokens go when its rows are laid end to end, a group's
    prompt once before its responses (:mod:`dapo.models.packing`). Shapes: N = packed tokens,
    R = real response tokens."""

    groups: tuple[tuple[int, tuple[int, ...]], ...]
    """(prompt tokens, each of its rows' response tokens) per group, in packed order (kept on
    the host)."""
    index_N: torch.Tensor
    """Flat positions, in ``cat([prompt_ids_BP, response_ids_BT], 1)``, of the packed tokens."""
    positions_N: torch.Tensor
    """Each packed token's position in its row, from 0 at the prompt's first token."""
    states_R: torch.Tensor
    """The packed position whose output predicts each real response token (row-major)."""
    response_R: torch.Tensor
    """The flat (row-major) positions in ``[B, T]`` of the real response tokens."""

    def to(self, device: torch.device | str) -> Packing:
        """This layout on ``device``, copied without the host waiting (:func:`to_device`)."""
        tensors = ("index_N", "positions_N", "states_R", "response_R")
        return Packing(self.groups, *(to_device(getattr(self, name), device) for name in tensors))

    @property
    def tokens(self) -> int:
        """The packed tokens, N."""
        return sum(p + sum(ts) for p, ts in self.groups)


def packing_of(
    prompt_of: list[int], prompt_lengths: list[int], lengths: list[int], width_p: int, width_t: int
) -> Packing:
    """The :class:`Packing` of rows whose prompts are ``prompt_of`` (an index per row: rows of
    one index share their prompt), ``prompt_lengths`` and response ``lengths`` long, collated
    to ``width_p`` prompt and ``width_t`` response columns. Groups go in the order of their
    first row, a group's rows in row order."""
    members: dict[int, list[int]] = {}
    for b, key in enumerate(prompt_of):
        members.setdefault(key, []).append(b)
    width = width_p + width_t
    index, positions, groups = [], [], []
    states, response = [0] * len(lengths), [0] * len(lengths)
    start = 0
    for rows in members.values():
        p = prompt_lengths[rows[0]]
        index.append(torch.arange(rows[0] * width + width_p - p, rows[0] * width + width_p))
        positions.append(torch.arange(p))
        last_prompt, start = start + p - 1, start + p
        for b in rows:
            t = lengths[b]
            index.append(torch.arange(b * width + width_p, b * width + width_p + t))
            positions.append(torch.arange(p, p + t))
            # Token 0 is predicted by the prompt's last position, token t by response t - 1.
            # An empty response (a custom rollout's) predicts nothing: no state at all.
            states[b] = torch.cat(
                [torch.tensor([last_prompt]), torch.arange(start, start + max(t - 1, 0))]
            )[:t]
            response[b] = torch.arange(b * width_t, b * width_t + t)
            start += t
        groups.append((p, tuple(lengths[b] for b in rows)))
    return Packing(
        tuple(groups),
        torch.cat(index),
        torch.cat(positions),
        torch.cat(states),
        torch.cat(response),
    )


@dataclass
class Batch:
    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    response_ids_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    """Every real response token (for old log-probs and metrics)."""
    loss_mask_BT: torch.Tensor
    """Tokens that count in the loss: the model's (not an environment's), of responses not
    overlong-filtered."""
    advantages_B: torch.Tensor
    old_logprobs_BT: torch.Tensor | None = None
    ref_logprobs_BT: torch.Tensor | None = None
    loss_weights_BT: torch.Tensor | None = None
    prompt_ids_NP: torch.Tensor | None = None
    """The N distinct padded prompts (rows of ``prompt_ids_BP``), in sorted order; with
    ``prompt_mask_NP`` and ``prompt_index_B`` (row b's prompt), found on the host by
    :func:`collate`, so that a shared-prompt pass on the device never waits for a
    ``torch.unique`` there (its output size is a device-to-host read)."""
    prompt_mask_NP: torch.Tensor | None = None
    prompt_index_B: torch.Tensor | None = None
    loss_index_N: torch.Tensor | None = None
    """The flat (row-major) positions of ``loss_mask_BT``'s tokens, found on the host: on the
    device, selecting by them never waits for a ``nonzero`` there."""
    packing: Packing | None = None
    """The rows laid end to end (``train.packing``), found on the host; None: padded."""

    def to(self, device: torch.device | str) -> Batch:
        """This batch on ``device``, copied without the host waiting (:func:`to_device`)."""
        return Batch(**{k: _moved(v, device) for k, v in vars(self).items()})

    @property
    def distinct_prompts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(ids [N, P], mask [N, P], row -> index [B]) when :func:`collate` found them."""
        if self.prompt_index_B is None:
            return None
        return self.prompt_ids_NP, self.prompt_mask_NP, self.prompt_index_B


def _moved(value: torch.Tensor | Packing | None, device: torch.device | str):
    if value is None:
        return None
    return value.to(device) if isinstance(value, Packing) else to_device(value, device)


def collate(
    episodes: Sequence[Episode], *, pad_id: int, packed: bool = False, min_width: int = 0
) -> Batch:
    """Left-pad prompts and right-pad responses so that every response starts at column P,
    at least ``min_width`` columns of them; ``packed``: with the :class:`Packing` that lays
    the rows end to end."""
    num = len(episodes)
    width_p = max(e.prompt_ids.numel() for e in episodes)
    width_t = max(min_width, *(e.length for e in episodes))
    prompt_ids = torch.full((num, width_p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((num, width_p), dtype=torch.long)
    response_ids = torch.full((num, width_t), pad_id, dtype=torch.long)
    response_mask = torch.zeros((num, width_t), dtype=torch.bool)
    model_mask = torch.zeros((num, width_t), dtype=torch.bool)
    for i, e in enumerate(episodes):
        p, t = e.prompt_ids.numel(), e.length
        prompt_ids[i, width_p - p :] = e.prompt_ids
        prompt_mask[i, width_p - p :] = 1
        response_ids[i, :t] = e.response_ids
        response_mask[i, :t] = True
        model_mask[i, :t] = e.model_mask()
    trainable = torch.tensor([e.trainable for e in episodes], dtype=torch.bool)
    # The environment's tokens are context: no loss, no entropy, not in the divisor.
    loss_mask = model_mask & trainable[:, None]
    rows_NP, index_B = torch.unique(
        torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True
    )
    packing = None
    if packed:
        sizes = [e.prompt_ids.numel() for e in episodes], [e.length for e in episodes]
        packing = packing_of(index_B.tolist(), *sizes, width_p, width_t)
    return Batch(
        prompt_ids_BP=prompt_ids,
        prompt_mask_BP=prompt_mask,
        response_ids_BT=response_ids,
        response_mask_BT=response_mask,
        loss_mask_BT=loss_mask,
        advantages_B=torch.tensor([e.advantage for e in episodes], dtype=torch.float32),
        old_logprobs_BT=_pad_rows([e.old_logprobs for e in episodes], width_t),
        ref_logprobs_BT=_pad_rows([e.ref_logprobs for e in episodes], width_t),
        loss_weights_BT=_pad_rows([e.loss_weights for e in episodes], width_t),
        prompt_ids_NP=rows_NP[:, :width_p],
        prompt_mask_NP=rows_NP[:, width_p:],
        prompt_index_B=index_B,
        loss_index_N=loss_mask.flatten().nonzero().squeeze(1),
        packing=packing,
    )


def _pad_rows(rows: list[torch.Tensor | None], width: int) -> torch.Tensor | None:
    """Right-pad 1-D float rows with zeros; None when any row is missing (not computed yet)."""
    if any(r is None for r in rows):
        return None
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def split_minibatches(num: int, size: int, *, generator: torch.Generator) -> list[list[int]]:
    """A seeded permutation of ``range(num)`` cut into chunks of ``size`` responses."""
    order = torch.randperm(num, generator=generator).tolist()
    return [order[i : i + size] for i in range(0, num, size)]


def length_sorted(episodes: Sequence[Episode], indices: Iterable[int]) -> list[int]:
    """``indices`` by prompt, prompts in decreasing order of their longest row (prompt +
    response), and a prompt's rows longest first.

    A prompt's rows stay together, so that a micro-batch holds whole groups where it can
    (their prompt then runs once, see ``response_logprobs``), and greedy micro-batching of
    this order pads little. Prompts of equal longest rows go in the order of their token
    sequences (compared as tuples); Python's sort is stable: the order is a function of the
    input. The prompts are ranked by one ``torch.unique`` over their rows, right-padded with
    -1 (below every token id, so a prefix sorts first, as a shorter tuple does): one read of
    host memory for all of them, not one per episode.
    """
    indices = list(indices)
    if not indices:
        return []
    width = max(episodes[i].prompt_ids.numel() for i in indices)
    rows = torch.full((len(indices), width), -1, dtype=torch.long)
    for row, i in enumerate(indices):
        rows[row, : episodes[i].prompt_ids.numel()] = episodes[i].prompt_ids
    _, rank_of_row = torch.unique(rows, dim=0, return_inverse=True)
    prompt_of = dict(zip(indices, rank_of_row.tolist(), strict=True))
    longest: dict[int, int] = {}
    for i in indices:
        total = episodes[i].prompt_ids.numel() + episodes[i].length
        longest[prompt_of[i]] = max(longest.get(prompt_of[i], 0), total)

    def key(i: int) -> tuple[int, int, int]:
        return (-longest[prompt_of[i]], prompt_of[i], -episodes[i].length)

    return sorted(indices, key=key)


def split_microbatches(
    episodes: Sequence[Episode], indices: Sequence[int], *, max_tokens: int, packed: bool = False
) -> list[list[int]]:
    """Greedy chunks of ``indices`` whose padded size rows x (P + T) stays within ``max_tokens``
    (``packed``: whose real tokens, every row's P + T summed, do).

    A single response longer than the budget still gets a micro-batch of its own. The split
    changes memory only: every micro-batch loss is divided by the whole mini-batch's count.
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    width_p = width_t = real = 0
    for i in indices:
        e = episodes[i]
        # collate pads prompts and responses separately: the width is max P + max T.
        p, t = max(width_p, e.prompt_ids.numel()), max(width_t, e.length)
        size = real + e.prompt_ids.numel() + e.length if packed else (p + t) * (len(current) + 1)
        if current and size > max_tokens:
            chunks.append(current)
            current, p, t, real = [], e.prompt_ids.numel(), e.length, 0
        current.append(i)
        width_p, width_t = p, t
        real += e.prompt_ids.numel() + e.length
    if current:
        chunks.append(current)
    return chunks


def partition_by_tokens(
    episodes: Sequence[Episode], parts: int, units: Sequence[int] | None = None
) -> list[list[int]]:
    """Indices of ``episodes`` in ``parts`` shares of about equal work, one per data-parallel
    rank; each share in increasing order. The same on every rank, which holds the same
    episodes; one share is every index, in order.

    A share's work is the tokens its rank computes once they are collated: its prompts' tokens
    plus its rows times its longest response, because every response is padded to the longest
    (one response truncated at L_max among short ones makes its rank compute L_max for every
    row). Episodes go longest response first (then most tokens, then first index), each to the
    share it leaves cheapest (the lowest share on a tie). Counting real tokens alone sent a
    truncated response and as many rows to one rank as to the other: on SmolLM2 that rank's
    forward and backward took twice the other's.

    With ``units`` (a key per episode: its group), the episodes of a unit go to one share
    together and their prompt counts once: a group's prompt then runs once on one rank
    (``response_logprobs`` shares it), instead of on every rank that holds one of its rows."""
    keys = list(range(len(episodes))) if units is None else list(units)
    members: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    prompt = {k: max(episodes[i].prompt_length for i in rows) for k, rows in members.items()}
    longest = {k: max(episodes[i].length for i in rows) for k, rows in members.items()}
    tokens = {k: prompt[k] + sum(episodes[i].length for i in rows) for k, rows in members.items()}
    shares: list[list[int]] = [[] for _ in range(parts)]
    prompts, rows, widths = [0] * parts, [0] * parts, [0] * parts

    def work_with(r: int, key: int) -> int:
        width = max(widths[r], longest[key])
        return prompts[r] + prompt[key] + (rows[r] + len(members[key])) * width

    for key in sorted(members, key=lambda k: (-longest[k], -tokens[k], members[k][0])):
        least = min(range(parts), key=lambda r: (work_with(r, key), r))
        shares[least].extend(members[key])
        prompts[least] += prompt[key]
        rows[least] += len(members[key])
        widths[least] = max(widths[least], longest[key])
    return [sorted(share) for share in shares]
