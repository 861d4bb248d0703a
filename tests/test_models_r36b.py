"""Review r36b: ``--base`` replaces a Hub base's revision too; ``dapo model import X .`` into an
empty working directory; a local file as a model is named as a file (a GGUF file pointed to
``dapo model import``), not looked up on the Hub; an export into the run's own checkpoints is
refused; a tokenizer that is code of its own is refused as model code is."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import save_model
from safetensors.torch import load_file
from test_hub_models import lay_out, offline_cache  # noqa: F401 (a fixture)

from dapo.cli import main
from dapo.config import load_config
from dapo.models import hub
from dapo.models.policy import check_model_path, load_tokenizer

REWARD = "def score(response, ground_truth):\n    return float(len(response) % 5) / 4.0\n"


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory) -> Path:
    """A 1-step LoRA run on the Hub id ``org/tiny`` at ``model.revision=main`` (an offline
    cache laid out in ``ROOT/hub``), a checkpoint saved; the base's files in ``ROOT/base``."""
    from huggingface_hub import constants

    root = tmp_path_factory.mktemp("hub-lora")
    base = save_model(root / "base", "llama")
    lay_out(root / "hub", "org/tiny", base)
    (root / "reward.py").write_text(REWARD)
    settings = [
        "model.path=org/tiny", "model.revision=main", "model.lora.rank=4",
        "rollout.group_size=4", "rollout.max_new_tokens=8", "algo.l_cache=4",
        "train.prompts_per_step=2", "train.responses_per_minibatch=4", "train.save_every=1",
        "sampling.dynamic=false", "eval.num_samples=0", "eval.every=0", "reward.workers=0",
        "run.threads=1", f"reward.function={root / 'reward.py'}:score", "train.steps=1",
        "optim.lr=1e-2", f"run.out_dir={root}", "run.name=run",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(root / "hub"))
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        assert main(["train", "--quiet", *settings]) == 0
    return root


def test_base_replaces_the_runs_hub_revision_with_its_path(hub_run, tmp_path, capsys):
    """The run's base was ``org/tiny`` at ``main``, gone from the cache since: ``--base DIR``
    merged into DIR (its digest checked), not refused for ``model.revision=main`` on a local
    path."""
    from huggingface_hub import constants

    empty = tmp_path / "other-cache"
    empty.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(empty))
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        out = tmp_path / "merged"
        assert main(["export", str(hub_run / "run"), "--merge", "--out", str(out)]) == 2
        said = capsys.readouterr().err
        assert "--merge: the adapters' base: model.path=org/tiny at revision main" in said
        assert "give that model with --base MODEL" in said
        args = ["--merge", "--base", str(hub_run / "base"), "--out", str(out)]
        assert main(["export", str(hub_run / "run"), *args]) == 0
    said = capsys.readouterr().err
    assert "model.revision" not in said
    merged, final = (
        load_file(out / "model.safetensors"),
        load_file(hub_run / "run" / "model" / "model.safetensors"),
    )
    assert merged.keys() == final.keys()
    assert all(torch.equal(merged[k], final[k]) for k in merged)


def test_an_out_inside_the_runs_checkpoints_is_refused(hub_run, tmp_path, capsys):
    """An export into a checkpoint left it not whole (its manifest lists no export files):
    the next export or resume passed over it. Refused, through a link to the run too."""
    run = hub_run / "run"
    root = (run / "checkpoints").resolve()
    step = root / "step_000001"
    before = sorted(p.name for p in step.iterdir())
    link = tmp_path / "run-link"
    link.symlink_to(run)
    for out in (step / "export", link / "checkpoints" / "step_000001" / "x", root / "new"):
        assert main(["export", str(run), "--out", str(out)]) == 2
        said = capsys.readouterr().err
        assert said == (
            f"dapo: error: --out {out} is inside the run's checkpoints/ ({root}): files "
            "written there make its checkpoint not whole (the next export or resume passes "
            f"over it); give an --out outside {root}\n"
        )
    assert sorted(p.name for p in step.iterdir()) == before and not (root / "new").exists()
    assert main(["export", str(run), "--out", str(run / "export")]) == 0  # the run's own dir
    assert "passed over" not in capsys.readouterr().err


def _gguf(path: Path) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_import_into_the_empty_working_directory(
    tmp_path, monkeypatch, tiny_model, tokenizer
):
    """``dapo model import smollm2 .`` in an empty directory converted for a minute, then
    failed (``OSError: [Errno 22] Invalid argument: '.'``): its partial directory was made
    inside ``.`` (``Path('.').parent`` is ``.``)."""
    from dapo.models import gguf as gguf_mod

    source = _gguf(tmp_path / "m.gguf")
    monkeypatch.setattr(gguf_mod, "load_model", lambda path: tiny_model)
    monkeypatch.setattr(gguf_mod, "load_tokenizer", lambda path, eos: tokenizer)
    here = tmp_path / "models" / "here"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    said: list[str] = []
    summary = gguf_mod.import_gguf(str(source), Path("."), log=said.append)
    assert summary.out_dir == here
    assert (here / "config.json").is_file() and (here / "model.safetensors").is_file()
    assert os.listdir(tmp_path / "models") == ["here"]  # no partial directory left
    assert Path.cwd() == here and (Path(".") / "config.json").is_file()  # the new one
    assert said[-1] == f"  {here} was the working directory: `cd .` in your shell to see its files"


def test_an_out_dir_a_mount_point_is_refused_before_the_conversion(tmp_path, monkeypatch):
    """Its rmdir, after the conversion's minute, would fail (EBUSY): refused first."""
    from dapo.models import gguf as gguf_mod

    def converted(*_a):
        raise AssertionError("converted")

    source = _gguf(tmp_path / "m.gguf")
    out = tmp_path / "mnt"
    out.mkdir()
    monkeypatch.setattr(gguf_mod, "load_model", converted)
    monkeypatch.setattr(gguf_mod, "load_tokenizer", converted)
    monkeypatch.setattr(gguf_mod.os.path, "ismount", lambda p: Path(p) == out)
    with pytest.raises(ValueError) as refused:
        gguf_mod.import_gguf(str(source), out, log=lambda m: None)
    assert str(refused.value) == (
        f"{out} is a mount point: dapo model import renames a new directory into OUT_DIR's "
        f"place, which a mount point cannot be; give a directory inside it ({out / 'model'})"
    )
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", "mnt"]


def test_a_local_file_is_named_as_a_file_not_looked_up_on_the_hub(
    tmp_path,
    monkeypatch,
    capsys,
    offline_cache,  # noqa: F811
):
    """``model.path=smolcopy.gguf`` and ``dapo eval smol/model.safetensors`` were Hub ids:
    "no such local directory, and the Hub model is not in the Hugging Face cache"."""
    monkeypatch.chdir(tmp_path)
    Path("smolcopy.gguf").write_bytes(b"GGUF")
    save_model(tmp_path / "smol", "llama", tokenizer=False)
    gguf_fix = "import it first, `dapo model import {0} OUT_DIR`, and give OUT_DIR"
    cases = {
        "smolcopy.gguf": "a GGUF file, not a model directory: " + gguf_fix.format("smolcopy.gguf"),
        str(tmp_path / "smolcopy.gguf"): "a GGUF file, not a model directory: "
        + gguf_fix.format(tmp_path / "smolcopy.gguf"),
        "smol/model.safetensors": "a file, not a model directory: give its directory, "
        "model.path=smol",
    }
    for path, why in cases.items():
        with pytest.raises(ValueError) as refused:
            check_model_path(load_config(None, [f"model.path={path}"]))
        assert str(refused.value) == f"model.path={path} is {why}"
    alone = tmp_path / "w.safetensors"
    alone.write_bytes(b"")
    assert hub.file_refusal(str(alone)) == (
        f"model.path={alone} is a file, not a model directory: give the directory that holds "
        "the model's config.json, weights and tokenizer"
    )
    assert main(["eval", "smol/model.safetensors", "--data", "arith"]) == 2
    assert capsys.readouterr().err == (
        "dapo: error: MODEL=smol/model.safetensors is a file, not a model directory: give its "
        "directory, MODEL=smol\n"
    )
    assert not hub.is_hub_id("smolcopy.gguf") and hub.is_hub_id("org/absent")


def _coded_tokenizer(model: Path, marker: Path, tokenizer_class: str) -> None:
    """tokenizer_config.json mapping AutoTokenizer to code beside it that leaves ``marker``."""
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = tokenizer_class
    config["auto_map"] = {"AutoTokenizer": ["evil_tok.EvilTokenizer", "evil_tok.EvilTokenizer"]}
    config_file.write_text(json.dumps(config))
    (model / "evil_tok.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )


def test_a_tokenizer_that_is_code_of_its_own_is_refused_as_model_code(tmp_path):
    """It got "save one beside the model with tokenizer.save_pretrained(DIR)", which does not
    help; config.json's auto_map got "dapo runs no model code"."""
    model, marker = save_model(tmp_path / "m", "llama"), tmp_path / "ran"
    _coded_tokenizer(model, marker, "EvilTokenizer")
    with pytest.raises(ValueError) as refused:
        load_tokenizer(load_config(None, [f"model.path={model}"]))
    assert str(refused.value) == (
        f"model.path={model}: its tokenizer class 'EvilTokenizer' is not one transformers has "
        "and dapo runs no model code (tokenizer_config.json's auto_map names code that came "
        "with the model); give a model whose tokenizer transformers has (a newer transformers "
        "may have this one)"
    )
    assert not marker.exists()
    known = tmp_path / "known"
    shutil.copytree(model, known)
    _coded_tokenizer(known, marker, "GPT2Tokenizer")  # transformers' own: the map unused
    assert hub.tokenizer_code_refusal(known) is None
    assert not marker.exists()
