"""The native engine's KV cache: one buffer per layer, written in place, that finished rows
leave without the cache being copied.

transformers' ``DynamicCache`` grows by concatenation: every decoding step copies each layer's
whole cache to append one position, so a step costs more the longer the responses get, and
removing finished rows (``batch_select_indices``) copies every running row again. Here each
layer's keys and values live in a buffer ``[rows, heads, capacity, head_dim]``:

- a step writes its position in place and hands attention a view of the filled part;
- a row that finishes leaves by having a running row from the end of the batch moved into its
  slot: the rows still running are always the first A of the buffer, and the only copying is
  of the rows moved (at most one per finished row, once);
- the capacity starts at the prompt plus ``FIRST_CAPACITY`` response positions and doubles
  when full (the running rows only are carried over), so the memory follows the longest
  running response rather than ``max_new_tokens`` from the start, and the copying it costs
  over a whole rollout is at most about one copy of the final cache.

Rows change places when others leave; :meth:`RowCache.keep` returns the new order so that the
caller's per-row state (output row, attention mask, position) follows.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

FIRST_CAPACITY = 256
"""Response positions a layer's buffer holds before it first grows (then doubles)."""


class SlabLayer(DynamicLayer):
    """One layer's keys and values in place: ``keys`` and ``values`` are views of the first
    ``rows`` rows and ``length`` positions of the buffers, as ``DynamicLayer`` holds them."""

    is_croppable = False

    def __init__(
        self,
        keys_nHPD: torch.Tensor,
        values_nHPD: torch.Tensor,
        *,
        group_size: int,
        max_length: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        n, heads, prompt, dim = keys_nHPD.shape
        self.max_length = max_length
        capacity = min(max_length, prompt + FIRST_CAPACITY)
        shape = (n * group_size, heads, capacity, dim)
        self.key_buf = keys_nHPD.new_empty(shape, dtype=dtype or keys_nHPD.dtype)
        self.value_buf = torch.empty_like(self.key_buf)
        # Each prompt's prefill, repeated for its G rows (a broadcast, no intermediate copy).
        for buf, src in ((self.key_buf, keys_nHPD), (self.value_buf, values_nHPD)):
            buf[:, :, :prompt].unflatten(0, (n, group_size)).copy_(src[:, None])
        self.rows, self.length = n * group_size, prompt
        self.device, self.is_initialized = keys_nHPD.device, True
        self._views()

    def _views(self) -> None:
        self.keys = self.key_buf[: self.rows, :, : self.length]
        self.values = self.value_buf[: self.rows, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new positions of the running rows in place; the filled views."""
        end = self.length + key_states.shape[-2]
        if end > self.key_buf.shape[2]:
            self._grow(end)
        self.key_buf[: self.rows, :, self.length : end].copy_(key_states)
        self.value_buf[: self.rows, :, self.length : end].copy_(value_states)
        self.length = end
        self._views()
        return self.keys, self.values

    def _grow(self, needed: int) -> None:
        """Double the capacity (up to ``max_length``); only the running rows move over."""
        capacity = self.key_buf.shape[2]
        capacity = max(needed, min(self.max_length, 2 * capacity))
        for name in ("key_buf", "value_buf"):
            old = getattr(self, name)
            new = old.new_empty((self.rows, old.shape[1], capacity, old.shape[3]))
            new[:, :, : self.length].copy_(old[: self.rows, :, : self.length])
            setattr(self, name, new)

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """Rows ``src`` take the places ``dst``; the first ``rows`` rows are the batch now."""
        if dst.numel():
            for buf in (self.key_buf, self.value_buf):
                buf[dst, :, : self.length] = buf[src, :, : self.length]
        self.rows = rows
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` in that order (a copy; :meth:`RowCache.keep` avoids it)."""
        self.key_buf, self.value_buf = self.keys[indices], self.values[indices]
        self.rows = indices.numel()
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.key_buf = self.keys.repeat_interleave(repeats, dim=0)
        self.value_buf = self.values.repeat_interleave(repeats, dim=0)
        self.rows *= repeats
        self._views()


class RowCache:
    """A prefill's cache turned into :class:`SlabLayer` s, each prompt's repeated G times,
    room for ``max_length`` positions in all (prompt included), held in ``dtype``.

    Under autocast the keys come out of the rotary embedding in float32 (bf16 projections
    times float32 cos/sin), while attention casts keys and values to the compute dtype
    anyway: holding both in that dtype gives the same attention at half the memory. Measured
    on an H200 (Qwen2.5-0.5B shape, bf16 autocast over float32 weights, 64 rows of 1,280
    positions), buffers in the keys' float32 made decoding rise 2.18 GiB where the plan's
    bf16 cache is 0.94 GiB."""

    def __init__(
        self, cache, *, group_size: int, max_length: int, dtype: torch.dtype | None = None
    ) -> None:
        self.cache = cache
        cache.layers[:] = [
            SlabLayer(
                layer.keys,
                layer.values,
                group_size=group_size,
                max_length=max_length,
                dtype=dtype,
            )
            for layer in cache.layers
        ]

    def keep(self, keep_A: torch.Tensor) -> torch.Tensor:
        """Drop the rows where ``keep_A`` is False; the indices (into the old batch) of the
        rows kept, in the order they now have. Running rows past the new end move into the
        places of finished ones before it; no other row moves."""
        rows = int(keep_A.sum())
        holes = (~keep_A[:rows]).nonzero().squeeze(1)
        movers = keep_A[rows:].nonzero().squeeze(1) + rows
        for layer in self.cache.layers:
            layer.move_rows(holes, movers, rows)
        order = torch.arange(rows, device=keep_A.device)
        order[holes] = movers
        return order
