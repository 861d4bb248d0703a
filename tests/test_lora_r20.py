"""Round 20's fixes to merged LoRA models and model loading: a bfloat16 base's merge kept in
float32 (what was trained), an adapted tied ``lm_head`` saved apart from the embeddings (one
process, torchrun, ``dapo export --merge``) and refused when a tied config hides it, the
model's own dropout turned off, and four clearer refusals (model code, pickled shards, a Hub
repository without safetensors)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import dapo_train, logged_metrics, save_model
from safetensors.torch import load_file, save_file
from test_hub_models import lay_out, offline_cache  # noqa: F401 (a fixture)
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from dapo.api import exporting
from dapo.config import LoraConfig, load_config
from dapo.models import dropout, lora, policy, sharded_load
from dapo.models.demo import build_tokenizer

pytest.importorskip("peft")

IDS = torch.tensor([[3, 5, 7, 9, 11, 13, 2, 4, 6, 8]])
REWARD = "def score(response, ground_truth):\n    return float(len(response) % 5) / 4.0\n"
"""Rewards that differ within a group whatever the tiny model says, so every step trains."""


def _run_settings(root: Path, model: Path, name: str, *extra: str) -> list[str]:
    (root / "reward.py").write_text(REWARD)
    return [
        f"model.path={model}",
        "rollout.group_size=4",
        "rollout.max_new_tokens=12",
        "algo.l_cache=4",
        "train.prompts_per_step=2",
        "train.responses_per_minibatch=4",
        "train.save_every=1",
        "sampling.dynamic=false",
        "eval.num_samples=0",
        "eval.every=0",
        "reward.workers=0",
        "run.threads=1",
        "dist.timeout_s=60",
        f"reward.function={root / 'reward.py'}:score",
        f"run.name={name}",
        *extra,
    ]


def _logits(directory: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model(IDS).logits


# ----------------------------------------------------------------- a bfloat16 base, merged


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """A LoRA run (rank 8: alpha / r = 4) on a bfloat16 base, its stdout."""
    root = tmp_path_factory.mktemp("bf16")
    base = save_model(root / "base", "llama")
    args = _run_settings(root, base, "bfl", "model.lora.rank=8", "optim.lr=1e-3")
    args += ["train.steps=2", "model.param_dtype=bfloat16", "model.compute_dtype=bfloat16"]
    out = dapo_train(0, *args, "train.recompute_old_logprobs=true", out_dir=root)
    return root, base, out


def _by_hand(base: Path, run: Path, scale: float) -> dict[str, torch.Tensor]:
    """What the run trained: each bfloat16 base weight in float32, plus scale B A of its
    adapters (float32), computed as the formula reads."""
    trained = load_file(run / "checkpoints" / "step_000002" / "model" / "trained.safetensors")
    assert any(float(t.abs().max()) > 0 for n, t in trained.items() if ".lora_B." in n)
    out = {}
    for name, w in load_file(base / "model.safetensors").items():
        w = w.to(torch.bfloat16).float()
        layer = name.removesuffix(".weight")
        if f"{layer}.lora_A.default.weight" in trained:
            b = trained[f"{layer}.lora_B.default.weight"]
            w = w + scale * (b @ trained[f"{layer}.lora_A.default.weight"])
        out[name] = w
    return out


def _same(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name


def test_a_bfloat16_bases_final_model_is_the_float32_merge_exactly(bf16_run):
    root, base, out = bf16_run
    run = root / "bfl"
    _same(load_file(run / "model" / "model.safetensors"), _by_hand(base, run, 4.0))
    assert json.loads((run / "model" / "config.json").read_text())["dtype"] == "float32"
    assert (
        f"model/: float32, the trained policy exactly (the base is bfloat16, the adapters were "
        f"trained unmerged in float32); `dapo export {run} --merge --dtype bfloat16 --out DIR` "
        "writes a copy half the size, rounded"
    ) in out


@pytest.mark.parametrize("dtype", [None, "float32", "bfloat16"])
def test_export_merge_of_a_bfloat16_base_merges_in_float32(bf16_run, tmp_path, dtype):
    root, base, _ = bf16_run
    said: list[str] = []
    exporting.export(root / "bfl", tmp_path / "m", dtype=dtype, merge=True, log=said.append)
    expected = _by_hand(base, root / "bfl", 4.0)
    if dtype == "bfloat16":  # rounded once, at the end
        expected = {k: v.to(torch.bfloat16) for k, v in expected.items()}
    _same(load_file(tmp_path / "m" / "model.safetensors"), expected)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["dtype"] == (dtype or "float32")
    assert config["tie_word_embeddings"] is True  # lm_head was not adapted: one tensor
    widened = [line for line in said if "merged in float32" in line]
    assert widened == (
        []
        if dtype
        else [
            "export: merged in float32, the trained policy exactly (the base is bfloat16, the "
            "adapters were trained unmerged in float32); --dtype bfloat16 writes a copy half the "
            "size, rounded"
        ]
    )


def test_a_float32_merge_is_still_the_policys_own_dtype(tiny_model):
    model = lora.apply(copy.deepcopy(tiny_model), LoraConfig(rank=4))
    merged = lora.merged_weights(model)
    assert {t.dtype for t in merged.values()} == {torch.float32}
    # A tied head stays one tensor when widened, so save_pretrained stores it once.
    half = lora.apply(tiny_model.to(torch.bfloat16), LoraConfig(rank=4))
    widened = lora.merged_weights(half)
    assert widened["lm_head.weight"] is widened["model.embed_tokens.weight"]
    assert {t.dtype for t in widened.values()} == {torch.float32}


# ------------------------------------------------------------ an adapted tied lm_head


@pytest.fixture(scope="module")
def head_runs(tmp_path_factory):
    """LoRA on the tied lm_head alone, in one process and on two torchrun ranks."""
    root = tmp_path_factory.mktemp("lmhead")
    base = save_model(root / "base", "llama")
    args = ["model.lora.rank=4", "model.lora.target_modules=[lm_head]", "optim.lr=5e-2"]
    args += ["train.steps=3", "train.recompute_old_logprobs=true"]
    dapo_train(0, *_run_settings(root, base, "one", *args), out_dir=root)
    dapo_train(2, *_run_settings(root, base, "two", *args), out_dir=root)
    return root, base


def test_an_adapted_head_is_saved_apart_under_torchrun_as_in_one_process(head_runs, tmp_path):
    root, base = head_runs
    for run in ("one", "two"):
        saved = load_file(root / run / "model" / "model.safetensors")
        assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
        config = json.loads((root / run / "model" / "config.json").read_text())
        assert config["tie_word_embeddings"] is False, run
    one, two = _logits(root / "one" / "model"), _logits(root / "two" / "model")
    assert float((one - _logits(base)).abs().max()) > 1e-2  # the head learned
    torch.testing.assert_close(two, one, rtol=0, atol=1e-4)  # summed in another order
    exporting.export(root / "two", tmp_path / "m", merge=True, log=lambda _: None)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["tie_word_embeddings"] is False
    torch.testing.assert_close(_logits(tmp_path / "m"), two, rtol=0, atol=1e-5)


def _tied_files(tmp_path: Path, head_shift: float) -> Path:
    """A tied llama whose file holds lm_head beside the embeddings, ``head_shift`` apart."""
    path = save_model(tmp_path / "m", "llama")
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + head_shift
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _fill(path: Path) -> torch.nn.Module:
    model = sharded_load.empty_model(AutoConfig.from_pretrained(path), torch.float32)
    sharded_load.materialise(model, params_on=torch.device("cpu"), buffers_on=torch.device("cpu"))
    sharded_load.fill_from_files(model, sharded_load.weight_files(path), path)
    return model


def test_a_tied_config_over_two_different_tensors_is_refused(tmp_path):
    path = _tied_files(tmp_path, 1.0)
    with pytest.raises(ValueError) as err:
        _fill(path)
    assert str(err.value) == (
        f"model.path={path}: config.json ties model.embed_tokens.weight and lm_head.weight "
        "(tie_word_embeddings), but model.safetensors hold two different tensors under those "
        "names (a head trained apart from the embeddings, as LoRA on lm_head gives); tying "
        'them would silently drop one. Set "tie_word_embeddings": false in its config.json '
        "to load both as they are"
    )
    same = _fill(_tied_files(tmp_path / "same", 0.0))  # stored twice alike: loads
    stored = load_file(tmp_path / "same" / "m" / "model.safetensors")
    assert torch.equal(same.lm_head.weight, stored["model.embed_tokens.weight"])


# -------------------------------------------------------------------- the model's dropout


def _gpt2(path: Path) -> Path:
    """A tiny GPT-2 with its config's dropout (attn/resid/embd_pdrop 0.1), saved."""
    tok = build_tokenizer()
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=512,
        vocab_size=len(tok),
        bos_token_id=tok.eos_token_id,
        **ids,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
    """GPT-2 (dropout 0.1 in its config), one update a step, padded and packed."""
    root = tmp_path_factory.mktemp("gpt2")
    model = _gpt2(root / "gpt2")
    outs = {}
    for packing in ("false", "true"):
        args = _run_settings(root, model, f"pk_{packing}", f"train.packing={packing}")
        args += ["train.steps=2", "optim.lr=1e-2", "train.responses_per_minibatch=8"]
        outs[packing] = dapo_train(0, *args, "train.recompute_old_logprobs=true", out_dir=root)
    return root, outs


def test_an_on_policy_update_of_gpt2_has_ratio_one_and_packing_changes_nothing(gpt2_runs):
    root, outs = gpt2_runs
    padded, packed = logged_metrics(root / "pk_false"), logged_metrics(root / "pk_true")
    first = next(r for r in padded if r["step"] == 1)
    assert first["train/loss"] == 0.0  # ratio 1, group advantages summing to zero
    for a, b in zip(padded, packed, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), a["step"]
    wa = load_file(root / "pk_false" / "model" / "model.safetensors")
    wb = load_file(root / "pk_true" / "model" / "model.safetensors")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 2e-5
    note = (
        "dropout: off in the policy (attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1, "
        "summary_first_dropout=0.1; now 0)"
    )
    assert note in outs["false"] and note in outs["true"]


def test_dropout_is_turned_off_but_loras_own_is_kept(tmp_path, tiny_model):
    model = GPT2LMHeadModel.from_pretrained(_gpt2(tmp_path / "gpt2"))
    assert dropout.disable(model).startswith("dropout: off in the policy (attn_pdrop=0.1,")
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert model.config.attn_pdrop == 0 and dropout.disable(model) is None
    lora.apply(model, LoraConfig(rank=2, dropout=0.05, target_modules=["lm_head"]))
    assert dropout.disable(model) is None
    kept = [m.p for n, m in model.named_modules() if "lora_dropout" in n and hasattr(m, "p")]
    assert kept and all(p == 0.05 for p in kept)
    assert dropout.disable(tiny_model) is None  # the demo's Qwen2: nothing to turn off


# ---------------------------------------------------------------- clearer refusals


def test_a_model_with_code_of_its_own_is_refused_in_one_line(tmp_path, capsys):
    from dapo.cli import main

    path = save_model(tmp_path / "remote", "llama")
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="evilmodel", auto_map={"AutoConfig": "modeling_evil.EvilConfig"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "modeling_evil.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w')\n")
    message = (
        f"model.path={path}: its model_type 'evilmodel' is unknown to transformers and dapo "
        "runs no model code (config.json's auto_map names code that came with the model); "
        "give a model of an architecture transformers has (a newer transformers may have "
        "this one)"
    )
    cfg = load_config(None, [f"model.path={path}"])
    for check in (policy.context_length, policy.check_model_path):
        with pytest.raises(ValueError) as err:
            check(cfg)
        assert str(err.value) == message
    capsys.readouterr()  # the model's saving
    assert main(["train", f"model.path={path}", f"run.out_dir={tmp_path}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == f"dapo: error: {message}\n"
    assert not (tmp_path / "RAN").exists()


class Payload:
    """Unpickled, it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_only_the_refused_shard_of_pickled_weights_is_named(tmp_path):
    path = save_model(tmp_path / "m", "llama")
    weights = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    files = {
        "pytorch_model-00001-of-00002.bin": names[:3],
        "pytorch_model-00002-of-00002.bin": names[3:],
    }
    for i, (file, part) in enumerate(files.items()):
        shard: dict = {n: weights[n] for n in part}
        if i == 1:
            shard["evil"] = Payload(tmp_path / "PWNED")
        torch.save(shard, path / file)
    weight_map = {n: f for f, part in files.items() for n in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as err:
        policy.load_policy(load_config(None, [f"model.path={path}"]), log=lambda _: None)
    assert str(err.value).startswith(
        f"model.path={path}: pytorch_model-00002-of-00002.bin is a pickle holding more than "
        "tensors; torch's safe loader refused it,"
    )
    assert not (tmp_path / "PWNED").exists()


def test_a_hub_model_without_safetensors_is_named_with_the_fix(tmp_path, offline_cache):  # noqa: F811
    path = save_model(tmp_path / "m", "llama")
    (path / "model.safetensors").unlink()  # what dapo fetches of a repo with .bin weights only
    lay_out(offline_cache, "org/bin-only", path)
    cfg = load_config(None, ["model.path=org/bin-only", "model.device=cpu"])
    with pytest.raises(ValueError) as err:
        policy.load_policy(cfg, log=lambda _: None)
    assert str(err.value) == (
        "model.path=org/bin-only: no weights dapo can read; dapo fetches only safetensors "
        "weights (*.safetensors) from the Hub, never pickled ones (*.bin), and this repository "
        "seems to have none. Convert its weights to safetensors locally, from a copy you trust "
        "(torch.load(FILE, weights_only=False), load them into the model, "
        "model.save_pretrained(DIR, safe_serialization=True)) and give model.path=DIR, or give "
        "a model.revision that has .safetensors files"
    )
