"""``dapo eval`` of a torchrun checkpoint's ``model/``: config and tokenizer, its weights DCP
shards in the sibling ``state/``. transformers said only that no model.safetensors was there,
while the troubleshooting page listed such a directory as one to evaluate; now it is refused
before any model loads, naming the export that makes it one."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from dapo.cli import main
from dapo.models import policy
from dapo.models.demo import TinyModelSpec, tiny_qwen2
from dapo.run import sharded_checkpoint

# The checkpoint is written the torchrun way in one process, as intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)
WHY = (
    "is the config and tokenizer of a checkpoint written under torchrun, without its weights "
    "(DCP shards in the checkpoint's state/): export the checkpoint, `dapo export {run} --step "
    "{step} --out DIR` (with --merge for a LoRA run), and evaluate DIR"
)


@pytest.fixture()
def run_dir(tmp_path, tokenizer, monkeypatch):
    """A run whose checkpoint of step 3 was written the torchrun way (in one process), and no
    model that may load: the refusal comes first."""
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = tmp_path / "run"
    run.mkdir()
    sharded_checkpoint.save(
        run,
        step=3,
        model=model,
        tokenizer=tokenizer,
        optimizer=opt,
        trainer_state={"sampler": {"epoch": 0, "pos": 3}},
        keep=3,
    )

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(policy, "load_policy", no_load)
    rows = [{"question": f"{n} + 1 = ?", "answer": str(n + 1)} for n in (1, 2)]
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


def _eval(capsys, run: Path, *args: str) -> tuple[int, str]:
    """``dapo eval ARGS`` on the two problems beside ``run`` (arith would build the warm-up)."""
    capsys.readouterr()
    code = main(["eval", *args, "--data", str(run.parent / "two.jsonl"), "--k", "2"])
    return code, capsys.readouterr().err


def test_a_torchrun_checkpoints_model_dir_is_refused_naming_the_export(
    run_dir, tmp_path, capsys, monkeypatch
):
    model_dir = run_dir / "checkpoints" / "step_000003" / "model"
    assert (model_dir / "config.json").is_file() and (model_dir.parent / "state").is_dir()
    assert not list(model_dir.glob("*.safetensors"))  # the layout this refusal is about
    code, err = _eval(capsys, run_dir, str(model_dir), "--out", str(tmp_path / "ev"))
    assert code == 2
    assert err == f"dapo: error: {model_dir} {WHY.format(run=run_dir, step=3)}\n"
    assert not (tmp_path / "ev").exists()
    # A relative path names the run as the user would type it.
    monkeypatch.chdir(tmp_path)
    code, err = _eval(capsys, run_dir, "run/checkpoints/step_000003/model")
    relative = f"run/checkpoints/step_000003/model {WHY.format(run='run', step=3)}"
    assert (code, err) == (2, f"dapo: error: {relative}\n")
    # From inside the checkpoint's model/ ("." has no parent of its own).
    monkeypatch.chdir(model_dir)
    code, err = _eval(capsys, run_dir, ".")
    assert (code, err) == (2, f"dapo: error: . {WHY.format(run='../../..', step=3)}\n")


def test_both_sides_of_compare_and_a_moved_checkpoint_are_refused(run_dir, tmp_path, capsys):
    model_dir = run_dir / "checkpoints" / "step_000003" / "model"
    out = tmp_path / "cmp"
    code, err = _eval(
        capsys, run_dir, "--compare", str(model_dir), str(model_dir), "--out", str(out)
    )
    assert code == 2
    assert err == f"dapo: error: {model_dir} {WHY.format(run=run_dir, step=3)}\n"
    assert not out.exists()
    # Out of its run directory there is no run or step to name.
    moved = tmp_path / "copy"
    shutil.copytree(model_dir.parent, moved)
    code, err = _eval(capsys, run_dir, str(moved / "model"))
    generic = WHY.format(run="RUN_DIR", step="N")
    assert (code, err) == (2, f"dapo: error: {moved / 'model'} {generic}\n")


def test_compare_refuses_side_b_before_side_a_is_sampled(run_dir, tmp_path, capsys):
    """--compare GOOD CKPT/model sampled every problem of A (minutes on a real model) before
    B was refused: both sides are checked first."""
    model_dir = run_dir / "checkpoints" / "step_000003" / "model"
    out = tmp_path / "cmp"
    code, err = _eval(capsys, run_dir, "--compare", "embedded", str(model_dir), "--out", str(out))
    assert code == 2
    assert err == f"dapo: error: {model_dir} {WHY.format(run=run_dir, step=3)}\n"
    assert not out.exists()  # A was not evaluated
