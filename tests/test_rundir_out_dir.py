"""A start that fails before its run starts removes run.out_dir again when it made it and it is
still empty (it stayed behind, empty, after a refused start); one it found, or one where
another run started meanwhile, stays."""

from __future__ import annotations

from pathlib import Path

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
