"""The native rollout engine (dapo.rollout.native) and the shared-prompt forward pass change
cost, not results."""

import math

import pytest
import torch
from helpers import generate
from transformers import TopPLogitsWarper

from dapo.models.logprobs import response_logprobs
from dapo.rollout import make_engine
from dapo.rollout.native import decode, sample_from_logits, sampling_cdf
from dapo.rollout.sampling import draw_tokens

PROMPTS = ["User: What is 2 + 3?\nAssistant:\n", "Compute 7 + 1 + 4.\n", "Hi"]


def _encode(tokenizer, prompts=PROMPTS):
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


# ----------------------------------------------------------------------------- the sampler


def test_inverse_cdf_sampling_hits_each_token_in_proportion_to_its_probability():
    """On a grid of N uniforms, token v is drawn round(p_v N) times (+-1): the exact law."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(1000, -1)
    u = (torch.arange(1000) + 0.5) / 1000
    counts = torch.bincount(sample_from_logits(logits, u), minlength=5)
    assert counts.tolist() == [500, 300, 150, 50, 0]


def test_top_p_keeps_the_nucleus_and_renormalises():
    # Mass above each token (sorted): 0, 0.5, 0.8, 0.95. At top_p 0.7 the nucleus is the first
    # two (0.8 >= 0.7 drops the third), renormalised to 0.625 / 0.375.
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log().expand(800, -1)
    u = (torch.arange(800) + 0.5) / 800
    counts = torch.bincount(sample_from_logits(logits, u, top_p=0.7), minlength=4)
    assert counts.tolist() == [0, 500, 0, 300]
    # The same nucleus as transformers' warper keeps.
    kept = TopPLogitsWarper(0.7)(None, probs.log()[None].clone()).isfinite()[0]
    assert kept.tolist() == [False, True, False, True]


def test_u_near_one_never_draws_a_zero_probability_token():
    logits = torch.tensor([[0.0, 0.0, float("-inf")]])
    for u in (0.0, 0.5, 1.0 - 2**-24):
        assert sample_from_logits(logits, torch.tensor([u])).item() in (0, 1)


# ----------------------------------------------------------------------------- decoding


def test_removing_finished_rows_gives_the_same_tokens_and_logprobs(eager_eos_model, tokenizer):
    ids, mask = _encode(tokenizer)
    runs = {}
    for drop in (True, False):
        runs[drop] = decode(
            eager_eos_model,
            ids,
            mask,
            group_size=8,
            max_new_tokens=24,
            stop_token_ids=(tokenizer.eos_token_id,),
            pad_token_id=tokenizer.pad_token_id,
            temperature=0.9,
            top_p=0.95,
            seed=0,  # a seed whose rows end at 7 different steps
            drop_finished=drop,
        )
    tokens, logps, slots = runs[True]
    ends = (tokens == tokenizer.eos_token_id).float().argmax(dim=1)
    # The case the removal is for: rows finish at many different steps.
    assert len(set(ends[ends > 0].tolist())) >= 5
    assert torch.equal(tokens, runs[False][0])
    torch.testing.assert_close(logps, runs[False][1], rtol=0, atol=1e-6)
    # Only generated tokens were computed; kept rows compute every step to the longest.
    lengths = torch.where(ends > 0, ends + 1, tokens.shape[1])
    lengths = torch.where(tokens[:, 0] == tokenizer.eos_token_id, 1, lengths)
    assert slots == int(lengths.sum()) < runs[False][2] == tokens.numel()


@pytest.mark.parametrize("drop_finished", [True, False])
def test_greedy_decoding_equals_transformers_generate(tiny_model, tokenizer, drop_finished):
    ids, mask = _encode(tokenizer)
    common = dict(
        max_new_tokens=20, pad_token_id=tokenizer.pad_token_id, attention_mask=mask.clone()
    )
    probe = tiny_model.generate(input_ids=ids, do_sample=False, eos_token_id=None, **common)
    # The random model's argmax never picks EOS; a token it emits midway in one response
    # plays EOS instead, so that rows finish at different steps.
    stop = int(probe[0, ids.shape[1] + 4])
    ref = tiny_model.generate(input_ids=ids, do_sample=False, eos_token_id=stop, **common)
    ref = ref[:, ids.shape[1] :]
    got, _, _ = decode(
        tiny_model,
        ids,
        mask,
        group_size=1,
        max_new_tokens=20,
        stop_token_ids=(stop,),
        pad_token_id=tokenizer.pad_token_id,
        greedy=True,
        drop_finished=drop_finished,
    )
    finished = (ref == stop).any(dim=1)
    assert finished.any() and not finished.all()
    assert torch.equal(got, ref[:, : got.shape[1]])
    assert (ref[:, got.shape[1] :] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize("engine", ["dapo", "hf"])
def test_ignore_eos_fixes_the_length_and_logs_the_unmasked_logprob(
    eager_eos_model, tokenizer, engine
):
    # Before, hf masked the stop tokens (min_new_tokens) before it recorded the log-probs:
    # they were normalised without the stop tokens' mass (off by up to 0.14 here).
    ro = generate(
        eager_eos_model,
        tokenizer,
        PROMPTS,
        group_size=4,
        max_new_tokens=16,
        seed=2,
        ignore_eos=True,
        engine=engine,
    )
    assert (ro.lengths_B == 16).all() and ro.truncated_B.all()
    assert not (ro.response_ids_BT == tokenizer.eos_token_id).any()
    with torch.no_grad():
        logp_BT, _ = response_logprobs(
            eager_eos_model,
            ro.prompt_ids_BP,
            ro.prompt_mask_BP,
            ro.response_ids_BT,
            ro.response_mask_BT,
        )
    # The policy's probability of each token, as recomputed, not the EOS-masked sampler's.
    torch.testing.assert_close(logp_BT, ro.logprobs_BT, rtol=0, atol=1e-5)


def test_engines_sample_the_same_first_token_distribution(tiny_model, tokenizer):
    """Different random streams, the same law: first-token frequencies over 4096 draws agree
    with the model's probabilities within 4 standard errors for both engines."""
    prompt = [PROMPTS[0]]
    ids, mask = _encode(tokenizer, prompt)
    with torch.no_grad():
        probs = torch.softmax(tiny_model(input_ids=ids, attention_mask=mask).logits[0, -1], -1)
    for engine in ("dapo", "hf"):
        ro = generate(
            tiny_model,
            tokenizer,
            prompt,
            group_size=4096,
            max_new_tokens=1,
            seed=11,
            engine=engine,
        )
        freq = torch.bincount(ro.response_ids_BT[:, 0], minlength=probs.numel()).float() / 4096
        se = (probs * (1 - probs) / 4096).sqrt()
        assert ((freq - probs).abs() <= 4 * se + 1e-4).all(), engine


# ----------------------------------------------------------------------------- shared prompts


def test_shared_prompt_forward_equals_the_full_forward_in_values_and_gradients(
    eager_eos_model, tokenizer
):
    model = eager_eos_model
    ro = generate(model, tokenizer, PROMPTS, group_size=4, max_new_tokens=20, seed=1)
    assert len(set(ro.lengths_B.tolist())) > 1  # ragged responses, right padding
    mask = ro.response_mask_BT.clone()  # generated in inference mode
    weights = torch.linspace(-1, 1, int(mask.sum()))
    results = {}
    for share in (False, True):
        model.zero_grad()
        logp, ent = response_logprobs(
            model,
            ro.prompt_ids_BP.clone(),
            ro.prompt_mask_BP.clone(),
            ro.response_ids_BT.clone(),
            mask.clone(),
            temperature=0.7,
            with_entropy=True,
            share_prompts=share,
        )
        (logp[mask] * weights).sum().backward()
        results[share] = (logp.detach(), ent, [p.grad.clone() for p in model.parameters()])
    full, shared = results[False], results[True]
    torch.testing.assert_close(shared[0][mask], full[0][mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1][mask], full[1][mask], rtol=0, atol=1e-5)
    for g_shared, g_full in zip(shared[2], full[2], strict=True):
        scale = g_full.abs().max().clamp(min=1e-6)
        assert ((g_shared - g_full).abs().max() / scale) < 1e-5


def test_non_finite_logits_stop_sampling_instead_of_drawing_the_last_token():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 2.0]])
    with pytest.raises(FloatingPointError, match="NaN or \\+inf"):
        sample_from_logits(logits, torch.tensor([0.5, 0.5]))
    with pytest.raises(FloatingPointError):
        sample_from_logits(torch.tensor([[float("inf"), 0.0]]), torch.tensor([0.5]))


@pytest.mark.parametrize("greedy", [False, True])
def test_non_finite_logits_stop_greedy_decoding_as_they_stop_sampling(greedy):
    # Before: greedy took the argmax of a NaN row (an arbitrary token, a NaN log-prob).
    u = torch.tensor([0.5], dtype=torch.float64)
    draw = dict(temperature=1.0, top_p=1.0, greedy=greedy, masked_tokens=None)
    for bad in (float("nan"), float("inf")):
        logits = torch.tensor([[0.0, 1.0, bad]])
        with pytest.raises(FloatingPointError, match="NaN or \\+inf"):
            draw_tokens(logits, u, **draw)
        draw_tokens(logits, u, **draw, check=False)  # the static path checks on the device
    masked = torch.tensor([[0.0, 1.0, float("-inf")]])  # -inf alone is a mask
    assert draw_tokens(masked, u, **draw)[0].item() in (0, 1)


def test_a_cache_that_cannot_be_sliced_by_row(monkeypatch, tiny_model, tokenizer):
    """Training falls back to the plain forward; the dapo engine says to use the hf one."""
    import dapo.models.logprobs
    import dapo.rollout.native

    ro = generate(tiny_model, tokenizer, PROMPTS, group_size=3, max_new_tokens=8, seed=4)
    args = (ro.prompt_ids_BP, ro.prompt_mask_BP, ro.response_ids_BT, ro.response_mask_BT)
    with torch.no_grad():
        shared, _ = response_logprobs(tiny_model, *args)
        monkeypatch.setattr(dapo.models.logprobs, "row_sliceable", lambda cache: False)
        fallback, _ = response_logprobs(tiny_model, *args)
        plain, _ = response_logprobs(tiny_model, *args, share_prompts=False)
    assert torch.equal(fallback, plain)
    # On response tokens; the padding after an EOS is masked out of every loss and metric.
    mask = ro.response_mask_BT
    torch.testing.assert_close(shared[mask], plain[mask], rtol=0, atol=1e-5)
    monkeypatch.setattr(dapo.rollout.native, "row_sliceable", lambda cache: False)
    with pytest.raises(ValueError, match="set rollout.engine=hf"):
        generate(tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=4)
    hf = generate(tiny_model, tokenizer, PROMPTS, group_size=2, max_new_tokens=4, engine="hf")
    assert hf.response_ids_BT.shape[0] == 6


def test_the_sampler_draws_the_exact_softmax_on_a_152k_vocabulary():
    """Inverse-CDF sampling draws token i with probability (CDF_i - CDF_{i-1}) / CDF_V: the
    distribution the sampler implies, read off its CDF, against the softmax of the same
    float32 logits computed independently (math.fsum)."""
    vocab = 152_064  # Qwen2.5's
    g = torch.Generator().manual_seed(0)
    # A long tail over ~40 nats: Zipf-like ranks with noise, shuffled, as float32 logits.
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    noisy = -3.0 * ranks.log() + 0.5 * torch.randn(vocab, generator=g, dtype=torch.float64)
    logits = noisy[torch.randperm(vocab, generator=g)].float()[None]
    values = logits[0].double().tolist()
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = math.fsum(weights)
    exact = torch.tensor([w / total for w in weights], dtype=torch.float64)
    assert exact.min() < 1e-15  # the tail reaches below float32's resolution near 1

    def total_variation(cdf):
        implied = torch.diff(cdf.double(), prepend=torch.zeros(1, dtype=torch.float64))
        return 0.5 * (implied / cdf[-1].double() - exact).abs().sum().item()

    cdf, order = sampling_cdf(logits)
    assert order is None and total_variation(cdf[0]) < 1e-9
    # Every token above 1e-13 keeps some of the unit interval (none is never drawn) ...
    implied = torch.diff(cdf[0], prepend=torch.zeros(1, dtype=torch.float64))
    assert (implied[exact > 1e-13] > 0).all()
    # ... where the float32 CDF this replaced was off by far more, and lost the tail.
    cdf32 = torch.softmax(logits[0], dim=-1).cumsum(dim=-1)
    assert total_variation(cdf32) > 1e-6
    implied32 = torch.diff(cdf32, prepend=torch.zeros(1))
    assert (implied32[exact > 1e-13] == 0).any()


def test_every_stop_token_ends_a_response_in_both_engines(tiny_model, tokenizer):
    """An instruct model stops on several tokens (its generation_config lists them): both
    engines end a response at the first one, mask what follows and call it finished."""
    from dapo.models.policy import stop_token_ids

    ids, mask = _encode(tokenizer)
    common = dict(max_new_tokens=20, pad_token_id=tokenizer.pad_token_id)
    probe = tiny_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=None, **common
    )[:, ids.shape[1] :]
    # Two tokens the greedy responses emit at different steps play the model's stop tokens.
    first, second = int(probe[0, 3]), int(probe[1, 6])
    tiny_model.generation_config.eos_token_id = [first, second]
    stops = stop_token_ids(tiny_model, tokenizer, extra=[7])
    assert stops == tuple(sorted({tokenizer.eos_token_id, first, second, 7}))
    ref = tiny_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=list(stops), **common
    )[:, ids.shape[1] :]
    for engine in ("dapo", "hf"):
        ro = make_engine(engine, tiny_model, tokenizer, stops).generate(
            PROMPTS, group_size=1, max_new_tokens=20, greedy=True
        )
        ends = [
            next((t for t, tok in enumerate(row) if tok in stops), None) for row in ref.tolist()
        ]
        assert sum(e is not None for e in ends) >= 2  # rows end at different steps
        assert ro.lengths_B.tolist() == [20 if e is None else e + 1 for e in ends], engine
        assert ro.truncated_B.tolist() == [e is None for e in ends], engine
        for b, n in enumerate(ro.lengths_B.tolist()):
            assert ro.response_ids_BT[b, :n].tolist() == ref[b, :n].tolist(), engine
            assert not ro.response_mask_BT[b, n:].any(), engine


def test_a_token_of_probability_1e_12_is_drawn_when_u_falls_in_its_interval():
    # Token 1's interval of the unit interval is [p0, p0 + 1e-12), p0 = 0.574..., between two
    # float32 numbers (6e-8 apart there): a float32 uniform never lands in it, a float64 can.
    logits = torch.tensor([[0.3, math.log(1e-12), 0.0]])
    cdf, _ = sampling_cdf(logits)
    u = torch.tensor([(cdf[0, 0] + cdf[0, 1]).item() / 2], dtype=torch.float64)
    assert cdf[0, 0] < u < cdf[0, 1]
    assert sample_from_logits(logits, u).item() == 1
    assert sample_from_logits(logits, u.float()).item() != 1


def _first_tokens_and_expected(model, tokenizer, seed, u_B):
    """(the first token decode draws for each of G=2 rows per prompt with ``seed``, the
    tokens inverse-CDF sampling picks from the model's own logits with uniforms ``u_B``)."""
    ids, mask = _encode(tokenizer)
    tokens, _, _ = decode(
        model,
        ids,
        mask,
        group_size=2,
        max_new_tokens=1,
        stop_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        seed=seed,
    )
    with torch.no_grad():
        position = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position).logits
    expected = sample_from_logits(logits[:, -1].repeat_interleave(2, dim=0), u_B)
    return tokens[:, 0].tolist(), expected.tolist()


def test_decoding_draws_float64_uniforms_from_its_seed(tiny_model, tokenizer):
    u = torch.rand(6, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    drawn, expected = _first_tokens_and_expected(tiny_model, tokenizer, 11, u)
    assert drawn == expected


def test_a_seed_per_prompt_draws_prompt_i_from_its_own_generator(tiny_model, tokenizer):
    """Prompt i's G rows at step t read row t of its generator's [64, G] block (steps 0-63)."""
    u = torch.cat(
        [
            torch.rand((64, 2), generator=torch.Generator().manual_seed(s), dtype=torch.float64)[0]
            for s in (5, 6, 7)
        ]
    )
    drawn, expected = _first_tokens_and_expected(tiny_model, tokenizer, [5, 6, 7], u)
    assert drawn == expected


@pytest.mark.parametrize("engine", ["dapo", "hf"])
def test_with_a_seed_per_prompt_a_prompts_responses_ignore_the_rest_of_the_batch(
    eager_eos_model, tokenizer, engine
):
    """What a rank draws for its share of a round is what one process draws for the round:
    over 70 steps (past one block of uniforms), with rows finishing at different steps."""
    eng = make_engine(engine, eager_eos_model, tokenizer)
    args = dict(group_size=3, max_new_tokens=70, temperature=1.0)
    whole = eng.generate(PROMPTS, seed=[21, 22, 23], **args)
    alone = eng.generate(PROMPTS[1:2], seed=[22], **args)
    pair = eng.generate([PROMPTS[2], PROMPTS[0]], seed=[23, 21], **args)
    assert alone.texts == whole.texts[3:6]
    assert pair.texts == whole.texts[6:9] + whole.texts[0:3]
    assert len(set(whole.lengths_B.tolist())) > 1  # rows did finish at different steps
    n = int(alone.lengths_B.max())
    torch.testing.assert_close(alone.logprobs_BT[:, :n], whole.logprobs_BT[3:6, :n])
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        eng.generate(PROMPTS, seed=[1, 2], **args)
