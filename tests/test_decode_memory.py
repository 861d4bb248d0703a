"""What decoding holds beside the KV cache (``decode_workspace_bytes`` of the memory plan):
computed by hand, checked against the one GPU measurement, and measured on the CPU as the most
tensor bytes alive at once while the native engine decodes and draws tokens."""

from dataclasses import replace

import pytest
import torch
from helpers import LiveBytes
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo.rollout import decoder_step, native
from dapo.training import gpu_memory
from dapo.training.gpu_memory import (
    GIB,
    PlanSettings,
    decode_workspace_bytes,
    kv_cache_bytes,
    transformers_copies_gqa,
)
from dapo.training.model_shape import KNOWN_SHAPES, ModelShape

# 4 query heads on 2 key-value heads (head_dim 16), a 1,000-token vocabulary.
SHAPE = ModelShape(
    vocab=1000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, tied=True
)
ROWS = PlanSettings(compute_dtype="bfloat16", prompt_tokens=10, max_new_tokens=22, rows=3)


OUTPUTS = 12 * 3 * 22  # each row's 22 int64 tokens and float32 log-probs


def test_drawing_a_token_holds_float32_and_float64_copies_of_the_logits():
    # 3 rows: float32 logits and their scaled copy (8 bytes a logit), then float64 logits,
    # probabilities and CDF (16); top-p's sort, order and mass above each token make it 33.
    assert decode_workspace_bytes(SHAPE, ROWS, compute=2) == (8 + 16) * 3 * 1000 + OUTPUTS
    top_p = replace(ROWS, top_p=True)
    assert decode_workspace_bytes(SHAPE, top_p, compute=2) == (8 + 33) * 3 * 1000 + OUTPUTS


def test_the_float64_arrays_are_built_a_block_of_rows_at_a_time(monkeypatch):
    monkeypatch.setattr(gpu_memory, "CDF_CHUNK_ELEMENTS", 2000)  # blocks of 2 rows of 1,000
    assert decode_workspace_bytes(SHAPE, ROWS, compute=2) == 8 * 3 * 1000 + 16 * 2 * 1000 + OUTPUTS


def test_a_long_context_copies_one_layers_keys_and_values_to_every_query_head():
    # 2,010 positions: K and V of 4 heads x 16 for 3 rows in bf16, beside the last logits;
    # half of it per rank at tp 2. Where transformers packs the query (5.23 on), a layer's
    # old buffer while its cache grows, of its 2 key-value heads.
    long, outputs = replace(ROWS, max_new_tokens=2000), 12 * 3 * 2000
    copy = 2 * 3 * 4 * 16 * 2010 * 2
    assert decode_workspace_bytes(SHAPE, long, compute=2) == copy + 4 * 3 * 1000 + outputs
    packed = replace(long, gqa_copy=False)
    assert decode_workspace_bytes(SHAPE, packed, compute=2) == copy // 2 + 12_000 + outputs
    halves = replace(long, tp_size=2, world_size=2)
    assert decode_workspace_bytes(SHAPE, halves, compute=2) == copy // 2 + 12_000 + outputs


def test_the_plan_gives_what_the_h200_measured_while_decoding():
    # benchmarks/gpu.py's decode, transformers 5.17 on an H200 (docs/guides/gpus.md): the
    # 0.5B shape, 64 rows of 256 + 1,024 tokens in bf16, rose by 1.25 GiB.
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-0.5b"])
    s = PlanSettings(compute_dtype="bfloat16", prompt_tokens=256, max_new_tokens=1024, rows=64)
    kv = kv_cache_bytes(shape, tokens=1280, rows=64, compute=2)
    workspace = decode_workspace_bytes(shape, s, compute=2)
    copy, logits, outputs = 2 * 64 * 14 * 64 * 1280 * 2, 4 * 64 * 151_936, 12 * 64 * 1024
    assert workspace == copy + logits + outputs == 333_283_328
    assert round((kv + workspace) / GIB, 2) == 1.25


def test_the_copied_constant_is_the_engines():
    assert gpu_memory.CDF_CHUNK_ELEMENTS == native.CDF_CHUNK_ELEMENTS
    assert set(gpu_memory.STATIC_DECODING_TYPES) == set(decoder_step.SUPPORTED_MODEL_TYPES)


def test_the_cuda_graph_path_copies_no_keys_per_query_head():
    """On CUDA the native engine decodes a whole Qwen2 on its own step: the workspace has no
    per-head copy whatever transformers is installed (LoRA's adapters merged); a
    tensor-parallel copy or the eager loop (rollout.cuda_graphs=false) go through
    transformers' forward."""
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-0.5b"])
    base = PlanSettings(gqa_copy=True, device="cuda")
    assert not gpu_memory.copies_gqa(shape, base)
    for eager in (
        dict(cuda_graphs=False),
        dict(device="cpu"),
        dict(engine="hf"),
    ):
        assert gpu_memory.copies_gqa(shape, replace(base, **eager))
    assert gpu_memory.copies_gqa(shape, replace(base, world_size=2, tp_size=2))
    assert not gpu_memory.copies_gqa(shape, replace(base, lora_rank=8))
    assert not gpu_memory.copies_gqa(shape, replace(base, gqa_copy=False, cuda_graphs=False))


@pytest.mark.parametrize("top_p", [1.0, 0.7])
@pytest.mark.parametrize("new_tokens", [40, 400], ids=["logits-bound", "attention-bound"])
def test_decoding_holds_the_kv_cache_and_the_planned_workspace(top_p, new_tokens):
    # A float32 Qwen2 with 8 query heads on 2 key-value heads and a 2,000-token vocabulary:
    # with 400 new tokens a step's forward holds the most (one layer's keys and values per
    # query head where the installed transformers copies them, else a layer's old buffer as
    # its cache grows), with 40 drawing a token does. The plan is an upper bound: it counts
    # that layer at the full width, where the cache here last grew at 264 positions.
    config = Qwen2Config(
        vocab_size=2000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    prompts = torch.randint(3, 2000, (2, 8))
    mask = torch.ones_like(prompts, dtype=torch.bool)
    mask[1, :3] = False  # left padding: the engine decodes under a mask
    with LiveBytes(prompts, mask) as live:
        native.decode(
            model, prompts, mask, group_size=4, max_new_tokens=new_tokens, stop_token_ids=[],
            pad_token_id=0, top_p=top_p,
        )  # fmt: skip
    shape = ModelShape.from_hf_config(config.to_dict())
    s = PlanSettings(
        compute_dtype="float32", prompt_tokens=8, max_new_tokens=new_tokens, rows=8,
        top_p=top_p < 1, gqa_copy=transformers_copies_gqa(),
    )  # fmt: skip
    planned = kv_cache_bytes(shape, tokens=8 + new_tokens, rows=8, compute=4)
    planned += decode_workspace_bytes(shape, s, compute=4)
    # Not in the plan: a step's hidden states, the attention mask and the rows' uniform
    # numbers, 0.2% at 40 tokens here (transformers 5.24) and 2% where it copies (4.56).
    assert 0.97 < planned / live.peak < 1.15, (live.peak, planned)
