"""Under FSDP2 the log-probs take the same path as in one process: the chunked output head
(never the model's own [B, T, V] logits) and the shared prompt pass, inside the root module's
forward, where FSDP has gathered the head. Two gloo ranks give the one-process values and
gradients to 1e-6 in float32, with activation checkpointing or not, and with the gradients
reduce-scattered after every micro-batch or once per mini-batch."""

from __future__ import annotations

import pytest
import torch
from helpers import spawn_ranks
from transformers import Qwen2Config, Qwen2ForCausalLM

import dapo.models.logprobs as logprobs_module
from dapo.dist import fsdp
from dapo.models.logprobs import response_logprobs

VOCAB, PAD = 97, 0  # an odd vocabulary: the head's rows do not split evenly over 2 ranks


def _model() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def _batch():
    """8 rows: rank 0's four share two prompts (left-padded), rank 1's four are distinct, so
    the ranks would make different calls if the shared pass ran only where prompts repeat."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, VOCAB, (8, 5), generator=g)
    prompts[1], prompts[3] = prompts[0], prompts[2]
    prompt_mask = torch.ones(8, 5, dtype=torch.long)
    prompt_mask[2:4, :2] = 0
    prompts[prompt_mask == 0] = PAD
    responses = torch.randint(1, VOCAB, (8, 6), generator=g)
    response_mask = torch.ones(8, 6, dtype=torch.long)
    response_mask[[0, 5], 4:] = 0
    weights = torch.randn(8, 6, generator=g) * response_mask
    return prompts, prompt_mask, responses * response_mask, response_mask, weights


def _loss(model, rows, micro_batches: int, *, sync_each: bool):
    """The summed weighted log-probs of ``rows``, backward per micro-batch; the log-probs."""
    prompts, prompt_mask, responses, response_mask, weights = _batch()
    out = []
    for n, part in enumerate(torch.tensor(rows).chunk(micro_batches), 1):
        if not sync_each:
            fsdp.set_grad_sync(model, n == micro_batches)
        logp, _ = response_logprobs(
            model, prompts[part], prompt_mask[part], responses[part], response_mask[part]
        )
        (logp * weights[part]).sum().backward()
        out.append(logp.detach())
    return torch.cat(out)


def _rank(rank: int, port: int, options: dict, out: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        torch.set_num_threads(1)
        model = fsdp.shard(
            _model(),
            compute_dtype=torch.float32,
            activation_checkpointing=options["checkpointing"],
            reshard_after_forward=options.get("reshard", True),
        )
        calls = {"head": 0, "layer": 0, "chunked": 0}
        model.lm_head.register_forward_hook(lambda *_: calls.__setitem__("head", 1 + calls["head"]))
        layer = fsdp.decoder_layers(model)[0]
        layer.register_forward_hook(lambda *_: calls.__setitem__("layer", 1 + calls["layer"]))
        chunked = logprobs_module.token_logprobs_from_hidden

        def counted(*args, **kwargs):
            calls["chunked"] += 1
            return chunked(*args, **kwargs)

        logprobs_module.token_logprobs_from_hidden = counted
        # FSDP2's reduce-scatters of gradients (torch.distributed's collective, by the name
        # torch 2.13 calls; reduce_scatter_tensor before).
        name = next(
            n
            for n in ("reduce_scatter_single", "reduce_scatter_tensor")
            if hasattr(torch.distributed, n)
        )
        reduce = getattr(torch.distributed, name)

        def counted_reduce(*args, **kwargs):
            calls["reduce"] = calls.get("reduce", 0) + 1
            return reduce(*args, **kwargs)

        setattr(torch.distributed, name, counted_reduce)
        rows = [0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7]
        logp = _loss(model, rows, options["micro_batches"], sync_each=options["sync_each"])
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        torch.save({"logp": logp, "grads": grads, "calls": calls}, f"{out}/rank_{rank}.pt")
        # Both ranks done with every collective before either tears gloo down: a rank that
        # destroyed its group while its peer's last reduce was in flight aborted once (CI).
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _one_process():
    model = _model()
    logp = _loss(model, list(range(8)), 1, sync_each=True)
    return logp, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "options",
    [
        {"checkpointing": False, "micro_batches": 1, "sync_each": True},
        {"checkpointing": False, "micro_batches": 2, "sync_each": False},
        {"checkpointing": True, "micro_batches": 2, "sync_each": True},
        {"checkpointing": True, "micro_batches": 2, "sync_each": False},
        {"checkpointing": False, "micro_batches": 2, "sync_each": False, "reshard": False},
    ],
    ids=["plain", "plain-one-reduce", "checkpointed", "checkpointed-one-reduce", "kept-gathered"],
)
def test_two_ranks_give_the_one_process_log_probs_and_gradients(options, tmp_path):
    spawn_ranks(_rank, options, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank_{r}.pt", weights_only=True) for r in range(2)]
    logp_1, grads_1 = _one_process()
    torch.testing.assert_close(torch.cat([r["logp"] for r in ranks]), logp_1, rtol=0, atol=1e-6)
    for rank in ranks:  # each rank holds the whole gradient, summed over the ranks
        assert rank["grads"].keys() == grads_1.keys()
        for name, grad in rank["grads"].items():
            # 1e-6 of the gradient's scale (the head's reaches 8.5: a summation split over two
            # ranks rounds it by 1.9e-6; a real error is of the gradient's own size).
            gap = float((grad - grads_1[name]).abs().max())
            assert gap <= 1e-6 * max(1.0, float(grads_1[name].abs().max())), (name, gap)
        micro = options["micro_batches"]
        # The chunked head on every micro-batch, the model's own head never; on every rank two
        # passes per micro-batch (the prompts, then the responses), shared prompts or not.
        assert rank["calls"]["head"] == 0 and rank["calls"]["chunked"] == micro
        assert rank["calls"]["layer"] == 2 * micro
        # Reduce-scatters of the 4 sharded units (3 layers, the root): one each per backward
        # (micro-batch); with the switch only in the last one, where FSDP2 reduces each
        # layer's gradient twice: what the earlier micro-batches accumulated with the
        # responses' part, then the prompt pass's part (measured, torch 2.13): 3 x 2 + 1.
        reduces = rank["calls"]["reduce"]
        assert reduces == (4 * micro if options["sync_each"] else 7), reduces


def test_within_forward_calls_the_root_with_one_argument_and_restores_forward():
    """FSDP2's root pre-forward in torch 2.11 indexes the first positional argument of the
    call on CUDA without checking there is one (an IndexError on an H200 before this call
    passed one): the call carries ``fn`` as its one positional argument, no keywords."""
    model = torch.nn.Linear(2, 3)
    seen = []
    model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append((args, kwargs)), with_kwargs=True
    )
    x = torch.ones(1, 2)
    out = fsdp.within_forward(model, lambda forward: forward(x) * 2)
    assert torch.equal(out, model(x) * 2)
    (args, kwargs), _ = seen  # the wrapped call, then the check's own
    assert len(args) == 1 and callable(args[0]) and kwargs == {}
    assert "forward" not in vars(model)  # the class's forward is back
