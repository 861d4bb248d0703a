"""Review r32a: the update's passes compute what the old log-probs' pass computes, also on
models whose training mode draws at random beyond dropout (PhiMoE's router samples its
experts there); and a row's log-probs are its own on models whose rotary embeddings change
with the length of the forward pass (``longrope``: Phi-3.5, Phi-4-mini; ``dynamic`` NTK)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PhimoeConfig,
    PhimoeForCausalLM,
)

from dapo.cli import main
from dapo.config import LoraConfig
from dapo.models import dropout, lora, policy, rotary
from dapo.models.demo import build_tokenizer

REWARD = "def score(response, ground_truth):\n    return float(len(response) % 5) / 4.0\n"


def _phimoe(path: Path) -> Path:
    tok = build_tokenizer()
    config = PhimoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    PhimoeForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_an_on_policy_update_of_phimoe_has_ratio_one(tmp_path):
    """Its first update, on the weights that sampled: ratio 1, so the loss of groups whose
    responses are all 12 tokens long is 0 (exactly on transformers 5; 2e-8 of rounding on
    4.56), where the router drawing in training mode gave 3.6e-6 (5.7e-5 on 4.56), and two
    runs' gradients differed."""
    model = _phimoe(tmp_path / "phimoe")
    (tmp_path / "reward.py").write_text(REWARD)
    settings = [
        f"model.path={model}", "rollout.group_size=4", "rollout.max_new_tokens=12",
        "algo.l_cache=4", "train.prompts_per_step=2", "train.responses_per_minibatch=8",
        "sampling.dynamic=false", "eval.num_samples=0", "eval.every=0", "reward.workers=0",
        "run.threads=1", f"reward.function={tmp_path / 'reward.py'}:score", "train.steps=1",
        "train.recompute_old_logprobs=true", f"run.out_dir={tmp_path}",
    ]  # fmt: skip
    norms = []
    for name in ("a", "b"):
        assert main(["train", "--quiet", *settings, f"run.name={name}"]) == 0
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        step = next(x for x in map(json.loads, lines) if "train/loss" in x)
        assert step["train/tokens"] == 96 and abs(step["train/loss"]) < 1e-7
        norms.append(step["train/grad_norm"])
    assert norms[0] == norms[1]


def test_update_mode_is_evaluation_mode_but_for_loras_dropout():
    torch.manual_seed(0)
    model = PhimoeForCausalLM(
        PhimoeConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
        )  # fmt: skip
    )
    lora.apply(model, LoraConfig(rank=2, dropout=0.1, target_modules=["q_proj"]))
    model.train()
    dropout.update_mode(model)
    training = {n for n, m in model.named_modules() if m.training}
    assert training and all(".lora_dropout" in f".{n}" for n in training)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = [model(ids).logits for _ in range(2)]
        model.eval()
        assert torch.equal(logits[0], logits[1]) and torch.equal(model(ids).logits, logits[0])


SIZES = dict(
    vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
)  # fmt: skip
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}


def _phi3() -> torch.nn.Module:
    """Longrope: short factors up to 16 positions, long ones beyond, a context of 64."""
    torch.manual_seed(0)
    config = Phi3Config(
        **SIZES, max_position_embeddings=64, original_max_position_embeddings=16,
        rope_scaling=LONGROPE,
    )  # fmt: skip
    return Phi3ForCausalLM(config).eval()


def _dynamic_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        **SIZES, max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
    )
    return LlamaForCausalLM(config).eval()


IDS = torch.randint(1, 64, (1, 35), generator=torch.Generator().manual_seed(1))


def _prefix_gap(model: torch.nn.Module) -> float:
    """How far the logits of the first 8 tokens move when 27 more follow (causal: only a
    length-dependent rotary embedding moves them beyond rounding)."""
    with torch.no_grad():
        return float((model(IDS[:, :8]).logits - model(IDS).logits[:, :8]).abs().max())


@pytest.mark.parametrize("make, kind", [(_phi3, "longrope"), (_dynamic_llama, "dynamic")])
def test_pinned_rotary_embeddings_give_a_prefix_the_same_logits_at_any_length(make, kind):
    model = make()
    assert _prefix_gap(model) > 5e-4  # 4.2e-3 and 9.4e-4: the longest row set everyone's
    with torch.no_grad():
        unpinned_long, unpinned_short = model(IDS).logits, model(IDS[:, :8]).logits
    note = rotary.pin(model)
    context = model.config.max_position_embeddings
    assert note == (
        f"rotary embeddings: {kind} pinned at the model's context ({context} tokens), so that "
        "a row's log-probs do not depend on the others in its forward pass"
    )
    assert model.model.rotary_emb.rope_type == rotary.PINNED and rotary.pin(model) is None
    assert _prefix_gap(model) < 1e-6
    with torch.no_grad():  # what a sequence of the whole context computes: longrope's long
        # factors (as transformers computes past 16 positions), dynamic's own frequencies
        if kind == "longrope":
            assert torch.equal(model(IDS).logits, unpinned_long)
        else:
            assert torch.equal(model(IDS[:, :8]).logits, unpinned_short)


def test_a_loaded_policy_is_pinned_and_says_so(tmp_path):
    from dapo.config import load_config

    tok = build_tokenizer()
    model = _phi3()
    model.resize_token_embeddings(len(tok))
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(tmp_path / "phi3")
    tok.save_pretrained(tmp_path / "phi3")
    said = []
    cfg = load_config(None, [f"model.path={tmp_path / 'phi3'}", "model.device=cpu"])
    loaded, _ = policy.load_policy(cfg, log=said.append, training=True)
    assert loaded.model.rotary_emb.rope_type == rotary.PINNED
    assert any(line.startswith("rotary embeddings: longrope pinned at") for line in said)


def test_per_layer_type_rotary_embeddings_that_change_with_length_are_refused():
    model = torch.nn.Module()
    model.rotary = torch.nn.Module()
    model.rotary.rope_type = {"full_attention": "dynamic", "sliding_attention": "default"}
    with pytest.raises(ValueError, match="per layer type .* change with the length"):
        rotary.pin(model)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)
