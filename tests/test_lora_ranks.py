"""LoRA under torchrun: the base loaded straight into frozen FSDP2 shards, adapters trained and
checkpointed alone (DCP), the same run as in one process, resumed at another world size."""

import json

import pytest
import torch
from helpers import TINY_DEMO, dapo_train
from safetensors import safe_open
from safetensors.torch import load_file

from dapo.api import exporting
from dapo.config import load_config

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_cache):
    """A saved base (the demo's warm-started model), and LoRA runs on it: one process, two
    ranks, two ranks for 2 steps resumed in one process for the third, and two ranks that
    generate together from a tensor-parallel copy (``rollout.tp_size=2``)."""
    from dapo.models.policy import load_policy
    from dapo.training.inputs import load_run_data

    root = tmp_path_factory.mktemp("lora-ranks")
    cfg = load_config(None, [*TINY_DEMO, f"embedded.cache_dir={demo_cache}"])
    base, tokenizer = load_policy(cfg, load_run_data(cfg).warmup_pairs, log=lambda m: None)
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    settings = [*TINY_DEMO, f"model.path={root / 'base'}", "model.lora.rank=4", "train.steps=3"]
    settings += ["train.save_every=1", "eval.num_samples=2", "eval.every=3", "run.threads=1"]
    settings += ["algo.kl_coef=0.01", "dist.timeout_s=60"]
    dapo_train(0, *settings, "run.name=one", out_dir=root)
    dapo_train(2, *settings, "run.name=two", out_dir=root)
    dapo_train(2, *settings, "train.steps=2", "run.name=cut", out_dir=root)
    dapo_train(2, *settings, "rollout.tp_size=2", "run.name=tp", out_dir=root)
    dapo_train(0, "--resume", str(root / "cut"), "train.steps=3", out_dir=root)
    return root


def _lines(run) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "val/"))} for r in rows]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert gap <= atol, gap


def _same_lines(a: list[dict], b: list[dict]) -> None:
    """The same steps and figures, up to the order ranks sum them in (float32). The sampler's
    log-prob gap is itself float rounding (~1e-6, the engine's and the trainer's forward of the
    same weights), so the summation order moves it by its own size: it gets an absolute bound."""
    assert [r.keys() for r in a] == [r.keys() for r in b]
    for x, y in zip(a, b, strict=True):
        gap = "train/sampler_logprob_gap"
        if gap in x or gap in y:
            assert abs(x.pop(gap) - y.pop(gap)) <= 1e-5, x["step"]
        assert x == pytest.approx(y, rel=1e-5, abs=1e-7), x["step"]


def test_two_ranks_train_the_adapters_as_one_process(runs):
    _same_lines(_lines(runs / "two"), _lines(runs / "one"))
    _same_lines(_lines(runs / "cut"), _lines(runs / "one"))  # 2 ranks, then 1 process
    _close(
        load_file(runs / "two" / "model" / "model.safetensors"),
        load_file(runs / "one" / "model" / "model.safetensors"),
    )
    _close(
        load_file(runs / "cut" / "model" / "model.safetensors"),
        load_file(runs / "one" / "model" / "model.safetensors"),
    )


def test_a_tensor_parallel_rollout_trains_the_adapters_as_one_process(runs):
    """The native engine's copy split over 2 ranks, filled with the merged weights after
    every update, draws what one process draws from its merged copy."""
    _same_lines(_lines(runs / "tp"), _lines(runs / "one"))
    _close(
        load_file(runs / "tp" / "model" / "model.safetensors"),
        load_file(runs / "one" / "model" / "model.safetensors"),
    )


def test_the_dcp_checkpoint_holds_the_adapters_alone_and_exports(runs, tmp_path):
    ckpt = runs / "two" / "checkpoints" / "step_000003"
    names = []
    for shard in (ckpt / "state").glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names += [n for n in f.keys() if n.startswith("model.")]  # noqa: SIM118
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert json.loads((ckpt / "trainer.json").read_text())["base_model"]["sha256"]
    for how in ({}, {"merge": True}):
        exporting.export(runs / "two", tmp_path / f"two{len(how)}", log=lambda m: None, **how)
        exporting.export(runs / "one", tmp_path / f"one{len(how)}", log=lambda m: None, **how)
    _close(
        load_file(tmp_path / "two0" / "adapter_model.safetensors"),
        load_file(tmp_path / "one0" / "adapter_model.safetensors"),
    )
    _close(
        load_file(tmp_path / "two1" / "model.safetensors"),
        load_file(runs / "two" / "model" / "model.safetensors"),
        atol=0,
    )


def test_generating_ahead_moves_the_adapters_alone(runs):
    """With train.async_staleness=1 the generator (a thread, or a rank of its own) samples
    from weights one step old, refreshed with the adapters alone: the thread and the
    generator rank draw the same rollouts and train the same adapters."""
    settings = [*TINY_DEMO, f"model.path={runs / 'base'}", "model.lora.rank=4", "train.steps=3"]
    settings += ["eval.num_samples=0", "eval.every=0", "run.threads=1", "dist.timeout_s=60"]
    settings += ["train.async_staleness=1"]
    dapo_train(0, *settings, "run.name=thread", out_dir=runs)
    dapo_train(2, *settings, "dist.rollout_ranks=1", "run.name=rank", out_dir=runs)
    _same_lines(_lines(runs / "rank"), _lines(runs / "thread"))
    _close(
        load_file(runs / "rank" / "model" / "model.safetensors"),
        load_file(runs / "thread" / "model" / "model.safetensors"),
    )
