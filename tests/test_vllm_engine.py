"""The vllm rollout engine, on the CPU: what it samples, the log-probs it reports, the weight
sync after an update, and a short training run. Skipped where vLLM is not installed
(``.ci/run-vllm`` installs it in a virtual environment of its own and runs this file)."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import spawn_ranks
from safetensors.torch import load_file

from dapo.models.demo import TinyModelSpec, build_tokenizer, tiny_qwen2
from dapo.models.logprobs import response_logprobs
from dapo.rollout import make_engine

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (see .ci/run-vllm)"
)

ROOT = Path(__file__).resolve().parents[1]
# vLLM's CPU attention needs a head size that is a multiple of 32.
SPEC = TinyModelSpec(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1
)
PROMPTS = ["User: 12+7=?\nAssistant:\n", "User: 3*4=?\nAssistant:\n", "User: 9-5=?\nAssistant:\n"]


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_qwen2(tokenizer, SPEC, seed=0).eval()


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    """One engine for the module: vLLM takes seconds to start."""
    return make_engine("vllm", model, tokenizer)


def forward_gap(model, ro, temperature: float = 1.0) -> float:
    """Largest |engine - forward pass| log-prob over the rollout's response tokens."""
    with torch.no_grad():
        logp_BT, _ = response_logprobs(
            model,
            ro.prompt_ids_BP,
            ro.prompt_mask_BP,
            ro.response_ids_BT,
            ro.response_mask_BT,
            temperature=temperature,
        )
    mask = ro.response_mask_BT
    return float((logp_BT[mask] - ro.logprobs_BT[mask]).abs().max())


def test_greedy_decoding_and_stops_match_the_native_engine(model, tokenizer, engine):
    native = make_engine("dapo", model, tokenizer)
    kw = dict(group_size=1, max_new_tokens=12, greedy=True)
    a, b = engine.generate(PROMPTS, **kw), native.generate(PROMPTS, **kw)
    for field in ("prompt_ids_BP", "prompt_mask_BP", "response_ids_BT", "response_mask_BT"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.lengths_B.tolist() == b.lengths_B.tolist() and a.texts == b.texts
    # A second stop token, the third token of prompt 0's greedy response: both engines end
    # that response there, stop token included, and call it finished, not truncated.
    stop = int(a.response_ids_BT[0, 2])
    eos = tokenizer.eos_token_id
    engine.stop_token_ids, native.stop_token_ids = (eos, stop), (eos, stop)
    try:
        a, b = engine.generate(PROMPTS, **kw), native.generate(PROMPTS, **kw)
    finally:
        engine.stop_token_ids = (eos,)
    assert int(a.lengths_B[0]) <= 3 and not bool(a.truncated_B[0])
    assert int(a.response_ids_BT[0, int(a.lengths_B[0]) - 1]) == stop
    assert torch.equal(a.response_ids_BT, b.response_ids_BT)
    assert a.truncated_B.tolist() == b.truncated_B.tolist()


def test_groups_seeds_and_log_probs(model, tokenizer, engine):
    G = 4
    for temperature in (1.0, 0.7):
        ro = engine.generate(
            PROMPTS, group_size=G, max_new_tokens=16, temperature=temperature, seed=[5, 6, 7]
        )
        assert len(ro.texts) == len(PROMPTS) * G
        ids_nP = tokenizer(PROMPTS, return_tensors="pt", padding=True)["input_ids"]
        assert torch.equal(ro.prompt_ids_BP, ids_nP.repeat_interleave(G, dim=0))
        for b in range(len(ro.texts)):  # a response ends at its first stop token, or at L_max
            n = int(ro.lengths_B[b])
            ends = int(ro.response_ids_BT[b, n - 1]) == tokenizer.eos_token_id
            assert bool(ro.truncated_B[b]) == (not ends) and (ends or n == 16)
        # The engine's log-probs, after temperature, are a float32 forward pass's to 1e-5.
        assert forward_gap(model, ro, temperature) < 1e-4
    # A prompt's G responses come from its own seed, whatever is batched with it.
    kw = dict(group_size=G, max_new_tokens=16, temperature=0.7)
    again = engine.generate(PROMPTS[1:], seed=[6, 7], **kw)
    width = again.response_ids_BT.shape[1]
    assert torch.equal(again.response_ids_BT, ro.response_ids_BT[G:, :width])
    other = engine.generate(PROMPTS[1:], seed=[8, 7], **kw)
    assert not torch.equal(other.response_ids_BT[:G], again.response_ids_BT[:G])


def test_episodes_on_vllm_are_the_native_engines(model, tokenizer, engine):
    """Multi-turn episodes (dapo.rollout.episodes): vLLM continues each row from its token ids
    after an observation, and greedy episodes are the native engine's, turn for turn."""
    from dapo.data.problems import Problem
    from dapo.env import Environment, Observation
    from dapo.rollout.episodes import EpisodeRunner, with_turn_ends

    eos = tokenizer.eos_token_id
    native = make_engine("dapo", model, tokenizer)
    plain = native.generate(PROMPTS, group_size=1, max_new_tokens=12, greedy=True)
    # A turn ends at the text of the third token of a greedy response: turns are continued.
    end = tokenizer.decode([int(plain.response_ids_BT[0, 2])]).strip()

    class Hints(Environment):
        turn_ends = (end,)

        def step(self, history):
            return Observation(" 4 +")

    env = Hints()
    stops = tuple(with_turn_ends([eos], tokenizer, env))
    problems = [Problem(f"p{i}", (), "0") for i in range(len(PROMPTS))]
    kw = dict(group_size=1, max_new_tokens=16, greedy=True)
    engine.stop_token_ids = stops
    try:
        a = EpisodeRunner(engine, tokenizer, env, max_turns=4).generate(problems, PROMPTS, **kw)
    finally:
        engine.stop_token_ids = (eos,)
    native.stop_token_ids = stops
    b = EpisodeRunner(native, tokenizer, env, max_turns=4).generate(problems, PROMPTS, **kw)
    assert max(t.turns for t in a.traces) > 1  # observations were added and continued from
    assert torch.equal(a.response_ids_BT, b.response_ids_BT)
    assert torch.equal(a.env_mask_BT, b.env_mask_BT) and a.traces == b.traces


def test_after_an_update_only_a_sync_gives_the_new_policy(model, tokenizer, engine):
    """An optimizer step changes the policy; without a sync the engine samples the old one (the
    test would fail if the sync were skipped), with it the new one. The long prompt spans
    several KV-cache blocks, which the prefix cache would otherwise serve from the old
    weights."""
    long_prompt = "User: " + " ".join(["12+7=?"] * 60) + "\nAssistant:\n"
    assert len(tokenizer(long_prompt)["input_ids"]) >= 128
    prompts = [long_prompt, PROMPTS[0]]
    engine.generate(prompts, group_size=2, max_new_tokens=8, seed=[1, 2])  # fills the cache
    new = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(new.parameters(), lr=3e-2)
    ro = engine.generate(prompts, group_size=2, max_new_tokens=8, seed=[1, 2])
    tensors = (ro.prompt_ids_BP, ro.prompt_mask_BP, ro.response_ids_BT, ro.response_mask_BT)
    tensors = [t.clone() for t in tensors]  # the engine's are inference tensors
    logp_BT, _ = response_logprobs(new, *tensors)
    (-logp_BT[tensors[3]].mean()).backward()
    optimizer.step()
    new.eval()
    try:
        stale = engine.generate(prompts, group_size=2, max_new_tokens=8, seed=[1, 2])
        assert forward_gap(new, stale) > 0.05  # the engine still samples the old weights
        reset = engine.llm.reset_prefix_cache
        engine.llm.reset_prefix_cache = lambda: True  # a sync that forgets the prefix cache
        try:
            engine.sync_weights(new)
        finally:
            engine.llm.reset_prefix_cache = reset
        cached = engine.generate(prompts, group_size=2, max_new_tokens=8, seed=[1, 2])
        assert forward_gap(new, cached) > 1e-3  # the long prompt's KV is the old weights'
        engine.sync_weights(new)
        assert engine.last_sync_s > 0
        fresh = engine.generate(prompts, group_size=2, max_new_tokens=8, seed=[1, 2])
        assert forward_gap(new, fresh) < 1e-4
    finally:
        engine.sync_weights(model)


RUN = [
    "train.steps=3", "train.prompts_per_step=4", "rollout.group_size=4",
    "train.responses_per_minibatch=8", "sampling.prompts_per_round=8",
    "sampling.on_max_rounds=train", "embedded.sft_steps=50", "arith.num_train=100",
    "arith.num_val=8", "arith.num_warmup=128", "eval.num_samples=2", "eval.every=3",
    "rollout.engine=vllm", "algo.rollout_correction=seq_mis", "run.threads=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The embedded model's cache that the runs share: RUN's warm-up is built once."""
    return tmp_path_factory.mktemp("vllm-runs") / "cache"


def warm_started(cache: Path) -> dict[str, torch.Tensor]:
    """The weights every run of RUN starts from."""
    (start,) = cache.glob("embedded-*/model.safetensors")
    return load_file(start)


def train(tmp_path: Path, cache: Path, name: str, *launcher: str, more: Sequence[str] = ()) -> Path:
    """The run directory of ``dapo train`` with RUN and ``more`` overrides, under ``launcher``
    (e.g. torchrun)."""
    cmd = [*launcher, "-m", "dapo", "train", "--quiet", *RUN, *more, f"run.out_dir={tmp_path}"]
    cmd += [f"run.name={name}", f"embedded.cache_dir={cache}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / name


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_short_run_with_seq_mis_trains_and_reports_the_mismatch(tmp_path, cache):
    """Three steps train (every metric finite, the weights move); two ranks under torchrun,
    each with its own engine loaded from the shards, draw the same samples and end at the
    same weights; so do two ranks that share one engine of tensor parallel size 2, and a
    trainer rank with a generator rank whose engine loads each version it is sent."""
    one = train(tmp_path, cache, "one", sys.executable)
    trained = [m for m in metrics(one) if "train/loss" in m]
    assert len(trained) == 3
    for m in trained:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
        assert 0 <= m["mismatch/abs_log_ratio"] < 1e-3  # float32 on both sides
        assert m["mismatch/corrected_frac"] == 0.0 and m["perf/weight_sync_s"] > 0
    before, after = warm_started(cache), load_file(one / "model" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ways = {  # at async_staleness 0 a generator rank samples the weights of the step it draws
        "two": [],
        "tp2": ["rollout.tp_size=2"],
        "generator": ["dist.rollout_ranks=1", "train.async_staleness=0"],
    }
    for name, extra in ways.items():
        two = train(tmp_path, cache, name, *torchrun, "--nproc-per-node", "2", more=extra)
        for a, b in zip(metrics(one), metrics(two), strict=True):
            drawn = [k for k in a if k.startswith(("rollout/", "sampling/", "val/"))]
            assert {k: a[k] for k in drawn} == {k: b[k] for k in drawn}, name
        ranks = load_file(two / "model" / "model.safetensors")
        assert max(float((after[k] - ranks[k]).abs().max()) for k in after) < 1e-4, name


# Two key-value heads, so that tensor parallelism at 2 splits them (head size 32 for vLLM).
TP_SPEC = TinyModelSpec(
    hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2
)


def _tensor_parallel_rank(rank: int, port: int, out: Path) -> None:
    """Rank ``rank`` of two: the policy sharded by FSDP2, one vLLM engine of tensor parallel
    size 2 across both ranks loaded from the shards; saves what it generated and held."""
    from dapo import dist
    from dapo.dist import fsdp
    from dapo.rollout import vllm_process
    from dapo.rollout.vllm_engine import VLLMEngine

    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    dist.init_from_env(timeout_s=300)
    tokenizer = build_tokenizer()
    model = fsdp.shard(tiny_qwen2(tokenizer, TP_SPEC, seed=0).eval(), compute_dtype=torch.float32)
    engine = VLLMEngine(model, tokenizer, tensor_parallel_size=2)
    ro = engine.generate(PROMPTS, group_size=1, max_new_tokens=12, greedy=True)
    sampled = engine.generate(PROMPTS, group_size=3, max_new_tokens=12, seed=[5, 6, 7])

    def held(worker) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for n, p in worker.model_runner.model.named_parameters()}

    (shapes,) = engine.llm.collective_rpc(held)
    dirs = sorted(vllm_process.TEMPORARY_DIRS)  # the engine's, removed by the rank's end
    saved = dict(greedy=vars(ro), sampled=vars(sampled), shapes=shapes, engine_dirs=dirs)
    saved["released"] = engine.shared_memory_released
    torch.save(saved, out / f"rank{rank}.pt")
    engine.close()


def test_tensor_parallel_engine_splits_the_weights_and_samples_as_one(tmp_path, tokenizer):
    """rollout.tp_size=2 with vLLM: two gloo ranks run one engine through vLLM's external
    launcher, loaded from FSDP2 shards one gathered tensor at a time. Each rank holds half the
    embedding rows and of the fused q/k/v bias; both return the same rollouts; greedy tokens
    are the native engine's and log-probs a float32 forward pass's (within 1e-4)."""
    spawn_ranks(_tensor_parallel_rank, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    # Each rank removed the name of its shared-memory segment once the engine had started, so
    # ranks that end by os._exit (as spawn_ranks's do) leave none for the next run to trip on.
    released = [r["released"] for r in ranks]
    assert [len(names) for names in released] == [1, 1]
    assert all(names[0].endswith(f"-cpushm_{r}") for r, names in enumerate(released))
    assert not [n for (n,) in released if Path("/dev/shm", n.lstrip("/")).exists()]
    assert [len(r["engine_dirs"]) for r in ranks] == [1, 1]
    assert not [d for r in ranks for d in r["engine_dirs"] if Path(d).exists()]  # nor in /tmp
    model = tiny_qwen2(tokenizer, TP_SPEC, seed=0).eval()
    for name in ("greedy", "sampled"):
        a, b = ranks[0][name], ranks[1][name]
        assert all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
        ), name
    whole = dict(model.named_parameters())
    shapes = ranks[0]["shapes"]
    vocab = whole["model.embed_tokens.weight"].shape[0]
    padded = -(-vocab // 64) * 64  # vLLM pads the vocabulary to a multiple of 64, then splits it
    assert shapes["model.embed_tokens.weight"] == (padded // 2, 128)
    qkv = 128 + 2 * 2 * 32  # 4 query heads and 2 key-value heads of 32
    assert shapes["model.layers.0.self_attn.qkv_proj.bias"] == (qkv // 2,)
    native = make_engine("dapo", model, tokenizer)
    greedy = native.generate(PROMPTS, group_size=1, max_new_tokens=12, greedy=True)
    got = ranks[0]["greedy"]
    assert torch.equal(got["response_ids_BT"], greedy.response_ids_BT)
    assert got["texts"] == greedy.texts
    # The sampled log-probs, from split sums, are a float32 forward pass's.
    assert forward_gap(model, SimpleNamespace(**ranks[0]["sampled"])) < 1e-4


def test_lora_adapters_are_served_and_alone_move_at_a_sync(tokenizer):
    """A policy with LoRA adapters: vLLM samples the adapted policy (its log-probs a float32
    forward pass's, not the base's), and after an update a sync hands over the adapters alone
    (no base weight reloaded), under a new adapter id, the old one dropped."""
    pytest.importorskip("peft")
    from dapo.config import LoraConfig
    from dapo.models import lora

    adapted = lora.apply(tiny_qwen2(tokenizer, SPEC, seed=0), LoraConfig(rank=4), seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    moving = lora.moving_names(adapted)

    def nudge(std: float) -> None:
        with torch.no_grad():
            for name, p in adapted.named_parameters():
                if ".lora_B." in name:
                    p.add_(torch.randn(p.shape, generator=gen) * std)

    nudge(0.3)
    engine = make_engine("vllm", adapted, tokenizer)
    every = sum(t.numel() * 4 for t in adapted.state_dict().values())
    adapters = sum(p.numel() * 4 for n, p in adapted.named_parameters() if n in moving)
    assert engine.last_sync_bytes == every and adapters < every / 4
    ro = engine.generate(PROMPTS, group_size=4, max_new_tokens=12, seed=[1, 2, 3])
    assert forward_gap(adapted, ro) < 1e-4
    with lora.adapters_off(adapted):
        assert forward_gap(adapted, ro) > 0.05  # the base alone is another policy

    nudge(0.3)
    stale = engine.generate(PROMPTS, group_size=4, max_new_tokens=12, seed=[1, 2, 3])
    assert forward_gap(adapted, stale) > 0.05
    calls, rpc = [], engine.llm.collective_rpc
    engine.llm.collective_rpc = lambda method, **kw: calls.append(method) or rpc(method, **kw)
    try:
        engine.sync_weights(adapted)
    finally:
        engine.llm.collective_rpc = rpc
    assert calls == [] and engine.last_sync_bytes == adapters
    assert engine.llm.llm_engine.list_loras() == {2}
    assert sorted(p.name for p in Path(engine._dir).glob("adapter-*")) == ["adapter-2"]
    fresh = engine.generate(PROMPTS, group_size=4, max_new_tokens=12, seed=[1, 2, 3])
    assert forward_gap(adapted, fresh) < 1e-4
    engine.close()


def test_a_lora_run_on_vllm_in_one_process_and_on_two_ranks(tmp_path, cache):
    """``model.lora`` with the vllm engine: the adapters train and the engine samples the
    policy of each step (float32 mismatch as without LoRA); two FSDP2 ranks, each engine
    given the adapters gathered from the shards, draw what one process draws."""
    pytest.importorskip("peft")
    more = ["model.lora.rank=4", "optim.lr=1e-3"]
    one = train(tmp_path, cache, "one", sys.executable, more=more)
    trained = [m for m in metrics(one) if "train/loss" in m]
    assert len(trained) == 3
    for m in trained:
        assert 0 <= m["mismatch/abs_log_ratio"] < 1e-3, m
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    two = train(tmp_path, cache, "two", *torchrun, "--nproc-per-node", "2", more=more)
    for a, b in zip(metrics(one), metrics(two), strict=True):
        drawn = [k for k in a if k.startswith(("rollout/", "sampling/", "val/"))]
        assert {k: a[k] for k in drawn} == {k: b[k] for k in drawn}
    before = warm_started(cache)
    after, ranks = (load_file(r / "model" / "model.safetensors") for r in (one, two))
    assert any(not torch.equal(before[k], after[k]) for k in before)  # merged: it moved
    assert max(float((after[k] - ranks[k]).abs().max()) for k in after) < 1e-4
