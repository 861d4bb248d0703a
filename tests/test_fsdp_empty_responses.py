"""Under FSDP a forward is a collective, so every rank must make the same calls whatever rows
it holds. A rank whose micro-batch held only empty responses (an environment's or a custom
engine's: the native engine always writes at least EOS) skipped the shared-prompt pass that
the other rank's micro-batch made, and both waited forever. Two gloo ranks, one process's
gradient to compare with."""

from __future__ import annotations

import faulthandler

import torch
from helpers import spawn_ranks

from dapo.config import load_config
from dapo.data.batch import Episode
from dapo.data.problems import Problem
from dapo.models.demo import TinyModelSpec, build_tokenizer, tiny_qwen2
from dapo.training.old_logprobs import fill_logprobs
from dapo.training.state import build_state
from dapo.training.update import accumulate_gradients

SPEC = TinyModelSpec(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
    max_positions=128,
)  # fmt: skip


def _episodes() -> list[Episode]:
    """Rows 0-2 share a prompt (the shared-prompt pass runs for them); row 3's response is
    empty."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 60, (4,), generator=g)
    out = []
    for i, (p, t) in enumerate([(prompt, 6), (prompt, 3), (prompt, 5), (prompt[:3], 0)]):
        response = torch.randint(5, 60, (t,), generator=g)
        e = Episode(p.clone(), response, -torch.rand(t, generator=g), False, True, 1.0)
        e.advantage = (0.9, -0.4, 1.3, 0.5)[i]
        out.append(e)
    return out


def _gradients(share: list[int] | None) -> tuple[dict[str, torch.Tensor], float]:
    tokenizer = build_tokenizer()
    cfg = load_config(None, ["rollout.max_new_tokens=8", "algo.l_cache=2", "model.device=cpu"])
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    state = build_state(cfg, model, tokenizer, [Problem("p", (), "1")])
    episodes = _episodes()
    fill_logprobs(state.model, episodes, "old_logprobs", state, share)
    for e in episodes:  # the other rank's rows: not this rank's to fill, nor to train
        e.old_logprobs = e.sampler_logprobs if e.old_logprobs is None else e.old_logprobs
    state.model.train()
    tokens = sum(e.length for e in episodes)
    sums = accumulate_gradients(state, episodes, share, num_tokens=tokens, num_seqs=3).read()
    grads = {}
    for name, p in state.model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.detach().clone()
    return grads, sums["loss"]


def _rank(rank: int, port: int, out: str) -> None:
    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the test, not CI
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        torch.set_num_threads(1)
        grads, loss = _gradients([[0, 1, 2], [3]][rank])
        if rank == 0:
            torch.save({"grads": grads, "loss": loss}, out)
    finally:
        torch.distributed.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def test_a_rank_of_empty_responses_makes_the_others_calls_and_the_gradient_is_one_process(
    tmp_path,
):
    torch.set_num_threads(1)
    reference, loss = _gradients(None)
    spawn_ranks(_rank, str(tmp_path / "r0.pt"))
    two = torch.load(tmp_path / "r0.pt", weights_only=True)
    assert abs(two["loss"] - loss) < 1e-6
    for name, g in reference.items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
