"""LoRA (``model.lora``): adapters injected with peft, trained alone, checkpointed alone, merged
only into copies, exported as a peft adapter directory or merged."""

import copy
import json

import pytest
import torch
from helpers import TINY_DEMO
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dapo.cli import main
from dapo.config import LoraConfig, load_config
from dapo.models import lora
from dapo.run import checkpoint

pytest.importorskip("peft")

IDS = torch.arange(3, 30).reshape(1, -1)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _adapted(tiny_model, rank: int = 4, **settings) -> torch.nn.Module:
    model = lora.apply(copy.deepcopy(tiny_model), LoraConfig(rank=rank, **settings))
    with torch.no_grad():  # B starts at zero; a trained one is not
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_the_adapted_policy_starts_as_its_base(tiny_model):
    model = lora.apply(copy.deepcopy(tiny_model).to(torch.bfloat16), LoraConfig(rank=4))
    assert torch.equal(_logits(model), _logits(tiny_model.to(torch.bfloat16)))
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert all(p.dtype == torch.float32 for p in trained.values())  # on a bfloat16 base
    layers = len(tiny_model.model.layers)
    assert len(trained) == 2 * 7 * layers  # A and B of every attention and MLP Linear


def test_a_target_the_model_lacks_is_named(tiny_model):
    with pytest.raises(ValueError, match=r"\['c_attn'\] name no Linear layer.*'q_proj'"):
        lora.apply(copy.deepcopy(tiny_model), LoraConfig(rank=4, target_modules=["c_attn"]))


def test_merged_weights_compute_what_the_adapters_do_and_leave_the_policy(tiny_model):
    model = _adapted(tiny_model)
    before = {n: p.clone() for n, p in model.named_parameters()}
    plain = copy.deepcopy(tiny_model)
    plain.load_state_dict(lora.merged_weights(model))
    torch.testing.assert_close(_logits(plain), _logits(model), rtol=0, atol=1e-5)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # W + (alpha / r) B A, by hand, for one layer.
    q = model.model.layers[0].self_attn.q_proj
    hand = q.base_layer.weight + 32.0 / 4 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    merged = lora.merged_weights(model)["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(merged, hand, rtol=0, atol=1e-6)


def test_adapters_off_is_the_base_and_trains_again_after(tiny_model):
    model = _adapted(tiny_model)
    assert not torch.equal(_logits(model), _logits(tiny_model))
    with lora.adapters_off(model):
        assert torch.equal(_logits(model), _logits(tiny_model))
    assert not torch.equal(_logits(model), _logits(tiny_model))
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


def test_many_updates_never_move_the_base(tiny_model):
    """The policy's frozen weights are never merged into and out of: after 200 updates they
    are bitwise the base's, and the merged copy is exactly W + scale B A of the adapters."""
    model = _adapted(tiny_model, rank=2)
    base = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    copy_for_engine = copy.deepcopy(tiny_model)
    for _ in range(200):
        optimizer.zero_grad()
        model(IDS, labels=IDS).loss.backward()
        optimizer.step()
        copy_for_engine.load_state_dict(lora.merged_weights(model))  # every sync
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    torch.testing.assert_close(_logits(copy_for_engine), _logits(model), rtol=0, atol=1e-4)


def test_the_optimizer_holds_the_adapters_alone(tiny_model):
    from dapo.models.demo import build_tokenizer
    from dapo.reward.tasks import arith
    from dapo.training.state import build_state

    cfg = load_config(None, ["model.lora.rank=4", "model.device=cpu", "run.preset=grpo"])
    model = lora.apply(copy.deepcopy(tiny_model), cfg.model.lora)
    problems = [p for p, _ in arith.make_splits(4, 1, seed=0)[0]]
    state = build_state(cfg, model, build_tokenizer(), problems)
    params = [p for g in state.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in params} == {id(p) for p in model.parameters() if p.requires_grad}
    # GRPO's KL reference: the policy with its adapters off, no copy of it.
    assert state.ref_model is None and state.has_reference
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)
    with state.reference() as reference:
        assert reference is model
        assert torch.equal(_logits(reference), _logits(tiny_model))
    assert not torch.equal(_logits(model), _logits(tiny_model))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, demo_cache):
    """A LoRA run of 3 steps on the demo's warm-started model (GRPO's KL term on), a
    checkpoint a step, the same run stopped after 2 steps and resumed, and its base model
    saved as a directory."""
    from dapo.models.policy import load_policy
    from dapo.training.inputs import load_run_data

    root = tmp_path_factory.mktemp("lora")
    settings = [*TINY_DEMO, f"embedded.cache_dir={demo_cache}", "model.lora.rank=4"]
    settings += ["train.save_every=1", "eval.num_samples=0", "eval.every=0", "run.threads=1"]
    settings += ["algo.kl_coef=0.01", f"run.out_dir={root}"]
    assert main(["train", "--quiet", *settings, "train.steps=3", "run.name=whole"]) == 0
    assert main(["train", "--quiet", *settings, "train.steps=2", "run.name=cut"]) == 0
    assert main(["train", "--quiet", "--resume", str(root / "cut"), "train.steps=3"]) == 0
    cfg = load_config(None, [*settings, "model.lora.rank=0", "model.device=cpu"])
    base, tokenizer = load_policy(cfg, load_run_data(cfg).warmup_pairs, log=lambda m: None)
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    return root, root / "base"


@pytest.mark.parametrize("revision", [None, "v1.2"])
def test_an_exported_adapter_names_its_base_at_the_run_revision(tmp_path, revision):
    from peft import PeftConfig

    from dapo.api.adapters import adapter_files

    pinned = [f"model.revision={revision}"] if revision else []
    cfg = load_config(None, ["model.lora.rank=4", "model.path=org/base", *pinned])
    trained = {"model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 8)}
    tensors, config = adapter_files(cfg, trained)
    assert list(tensors) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    read = PeftConfig.from_pretrained(tmp_path)  # what peft fetches the base model by
    assert (read.base_model_name_or_path, read.revision) == ("org/base", revision)


def test_a_checkpoint_holds_the_adapters_and_names_its_base(lora_run):
    root, base = lora_run
    ckpt = root / "whole" / "checkpoints" / "step_000003"
    saved = load_file(ckpt / "model" / checkpoint.model_files.TRAINED_FILE)
    assert saved and all(".lora_A." in n or ".lora_B." in n for n in saved)
    assert not list((ckpt / "model").glob("model*.safetensors"))  # no base weights
    optimizer = load_file(ckpt / "optimizer.safetensors")
    assert len({k.split("/")[0] for k in optimizer}) == len(saved)  # state of adapters only
    trainer = json.loads((ckpt / "trainer.json").read_text())
    assert trainer["base_model"]["path"] == "embedded" and trainer["base_model"]["sha256"]
    # The adapters learned: B moved away from zero.
    assert any(float(t.abs().max()) > 0 for n, t in saved.items() if ".lora_B." in n)


def test_a_lora_run_resumes_exactly(lora_run):
    root, _ = lora_run
    whole = (root / "whole" / "metrics.jsonl").read_text().splitlines()
    cut = (root / "cut" / "metrics.jsonl").read_text().splitlines()
    drop = ("perf/", "val/")  # times; the cut run evaluated at its end

    def strip(line: str) -> dict:
        return {k: v for k, v in json.loads(line).items() if not k.startswith(drop)}

    assert [strip(x) for x in whole] == [strip(x) for x in cut]
    name = checkpoint.model_files.TRAINED_FILE
    a = load_file(root / "whole" / "checkpoints" / "step_000003" / "model" / name)
    b = load_file(root / "cut" / "checkpoints" / "step_000003" / "model" / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_run_model_is_merged_and_exports_both_ways(lora_run, tmp_path):
    from peft import PeftModel

    root, base = lora_run
    final = AutoModelForCausalLM.from_pretrained(root / "whole" / "model")
    assert not torch.equal(_logits(final), _logits(AutoModelForCausalLM.from_pretrained(base)))
    assert main(["export", str(root / "whole"), "--out", str(tmp_path / "m"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(_logits(merged), _logits(final), rtol=0, atol=1e-6)
    assert main(["export", str(root / "whole"), "--out", str(tmp_path / "a")]) == 0
    assert not (tmp_path / "a" / "config.json").exists()
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 32.0
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "a")
    torch.testing.assert_close(_logits(adapted), _logits(final), rtol=0, atol=1e-5)
    args = ["--data", "arith", "--k", "1", "--num-problems", "2", "--max-new-tokens", "4"]
    assert main(["eval", str(tmp_path / "m"), *args, "--out", str(tmp_path / "e")]) == 0


def test_an_earlier_step_exports_with_the_lora_settings_it_was_trained_with(
    lora_run, tmp_path, capsys
):
    """A resume with --force model.lora.alpha=64 leaves step 3's adapters trained at 32: its
    merge must scale them by 32 / r (merged at 64, the logits were off by several units)."""
    import shutil

    root, _ = lora_run
    run = tmp_path / "run"
    shutil.copytree(root / "whole", run)
    args = ["--resume", str(run), "--force", "train.steps=4", "model.lora.alpha=64"]
    assert main(["train", "--quiet", *args]) == 0
    capsys.readouterr()
    assert main(["export", str(run), "--step", "3", "--out", str(tmp_path / "m"), "--merge"]) == 0
    assert "trained with model.lora alpha=32.0 (config.yaml: 64.0): used" in capsys.readouterr().err
    final = AutoModelForCausalLM.from_pretrained(root / "whole" / "model")  # step 3's policy
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(_logits(merged), _logits(final), rtol=0, atol=1e-6)
    assert main(["export", str(run), "--step", "3", "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["lora_alpha"] == 32
    step4 = json.loads((run / "checkpoints" / "step_000004" / "trainer.json").read_text())
    assert step4["base_model"]["lora"]["alpha"] == 64.0


@pytest.mark.parametrize(
    ("lora_record", "says"),
    [
        ({"rank": 4}, "base_model.lora is not {rank, alpha, dropout, target_modules}"),
        ({"rank": "4", "alpha": 32.0, "dropout": 0.0, "target_modules": ["q_proj"]}, "rank"),
        ({"rank": 4, "alpha": -1.0, "dropout": 0.0, "target_modules": ["q_proj"]}, "alpha"),
    ],
)
def test_a_crafted_lora_record_is_refused(lora_record, says, tmp_path):
    from dapo.api.adapters import with_trained_settings
    from dapo.run.model_files import CheckpointError

    cfg = load_config(None, ["model.lora.rank=4"])
    with pytest.raises(CheckpointError, match="base_model.lora") as info:
        with_trained_settings(cfg, {"lora": lora_record}, tmp_path, print)
    assert says in str(info.value)


def test_a_resume_on_another_base_is_refused(lora_run, tmp_path, capsys):
    import shutil

    root, _ = lora_run
    run = tmp_path / "run"
    shutil.copytree(root / "whole", run)
    # Another warm-start makes other base weights; --force takes the changed setting.
    args = ["--resume", str(run), "--force", "train.steps=4", "embedded.sft_steps=20"]
    assert main(["train", "--quiet", *args]) == 1
    err = capsys.readouterr().err
    assert "trained adapters on model.path=embedded" in err
    assert "resume with the same base model" in err
    # The same embedded base in another dtype digests otherwise (it has no files): the fix
    # names the dtype the adapters trained on, not another base.
    bf16 = ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16"]
    bf16.append("train.recompute_old_logprobs=true")  # bfloat16's log-probs need it
    assert main(["train", "--quiet", "--resume", str(run), "--force", *bf16]) == 1
    assert "resume with model.param_dtype=float32, the dtype its" in capsys.readouterr().err
