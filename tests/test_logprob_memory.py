"""Log-probs in bounded memory: the output head a chunk of tokens at a time, recomputed in
backward (algo.token_logprobs_from_hidden, used by dapo.models.logprobs for plain Linear heads)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import dapo.models.logprobs
from dapo.algo import token_logprobs_from_hidden
from dapo.algo.logits import add_product
from dapo.models.logprobs import output_head, response_logprobs


def _plain(hidden, weight, tokens, temperature):
    logp_all = torch.log_softmax((hidden @ weight.T) / temperature, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp_all.gather(1, tokens[:, None]).squeeze(1), entropy


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_values_and_gradients_equal_the_plain_computation(dtype, tolerance, chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=dtype, requires_grad=True)
    weight = (0.5 * torch.randn(101, 16, generator=g, dtype=dtype)).requires_grad_()
    tokens = torch.randint(0, 101, (37,), generator=g)
    upstream = torch.randn(37, generator=g, dtype=dtype)

    logp, entropy = token_logprobs_from_hidden(
        hidden, weight, tokens, temperature=0.7, with_entropy=True, chunk_tokens=chunk
    )
    (logp * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_logp, ref_entropy = _plain(hidden, weight, tokens, 0.7)
    (ref_logp * upstream).sum().backward()

    assert logp.dtype == dtype and not entropy.requires_grad
    assert _relative(logp.detach(), ref_logp.detach()) < tolerance
    assert _relative(entropy, ref_entropy.detach()) < 10 * tolerance  # another formula
    assert _relative(grads[0], hidden.grad) < tolerance
    assert _relative(grads[1], weight.grad) < tolerance


def test_under_bf16_autocast_the_head_runs_in_bf16_and_returns_float32():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    tokens = torch.randint(0, 50, (20,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = token_logprobs_from_hidden(hidden, weight, tokens, chunk_tokens=7)
        logits = torch.nn.functional.linear(hidden, weight)  # an autocast Linear: bf16
    ref = logits.float().log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert logp.dtype == torch.float32 and logits.dtype == torch.bfloat16
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)
    logp.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32


def test_the_weight_gradient_sums_chunk_products_in_the_accumulators_dtype():
    """``add_product``: float32 += bf16 @ bf16 is the bf16 product cast and added (on CUDA,
    cuBLAS sums it in float32 without rounding it to bf16 first: checked on an H100, relative
    error 6e-7 against the float32 product); equal dtypes add in place."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 5, generator=g), torch.randn(5, 4, generator=g)
    acc = torch.randn(6, 4, generator=g)
    want = acc + (a.bfloat16() @ b.bfloat16()).float()
    add_product(acc, a.bfloat16(), b.bfloat16())
    assert torch.equal(acc, want)
    want = acc + a @ b
    add_product(acc, a, b)
    torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-6)


def _big_vocab_model(vocab: int = 4096, tied: bool = True) -> Qwen2ForCausalLM:
    """A tiny Qwen2 whose vocabulary dwarfs every activation, so [tokens x vocab] stands out."""
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, vocab, (2, 6), generator=g).repeat_interleave(3, dim=0)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[3:, :2] = 0  # left padding on the second prompt
    response = torch.randint(0, vocab, (6, 9), generator=g)
    response_mask = torch.ones_like(response, dtype=torch.bool)
    response_mask[1, 5:] = False
    return prompt, prompt_mask, response, response_mask


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("share_prompts", [True, False])
def test_the_model_path_equals_the_models_own_logits(monkeypatch, share_prompts, tied):
    model = _big_vocab_model(tied=tied)
    assert output_head(model) is model.lm_head.weight  # a bias-free Linear, tied or not
    batch = _batch(4096)
    mask = batch[3]

    def run():
        model.zero_grad()
        logp, entropy = response_logprobs(
            model, *batch, temperature=0.8, with_entropy=True, share_prompts=share_prompts
        )
        logp[mask].sum().backward()
        return logp.detach()[mask], entropy[mask], [p.grad.clone() for p in model.parameters()]

    chunked = run()
    monkeypatch.setattr(dapo.models.logprobs, "output_head", lambda _model: None)  # the logits path
    plain = run()
    assert _relative(chunked[0], plain[0]) < 1e-6
    assert _relative(chunked[1], plain[1]) < 1e-5
    for a, b in zip(chunked[2], plain[2], strict=True):
        assert _relative(a, b) < 1e-5


def test_no_tokens_by_vocabulary_tensor_is_kept_for_backward():
    model = _big_vocab_model()
    batch = _batch(4096)
    tokens_x_vocab = batch[2].numel() * 4096
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = response_logprobs(model, *batch, share_prompts=False)
    assert max(saved) == 4096 * 32 < tokens_x_vocab  # the largest: the tied weight [V, H]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=torch.cat(batch[::2], dim=1)).logits
        logits.log_softmax(dim=-1)
    assert max(saved) >= tokens_x_vocab  # the plain way keeps every logit


def test_a_head_that_transforms_its_logits_uses_the_models_logits():
    model = _big_vocab_model(vocab=64)
    model.config.final_logit_softcapping = 30.0
    assert output_head(model) is None
    model.config.final_logit_softcapping = None
    model.config.model_type = "falcon_h1"  # a type whose forward scales its logits
    assert output_head(model) is None
