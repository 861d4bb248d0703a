"""Tensor-parallel generation (``rollout.tp_size``, :mod:`dapo.dist.tensor_parallel`): two
gloo ranks generate together from a policy split across them, as one process generates from
the whole model: the same greedy and sampled tokens, log-probs within 1e-4 (float32).

One spawn of 2 ranks runs every check (a spawn costs ~10 s); the ranks save what they saw
and the tests below compare it with one process. Covered: a tied Qwen2 (embedding and head
one vocabulary-sharded weight, an odd vocabulary split unevenly), an untied Llama and a Qwen3
(per-head q/k norms); both runtimes (local shards, the default, and DTensor's forwards); the copy
filled from the whole model and from an FSDP2-sharded one (the same shards); no rank holding
two whole parameters at once while filling; both ranks returning the same rollouts; the
groups' share of a round and de-duplication; refusals before any model loads; a LoRA policy
(the copy filled with its merged weights, from the whole policy and from FSDP2 shards).

Not covered here: CUDA and NCCL (checked by hand on one H200 at tp 1 only: two ranks cannot
share one GPU under NCCL; a fake CUDA tensor cannot run on the CPU-only torch wheel, see
``tests/test_device_check.py``), bf16 generation at tp 2 (a split bf16 sum rounds differently
from the whole one, so its tokens need not match), the training step (not wired yet).
"""

from __future__ import annotations

import copy
import importlib.util
import weakref
from pathlib import Path

import pytest
import torch
from helpers import spawn_ranks
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dapo.data.problems import Problem
from dapo.dist import tensor_parallel as tp
from dapo.models.demo import TinyModelSpec, build_tokenizer, tiny_qwen2
from dapo.rollout.native import NativeEngine
from dapo.training.copies import fill_tp_copy

PROMPTS = ["1 + 2 =", "3 + 4 + 5 =", "6 ="]
SEEDS = [5, 7, 11]
GROUP = 4
NEW = 24
CPU = torch.device("cpu")
PROBLEM = Problem("p", ({"role": "user", "content": "1 + 2"},), "3")
NAMES = ["qwen2", "llama", "qwen3"]
# SmolLM2-135M's shape: 9 heads, 3 key-value heads; tp 2 splits neither.
SMOLLM2 = dict(
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
)


def _models(tok) -> dict[str, torch.nn.Module]:
    """A tied Qwen2 (4 heads, 2 kv heads), an untied Llama and a tied Qwen3, float32, EOS
    made likely so that rows finish at different steps (rows leave the batch and the cache)."""
    spec = TinyModelSpec(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_positions=256,
    )
    qwen2 = tiny_qwen2(tok, spec, seed=0)
    torch.manual_seed(1)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    torch.manual_seed(2)
    qwen3 = Qwen3ForCausalLM(  # per-head q/k norms, an explicit head_dim
        Qwen3Config(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    models = {"qwen2": qwen2, "llama": llama, "qwen3": qwen3}
    with torch.no_grad():
        for model in models.values():
            model.get_output_embeddings().weight[tok.eos_token_id] *= 6
    return {name: model.eval() for name, model in models.items()}


def _adapted(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` with rank-4 LoRA adapters, B drawn (trained adapters); None without peft."""
    if importlib.util.find_spec("peft") is None:
        return None
    from dapo.config import LoraConfig
    from dapo.models import lora

    adapted = lora.apply(copy.deepcopy(model), LoraConfig(rank=4))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return adapted.eval()


def _generate(model, tok) -> dict[str, list]:
    """Greedy and sampled (temperature 1, one seed per prompt) rollouts, as plain lists."""
    engine = NativeEngine(model, tok)
    out = {}
    for mode, greedy in (("greedy", True), ("sampled", False)):
        r = engine.generate(
            PROMPTS, group_size=GROUP, max_new_tokens=NEW, seed=SEEDS, greedy=greedy
        )
        out[f"{mode}_ids"] = r.response_ids_BT.tolist()
        out[f"{mode}_logprobs"] = r.logprobs_BT.tolist()
        out[f"{mode}_lengths"] = r.lengths_B.tolist()
    return out


def _filled_from_shards(model, mesh) -> tuple[torch.nn.Module, int]:
    """A TP copy filled from an FSDP2-sharded copy of ``model``, and the most whole
    parameters alive at once while filling (each ``full_tensor`` is one)."""
    from torch.distributed.tensor import DTensor

    from dapo.dist import fsdp

    sharded = fsdp.shard(copy.deepcopy(model), compute_dtype=torch.float32)
    target = tp.tp_generation_copy(sharded, mesh, dtype=torch.float32, device=CPU)
    alive: list[weakref.ref] = []
    most = 0
    full_tensor = DTensor.full_tensor

    def tracked(self, *args, **kwargs):
        nonlocal most
        out = full_tensor(self, *args, **kwargs)
        alive.append(weakref.ref(out))
        most = max(most, sum(ref() is not None for ref in alive))
        return out

    DTensor.full_tensor = tracked
    try:
        fill_tp_copy(sharded, target)
    finally:
        DTensor.full_tensor = full_tensor
    assert len(alive) == sum(1 for _ in sharded.parameters())  # every one was gathered
    return target, most


def _local_shards(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.to_local() if hasattr(p, "to_local") else p).clone()
        for n, p in model.named_parameters()
    }


RANK_ENV = """\
import torch.distributed
from dapo.env import Environment, Observation

class RankEnv(Environment):
    # Answers with its rank: a tool whose output differs between the ranks of a group.
    turn_ends = ("=",)
    calls = 0

    def step(self, history):
        RankEnv.calls += 1
        rank = torch.distributed.get_rank()
        if history.finished:
            return Observation(done=True, reward=float(rank))
        return Observation(f" {rank} +")
"""


def _episodes(model, tok, mesh, env_file: Path) -> dict:
    """Episodes of an environment that answers each rank differently, through the run's
    runner (state.runner_for): the group's first rank answers for both."""
    from dapo.config import load_config
    from dapo.env import load_environment
    from dapo.rollout.episodes import with_turn_ends
    from dapo.training.state import runner_for

    cfg = load_config(None, [f"env.class={env_file}:RankEnv", "env.max_turns=3"])
    stops = with_turn_ends([tok.eos_token_id], tok, load_environment(cfg.env.class_, cfg.env))
    runner = runner_for(cfg, NativeEngine(model, tok, stop_token_ids=stops), tok, mesh)
    r = runner.generate([PROBLEM] * 3, PROMPTS, group_size=GROUP, max_new_tokens=NEW, seed=SEEDS)
    return {
        "ids": r.response_ids_BT.tolist(),
        "env": r.env_mask_BT.tolist(),
        "rewards": [t.reward for t in r.traces],
        "calls": type(runner.env).calls,
    }


def _rank_checks(rank: int, out: Path) -> dict:
    """What one rank of the 2-rank group sees; saved for the tests to compare."""
    tok = build_tokenizer()
    mesh = tp.tp_mesh(2, "cpu")
    seen: dict = {"coordinates": tp.tp_coordinates(mesh), "share": list(tp.group_share(7, mesh))}
    seen["contribution"] = tp.group_contribution([rank], mesh)
    per_rank = tp.tp_mesh(1, "cpu")  # world 2, tp 1: two groups of one
    seen["share_tp1"] = list(tp.group_share(7, per_rank))
    for name, model in _models(tok).items():
        copy_tp = tp.tp_generation_copy(model, mesh, dtype=torch.float32, device=CPU)
        tp.fill_tp_copy(model, copy_tp)
        seen[name] = _generate(copy_tp, tok)
        seen[f"{name}_shard_bytes"] = sum(
            t.numel() * t.element_size() for t in _local_shards(copy_tp).values()
        )
        dtensor = tp.tp_generation_copy(
            model, mesh, dtype=torch.float32, device=CPU, local_forward=False
        )
        tp.fill_tp_copy(model, dtensor)
        seen[f"{name}_dtensor"] = _generate(dtensor, tok)
        for key in (name, f"{name}_dtensor"):
            ids = torch.tensor(seen[key]["greedy_ids"] + seen[key]["sampled_ids"])
            seen[f"{key}_lockstep"] = tp.same_on_group([ids], mesh)
        from_shards, most = _filled_from_shards(model, mesh)
        a, b = _local_shards(copy_tp), _local_shards(from_shards)
        seen[f"{name}_fsdp_equal"] = a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) for k in a
        )
        seen[f"{name}_fsdp_generate"] = _generate(from_shards, tok)
        seen[f"{name}_most_whole"] = most
        held = tp.tp_generation_copy(model, mesh, dtype=torch.bfloat16, device=CPU)
        tp.fill_tp_copy(model, held)  # float32 weights into a bf16 copy: cast on the way
        c = _local_shards(held)
        seen[f"{name}_bf16_equal"] = all(
            c[k].dtype == torch.bfloat16 and torch.equal(c[k], a[k].bfloat16()) for k in a
        )
        if name == "qwen2":
            seen["episodes"] = _episodes(copy_tp, tok, mesh, out / "rank_env.py")
    adapted = _adapted(_models(tok)["qwen2"])
    if adapted is not None:  # a LoRA policy: its TP copy filled with the merged weights
        copy_tp = tp.tp_generation_copy(adapted, mesh, dtype=torch.float32, device=CPU)
        fill_tp_copy(adapted, copy_tp)
        seen["qwen2_lora"] = _generate(copy_tp, tok)
        seen["qwen2_lora_fsdp_generate"] = _generate(_filled_from_shards(adapted, mesh)[0], tok)
    try:
        tp.tp_generation_copy(
            LlamaConfig(**{k: v for k, v in SMOLLM2.items() if k != "model_type"}),
            mesh,
            dtype=torch.float32,
            device=CPU,
        )
    except ValueError as e:
        seen["refused"] = str(e)
    return seen


def _rank(rank: int, port: int, out: Path) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    torch.set_num_threads(1)
    try:
        torch.save(_rank_checks(rank, out), out / f"rank_{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("tp")
    (out / "rank_env.py").write_text(RANK_ENV)
    spawn_ranks(_rank, out)
    return {r: torch.load(out / f"rank_{r}.pt", weights_only=False) for r in range(2)}


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict]:
    torch.set_num_threads(1)
    tok = build_tokenizer()
    out = {name: _generate(model, tok) for name, model in _models(tok).items()}
    adapted = _adapted(_models(tok)["qwen2"])
    if adapted is not None:  # sampled from its merged copy (model.lora.merged_sampling)
        out["qwen2_lora"] = _generate(adapted, tok)
    return out


RUNTIMES = ["", "_dtensor"]  # local shards with plain collectives (default); DTensor's dispatch


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_two_ranks_generate_what_one_process_generates(ranks, one_process, name, mode, runtime):
    whole = one_process[name]
    assert len(set(whole[f"{mode}_lengths"])) > 1  # rows finished at different steps
    for r in (0, 1):
        split = ranks[r][name + runtime]
        assert split[f"{mode}_ids"] == whole[f"{mode}_ids"]
        diff = torch.tensor(split[f"{mode}_logprobs"]) - torch.tensor(whole[f"{mode}_logprobs"])
        assert diff.abs().max() < 1e-4


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_lora_policy_generates_at_tp_2_what_it_generates_whole(ranks, one_process, mode):
    """The tensor-parallel copy of a policy with adapters holds the merged weights, filled from
    the whole policy or from its FSDP2 shards (``fill_tp_copy``)."""
    pytest.importorskip("peft")
    whole = one_process["qwen2_lora"]
    assert whole[f"{mode}_ids"] != one_process["qwen2"][f"{mode}_ids"]  # the adapters count
    for r in (0, 1):
        for split in (ranks[r]["qwen2_lora"], ranks[r]["qwen2_lora_fsdp_generate"]):
            assert split[f"{mode}_ids"] == whole[f"{mode}_ids"]
            diff = torch.tensor(split[f"{mode}_logprobs"]) - torch.tensor(whole[f"{mode}_logprobs"])
            assert diff.abs().max() < 1e-4


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", NAMES)
def test_both_ranks_of_a_group_return_the_same_rollouts(ranks, name, runtime):
    key = name + runtime
    assert ranks[0][key] == ranks[1][key]  # ids and log-probs, bit for bit
    assert ranks[0][f"{key}_lockstep"] and ranks[1][f"{key}_lockstep"]


@pytest.mark.parametrize("name", NAMES)
def test_filling_from_fsdp_shards_equals_filling_from_the_whole_model(ranks, name):
    for r in (0, 1):
        assert ranks[r][f"{name}_fsdp_equal"]
        assert ranks[r][f"{name}_fsdp_generate"] == ranks[r][name]


@pytest.mark.parametrize("name", NAMES)
def test_a_bf16_copy_holds_the_float32_weights_rounded(ranks, name):
    assert ranks[0][f"{name}_bf16_equal"] and ranks[1][f"{name}_bf16_equal"]


@pytest.mark.parametrize("name", NAMES)
def test_no_rank_holds_two_whole_parameters_while_filling(ranks, name):
    for r in (0, 1):
        assert ranks[r][f"{name}_most_whole"] == 1


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_holds_about_half_the_weights(ranks, one_process, name):
    tok = build_tokenizer()
    model = _models(tok)[name]
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    for r in (0, 1):
        # 1/2 of every split weight (an odd vocabulary splits one row unevenly), whole norms.
        assert ranks[r][f"{name}_shard_bytes"] <= (whole - norms) / 2 + norms + 64 * 4 * 2


def test_a_groups_episodes_see_its_first_ranks_observations(ranks):
    """Each rank ran its environment: a tool whose output differs between them (a set's
    order, a deadline) forked the group's episodes, and the lockstep collectives combined
    partial sums of different sequences. The first rank answers for the group."""
    first, second = ranks[0]["episodes"], ranks[1]["episodes"]
    assert first == second | {"calls": first["calls"]}  # ids, masks, rewards: the same
    assert first["calls"] > 0 and second["calls"] == 0  # the second rank ran no tool
    # Rank 0's answers (rank 1 would score 1.0; None: cut by L_max or max_turns, unscored).
    assert 0.0 in first["rewards"] and set(first["rewards"]) <= {0.0, None}
    assert any(any(row) for row in first["env"])  # observations were added


def test_groups_share_a_round_and_contribute_once(ranks):
    assert ranks[0]["coordinates"] == (0, 0) and ranks[1]["coordinates"] == (0, 1)
    # One group of two: both ranks generate every prompt; only the first contributes.
    assert ranks[0]["share"] == ranks[1]["share"] == list(range(7))
    assert ranks[0]["contribution"] == [0] and ranks[1]["contribution"] == []
    # tp 1: two groups of one, which split the round as dist.share does.
    assert ranks[0]["share_tp1"] == [0, 1, 2] and ranks[1]["share_tp1"] == [3, 4, 5, 6]


def test_a_model_tp_cannot_split_is_refused_before_it_is_built(ranks):
    message = ranks[0]["refused"]
    assert "rollout.tp_size=2" in message
    assert "attention heads (num_attention_heads), 9" in message
    assert "key-value heads (num_key_value_heads), 3" in message
    assert message.endswith(": 1")  # the one size that fits both ranks and 9/3 heads


def test_refusals_name_the_field_and_the_fix():
    # SmolLM2-135M: tp 2 splits neither its 9 heads nor its 3 kv heads; tp 3 splits both.
    errors = tp.check_tp_size(2, 2, SMOLLM2)
    assert len(errors) == 2 and all(e.startswith("rollout.tp_size=2 ") for e in errors)
    assert all(e.endswith("intermediate size: 1") for e in errors)
    assert tp.check_tp_size(3, 3, SMOLLM2) == []
    assert tp.check_tp_size(3, 6, SMOLLM2) == []
    # The world size: 3 ranks cannot be grouped 2 at a time.
    qwen = dict(SMOLLM2, model_type="qwen2", num_attention_heads=8, num_key_value_heads=2)
    (error,) = tp.check_tp_size(2, 3, qwen)
    assert "does not divide the world size, 3" in error and error.endswith(": 1")
    assert tp.check_tp_size(2, 4, qwen) == []
    # A model without a plan (a config object, as transformers loads it).
    from transformers import GPT2Config

    (error,) = tp.check_tp_size(2, 2, GPT2Config(n_head=4))
    assert "no tensor-parallel plan for model type 'gpt2'" in error
    assert error.endswith("set rollout.tp_size=1")
    assert tp.check_tp_size(1, 3, GPT2Config()) == []  # tp 1 needs nothing
    with pytest.raises(ValueError, match="rollout.tp_size=2 does not divide"):
        tp.require_tp_size(2, 2, SMOLLM2)
