"""Packed micro-batches (``train.packing``, dapo/models/packing.py) against padded ones, through
a real transformer in float32: the same log-probs and entropies, the same loss and gradient,
whatever the micro-batch split; nothing attends across rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dapo.config import load_config
from dapo.data.batch import Episode, collate, split_microbatches
from dapo.data.problems import Problem
from dapo.models.logprobs import batch_logprobs
from dapo.models.packing import PACKED_ATTENTION, packing_refusal, use_packing
from dapo.training.gpu_memory import PlanSettings, plan_memory
from dapo.training.model_shape import ModelShape
from dapo.training.state import build_state
from dapo.training.update import accumulate_gradients


def episode(prompt: torch.Tensor, length: int, seed: int, advantage: float) -> Episode:
    g = torch.Generator().manual_seed(seed)
    e = Episode(
        prompt_ids=prompt,
        response_ids=torch.randint(5, 60, (length,), generator=g),
        sampler_logprobs=-torch.rand(length, generator=g),
        truncated=False,
        correct=advantage > 0,
        reward=1.0,
        advantage=advantage,
    )
    e.old_logprobs = e.sampler_logprobs
    return e


def groups() -> list[Episode]:
    """Three prompts of 3, 7 and 5 tokens, their responses of 1 to 13 tokens (a group's rows
    share their prompt, as a round's do); one row overlong-filtered."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 60, (n,), generator=g) for n in (3, 7, 5)]
    lengths = [[13, 2, 6], [1, 9], [4, 11, 3, 7]]
    eps = [
        episode(prompts[p], n, seed=10 * p + i, advantage=(-1.0) ** i * (0.3 + i / 7))
        for p, group in enumerate(lengths)
        for i, n in enumerate(group)
    ]
    eps[4].trainable = False
    return eps


@pytest.mark.parametrize("with_entropy", [False, True])
def test_packed_log_probs_are_the_padded_ones(tiny_model, with_entropy):
    eps = groups()
    padded = collate(eps, pad_id=0)
    packed = collate(eps, pad_id=0, packed=True)
    assert packed.packing.groups == ((3, (13, 2, 6)), (7, (1, 9)), (5, (4, 11, 3, 7)))
    assert packed.packing.tokens == 3 + 21 + 7 + 10 + 5 + 25
    with torch.no_grad():
        shared = batch_logprobs(tiny_model, padded, with_entropy=with_entropy)
        alone = batch_logprobs(tiny_model, padded, with_entropy=with_entropy, share_prompts=False)
        use_packing(tiny_model)
        got = batch_logprobs(tiny_model, packed, with_entropy=with_entropy, temperature=1.0)
    real = padded.response_mask_BT
    for ref in (shared, alone):
        for want, have in zip(ref, got, strict=True):
            if want is None:
                assert have is None
                continue
            torch.testing.assert_close(have[real], want[real], rtol=0, atol=2e-6)
            assert (have[~real] == 0).all()


def test_empty_responses_pack_and_share_their_prompt(tiny_model):
    # A custom rollout may give a response of no token: the packed collate raised (arange
    # from start to start - 1) and a micro-batch of empty responses broke the shared prompt.
    eps = groups()
    eps[1] = episode(eps[1].prompt_ids, 0, seed=99, advantage=0.5)
    padded, packed = collate(eps, pad_id=0), collate(eps, pad_id=0, packed=True)
    assert packed.packing.groups[0] == (3, (13, 0, 6))
    with torch.no_grad():
        want, _ = batch_logprobs(tiny_model, padded)
        use_packing(tiny_model)
        got, _ = batch_logprobs(tiny_model, packed, temperature=1.0)
        real = padded.response_mask_BT
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=2e-6)
        empty = [episode(eps[0].prompt_ids, 0, seed=s, advantage=0.5) for s in (1, 2)]
        logp, _ = batch_logprobs(tiny_model, collate(empty, pad_id=0))
    assert logp.shape == (2, 0)


def test_a_row_sees_only_itself():
    """Changing one row's tokens changes no other row's log-probs (a Llama with a tied head:
    the chunked head; and its logits path through ``logits_to_keep``)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    use_packing(model)
    assert model.config._attn_implementation == PACKED_ATTENTION
    eps = groups()
    before = batch_logprobs(model, collate(eps, pad_id=0, packed=True))[0]
    eps[2].response_ids = eps[2].response_ids.flip(0)
    after = batch_logprobs(model, collate(eps, pad_id=0, packed=True))[0]
    changed = (before != after).any(dim=1)
    assert changed.tolist() == [i == 2 for i in range(len(eps))]


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        # StableLM's decoder layer calls its attention without the keyword arguments: packed,
        # every row attended to the rows before it (log-probs 0.05 off), without a word.
        # (transformers 4's StableLM calls SDPA itself: its attention never comes through.)
        ("stablelm", "does not hand packed_groups to|does not run attention through"),
        # Falcon takes its SDPA branch only by the name "sdpa": packed, it ran its eager path
        # and failed inside transformers with a TypeError. From transformers 5.25 it calls
        # the attention functions, without the keyword arguments: refused as StableLM is.
        ("falcon", "does not run attention through|does not hand packed_groups to"),
    ],
)
def test_a_model_whose_attention_loses_the_packing_is_refused(kind, what):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        kind,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    eps = groups()
    padded = batch_logprobs(model, collate(eps, pad_id=0))[0]
    use_packing(model)
    with pytest.raises(ValueError) as err:
        batch_logprobs(model, collate(eps, pad_id=0, packed=True))
    refused = [
        f"train.packing=true: this model ({kind}) {phrase} transformers' attention functions "
        "(dapo's packed attention), so packed rows could not be kept from attending to each "
        "other; set train.packing=false"
        for phrase in what.split("|")
    ]
    failed = " (it failed: TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType')"
    # Falcon fails in transformers 5 (then the refusal says so); in 4 it runs without a call.
    assert str(err.value) in refused + ([x + failed for x in refused] if kind == "falcon" else [])
    if kind == "stablelm":  # its unpacked passes are as they were (Falcon's are not: the
        # refusal comes at the first packed pass, before any update, not as the model loads)
        assert torch.equal(batch_logprobs(model, collate(eps, pad_id=0))[0], padded)


def test_an_error_of_a_packed_pass_that_is_not_the_models_routing_is_its_own():
    """Out of memory in the first layer, before any attention call: not "set
    train.packing=false" (a run that had packed for 500 steps would be told it cannot)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    model = Qwen2ForCausalLM(config).eval()
    use_packing(model)

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
        batch_logprobs(model, collate(groups(), pad_id=0, packed=True))


def gradients(model, tokenizer, eps, *overrides: str):
    cfg = load_config(None, ["rollout.max_new_tokens=20", *overrides])
    state = build_state(cfg, model, tokenizer, [Problem("p", (), "1")])
    model.zero_grad(set_to_none=True)
    sums = accumulate_gradients(
        state,
        eps,
        num_tokens=sum(e.num_loss_tokens for e in eps),
        num_seqs=sum(1 for e in eps if e.num_loss_tokens),
    ).read()
    return [p.grad.clone() for p in model.parameters()], sums


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_gradient_is_the_padded_one_whatever_the_split(tiny_model, tokenizer, agg):
    eps = groups()
    rule = f"algo.loss_agg={agg}"
    padded, s0 = gradients(tiny_model, tokenizer, eps, rule, "train.tokens_per_microbatch=100000")
    runs = [
        gradients(tiny_model, tokenizer, eps, rule, "train.packing=true", f"train.{budget}")
        for budget in ("tokens_per_microbatch=100000", "tokens_per_microbatch=20")
    ]
    for grads, sums in runs:
        assert sums["tokens"] == s0["tokens"] and sums["loss"] == pytest.approx(s0["loss"], 1e-6)
        for want, have in zip(padded, grads, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-8)
    # Nothing padded, a group's prompt once: every position computed is a real token.
    whole, split = (sums for _, sums in runs)
    assert whole["slots"] == whole["real"] == s0["real"] == 15 + 56 < s0["slots"]
    assert split["slots"] == split["real"] > whole["real"]  # a group cut in two: its prompt twice


def test_packed_micro_batches_count_real_tokens():
    eps = groups()
    chunks = split_microbatches(eps, range(len(eps)), max_tokens=20, packed=True)
    assert sorted(i for c in chunks for i in c) == list(range(len(eps)))
    for c in chunks:
        real = sum(eps[i].prompt_length + eps[i].length for i in c)
        assert len(c) == 1 or real <= 20


def test_only_an_sdpa_model_without_windows_packs():
    model = LlamaForCausalLM._from_config(
        LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        ),
        attn_implementation="eager",
    )
    with pytest.raises(ValueError, match="train.packing=false"):
        use_packing(model)
    windowed = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        )
    )
    with pytest.raises(ValueError, match="sliding-window"):
        use_packing(windowed)


def mistral(window: int | None) -> torch.nn.Module:
    """A tiny Mistral (its window in ``sliding_window`` alone, no switch) with a context of 64,
    its weights scaled up so that a dropped window shows in the log-probs."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=window,
    )
    model = MistralForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0 if p.dim() > 1 else 1.0)
    return model


def test_a_mistral_window_is_refused_and_the_model_left_as_it_was():
    model = mistral(4)  # a window shorter than the rows: packing would drop it
    eps = groups()
    with torch.no_grad():
        before = batch_logprobs(model, collate(eps, pad_id=0), share_prompts=False)[0]
        with pytest.raises(ValueError) as refused:
            use_packing(model)
        after = batch_logprobs(model, collate(eps, pad_id=0), share_prompts=False)[0]
    message = str(refused.value)
    assert "(mistral)" in message and "sliding_window=4" in message
    assert message.endswith("set train.packing=false")
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(before, after)


@pytest.mark.parametrize("window", [None, 64, 4096])
def test_a_mistral_whose_window_cannot_bind_packs_exactly(window):
    model = mistral(window)  # none, or none shorter than the context of 64
    eps = groups()
    padded = collate(eps, pad_id=0)
    with torch.no_grad():
        want = batch_logprobs(model, padded, share_prompts=False)[0]
        use_packing(model)
        have = batch_logprobs(model, collate(eps, pad_id=0, packed=True))[0]
    real = padded.response_mask_BT
    torch.testing.assert_close(have[real], want[real], rtol=0, atol=2e-5)


def test_which_configs_pack():
    from types import SimpleNamespace as Config

    def refusal(**fields):
        return packing_refusal(Config(model_type="m", max_position_embeddings=4096, **fields))

    # Qwen2 carries a window it does not use; Phi3-128k's is longer than its context.
    assert refusal(use_sliding_window=False, sliding_window=4096) is None
    assert refusal(use_sliding_window=False, sliding_window=None) is None
    assert refusal(sliding_window=262144) is None and refusal(sliding_window=None) is None
    assert refusal(layer_types=["full_attention"] * 2) is None
    assert "use_sliding_window=true, sliding_window=8" in refusal(
        use_sliding_window=True, sliding_window=8
    )
    assert "(m) has sliding-window attention (sliding_window=2047" in refusal(sliding_window=2047)
    assert "layer_types: sliding_attention" in refusal(
        layer_types=["full_attention", "sliding_attention"]
    )
    assert "layer_types: linear_attention" in refusal(layer_types=["linear_attention"])


def test_the_memory_plan_counts_the_prompt_copies():
    """Packed, each response attends with a copy of its prompt's queries, keys and values and
    an output over them, held for the backward: rows of the plan's lengths (10 prompt + 22
    response tokens) in 100 tokens copy 100 x 10 // 32 = 31 prompt positions in each of 2
    layers, 2 x 64 + 2 x 16 values each (hidden 64, one kv head of 16), in bf16."""
    shape = ModelShape.from_hf_config(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "vocab_size": 1000,
            "tie_word_embeddings": True,
        }
    )
    settings = PlanSettings(microbatch_tokens=100, prompt_tokens=10, max_new_tokens=22)
    padded = plan_memory(shape, settings).activations
    packed = plan_memory(shape, replace(settings, packing=True)).activations
    assert packed - padded == 2 * 31 * (2 * 64 + 2 * 16) * 2
    ckpt = replace(settings, activation_checkpointing=True)
    extra = plan_memory(shape, replace(ckpt, packing=True)).activations
    assert (
        extra - plan_memory(shape, ckpt).activations == 31 * (2 * 64 + 2 * 16) * 2
    )  # one layer at a time


def test_packing_is_refused_from_config_json_before_any_model_loads(tmp_path, capsys):
    """The refusal came when the training state was built, after the weights had loaded:
    --dry-run passed a Mistral whose window packing would lose."""
    from transformers import MistralConfig, Qwen2Config

    from dapo.config import load_config
    from dapo.training.inputs import check_packing

    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=50)
    MistralConfig(**small, sliding_window=4, max_position_embeddings=64).save_pretrained(
        tmp_path / "mistral"
    )
    Qwen2Config(**small, sliding_window=4, use_sliding_window=False).save_pretrained(
        tmp_path / "qwen2"
    )
    for name, refused in (("mistral", True), ("qwen2", False)):
        cfg = load_config(None, [f"model.path={tmp_path / name}", "train.packing=true"])
        if refused:
            with pytest.raises(ValueError, match=r"\(mistral\).*set train.packing=false"):
                check_packing(cfg)
        else:
            check_packing(cfg)
        check_packing(load_config(None, [f"model.path={tmp_path / name}", "train.packing=false"]))
    from dapo.cli import main

    dry = ["train", "--dry-run", f"model.path={tmp_path / 'mistral'}", "train.packing=true"]
    assert main(dry) == 2  # before the tokenizer (there is none) and the weights
    assert "sliding-window attention" in capsys.readouterr().err
