"""A model directory whose only weights are a pickle holding more than tensors: torch's
``weights_only`` loader refuses it (nothing in it runs), and dapo says so, naming the file
and the safe fix, where an UnpicklingError traceback advised ``weights_only=False``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import save_model
from safetensors.torch import load_file

from dapo.cli import main
from dapo.config import load_config
from dapo.models import sharded_load
from dapo.models.policy import load_policy


class Payload:
    """Unpickled, it would create ``marker``: what a hostile checkpoint runs instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickled(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny model whose weights are only ``pytorch_model.bin``, with the payload beside
    its tensors (as /tmp/reviews/r5/mk_pkl.py builds it)."""
    path = save_model(tmp_path / "m_pkl", "qwen2")
    marker = tmp_path / "PWNED"
    weights: dict = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    weights["evil"] = Payload(marker)
    torch.save(weights, path / "pytorch_model.bin")
    return path, marker


def _message(path: Path) -> str:
    return (
        f"model.path={path}: pytorch_model.bin is a pickle holding more than tensors; torch's "
        "safe loader refused it, and dapo loads no pickled code (unpickling it could run "
        "anything it names). Convert the weights to safetensors from a copy you trust, in an "
        "environment you trust (there: torch.load(FILE, weights_only=False), load the tensors "
        "into the model, model.save_pretrained(DIR, safe_serialization=True)), or fetch the "
        "model's .safetensors files, and give model.path=DIR"
    )


def test_pickled_weights_are_refused_by_name_and_nothing_in_them_runs(tmp_path):
    path, marker = _pickled(tmp_path)
    cfg = load_config(None, [f"model.path={path}"])
    with pytest.raises(ValueError) as err:
        load_policy(cfg, log=lambda _: None)
    assert str(err.value) == _message(path)
    assert "weights_only=False" not in str(err.value).split("(there:")[0]
    assert not marker.exists()
    # The torchrun loader reads safetensors files only: it finds none here and leaves the
    # directory to this same whole load (sharded_load.load returns None).
    assert sharded_load.weight_files(path) is None


def test_dapo_eval_reports_it_as_an_error_not_a_traceback(tmp_path, capsys):
    path, marker = _pickled(tmp_path)
    args = ["eval", str(path), "--data", "arith", "--num-problems", "1", "--k", "1"]
    assert main([*args, "--max-new-tokens", "4", "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err
    assert _message(path) in err and "Traceback" not in err
    assert not marker.exists()


def test_plain_tensor_pickles_still_load(tmp_path):
    path = save_model(tmp_path / "m_bin", "qwen2")
    weights = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save(weights, path / "pytorch_model.bin")  # tensors only: the safe loader reads it
    model, _ = load_policy(load_config(None, [f"model.path={path}"]), log=lambda _: None)
    name = "model.embed_tokens.weight"
    assert torch.equal(model.state_dict()[name], weights[name])
