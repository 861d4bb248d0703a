"""The start-up check of free space against what a run writes (dapo.run.disk_space): a LoRA
run's checkpoints hold its adapters alone, measured against the estimate; a resume with no
step left writes the final model/ alone, at the dtype it is written in."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from dapo.cli import main
from dapo.config import load_config
from dapo.models.demo import build_tokenizer
from dapo.run import disk_space, save_sizes

pytest.importorskip("peft")

REWARD = "def score(response, ground_truth):\n    return float(len(response) % 5) / 4.0\n"
"""Rewards that differ within a group whatever the model says, so every step trains."""

USAGE = namedtuple("usage", "total used free")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A float32 Llama of 1.2M parameters (tied head): its adapters of rank 8 are 5% of it."""
    path = tmp_path_factory.mktemp("base")
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    (path.parent / "reward.py").write_text(REWARD)
    return path


def _settings(base: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model.path={base}",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "algo.l_cache=4",
        "train.prompts_per_step=2",
        "train.responses_per_minibatch=8",
        "train.save_every=1",
        "train.steps=1",
        "sampling.dynamic=false",
        "eval.num_samples=1",
        "eval.every=0",
        "reward.workers=0",
        "run.threads=1",
        f"reward.function={base.parent / 'reward.py'}:score",
        f"run.out_dir={out}",
        "run.name=r",
        *extra,
    ]


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def test_a_lora_checkpoint_and_model_are_estimated_as_written(base, tmp_path):
    lora = ["model.lora.rank=8", "model.param_dtype=bfloat16", "model.compute_dtype=bfloat16"]
    settings = _settings(base, tmp_path, *lora, "train.recompute_old_logprobs=true")
    assert main(["train", "--quiet", *settings]) == 0
    cfg = load_config(None, settings)
    # The checkpoint holds the adapters and their optimizer state: 0.8 MB here, where three
    # copies of the bfloat16 base (the estimate before) are 7.4 MB.
    written = _bytes(tmp_path / "r" / "checkpoints" / "step_000001")
    estimate = disk_space.estimate_checkpoint_bytes(cfg, base)
    assert written <= estimate <= 1.25 * written, (written, estimate)
    # The final model/ is the merge in float32 (a bfloat16 base widened): 4 bytes a weight.
    model = tmp_path / "r" / "model"
    with safe_open(model / "model.safetensors", "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F32"}
    written = _bytes(model)
    estimate = disk_space.estimate_model_bytes(cfg, base)
    assert written <= estimate <= 1.05 * written, (written, estimate)
    # A new run asks for a checkpoint and the final model/, the larger (not two checkpoints).
    need = disk_space.estimate_checkpoint_bytes(cfg, base) + estimate
    free = {"now": need - 1}
    usage = lambda _p: USAGE(2**40, 0, free["now"])  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shutil, "disk_usage", usage)
        with pytest.raises(ValueError) as caught:
            disk_space.check_space(tmp_path / "new", cfg, base)
        free["now"] = need
        disk_space.check_space(tmp_path / "new", cfg, base)
    assert (
        f"needs about {need / 2**20:.0f} MiB (a checkpoint of the adapters and their optimiser "
        "state, then the final model/ in float32); free space or set run.out_dir"
    ) in str(caught.value)


def test_a_resume_with_no_step_left_needs_room_for_the_final_model_alone(
    base, tmp_path, monkeypatch, capsys
):
    settings = _settings(base, tmp_path)
    assert main(["train", "--quiet", *settings]) == 0
    run = tmp_path / "r"
    final = (run / "model" / "model.safetensors").read_bytes()
    shutil.rmtree(run / "model")  # as a run killed between its last checkpoint and model/
    cfg = load_config(None, settings)
    model = disk_space.estimate_model_bytes(cfg, base)
    checkpoint = disk_space.estimate_checkpoint_bytes(cfg, base)
    assert model < checkpoint / 2  # the weights, against weights and two moments
    free = {"now": model - 1}
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: USAGE(2**40, 0, free["now"]))
    assert main(["train", "--quiet", "--resume", str(run)]) == 2
    assert capsys.readouterr().err == (
        f"dapo: error: run directory {run} has {(model - 1) / 2**20:.0f} MiB free, but "
        f"finishing the run needs about {model / 2**20:.0f} MiB (the final model/ in float32: no "
        "step is left to train); free space or copy the run directory to a larger disk and "
        "resume the copy\n"
    )
    # Room for model/ but not for another checkpoint (what it asked for before): it finishes.
    free["now"] = model
    assert main(["train", "--quiet", "--resume", str(run)]) == 0
    assert (run / "model" / "model.safetensors").read_bytes() == final
    # More steps asked for: room for one more checkpoint again.
    assert main(["train", "--quiet", "--resume", str(run), "train.steps=2"]) == 2
    assert "(one more checkpoint of weights and optimiser state)" in capsys.readouterr().err


def test_steps_left_follows_the_loops_limits():
    cfg = load_config(None, ["train.steps=3", "train.max_gen_tokens=500"])
    assert disk_space.steps_left(cfg, {"step": 2, "spent": {"gen_tokens": 499.0}})
    assert not disk_space.steps_left(cfg, {"step": 3, "spent": {"gen_tokens": 0.0}})
    assert not disk_space.steps_left(cfg, {"step": 2, "spent": {"gen_tokens": 500.0}})
    timed = load_config(None, ["train.steps=3", "train.max_seconds=60"])
    assert not disk_space.steps_left(timed, {"step": 1, "spent": {"step_seconds": 61.0}})
    assert disk_space.steps_left(timed, {"step": 1})


def test_the_estimate_counts_the_files_a_load_reads(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    # A Hub snapshot with its shards and a second copy of the weights (Mistral's repos):
    # only what the index names is the model.
    shard = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}
    save_file(shard, tmp_path / "model-00001-of-00001.safetensors")
    save_file(
        {"layers.0.attention.wq.weight": torch.zeros(64, 32)}, tmp_path / "consolidated.safetensors"
    )
    weight_map = dict.fromkeys(shard, "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.target_modules=[q_proj]"])
    side = save_sizes.STATE_BYTES + (tmp_path / "model.safetensors.index.json").stat().st_size
    assert (
        disk_space.estimate_model_bytes(cfg, tmp_path)
        == 64 * 32 * 4 + save_sizes.ENTRY_BYTES + side
    )
    # A: 4 x 32, B: 64 x 4, float32, three copies; two tensors' header entries.
    assert disk_space.estimate_checkpoint_bytes(cfg, tmp_path) == (
        3 * 4 * (4 * 32 + 64 * 4) + 2 * save_sizes.TENSOR_BYTES + side
    )
