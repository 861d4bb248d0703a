"""Two gloo ranks under FSDP2 train exactly as one process: the same samples, the same
dynamic-sampling decisions on every rank, the same weights (to float rounding)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_DEMO as TINY
from helpers import TORCHRUN_DEMO as RUN
from helpers import dapo_train, spawn_ranks
from safetensors.torch import load_file

from dapo.config import load_config
from dapo.models import policy
from dapo.training import inputs
from dapo.training.state import build_state
from dapo.training.step import train_step

COUNTERS = (
    "sampling/rounds",
    "sampling/prompts_drawn",
    "sampling/groups_mixed",
    "sampling/groups_kept",
    "sampling/tokens_generated",
    "sampling/all_correct_frac",
    "sampling/all_wrong_frac",
    "sampling/groups_with_gradient",
    "train/updates",
    "train/tokens",
)


def _config(cache: str, *extra: str):
    preset = "grpo" if "preset=grpo" in extra else None
    extra = tuple(x for x in extra if x != "preset=grpo")
    return load_config(
        None, [*TINY, f"embedded.cache_dir={cache}", *extra], base="demo", preset=preset
    )


def _train(cfg, steps: int = 2):
    """(metrics of each step, the policy's weights at the end as whole float32 tensors, the
    largest change of a weight)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = inputs.load_run_data(cfg)
    model, tokenizer = policy.load_policy(cfg, data.warmup_pairs, log=lambda _: None)
    start = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    state = build_state(cfg, model, tokenizer, data.train)  # shards the model under ranks
    assert (state.tp_mesh is not None) == (cfg.rollout.tp_size > 1)
    metrics = [train_step(state) for _ in range(steps)]
    if state.tp_mesh is not None:  # the generation copy is split: gather the policy's shards
        whole = {k: v.full_tensor() for k, v in state.model.state_dict().items()}
    else:
        source = state.gen_model if state.gen_model is not None else state.model
        if state.gen_model is not None:
            state.sync_engine()  # gathers the shards into the whole copy
        whole = source.state_dict()
    end = {k: v.detach().float().clone() for k, v in whole.items()}
    moved = max(float((end[k] - v).abs().max()) for k, v in start.items())
    return metrics, end, moved


def _rank(rank: int, port: int, cache: str, per_rank: list[list[str]], out: Path) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        torch.save(_train(_config(cache, *per_rank[rank])), out / f"rank_{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _two_ranks(cache: str, per_rank: list[list[str]], out: Path):
    spawn_ranks(_rank, cache, per_rank, out)
    return {r: torch.load(out / f"rank_{r}.pt", weights_only=True) for r in range(2)}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, demo_cache):
    cache = str(demo_cache)
    return cache, _train(_config(cache))


# The GRPO baseline's KL term: a sharded frozen reference; its groups are filtered too, so
# that every update has a real gradient (an all-zero advantage leaves only rounding noise,
# which Adam's normalisation would turn into full-size steps of random sign).
GRPO = ["preset=grpo", "sampling.dynamic=true", "algo.kl_coef=0.1"]


def test_two_ranks_train_the_grpo_baseline_as_one_process(one_process, tmp_path):
    cache = one_process[0]
    metrics_1, weights_1, moved = _train(_config(cache, *GRPO))
    assert metrics_1[1]["train/kl"] > 0 and moved > 1e-3
    for rank, (metrics, weights, _) in _two_ranks(cache, [GRPO, GRPO], tmp_path).items():
        assert [m["train/kl"] for m in metrics] == pytest.approx(
            [m["train/kl"] for m in metrics_1], abs=1e-6
        ), rank
        # Rounding only: a sum split over ranks rounds differently, and Adam's division by
        # sqrt(v) carries that into the weights (1.2e-6 after these steps with transformers
        # 4.56.2, whose attention kernels round differently; a real error moves them 1e-3).
        gap = max(float((w - weights_1[k]).abs().max()) for k, w in weights.items())
        assert gap <= 2e-6, f"rank {rank}: weights differ by up to {gap:.3g}"


@pytest.mark.parametrize(
    "per_rank",
    [
        [[], []],
        [["train.tokens_per_microbatch=120"], ["train.tokens_per_microbatch=700"]],
        [["rollout.tp_size=2"], ["rollout.tp_size=2"]],
        [["train.packing=true"], ["train.packing=true", "train.tokens_per_microbatch=200"]],
    ],
    ids=["same-split", "different-micro-batches", "tensor-parallel-rollout", "packed"],
)
def test_two_ranks_train_as_one_process(one_process, per_rank, tmp_path):
    cache, (metrics_1, weights_1, moved) = one_process
    ranks = _two_ranks(cache, per_rank, tmp_path)
    # Dynamic sampling dropped groups and drew more rounds; the weights moved far past 1e-6.
    assert metrics_1[0]["sampling/groups_mixed"] < metrics_1[0]["sampling/prompts_drawn"]
    assert max(m["sampling/rounds"] for m in metrics_1) > 1 and moved > 1e-3
    for rank, (metrics, weights, _) in ranks.items():
        for step in range(2):
            assert {k: metrics[step][k] for k in COUNTERS} == {
                k: metrics_1[step][k] for k in COUNTERS
            }, f"rank {rank}, step {step + 1}"
            assert metrics[step]["train/loss"] == pytest.approx(
                metrics_1[step]["train/loss"], abs=1e-6
            )
        assert weights.keys() == weights_1.keys()
        gap = max(float((w - weights_1[k]).abs().max()) for k, w in weights.items())
        # Other micro-batch budgets sum the same float32 gradient in another order, and Adam
        # turns a rounding difference in a near-zero gradient into part of a full step: in one
        # process, budgets of 120 and 700 tokens instead of 300 alone move the weights by up
        # to 7.2e-7 and 1.9e-7 after these 2 steps (measured on a 2-core x86 CPU, torch 2.13),
        # and two ranks with those budgets by 1.2e-6. The weights moved 3e-3: the bound is
        # still 1,500 times smaller than the training's own change.
        bound = 1e-6 if per_rank == [[], []] else 2e-6
        assert gap <= bound, f"rank {rank}: weights differ by up to {gap:.3g}"


# ----------------------------------------------------------------------------- torchrun


def _result(run_dir: Path):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    counters = [{k: m.get(k) for k in (*COUNTERS, "val/accuracy")} for m in lines]
    return counters, load_file(run_dir / "model" / "model.safetensors")


def _same_run(a: Path, b: Path) -> None:
    (counters_a, weights_a), (counters_b, weights_b) = _result(a), _result(b)
    assert counters_a == counters_b
    assert weights_a.keys() == weights_b.keys()
    gap = max(float((w - weights_b[k]).abs().max()) for k, w in weights_a.items())
    assert gap <= 1e-6, f"{a.name} and {b.name}: weights differ by up to {gap:.3g}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_cache):
    """The cache, the run directory root and an uninterrupted one-process run of 3 steps."""
    out = tmp_path_factory.mktemp("runs")
    cache = f"embedded.cache_dir={demo_cache}"
    dapo_train(0, *RUN, cache, "run.name=one", out_dir=out)
    return out, cache


def test_torchrun_two_ranks_is_the_one_process_run(runs):
    out, cache = runs
    printed = dapo_train(2, *RUN, cache, "run.name=two", out_dir=out)
    assert printed.count("step    3") == 1  # rank 0 prints; rank 1's output is silenced
    _same_run(out / "one", out / "two")
    ckpt = out / "two" / "checkpoints" / "step_000003"
    names = {p.name for p in (ckpt / "rng").iterdir()}
    assert names == {f"rank_{r}.{x}" for r in (0, 1) for x in ("json", "safetensors")}
    assert json.loads((ckpt / "trainer.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("first,then", [(2, 0), (0, 2)], ids=["2-ranks-then-1", "1-then-2-ranks"])
def test_a_checkpoint_resumes_at_another_world_size(runs, first, then):
    out, cache = runs
    name = f"from{first}to{then}"
    dapo_train(first, *RUN, cache, "train.steps=2", f"run.name={name}", out_dir=out)
    dapo_train(then, "--resume", str(out / name), "train.steps=3", out_dir=out)
    _same_run(out / "one", out / name)


def test_kill_9_of_one_rank_stops_the_job_and_resume_continues_exactly(runs):
    out, cache = runs
    proc = dapo_train(2, *RUN, cache, "train.steps=40", "run.name=killed", out_dir=out, wait=False)
    latest = out / "killed" / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert latest.exists(), "no checkpoint within 2 minutes"
    ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    victim = int(ranks.stdout.split()[-1])
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    stopped_in = time.monotonic() - killed_at
    assert proc.returncode != 0 and stopped_in < 90, (proc.returncode, stopped_in)
    assert "Signal 9" in err or "SIGKILL" in err or "exitcode  : -9" in err
    # The job died mid-run: resume it (in one process) to step 3 and it is the run of 'one'.
    step = int(latest.read_text().strip().removeprefix("step_"))
    assert 1 <= step <= 3, step
    dapo_train(0, "--resume", str(out / "killed"), "train.steps=3", out_dir=out)
    _same_run(out / "one", out / "killed")


def test_cpu_offload_on_a_cpu_model_is_refused_with_the_fix(tokenizer):
    from dapo.dist import fsdp
    from dapo.models.demo import TinyModelSpec, tiny_qwen2

    model = tiny_qwen2(tokenizer, TinyModelSpec(hidden_size=16, num_layers=1), seed=0)
    with pytest.raises(ValueError, match="trains on the CPU already: drop dist.cpu_offload"):
        fsdp.shard(model, compute_dtype=torch.float32, cpu_offload=True)
    assert [type(m).__name__ for m in fsdp.decoder_layers(model)] == ["Qwen2DecoderLayer"]


def test_activation_checkpointing_in_one_process_trains_as_without_it(one_process):
    cache, (metrics_1, weights_1, _) = one_process
    metrics, weights, _ = _train(_config(cache, "dist.activation_checkpointing=true"))
    for step in range(2):
        assert {k: metrics[step][k] for k in COUNTERS} == {k: metrics_1[step][k] for k in COUNTERS}
    gap = max(float((w - weights_1[k]).abs().max()) for k, w in weights.items())
    # The layers recomputed in backward: to float rounding.
    assert gap <= 2e-6, f"weights differ by up to {gap:.3g}"


def test_checkpointed_layers_keep_a_fraction_of_the_activations(tokenizer):
    import copy

    from dapo.data.batch import Episode, collate
    from dapo.dist import fsdp
    from dapo.models.demo import TinyModelSpec, tiny_qwen2
    from dapo.models.logprobs import batch_logprobs

    plain = tiny_qwen2(tokenizer, TinyModelSpec(hidden_size=32, num_layers=4), seed=0)
    checkpointed = copy.deepcopy(plain)
    fsdp.checkpoint_layers(checkpointed)
    ids = torch.tensor([8, 9, 10, 11, 12])
    episode = Episode(torch.tensor([5, 6, 7]), ids, torch.zeros(5), False, True, 1.0)
    b = collate([episode] * 3, pad_id=tokenizer.pad_token_id)

    def saved_bytes(model):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            logp_BT, _ = batch_logprobs(model.train(), b)
        logp_BT.sum().backward()  # the recompute happens here, outside the hooks
        return sum(saved), [p.grad.clone() for p in model.parameters()]

    (kept, grads), (kept_ckpt, grads_ckpt) = saved_bytes(plain), saved_bytes(checkpointed)
    assert kept_ckpt < kept / 10  # 4 layers' activations against their inputs and one layer's
    # The same gradient: both share the group's prompt pass, whose cache the recomputed layers
    # read again (to float32 rounding: the recompute's kernels may round differently).
    for a, g in zip(grads, grads_ckpt, strict=True):
        torch.testing.assert_close(g, a, rtol=1e-5, atol=1e-5)
