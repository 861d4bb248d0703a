"""The native engine's CUDA-graph path (dapo.rollout.static_decode, dapo.rollout.decoder_step)
run without graphs on the CPU: the same tokens and log-probs as the eager loop, reads on the
host only at read-backs, and the models it refuses. The graphs themselves need a GPU
(``benchmarks/decode_check.py`` compares them with this path there, bit for bit)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dapo.models import lora
from dapo.models.logprobs import autocast
from dapo.rollout import make_engine, sampling, static_decode
from dapo.rollout.decoder_step import DecoderStep, unsupported_reason
from dapo.rollout.native import decode

SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
)
MODELS = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES)),
    "llama (tied)": lambda: LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=True)),
    "qwen3 (head norms)": lambda: Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16)),
}
STOPS = [5, 6, 7, 8]  # rows finish at different steps: the batch shrinks
SAMPLING = {
    "sampled": {},
    "top-p, temperature": {"top_p": 0.7, "temperature": 0.8},
    "greedy": {"greedy": True},
    "a seed per prompt": {"seed": [1, 2, 3]},
    "EOS ignored": {"ignore_eos": True},
}


def model_of(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 7, 6 and 4 tokens, left padded."""
    ids = torch.randint(3, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def both(model, *, new_tokens: int = 40, compute=None, **options):
    """(eager, static) results of the same rollout: 4 rows per prompt."""
    ids, mask = prompts()
    kwargs = dict(group_size=4, max_new_tokens=new_tokens, stop_token_ids=STOPS, pad_token_id=0)
    with torch.inference_mode():
        with autocast(model, compute):
            eager = decode(model, ids, mask, **kwargs, **options)
        static = static_decode.static_decode(
            model, ids, mask, compute_dtype=compute, graphs=False, **kwargs, **options
        )
    return eager, static


@pytest.fixture(params=["weights as they are", "fused and folded"])
def fused(request, monkeypatch):
    """The step on the model's own float32 weights, or (what it does on a GPU, where float32
    master weights are copied into bf16) on fused copies with the norms folded in."""
    fuse = request.param == "fused and folded"
    monkeypatch.setattr(static_decode, "DecoderStep", functools.partial(DecoderStep, fuse=fuse))
    return fuse


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("how", SAMPLING)
def test_the_same_tokens_and_log_probs_as_the_eager_loop(arch, how, fused):
    eager, static = both(model_of(arch), **SAMPLING[how])
    assert torch.equal(static[0], eager[0])
    # float32: the fused projections and folded norm weights change the order of sums only.
    torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-5)
    if how not in ("EOS ignored", "greedy"):  # rows finish, so the batch shrinks
        assert torch.isin(eager[0], torch.tensor(STOPS)).any(dim=1).sum() >= 7
    # Slots: every row in the batch at every step; the static batch shrinks every 16 steps only.
    assert eager[2] <= static[2] <= 12 * eager[0].shape[1]


def batch_sizes_seen(monkeypatch) -> list[int]:
    """The batch sizes the static loop shrinks to, appended as it compacts."""
    sizes: list[int] = []
    real = static_decode.State.compact
    monkeypatch.setattr(
        static_decode.State,
        "compact",
        lambda self, slots, size, filled: (sizes.append(size), real(self, slots, size, filled)),
    )
    return sizes


def test_small_blocks_and_buckets_refill_uniforms_and_shrink_the_batch(monkeypatch, fused):
    """Uniforms refilled every 8 steps, a read-back every 4, attention widths in steps of 16,
    over 60 tokens: the rows shrink through the batch sizes 12, 8, 4, 2, 1."""
    monkeypatch.setattr(static_decode, "UNIFORM_BLOCK", 8)
    monkeypatch.setattr(static_decode, "CHECK_EVERY", 4)
    monkeypatch.setattr(static_decode, "WIDTH_STEP", 16)
    sizes = batch_sizes_seen(monkeypatch)
    eager, static = both(model_of("qwen2"), new_tokens=60, seed=[4, 5, 6])
    assert torch.equal(static[0], eager[0])
    torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-5)
    assert sizes and sizes == sorted(sizes, reverse=True) and set(sizes) <= {8, 4, 2, 1}


def test_slots_count_every_row_the_batch_computes(monkeypatch):
    """Slots are the (row, step) positions computed, as the eager loop counts them: the static
    loop counts its whole batch at each step, finished rows and padding copies included (the
    batch shrinks to 8 slots for 6 running rows, then to 4 and 1)."""
    sizes: list[int] = []
    real = static_decode.Runner.run
    monkeypatch.setattr(
        static_decode.Runner,
        "run",
        lambda self, size, width: (sizes.append(size), real(self, size, width)),
    )
    eager, static = both(model_of("qwen2"), new_tokens=60, seed=[4, 5, 6])
    assert static[2] == 12 + sum(sizes)  # step 0 samples all 12 rows after the prefill
    assert min(sizes) < 12  # it shrank
    # The same computation is counted the same: no row finishes, none leaves either batch.
    eager, static = both(model_of("qwen2"), new_tokens=20, ignore_eos=True)
    assert eager[2] == static[2] == 12 * 20


@pytest.mark.parametrize("width_step", [16, 48])
def test_attention_widths_in_other_steps_draw_the_same(width_step):
    """``width_step``: attention over more or fewer unfilled (masked) columns changes nothing
    drawn; a step that is not a positive multiple of 16 is refused."""
    model = model_of("qwen2")
    ids, mask = prompts()
    kwargs = dict(group_size=4, max_new_tokens=40, stop_token_ids=STOPS, pad_token_id=0)
    with torch.inference_mode():
        default = static_decode.static_decode(model, ids, mask, graphs=False, **kwargs)
        other = static_decode.static_decode(
            model, ids, mask, graphs=False, width_step=width_step, **kwargs
        )
        for bad in (40, -16):
            with pytest.raises(ValueError, match=f"width_step={bad}: give a positive multiple"):
                static_decode.static_decode(
                    model, ids, mask, graphs=False, width_step=bad, **kwargs
                )
    assert torch.equal(other[0], default[0])
    torch.testing.assert_close(other[1], default[1], rtol=0, atol=1e-6)


class HostReads(TorchDispatchMode):
    """Counts the ops that read a value on the host or size their output by the data (a
    wait for the GPU's queue on CUDA)."""

    READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "unique_dim"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.READS:
            self.reads.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_no_read_on_the_host_per_token(monkeypatch):
    """Every decoding step runs under a counter of host reads: none; the loop reads back once
    every CHECK_EVERY steps and after the last."""
    per_step: list[list[str]] = []
    real_run = static_decode.Runner.run

    def counted(self, size, width):
        with HostReads() as mode:
            real_run(self, size, width)
        per_step.append(mode.reads)

    read_backs = []
    real_read = static_decode.read_back
    monkeypatch.setattr(static_decode.Runner, "run", counted)
    monkeypatch.setattr(
        static_decode, "read_back", lambda t: (read_backs.append(1), real_read(t))[1]
    )
    _, static = both(model_of("qwen2"), new_tokens=40, ignore_eos=True, top_p=0.9)
    assert len(per_step) == 39 and all(reads == [] for reads in per_step)
    assert len(read_backs) == 3 == -(-40 // static_decode.CHECK_EVERY)  # steps 16, 32, 40
    assert static[0].shape == (12, 40)


def test_bf16_log_probs_stay_with_the_policy():
    """bf16 autocast over float32 weights (a GPU run's setting): the recorded log-probs are
    within bf16 rounding of the eager loop's on the tokens both drew before they part."""
    eager, static = both(model_of("qwen2"), compute=torch.bfloat16, top_p=0.9)
    steps = min(eager[0].shape[1], static[0].shape[1])
    same = (eager[0][:, :steps] != static[0][:, :steps]).long().cumsum(dim=1) == 0
    assert same[:, 0].all()  # the first token comes from the same prefill
    gap = ((eager[1][:, :steps] - static[1][:, :steps]).abs() * same).max()
    assert gap < 0.05


def test_two_level_inversion_draws_what_one_running_sum_draws():
    g = torch.Generator().manual_seed(0)
    # 97 and 1000: padded to blocks of 256; 4096 in blocks of 256, 1,088 of 64 and 151,936
    # (Qwen's) of 128, views of the probabilities.
    assert [sampling.block_tokens(v) for v in (97, 1000, 4096, 1088, 151936)] == [
        256,
        256,
        256,
        64,
        128,
    ]
    for vocab in (97, 256, 1000, 1088, 4096, 151936):
        logits = torch.randn(64, vocab, generator=g) * 4
        logits[:, ::7] = float("-inf")  # masked tokens: never drawn
        u = torch.rand(64, dtype=torch.float64, generator=g)
        u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1e-300], dtype=torch.float64)
        one = sampling.sample_from_logits(logits, u)
        two = sampling.sample_from_logits(logits, u, by_blocks=True)
        assert torch.equal(one, two)
        assert not (two % 7 == 0).any()


@pytest.mark.parametrize("vocab", [97, 1088])
def test_a_row_of_nan_logits_draws_a_valid_index(vocab):
    """The graph path draws without a check (it reads the finiteness flag back later): a
    NaN row, or a row of only NaN and -inf, still gives an index inside the vocabulary, so
    the log-prob's gather stays in bounds (past the end would be a device-side assert on
    CUDA, not the FloatingPointError the loop raises); the other rows draw as before."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g)
    logits[1] = float("nan")
    logits[2, ::2], logits[2, 1::2] = float("nan"), float("-inf")
    u = torch.tensor([0.3, 0.999, 1 - 2**-53, 0.6], dtype=torch.float64)
    tokens = sampling.sample_from_logits(logits, u, check=False, by_blocks=True)
    assert ((tokens >= 0) & (tokens < vocab)).all()
    keep = [0, 3]
    assert torch.equal(tokens[keep], sampling.sample_from_logits(logits[keep], u[keep]))
    token, logp = sampling.draw_tokens(
        logits,
        u,
        temperature=1.0,
        top_p=0.9,
        greedy=False,
        masked_tokens=None,
        check=False,
        by_blocks=True,
    )
    assert ((token >= 0) & (token < vocab)).all() and logp[1].isnan()


def test_the_draw_benchmark_draws_the_same_tokens_both_ways():
    """``benchmarks/draw.py`` at a vocabulary of 1,088 (blocks of 64): both ways draw the
    same tokens, and it says so."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "benchmarks/draw.py", "--vocab", "1088", "--rows", "4", "--reps", "1"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("4 rows x 1088 tokens: blocks of 64 ")
    assert line.endswith("same tokens: True")


def test_the_models_it_refuses_and_the_engine_falls_back():
    assert unsupported_reason(model_of("qwen2")) is None
    gpt2 = type("Gpt2", (torch.nn.Module,), {})()
    gpt2.config = type("C", (), {"model_type": "gpt2"})()
    assert "gpt2" in unsupported_reason(gpt2)
    model = model_of("llama (tied)")
    model.model.layers[1].mlp.up_proj.forward = lambda x: x  # a parallel copy's replaced forward
    assert "forward replaced" in unsupported_reason(model)
    with pytest.raises(ValueError, match="cannot run this model"):
        DecoderStep(model, None)
    engine = make_engine("dapo", model, _Tok(), device=torch.device("cuda"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.static_path() is False and engine.static_path() is False
    assert len(caught) == 1 and "decodes eagerly" in str(caught[0].message)
    fine = make_engine("dapo", model_of("qwen2"), _Tok(), device=torch.device("cuda"))
    assert fine.static_path() is True
    fine.cuda_graphs = False  # rollout.cuda_graphs=false
    assert fine.static_path() is False
    assert make_engine("dapo", model_of("qwen2"), _Tok()).static_path() is False  # a CPU


def test_activation_checkpointing_and_compiled_layers_keep_the_static_path():
    # In one process both wrap each decoder layer's forward on the policy the engine samples
    # from, and both compute what the layer did: a 1-GPU run with either (the 48 GB recipe
    # checkpoints) read as a parallel copy and decoded eagerly.
    from dapo.dist import fsdp
    from dapo.models.compiled_layers import compile_layers

    wrapped = model_of("qwen2")
    compile_layers(wrapped)
    fsdp.checkpoint_layers(wrapped)  # nested: recomputed over the compiled layer_forward
    assert unsupported_reason(wrapped) is None
    engine = make_engine("dapo", wrapped, _Tok(), device=torch.device("cuda"))
    assert engine.static_path() is True
    checkpointed = model_of("qwen2")
    fsdp.checkpoint_layers(checkpointed)
    assert unsupported_reason(checkpointed) is None
    eager, _ = both(model_of("qwen2"), top_p=0.9, seed=[7, 8, 9])
    _, static = both(checkpointed, top_p=0.9, seed=[7, 8, 9])
    assert torch.equal(static[0], eager[0])
    torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-5)
    # A foreign forward under dapo's checkpointing is still refused.
    layer = checkpointed.model.layers[0]
    layer.forward = functools.partial(fsdp.recomputed, lambda *a, **k: a[0])
    assert "forward replaced" in unsupported_reason(checkpointed)


def lora_model(seed: int = 0) -> torch.nn.Module:
    """The tiny Qwen2 with rank-4 adapters (peft, as ``model.lora`` injects them) on the
    attention's q and v and the MLP's down projection, B drawn so that they matter."""
    peft = pytest.importorskip("peft")
    model = model_of("qwen2")
    settings = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    peft.inject_adapter_in_model(settings, model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model.eval()


def test_lora_decodes_from_merged_weights_as_the_adapters_do():
    model = lora_model()
    assert unsupported_reason(model) is None
    assert DecoderStep(model, None).fuse  # merged into a copy, even in float32
    eager, static = both(model, top_p=0.9, seed=[7, 8, 9])
    assert torch.equal(static[0], eager[0])
    torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-5)


def test_merged_weights_do_not_drift_over_many_updates():
    """Twenty updates of the adapters (in place, as AdamW makes them): each rollout's step
    merges them afresh into its own copy, and its logits stay the adapters' own; the base
    weights are never touched."""
    model = lora_model(seed=1)
    base = {n: p.clone() for n, p in model.named_parameters() if "lora_" not in n}
    ids, mask = prompts()
    for update in range(20):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn_like(p), alpha=0.05)
        eager, static = both(model, new_tokens=6, seed=[update, 1, 2])
        assert torch.equal(static[0], eager[0]), update
        torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-5)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)


def test_adapters_it_cannot_merge_are_refused():
    model = lora_model()
    with lora.adapters_off(model):  # the reference of a KL term: the base alone
        assert "one active, unmerged adapter" in unsupported_reason(model)
    assert unsupported_reason(model) is None
    layer = model.model.layers[0].self_attn.q_proj
    layer.use_dora[layer.active_adapters[0]] = True
    assert "DoRA" in unsupported_reason(model)


class _Tok:
    eos_token_id = 5
    pad_token_id = 0


@pytest.mark.parametrize("new_tokens", [1, 2, 17])
def test_short_rollouts_end_where_the_eager_loop_ends(new_tokens):
    eager, static = both(model_of("qwen2"), new_tokens=new_tokens)
    assert static[0].shape == eager[0].shape == (12, new_tokens)
    assert torch.equal(static[0], eager[0])


@pytest.mark.parametrize("new_tokens", [1, 2, 17])
def test_nan_logits_are_refused_as_the_eager_loop_refuses_them(new_tokens):
    """One token's logit NaN: the eager loop raises; so does this one, also when step 0's draw
    (after the prefill) is the only one, whose flag no read-back of the loop saw (review
    r32b: max_new_tokens=1 returned NaN log-probs)."""
    model = model_of("qwen2")
    with torch.no_grad():
        model.lm_head.weight[7, 0] = float("nan")
    for way in ("eager", "static"):
        with pytest.raises(FloatingPointError, match="NaN or \\+inf"):
            both(model, new_tokens=new_tokens) if way == "eager" else _static(model, new_tokens)


def _static(model, new_tokens: int):
    ids, mask = prompts()
    with torch.inference_mode():
        return static_decode.static_decode(
            model, ids, mask, group_size=4, max_new_tokens=new_tokens, stop_token_ids=STOPS,
            pad_token_id=0, graphs=False,
        )  # fmt: skip


def test_pinned_length_dependent_rotary_embeddings_decode_on_this_path():
    """A dynamic-NTK Llama is refused (its frequencies change with the length); pinned as
    dapo loads a policy (dapo.models.rotary), it decodes here as the eager loop does."""
    from dapo.models import rotary

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    model = LlamaForCausalLM(config).eval()
    assert unsupported_reason(model) == "rotary embeddings of type 'dynamic'"
    rotary.pin(model)
    assert unsupported_reason(model) is None
    eager, static = both(model)
    assert torch.equal(static[0], eager[0])
    torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-5)


def test_folded_matrices_are_built_a_block_of_rows_at_a_time(monkeypatch):
    """The fused copy was folded whole in float32 (the head: two V x H float32 temporaries,
    1.9 GB for 1.5B); block by block it is the same matrix, bit for bit."""
    from dapo.rollout import decoder_step

    model = model_of("qwen2")
    whole = DecoderStep(model, torch.bfloat16)
    monkeypatch.setattr(decoder_step, "FOLD_ROWS", 7)  # blocks that split every matrix
    blocks = DecoderStep(model, torch.bfloat16)
    head = model.get_output_embeddings().weight
    folded = (head.float() * model.model.norm.weight.float()).bfloat16()
    assert torch.equal(blocks.head[0][0], folded) and torch.equal(whole.head[0][0], folded)
    for a, b in zip(whole.layers, blocks.layers, strict=True):
        for name in ("qkv", "gate_up"):
            for x, y in zip(a[name][0], b[name][0], strict=True):  # weight, bias (or None)
                assert (x is None and y is None) or torch.equal(x, y)


def test_weights_in_the_compute_dtype_are_not_copied():
    model = model_of("qwen2")
    own = DecoderStep(model, torch.float32)  # float32 weights, float32 compute
    assert not own.fuse and len(own.layers[0]["qkv"]) == 3
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert own.layers[0]["qkv"][0][0].data_ptr() == q_proj.data_ptr()
    copied = DecoderStep(model, torch.bfloat16)  # bf16 matmuls over float32 master weights
    assert copied.fuse and len(copied.layers[0]["qkv"]) == 1
    qkv, bias = copied.layers[0]["qkv"][0]
    assert qkv.dtype == bias.dtype == torch.bfloat16 and qkv.shape == (64 + 2 * 32, 64)
    g = model.model.layers[0].input_layernorm.weight
    torch.testing.assert_close(qkv[:64].float(), (q_proj * g).bfloat16().float())
