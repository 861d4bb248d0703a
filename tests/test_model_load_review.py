"""A model directory loaded whole, in one process (dapo.models.policy.load_policy: what dapo
train, dapo eval and dapo export --merge load with): a weight its files lack is refused, in
the sharded loader's words, where transformers initialised it at random and a run trained on
it; a truncated or garbled safetensors file is named with the fix, where a bare
SafetensorError traceback came. Tied heads and buffers still load (an imported GGUF model:
tests/test_smollm2.py)."""

import json
from pathlib import Path

import pytest
import torch
from helpers import ARCHS, save_model
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from dapo.cli import main
from dapo.config import load_config
from dapo.models import sharded_load
from dapo.models.demo import build_tokenizer
from dapo.models.policy import load_policy

INDEX = "model.safetensors.index.json"
FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
RESAVE = (
    "re-save the model with model.save_pretrained(DIR, safe_serialization=True) so that its "
    "files hold every weight, or check that config.json belongs to these weights"
)
REFETCH = (
    "a file is missing, truncated or damaged, as an interrupted download or copy leaves it: "
    "download the model again (a Hub model: delete its snapshot from the Hugging Face cache) "
    "or re-save it with model.save_pretrained(DIR, safe_serialization=True)"
)


def _save(path: Path, arch: str, *, tied: bool, files: int = 1) -> Path:
    """A tiny random model with the demo's tokenizer; ``files=2``: its tensors split over two
    files and an index, as a large model's are."""
    tok = build_tokenizer()
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model_cls(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    if files == 2:
        weights = load_file(path / "model.safetensors")
        names = sorted(weights)
        halves = {FIRST: names[::2], SECOND: names[1::2]}
        for file, part in halves.items():
            save_file({n: weights[n] for n in part}, path / file, metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {n: f for f, ns in halves.items() for n in ns}}
        (path / INDEX).write_text(json.dumps(index))
        (path / "model.safetensors").unlink()
    return path


def _load(path: Path):
    return load_policy(load_config(None, [f"model.path={path}"]), log=lambda _: None)


def _drop(file: Path, name: str) -> None:
    weights = load_file(file)
    del weights[name]
    save_file(weights, file, metadata={"format": "pt"})


def _sharded_loader_error(path: Path) -> str:
    """What the torchrun loader's reading of the files says about ``path`` (one process:
    the same fill_from_files, into an empty model that is not sharded)."""
    from transformers import AutoConfig

    model = sharded_load.empty_model(AutoConfig.from_pretrained(path), torch.float32)
    sharded_load.materialise(model, params_on=torch.device("cpu"), buffers_on=torch.device("cpu"))
    with pytest.raises(ValueError) as err:
        sharded_load.fill_from_files(model, sharded_load.weight_files(path), path)
    return str(err.value)


@pytest.mark.parametrize(
    "arch,tied,files",
    [("qwen2", True, 1), ("llama", True, 1), ("qwen2", False, 2), ("llama", False, 1)],
)
def test_whole_models_load_every_weight_from_their_files(tmp_path, arch, tied, files):
    path = _save(tmp_path / "m", arch, tied=tied, files=files)
    model, _ = _load(path)
    stored = {}
    for file in {FIRST, SECOND} if files == 2 else {"model.safetensors"}:
        stored |= load_file(path / file)
    params = dict(model.named_parameters())
    assert ("lm_head.weight" in stored) == (not tied)  # a tied head is stored once
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert set(params) == set(stored) - ({"lm_head.weight"} if tied else set())
    assert all(torch.equal(params[n], t) for n, t in stored.items() if n in params)


def test_the_helpers_saved_models_still_load(tmp_path):
    for arch in ("qwen2", "llama"):
        model, _ = _load(save_model(tmp_path / arch, arch))
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_missing_weight_is_refused_as_the_sharded_loader_refuses_it(tmp_path):
    path = save_model(tmp_path / "m", "qwen2")
    name = "model.layers.0.self_attn.q_proj.weight"
    _drop(path / "model.safetensors", name)
    with pytest.raises(ValueError) as err:
        _load(path)
    assert str(err.value) == (
        f"model.path={path}: the model built from its config.json has the weight {name}, but "
        f"model.safetensors does not hold it; {RESAVE}"
    )
    assert str(err.value) == _sharded_loader_error(path)


def test_a_weight_of_another_shape_is_named_with_the_fix(tmp_path):
    """A weight whose shape is not the config's gave transformers' RuntimeError traceback."""
    path = save_model(tmp_path / "m", "qwen2")
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        _load(path)
    message = str(err.value)
    assert message.startswith(
        f"model.path={path}: a weight in its files has another shape than the model its "
        "config.json builds ("
    )
    assert message.endswith(
        "); re-save the model with model.save_pretrained(DIR, safe_serialization=True), or "
        "check that config.json belongs to these weights"
    )


def test_a_weight_the_index_names_a_file_for_but_it_lacks(tmp_path):
    path = _save(tmp_path / "m", "llama", tied=False, files=2)
    file = json.loads((path / INDEX).read_text())["weight_map"]["lm_head.weight"]
    _drop(path / file, "lm_head.weight")
    with pytest.raises(ValueError) as err:
        _load(path)
    assert str(err.value) == (
        f"model.path={path}: the model built from its config.json has the weight "
        f"lm_head.weight, but {file} does not hold it (the file {INDEX} names for it); "
        f"{RESAVE}"
    )
    assert str(err.value) == _sharded_loader_error(path)
    # Dropped from the index too: the index names no file for it.
    index = json.loads((path / INDEX).read_text())
    del index["weight_map"]["lm_head.weight"]
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"lm_head.weight, but {INDEX} names no file for it"):
        _load(path)


def test_a_pickled_model_missing_a_weight_is_refused(tmp_path):
    path = save_model(tmp_path / "m", "qwen2")
    weights = load_file(path / "model.safetensors")
    del weights["model.norm.weight"]
    torch.save(weights, path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError) as err:
        _load(path)
    assert str(err.value) == (
        f"model.path={path}: the model built from its config.json has the weight "
        f"model.norm.weight, but its weights files do not hold it; {RESAVE}"
    )


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _garble_header(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:8] + b"{not json" + data[17:])


def _garbage(file: Path) -> None:
    file.write_bytes(b"\x00garbage" * 100)


@pytest.mark.parametrize("damage", [_truncate, _garbage, _garble_header])
def test_a_damaged_weights_file_is_named_with_the_fix(tmp_path, damage):
    path = save_model(tmp_path / "m", "qwen2")
    damage(path / "model.safetensors")
    with pytest.raises(SafetensorError) as raw:  # what safetensors says, in its version's words
        safe_open(str(path / "model.safetensors"), framework="pt")
    with pytest.raises(ValueError) as err:
        _load(path)
    assert str(err.value) == (
        f"model.path={path}: model.safetensors cannot be read ({raw.value}); {REFETCH}"
    )
    # The torchrun loader's listing of the files says the same.
    with pytest.raises(ValueError) as sharded:
        sharded_load.weight_files(path)
    assert str(sharded.value) == str(err.value)


def test_a_damaged_file_among_several_is_the_one_named(tmp_path):
    path = _save(tmp_path / "m", "qwen2", tied=False, files=2)
    _truncate(path / SECOND)
    with pytest.raises(ValueError) as err:
        _load(path)
    assert str(err.value).startswith(f"model.path={path}: {SECOND} cannot be read (Error ")
    assert str(err.value).endswith(REFETCH)
    with pytest.raises(ValueError) as sharded:
        sharded_load.check_weight_files(path)
    assert str(sharded.value) == str(err.value)


def test_an_unreadable_index_or_a_file_it_names_that_is_gone(tmp_path):
    path = _save(tmp_path / "m", "qwen2", tied=False, files=2)
    (path / SECOND).unlink()
    with pytest.raises(ValueError) as err:
        sharded_load.check_weight_files(path)
    assert str(err.value).startswith(f"model.path={path}: {SECOND} cannot be read (")
    (path / INDEX).write_text("{ not json")
    with pytest.raises(ValueError) as err:
        sharded_load.weight_files(path)
    assert str(err.value).startswith(f"model.path={path}: {INDEX} cannot be read (Expecting")
    assert str(err.value).endswith(REFETCH)


def test_train_and_eval_report_a_missing_weight_and_exit_2(tmp_path, capsys):
    path = save_model(tmp_path / "m", "qwen2")
    _drop(path / "model.safetensors", "model.layers.1.mlp.up_proj.weight")
    expected = f"dapo: error: model.path={path}: the model built from its config.json has"
    args = ["train", "--quiet", f"model.path={path}", "train.steps=1", "eval.every=0"]
    assert main([*args, f"run.out_dir={tmp_path}", "run.name=r"]) == 2
    assert expected in capsys.readouterr().err
    eval_args = ["eval", str(path), "--data", "arith", "--max-new-tokens", "28"]
    assert main([*eval_args, "--out", str(tmp_path / "e")]) == 2
    assert expected in capsys.readouterr().err
