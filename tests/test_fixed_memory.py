"""What the memory plan counts beyond a run's tensors (dapo.training.fixed_memory): the CUDA
runtime, NCCL's buffers, the allocator's reserve, the vllm engine's reservation, and the
memory a card really offers (issue 44, item 5)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dapo.config import load_config
from dapo.memory_plan import recipe_plan
from dapo.training import fixed_memory, memory_table
from dapo.training.gpu_memory import plan_memory, settings_from_config
from dapo.training.model_shape import KNOWN_SHAPES, ModelShape
from dapo.training.plan_settings import PlanSettings

GIB = 2**30
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHAPE = ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-1.5b"])
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_cards_offer_less_than_their_name():
    # What CUDA reports: an H100 80GB about 81,090 MiB (nvidia-smi's 81,559 less 0.46 GiB);
    # an H200 nvidia-smi's 143,771 MiB less the same.
    assert fixed_memory.usable_gib(80) == 79.19
    assert fixed_memory.usable_gib(141) == 139.9
    assert fixed_memory.usable_gib(24) == pytest.approx(24e9 / GIB)  # 22.35: GB, not GiB


@pytest.mark.parametrize(
    ("world", "tp", "generators", "communicators"),
    [(1, 1, 0, 0), (8, 1, 0, 1), (8, 4, 0, 2), (4, 1, 2, 2), (4, 2, 2, 3), (1, 1, 1, 2)],
)
def test_nccl_buffers_per_communicator(world, tp, generators, communicators):
    s = PlanSettings(world_size=world, tp_size=tp, generators=generators, device="cuda")
    assert fixed_memory.communicators(s) == communicators
    assert fixed_memory.runtime_bytes(s) == GIB + communicators * GIB
    assert fixed_memory.runtime_bytes(replace(s, device="cpu")) == 0
    assert fixed_memory.runtime_bytes(replace(s, device="")) == 0  # not stated: tensors only


def test_the_runtime_is_held_in_both_phases_and_the_reserve_in_training():
    # (gqa_copy off: on CUDA the graph path decodes without transformers' per-head copy)
    tensors = plan_memory(SHAPE, PlanSettings(world_size=8, gqa_copy=False))
    card = plan_memory(SHAPE, PlanSettings(world_size=8, gqa_copy=False, device="cuda"))
    assert card.runtime == 2 * GIB  # the runtime and the job's communicator
    transient = card.activations + card.output_head + card.gathered_layers
    assert card.allocator_slack == pytest.approx(0.2 * transient, abs=1)
    assert card.generation_peak == tensors.generation_peak + 2 * GIB
    assert card.training_peak == tensors.training_peak + 2 * GIB + card.allocator_slack


def test_the_plan_with_its_reserve_covers_what_an_h100_reserved():
    """benchmarks/gpu.py on one H100 (2026-11-27): the allocator reserved 23.29 and 58.13 GiB
    in the training step of the 0.5B and 1.5B shapes (allocated peaks 22.27 and 54.45)."""
    import gpu

    cfg = gpu.run_config(gpu.REAL, "bfloat16")
    for name, reserved in (("qwen2.5-0.5b", 23.29), ("qwen2.5-1.5b", 58.13)):
        shape = ModelShape.from_hf_config(KNOWN_SHAPES[name])
        settings = settings_from_config(cfg, world_size=1, prompt_tokens=256, device="cuda")
        plan = plan_memory(shape, settings)
        with_reserve = (plan.training_peak - plan.runtime) / GIB
        assert reserved <= with_reserve <= 1.1 * reserved


def test_the_vllm_engine_reserves_its_share_of_the_card():
    cfg = load_config(
        RECIPES / "dapo-qwen2.5-math-1.5b.yaml",
        ["rollout.engine=vllm", "vllm.gpu_memory_utilization=0.4"],
    )
    card = int(79.19 * GIB)
    settings = settings_from_config(
        cfg, world_size=1, prompt_tokens=512, device="cuda", gpu_bytes=card
    )
    plan = plan_memory(SHAPE, settings)
    assert plan.kv_cache == plan.decode_workspace == 0  # vLLM's are in its reservation
    assert plan.vllm_generating == int(0.4 * card) and plan.vllm_training == 2 * GIB
    assert plan.generation_peak == plan.held + int(0.4 * card)
    native = plan_memory(SHAPE, replace(settings, engine="dapo"))
    assert plan.training_peak == native.training_peak + 2 * GIB
    awake = plan_memory(SHAPE, replace(settings, vllm_sleep=False))
    assert awake.vllm_training == int(0.4 * card)  # no sleep: held in training too
    unknown = plan_memory(SHAPE, replace(settings, gpu_bytes=0))
    assert unknown.vllm_generating == 0  # no card to size it: the dry run says so


def test_a_dry_run_of_the_vllm_engine_without_a_gpu_says_what_it_leaves_out(capsys):
    cfg = load_config(None, ["rollout.engine=vllm", "model.device=cuda"])
    memory_table.print_plan(cfg, world_size=1, prompt_tokens=20)
    out = capsys.readouterr().out
    assert "CUDA runtime and NCCL buffers (0 communicators)" in out
    assert "the vllm engine reserves 0.5 of the card" in out


def test_every_gpu_recipe_fits_its_card_with_the_overheads():
    for recipe in sorted(RECIPES.glob("dapo-qwen2.5-*.yaml")):
        row = recipe_plan(recipe)
        assert row["runtime_gib"] >= 1.0 and row["allocator_slack_gib"] > 0, recipe.name
        assert row["usable_gib"] < row["gpu_gib"] and row["fits"], (recipe.name, row["spare_gib"])
