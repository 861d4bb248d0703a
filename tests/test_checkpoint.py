"""Checkpoints: exact round trip of weights, optimiser and RNG; atomic writes; pruning."""

import errno
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dapo.api import exporting
from dapo.models.demo import TinyModelSpec, tiny_qwen2
from dapo.run import checkpoint, manifest, state_files
from dapo.run.metrics import MetricsLogger

SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)


def _trained(tokenizer, seed):
    model = tiny_qwen2(tokenizer, SPEC, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(run_dir, model, tok, opt, step, keep=3, **extra):
    state = {"sampler": {"epoch": 0, "pos": step}, **extra}
    return checkpoint.save(
        run_dir,
        step=step,
        model=model,
        tokenizer=tok,
        optimizer=opt,
        trainer_state=state,
        keep=keep,
    )


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path, tokenizer):
    model, opt = _trained(tokenizer, seed=0)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=7)
    expected = (random.random(), float(np.random.rand()), torch.rand(3))

    other, other_opt = _trained(tokenizer, seed=1)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    info = checkpoint.load(ckpt, model=other, optimizer=other_opt)

    assert info["step"] == 7 and info["sampler"] == {"epoch": 0, "pos": 7}
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # Tied weights stay tied after loading (save_pretrained stores lm_head once).
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()
    s1, s2 = opt.state_dict(), other_opt.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][field], s2["state"][k][field])
    assert random.random() == expected[0]
    assert float(np.random.rand()) == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


def test_layout_pointer_and_weights_only_files(tmp_path, tokenizer):
    model, opt = _trained(tokenizer, seed=0)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=3)
    assert ckpt == tmp_path / "checkpoints" / "step_000003"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000003\n"
    assert (ckpt / "model" / "model.safetensors").is_file()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    names = set(manifest["files"])
    assert {"optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json"} <= names
    assert "trainer.json" in names
    for rel, entry in manifest["files"].items():  # every file with its size and digest
        data = (ckpt / rel).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert_nothing_pickled(ckpt)


def assert_nothing_pickled(root: Path) -> None:
    """No file under ``root`` is a pickle or a torch.save archive (a zip holding one): every
    one is safetensors, JSON or text."""
    for path in root.rglob("*"):
        if path.is_file():
            head = path.read_bytes()[:4]
            assert head[:1] != b"\x80" and head != b"PK\x03\x04", path
            assert path.suffix in {".safetensors", ".json", ".jinja", ".txt", ""}, path


def test_keeps_only_the_newest(tmp_path, tokenizer):
    model, opt = _trained(tokenizer, seed=0)
    for step in range(1, 6):
        _save(tmp_path, model, tokenizer, opt, step=step, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000004", "step_000005"]


def test_failed_write_leaves_previous_checkpoint_whole(tmp_path, tokenizer, monkeypatch):
    model, opt = _trained(tokenizer, seed=0)
    _save(tmp_path, model, tokenizer, opt, step=1)
    real_save = state_files.save_file

    def full_disk(tensors, path, *a, **k):
        if str(path).endswith("rng.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, path, *a, **k)

    monkeypatch.setattr(state_files, "save_file", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as err:
        _save(tmp_path, model, tokenizer, opt, step=2)
    msg = str(err.value)
    assert "step 2" in msg and "the disk is full" in msg and "step_000001 is intact" in msg
    assert f"dapo train --resume {tmp_path}" in msg
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000001"]  # no half-written directory left behind
    assert checkpoint.find_latest(tmp_path).name == "step_000001"


def test_find_latest_skips_a_damaged_checkpoint(tmp_path, tokenizer):
    model, opt = _trained(tokenizer, seed=0)
    _save(tmp_path, model, tokenizer, opt, step=1)
    newest = _save(tmp_path, model, tokenizer, opt, step=2)
    with (newest / "optimizer.safetensors").open("r+b") as f:
        f.truncate(10)
    files = json.loads((newest / "manifest.json").read_text())["files"]
    assert checkpoint.verify(newest).endswith(
        f"the manifest says {files['optimizer.safetensors']['bytes']}"
    )
    assert checkpoint.find_latest(tmp_path).name == "step_000001"
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.load(newest, model=model, optimizer=opt)


def test_a_stray_file_is_named_and_never_called_a_run_without_checkpoints(tmp_path, tokenizer):
    model, opt = _trained(tokenizer, seed=0)
    older = _save(tmp_path, model, tokenizer, opt, step=1)
    newest = _save(tmp_path, model, tokenizer, opt, step=2)
    (newest / ".DS_Store").write_bytes(b"x")  # a copy's or a file browser's stray file
    assert checkpoint.find_latest(tmp_path) == older
    assert checkpoint.passed_over(tmp_path, older) == (
        f"step_000002, the newest, was passed over: {newest / '.DS_Store'} is not in the "
        "manifest: it was added after the checkpoint"
    )
    assert checkpoint.passed_over(tmp_path, newest) == ""
    (older / ".DS_Store").write_bytes(b"x")
    assert checkpoint.find_latest(tmp_path) is None
    why = checkpoint.unreadable(tmp_path)
    assert why.startswith("the newest, step_000002, is not whole: ") and ".DS_Store" in why
    assert "remove a file added since" in why
    # --resume and export say so; neither advises --overwrite (it would delete every one).
    with pytest.raises(ValueError, match=r"is not whole: .*\.DS_Store") as err:
        exporting.find_checkpoint(tmp_path, None, print)
    assert "--overwrite" not in str(err.value)
    assert checkpoint.unreadable(tmp_path / "checkpoints") == ""  # no checkpoint written there


@pytest.mark.parametrize("name", ["optimizer.safetensors", "model/model.safetensors"])
def test_a_garbled_safetensors_file_with_its_own_manifest_is_named(tmp_path, tokenizer, name):
    # A checkpoint from elsewhere may come with a manifest made for its files: the digests then
    # pass, and safetensors' own SafetensorError (no ValueError) was a traceback.
    model, opt = _trained(tokenizer, seed=0)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=1)
    (ckpt / name).write_bytes(b"\xff" * 64)
    (ckpt / "manifest.json").unlink()
    manifest.write(ckpt, checkpoint.FORMAT_VERSION, 1, None)
    assert checkpoint.verify(ckpt, digests=True) is None
    with pytest.raises((checkpoint.CheckpointError, state_files.StateFileError)) as err:
        checkpoint.load(ckpt, model=model, optimizer=opt)
    assert name.split("/")[-1] in str(err.value) and "damaged" in str(err.value)
    if name.startswith("model/"):
        with pytest.raises(checkpoint.CheckpointError, match="not a readable safetensors"):
            exporting.export(tmp_path, tmp_path / "out", log=lambda m: None, dtype="bfloat16")
        with pytest.raises(checkpoint.CheckpointError, match="not a readable safetensors"):
            exporting.export(tmp_path, tmp_path / "out2", log=lambda m: None)


def test_a_file_altered_at_its_size_is_named_before_anything_is_read(tmp_path, tokenizer):
    """Sizes are what finding the latest checkpoint checks (fast); resuming checks every
    file's SHA-256, so one byte changed is caught before the file is read."""
    model, opt = _trained(tokenizer, seed=0)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=1)
    path = ckpt / "rng.json"
    data = bytearray(path.read_bytes())
    data[-3] ^= 1  # a digit of the numpy state's cached float: still valid JSON
    path.write_bytes(bytes(data))
    assert checkpoint.verify(ckpt) is None  # the size is the same
    assert checkpoint.find_latest(tmp_path) == ckpt
    assert "rng.json is not the file that was written" in checkpoint.verify(ckpt, digests=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"altered: .*rng.json is not the file"):
        checkpoint.load(ckpt, model=model, optimizer=opt)


def test_a_checkpoint_of_the_pickled_format_is_refused_naming_the_fix(tmp_path, tokenizer):
    model, opt = _trained(tokenizer, seed=0)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=1)
    trainer = json.loads((ckpt / "trainer.json").read_text())
    (ckpt / "trainer.json").write_text(json.dumps({**trainer, "format_version": 1}))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    entry = manifest["files"]["trainer.json"]
    data = (ckpt / "trainer.json").read_bytes()
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"older dapo \(checkpoint format 1, before commit 96772cf\).*pickled",
    ):
        checkpoint.load(ckpt, model=model, optimizer=opt)


def test_refuses_to_save_non_finite_weights(tmp_path, tokenizer):
    model, opt = _trained(tokenizer, seed=0)
    _save(tmp_path, model, tokenizer, opt, step=1)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(checkpoint.CheckpointError) as caught:
        _save(tmp_path, model, tokenizer, opt, step=2)
    assert checkpoint.find_latest(tmp_path).name == "step_000001"
    assert str(caught.value).endswith(
        "resume from its last checkpoint with a changed config: "
        f"dapo train --resume {tmp_path} optim.lr=<lower> --force (first: model.norm.weight)"
    )


def test_a_first_checkpoint_refused_says_to_start_again(tmp_path, tokenizer):
    """At a run's first save there is no checkpoint to resume from: the message said there was."""
    model, opt = _trained(tokenizer, seed=0)
    with torch.no_grad():
        model.model.norm.weight[0] = float("inf")
    with pytest.raises(checkpoint.CheckpointError) as caught:
        _save(tmp_path, model, tokenizer, opt, step=1)
    assert str(caught.value) == (
        "refusing to save the checkpoint of step 1: the weights hold NaN or inf, and a checkpoint "
        "of broken weights would overwrite good ones. It stopped before its first checkpoint, so "
        "there is nothing to resume: start it again with the same command, optim.lr=<lower> and "
        "--overwrite (first: model.norm.weight)"
    )
    assert checkpoint.find_latest(tmp_path) is None


def test_weights_of_another_model_are_refused(tmp_path, tokenizer):
    model, opt = _trained(tokenizer, seed=0)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=1)
    bigger = tiny_qwen2(tokenizer, TinyModelSpec(hidden_size=32, num_layers=3), seed=0)
    with pytest.raises(checkpoint.CheckpointError, match="do not fit this model"):
        checkpoint.model_files.load(bigger, ckpt / "model")


def test_metrics_log_truncates_to_a_checkpoint_offset(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLogger(path)
    log.log(0, {"a": 1.0})
    offset = log.sync()
    log.log(1, {"a": 2.0})
    log.close()
    with path.open("ab") as f:
        f.write(b'{"step": 2, "a"')  # a line half-written when the process died
    log = MetricsLogger(path)
    log.truncate(offset)
    log.log(1, {"a": 3.0})
    log.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 0, "a": 1.0},
        {"step": 1, "a": 3.0},
    ]
    log = MetricsLogger(path)
    with pytest.raises(ValueError, match="not the end of a line"):
        log.truncate(offset + 3)
    with pytest.raises(ValueError, match="was cut or edited"):
        log.truncate(10**6)
    log.close()


def test_a_damaged_checkpoint_does_not_count_among_those_kept(tmp_path, tokenizer):
    """Pruning counted by step number: with the newest checkpoint but one damaged, keep=2
    deleted the complete one before it and left one complete checkpoint where two were asked."""
    model, opt = _trained(tokenizer, seed=0)
    for step in range(1, 4):
        _save(tmp_path, model, tokenizer, opt, step=step, keep=2)
    root = tmp_path / "checkpoints"
    (root / "step_000003" / "trainer.json").write_text("{}")  # its size no longer matches
    _save(tmp_path, model, tokenizer, opt, step=4, keep=2)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_000002", "step_000003", "step_000004"]
    assert checkpoint.verify(root / "step_000002") is None
