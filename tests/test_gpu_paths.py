"""The GPU paths, checked on a CPU: the device a run computes on, the generators a checkpoint
keeps, the process group's backends. Each of these failed on GPUs before (issue: the first
run on real GPUs): every rank on cuda:0, an RNG state per visible GPU that a machine with
fewer GPUs could not restore, NCCL asked to carry CPU tensors."""

from __future__ import annotations

import io
import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from dapo import dist
from dapo.models import policy
from dapo.run import checkpoint


class _FakeCuda:
    """torch.cuda's generator and device queries, recorded: a CPU build has no GPU to ask."""

    def __init__(self, monkeypatch, count: int) -> None:
        self.set_calls: list[tuple[torch.Tensor, torch.device]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(
            torch.cuda,
            "get_rng_state",
            lambda device: torch.tensor([device.index], dtype=torch.uint8),
        )
        monkeypatch.setattr(
            torch.cuda,
            "set_rng_state",
            lambda state, device: self.set_calls.append((state, device)),
        )


def test_a_checkpoint_keeps_only_its_own_gpus_generator(monkeypatch):
    fake = _FakeCuda(monkeypatch, count=8)
    state = checkpoint.capture_rng(torch.device("cuda", 3))
    assert torch.equal(state["cuda_rank"], torch.tensor([3], dtype=torch.uint8))
    assert "cuda" not in state  # not one state per visible GPU
    checkpoint.restore_rng(state, torch.device("cuda", 0))  # another rank, another machine
    assert fake.set_calls == [(state["cuda_rank"], torch.device("cuda", 0))]


def test_a_checkpoint_of_8_gpus_resumes_on_4_on_1_and_on_a_cpu(monkeypatch):
    before = checkpoint.capture_rng()
    # dapo <= 0.2 saved torch.cuda.get_rng_state_all(): one state per GPU the rank saw.
    before["cuda"] = [torch.tensor([i], dtype=torch.uint8) for i in range(8)]
    fake = _FakeCuda(monkeypatch, count=4)
    checkpoint.restore_rng(before, torch.device("cuda", 2))  # its own GPU's state
    assert [int(s) for s, _ in fake.set_calls] == [2]
    with pytest.warns(UserWarning, match="2 GPU generator states"):
        checkpoint.restore_rng({**before, "cuda": before["cuda"][:2]}, torch.device("cuda", 3))
    with pytest.warns(UserWarning, match="only the GPU generator's draws differ"):
        checkpoint.restore_rng(before, None)  # one process on a CPU
    new = checkpoint.capture_rng(torch.device("cuda", 1))
    with pytest.warns(UserWarning, match="a GPU generator state"):
        checkpoint.restore_rng(new, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.restore_rng(checkpoint.capture_rng(), None)  # CPU to CPU: nothing to say


def test_each_rank_computes_on_its_own_gpu_or_the_one_it_is_shown():
    assert dist.rank_device(cuda_count=8, local_rank=5) == torch.device("cuda", 5)
    # srun --gpus-per-task=1: each task sees one GPU, whatever its LOCAL_RANK.
    assert dist.rank_device(cuda_count=1, local_rank=5) == torch.device("cuda", 0)
    assert dist.rank_device(cuda_count=0, local_rank=1) == torch.device("cpu")
    with pytest.raises(ValueError, match="LOCAL_RANK=4 but 4 GPUs are visible"):
        dist.rank_device(cuda_count=4, local_rank=4)
    assert dist.backend(True) == "cuda:nccl,cpu:gloo" and dist.backend(False) == "gloo"


def _launched(monkeypatch, local_rank: int) -> None:
    for key, value in {"RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "h"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def test_model_device_is_the_ranks_and_a_contradiction_is_refused(monkeypatch):
    _FakeCuda(monkeypatch, count=8)
    _launched(monkeypatch, local_rank=5)
    assert policy.compute_device("auto") == torch.device("cuda", 5)
    assert policy.compute_device("cuda") == torch.device("cuda", 5)
    assert policy.compute_device("cuda:5") == torch.device("cuda", 5)
    with pytest.raises(ValueError, match="model.device=cuda:0 under torchrun.*cuda:5 for this"):
        policy.compute_device("cuda:0")
    with pytest.raises(ValueError, match="model.device=cpu under torchrun"):
        policy.compute_device("cpu")


def test_one_process_picks_a_visible_gpu_or_says_which_are(monkeypatch):
    _FakeCuda(monkeypatch, count=2)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert policy.compute_device("auto") == torch.device("cuda", 0)
    assert policy.compute_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="only 2 GPUs are visible"):
        policy.compute_device("cuda:2")
    assert policy.compute_device("cpu") == torch.device("cpu")


# --- the vllm engine on its rank's GPU, with a stand-in for vLLM ---------------------------------


class _StandInLLM:
    """Records how the engine builds and drives vLLM; like vLLM's worker, it makes cuda:0 the
    current device when it starts."""

    built: list[dict] = []

    def __init__(self, cuda, **kwargs) -> None:
        self.cuda, self.calls = cuda, []
        _StandInLLM.built.append({**kwargs, "LOCAL_RANK": os.environ.get("LOCAL_RANK")})
        cuda.current = 0
        self.llm_engine = SimpleNamespace(
            add_lora=lambda request: self.calls.append(f"add_lora({request.lora_int_id})"),
            remove_lora=lambda lora_id: self.calls.append(f"remove_lora({lora_id})"),
        )

    def collective_rpc(self, method, kwargs):
        list(kwargs["weights_iterator"])
        self.calls.append(method)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags):
        self.calls.append(f"wake_up({','.join(tags)}) after {self.cuda.emptied} empty_cache")

    def generate(self, requests, params, use_tqdm, lora_request=None):
        if lora_request is not None:
            self.calls.append(f"generate(lora {lora_request.lora_int_id})")
        eos = params[0].stop_token_ids[0]
        done = [
            SimpleNamespace(
                index=j, token_ids=[eos], logprobs=[{eos: SimpleNamespace(logprob=-0.5)}]
            )
            for j in range(params[0].n)
        ]  # noqa: E501
        return [SimpleNamespace(outputs=done) for _ in requests]


class _Cuda:
    def __init__(self, monkeypatch) -> None:
        self.current, self.emptied = 0, 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set)
        monkeypatch.setattr(torch.cuda, "empty_cache", self._empty)

    def _set(self, device) -> None:
        self.current = torch.device(device).index

    def _empty(self) -> None:
        self.emptied += 1


def _engine(monkeypatch, tiny_model, tokenizer, device, **options):
    cuda = _Cuda(monkeypatch)
    fake = SimpleNamespace(LLM=lambda **kw: _StandInLLM(cuda, **kw), SamplingParams=SimpleNamespace)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    _StandInLLM.built.clear()
    from dapo.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model, tokenizer, device=device, **options)
    return engine, cuda


def test_under_torchrun_each_ranks_engine_starts_on_its_gpu(monkeypatch, tiny_model, tokenizer):
    _launched(monkeypatch, local_rank=3)
    engine, cuda = _engine(monkeypatch, tiny_model, tokenizer, torch.device("cuda", 3))
    built = _StandInLLM.built[0]
    # The one-process executor would take GPU 0 from the device type "cuda" on every rank.
    assert built["distributed_executor_backend"] == "external_launcher"
    assert built["LOCAL_RANK"] == "3" and built["enable_sleep_mode"]
    assert cuda.current == 3  # vLLM's worker made cuda:0 current: put back
    assert os.environ["LOCAL_RANK"] == "3"


def test_one_gpu_per_task_starts_vllm_on_that_gpu(monkeypatch, tiny_model, tokenizer):
    _launched(monkeypatch, local_rank=5)  # srun: LOCAL_RANK 5, and one visible GPU, cuda:0
    _engine(monkeypatch, tiny_model, tokenizer, torch.device("cuda", 0))
    assert _StandInLLM.built[0]["LOCAL_RANK"] == "0"
    assert os.environ["LOCAL_RANK"] == "5"


def test_one_process_on_another_gpu_than_the_first_is_refused(monkeypatch, tiny_model, tokenizer):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=2"):
        _engine(monkeypatch, tiny_model, tokenizer, torch.device("cuda", 2))
    engine, _ = _engine(monkeypatch, tiny_model, tokenizer, torch.device("cuda", 0))
    assert "distributed_executor_backend" not in _StandInLLM.built[0]


def test_the_engine_sleeps_without_copying_weights_and_wakes_on_freed_memory(
    monkeypatch, tiny_model, tokenizer
):
    _launched(monkeypatch, local_rank=1)
    engine, cuda = _engine(monkeypatch, tiny_model, tokenizer, torch.device("cuda", 1))
    llm = engine.llm
    assert llm.calls == ["reload_weights", "reset_prefix_cache"]  # the trainer's weights
    kwargs = dict(group_size=2, max_new_tokens=4, seed=[7])
    engine.generate(["1 + 1 ="], **kwargs)  # an evaluation before any update
    engine.generate(["2 + 2 ="], **kwargs)  # no update in between: weights from the module
    engine.sync_weights(tiny_model)  # after an update: woken, then loaded once
    assert llm.calls[2:] == [
        "sleep(2)",
        "wake_up(kv_cache,weights) after 1 empty_cache",
        "reload_weights",
        "reset_prefix_cache",
        "sleep(2)",
        "wake_up(weights) after 2 empty_cache",
        "reload_weights",
        "reset_prefix_cache",
    ]


def test_with_lora_the_engine_sleeps_in_host_memory_and_syncs_the_adapters_alone(
    monkeypatch, tiny_model, tokenizer
):
    """LoRA with vllm.sleep (one process, or a generator rank): the frozen base goes to vLLM
    once. A level-2 sleep would drop it, and every sync and wake-up would send the whole base
    again; at level 1 it waits in host memory, and each sync after the first is the adapters'
    bytes alone (add_lora, remove_lora), with no reload_weights."""
    from dapo.config import LoraConfig
    from dapo.models import lora

    def made(name, lora_int_id, lora_path):
        return SimpleNamespace(lora_int_id=lora_int_id, lora_path=lora_path)

    request = SimpleNamespace(LoRARequest=made)
    monkeypatch.setitem(sys.modules, "vllm.lora", SimpleNamespace(request=request))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    model = lora.apply(tiny_model, LoraConfig(rank=4))
    engine, cuda = _engine(monkeypatch, model, tokenizer, torch.device("cuda", 0))
    llm = engine.llm
    assert llm.calls == ["reload_weights", "add_lora(1)", "reset_prefix_cache"]  # the base once
    moving = lora.moving_names(model)
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in moving)
    assert 0 < adapters < engine.last_sync_bytes / 4
    kwargs = dict(group_size=2, max_new_tokens=4, seed=[7])
    for step in (1, 2):
        del llm.calls[:]
        cuda.emptied = 0
        engine.generate(["1 + 1 ="], **kwargs)  # the step's rollout
        engine.generate(["2 + 2 ="], **kwargs)  # its next round, or an evaluation
        engine.sync_weights(model)  # after the update
        # The KV cache stays asleep through a sync: the next rollout wakes it alone.
        kv = ["wake_up(kv_cache) after 1 empty_cache"] if step == 2 else []
        assert llm.calls == [
            *kv,
            f"generate(lora {step})",
            "sleep(1)",
            f"wake_up(kv_cache,weights) after {len(kv) + 1} empty_cache",  # no reload
            f"generate(lora {step})",
            "sleep(1)",
            f"wake_up(weights) after {len(kv) + 2} empty_cache",
            f"add_lora({step + 1})",
            f"remove_lora({step})",
            "reset_prefix_cache",
        ], step
        assert engine.last_sync_bytes == adapters


def test_a_tensor_parallel_engine_on_shards_sleeps_in_host_memory(
    monkeypatch, tiny_model, tokenizer
):
    """rollout.tp_size=2 under torchrun: one engine across a group (vLLM's external launcher,
    tensor_parallel_size 2). Its weights come from the FSDP2 shards, whose gathers every rank
    joins in step; a rank's wake-ups (one per generate call, as many as its share needs) must
    not gather, so its weights sleep in host memory (level 1) and are not reloaded on waking."""
    from dapo.dist import fsdp

    _launched(monkeypatch, local_rank=1)
    monkeypatch.setattr(fsdp, "is_sharded", lambda model: model is tiny_model)
    engine, _ = _engine(
        monkeypatch, tiny_model, tokenizer, torch.device("cuda", 1), tensor_parallel_size=2
    )
    built = _StandInLLM.built[0]
    assert built["tensor_parallel_size"] == 2
    assert built["distributed_executor_backend"] == "external_launcher"
    kwargs = dict(group_size=2, max_new_tokens=4, seed=[7])
    engine.generate(["1 + 1 ="], **kwargs)
    engine.generate(["2 + 2 ="], **kwargs)
    engine.sync_weights(tiny_model)
    assert engine.llm.calls[2:] == [
        "sleep(1)",
        "wake_up(kv_cache,weights) after 1 empty_cache",  # no reload: no gather
        "sleep(1)",
        "wake_up(weights) after 2 empty_cache",
        "reload_weights",
        "reset_prefix_cache",
    ]


def test_parallel_ablation_runs_spread_over_the_visible_gpus(monkeypatch, tmp_path):
    import threading
    import time

    from dapo.ablate.plans import expand
    from dapo.ablate.runs import run_jobs

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    running: dict[str, str] = {}
    clashes, seen, lock = [], [], threading.Lock()

    def launcher(cmd, log, env):
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            clashes.extend(name for name, g in running.items() if g == gpu)
            running[log.name] = gpu
            seen.append(gpu)
        time.sleep(0.05)
        with lock:
            del running[log.name]
        return 0

    jobs = expand("2x2", seeds=2, budget="steps=2")
    assert run_jobs(jobs, tmp_path, parallel=2, cores=2, launcher=launcher) == []
    # 8 runs, 2 at a time: each on one GPU, never two at once on the same.
    assert len(seen) == 8 and set(seen) == {"2", "5"} and clashes == []
    # More at a time than GPUs: still one run per GPU, said once.
    seen.clear()
    out = io.StringIO()
    more = tmp_path / "more"
    assert run_jobs(jobs, more, parallel=4, cores=2, launcher=launcher, stream=out) == []
    assert len(seen) == 8 and set(seen) == {"2", "5"} and clashes == []
    assert "--parallel 4 with 2 visible GPU(s): 2 at a time, one run per GPU" in out.getvalue()


def test_run_deterministic_asks_torch_and_cublas_for_repeatable_kernels():
    """``run.deterministic``: torch's deterministic mode on, and cuBLAS's documented workspace
    setting unless the user set one (in a fresh process: the mode is process-wide)."""
    import subprocess

    code = (
        "import os, torch; from dapo.run.determinism import make_deterministic; "
        "make_deterministic(); "
        "print(torch.are_deterministic_algorithms_enabled(), os.environ['CUBLAS_WORKSPACE_CONFIG'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["True", ":4096:8"], out.stderr
    env["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"  # the user's own choice stays
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["True", ":16:8"], out.stderr


def test_a_generator_rank_loads_in_bf16_on_the_host_and_is_deterministic(monkeypatch, tmp_path):
    """A generator rank (dist.rollout_ranks) never holds the float32 policy on its GPU: the
    model directory is read in the dtype the engine samples in (bf16 under bf16 compute), on
    the host, then moved; a 32B model's float32 weights (131 GB) would not fit a GPU."""
    from helpers import TINY_DEMO, save_model
    from transformers import AutoModelForCausalLM

    from dapo.api import training
    from dapo.config import load_config
    from dapo.training import generator_ranks

    model_dir = save_model(tmp_path / "m", "qwen2")
    settings = [*TINY_DEMO, f"model.path={model_dir}", "model.compute_dtype=bfloat16"]
    settings.append("train.recompute_old_logprobs=true")
    cfg = load_config(None, [*settings, f"run.out_dir={tmp_path}"])
    reads, seen = [], {}
    real = AutoModelForCausalLM.from_pretrained

    def read(path, **kw):
        reads.append(kw.get("dtype"))
        return real(path, **kw)

    def generate(cfg, model, tokenizer, problems, reward_fn=None):
        seen["p"] = model

    from dapo.run import determinism

    made = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", read)
    monkeypatch.setattr(generator_ranks, "generate_on_this_rank", generate)
    monkeypatch.setattr(determinism, "make_deterministic", lambda: made.append(True))
    training.generator_rank(cfg, None)
    assert reads == [torch.bfloat16] and made == []
    cfg.run.deterministic = True  # the generator's kernels as repeatable as the trainers'
    training.generator_rank(cfg, None)
    assert made == [True]
    params = list(seen["p"].parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.device.type for p in params} == {"cpu"}  # generate_on_this_rank moves it
    assert policy.generation_dtype(cfg) == torch.bfloat16
    fp32 = load_config(None, TINY_DEMO)
    assert policy.generation_dtype(fp32) == torch.float32


def test_a_failing_rank_leaves_the_process_group_and_vllm_to_its_exit(monkeypatch):
    """Under torchrun a rank that fails neither destroys the process group nor shuts vLLM down
    (whose teardown destroys it): its peers may be waiting in a collective on that group, and
    with NCCL the destroy itself can hang. Its exit makes torchrun stop them. A rank that
    finishes, or a process alone, closes both as before."""
    from dapo.api import training
    from dapo.config import load_config
    from dapo.rollout.base import close_engine

    closed = []
    engine = SimpleNamespace(close=lambda: closed.append("engine"))
    monkeypatch.setattr(dist, "launched", lambda: True)
    close_engine(engine, failed=True)
    assert closed == []
    close_engine(engine, failed=False)
    assert closed == ["engine"]
    monkeypatch.setattr(dist, "launched", lambda: False)
    close_engine(engine, failed=True)  # one process: nothing waits on it
    assert closed == ["engine", "engine"]

    monkeypatch.setattr(dist, "launched", lambda: True)
    monkeypatch.setattr(dist, "shutdown", lambda: closed.append("group"))

    def fails(*a, **kw):
        raise RuntimeError("rank 1 failed")

    monkeypatch.setattr(training, "run_rank", fails)
    cfg = load_config(None, [])
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        training.run(cfg)
    assert closed == ["engine", "engine"]
    monkeypatch.setattr(training, "run_rank", lambda *a, **kw: "runs/x")
    assert training.run(cfg) == "runs/x" and closed[-1] == "group"
