"""The native engine's episodes without recomputing them: a row that stops at a turn end keeps
its KV cache ("parks"), and its next turn prefills only what came after it.

A multi-turn episode (:mod:`dapo.rollout.episodes`) is continued by another ``generate`` call
from the row's whole context so far: prompt, the model's turns, the environment's
observations. An engine without a cache of its own would run the whole context through the
model again. The native engine, asked to park at the turn-end tokens, keeps what its decoding
loop already computed for the rows that stop there:

- when such a row leaves the batch (or the loop ends), its keys and values are copied out of
  the loop's buffers (:meth:`Parking.take`): the positions of its prompt and response, the
  stop token excluded (sampled, never fed);
- the next call is given each row's :class:`Parked` cache along with its context, which must
  begin with the parked tokens (checked; a row whose context does not is computed from
  scratch). :func:`prefix_cache` lays the parked keys out as the left-padded contexts put
  their tokens, and the prefill runs over the last ``K`` columns only: ``K`` the most any row
  adds (its turn-end token and the observation), so a row that adds less computes its last
  few parked positions again, which gives the same keys up to rounding.

What is sampled is what a recomputation samples: the same contexts, positions and uniforms;
the keys of the parked positions come from the decoding steps rather than one prefill, which
can round differently (tested equal in float32 to 1e-5). Memory: a parked row holds the cache
it held while decoding until its next turn's prefill has copied it, or its episode ends (the
runner lets go of it then): at most the rows' caches twice, parked beside decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Parked:
    """One row's KV cache after a turn: the tokens it covers (the row's context and response,
    the stop token excluded), each layer's keys and values ``[heads, len(tokens), head_dim]``.
    It serves one continuation: :func:`prefix_cache` lets go of its tensors once copied."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class Parking:
    """Collects, during one decoding loop, the caches of the rows that stop at ``park_at``."""

    def __init__(self, park_at: Sequence[int], device: torch.device) -> None:
        self.park_at = frozenset(int(t) for t in park_at)
        self.stops = torch.tensor(sorted(self.park_at), dtype=torch.long, device=device)
        self.held: dict[int, tuple[list[torch.Tensor], int]] = {}
        """Output row -> (each buffer's copied slice [heads, columns, head_dim], the first
        column of the row's own tokens)."""

    def take(
        self,
        slots: torch.Tensor,
        rows: Sequence[int],
        buffers: Sequence[torch.Tensor],
        columns: int,
        first: Sequence[int],
    ) -> None:
        """Copy slots ``slots`` (output rows ``rows``) of the loop's cache ``buffers`` (keys
        and values of each layer in turn, ``[slots, heads, width, head_dim]``), their first
        ``columns`` columns; ``first``: where each row's prompt starts (after its padding)."""
        if not len(rows):
            return
        copies = [buf[slots, :, :columns] for buf in buffers]
        for i, (row, start) in enumerate(zip(rows, first, strict=True)):
            self.held[int(row)] = ([c[i] for c in copies], int(start))

    def rows(
        self,
        prompt_ids_BP: torch.Tensor,
        prompt_mask_BP: torch.Tensor,
        response_ids_BT: torch.Tensor,
        lengths_B: torch.Tensor,
    ) -> list[Parked | None]:
        """Each output row's :class:`Parked` cache (None for a row that did not stop at a
        turn end), cut to its tokens: prompt, then its response less the stop token."""
        out: list[Parked | None] = [None] * prompt_ids_BP.shape[0]
        if not self.held:
            return out
        ids_BP, mask_BP = prompt_ids_BP.cpu(), prompt_mask_BP.cpu().bool()
        responses, lengths = response_ids_BT.cpu(), lengths_B.cpu().tolist()
        for b, (copies, start) in self.held.items():
            n = int(lengths[b])
            if n == 0 or int(responses[b, n - 1]) not in self.park_at:
                continue
            tokens = tuple(ids_BP[b][mask_BP[b]].tolist() + responses[b, : n - 1].tolist())
            cut = [c[:, start : start + len(tokens)] for c in copies]
            out[b] = Parked(tokens, cut[0::2], cut[1::2])
        return out


def matched(parked: Parked | None, context: Sequence[int]) -> int:
    """How many of ``context``'s first tokens ``parked`` holds (0 when it is not a prefix of
    the context); at most all but the last, which the prefill must feed to give logits."""
    if parked is None:
        return 0
    n = min(len(parked.tokens), len(context) - 1)
    return n if n > 0 and tuple(context[:n]) == parked.tokens[:n] else 0


def prefix_cache(
    parked: Sequence[Parked | None], contexts: Sequence[Sequence[int]], width: int
) -> tuple[object | None, int]:
    """(the KV cache of the first ``width - K`` columns of the left-padded ``contexts``
    (``width`` columns), from the ``parked`` rows; ``K``): the prefill computes the last
    ``K`` columns. (None, ``width``) when no row's parked cache fits its context. The parked
    caches are taken: their tensors are let go (a continuation from them is prefilled once)."""
    from transformers.cache_utils import DynamicCache

    held = [matched(p, c) for p, c in zip(parked, contexts, strict=True)]
    new = max(len(c) - h for c, h in zip(contexts, held, strict=True))
    some = next((p for p, h in zip(parked, held, strict=True) if h), None)
    if some is None or new >= width:
        return None, width
    cached = width - new
    cache = DynamicCache()
    for layer, (k0, v0) in enumerate(zip(some.keys, some.values, strict=True)):
        keys = k0.new_zeros((len(contexts), k0.shape[0], cached, k0.shape[2]))
        values = v0.new_zeros((len(contexts), v0.shape[0], cached, v0.shape[2]))
        for i, (p, c) in enumerate(zip(parked, contexts, strict=True)):
            used = len(c) - new  # this row's positions before the prefill's columns
            if used > 0:
                keys[i, :, cached - used :] = p.keys[layer][:, :used]
                values[i, :, cached - used :] = p.values[layer][:, :used]
        cache.update(keys, values, layer)
    for p in parked:  # copied: the memory of the old caches goes before decoding starts
        if p is not None:
            p.keys, p.values = [], []
    return cache, new
