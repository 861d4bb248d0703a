"""``dapo export``: checkpoints of one process and of 2 ranks (DCP shards) as Hugging Face model
directories that transformers loads and that give the trained policy's logits."""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import TINY_DEMO, TORCHRUN_DEMO, dapo_train
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import dapo
from dapo.api import exporting as export_mod
from dapo.cli import main


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    found = {}
    for f in sorted(directory.glob("*.safetensors")):
        found |= load_file(f)
    return found


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert sorted(wa) == sorted(wb)
    for name, tensor in wa.items():
        assert tensor.dtype == wb[name].dtype and torch.equal(tensor, wb[name]), name


def _logits(directory: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = torch.arange(3, 40).reshape(1, -1) % model.config.vocab_size
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, demo_cache):
    """A 2-step run of one process, a checkpoint each step, an extra stop token."""
    out = tmp_path_factory.mktemp("export")
    args = [*TINY_DEMO, "train.steps=2", "train.save_every=1", "eval.num_samples=0"]
    args += ["eval.every=0", f"embedded.cache_dir={demo_cache}", "rollout.stop_token_ids=[7]"]
    assert main(["train", "--quiet", *args, f"run.out_dir={out}", "run.name=r"]) == 0
    return out / "r"


def test_the_latest_checkpoint_exports_as_the_trained_policy(one_process, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(one_process), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    # The last checkpoint is the final policy the run saved as model/.
    _same_weights(out, one_process / "model")
    torch.testing.assert_close(_logits(out), _logits(one_process / "model"), rtol=0, atol=1e-6)
    generation = json.loads((out / "generation_config.json").read_text())
    eos = json.loads((one_process / "model" / "tokenizer_config.json").read_text())
    assert generation["eos_token_id"] == [0, 7], (generation, eos.get("eos_token"))
    marker = json.loads((out / export_mod.MARKER).read_text())
    assert marker["step"] == 2 and marker["sharded"] is False
    assert marker["run"] == str(one_process.resolve())
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporaries


def test_an_earlier_step_and_another_dtype(one_process, tmp_path):
    first = dapo.export(one_process, tmp_path / "s1", step=1, log=lambda m: None)  # the API
    assert first.step == 1 and first.parameters > 0
    _same_weights(tmp_path / "s1", one_process / "checkpoints" / "step_000001" / "model")
    assert not torch.equal(_logits(tmp_path / "s1"), _logits(one_process / "model"))
    half = export_mod.export(one_process, tmp_path / "bf16", dtype="bfloat16", log=lambda m: None)
    full, low = _weights(one_process / "model"), _weights(tmp_path / "bf16")
    assert all(torch.equal(low[k], v.to(torch.bfloat16)) for k, v in full.items())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert half.weight_bytes < first.weight_bytes


def test_eval_reads_an_export(one_process, tmp_path):
    export_mod.export(one_process, tmp_path / "hf", log=lambda m: None)
    args = ["--data", "arith", "--k", "2", "--max-new-tokens", "8", "--num-problems", "3"]
    args += ["--resamples", "50"]
    assert main(["eval", str(tmp_path / "hf"), *args, "--out", str(tmp_path / "a")]) == 0
    assert main(["eval", str(one_process / "model"), *args, "--out", str(tmp_path / "b")]) == 0
    records = (tmp_path / "a" / "problems.jsonl").read_text()
    assert records == (tmp_path / "b" / "problems.jsonl").read_text()


def test_what_export_refuses(one_process, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for extra in ([], ["--overwrite"]):
        assert main(["export", str(one_process), "--out", str(mine), *extra]) == 2
        assert str(mine) in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep"  # dapo deletes only what it wrote
    earlier = tmp_path / "earlier"
    assert main(["export", str(one_process), "--out", str(earlier), "--step", "1"]) == 0
    assert main(["export", str(one_process), "--out", str(earlier)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(["export", str(one_process), "--out", str(earlier), "--overwrite"]) == 0
    assert json.loads((earlier / export_mod.MARKER).read_text())["step"] == 2
    assert main(["export", str(one_process), "--out", str(tmp_path / "x"), "--step", "9"]) == 2
    assert "no checkpoint of step 9; it has [1, 2]" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoints/ there" in capsys.readouterr().err
    link = tmp_path / "link"
    os.symlink(mine, link)
    assert main(["export", str(one_process), "--out", str(link), "--overwrite"]) == 2
    assert "link" in capsys.readouterr().err and (mine / "notes.txt").is_file()
    assert not (tmp_path / "x").exists()


def test_an_altered_checkpoint_is_named_and_nothing_written(one_process, tmp_path, capsys):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(one_process, run)
    weights = run / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the same size: only the digest tells
    weights.write_bytes(bytes(data))
    assert main(["export", str(run), "--out", str(tmp_path / "x"), "--step", "2"]) == 1
    err = capsys.readouterr().err
    assert "model/model.safetensors" in err and "altered" in err
    assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".x")]


def test_a_damaged_newest_checkpoint_is_passed_over_with_a_warning(one_process, tmp_path, capsys):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(one_process, run)
    added = run / "checkpoints" / "step_000002" / "model" / ".DS_Store"
    added.write_bytes(b"x")  # a file browser's stray file: the checkpoint is not whole
    assert main(["export", str(run), "--out", str(tmp_path / "x")]) == 0
    err = capsys.readouterr().err
    assert "dapo: warning: export: step_000002, the newest, was passed over: " in err
    assert f"{added} is not in the manifest" in err and "exporting step_000001" in err
    assert json.loads((tmp_path / "x" / export_mod.MARKER).read_text())["step"] == 1
    assert main(["export", str(run), "--out", str(tmp_path / "y"), "--step", "1"]) == 0
    assert "warning" not in capsys.readouterr().err  # the step asked for: nothing passed over


def test_out_dot_from_inside_an_earlier_export_replaces_it(one_process, tmp_path, monkeypatch):
    earlier = tmp_path / "earlier"
    assert main(["export", str(one_process), "--out", str(earlier), "--step", "1"]) == 0
    monkeypatch.chdir(earlier)  # `--out .` had an empty name to build its siblings' from
    result = dapo.export(one_process, ".", overwrite=True, log=lambda m: None)
    assert result.out_dir.resolve() == earlier.resolve() and result.step == 2
    assert json.loads((earlier / export_mod.MARKER).read_text())["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier"]  # no temporaries left


def test_the_tokenizers_named_chat_templates_are_exported(one_process, tmp_path):
    """``save_pretrained`` writes a tokenizer's named chat templates (tool_use, ...) into
    ``additional_chat_templates/``: the export carries them, lists them in its marker, and
    replaces such an export with --overwrite unless something else sits in that directory."""
    import shutil

    from transformers import AutoTokenizer

    from dapo.run import checkpoint, manifest

    run = tmp_path / "run"
    shutil.copytree(one_process, run)
    (run / ".dapo-lock").unlink(missing_ok=True)
    ckpt = run / "checkpoints" / "step_000002"
    (ckpt / "model" / "additional_chat_templates").mkdir()
    (ckpt / "model" / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ 1 }}")
    (ckpt / manifest.MANIFEST).unlink()  # the run as a tokenizer with two templates saves it
    manifest.write(ckpt, checkpoint.FORMAT_VERSION, 2, None)
    out = tmp_path / "hf"
    dapo.export(run, out, log=lambda m: None)
    templates = AutoTokenizer.from_pretrained(out).chat_template
    assert isinstance(templates, dict) and templates["tool_use"] == "TOOLS {{ 1 }}"
    listed = json.loads((out / export_mod.MARKER).read_text())["files"]
    assert "additional_chat_templates/tool_use.jinja" in listed
    dapo.export(run, out, step=1, overwrite=True, log=lambda m: None)  # its own: replaced
    assert json.loads((out / export_mod.MARKER).read_text())["step"] == 1
    dapo.export(run, out, overwrite=True, log=lambda m: None)
    (out / "additional_chat_templates" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="did not write: additional_chat_templates"):
        dapo.export(run, out, step=1, overwrite=True, log=lambda m: None)
    assert (out / "additional_chat_templates" / "notes.txt").read_text() == "mine"


def test_the_api_wrapper_and_the_guide_name_every_option_of_export():
    import inspect

    options = [
        name
        for name, p in inspect.signature(export_mod.export).parameters.items()
        if p.kind is p.KEYWORD_ONLY
    ]
    assert {"step", "merge", "log"} <= set(options)
    guide = (Path(__file__).parents[1] / "docs" / "guides" / "your-task.md").read_text()
    assert "- `dapo.export(run_dir, out, *, " in guide
    for name in options:
        assert f"``{name}``" in dapo.export.__doc__, name
        assert f"{name}=" in guide.split("- `dapo.export(", 1)[1].split("\n- ", 1)[0], name


def test_a_two_rank_dcp_checkpoint_exports_in_one_process(tmp_path, monkeypatch, demo_cache):
    """torchrun writes DCP shards, each rank its half; one process gathers them into the
    weights the run itself gathered for model/ at its end, in one file or in several."""
    cache = f"embedded.cache_dir={demo_cache}"
    dapo_train(2, *TORCHRUN_DEMO, "train.steps=2", cache, "run.name=two", out_dir=tmp_path)
    run = tmp_path / "two"
    assert (run / "checkpoints" / "step_000002" / "state").is_dir()
    result = export_mod.export(run, tmp_path / "hf", log=lambda m: None)
    assert result.sharded and result.step == 2
    _same_weights(tmp_path / "hf", run / "model")
    torch.testing.assert_close(_logits(tmp_path / "hf"), _logits(run / "model"), rtol=0, atol=1e-6)
    # Cut into files of at most 20 kB: an index, and the same model.
    monkeypatch.setattr(export_mod, "SHARD_BYTES", 20_000)
    export_mod.export(run, tmp_path / "cut", log=lambda m: None)
    index = json.loads((tmp_path / "cut" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert sorted(index["weight_map"]) == sorted(_weights(run / "model"))
    _same_weights(tmp_path / "cut", run / "model")
    torch.testing.assert_close(_logits(tmp_path / "cut"), _logits(run / "model"), rtol=0, atol=1e-6)
    step1 = export_mod.export(run, tmp_path / "s1", step=1, log=lambda m: None)
    assert step1.step == 1 and not torch.equal(_logits(tmp_path / "s1"), _logits(run / "model"))
