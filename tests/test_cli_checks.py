"""Up-front checks: every mistake in the command is reported before any model is loaded, with
the field or path and the fix, and nothing that dapo did not write is ever deleted."""

import errno
import importlib.util
import re
import shutil
from collections import namedtuple

import pytest
from helpers import fake_checkpoint

from dapo import cli
from dapo.config import load_config
from dapo.extras import pip_install
from dapo.models import policy
from dapo.run import disk_space, rundir
from dapo.training import loop


class ModelLoaded(Exception):
    """Raised in place of training: reaching it means every check passed and the run started
    (its directory made, its config written, the policy "loaded")."""


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    def refuse(*_a, on_resume=None, **_k):
        if on_resume is not None:  # a resumed run's checkpoint read: its config is written
            on_resume()
        raise ModelLoaded

    monkeypatch.setattr(policy, "load_policy", lambda cfg, pairs, tokenizer, **_: (None, tokenizer))
    monkeypatch.setattr(loop, "fit", refuse)


def _train(tmp_path, *args, name="r"):
    return cli.main(["train", f"run.out_dir={tmp_path}", f"run.name={name}", *args])


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("dapo: error: ")
    return err


def test_all_invalid_values_are_reported_together_and_nothing_is_created(tmp_path, capsys):
    code = _train(tmp_path, "rollout.group_size=1", "optim.lr=-1", "train.keep_checkpoints=0")
    assert code == 2
    err = _error(capsys)
    assert "rollout.group_size must be >= 2" in err
    assert "optim.lr must be > 0" in err
    assert "train.keep_checkpoints must be >= 1" in err
    assert not (tmp_path / "r").exists()


def test_a_directory_holding_a_run_is_refused_unless_overwrite(tmp_path, capsys):
    with pytest.raises(ModelLoaded):
        _train(tmp_path)
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 0}\n')
    assert _train(tmp_path) == 2
    err = _error(capsys)
    assert f"run directory {tmp_path / 'r'} already holds a run" in err
    assert f"dapo train --resume {tmp_path / 'r'}" in err and "--overwrite" in err
    with pytest.raises(ModelLoaded):
        _train(tmp_path, "--overwrite")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # the old run is gone
    assert (tmp_path / "r" / "config.yaml").is_file()


def test_overwrite_never_deletes_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "thesis.tex").write_text("precious")
    assert _train(tmp_path, "--overwrite") == 2
    assert "not empty and holds no dapo run" in _error(capsys)
    assert (tmp_path / "r" / "thesis.tex").read_text() == "precious"


def test_full_disk_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(2**30, 2**30 - 2**20, 2**20))
    assert _train(tmp_path) == 2
    err = _error(capsys)
    assert "has 1 MiB free, but checkpointing needs about" in err and "run.out_dir" in err


def test_a_resume_needs_room_for_one_more_checkpoint_a_new_run_for_two(tmp_path, monkeypatch):
    # A resume's latest checkpoint is on the disk already: room for the next one is enough
    # (the full-disk advice says to delete older checkpoints, and the resume must then start).
    cfg = load_config()
    one = disk_space.estimate_checkpoint_bytes(cfg, None)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(2**40, 0, one * 3 // 2))
    disk_space.check_space(tmp_path, cfg, None, resume=True)
    with pytest.raises(ValueError, match=r"needs about \d+ MiB \(two checkpoints of weights"):
        disk_space.check_space(tmp_path, cfg, None)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(2**40, 0, one - 1))
    with pytest.raises(ValueError, match=r"\(one more checkpoint of weights and optimiser"):
        disk_space.check_space(tmp_path, cfg, None, resume=True)


def test_unwritable_run_directory_is_refused(tmp_path, capsys, monkeypatch):
    def read_only(_fd):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(rundir.os, "fsync", read_only)
    assert _train(tmp_path) == 2
    assert "is not writable (Read-only file system)" in _error(capsys)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["train", f"run.out_dir={blocker}", "run.name=r"]) == 2
    assert f"{blocker} is a file, not a directory; choose another run.out_dir" in _error(capsys)


def test_missing_model_directory_is_refused_before_loading(tmp_path, capsys):
    assert _train(tmp_path, f"model.path={tmp_path / 'nope'}") == 2
    assert "is not a Hugging Face model directory (no config.json)" in _error(capsys)


def test_a_lora_adapter_directory_as_model_path_names_the_merged_export(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert _train(tmp_path, f"model.path={adapter}") == 2
    assert "is a LoRA adapter directory" in (err := _error(capsys))
    assert "dapo export RUN --merge --out DIR" in err


def test_the_vllm_engine_without_vllm_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert _train(tmp_path, "rollout.engine=vllm") == 2
    hint = f"rollout.engine=vllm needs vLLM (Python >= 3.11): {pip_install('vllm')}"
    assert hint in _error(capsys)


def _a_run_with_a_checkpoint(tmp_path):
    with pytest.raises(ModelLoaded):
        _train(tmp_path)
    run = tmp_path / "r"
    fake_checkpoint(run)
    return run


def test_resume_refuses_a_changed_run_and_lists_the_fields(tmp_path, capsys):
    run = _a_run_with_a_checkpoint(tmp_path)
    assert cli.main(["train", "--resume", str(run), "optim.lr=1e-5", "rollout.group_size=8"]) == 2
    err = _error(capsys)
    assert "optim.lr: 0.0003 -> 1e-05" in err and "rollout.group_size: 16 -> 8" in err
    assert "--force" in err
    # Changing only where/how often things are written, or extending the run, is accepted.
    with pytest.raises(ModelLoaded):
        cli.main(["train", "--resume", str(run), "train.steps=500", "run.threads=1"])
    with pytest.raises(ModelLoaded):
        cli.main(["train", "--resume", str(run), "optim.lr=1e-5", "--force"])
    assert "lr: 1.0e-05" in (run / "config.yaml").read_text()
    assert "lr: 0.0003" in (run / "config.before-resume-1.yaml").read_text()


def test_a_preset_on_resume_changes_the_algorithm_and_a_base_is_refused(tmp_path, capsys):
    """The saved config.yaml lists every field: --preset grpo on --resume renamed the run
    and left DAPO's switches (eps_high 0.28, token-mean, no KL, dynamic sampling) in place."""
    run = _a_run_with_a_checkpoint(tmp_path)
    assert cli.main(["train", "--resume", str(run), "--preset", "grpo"]) == 2
    err = _error(capsys)
    assert "algo.eps_high: 0.28 -> 0.2" in err and "sampling.dynamic: True -> False" in err
    with pytest.raises(ModelLoaded):
        cli.main(["train", "--resume", str(run), "--preset", "grpo", "--force"])
    saved = (run / "config.yaml").read_text()
    assert "preset: grpo" in saved and "eps_high: 0.2\n" in saved and "dynamic: false" in saved
    assert cli.main(["train", "--resume", str(run), "--base", "paper", "--force"]) == 2
    assert "run.base 'demo' -> 'paper' would change the run's label only" in _error(capsys)


def test_resume_needs_a_run_with_a_checkpoint(tmp_path, capsys):
    assert cli.main(["train", "--resume", str(tmp_path)]) == 2
    assert "not a dapo run directory (no config.yaml)" in _error(capsys)
    with pytest.raises(ModelLoaded):
        _train(tmp_path)
    assert cli.main(["train", "--resume", str(tmp_path / "r")]) == 2
    assert "no complete checkpoint there" in _error(capsys)
    assert cli.main(["train", "--resume", str(tmp_path / "r"), "--overwrite"]) == 2
    assert "give one" in _error(capsys)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--world-size", "4"], "--world-size plans memory with --dry-run only"),
        (["--force"], "--force accepts config changes on --resume only"),
        (["--print-config", "--dry-run"], "--print-config prints the config and exits"),
    ],
)
def test_a_flag_that_would_do_nothing_is_refused(tmp_path, capsys, flags, message):
    """--world-size without --dry-run, --force without --resume and --dry-run beside
    --print-config were silently ignored (a run of 1 process; no dry run)."""
    assert _train(tmp_path, *flags) == 2
    assert message in _error(capsys)
    assert not (tmp_path / "r").exists()


def test_a_resume_asks_for_at_least_its_latest_checkpoints_size(tmp_path, monkeypatch):
    # Rollouts drawn ahead of training (train.async_staleness) sit in every checkpoint, and
    # no estimate from the weights sees them: the latest checkpoint on disk says how big the
    # next one is.
    cfg = load_config()
    one = disk_space.estimate_checkpoint_bytes(cfg, None)
    latest = tmp_path / "checkpoints" / "step_000004"
    latest.mkdir(parents=True)
    (latest / "rollouts.safetensors").write_bytes(b"\0" * (3 * one))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(2**40, 0, 2 * one))
    disk_space.check_space(tmp_path, cfg, None, resume=True)  # the estimate alone fits
    need = f"needs about {3 * one / 2**20:.0f} MiB (one more checkpoint of weights"
    with pytest.raises(ValueError, match=re.escape(need)):
        disk_space.check_space(tmp_path, cfg, None, resume=True, latest=latest)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(2**40, 0, 3 * one))
    disk_space.check_space(tmp_path, cfg, None, resume=True, latest=latest)
