"""A checkpoint's JSON nested deeper than the parser recurses (``trainer.json``,
``optimizer.json``, ``rng.json``, ``manifest.json``) is damage like any other unreadable
JSON: named, never a RecursionError traceback; a deep manifest makes the checkpoint not whole,
so the newest whole one before it is used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapo.run import checkpoint, manifest, state_files
from dapo.run.checkpoint import CheckpointError

DEEP = "[" * 100_000 + "]" * 100_000


def _seal(ckpt: Path, step: int) -> None:
    """The manifest written over the checkpoint's files, as a crafted one would be."""
    (ckpt / manifest.MANIFEST).unlink(missing_ok=True)
    manifest.write(ckpt, checkpoint.FORMAT_VERSION, step, None)


def _checkpoint(run: Path, step: int, trainer: str) -> Path:
    ckpt = run / checkpoint.CKPT_DIR / checkpoint.step_dir_name(step)
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(trainer)
    _seal(ckpt, step)
    return ckpt


def test_a_deep_trainer_json_is_named(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, 2, '{"format_version": 2, "step": 2, "x": ' + DEEP + "}")
    with pytest.raises(CheckpointError) as caught:
        checkpoint.read_trainer_state(ckpt)
    assert str(caught.value).startswith(f"{ckpt / 'trainer.json'} is unreadable: RecursionError(")


def test_deep_optimizer_and_rng_json_are_named(tmp_path: Path) -> None:
    stem = tmp_path / "optimizer"
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state_files.save_optimizer(optimizer.state_dict(), stem)
    assert state_files.load_optimizer(stem)["param_groups"][0]["params"] == [0, 1]
    stem.with_suffix(".json").write_text(DEEP)
    with pytest.raises(state_files.StateFileError) as caught:
        state_files.load_optimizer(stem)
    message = str(caught.value)
    assert message.startswith(f"{stem}.safetensors / optimizer.json are missing or unreadable")
    assert "(RecursionError(" in message and "resume from an earlier one" in message
    rng = tmp_path / "rng"
    state_files.save_rng(checkpoint.capture_rng(None), rng)
    rng.with_suffix(".json").write_text('{"python": ' + DEEP + "}")
    with pytest.raises(state_files.StateFileError, match=r"rng.json are missing or unreadable"):
        state_files.load_rng(rng)


def test_a_deep_manifest_makes_the_checkpoint_not_whole(tmp_path: Path) -> None:
    """find_latest passes over it to the newest whole one, and says why."""
    trainer = '{"format_version": 2, "step": 1}'
    earlier, newest = _checkpoint(tmp_path, 1, trainer), _checkpoint(tmp_path, 2, trainer)
    checkpoint.write_pointer(tmp_path / checkpoint.CKPT_DIR, newest.name)
    (newest / manifest.MANIFEST).write_text('{"files": ' + DEEP + "}")
    why = manifest.verify(newest)
    assert why is not None and why.startswith(f"{newest / manifest.MANIFEST} is unreadable: ")
    assert "maximum recursion depth" in why
    assert checkpoint.find_latest(tmp_path) == earlier
    assert checkpoint.passed_over(tmp_path, earlier).startswith("step_000002, the newest, was")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, intended
def test_a_deep_optimizer_json_of_sharded_checkpoint_is_named(tmp_path: Path) -> None:
    from dapo.dist import dcp

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    dcp.save(tmp_path / "state", model, opt)
    (tmp_path / "state" / dcp.OPTIMIZER_JSON).write_text(DEEP)
    with pytest.raises(dcp.UnsafeCheckpointError) as caught:
        dcp.load(tmp_path / "state", model, opt)
    assert str(caught.value).startswith(
        f"{tmp_path / 'state' / dcp.OPTIMIZER_JSON} is missing or unreadable (RecursionError("
    )
