"""Crafted checkpoints, exports and GGUF files: each refused with an error naming the file (or,
where nothing in it needs trusting, read safely), never a traceback, never a read outside."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import TINY_DEMO
from safetensors.torch import load_file, save_file

from dapo.api import exporting as export_mod
from dapo.cli import main
from dapo.dist import dcp
from dapo.models import policy
from dapo.run import checkpoint, manifest, trainer_file
from dapo.run.checkpoint import CheckpointError

STEP = "step_000002"


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_cache):
    """A 2-step run of one process with a checkpoint at step 2 (never altered: copy it)."""
    out = tmp_path_factory.mktemp("crafted")
    args = [*TINY_DEMO, "train.steps=2", "train.save_every=2", "eval.num_samples=0"]
    args += ["eval.every=0", f"embedded.cache_dir={demo_cache}"]
    assert main(["train", "--quiet", *args, f"run.out_dir={out}", "run.name=r"]) == 0
    return out / "r"


def _copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    dest = tmp_path / "run"
    shutil.copytree(run, dest, symlinks=True)
    (dest / ".dapo-lock").unlink(missing_ok=True)
    return dest, dest / "checkpoints" / STEP


def _reseal(ckpt: Path) -> None:
    """The manifest written again over the crafted files, as an attacker would."""
    (ckpt / manifest.MANIFEST).unlink()
    manifest.write(ckpt, checkpoint.FORMAT_VERSION, 2, None)


def _export(run_dir: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    rc = main(["export", str(run_dir), "--out", str(out), *extra])
    return rc, capsys.readouterr().err


def _edit_trainer(ckpt: Path, **changes) -> None:
    trainer = json.loads((ckpt / "trainer.json").read_text())
    for key, value in changes.items():
        if value is None:
            del trainer[key]
        else:
            trainer[key] = value
    (ckpt / "trainer.json").write_text(json.dumps(trainer))
    _reseal(ckpt)


def test_a_linked_directory_in_a_checkpoint_is_refused(run, tmp_path, capsys):
    copy, ckpt = _copy(run, tmp_path)
    outside = tmp_path / "outside"
    shutil.move(ckpt / "model", outside)
    (outside / "PRIVATE.txt").write_text("not the checkpoint's")
    _reseal(ckpt)
    (ckpt / "model").symlink_to(outside, target_is_directory=True)
    problem = manifest.verify(ckpt)
    assert problem is not None and "model is a link" in problem
    rc, err = _export(copy, tmp_path / "x", capsys, "--step", "2")
    assert rc != 0 and f"{ckpt / 'model'} is a link" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"step": None}, "holds no step"),
        ({"step": "x"}, "step is 'x', not a whole number"),
        ({"val_start": [1]}, "val_start is '[1]', not an object of numbers"),
        ({"metrics_bytes": -3}, "metrics_bytes is '-3'"),
        ({"sampler": {"epoch": 0}}, "sampler is"),
        ({"val_step": "2"}, "val_step is '2', not a whole number"),
        ({"val_set": {"problems": 3, "digest": "../x"}}, "val_set is "),
        ({"val_set": {"problems": -1, "digest": "0" * 64}}, "not {problems, digest}"),
    ],
)
def test_a_mistyped_trainer_json_is_named(run, tmp_path, capsys, changes, says):
    copy, ckpt = _copy(run, tmp_path)
    _edit_trainer(ckpt, **changes)
    with pytest.raises(CheckpointError, match="trainer.json") as info:
        checkpoint.read_trainer_state(ckpt)
    assert says in str(info.value)
    rc, err = _export(copy, tmp_path / "x", capsys, "--step", "2")
    assert rc == 1 and f"{ckpt / 'trainer.json'}" in err and says in err
    assert not (tmp_path / "x").exists()


def test_resuming_a_trainer_json_without_a_key_names_it_before_a_model_loads(
    run, tmp_path, capsys, monkeypatch
):
    copy, ckpt = _copy(run, tmp_path)
    _edit_trainer(ckpt, consecutive_skips=None)
    with pytest.raises(CheckpointError, match="trainer.json has no 'consecutive_skips'"):
        trainer_file.check_resumable(checkpoint.read_trainer_state(ckpt))
    loads: list[object] = []
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: loads.append(a))
    assert main(["train", "--quiet", "--resume", str(copy), "train.steps=3"]) == 1
    err = capsys.readouterr().err
    assert f"{ckpt / 'trainer.json'} has no 'consecutive_skips'" in err
    assert "Traceback" not in err and loads == []


def test_fewer_steps_than_the_checkpoint_are_refused_before_a_model_loads(
    run, tmp_path, capsys, monkeypatch
):
    copy, _ = _copy(run, tmp_path)
    loads: list[object] = []
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: loads.append(a))
    for dry in ([], ["--dry-run"]):
        assert main(["train", "--quiet", "--resume", str(copy), "train.steps=1", *dry]) == 2
        err = capsys.readouterr().err
        assert f"--resume {copy}: train.steps=1 is below 2, the step of its checkpoint" in err
    assert loads == []


@pytest.mark.parametrize(
    "index", [{}, {"weight_map": {"model.norm.weight": "../../../../etc/hostname"}}, []]
)
def test_the_shard_index_is_rebuilt_not_trusted(run, tmp_path, capsys, index):
    copy, ckpt = _copy(run, tmp_path)
    (ckpt / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    _reseal(ckpt)
    rc, err = _export(copy, tmp_path / "x", capsys, "--step", "2")
    assert rc == 0, err
    written = json.loads((tmp_path / "x" / "model.safetensors.index.json").read_text())
    names = load_file(tmp_path / "x" / "model.safetensors")
    assert written["weight_map"] == dict.fromkeys(sorted(names), "model.safetensors")


@pytest.mark.parametrize("config", [None, "[1, 2]", "{not json"])
def test_a_missing_or_bad_config_json_is_named(run, tmp_path, capsys, config):
    copy, ckpt = _copy(run, tmp_path)
    path = ckpt / "model" / "config.json"
    path.unlink() if config is None else path.write_text(config)
    _reseal(ckpt)
    rc, err = _export(copy, tmp_path / "x", capsys, "--step", "2")
    why = "holds a list, not a model config" if config == "[1, 2]" else "is missing or unreadable"
    assert rc == 1 and f"{path} {why}" in err, err
    assert "Traceback" not in err and not (tmp_path / "x").exists()


def _shards(state: Path, shape: list[int], parts: list[tuple[int, int]]) -> None:
    """DCP safetensors shards of one tensor ``model.x`` of ``shape``: a part (offset, length)
    per shard file, each filled with its offset + 1."""
    state.mkdir()  # the header keys of torch's DCP Hugging Face storage (_hf_utils)
    for rank, (offset, length) in enumerate(parts, 1):
        info = {"saved_offsets": [offset], "shape": shape, "dtype": "F32"}
        meta = {"DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps({"model.x": info})}
        name = f"shard-{rank:05d}-model-00001-of-00001.safetensors"
        save_file({"model.x": torch.full((length,), offset + 1.0)}, state / name, metadata=meta)


@pytest.mark.parametrize(
    ("parts", "says"),
    [([(4, 4)], "hold 4 of its 8 elements"), ([(0, 4), (2, 4)], "overlap")],
)
def test_dcp_shards_that_do_not_cover_a_tensor_are_refused(tmp_path, parts, says):
    _shards(tmp_path / "state", [8], parts)
    with pytest.raises(dcp.UnsafeCheckpointError, match=says):
        dcp.stored_tensors(tmp_path / "state")
    with pytest.raises(dcp.UnsafeCheckpointError, match="'model.x'"):
        dcp.read_tensors(tmp_path / "state", {"model.x": (torch.Size([8]), torch.float32)})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(dcp.UnsafeCheckpointError, match=says):  # resume's path
        dcp.load(tmp_path / "state", model, torch.optim.AdamW(model.parameters()))


def test_dcp_shards_that_cover_a_tensor_are_read(tmp_path):
    _shards(tmp_path / "state", [8], [(0, 4), (4, 4)])
    wanted = dcp.stored_tensors(tmp_path / "state")
    got = dcp.read_tensors(tmp_path / "state", wanted)["model.x"]
    assert got.tolist() == [1.0] * 4 + [5.0] * 4


def test_overwrite_replaces_only_what_an_export_wrote(run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert _export(run, out, capsys, "--step", "2")[0] == 0
    listed = json.loads((out / export_mod.MARKER).read_text())["files"]
    assert sorted(p.name for p in out.iterdir()) == listed
    (out / "eval_results.json").write_text("{}")
    (out / "notes").mkdir()
    (out / "notes" / "a.txt").write_text("mine")
    rc, err = _export(run, out, capsys, "--overwrite")
    assert rc == 2 and "eval_results.json, notes" in err
    assert (out / "eval_results.json").is_file() and (out / "notes" / "a.txt").is_file()
    # An export from before the list: only the files an export writes may be replaced.
    marker = json.loads((out / export_mod.MARKER).read_text())
    del marker["files"]
    (out / export_mod.MARKER).write_text(json.dumps(marker))
    rc, err = _export(run, out, capsys, "--overwrite")
    assert rc == 2 and "eval_results.json, notes" in err and (out / "notes").is_dir()
    shutil.rmtree(out / "notes")
    (out / "eval_results.json").unlink()
    assert _export(run, out, capsys, "--overwrite")[0] == 0
    assert "files" in json.loads((out / export_mod.MARKER).read_text())


def _gguf(path: Path, architecture: str = "llama", **fields) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in fields.items():
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_metadata_of_the_wrong_type_is_named(tmp_path):
    from dapo.models.gguf import gguf_metadata, import_gguf

    eos = _gguf(tmp_path / "eos.gguf", **{"tokenizer.ggml.eos_token_id": "abc"})
    with pytest.raises(ValueError, match=f"{eos}: .*eos_token_id is of type"):
        gguf_metadata(eos)
    arch = _gguf(tmp_path / "arch.gguf")
    arch.write_bytes(arch.read_bytes().replace(b"llama", b"\xff\xfe\xfd\xfc\xfb", 1))
    with pytest.raises(ValueError, match=f"{arch}: unreadable GGUF file .*give a GGUF file"):
        gguf_metadata(arch)
    empty = _gguf(tmp_path / "empty.gguf")  # no tokenizer, no tensors: transformers fails
    with pytest.raises(ValueError, match=f"{empty}: transformers could not read"):
        import_gguf(str(empty), tmp_path / "out", log=lambda m: None)
    assert not (tmp_path / "out").exists()


def test_a_gguf_import_never_writes_through_a_planted_partial_link(
    tmp_path, monkeypatch, tiny_model, tokenizer
):
    """The import wrote into ``.OUT.partial`` beside the target: a link planted there was
    written through (the model's files landed in the link's target), and renamed to OUT."""
    from dapo.models import gguf as gguf_mod

    source = _gguf(tmp_path / "m.gguf", **{"tokenizer.ggml.eos_token_id": 2})
    monkeypatch.setattr(gguf_mod, "load_model", lambda path: tiny_model)
    monkeypatch.setattr(gguf_mod, "load_tokenizer", lambda path, eos: tokenizer)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / ".out.partial").symlink_to(elsewhere)
    out = tmp_path / "models" / "out"
    gguf_mod.import_gguf(str(source), out, log=lambda m: None)
    assert not any(elsewhere.iterdir())  # nothing written through the link
    assert out.is_dir() and not out.is_symlink() and (out / "config.json").is_file()
    assert (tmp_path / "models" / ".out.partial").is_symlink()  # not dapo's: left alone
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".out.partial", "out"]
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode


def _with_code(model_dir: Path, marker: Path) -> None:
    """config.json of a model type transformers lacks, mapped to code beside it that would
    leave ``marker``: transformers asked on the terminal whether to run it, and a `y` piped
    to dapo (``yes |``) ran it."""
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("model_type")
    config["auto_map"] = {"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"}
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")


def test_code_that_comes_with_a_checkpoint_or_model_is_never_run(
    run, tmp_path, capsys, monkeypatch
):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))  # yes | dapo ...
    marker = tmp_path / "ran"
    copy, ckpt = _copy(run, tmp_path)
    _with_code(ckpt / "model", marker)
    (ckpt / "model" / "generation_config.json").unlink()  # export builds one from the config
    _reseal(ckpt)
    rc, err = _export(copy, tmp_path / "x", capsys, "--step", "2")
    config = ckpt / "model" / "config.json"
    assert rc == 1 and f"{config} asks for code of its own (auto_map)" in err, err
    assert not (tmp_path / "x").exists()
    model_dir = tmp_path / "model"
    shutil.copytree(run / "model", model_dir)
    _with_code(model_dir, marker)
    out = tmp_path / "eval"
    args = ["--data", "arith", "--k", "1", "--num-problems", "1", "--out", str(out)]
    rc = main(["eval", str(model_dir), *args])
    err = capsys.readouterr().err
    assert rc == 2 and "is unknown to transformers and dapo runs no model code" in err, err
    assert not marker.exists() and not out.exists()  # nothing written for a model never loaded
