"""The run directory under review 26: a failed --overwrite start puts the earlier run back
before it lets its lock go (a start racing in could once make it delete that run), a replaced
run that cannot be deleted is named and the new run goes on, and a plain start in a directory
where a run is running is told that it is in use, by whom."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest
from helpers import Started, run_tree

from dapo import cli
from dapo.config import load_config
from dapo.run import asides, run_files, rundir
from dapo.run.lock import RunLock, in_use_by


def _cfg(out: Path, name: str = "r"):
    return load_config(None, [f"run.out_dir={out}", f"run.name={name}"])


def _a_run(out: Path, name: str = "r") -> Path:
    """A marked run with a config, metrics and a checkpoint, its lock let go."""
    plan = rundir.plan_new_run(_cfg(out, name))
    run = rundir.start_new_run(plan)
    plan.lock.release()
    (run / "config.yaml").write_text("run: {}\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_000001\n")
    return run


def _failed_overwrite(out: Path) -> rundir.NewRun:
    """An --overwrite start of ``out``/r that moved the earlier run aside and wrote its
    config.yaml (as a start does before its model loads), its lock held: about to fail."""
    plan = rundir.plan_new_run(_cfg(out), overwrite=True)
    rundir.start_new_run(plan)
    (plan.path / "config.yaml").write_text("run: {new: 1}\n")
    return plan


# --- 1. a failed --overwrite start: the earlier run back before the lock goes ------------------


def test_the_earlier_run_is_back_before_the_lock_goes(tmp_path, capsys):
    run = _a_run(tmp_path)
    before = run_tree(run)
    plan = _failed_overwrite(tmp_path)
    lock, release = plan.lock, plan.lock.release
    refused = []

    def release_then_race():
        names = sorted(p.name for p in tmp_path.iterdir())
        # The aborted start is out of the way and the earlier run back, the lock still held.
        assert names[0].startswith(".r.aborted-") and names[1:] == ["r"]
        assert run_tree(run) == before
        assert in_use_by(tmp_path / names[0]).startswith(f"process {os.getpid()} on host ")
        release()
        # A start of the same name racing in as the lock goes: the old undo removed, after
        # this, the run that the racer's put-back had just restored.
        asides.put_back(run)
        with pytest.raises(FileExistsError) as exc:
            rundir.plan_new_run(_cfg(tmp_path))
        refused.append(str(exc.value))

    lock.release = release_then_race
    rundir.undo_new_run(plan)
    assert refused == [
        f"run directory {run} already holds a run; continue it with "
        f"`dapo train --resume {run}`, replace it with --overwrite, or pick another run.name"
    ]
    assert run_tree(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    assert plan.lock is None and plan.aside is None
    assert "is put back" not in capsys.readouterr().out


def test_a_start_putting_the_earlier_run_back_between_the_renames_loses_nothing(
    tmp_path, monkeypatch, capsys
):
    run = _a_run(tmp_path)
    before = run_tree(run)
    plan = _failed_overwrite(tmp_path)
    rename, raced = os.rename, []

    def rename_then_race(src, dst):
        rename(src, dst)
        if Path(dst).name.startswith(".r.aborted-") and not raced:
            raced.append(dst)
            asides.put_back(run)  # the run directory is gone: the racer puts the run back

    monkeypatch.setattr(os, "rename", rename_then_race)
    rundir.undo_new_run(plan)
    monkeypatch.undo()
    assert len(raced) == 1
    assert "the earlier run it replaced, kept at" in capsys.readouterr().out
    assert run_tree(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    assert plan.lock is None and plan.aside is None


# --- 2. a replaced run that cannot be deleted --------------------------------------------------


def test_a_replaced_run_that_cannot_be_deleted_is_named_and_the_run_goes_on(
    tmp_path, monkeypatch, capsys, no_training
):
    run = _a_run(tmp_path)
    rmtree = shutil.rmtree

    def refused(path, *args, **kwargs):
        if ".deleting-" not in Path(path).name:
            return rmtree(path, *args, **kwargs)
        (path / "metrics.jsonl").unlink()  # cut short partway, as an immutable file does
        raise PermissionError(errno.EACCES, "Permission denied", str(path / "checkpoints"))

    monkeypatch.setattr(shutil, "rmtree", refused)
    with pytest.raises(Started):  # the new run goes on to train
        cli.main(["train", "--overwrite", f"run.out_dir={tmp_path}", "run.name=r"])
    (left,) = tmp_path.glob(".r.deleting-*")
    assert sorted(p.name for p in left.iterdir()) == [
        ".dapo-lock",
        ".dapo-run",
        "checkpoints",
        "config.yaml",
    ]
    err = capsys.readouterr().err
    assert (
        f"dapo: warning: the earlier run that this one replaced could not be deleted "
        f"(Permission denied: {left / 'checkpoints'}); what is left of it is at {left}. "
        f"Delete it yourself once that is fixed: rm -rf {left}\n"
    ) in err
    assert "Traceback" not in err and (run / ".dapo-run").is_file()
    assert not (run / "metrics.jsonl").exists()


# --- 3. a plain start where a run is running ---------------------------------------------------


def _in_use_text(run: Path) -> str:
    holder = json.loads((run / ".dapo-lock").read_text())
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
    return (
        f"run directory {run} is in use by process {os.getpid()} on host "
        f"{socket.gethostname()} (since {since}): one run at a time writes a run directory. "
        "Wait for that run to end (or stop it), then try again; to start a separate run, pick "
        "another run.name"
    )


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_start_where_a_run_is_running_is_told_who_runs_there(tmp_path, overwrite):
    run = _a_run(tmp_path)
    with RunLock(run):
        with pytest.raises(ValueError) as refused:
            rundir.plan_new_run(_cfg(tmp_path), overwrite=overwrite)
        assert str(refused.value) == _in_use_text(run)
    with pytest.raises(FileExistsError, match="already holds a run; continue it with"):
        rundir.plan_new_run(_cfg(tmp_path))  # once it is over


def test_the_command_line_says_it_is_in_use(tmp_path, capsys):
    run = _a_run(tmp_path)
    with RunLock(run):
        for dry in ([], ["--dry-run"]):
            assert cli.main(["train", f"run.out_dir={tmp_path}", "run.name=r", *dry]) == 2
            assert f"dapo: error: {_in_use_text(run)}\n" in capsys.readouterr().err


def test_a_resume_of_a_run_going_on_before_its_first_checkpoint_is_told_it_is_in_use(
    tmp_path, capsys
):
    """It was told the run "stopped before its first one; start it again with --overwrite"
    while that run was still going (found by an exploratory session, 2026-12-04)."""
    run = _a_run(tmp_path)
    shutil.rmtree(run / "checkpoints")  # going on, not yet saved
    run_files.write_config(run, _cfg(tmp_path))  # the demo's, as its start wrote it
    with RunLock(run):
        assert cli.main(["train", "--resume", str(run)]) == 2
        assert f"dapo: error: {_in_use_text(run)}\n" in capsys.readouterr().err
    assert cli.main(["train", "--resume", str(run)]) == 2  # it ended: nothing to resume
    assert (
        f"dapo: error: --resume {run}: no complete checkpoint there: it stopped before its "
        "first one; start it again with --overwrite\n"
    ) in capsys.readouterr().err
