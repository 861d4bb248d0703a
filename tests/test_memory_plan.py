"""The memory plan: exact parameter counts, every part of a plan computed by hand, what
sharding, CPU offload, ``dist.grad_sync`` and ``rollout.tp_size`` move, the rough activation
and output-head models against what autograd saves or holds, ``dapo train --dry-run
--world-size N``, the table's JSON rows, and every recipe (7B on 8 and 32B on 64 GPUs of
80 GB among them) fitting its hardware."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import LiveBytes
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from dapo import cli
from dapo.algo.logits import token_logprobs_from_hidden
from dapo.config import apply_overrides, load_config
from dapo.dist.fsdp import checkpoint_layers
from dapo.models import policy
from dapo.training import gpu_memory, memory_table
from dapo.training.gpu_memory import (
    PlanSettings,
    activation_bytes,
    generator_bytes,
    plan_memory,
    settings_from_config,
)
from dapo.training.memory_table import format_plan
from dapo.training.model_shape import KNOWN_SHAPES, ModelShape


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen2.5-1.5b", 1_543_714_304),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen2.5-32b", 32_763_876_352),
    ],
)
def test_qwen25_parameter_counts_are_the_published_ones(name, count):
    assert ModelShape.from_hf_config(KNOWN_SHAPES[name]).num_parameters == count


SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
SMALL |= dict(num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(
    "config",
    [
        Qwen2Config(**SMALL, tie_word_embeddings=True),
        Qwen2Config(**SMALL, tie_word_embeddings=False),
        LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True),
        LlamaConfig(**SMALL, tie_word_embeddings=True),
        MistralConfig(**SMALL),
        Qwen3Config(**SMALL, head_dim=16, attention_bias=True),
    ],
    ids=["qwen2-tied", "qwen2-untied", "llama-biases", "llama-tied", "mistral", "qwen3"],
)
def test_counts_match_the_transformers_models(config):
    model = AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())  # a tied weight once
    assert ModelShape.from_hf_config(config.to_dict()).num_parameters == built


def test_the_embedded_model_is_counted_as_policy_builds_it():
    from dapo.models.demo import TinyModelSpec, build_tokenizer, tiny_qwen2

    cfg = load_config(None, ["embedded.hidden=64", "embedded.layers=3"])
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=3)
    model = tiny_qwen2(build_tokenizer(), spec, seed=0)
    built = sum(p.numel() for p in model.parameters())
    assert gpu_memory.model_shape(cfg).num_parameters == built


def test_an_unknown_model_type_is_refused():
    with pytest.raises(ValueError, match="model_type 'gemma2'"):
        ModelShape.from_hf_config({**KNOWN_SHAPES["qwen2.5-0.5b"], "model_type": "gemma2"})


HAND = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # head_dim 16: q 64, kv 32
    "tie_word_embeddings": True,
}
HAND_SETTINGS = PlanSettings(
    world_size=2,
    param_dtype="float32",
    compute_dtype="bfloat16",
    microbatch_tokens=100,
    prompt_tokens=10,
    max_new_tokens=22,
    rows=3,
    reference=True,
)


def test_every_part_of_a_small_plan_by_hand():
    shape = ModelShape.from_hf_config(HAND)
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q k v, o, MLP, norms
    assert layer == 36_992 == shape.layer_parameters
    params = 2 * layer + 1000 * 64 + 64  # layers, tied embedding, final norm
    assert params == 138_048 == shape.num_parameters
    plan = plan_memory(shape, HAND_SETTINGS)
    assert plan.weights == plan.gradients == 138_048 * 4 // 2 == 276_096
    assert plan.optimizer == 2 * 276_096
    # dist.grad_sync=minibatch (the default): an unsharded float32 gradient of everything
    assert plan.accumulated_gradients == 4 * 138_048 == 552_192
    assert plan.generation_copy == 138_048 * 2  # whole, bf16 (rollout.tp_size 1)
    # two bf16 layers, the bf16 embedding + final norm, one float32 layer gradient
    assert plan.gathered_layers == (2 * layer + 64_064) * 2 + layer * 4 == 424_064
    per_token_layer = 2 * (6 * 64 + 2 * 32 + 4 * 128) + 16 * 64
    assert plan.activations == 100 * 2 * per_token_layer == 588_800
    # The chunked head under FSDP: all 100 tokens fit a chunk (2**26 // 1000 = 67108). Its
    # backward holds the float32 logits and their bf16 copy, the head's float32 gradient, and
    # a chunk's bf16 [V, H] gradient with its float32 copy (the weight itself is in the
    # gathered root): 1_240_000; its forward, 16 bytes a logit, more at this narrow H.
    backward = 100 * 1000 * (4 + 2) + 1000 * 64 * (4 + 2 + 4)
    assert plan.output_head == max(100 * 1000 * 16, backward) == 1_600_000
    assert plan.kv_cache == 2 * 2 * 32 * 2 * (10 + 22) * 3 == 24_576  # K,V x layers x kv
    assert plan.reference == 138_048 * 2 // 2
    # Loading: the rank's float32 shard and the largest tensor (the embedding) in float32.
    assert plan.load_host == 276_096 + 1000 * 64 * 4 == 532_096
    held = 276_096 + 2 * 276_096 + 276_096 + 138_048
    # Decoding's workspace: 3 rows' float32 logits and scaled copy, float64 logits,
    # probabilities and CDF (above one layer's keys and values per query head and the
    # logits), and the rows' 22 tokens and log-probs (tests/test_decode_memory.py).
    assert plan.decode_workspace == (8 + 16) * 3 * 1000 + 12 * 3 * 22 == 72_792
    assert plan.generation_peak == held + 24_576 + 72_792
    assert plan.training_peak == held + 276_096 + 552_192 + 424_064 + 588_800 + 1_600_000
    assert plan.total == plan.training_peak and plan.host == 0
    text = format_plan(plan)
    assert "world size 2" in text and "1/2 shard" in text
    assert "output head (a logit chunk, the weight's float32 gradient)" in text
    assert "rollout.tp_size 1, dist.grad_sync minibatch" in text
    assert "host memory per rank while loading" in text
    # One process: the same chunk, and the head's weight cast to bf16; no unsharded gradient
    # beside the gradients; loading holds the whole float32 model.
    alone = plan_memory(shape, replace(HAND_SETTINGS, world_size=1))
    assert alone.output_head == 1_600_000 + 1000 * 64 * 2 == 1_728_000
    assert alone.accumulated_gradients == 0 and alone.load_host == 138_048 * 4
    assert "output head (a logit chunk, the bfloat16 weight, its float32 gradient)" in (
        format_plan(alone)
    )


def test_the_head_is_a_chunk_in_one_process_and_under_fsdp():
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-7b"])
    paper = PlanSettings()  # one 512 + 20480-token response per micro-batch, bf16
    # 2**26 // 152064 = 441 tokens of float32 + bf16 logits, the head's float32 gradient, a
    # chunk's bf16 [V, H] gradient and its float32 copy; one process adds the bf16 weight.
    chunk = 441 * 152064 * (4 + 2)
    one = plan_memory(shape, paper).output_head
    assert one == chunk + 152064 * 3584 * (2 + 4 + 2 + 4)
    for w in (2, 8, 64):  # 5.45 GiB, whatever the world size
        fsdp = plan_memory(shape, replace(paper, world_size=w)).output_head
        assert fsdp == chunk + 152064 * 3584 * (4 + 2 + 4)
    # Two responses per micro-batch: the same chunk.
    two = replace(paper, world_size=8, microbatch_tokens=2 * 20992)
    assert plan_memory(shape, two).output_head == fsdp
    # float32 compute: the chunk's gradient is added in place, no [V, H] temporary.
    fp32 = replace(paper, world_size=8, compute_dtype="float32")
    assert plan_memory(shape, fp32).output_head == 441 * 152064 * 8 + 152064 * 3584 * 4


def test_grad_sync_minibatch_adds_exactly_a_float32_gradient_of_the_whole_model():
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-7b"])
    for w in (2, 8, 64):
        mini = plan_memory(shape, replace(HAND_SETTINGS, world_size=w, grad_sync="minibatch"))
        micro = plan_memory(shape, replace(HAND_SETTINGS, world_size=w, grad_sync="microbatch"))
        assert mini.training_peak - micro.training_peak == 4 * 7_615_616_512
        assert mini.generation_peak == micro.generation_peak  # freed after the reduce-scatter
        assert micro.accumulated_gradients == 0
    # bf16 master weights too: FSDP2 accumulates in its float32 reduce dtype.
    bf16 = replace(HAND_SETTINGS, world_size=8, param_dtype="bfloat16")
    assert plan_memory(shape, bf16).accumulated_gradients == 4 * 7_615_616_512
    # One process has no FSDP: the option changes nothing.
    alone = replace(HAND_SETTINGS, world_size=1)
    assert plan_memory(shape, alone) == replace(
        plan_memory(shape, replace(alone, grad_sync="microbatch")), settings=alone
    )
    with pytest.raises(ValueError, match="dist.grad_sync"):
        plan_memory(shape, replace(alone, grad_sync="step"))


def test_tp_size_divides_the_copys_split_part_and_the_kv_cache():
    shape = ModelShape.from_hf_config(HAND)  # 4 heads, 2 KV heads, tied, no biases
    # Split (dapo.dist.tensor_parallel.tp_plan): both layers' q, k, v, o (64 x 128 + 64 x 64)
    # and MLP (3 x 64 x 128) weights, and the embedding (1000 x 64), whose shard the tied head
    # shares; whole: the 5 RMSNorms (4 x 64 in the layers, 64 at the end).
    split = 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128) + 1000 * 64
    assert shape.tp_split_parameters == split == 137_728 == 138_048 - 5 * 64
    tp2 = plan_memory(shape, replace(HAND_SETTINGS, tp_size=2))
    assert tp2.generation_copy == 137_728 * 2 // 2 + 5 * 64 * 2 == 138_368
    assert tp2.kv_cache == 24_576 // 2
    untied = ModelShape.from_hf_config({**HAND, "tie_word_embeddings": False})
    assert untied.tp_split_parameters == split + 1000 * 64  # the vocabulary-parallel head
    # Qwen2's q, k, v biases are split with their columns; Llama's o bias stays whole.
    biased = ModelShape.from_hf_config({**HAND, "attention_bias": True})
    assert biased.num_parameters - biased.tp_split_parameters == 5 * 64 + 2 * 64
    qwen = ModelShape.from_hf_config({**HAND, "model_type": "qwen2"})
    assert qwen.tp_split_parameters == split + 2 * (64 + 2 * 32)
    for name, k in (("qwen2.5-7b", 2), ("qwen2.5-7b", 4), ("qwen2.5-32b", 8)):
        big = ModelShape.from_hf_config(KNOWN_SHAPES[name])
        one = plan_memory(big, replace(PlanSettings(), world_size=64))
        tp = plan_memory(big, replace(PlanSettings(), world_size=64, tp_size=k))
        whole = big.num_parameters - big.tp_split_parameters
        assert tp.generation_copy == big.tp_split_parameters * 2 // k + whole * 2
        assert one.generation_copy - whole * 2 == k * (tp.generation_copy - whole * 2)
        assert one.kv_cache == k * tp.kv_cache
        # Only generation changes.
        assert tp.training_peak - one.training_peak == tp.generation_copy - one.generation_copy
    for settings, match in (
        (replace(HAND_SETTINGS, world_size=1, tp_size=2), "needs torchrun"),
        (replace(HAND_SETTINGS, world_size=6, tp_size=4), "must divide the world size 6"),
        (replace(HAND_SETTINGS, world_size=4, tp_size=4), "2 key-value heads"),
    ):
        with pytest.raises(ValueError, match=match):
            plan_memory(shape, settings)


def test_loading_holds_a_shard_and_the_largest_tensor_per_rank():
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-32b"])
    assert shape.largest_tensor == 152064 * 5120  # the embedding (and the untied head)
    for w in (8, 64):
        plan = plan_memory(shape, replace(PlanSettings(), world_size=w))
        assert plan.load_host == -(-32_763_876_352 * 4 // w) + 152064 * 5120 * 4
    assert plan.load_host / 2**30 < 5  # 4.81 GiB at 64 ranks, not 122 GiB
    alone = plan_memory(shape, PlanSettings(param_dtype="bfloat16"))
    assert alone.load_host == 32_763_876_352 * 2  # the whole model in param_dtype
    # Host memory is not GPU memory: no peak has it.
    assert plan.total == max(plan.training_peak, plan.generation_peak)


def test_more_ranks_shrink_the_shards_but_not_the_generation_copy():
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-7b"])
    one, two, four = (plan_memory(shape, replace(HAND_SETTINGS, world_size=w)) for w in (1, 2, 4))
    for a, b in ((one, two), (two, four)):
        for part in ("weights", "gradients", "optimizer", "reference"):
            assert getattr(b, part) == getattr(a, part) / 2, part
        assert b.generation_copy == a.generation_copy == 2 * shape.num_parameters
        assert b.kv_cache == a.kv_cache and b.activations == a.activations
    assert one.gathered_layers == 0 < two.gathered_layers == four.gathered_layers
    # One process in float32 generates from its own module: no copy at all.
    fp32 = plan_memory(shape, replace(HAND_SETTINGS, world_size=1, compute_dtype="float32"))
    assert fp32.generation_copy == 0
    assert plan_memory(shape, replace(HAND_SETTINGS, compute_dtype="float32")).generation_copy == (
        4 * shape.num_parameters
    )


def test_cpu_offload_moves_the_sharded_states_to_the_host():
    shape = ModelShape.from_hf_config(HAND)
    gpu = plan_memory(shape, HAND_SETTINGS)
    off = plan_memory(shape, replace(HAND_SETTINGS, cpu_offload=True))
    states = gpu.weights + gpu.gradients + gpu.optimizer + gpu.reference  # reference sharded too
    assert off.host == states and gpu.host == 0
    assert off.training_peak == gpu.training_peak - states
    assert off.generation_peak == gpu.generation_peak - states + gpu.gradients
    assert off.generation_copy == gpu.generation_copy  # whole, on the GPU
    assert "host memory per rank" in format_plan(off)
    # One process runs without the dist options.
    alone = replace(HAND_SETTINGS, world_size=1)
    offloaded = plan_memory(shape, replace(alone, cpu_offload=True))
    assert offloaded.host == 0 and offloaded.total == plan_memory(shape, alone).total


def test_activation_checkpointing_keeps_layer_inputs_and_one_layer():
    shape = ModelShape.from_hf_config(HAND)
    plan = plan_memory(shape, replace(HAND_SETTINGS, activation_checkpointing=True))
    one_layer = activation_bytes(shape, tokens=100, compute=2, checkpointing=False) // 2
    assert plan.activations == 100 * 2 * 64 * 2 + one_layer


def _kept_bytes(layers: int, tokens: int, weights: torch.dtype, autocast: bool):
    """Bytes a forward pass of a real Qwen2 decoder, its layers checkpointed as one process
    checkpoints them, leaves alive for the backward (no KV cache, as training calls it)."""
    model = _qwen2(layers, weights)
    checkpoint_layers(model)
    ids = torch.randint(64, (1, tokens))
    with LiveBytes() as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        held = sum(live.live.values())
    del hidden
    return held, ModelShape.from_hf_config(model.config.to_dict())


@pytest.mark.parametrize(
    ("weights", "autocast", "world_size"),
    [
        (torch.float32, True, 1),  # one process: float32 weights under bf16 autocast
        (torch.bfloat16, False, 2),  # FSDP: bf16 weights gathered, a bf16 residual stream
    ],
    ids=["one-process-autocast", "fsdp-bf16"],
)
def test_checkpointed_layers_keep_inputs_in_the_residual_streams_dtype(
    weights, autocast, world_size
):
    # Autocast computes the projections in bf16 but leaves the embedding's output and the
    # residual adds in the weights' dtype: in one process each layer's kept input is float32.
    # Differences over layers and tokens leave the kept inputs alone (weights, autocast's
    # copies of them, the embedding's output and rotary tables do not grow with both).
    runs = {(n, t): _kept_bytes(n, t, weights, autocast) for n in (3, 1) for t in (256, 128)}
    held = {key: bytes_ for key, (bytes_, _) in runs.items()}
    measured = ((held[3, 256] - held[1, 256]) - (held[3, 128] - held[1, 128])) / 128 / 2
    settings = PlanSettings(world_size=world_size, activation_checkpointing=True)
    planned = {
        key: plan_memory(shape, replace(settings, microbatch_tokens=key[1])).activations
        for key, (_, shape) in runs.items()
    }
    modelled = ((planned[3, 256] - planned[1, 256]) - (planned[3, 128] - planned[1, 128])) / 256
    stream = 4 if world_size == 1 else 2
    assert measured == pytest.approx(stream * 128, rel=0.05), measured  # H = 128
    assert modelled == pytest.approx(measured, rel=0.05), (modelled, measured)


def _qwen2(layers: int, weights: torch.dtype) -> torch.nn.Module:
    """A small real Qwen2 decoder (H 128, I 704, 4 heads, 2 key-value heads) in ``weights``."""
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(weights)


def _saved_bytes(layers: int, tokens: int, weights: torch.dtype, autocast: bool):
    """Bytes of the tensors autograd saves in a forward pass of a real Qwen2 decoder."""
    model = _qwen2(layers, weights)
    storages: dict[int, int] = {}  # the graph keeps every saved tensor alive: no reuse

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model.get_decoder()(input_ids=torch.randint(64, (1, tokens)))
    del hidden
    return sum(storages.values()), ModelShape.from_hf_config(model.config.to_dict())


@pytest.mark.parametrize(("weights", "autocast"), [(torch.bfloat16, False), (torch.float32, True)])
def test_the_activation_model_is_near_what_autograd_saves(weights, autocast):
    # Differences over layers and tokens leave activations alone: weights (and autocast's
    # copies of them) do not grow with tokens, the embedding and final norm not with layers.
    (a, shape), (b, _), (c, _), (d, _) = (
        _saved_bytes(layers, tokens, weights, autocast)
        for layers, tokens in ((2, 256), (1, 256), (2, 128), (1, 128))
    )
    measured = ((a - b) - (c - d)) / 128
    modelled = activation_bytes(shape, tokens=1, compute=2, checkpointing=False) / shape.layers
    assert 0.8 < modelled / measured < 1.25, (modelled, measured)


@pytest.mark.parametrize(
    ("weights", "autocast", "world_size", "lora"),
    [
        (torch.bfloat16, False, 2, 0),  # FSDP: the head's weight gathered in bf16
        (torch.float32, True, 1, 0),  # one process: float32 weights under bf16 autocast
        (torch.float32, False, 2, 0),  # float32 compute (gloo on a CPU)
        (torch.bfloat16, False, 2, 16),  # LoRA: the head frozen, no weight gradient
        (torch.float32, True, 1, 16),
    ],
    ids=["fsdp-bf16", "one-process-autocast", "float32", "lora-fsdp-bf16", "lora-autocast"],
)
def test_the_head_model_is_what_the_chunked_head_holds(
    monkeypatch, weights, autocast, world_size, lora
):
    # dapo.algo.logits's chunked head, forward and backward, 50 positions in chunks of 10, at
    # a vocabulary whose [V, H] tensors dominate as a real model's do (152k x 3584).
    positions, vocab, hidden_size, chunk = 50, 20_000, 64, 10
    from dapo.algo import logits

    for module in (logits, gpu_memory):
        monkeypatch.setattr(module, "HEAD_CHUNK_ELEMENTS", chunk * vocab)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(positions, hidden_size, generator=g, dtype=weights, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=weights, requires_grad=not lora)
    ids = torch.randint(vocab, (positions,), generator=g)
    with LiveBytes(hidden, weight, ids) as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, _ = token_logprobs_from_hidden(hidden, weight, ids, with_entropy=True)
        logp.sum().backward()
    shape = replace(ModelShape.from_hf_config(HAND), vocab=vocab, hidden=hidden_size)
    compute = "bfloat16" if autocast or weights == torch.bfloat16 else "float32"
    master = str(weights).removeprefix("torch.")
    settings = PlanSettings(
        world_size=world_size, param_dtype=master, compute_dtype=compute, lora_rank=lora
    )
    modelled = plan_memory(shape, replace(settings, microbatch_tokens=positions)).output_head
    # Above the model: the hidden states' gradient and the [N] log-probs (1% here).
    assert 1 <= live.peak / modelled < 1.03, (live.peak, modelled)


def test_constants_copied_from_torch_modules_agree():
    from dapo.algo import logits
    from dapo.training import sampling

    assert gpu_memory.HEAD_CHUNK_ELEMENTS == logits.HEAD_CHUNK_ELEMENTS
    assert gpu_memory.MAX_OVERSAMPLE == sampling.MAX_OVERSAMPLE


def test_settings_from_a_config():
    cfg = load_config(None, ["model.compute_dtype=bfloat16", "algo.kl_coef=0.01"], base="paper")
    s = settings_from_config(cfg, world_size=8, prompt_tokens=500)
    # The paper's rounds: up to 4 x 512 prompts when oversampled, x 16, over 8 ranks.
    assert s.rows == 4 * 512 * 16 // 8
    # A 20980-token response is longer than the 16384-token budget: a micro-batch alone.
    assert s.microbatch_tokens == 500 + 20480
    assert s.reference and s.compute_dtype == "bfloat16" and s.world_size == 8
    assert (s.tp_size, s.grad_sync) == (1, "minibatch")
    overrides = ["rollout.rows_per_generate=384", "sampling.oversample=false"]
    cfg = load_config(None, overrides, base="paper")
    assert settings_from_config(cfg, world_size=64, prompt_tokens=10).rows == 128  # 512x16/64
    assert settings_from_config(cfg, world_size=8, prompt_tokens=10).rows == 384
    # Tensor parallel 8: 64 ranks are 8 generating groups, each with 512 x 16 / 8 rows of a
    # round, every rank of a group holding them all (1/8 of their KV heads each).
    overrides += ["rollout.tp_size=8", "dist.grad_sync=microbatch"]
    cfg = load_config(None, overrides, base="paper")
    s = settings_from_config(cfg, world_size=64, prompt_tokens=10)
    assert (s.rows, s.tp_size, s.grad_sync) == (384, 8, "microbatch")
    assert settings_from_config(cfg, world_size=256, prompt_tokens=10).rows == 256  # 32 groups
    assert settings_from_config(cfg, world_size=64, prompt_tokens=10, tp_size=2).rows == 256


def test_a_model_directory_is_read_from_its_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(KNOWN_SHAPES["qwen2.5-1.5b"]))
    cfg = load_config(None, [f"model.path={tmp_path}"])
    assert gpu_memory.model_shape(cfg).num_parameters == 1_543_714_304
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    memory_table.print_plan(cfg, world_size=1, prompt_tokens=10)
    assert "memory plan: not available (model_type 'mamba'" in capsys.readouterr().out


def test_a_dry_run_without_cuda_says_what_a_gpus_plan_adds(tmp_path, capsys, monkeypatch):
    """The docs run a GPU recipe's dry run "on any machine": without CUDA it planned for the
    CPU, leaving out the card's overheads (6.6 GiB of the 7B recipe's) without a word."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "config.json").write_text(json.dumps(KNOWN_SHAPES["qwen2.5-1.5b"]))
    note = (
        "  note: planned for this machine's CPU, which has no CUDA; on GPUs a plan adds the "
        "CUDA runtime, NCCL's buffers and the allocator's reserve: python -m dapo.memory_plan "
        "--config RECIPE plans a recipe on the GPUs it states\n"
    )
    cfg = load_config(RECIPES / "dapo-qwen2.5-math-1.5b.yaml", [f"model.path={tmp_path}"])
    memory_table.print_plan(cfg, world_size=1, prompt_tokens=10)
    out = capsys.readouterr().out
    assert note in out and "CUDA runtime and NCCL buffers" not in out.replace(note, "")
    for other in (apply_overrides(cfg, ["model.device=cpu"]), load_config(None)):  # no GPU
        memory_table.print_plan(other, world_size=1, prompt_tokens=10)
        assert note not in capsys.readouterr().out


def test_dry_run_prints_the_plan_for_the_world_size(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(policy, "load_policy", pytest.fail)  # a dry run loads no model
    monkeypatch.setenv("WORLD_SIZE", "3")  # the flag wins over torchrun's variable
    small = ["arith.num_train=64", "arith.num_val=8", f"run.out_dir={tmp_path}"]
    assert cli.main(["train", "--dry-run", "--world-size", "4", *small]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU on paper, world size 4:" in out
    assert "weights (float32, 1/4 shard)" in out and "peak per GPU" in out
    assert "settings: rollout.tp_size 1, dist.grad_sync minibatch" in out
    assert "unsharded float32 gradients (grad_sync minibatch)" in out
    assert cli.main(["train", "--dry-run", *small]) == 0
    assert "memory per GPU on paper, world size 3:" in capsys.readouterr().out
    # The run's own rollout.tp_size and dist.grad_sync (the tiny model's 2 KV heads: tp 2).
    tp = ["rollout.tp_size=2", "dist.grad_sync=microbatch"]
    assert cli.main(["train", "--dry-run", "--world-size", "4", *small, *tp]) == 0
    out = capsys.readouterr().out
    assert "settings: rollout.tp_size 2, dist.grad_sync microbatch" in out
    assert "generation copy (tp 2: 1/2 split)" in out and "1/2 of the KV heads" in out
    assert "unsharded float32 gradients" not in out
    cfg = load_config(None, [*small, *tp])
    shape = gpu_memory.model_shape(cfg)
    plan = plan_memory(shape, settings_from_config(cfg, world_size=4, prompt_tokens=77))
    assert format_plan(plan) in out  # the plan of the run's config (its longest prompt: 77)
    # One process cannot generate tensor-parallel: the dry run refuses, as the run would.
    assert cli.main(["train", "--dry-run", "--world-size", "1", *small, *tp]) == 2
    assert "rollout.tp_size=2 splits generation over 2 ranks" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("copies", [True, False])
def test_the_dry_run_says_what_a_newer_transformers_saves_while_decoding(
    copies, monkeypatch, capsys
):
    # The demo's 4 query heads on 2 key-value heads: before 5.23 a layer's keys and values
    # are copied to every query head, which the note prices; from 5.23 there is no note.
    monkeypatch.setattr(gpu_memory, "transformers_copies_gqa", lambda: copies)
    cfg = load_config(None, ["arith.num_train=64", "arith.num_val=8"])
    memory_table.print_plan(cfg, world_size=1, prompt_tokens=20)
    out = capsys.readouterr().out
    settings = settings_from_config(cfg, world_size=1, prompt_tokens=20)
    shape = gpu_memory.model_shape(cfg)
    saved = (
        plan_memory(shape, replace(settings, gqa_copy=True)).decode_workspace
        - plan_memory(shape, replace(settings, gqa_copy=False)).decode_workspace
    )
    assert saved > 0
    note = "5.23 or later does not, which would save"
    assert (note in out) == copies
    if copies:
        assert f"{note} {saved / 2**20:.2f} MiB here" in out


def test_the_documented_command_prints_the_table():
    import subprocess
    import sys

    from dapo.memory_plan import the_table_rows

    out = subprocess.run(
        [sys.executable, "-m", "dapo.memory_plan"], capture_output=True, text=True, check=True
    ).stdout
    assert out == memory_table.markdown_table(the_table_rows()) + "\n"
    # docs/scale-out.md shows it as printed.
    docs = (Path(__file__).resolve().parents[1] / "docs" / "scale-out.md").read_text()
    assert out in docs


RECIPES = Path(__file__).resolve().parents[1] / "recipes"
COMPONENT_KEYS = {f"{part}_gib" for part in memory_table.COMPONENTS}
COMPONENT_KEYS |= {"load_host_gib", "offloaded_host_gib"}


def test_the_table_as_json_rows_at_the_recipes_settings():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "dapo.memory_plan", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = json.loads(out)
    models = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b")
    assert [(r["model"], r["gpus"]) for r in rows] == [(m, w) for m in models for w in (1, 8, 64)]
    keys = {"model", "gpus", "gpu_gib", "peak_train_gib", "peak_generate_gib", "spare_gib"}
    keys |= {"fits", "tp_size", "grad_sync", "activation_checkpointing", "microbatch_tokens"}
    keys |= {"rows_per_generate", "params", *COMPONENT_KEYS}
    for row in rows:
        assert keys <= set(row) and row["gpu_gib"] == 80
        parts = sum(row[f"{part}_gib"] for part in memory_table.COMPONENTS)
        assert max(row["peak_train_gib"], row["peak_generate_gib"]) <= parts + 0.1
    by = {(r["model"], r["gpus"]): r for r in rows}
    # 0.5B and 1.5B: the defaults; 7B and 32B: their recipes' (tp_size at most the GPUs, 1 alone).
    assert (
        by["qwen2.5-1.5b", 8]["tp_size"] == 1
        and not by["qwen2.5-1.5b", 8]["activation_checkpointing"]
    )
    assert [by["qwen2.5-7b", w]["tp_size"] for w in (1, 8, 64)] == [1, 4, 4]
    assert [by["qwen2.5-32b", w]["tp_size"] for w in (1, 8, 64)] == [1, 8, 8]
    assert by["qwen2.5-7b", 8]["grad_sync"] == "minibatch"
    assert by["qwen2.5-32b", 64]["grad_sync"] == "microbatch"
    assert by["qwen2.5-32b", 64]["activation_checkpointing"] and by["qwen2.5-32b", 64]["fits"]


@pytest.mark.parametrize(
    ("recipe", "model", "gpus"),
    [("dapo-qwen2.5-7b.yaml", "Qwen2.5-7B", 8), ("dapo-qwen2.5-32b.yaml", "Qwen2.5-32B", 64)],
)
def test_the_papers_lengths_fit_80_gb_gpus(recipe, model, gpus):
    # Issue 26's targets: L_max 20480 on 80 GB cards, within 76 GiB in both phases.
    from dapo.memory_plan import recipe_plan

    row = recipe_plan(RECIPES / recipe)
    assert (row["model"], row["gpus"], row["gpu_gib"]) == (model, gpus, 80)
    assert row["max_new_tokens"] == 20480 and row["activation_checkpointing"]
    assert row["peak_train_gib"] <= 76 and row["peak_generate_gib"] <= 76, row
    assert row["tp_size"] == (4 if gpus == 8 else 8)


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda r: r.stem)
def test_every_recipe_fits_the_hardware_it_states_with_4_gib_to_spare(recipe):
    from dapo.memory_plan import recipe_plan

    row = recipe_plan(recipe)  # neither weights nor data needed: built-in shapes
    assert row["fits"] and row["spare_gib"] >= 4.0, row


def test_a_recipes_plan_as_json_and_its_hardware_checked(tmp_path):
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo.memory_plan",
            "--config",
            str(RECIPES / "dapo-qwen2.5-math-1.5b.yaml"),
            "--json",
        ],  # noqa: E501
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (row,) = json.loads(out)
    assert {"model", "gpus", "gpu_gib", "peak_train_gib", "peak_generate_gib"} <= set(row)
    assert COMPONENT_KEYS | {"tp_size", "grad_sync", "microbatch_tokens"} <= set(row)
    assert (row["model"], row["gpus"], row["gpu_gib"]) == ("Qwen2.5-Math-1.5B", 1, 80.0)
    # The plan of its settings on 1 GPU: 54.0 GiB of the run's tensors in training, plus the
    # CUDA runtime (1 GiB, one process: no NCCL) and the allocator's reserve (20% of 25.10
    # GiB of activations, packed, and 2.98 of output head): 60.6; generating, 63.9 GiB + 1 whatever
    # transformers is installed: on CUDA the native engine decodes a whole Qwen2 on its own
    # step, which copies no keys and values per query head (transformers before 5.23 would:
    # 8.1 GiB beside the KV cache instead of 1.5).
    assert row["runtime_gib"] == 1.0 and row["allocator_slack_gib"] == 5.62
    assert row["usable_gib"] == 79.19  # what an "80 GB" H100 reports to CUDA
    generating = 64.86  # prompts of 1024 tokens: the most the 4096-token context leaves
    assert (row["peak_train_gib"], row["peak_generate_gib"]) == (60.58, generating)
    assert row["spare_gib"] == round(79.19 - max(60.58, generating), 2)
    bad = tmp_path / "r.yaml"
    bad.write_text("base: demo\nhardware: {gpus: 2}\n")
    from dapo.config.loading import read_hardware

    with pytest.raises(ValueError, match="hardware.gpu_gib must be a number > 0"):
        read_hardware(bad)
    bad.write_text("base: demo\n")
    with pytest.raises(ValueError, match="no hardware: mapping"):
        read_hardware(bad)


def test_layers_kept_gathered_after_forward_count_every_layer_in_the_compute_dtype():
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-7b"])
    kept = plan_memory(shape, PlanSettings(world_size=8, reshard_after_forward=False))
    freed = plan_memory(shape, PlanSettings(world_size=8))
    # bf16: (28 - 2) more layers of 2 bytes per parameter, nothing else changes.
    assert kept.gathered_layers - freed.gathered_layers == 26 * shape.layer_parameters * 2
    assert kept.training_peak - freed.training_peak == 26 * shape.layer_parameters * 2


@pytest.mark.parametrize("k", [1, 2])
def test_generating_ahead_holds_its_copy_and_k_clones_and_overlaps_the_kv_cache(k):
    """train.async_staleness=k: the generator's copy and up to k clones of new weights, in
    bf16 when that computes, held through both phases; its KV cache is in use while training."""
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-1.5b"])
    turns = plan_memory(shape, PlanSettings())
    ahead = plan_memory(shape, PlanSettings(staleness=k))
    p = shape.num_parameters
    assert ahead.ahead == (1 + k) * p * 2 and turns.ahead == 0
    assert ahead.generation_peak == turns.generation_peak + (1 + k) * p * 2
    decoding = turns.kv_cache + turns.decode_workspace
    assert ahead.training_peak == turns.training_peak + (1 + k) * p * 2 + decoding
    fp32 = plan_memory(shape, PlanSettings(staleness=k, compute_dtype="float32"))
    assert fp32.ahead == (1 + k) * p * 4
    assert f"generating ahead: its copy and up to {k} clones (bfloat16)" in format_plan(ahead)
    with pytest.raises(ValueError, match="async_staleness under torchrun needs dist.rollout_r"):
        plan_memory(shape, PlanSettings(staleness=k, world_size=8))


@pytest.mark.parametrize("k", [0, 2])
def test_with_generator_ranks_the_plan_is_a_trainers_and_a_generator_holds_a_whole_copy(k):
    """dist.rollout_ranks=2 of 8: the table plans a trainer of 6, whose rank 0 keeps the
    versions of the weights it sent in host memory (none on the GPU) and decodes nothing
    while it trains; a generator holds the policy whole in bf16 and the KV cache of its rows
    (the next weights arrive in its host memory)."""
    overrides = [f"train.async_staleness={k}", "dist.rollout_ranks=2"]
    cfg = load_config(None, [*overrides, "rollout.rows_per_generate=64"])
    s = gpu_memory.settings_from_config(cfg, world_size=8, prompt_tokens=100)
    assert (s.world_size, s.generators, s.staleness) == (6, 2, k)
    s = replace(s, compute_dtype="bfloat16", param_dtype="float32")
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-1.5b"])
    plan = plan_memory(shape, s)
    alone = plan_memory(shape, replace(s, staleness=0, generators=0))
    p = shape.num_parameters
    assert plan.ahead == 0
    # No KV cache beside training; one more NCCL communicator (the trainers' own group).
    assert plan.training_peak == alone.training_peak
    gen = generator_bytes(shape, replace(s, world_size=1, rows=64, generators=0))
    tokens = 100 + cfg.rollout.max_new_tokens
    assert gen["policy"] == p * 2
    assert gen["kv_cache"] == 2 * 28 * 2 * 128 * 64 * tokens * 2  # K, V x layers x heads x dim
    assert set(gen) == {"policy", "kv_cache", "decode_workspace", "vllm", "runtime"}
    assert gen["vllm"] == gen["runtime"] == 0  # the native engine; a device not stated
    line = memory_table.generator_line(cfg, plan, s)
    assert "a generator rank (dist.rollout_ranks=2" in line and "KV cache (64 rows)" in line
    assert "the next weights arrive in host memory" in line
    assert "not yet taken" not in format_plan(plan)


def test_lora_counts_gradients_and_adamw_of_the_adapters_alone():
    """Qwen2.5-1.5B with rank-16 adapters on every attention and MLP Linear: per layer
    16 x (q 1536+1536, k 1536+256, v 1536+256, o 1536+1536, gate and up 1536+8960 each,
    down 8960+1536) = 16 x 41,216 = 659,456; 28 layers: 18,464,768 adapter parameters."""
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-1.5b"])
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    a = 28 * 16 * 41_216
    assert shape.lora_parameters(16, targets) == a == 18_464_768
    assert shape.lora_parameters(16, ("q_proj", "c_attn")) == 28 * 16 * 3072
    p = shape.num_parameters
    full = plan_memory(shape, PlanSettings(reference=True))
    lora = plan_memory(shape, PlanSettings(reference=True, lora_rank=16, lora_targets=targets))
    assert (lora.weights, lora.gradients, lora.optimizer) == (4 * p + 4 * a, 4 * a, 8 * a)
    assert lora.reference == 0 and full.reference == 2 * p  # the policy with adapters off
    assert full.optimizer / lora.optimizer == pytest.approx(p / a)  # 83.6x less AdamW state
    assert lora.total < full.total
    cfg = load_config(None, ["model.lora.rank=16", "model.lora.target_modules=[q_proj]"])
    s = settings_from_config(cfg, world_size=1, prompt_tokens=10)
    assert (s.lora_rank, s.lora_targets) == (16, ("q_proj",))


def test_lora_sampled_from_a_merged_copy_counts_the_adapted_weights_again():
    """``model.lora.merged_sampling``: the eager loop and hf sample from a float32 copy of the
    adapted Linears, merged. Qwen2.5-1.5B per layer: 1536 x (q 1536 + k 256 + v 256 + o 1536
    + gate, up and down 8960 each) = 46,792,704 weights; 28 layers: 1,310,195,712."""
    shape = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-1.5b"])
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert shape.lora_target_weights(targets) == 28 * 46_792_704 == 1_310_195_712
    assert shape.lora_target_weights(("q_proj",)) == 28 * 1536 * 1536

    def copy(**settings) -> int:
        on = dict(lora_rank=16, lora_targets=targets, device="cuda", compute_dtype="bfloat16")
        merged = plan_memory(shape, PlanSettings(**on | settings)).generation_copy
        off = PlanSettings(**on | settings | {"merged_sampling": False})
        return merged - plan_memory(shape, off).generation_copy

    assert copy(engine="hf") == copy(cuda_graphs=False) == 4 * 1_310_195_712
    assert copy(device="cpu", compute_dtype="float32") == 4 * 1_310_195_712
    assert copy() == 0  # the CUDA-graph path merges into the bf16 copy it makes anyway
    assert copy(engine="vllm") == copy(engine="hf", param_dtype="bfloat16") == 0
    assert copy(engine="hf", world_size=2) == 0  # under FSDP: a bf16 generation copy
    f32 = dict(world_size=2, compute_dtype="float32", device="cpu")
    assert copy(**f32) == 4 * 1_310_195_712  # a float32 one, merged per call again
    assert copy(**f32, tp_size=2) == 0  # the tensor-parallel copy is filled merged
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.merged_sampling=false"])
    assert not settings_from_config(cfg, world_size=1, prompt_tokens=10).merged_sampling


def test_episodes_count_the_parked_caches_beside_the_decoding_ones():
    """With ``env.class`` the native engine keeps the caches of rows that stopped at a turn
    end while the others decode (dapo/rollout/parking.py): the KV cache twice; vLLM's
    reservation is its own."""
    shape = ModelShape.from_hf_config(HAND)
    cfg = load_config(None, ["env.class=math_tool"])
    assert settings_from_config(cfg, world_size=1, prompt_tokens=10).episodes
    assert not settings_from_config(load_config(None, []), world_size=1, prompt_tokens=10).episodes
    one = plan_memory(shape, HAND_SETTINGS)
    two = plan_memory(shape, replace(HAND_SETTINGS, episodes=True))
    assert two.kv_cache == 2 * one.kv_cache == 2 * 24_576
    vllm = replace(HAND_SETTINGS, engine="vllm")
    assert plan_memory(shape, replace(vllm, episodes=True)).kv_cache == 0
