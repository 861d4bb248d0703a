"""``dapo export`` of a LoRA run (review r31a): an earlier step merges into its base as that
step loaded it (a resume may change ``model.param_dtype``), a base moved since the run is
given with ``--base``, a refused export makes no directory, and a killed export's temporary
copy (a model's weights) is removed by the next export to the same ``--out``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import save_model
from safetensors.torch import load_file

from dapo.api.adapters import with_trained_settings
from dapo.cli import main
from dapo.config import load_config
from dapo.run.model_files import CheckpointError

pytest.importorskip("peft")

REWARD = "def score(response, ground_truth):\n    return float(len(response) % 5) / 4.0\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 2-step LoRA run (rank 4, alpha 32) on a tiny float32 Llama saved as a directory
    (``ROOT/base``), a checkpoint a step; its final ``model/`` copied to ``ROOT/step2``."""
    root = tmp_path_factory.mktemp("lora-export")
    save_model(root / "base", "llama")
    (root / "reward.py").write_text(REWARD)
    settings = [
        f"model.path={root / 'base'}", "model.lora.rank=4", "rollout.group_size=4",
        "rollout.max_new_tokens=12", "algo.l_cache=4", "train.prompts_per_step=2",
        "train.responses_per_minibatch=4", "train.save_every=1", "sampling.dynamic=false",
        "eval.num_samples=0", "eval.every=0", "reward.workers=0", "run.threads=1",
        f"reward.function={root / 'reward.py'}:score", "train.steps=2", "optim.lr=1e-2",
        f"run.out_dir={root}", "run.name=run",
    ]  # fmt: skip
    assert main(["train", "--quiet", *settings]) == 0
    shutil.copytree(root / "run" / "model", root / "step2")
    return root


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _same(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_earlier_step_merges_into_the_base_dtype_it_was_trained_with(run, tmp_path, capsys):
    """Resumed in bfloat16 (--force), the run's step 2 still merges into the float32 base it
    trained on: merged into the rounded base, weights were off by up to 2.3e-4 and the export
    said "the trained policy exactly"."""
    copy = tmp_path / "run"
    shutil.copytree(run / "run", copy)
    bf16 = ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16"]
    resume = ["--resume", str(copy), "--force", "train.steps=3", *bf16]
    assert main(["train", "--quiet", *resume, "train.recompute_old_logprobs=true"]) == 0
    capsys.readouterr()
    out = tmp_path / "m"
    assert main(["export", str(copy), "--step", "2", "--merge", "--out", str(out)]) == 0
    said = capsys.readouterr().err
    assert "the base was loaded in model.param_dtype=float32 (config.yaml: bfloat16)" in said
    assert _same(out, run / "step2")

    def recorded(step: int) -> str:
        trainer = copy / "checkpoints" / f"step_00000{step}" / "trainer.json"
        return json.loads(trainer.read_text())["base_model"]["param_dtype"]

    assert (recorded(2), recorded(3)) == ("float32", "bfloat16")


@pytest.mark.parametrize("dtype", ["int8", 5])
def test_a_crafted_param_dtype_record_is_refused(dtype, tmp_path):
    cfg = load_config(None, ["model.lora.rank=4"])
    with pytest.raises(CheckpointError, match="trainer.json's base_model.param_dtype"):
        with_trained_settings(cfg, {"param_dtype": dtype}, tmp_path, print)


def test_a_moved_base_is_given_with_base_and_another_is_refused(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run / "run", copy)
    moved = tmp_path / "moved-base"
    shutil.copytree(run / "base", moved)
    config = copy / "config.yaml"
    config.write_text(config.read_text().replace(str(run / "base"), str(tmp_path / "gone")))
    out = tmp_path / "new" / "m"
    assert main(["export", str(copy), "--merge", "--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert "--merge: the adapters' base: model.path=" in said and "no such directory" in said
    assert "give that model with --base MODEL" in said and "export without --merge" in said
    assert not (tmp_path / "new").exists()  # its parent, made for the export, removed
    assert main(["export", str(copy), "--merge", "--base", str(moved), "--out", str(out)]) == 0
    assert _same(out, run / "step2")
    other = tmp_path / "other"
    save_model(other, "llama")  # another random model of the same shape
    args = ["export", str(copy), "--merge", "--base", str(other), "--out", str(tmp_path / "o")]
    assert main(args) == 1
    said = capsys.readouterr().err
    assert "trained adapters on model.path=" in said and "--base MODEL" in said
    assert f"but this run's base is model.path={other} (sha256" in said
    assert main(["export", str(copy), "--base", str(moved), "--out", str(tmp_path / "a")]) == 2
    said = capsys.readouterr().err  # refused before the checkpoint's SHA-256 check
    assert "--base names the model --merge merges into; add --merge" in said
    assert "against its manifest" not in said


def test_a_base_no_other_base_would_cure_gets_no_base_hint(run, tmp_path, capsys):
    """A base that is there but refused (its config names model code of its own, which dapo
    never runs) is not a moved base: --base is no fix."""
    copy = tmp_path / "run"
    shutil.copytree(run / "run", copy)
    coded = tmp_path / "coded"
    shutil.copytree(run / "base", coded)
    config = json.loads((coded / "config.json").read_text())
    config.update(model_type="my-own", auto_map={"AutoModelForCausalLM": "m.M"})
    (coded / "config.json").write_text(json.dumps(config))
    assert (
        main(["export", str(copy), "--merge", "--base", str(coded), "--out", str(tmp_path / "o")])
        == 2
    )
    said = capsys.readouterr().err
    assert "--merge: the adapters' base: model.path=" in said and "runs no model code" in said
    assert "--base MODEL" not in said


def test_a_refused_export_makes_no_directory(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run / "run", copy)
    with open(copy / "checkpoints" / "step_000002" / "model" / "trained.safetensors", "ab") as f:
        f.write(b"x")
    out = tmp_path / "new" / "a" / "b"
    assert main(["export", str(copy), "--step", "2", "--out", str(out)]) == 1
    assert "is incomplete or altered" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_killed_exports_temporary_copy_is_removed_by_the_next(run, tmp_path):
    """SIGKILL (or the OOM killer) leaves ``.OUT.tmp-PID`` with the weights written so far;
    the next export to OUT removes it. Another live process's is left alone, as is anything
    else beside OUT."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale, live = tmp_path / f".m.tmp-{dead.pid}", tmp_path / f".m.tmp-{os.getppid()}"
    others = [tmp_path / ".m.tmp-x", tmp_path / ".n.tmp-1", tmp_path / "m.tmp-2"]
    for made in [stale, live, *others]:
        made.mkdir()
        (made / "model.safetensors").write_bytes(b"weights")
    assert main(["export", str(run / "run"), "--out", str(tmp_path / "m")]) == 0
    assert not stale.exists()
    assert live.is_dir() and all(d.is_dir() for d in others)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapters"])
def test_a_sigterm_during_an_export_leaves_nothing_behind(run, tmp_path, merge):
    """SIGTERM's default action ended the export at once, leaving ``.m.tmp-PID`` with the
    weights written so far (gigabytes for a real model) and the parents made for ``--out``.
    The signal comes as the export logs a line of its writing, in its own process; it still
    ends by SIGTERM (exit status -15), having removed what it made."""
    out = tmp_path / "new" / "m"
    at = "export: weights" if merge else "export: the adapters"
    code = (
        "import os, signal, sys\n"
        "from dapo.api.exporting import export\n"
        "def log(line):\n"
        "    print(line, file=sys.stderr)\n"
        f"    if line.startswith({at!r}):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        f"export({str(run / 'run')!r}, {str(out)!r}, merge={merge}, log=log)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert at in done.stderr and "export: wrote" not in done.stderr
    assert list(tmp_path.iterdir()) == []
