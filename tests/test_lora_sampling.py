"""LoRA in the live engines (``model.lora.merged_sampling``): the dapo engine's eager loop and
the hf engine sample from a copy with the adapters merged in, made for each call from the
policy's current adapters and dropped after it; the policy is never merged."""

import copy
import gc
import weakref

import pytest
import torch

from dapo.config import LoraConfig, load_config
from dapo.dist import fsdp
from dapo.models import lora
from dapo.rollout import make_engine
from dapo.rollout.decoder_step import linear_reason
from dapo.rollout.hf import HFEngine

pytest.importorskip("peft")

IDS = torch.arange(3, 30).reshape(1, -1)
PROMPTS = ["1 + 1 =", "12 + 30 =", "7 + 5 ="]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _adapted(tiny_model, rank: int = 4) -> torch.nn.Module:
    model = lora.apply(copy.deepcopy(tiny_model), LoraConfig(rank=rank))
    with torch.no_grad():  # B starts at zero; a trained one is not
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def _spy_copies(monkeypatch) -> list[torch.nn.Module]:
    """The merged copies the engines make, in order."""
    made, real = [], lora.merged_copy
    monkeypatch.setattr(lora, "merged_copy", lambda m: made.append(real(m)) or made[-1])
    return made


def test_the_merged_copy_computes_the_adapters_and_shares_the_rest(tiny_model):
    model = _adapted(tiny_model)
    before = {n: p.clone() for n, p in model.named_parameters()}
    merged = lora.merged_copy(model)
    torch.testing.assert_close(_logits(merged), _logits(model), rtol=0, atol=1e-5)
    assert not lora.enabled(merged) and not model.model.layers[0].self_attn.q_proj.merged
    q = merged.model.layers[0].self_attn.q_proj
    assert type(q) is torch.nn.Linear and not q.weight.requires_grad
    # W + (alpha / r) B A, by hand; the bias is the policy's own tensor.
    src = model.model.layers[0].self_attn.q_proj
    a, b = src.lora_A["default"].weight, src.lora_B["default"].weight
    torch.testing.assert_close(
        q.weight, src.base_layer.weight + 32.0 / 4 * b @ a, rtol=0, atol=1e-6
    )
    assert q.bias is src.base_layer.bias
    # What has no adapter is shared, not copied: the embedding, the norms, the rotary buffer.
    assert merged.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert merged.model.norm.weight is model.model.norm.weight
    assert merged.model.rotary_emb.inv_freq is model.model.rotary_emb.inv_freq
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_only_float32_single_adapters_are_merged(tiny_model):
    model = _adapted(tiny_model)
    assert lora.can_merge(model) and not lora.can_merge(tiny_model)
    with lora.adapters_off(model):  # the KL reference's state: nothing to merge
        assert not lora.can_merge(model)
    bf16 = lora.apply(copy.deepcopy(tiny_model).to(torch.bfloat16), LoraConfig(rank=4))
    assert not lora.can_merge(bf16)  # a bfloat16 W + B A would round the adapters away


def test_adapters_with_a_bias_of_their_own_are_not_merged(tiny_model):
    """peft's ``lora_bias`` adds a bias to B's output, which W + s B A leaves out: neither the
    merged copy nor the CUDA-graph step takes such a layer."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    targets = ["q_proj", "v_proj"]
    plain = get_peft_model(copy.deepcopy(tiny_model), PeftLora(r=4, target_modules=targets))
    biased = get_peft_model(
        copy.deepcopy(tiny_model), PeftLora(r=4, target_modules=targets, lora_bias=True)
    )
    assert lora.can_merge(plain) and not lora.can_merge(biased)
    q = biased.base_model.model.model.layers[0].self_attn.q_proj
    assert linear_reason(q) == "a LoRA adapter with a bias of its own (lora_bias)"
    assert linear_reason(plain.base_model.model.model.layers[0].self_attn.q_proj) is None


@pytest.mark.parametrize("wrap", ["checkpointed", "as they are"])
def test_a_copys_merged_weights_are_freed_when_the_call_ends(
    tiny_model, tokenizer, wrap, monkeypatch
):
    """Layers wrapped for activation checkpointing hold a reference to themselves, a cycle
    the copy keeps: with the garbage collector off, each call's merged weights are still
    freed as the call ends (so the copies made per call never pile up)."""
    model = _adapted(tiny_model)
    if wrap == "checkpointed":
        fsdp.checkpoint_layers(model)
    engine = make_engine("dapo", model, tokenizer)
    weights, real = [], lora.merged_copy

    def spy(m):
        out = real(m)
        weights.extend(weakref.ref(p) for p in out.parameters() if p.requires_grad is False)
        weights[:] = [w for w in weights if w() is not None]
        return out

    monkeypatch.setattr(lora, "merged_copy", spy)
    gc.disable()
    try:
        for _ in range(3):
            engine.generate(PROMPTS, group_size=2, max_new_tokens=4, seed=0)
            own = [w for w in weights if w() is not None and not _shared(w(), model)]
            assert own == []
    finally:
        gc.enable()


def _shared(tensor: torch.Tensor, model: torch.nn.Module) -> bool:
    return any(tensor is p for p in model.parameters())


@pytest.mark.parametrize("engine_name", ["dapo", "hf"])
def test_engines_sample_the_adapted_policy_from_a_copy_made_per_call(
    tiny_model, tokenizer, engine_name, monkeypatch
):
    """Over 30 updates, with a rollout after each: the merged engine draws the adapters'
    tokens, with their log-probs to float rounding; the policy's base stays bitwise the
    same; one copy per call (per-prompt seeds included), none kept after it."""
    model = _adapted(tiny_model, rank=2)
    base = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    merged = make_engine(engine_name, model, tokenizer)
    through = make_engine(engine_name, model, tokenizer, merged_sampling=False)
    made = _spy_copies(monkeypatch)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sampling = dict(group_size=2, max_new_tokens=6, seed=[3, 4, 5])
    for update in range(30):
        optimizer.zero_grad()
        model(IDS, labels=IDS).loss.backward()
        optimizer.step()
        a, b = merged.generate(PROMPTS, **sampling), through.generate(PROMPTS, **sampling)
        assert len(made) == update + 1 and merged._merged is None
        assert torch.equal(a.response_ids_BT, b.response_ids_BT)
        torch.testing.assert_close(a.logprobs_BT, b.logprobs_BT, rtol=0, atol=1e-5)
    assert not torch.equal(_logits(model), _logits(tiny_model))  # the adapters did move
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)


def test_a_bfloat16_base_or_the_switch_off_samples_through_the_adapters(tiny_model, tokenizer):
    model = _adapted(tiny_model)
    for engine in (make_engine("dapo", model, tokenizer, merged_sampling=False),):
        with engine.sampling_model() as sampled:
            assert sampled is model
    bf16 = lora.apply(copy.deepcopy(tiny_model).to(torch.bfloat16), LoraConfig(rank=4))
    with HFEngine(bf16, tokenizer).sampling_model() as sampled:
        assert sampled is bf16
    with HFEngine(tiny_model, tokenizer).sampling_model() as sampled:  # no adapters
        assert sampled is tiny_model


def test_the_run_config_reaches_the_engine(tiny_model, tokenizer):
    from dapo.reward.tasks import arith
    from dapo.training.state import build_state

    problems = [p for p, _ in arith.make_splits(4, 1, seed=0)[0]]
    for value in (True, False):
        settings = ["model.lora.rank=4", "model.device=cpu", f"model.lora.merged_sampling={value}"]
        cfg = load_config(None, settings)
        model = lora.apply(copy.deepcopy(tiny_model), cfg.model.lora)
        state = build_state(cfg, model, tokenizer, problems)
        assert state.engine.merged_sampling is value
