"""A start that fails before its run starts removes run.out_dir again when it made it and it is
still empty (it stayed behind, empty, after a refused start); one it found, or one where
another run started meanwhile, stays."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo.config import load_config
from dapo.run import rundir


def _opened(out: Path, name: str = "r") -> rundir.NewRun:
    plan = rundir.plan_new_run(load_config(None, [f"run.out_dir={out}", f"run.name={name}"]))
    rundir.start_new_run(plan)
    return plan


def test_a_failed_start_removes_the_out_dir_it_made(tmp_path):
    out = tmp_path / "made" / "deeper" / "runs"
    plan = _opened(out)
    assert plan.made_parents == [out, out.parent, out.parent.parent]
    rundir.undo_new_run(plan)
    assert list(tmp_path.iterdir()) == []


def test_an_out_dir_it_found_stays(tmp_path):
    out = tmp_path / "runs"
    out.mkdir()
    plan = _opened(out / "sub")
    assert plan.made_parents == [out / "sub"]
    rundir.undo_new_run(plan)
    assert list(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []


def test_an_out_dir_where_another_run_started_meanwhile_stays(tmp_path):
    out = tmp_path / "made" / "runs"
    plan = _opened(out)
    other = _opened(out, "other")
    assert other.made_parents == []
    rundir.undo_new_run(plan)
    assert sorted(p.name for p in out.iterdir()) == ["other"]
    other.lock.release()


def test_a_user_s_empty_run_directory_keeps_its_parents(tmp_path):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)  # taken as it is: the start made neither it nor runs/
    plan = _opened(run.parent)
    assert not plan.created and plan.made_parents == []
    rundir.undo_new_run(plan)
    assert run.is_dir() and list(run.iterdir()) == []


def test_an_out_dir_through_dotdot_removes_only_what_it_made(tmp_path):
    """run.out_dir is joined, not resolved: a/../b with a missing and the user's b there made
    a alone; a guess by what existed counted b as made and removed it."""
    (tmp_path / "b").mkdir()
    plan = _opened(tmp_path / "a" / ".." / "b")
    assert plan.made_parents == [tmp_path / "a"]
    rundir.undo_new_run(plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_a_start_refused_as_it_starts_removes_its_out_dir(tmp_path, monkeypatch):
    def unwritable(run_dir, *, new=False):
        raise ValueError(f"run directory {run_dir} is not writable")

    monkeypatch.setattr(rundir, "check_writable", unwritable)
    cfg = load_config(None, [f"run.out_dir={tmp_path / 'runs'}", "run.name=r"])
    with pytest.raises(ValueError, match="is not writable"):
        rundir.start_new_run(rundir.plan_new_run(cfg))
    assert list(tmp_path.iterdir()) == []


def test_an_out_dir_removed_by_another_start_is_made_again_and_counted_once(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    mkdir, removed = Path.mkdir, []

    def removed_first(path, *args, **kwargs):
        if path == out / "r" and not removed:  # another start's undo, just before this mkdir
            removed.append(out.rmdir())
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", removed_first)
    plan = _opened(out)
    assert removed and plan.created and plan.made_parents == [out]
    rundir.undo_new_run(plan)
    assert list(tmp_path.iterdir()) == []
