"""The native engine's KV cache (dapo/rollout/kv_cache.py): the same keys and values as
transformers' DynamicCache under the same appends and row removals, written in place, rows
leaving by moving only the rows that fill their places, and a capacity that doubles."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import DynamicCache

from dapo.models.demo import TinyModelSpec, tiny_qwen2
from dapo.rollout import kv_cache, native
from dapo.rollout.base import encode_prompts
from dapo.rollout.kv_cache import RowCache

HEADS, DIM = 2, 3


def prefill(n: int, prompt: int, layers: int = 2, seed: int = 0) -> DynamicCache:
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for i in range(layers):
        k, v = (torch.randn(n, HEADS, prompt, DIM, generator=gen) for _ in range(2))
        cache.update(k, v, i)
    return cache


def clone(cache: DynamicCache) -> DynamicCache:
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.clone(), layer.values.clone(), i)
    return out


def test_appends_and_removals_give_dynamic_caches_keys_and_values(monkeypatch):
    """Random appends and removals, growth forced every few steps: the running rows' keys and
    values are the reference's, in the order keep() reports."""
    monkeypatch.setattr(kv_cache, "FIRST_CAPACITY", 2)
    n, group, prompt, steps = 3, 4, 5, 12
    ref = clone(base := prefill(n, prompt))
    ref.batch_repeat_interleave(group)
    rows = RowCache(base, group_size=group, max_length=prompt + steps)
    gen = torch.Generator().manual_seed(1)
    order = torch.arange(n * group)  # our row i is the reference's row order[i]
    for _ in range(steps):
        for i in range(len(ref.layers)):
            k, v = (torch.randn(order.numel(), HEADS, 1, DIM, generator=gen) for _ in range(2))
            ref.update(k, v, i)
            rows.cache.update(k[order], v[order], i)
        keep = torch.rand(order.numel(), generator=gen) > 0.2  # in the reference's order
        if keep.all() or not keep.any():
            continue
        kept = rows.keep(keep[order])  # our old rows, in their new order
        ref.batch_select_indices(keep.nonzero().squeeze(1))
        order = (torch.cumsum(keep.long(), 0) - 1)[order[kept]]  # the reference's new ids
        for ours, theirs in zip(rows.cache.layers, ref.layers, strict=True):
            assert torch.equal(ours.keys, theirs.keys[order])
            assert torch.equal(ours.values, theirs.values[order])
    assert order.numel() < n * group  # some rows left on the way


def test_a_step_writes_in_place_and_a_removal_moves_only_the_rows_that_fill_places():
    n, group, prompt = 2, 4, 3
    rows = RowCache(prefill(n, prompt), group_size=group, max_length=prompt + 10)
    layer = rows.cache.layers[0]
    ptr = layer.key_buf.data_ptr()
    before = layer.key_buf.clone()
    k = torch.ones(n * group, HEADS, 1, DIM)
    layer.update(k, k)
    assert layer.key_buf.data_ptr() == ptr and layer.keys.shape[2] == prompt + 1
    # Rows 1 and 5 finish: rows 6 and 7, past the new end, take their places; no other moves.
    keep = torch.ones(8, dtype=torch.bool)
    keep[[1, 5]] = False
    order = rows.keep(keep)
    assert order.tolist() == [0, 6, 2, 3, 4, 7]
    assert layer.key_buf.data_ptr() == ptr
    assert torch.equal(layer.keys[1, :, :prompt], before[6, :, :prompt])
    assert torch.equal(layer.keys[5, :, :prompt], before[7, :, :prompt])
    assert torch.equal(layer.keys[2, :, :prompt], before[2, :, :prompt])
    assert layer.keys.shape[0] == 6


def test_the_capacity_doubles_so_a_long_response_reallocates_a_few_times(monkeypatch):
    monkeypatch.setattr(kv_cache, "FIRST_CAPACITY", 4)
    prompt, steps = 3, 100
    rows = RowCache(prefill(1, prompt, layers=1), group_size=2, max_length=prompt + steps)
    layer = rows.cache.layers[0]
    ptrs = {layer.key_buf.data_ptr()}
    capacities = [layer.key_buf.shape[2]]
    for _ in range(steps):
        layer.update(torch.zeros(2, HEADS, 1, DIM), torch.zeros(2, HEADS, 1, DIM))
        if layer.key_buf.data_ptr() not in ptrs:
            ptrs.add(layer.key_buf.data_ptr())
            capacities.append(layer.key_buf.shape[2])
    assert capacities == [7, 14, 28, 56, 103]  # never past the prompt plus max_new_tokens
    assert layer.keys.shape[2] == prompt + steps


def test_decoding_with_growing_buffers_gives_the_same_tokens(
    monkeypatch, eager_eos_model, tokenizer
):
    prompts = ["1 + 2 =", "33 + 4 + 5 =", "7 ="]
    ids, mask = encode_prompts(tokenizer, prompts, torch.device("cpu"))
    options = dict(
        group_size=3,
        max_new_tokens=24,
        stop_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        seed=[5, 6, 7],
    )
    whole = native.decode(eager_eos_model, ids, mask, **options)
    monkeypatch.setattr(kv_cache, "FIRST_CAPACITY", 1)
    grown = native.decode(eager_eos_model, ids, mask, **options)
    assert torch.equal(whole[0], grown[0]) and torch.equal(whole[1], grown[1])
    lengths = (whole[0] != tokenizer.pad_token_id).sum(dim=1)
    assert lengths.min() < lengths.max()  # rows left at different steps


@pytest.mark.parametrize("group", [1, 4])
def test_the_prefill_is_repeated_for_each_row_of_its_group(group):
    base = prefill(3, 5)
    ref = clone(base)
    ref.batch_repeat_interleave(group)
    rows = RowCache(base, group_size=group, max_length=9)
    for ours, theirs in zip(rows.cache.layers, ref.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert rows.cache.get_seq_length() == 5


class _Writes(TorchDispatchMode):
    """The shapes of the tensors that ops write (views and allocations excluded: they write
    nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and any(a.alias_info for a in func._schema.returns):
            return out  # a view
        if "empty" in func._schema.name:
            return out
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("cache", ["preallocated", "dynamic"])
def test_a_decoding_step_writes_nothing_the_size_of_the_cache(monkeypatch, tokenizer, cache):
    """Per step only the new position is written (and attention reads the cache): no op writes
    a tensor of [.., positions, head_dim] longer than the prompt, as DynamicCache's
    concatenation does at every step (the "dynamic" case shows the check catches it)."""
    spec = TinyModelSpec(hidden_size=64, intermediate_size=64, num_heads=2, num_kv_heads=2)
    model = tiny_qwen2(tokenizer, spec, seed=0).eval()  # no GQA: no repeated keys to write
    head_dim = spec.hidden_size // spec.num_heads
    if cache == "dynamic":
        monkeypatch.setattr(RowCache, "__init__", _plain_repeat)
        monkeypatch.setattr(RowCache, "keep", _plain_keep)
    ids, mask = encode_prompts(tokenizer, ["1 + 2 =", "33 + 4 + 5 ="], torch.device("cpu"))
    writes = _Writes()
    with writes:
        tokens, _, _ = native.decode(
            model,
            ids,
            mask,
            group_size=2,
            max_new_tokens=40,
            stop_token_ids=[],
            pad_token_id=tokenizer.pad_token_id,
            seed=0,
        )
    assert tokens.shape[1] == 40
    longest = max(s[-2] for s in writes.shapes if len(s) == 4 and s[-1] == head_dim)
    prompt = ids.shape[1]
    assert longest == (prompt if cache == "preallocated" else prompt + 39)


def _plain_repeat(self, cache, *, group_size: int, max_length: int, dtype=None) -> None:
    cache.batch_repeat_interleave(group_size)
    self.cache = cache


def _plain_keep(self, keep_A):
    kept = keep_A.nonzero().squeeze(1)
    self.cache.batch_select_indices(kept)
    return kept


def test_under_autocast_the_cache_holds_the_compute_dtype_and_decodes_the_same(
    monkeypatch, eager_eos_model, tokenizer
):
    """bf16 autocast over float32 weights: the rotary embedding hands over float32 keys, and
    the buffers hold bf16 (half the memory; the H200 measurement in RowCache's docstring).
    Attention casts to bf16 either way, so the tokens and log-probs equal those decoded with
    float32 buffers."""
    ids, mask = encode_prompts(tokenizer, ["1 + 2 =", "33 + 4 + 5 ="], torch.device("cpu"))
    options = dict(
        group_size=3,
        max_new_tokens=20,
        stop_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        seed=[1, 2],
    )
    made, held = [], [True]
    init = RowCache.__init__

    def recorded(self, cache, *, dtype=None, **kw):
        init(self, cache, dtype=dtype if held[0] else None, **kw)
        made.append(
            {layer.key_buf.dtype for layer in cache.layers}
            | {layer.value_buf.dtype for layer in cache.layers}
        )

    monkeypatch.setattr(RowCache, "__init__", recorded)
    runs = []
    for held[0] in (True, False):  # the compute dtype, then the keys' own (float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(native.decode(eager_eos_model, ids, mask, **options))
    assert made == [{torch.bfloat16}, {torch.float32}]
    (tokens, logprobs, _), (tokens32, logprobs32, _) = runs
    assert torch.equal(tokens, tokens32) and torch.equal(logprobs, logprobs32)
