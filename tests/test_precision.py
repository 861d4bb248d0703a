"""Mixed precision: float32 weights and optimizer state, forward/backward under autocast.

The failure it fixes: with the whole model cast to bf16, AdamW steps bf16 weights, and at the
paper's lr of 1e-6 an update far smaller than a weight's bf16 spacing rounds away.

AdamW's fused kernel on CUDA (issue 45): torch's default AdamW there is its multi-tensor path,
some ten element-wise passes over the weights, gradients and moments (in a profile of the
Qwen2.5-1.5B shape's step on an H100, AdamW took 0.05 s of 1.13); the fused kernel makes one. A
CPU run keeps torch's default, bit for bit. torch's fused kernel exists on the CPU too, and
stands in for the CUDA one: the same update through dapo's loop (clipping, float16's loss
scaler) to float32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import plus_one_problems
from torch._subclasses.fake_tensor import FakeTensorMode

from dapo.config import config_warnings, load_config
from dapo.data.batch import Episode
from dapo.data.problems import Problem
from dapo.models.demo import TinyModelSpec, tiny_qwen2
from dapo.training import state as state_module
from dapo.training.state import adamw, build_state
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
    problems = plus_one_problems(4)
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
    # finite, but for a mean over no up-clipped token (null by design)
    assert all(isinstance(v, float) for v in metrics.values())
    assert all(v == v for k, v in metrics.items() if k != "clip/high_prob_mean")


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
    # Its rotary table stays float32, as the policy's: Module.to(bf16) rounded it, and the
    # KL between the two was not ~0 at step 0 (6.6e-4 against 1.2e-5 at positions 768-1536).
    for m in (model, state.ref_model):
        assert m.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(state.ref_model.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)


def test_a_bf16_policy_keeps_the_rotary_table_from_pretrained_keeps(tmp_path):
    """model.param_dtype=bfloat16: load_policy's cast rounded inv_freq to bf16, unlike
    from_pretrained(dtype=bfloat16), and the policy's log-probs drifted from the
    pretrained model's with the position."""
    from helpers import save_model
    from transformers import AutoModelForCausalLM

    from dapo.models.policy import load_policy

    path = save_model(tmp_path / "m", "qwen2", context=2048)
    overrides = [f"model.path={path}", "model.param_dtype=bfloat16", "model.device=cpu"]
    cfg = load_config(
        None, [*overrides, "model.compute_dtype=bfloat16", "train.recompute_old_logprobs=true"]
    )
    model, _ = load_policy(cfg, log=lambda _: None)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.arange(1, 1500).remainder(model.config.vocab_size)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


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


def test_the_optimizer_is_fused_on_cuda_and_torchs_default_elsewhere():
    with FakeTensorMode():  # CUDA tensors without a GPU: AdamW only looks at their devices
        on_gpu = [torch.nn.Parameter(torch.empty(3, 4, device="cuda")) for _ in range(2)]
        offloaded = [torch.nn.Parameter(torch.empty(3, device="cpu"))]
        assert adamw(on_gpu, lr=1e-6).param_groups[0]["fused"] is True
        assert adamw(on_gpu + offloaded, lr=1e-6).param_groups[0]["fused"] is None
    group = adamw([torch.nn.Parameter(torch.ones(2))], lr=1e-6).param_groups[0]
    assert group["fused"] is None and group["foreach"] is None  # torch's default: as before


def _trained(tokenizer, monkeypatch, *, fused: bool, extra: tuple[str, ...] = ()):
    """The weights and optimizer after two updates of the tiny model at lr 1e-3."""
    if fused:
        monkeypatch.setattr(state_module, "FUSED_DEVICE_TYPES", ("cpu",))
    cfg = load_config(
        None,
        [
            "train.recompute_old_logprobs=true",
            "train.responses_per_minibatch=4",
            "optim.lr=1e-3",
            "optim.weight_decay=0.1",
            "optim.grad_clip=0.5",
            *extra,
        ],
    )
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    state = build_state(cfg, model, tokenizer, [Problem("p", (), "1")])
    out = [update(state, copy.deepcopy(_episodes()), lr=1e-3) for _ in range(2)]
    monkeypatch.setattr(state_module, "FUSED_DEVICE_TYPES", ("cuda",))
    return state, out


@pytest.mark.parametrize("extra", [(), ("model.compute_dtype=float16",)], ids=["fp32", "fp16"])
def test_the_fused_kernel_steps_as_the_default_does(tokenizer, monkeypatch, extra):
    default, out_default = _trained(tokenizer, monkeypatch, fused=False, extra=extra)
    fused, out_fused = _trained(tokenizer, monkeypatch, fused=True, extra=extra)
    assert fused.optimizer.param_groups[0]["fused"] is True
    assert default.optimizer.param_groups[0]["fused"] is None
    updates = [o["train/updates"] for o in out_default]
    assert updates == [o["train/updates"] for o in out_fused] and sum(updates) >= 2
    start = tiny_qwen2(tokenizer, SPEC, seed=0).state_dict()
    pairs = zip(default.model.named_parameters(), fused.model.parameters(), strict=True)
    for (name, a), b in pairs:
        moved = float((a.detach() - start[name]).abs().max())
        assert moved > 1e-4, name  # the updates moved every tensor
        # Within a thousandth of one step's size (lr 1e-3): the kernels round differently, and
        # Adam's division by sqrt(v) magnifies that where a gradient is near 0 (measured:
        # at most 6e-7, a bias).
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("written_fused", [False, True], ids=["foreach-written", "fused-written"])
def test_a_checkpoint_resumes_with_this_processs_adamw(
    tokenizer, monkeypatch, tmp_path, written_fused
):
    """Loading an optimizer's state replaces its parameter groups with the saved ones, AdamW's
    ``fused`` among them. A float16 run (with a loss scaler) resumed across kinds, a checkpoint
    of a CPU run on a GPU or the reverse (the CPU's fused kernel standing in for CUDA's), keeps
    this process's kind, its step counters where that kind keeps them, and steps on (a fused
    flag over a foreach optimizer used to fail at the scaler's step)."""
    from dapo.run import checkpoint

    ft = ("model.compute_dtype=float16",)
    written, _ = _trained(tokenizer, monkeypatch, fused=written_fused, extra=ft)
    checkpoint.save(
        tmp_path,
        step=2,
        model=written.model,
        tokenizer=tokenizer,
        optimizer=written.optimizer,
        trainer_state=written.state_dict(),
        keep=1,
    )
    if not written_fused:
        monkeypatch.setattr(state_module, "FUSED_DEVICE_TYPES", ("cpu",))
    cfg = written.cfg
    resumed = build_state(
        cfg, tiny_qwen2(tokenizer, SPEC, seed=1), tokenizer, [Problem("p", (), "1")]
    )
    resumed.load_state_dict(
        checkpoint.load(
            checkpoint.find_latest(tmp_path), model=resumed.model, optimizer=resumed.optimizer
        )
    )
    group = resumed.optimizer.param_groups[0]
    assert group["fused"] is (None if written_fused else True)
    before = [float(s["step"]) for s in written.optimizer.state.values()]
    steps = [s["step"] for s in resumed.optimizer.state.values()]
    assert [float(t) for t in steps] == before and before[0] >= 2.0
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in steps)
    updates = update(resumed, copy.deepcopy(_episodes()), lr=1e-3)["train/updates"]
    assert updates >= 1.0
    after = [float(s["step"]) for s in resumed.optimizer.state.values()]
    assert after == [b + updates for b in before]


def test_an_empty_model_for_a_sharded_load_keeps_a_float32_rotary_table(tokenizer):
    """The sharded load and the FSDP generation copy start from empty_model: its bf16 cast
    rounded inv_freq, and the generation copy sampled with bf16 rotary angles."""
    from dapo.models.sharded_load import empty_model

    config = tiny_qwen2(tokenizer, SPEC, seed=0).config
    model = empty_model(config, torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
