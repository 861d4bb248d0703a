import importlib.util

import pytest
import torch
from helpers import generate

from dapo.models.logprobs import response_logprobs
from dapo.rollout import ENGINES, Engine, generate_samples, make_engine

PROMPTS = ["User: What is 2 + 3?\nAssistant:\n", "Compute 7 + 1 + 4.\n"]  # different lengths


def test_shapes_masks_and_lengths_agree(tiny_model, tokenizer):
    ro = generate(tiny_model, tokenizer, PROMPTS, group_size=3, max_new_tokens=12, seed=0)
    assert ro.prompt_ids_BP.shape[0] == ro.response_ids_BT.shape[0] == 6
    # Left padding: every prompt ends at the last column, the shorter one starts later.
    assert ro.prompt_mask_BP[:, -1].all()
    assert ro.prompt_mask_BP[0].sum() != ro.prompt_mask_BP[3].sum()
    assert torch.equal(ro.prompt_ids_BP[0], ro.prompt_ids_BP[2])  # rows 0..2 are prompt 0
    eos = tokenizer.eos_token_id
    for b in range(6):
        n = int(ro.lengths_B[b])
        assert ro.response_mask_BT[b, :n].all() and not ro.response_mask_BT[b, n:].any()
        ids = ro.response_ids_BT[b, :n].tolist()
        if ro.truncated_B[b]:
            assert n == 12 and eos not in ids
        else:
            assert ids[-1] == eos and eos not in ids[:-1]
        assert (ro.response_ids_BT[b, n:] == tokenizer.pad_token_id).all()
        assert ro.texts[b] == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("engine", ["dapo", "hf"])
def test_sampler_logprobs_equal_a_fresh_forward_pass(tiny_model, tokenizer, engine):
    """pi_old from the sampler is the model's own distribution at the sampling temperature,
    whichever engine sampled it (the forward pass shares each group's prompt); with top-p < 1,
    the whole distribution, before the top-p cut (verl's convention)."""
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (0.7, 0.8)):
        ro = generate(
            tiny_model,
            tokenizer,
            PROMPTS,
            group_size=4,
            max_new_tokens=16,
            temperature=temperature,
            top_p=top_p,
            seed=1,
            engine=engine,
        )
        with torch.no_grad():
            logp_BT, _ = response_logprobs(
                tiny_model,
                ro.prompt_ids_BP,
                ro.prompt_mask_BP,
                ro.response_ids_BT,
                ro.response_mask_BT,
                temperature=temperature,
            )
        mask = ro.response_mask_BT
        # float32 on CPU: the KV-cached sampler and the forward pass agree to about 1e-6.
        torch.testing.assert_close(logp_BT[mask], ro.logprobs_BT[mask], rtol=0, atol=1e-5)
        assert (ro.logprobs_BT[~mask] == 0).all()


def test_same_seed_same_samples(tiny_model, tokenizer):
    a = generate(tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=10, seed=7)
    b = generate(tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=10, seed=7)
    c = generate(tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=10, seed=8)
    assert torch.equal(a.response_ids_BT, b.response_ids_BT)
    assert not torch.equal(a.response_ids_BT, c.response_ids_BT)


def test_checkpoint_generation_config_does_not_leak_into_sampling(tiny_model, tokenizer):
    """A checkpoint's top_k / repetition penalty must not change the sampling distribution."""
    ref = generate(tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=10, seed=3)
    tiny_model.generation_config.top_k = 1
    tiny_model.generation_config.repetition_penalty = 5.0
    got = generate(tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=10, seed=3)
    assert torch.equal(ref.response_ids_BT, got.response_ids_BT)


def test_the_hf_engine_reads_no_other_setting_of_the_checkpoints_generation_config(
    tiny_model, tokenizer
):
    """generate filled every setting it was not given from the checkpoint: min_new_tokens
    held EOS back, suppress_tokens / bad_words_ids never drew a token, and the log-probs
    recorded were still the plain policy's; return_dict_in_generate crashed the engine."""
    engine = make_engine("hf", tiny_model, tokenizer)
    args = dict(group_size=2, max_new_tokens=10, seed=[3, 4])
    ref = engine.generate(PROMPTS, **args)
    drawn = int(ref.response_ids_BT[0, 0])
    config = tiny_model.generation_config
    config.min_new_tokens, config.suppress_tokens = 10, [drawn]
    config.bad_words_ids, config.return_dict_in_generate = [[drawn]], True
    config.sequence_bias = {(drawn,): -100.0}
    got = engine.generate(PROMPTS, **args)
    assert torch.equal(ref.response_ids_BT, got.response_ids_BT)
    assert torch.equal(ref.logprobs_BT, got.logprobs_BT)
    assert tiny_model.generation_config is config and config.min_new_tokens == 10  # put back


def test_every_engine_follows_the_protocol(tiny_model, tokenizer):
    for name in ("dapo", "hf"):  # the vllm engine: tests/test_vllm_engine.py
        engine = make_engine(name, tiny_model, tokenizer)
        assert isinstance(engine, Engine) and engine.exact_logprobs
        engine.sync_weights(tiny_model)  # reads the live module: nothing to copy
        ro = engine.generate(PROMPTS, group_size=2, max_new_tokens=6, seed=1)
        assert len(ro.samples()) == 4 and ro.slots >= sum(int(n) for n in ro.lengths_B)
    assert set(ENGINES) == {"dapo", "hf", "vllm"}
    with pytest.raises(ValueError, match="rollout engine 'sglang': use one of dapo, hf, vllm"):
        make_engine("sglang", tiny_model, tokenizer)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_the_vllm_engine_without_vllm_says_how_to_install_it(tiny_model, tokenizer):
    from dapo.extras import pip_install

    with pytest.raises(ImportError) as missing:
        make_engine("vllm", tiny_model, tokenizer)
    hint = f"needs vLLM (Python >= 3.11): {pip_install('vllm')}; on a machine without a GPU"
    assert hint in str(missing.value) and "rollout-engines.md" in str(missing.value)


def test_samples_are_the_rows_unpadded(tiny_model, tokenizer):
    ro = generate(tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=8, seed=5)
    for b, s in enumerate(ro.samples()):
        n = int(ro.lengths_B[b])
        assert torch.equal(s.response_ids, ro.response_ids_BT[b, :n])
        assert torch.equal(s.logprobs, ro.logprobs_BT[b, :n])
        assert torch.equal(s.prompt_ids, ro.prompt_ids_BP[b][ro.prompt_mask_BP[b].bool()])
        assert s.truncated == bool(ro.truncated_B[b]) and s.text == ro.texts[b]


def test_generate_samples_in_calls_keeps_the_first_calls_draw(tiny_model, tokenizer):
    engine = make_engine("dapo", tiny_model, tokenizer)
    kwargs = dict(group_size=2, seed=3, max_new_tokens=6)
    whole, slots = generate_samples(engine, PROMPTS, rows_per_call=0, **kwargs)
    one_call, _ = generate_samples(engine, PROMPTS, rows_per_call=4, **kwargs)
    split, split_slots = generate_samples(engine, PROMPTS, rows_per_call=2, **kwargs)
    again, _ = generate_samples(engine, PROMPTS, rows_per_call=2, **kwargs)
    assert [s.text for s in one_call] == [s.text for s in whole]  # one call: the plain draw
    assert [s.text for s in split] == [s.text for s in again]  # calls: reproducible
    assert len(split) == 4 and split_slots >= sum(s.response_ids.numel() for s in split)


def test_each_call_after_the_first_has_its_own_derived_seed(tiny_model, tokenizer):
    from dapo.run.seeding import derive_seed

    engine = make_engine("dapo", tiny_model, tokenizer)
    split, _ = generate_samples(
        engine, PROMPTS, group_size=2, rows_per_call=1, seed=3, max_new_tokens=6
    )  # fewer rows than a group: one prompt per call
    first = engine.generate(PROMPTS[:1], group_size=2, max_new_tokens=6, seed=3)
    second = engine.generate(
        PROMPTS[1:], group_size=2, max_new_tokens=6, seed=derive_seed(3, "call", 1)
    )
    assert [s.text for s in split] == first.texts + second.texts


@pytest.mark.parametrize("engine", ["dapo", "hf"])
def test_bad_requests_are_refused_naming_the_argument(tiny_model, tokenizer, engine):
    # Before: top-p 0 drew the least likely token every step, a negative temperature sampled
    # the inverted distribution, and no prompt or no row were tracebacks from inside.
    eng = make_engine(engine, tiny_model, tokenizer)
    cases = [
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(temperature=-1.0), r"temperature must be a positive number, got -1.0"),
        (dict(temperature=0.0), r"for argmax decoding pass greedy=True"),
        (dict(temperature=float("nan")), "temperature must be a positive number"),
        (dict(group_size=0), "group_size and max_new_tokens must be >= 1, got 0 and 4"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            eng.generate(PROMPTS, **{"group_size": 2, "max_new_tokens": 4, **options})
    with pytest.raises(ValueError, match="at least one prompt"):
        eng.generate([], group_size=2, max_new_tokens=4)
    ro = eng.generate(PROMPTS, group_size=1, max_new_tokens=4, temperature=0.0, greedy=True)
    assert ro.response_ids_BT.shape == (2, 4)  # greedy needs no temperature


@pytest.mark.parametrize("engine", ["dapo", "hf"])
def test_an_empty_prompt_is_refused_naming_it(tiny_model, tokenizer, engine):
    # Before: the native engine sampled its rows from a fully masked row, hf raised IndexError.
    eng = make_engine(engine, tiny_model, tokenizer)
    ids = tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"]
    for prompts in ([ids, []], [PROMPTS[0], ""]):
        with pytest.raises(ValueError, match="prompt 1 has no tokens.*at least one token"):
            eng.generate(prompts, group_size=2, max_new_tokens=4, seed=[1, 2])


@pytest.mark.parametrize("engine", ["dapo", "hf"])
def test_a_right_padding_tokenizer_still_gives_left_padded_prompts(
    tiny_model, tokenizer, engine, monkeypatch
):
    # A tokenizer a user passes in often pads on the right: the shorter prompt then ended in
    # pads, and generation continued from them.
    left = generate(tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=8, seed=3)
    monkeypatch.setattr(tokenizer, "padding_side", "right")
    right = generate(
        tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=8, seed=3, engine=engine
    )
    assert right.prompt_mask_BP[:, -1].all()
    assert torch.equal(right.prompt_ids_BP, left.prompt_ids_BP)
    if engine == "dapo":
        assert torch.equal(right.response_ids_BT, left.response_ids_BT)


@pytest.mark.parametrize("engine", ["dapo", "hf"])
def test_greedy_logprobs_are_at_the_temperature_given(tiny_model, tokenizer, engine):
    ro = generate(
        tiny_model, tokenizer, PROMPTS, group_size=1, max_new_tokens=8, temperature=0.5,
        greedy=True, engine=engine,
    )  # fmt: skip
    with torch.no_grad():
        args = (ro.prompt_ids_BP, ro.prompt_mask_BP, ro.response_ids_BT, ro.response_mask_BT)
        at_half, _ = response_logprobs(tiny_model, *args, temperature=0.5)
    mask = ro.response_mask_BT
    torch.testing.assert_close(ro.logprobs_BT[mask], at_half[mask], rtol=0, atol=1e-5)


@pytest.mark.parametrize("engine", ["dapo", "hf"])
def test_a_rollout_leaves_the_global_random_stream_where_it_was(tiny_model, tokenizer, engine):
    """The hf engine seeds torch's global generator for generate(); it reseeded it for good,
    so a caller's later draws depended on the last rollout's seed. Its tokens are the same
    seeded draw as before."""
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    a = generate(
        tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=6, seed=5, engine=engine
    )
    assert torch.equal(torch.rand(4), want)
    torch.manual_seed(999)
    b = generate(
        tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=6, seed=5, engine=engine
    )
    assert torch.equal(a.response_ids_BT, b.response_ids_BT)
