"""Mixed precision: float32 weights and optimizer state, forward/backward under autocast.

The failure it fixes: with the whole model cast to bf16, AdamW steps bf16 weights, and at the
paper's lr of 1e-6 an update far smaller than a weight's bf16 spacing rounds away."""

from __future__ import annotations

import torch
import torch.nn as nn

from dapo.config import config_warnings, load_config
from dapo.data.batch import Episode
from dapo.data.problems import Problem
from dapo.models.demo import TinyModelSpec, tiny_qwen2
from dapo.training.state import build_state
from dapo.training.step import train_step
from dapo.training.update import update

SPEC = TinyModelSpec(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1
)


def _episodes() -> list[Episode]:
    eps = []
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        eps.append(
            Episode(
                prompt_ids=torch.randint(5, 60, (6,), generator=g),
                response_ids=torch.randint(5, 60, (5 + i,), generator=g),
                sampler_logprobs=-torch.rand(5 + i, generator=g),
                truncated=False,
                correct=i % 2 == 0,
                reward=1.0,
                advantage=(-1.0) ** i,
            )
        )
    return eps


def _one_update(tokenizer, param: str, compute: str) -> dict[str, tuple[int, int]]:
    """(elements changed, elements) of each parameter after one AdamW update at lr 1e-6."""
    cfg = load_config(
        None,
        [
            f"model.param_dtype={param}",
            f"model.compute_dtype={compute}",
            "train.recompute_old_logprobs=true",
            "train.responses_per_minibatch=8",
            "optim.weight_decay=0.1",
        ],
    )
    model = tiny_qwen2(tokenizer, SPEC, seed=0).to(getattr(torch, param))
    before = {name: p.clone() for name, p in model.named_parameters()}
    state = build_state(cfg, model, tokenizer, [Problem("p", (), "1")])
    assert update(state, _episodes(), lr=1e-6)["train/updates"] == 1.0
    return {
        name: (int((p != before[name]).sum()), p.numel()) for name, p in model.named_parameters()
    }


def test_a_bf16_autocast_update_at_lr_1e_6_changes_every_parameter(tokenizer):
    changed = _one_update(tokenizer, "float32", "bfloat16")
    assert all(n == total for n, total in changed.values())  # every element of every tensor


def test_pure_bf16_adamw_rounds_most_of_that_update_away(tokenizer):
    changed = _one_update(tokenizer, "bfloat16", "bfloat16")
    moved = sum(n for n, _ in changed.values()) / sum(total for _, total in changed.values())
    assert moved < 0.05  # measured: 2.6% of the elements
    assert any(n == 0 for n, _ in changed.values())  # whole tensors did not move
    cfg = load_config(
        None,
        [
            "model.param_dtype=bfloat16",
            "model.compute_dtype=bfloat16",
            "train.recompute_old_logprobs=true",
        ],
    )
    (warning,) = config_warnings(cfg)
    assert "small updates round away" in warning and "param_dtype=float32" in warning


def _matmul_dtypes(model: nn.Module) -> list[torch.dtype]:
    """Records the output dtype of every Linear layer the model runs."""
    seen: list[torch.dtype] = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    return seen


def test_training_and_rollout_compute_in_the_compute_dtype(tokenizer):
    problems = [Problem(f"p{i}", ({"role": "user", "content": f"{i} + 1"},), "1") for i in range(4)]
    cfg = load_config(
        None,
        [
            "model.compute_dtype=bfloat16",
            "train.recompute_old_logprobs=true",
            "rollout.group_size=2",
            "rollout.max_new_tokens=6",
            "algo.l_cache=2",
            "train.prompts_per_step=2",
            "sampling.dynamic=false",
            "reward.workers=0",
        ],
    )
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    seen = _matmul_dtypes(model)
    state = build_state(cfg, model, tokenizer, problems)
    metrics = train_step(state)
    assert set(seen) == {torch.bfloat16}  # rollout, pi_old and the update all ran in bf16
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the weights did not
    assert all(isinstance(v, float) and v == v for v in metrics.values())  # finite


def test_float16_computes_with_a_loss_scaler_that_resumes(tokenizer):
    cfg = load_config(
        None,
        [
            "model.compute_dtype=float16",
            "train.recompute_old_logprobs=true",
            "train.responses_per_minibatch=4",
            "optim.lr=1e-3",
        ],
    )
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    before = [p.clone() for p in model.parameters()]
    state = build_state(cfg, model, tokenizer, [Problem("p", (), "1")])
    assert state.scaler is not None and state.scaler.get_scale() == 2.0**16
    out = update(state, _episodes(), lr=1e-3)
    # The scale shrank where a scaled gradient overflowed float16; every update that went
    # through moved the weights, which stay float32 and finite.
    assert out["train/updates"] + out["train/scaler_overflows"] == 2.0
    assert out["train/updates"] >= 1.0 and state.consecutive_skips == 0
    assert out["train/loss_scale"] == state.scaler.get_scale() <= 2.0**16
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    fresh = build_state(
        cfg, tiny_qwen2(tokenizer, SPEC, seed=0), tokenizer, [Problem("p", (), "1")]
    )
    fresh.load_state_dict(state.state_dict())
    assert fresh.scaler.get_scale() == state.scaler.get_scale()


def test_the_grpo_reference_is_held_in_the_compute_dtype(tokenizer):
    cfg = load_config(None, ["model.compute_dtype=bfloat16", "train.recompute_old_logprobs=true"])
    cfg.algo.kl_coef = 0.001
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    state = build_state(cfg, model, tokenizer, [Problem("p", (), "1")])
    assert {p.dtype for p in state.ref_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_non_finite_loss_under_the_scaler_is_skipped_and_training_goes_on(tokenizer):
    cfg = load_config(
        None,
        [
            "model.compute_dtype=float16",
            "train.recompute_old_logprobs=true",
            "train.responses_per_minibatch=1",
        ],
    )
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    state = build_state(cfg, model, tokenizer, [Problem("p", (), "1")])
    fired = []

    def first_update_nan(module, _args, output):
        if module.training and not fired:  # the first update's forward (pi_old runs in eval)
            fired.append(True)
            output.last_hidden_state = output.last_hidden_state * float("nan")
        return output

    model.get_decoder().register_forward_hook(first_update_nan)
    out = update(state, _episodes(), lr=1e-3)  # 8 mini-batches: the first has a NaN loss
    # The NaN is skipped (not a crash in the next mini-batch's unscale_), and the scaler goes
    # on: later mini-batches update the weights once the scale fits.
    assert out["train/updates"] >= 1.0
    assert out["train/updates"] + out["train/skipped_updates"] == 8.0
    assert state.consecutive_skips == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
