"""Careless and hostile input, in one place: nothing dapo did not write is deleted, a run
directory is used by one run at a time, ranks die with their launcher, and checkpoints from
elsewhere are data, not code. Every case here was a real failure before it was fixed."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_scale_out import TINY

from dapo import cli
from dapo.dist import dcp
from dapo.models import policy
from dapo.run.lock import RunLock
from dapo.train import loop

ROOT = Path(__file__).resolve().parents[1]


class Started(Exception):
    """Raised in place of training: every check passed and the run started."""


@pytest.fixture
def no_training(monkeypatch):
    """The policy "loads" at once and training stops at its first line."""

    def refuse(*_a, **_k):
        raise Started

    monkeypatch.setattr(policy, "load_policy", lambda cfg, pairs, tokenizer: (None, tokenizer))
    monkeypatch.setattr(loop, "fit", refuse)


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("dapo: error: "), err
    return err


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with its text (the lock file aside: who last held it)."""
    return {
        str(p.relative_to(path)): p.read_text() if p.is_file() else "/"
        for p in sorted(path.rglob("*"))
        if p.name != ".dapo-lock"
    }


def _a_run(tmp_path: Path, name: str = "r") -> Path:
    with pytest.raises(Started):
        cli.main(["train", f"run.out_dir={tmp_path}", f"run.name={name}"])
    run = tmp_path / name
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    return run


# --- run directories -----------------------------------------------------------------------------


def test_a_run_name_that_leaves_out_dir_is_refused_and_nothing_deleted(tmp_path, capsys):
    keep = tmp_path / "a" / "b" / "notes.txt"
    keep.parent.mkdir(parents=True)
    keep.write_text("mine")
    for name in ("..", ".", "x/y", "/etc"):
        code = cli.main(
            ["train", "--overwrite", "model.path=/nonexistent", f"run.out_dir={tmp_path}/a/b/c"]
            + [f"run.name={name}"]
        )
        assert code == 2
        assert "run.name must be one plain directory name" in _error(capsys)
    assert keep.read_text() == "mine" and not (tmp_path / "a" / "b" / "c").exists()


def test_overwrite_of_a_folder_dapo_did_not_create_is_refused(tmp_path, capsys, no_training):
    project = tmp_path / "myproject"
    project.mkdir()
    (project / "config.yaml").write_text("anything: 1\n")
    (project / "thesis.tex").write_text("precious")
    before = _tree(project)
    # A wrong model path is named first; the folder is never touched.
    args = ["train", "--overwrite", f"run.out_dir={tmp_path}", "run.name=myproject"]
    assert cli.main([*args, "model.path=/nonexistent"]) == 2
    assert "/nonexistent" in _error(capsys)
    # Every other check passes: the missing mark stops it, naming what is there.
    assert cli.main(args) == 2
    err = _error(capsys)
    assert "has no .dapo-run mark" in err and "config.yaml, thesis.tex" in err
    assert _tree(project) == before


def test_overwrite_with_a_typo_in_the_model_path_keeps_the_earlier_run(
    tmp_path, capsys, no_training
):
    run = _a_run(tmp_path)
    before = _tree(run)
    code = cli.main(
        ["train", "--overwrite", f"run.out_dir={tmp_path}", "run.name=r", "model.path=/nop"]
    )
    assert code == 2 and "/nop" in _error(capsys)
    assert _tree(run) == before


def test_overwrite_deletes_only_what_dapo_wrote(tmp_path, capsys, no_training):
    run = _a_run(tmp_path)
    (run / "notes.txt").write_text("mine")
    before = _tree(run)
    args = ["train", "--overwrite", f"run.out_dir={tmp_path}", "run.name=r"]
    assert cli.main(args) == 2
    assert "holds files dapo did not write: notes.txt" in _error(capsys)
    assert _tree(run) == before
    (run / "notes.txt").unlink()
    with pytest.raises(Started):
        cli.main(args)
    assert not (run / "metrics.jsonl").exists() and (run / ".dapo-run").is_file()
    assert not list(tmp_path.glob(".r.replaced-*"))  # the earlier run is gone once it started


def test_a_run_that_fails_before_it_starts_puts_the_earlier_run_back(
    tmp_path, monkeypatch, no_training
):
    run = _a_run(tmp_path)
    before = _tree(run)

    def out_of_memory(*_a, **_k):
        raise MemoryError("loading the policy")

    monkeypatch.setattr(policy, "load_policy", out_of_memory)
    with pytest.raises(MemoryError):
        cli.main(["train", "--overwrite", f"run.out_dir={tmp_path}", "run.name=r"])
    assert _tree(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_a_symlinked_run_directory_is_refused(tmp_path, capsys, no_training):
    elsewhere = _a_run(tmp_path, "real")
    (tmp_path / "link").symlink_to(elsewhere)
    assert cli.main(["train", "--overwrite", f"run.out_dir={tmp_path}", "run.name=link"]) == 2
    assert "is a symbolic link" in _error(capsys)
    assert (elsewhere / "metrics.jsonl").is_file()


def test_flags_and_overrides_mix_in_any_order(tmp_path, no_training):
    _a_run(tmp_path)
    with pytest.raises(Started):
        cli.main(["train", f"run.out_dir={tmp_path}", "--overwrite", "run.name=r", "--quiet"])
    assert "progress: plain" in (tmp_path / "r" / "config.yaml").read_text()


# --- one run at a time ---------------------------------------------------------------------------


def test_a_run_directory_in_use_is_refused_naming_the_process(tmp_path, capsys, no_training):
    run = _a_run(tmp_path)
    ckpt = run / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text('{"format_version": 1, "step": 1, "files": {}}')
    (run / "checkpoints" / "latest").write_text("step_000001\n")
    with RunLock(run):
        assert cli.main(["train", "--resume", str(run)]) == 2
        err = _error(capsys)
        assert f"run directory {run} is in use by process {os.getpid()} on host" in err
        assert cli.main(["train", "--overwrite", f"run.out_dir={tmp_path}", "run.name=r"]) == 2
        assert "is in use by process" in _error(capsys)
        assert (run / "metrics.jsonl").is_file()
    with pytest.raises(Started):  # free again
        cli.main(["train", "--resume", str(run)])


def test_the_lock_is_released_when_its_process_dies(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from dapo.run.lock import RunLock;"
         f"RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ValueError, match=f"in use by process {holder.pid}"):
        RunLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    RunLock(tmp_path).acquire().release()


# --- checkpoints from elsewhere ------------------------------------------------------------------


class _CreatesAFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _sharded_checkpoint(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    dcp.save(path, model, optimizer)
    return model, optimizer


def test_crafted_checkpoint_metadata_is_refused_and_runs_nothing(tmp_path):
    state = tmp_path / "state"
    model, _ = _sharded_checkpoint(state)
    fresh = torch.nn.Linear(3, 2)
    dcp.load(state, fresh, torch.optim.AdamW(fresh.parameters()))  # the real one loads
    assert torch.equal(fresh.weight, model.weight)

    marker = tmp_path / "pwned"
    evil = pickle.dumps(_CreatesAFile(marker))
    (state / ".metadata").write_bytes(evil)
    with pytest.raises(
        dcp.UnsafeCheckpointError,
        match="asks for io.open, which no torch.distributed checkpoint holds",
    ):
        dcp.load(state, fresh, torch.optim.AdamW(fresh.parameters()))
    assert not marker.exists()
    pickle.loads(evil)  # what torch's own reader (pickle.load) would have done
    assert marker.exists()


def test_checkpoint_metadata_pointing_outside_its_directory_is_refused(tmp_path):
    state = tmp_path / "state"
    _sharded_checkpoint(state)
    metadata = dcp.read_metadata((state / ".metadata").read_bytes(), "test")
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret"
    (state / ".metadata").write_bytes(pickle.dumps(metadata))
    fresh = torch.nn.Linear(3, 2)
    with pytest.raises(dcp.UnsafeCheckpointError, match="outside its directory"):
        dcp.load(state, fresh, torch.optim.AdamW(fresh.parameters()))


# --- ranks end with their launcher ---------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended; only its exit status remains


def test_ranks_end_when_the_launcher_is_killed(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += ["-m", "dapo", "train", *TINY, f"run.out_dir={tmp_path}", "run.name=r"]
    cmd += [f"embedded.cache_dir={tmp_path / 'cache'}", "train.steps=200", "run.threads=1"]
    cmd += ["train.save_every=1", "eval.every=0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    latest = tmp_path / "r" / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert latest.exists(), "no checkpoint within 2 minutes"
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    ranks = [int(pid) for pid in children]
    assert len(ranks) == 2 and all(_alive(pid) for pid in ranks)
    launcher.send_signal(signal.SIGKILL)
    _, err = launcher.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in ranks), "orphan ranks still running"
    written = latest.read_text()
    time.sleep(2)
    assert latest.read_text() == written  # and nothing writes the run any more
    assert json.loads((tmp_path / "r" / ".dapo-run").read_text())["run_id"]
