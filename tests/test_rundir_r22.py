"""The run directory under review 22: --overwrite checks every entry it would delete (not only
the top level), an earlier run left aside by a killed --overwrite start is put back, starts of
one name at once leave one winner and tell the other who holds it, automatic names never
collide, printed commands quote their paths, and a resume that cannot write says to copy."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import RESUMABLE_DEMO, Started, finish_run, run_tree, start_run

from dapo import cli
from dapo.config import load_config
from dapo.run import checkpoint, launcher, manifest, own_files, rundir

ROOT = Path(__file__).resolve().parents[1]


def _cfg(out: Path, name: str = "r"):
    return load_config(None, [f"run.out_dir={out}", f"run.name={name}"])


def _finished_run(out: Path, name: str = "r") -> Path:
    """A marked run with what a finished one holds: a checkpoint with its manifest, model/
    and tensorboard/ as dapo writes them."""
    run = out / name
    plan = rundir.plan_new_run(_cfg(out, name))
    rundir.start_new_run(plan)
    plan.lock.release()
    (run / "config.yaml").write_text("run: {}\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    ckpt = run / "checkpoints" / "step_000001"
    for rel in ("model/config.json", "model/tokenizer.json", "model/chat_template.jinja"):
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_text("{}")
    (ckpt / "trainer.json").write_text("{}")
    manifest.write(ckpt, checkpoint.FORMAT_VERSION, 1, None)
    (run / "checkpoints" / "latest").write_text("step_000001\n")
    (run / "checkpoints" / ".tmp-step_000002-123").mkdir()  # a save cut short
    (run / "model").mkdir()
    for name_ in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        (run / "model" / name_).write_text("x")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1796098503.vm.15712.0").write_text("e")
    return run


# --- 1. --overwrite checks in depth -------------------------------------------------------------


@pytest.mark.parametrize(
    ("planted", "named"),
    [
        ("model/NOTES.md", "model/NOTES.md"),
        ("checkpoints/best-by-hand/weights.bin", "checkpoints/best-by-hand"),
        ("tensorboard/my-other-events.txt", "tensorboard/my-other-events.txt"),
        ("checkpoints/step_000001/extra.txt", "checkpoints/step_000001/extra.txt"),
        ("checkpoints/step_000001/model/mine/a.txt", "checkpoints/step_000001/model/mine"),
        ("model/additional_chat_templates/x.txt", "model/additional_chat_templates/x.txt"),
        ("checkpoints/latest.bak", "checkpoints/latest.bak"),
    ],
)
def test_overwrite_refuses_a_user_file_deep_in_a_run(tmp_path, planted, named):
    run = _finished_run(tmp_path)
    (run / planted).parent.mkdir(parents=True, exist_ok=True)
    (run / planted).write_text("mine")
    before = run_tree(run)
    with pytest.raises(ValueError) as refused:
        rundir.plan_new_run(_cfg(tmp_path), overwrite=True)
    assert str(refused.value) == (
        f"--overwrite: {run} holds files dapo did not write: {named}. Move them out of it "
        "first (dapo deletes only what it wrote), or pick another run.name"
    )
    assert run_tree(run) == before


def test_overwrite_of_the_reviewers_run_keeps_every_user_file(tmp_path, capsys, no_training):
    run = _finished_run(tmp_path)
    planted = ["model/NOTES.md", "checkpoints/best-by-hand/w.bin", "tensorboard/mine.txt"]
    for rel in planted:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text("mine")
    before = run_tree(run)
    args = ["train", "--overwrite", f"run.out_dir={tmp_path}", "run.name=r"]
    for rel in planted:
        assert cli.main(args) == 2
        assert "holds files dapo did not write: " in capsys.readouterr().err
        assert run_tree(run) == before
        (run / rel).unlink()
        if rel.startswith("checkpoints/"):
            (run / rel).parent.rmdir()  # an empty directory of the user's is refused too
        before = run_tree(run)
    with pytest.raises(Started):  # only dapo's files left: replaced
        cli.main(args)
    assert not (run / "checkpoints").exists() and (run / ".dapo-run").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # the earlier run is gone


def test_overwrite_names_every_user_file_in_one_refusal(tmp_path):
    """It named one place per attempt (a top-level file, else the first file deeper): a run
    holding files of the user's in three places took three refused starts to list them."""
    run = _finished_run(tmp_path)
    planted = [
        "notes.txt",
        "model/NOTES.md",
        "checkpoints/best-by-hand/w.bin",
        "checkpoints/step_000001/extra.txt",
        "tensorboard/mine.txt",
    ]
    for rel in planted:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text("mine")
    with pytest.raises(ValueError) as refused:
        rundir.plan_new_run(_cfg(tmp_path), overwrite=True)
    named = [
        "checkpoints/best-by-hand",  # a directory of the user's: named, not looked into
        "checkpoints/step_000001/extra.txt",
        "model/NOTES.md",
        "notes.txt",
        "tensorboard/mine.txt",
    ]
    assert f"holds files dapo did not write: {', '.join(named)}. Move them" in str(refused.value)


def test_a_link_in_a_run_is_not_dapo_s_and_is_refused(tmp_path, no_training):
    run = _finished_run(tmp_path)
    (run / "model" / "tokenizer.model").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"did not write: model/tokenizer\.model\. Move"):
        rundir.plan_new_run(_cfg(tmp_path), overwrite=True)


def test_the_walk_is_bounded(tmp_path, monkeypatch):
    run = _finished_run(tmp_path)
    for k in range(30):
        (run / "tensorboard" / f"events.out.tfevents.{k}").write_text("e")
    monkeypatch.setattr(own_files, "WALK_LIMIT", 20)
    with pytest.raises(ValueError, match=r"holds more than 20 entries, more than dapo checks"):
        rundir.plan_new_run(_cfg(tmp_path), overwrite=True)
    (run / "notes.txt").write_text("mine")  # named even so: the top level was listed whole
    with pytest.raises(ValueError, match=r"holds files dapo did not write: notes.txt\. Move"):
        rundir.plan_new_run(_cfg(tmp_path), overwrite=True)
    (run / "notes.txt").unlink()
    monkeypatch.setattr(own_files, "WALK_LIMIT", 1000)
    assert rundir.plan_new_run(_cfg(tmp_path), overwrite=True).replaces


def test_a_file_put_in_the_aside_meanwhile_keeps_it(tmp_path, capsys):
    run = _finished_run(tmp_path)
    plan = rundir.plan_new_run(_cfg(tmp_path), overwrite=True)
    rundir.start_new_run(plan)
    aside = plan.aside
    (aside / "model" / "NOTES.md").write_text("mine")
    rundir.finish_replacing(plan)
    assert (aside / "model" / "NOTES.md").read_text() == "mine"
    assert f"dapo: warning: {aside} holds files dapo did not write (model/NOTES.md)" in (
        capsys.readouterr().out
    )
    plan.lock.release()
    assert run.is_dir()


# --- 2. an --overwrite start killed before its run began ----------------------------------------


_KILLED_START = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from dapo.config import load_config
from dapo.run import rundir
cfg = load_config(None, ["run.out_dir={out}", "run.name=r"])
rundir.start_new_run(rundir.plan_new_run(cfg, overwrite=True))
print("started", flush=True)
if {wait}:
    time.sleep(60)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _overwrite_start(out: Path, *, wait: bool) -> subprocess.Popen:
    code = _KILLED_START.format(root=str(ROOT), out=str(out), wait=wait)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_killed_overwrite_start_puts_the_earlier_run_back_on_resume(tmp_path, capsys):
    run = _finished_run(tmp_path)
    before = run_tree(run)
    proc = _overwrite_start(tmp_path, wait=False)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    (aside,) = tmp_path.glob(".r.replaced-*")
    assert sorted(p.name for p in run.iterdir()) == [".dapo-lock", ".dapo-run"]
    assert rundir.existing_run_dir(run) == run
    assert f"the earlier run it replaced, kept at {aside}, is put back" in capsys.readouterr().out
    assert run_tree(run) == before and sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_a_killed_overwrite_start_puts_the_earlier_run_back_on_a_new_start(tmp_path, capsys):
    run = _finished_run(tmp_path)
    before = run_tree(run)
    proc = _overwrite_start(tmp_path, wait=False)
    proc.communicate(timeout=60)
    with pytest.raises(FileExistsError, match="already holds a run; continue it with"):
        rundir.plan_new_run(_cfg(tmp_path))
    assert "is put back" in capsys.readouterr().out
    assert run_tree(run) == before and not list(tmp_path.glob(".r.replaced-*"))


def test_a_live_start_keeps_its_aside_and_is_named(tmp_path, capsys):
    run = _finished_run(tmp_path)
    proc = _overwrite_start(tmp_path, wait=True)
    try:
        assert "is kept at" in proc.stdout.readline()
        assert proc.stdout.readline().strip() == "started"
        with pytest.raises(ValueError, match=f"is in use by process {proc.pid} on host"):
            rundir.plan_new_run(_cfg(tmp_path))
        with pytest.raises(ValueError, match=f"is in use by process {proc.pid} on host"):
            rundir.existing_run_dir(run)
        assert len(list(tmp_path.glob(".r.replaced-*"))) == 1
    finally:
        proc.kill()
        proc.wait()
    assert "put back" not in capsys.readouterr().out


def test_an_aside_beside_a_run_that_started_since_is_named_not_moved(tmp_path, capsys):
    run = _finished_run(tmp_path)
    aside = tmp_path / ".r.replaced-0123abcd"
    shutil.copytree(run, aside)
    with pytest.raises(FileExistsError, match="already holds a run"):
        rundir.plan_new_run(_cfg(tmp_path))
    out = capsys.readouterr().out
    assert f"dapo: warning: {aside} holds the earlier run that --overwrite replaced" in out
    assert f"(rm -rf {aside})" in out and aside.is_dir()


def test_an_aborted_start_says_so_to_a_start_and_a_resume(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / ".dapo-run").write_text("{}\n")
    (run / ".dapo-lock").write_text("")
    with pytest.raises(FileExistsError) as new:
        rundir.plan_new_run(_cfg(tmp_path))
    assert str(new.value) == (
        f"run directory {run} holds only a start that was interrupted before it wrote its "
        "config.yaml (dapo's mark and lock): there is no run to continue; start it again with "
        "--overwrite, or pick another run.name"
    )
    with pytest.raises(ValueError) as resume:
        rundir.existing_run_dir(run)
    assert str(resume.value) == (
        f"--resume {run}: it holds only a start that was interrupted before it wrote its "
        "config.yaml: there is no run to resume; start it again with the same command and "
        "--overwrite"
    )
    assert rundir.plan_new_run(_cfg(tmp_path), overwrite=True).replaces


def test_a_directory_holding_only_a_dead_start_s_lock_is_taken(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / ".dapo-lock").write_text('{"pid": 1, "host": "h", "since": 0}\n')
    (run / ".write-test-99999").write_text("ok")
    plan = rundir.plan_new_run(_cfg(tmp_path))
    assert rundir.start_new_run(plan) == run and (run / ".dapo-run").is_file()
    plan.lock.release()


# --- 3. starts of one name at once --------------------------------------------------------------


def _start_one(out: str, name: str, barrier, results) -> None:
    cfg = load_config(None, [f"run.out_dir={out}", *([f"run.name={name}"] if name else [])])
    barrier.wait()
    try:
        plan = rundir.plan_new_run(cfg)
        rundir.start_new_run(plan)
        results.put(f"ok {plan.path.name}")
    except Exception as exc:  # what the loser is told
        results.put(f"{type(exc).__name__}: {exc}")
    barrier.wait()  # the winner holds its lock until every start has tried


def _race(out: Path, name: str, n: int) -> list[str]:
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_start_one, args=(str(out), name, barrier, results)) for _ in range(n)
    ]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return got


def test_two_starts_of_one_name_leave_one_winner_and_name_it_to_the_other(tmp_path):
    for i in range(20):
        loser, winner = _race(tmp_path, f"run{i}", 2)
        assert winner == f"ok run{i}", (loser, winner)
        assert loser.startswith(
            f"ValueError: run directory {tmp_path / f'run{i}'} is in use by process "
        ), loser
        held = sorted(p.name for p in (tmp_path / f"run{i}").iterdir())
        assert held == [".dapo-lock", ".dapo-run"]


def test_automatic_names_started_in_one_second_are_all_different(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260101-000000")
    got = _race(tmp_path, "", 3)
    base = "dapo-20260101-000000"
    assert got == [f"ok {base}", f"ok {base}-2", f"ok {base}-3"]
    plans = [rundir.plan_new_run(load_config(None, [f"run.out_dir={tmp_path}"])) for _ in "ab"]
    assert [rundir.start_new_run(p).name for p in plans] == [f"{base}-4", f"{base}-5"]


# --- 4. printed commands quote their paths ------------------------------------------------------


def test_resume_commands_quote_a_path_with_spaces(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert launcher.resume_command("/tmp/x/sp dir/my run") == (
        "dapo train --resume '/tmp/x/sp dir/my run'"
    )
    assert launcher.resume_command(Path("runs/r")) == "dapo train --resume runs/r"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "h")
    assert (
        launcher.resume_command("a b") == "torchrun --nproc-per-node 2 -m dapo train --resume 'a b'"
    )
    run = _finished_run(tmp_path, "my run")
    with pytest.raises(FileExistsError) as held:
        rundir.plan_new_run(_cfg(tmp_path, "my run"))
    assert f"continue it with `dapo train --resume '{run}'`" in str(held.value)


# --- 5. a resume that cannot write -------------------------------------------------------------


def test_an_unwritable_resume_says_to_copy_the_run(tmp_path, monkeypatch):
    run = tmp_path / "sp dir"
    run.mkdir()

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(rundir, "open_binary", read_only)
    with pytest.raises(ValueError) as resumed:
        rundir.check_writable(run)
    assert str(resumed.value) == (
        f"run directory {run} is not writable (Read-only file system); fix its permissions, "
        f"or copy the run directory to a writable place and resume the copy: cp -a '{run}' "
        "COPY && dapo train --resume COPY"
    )
    with pytest.raises(
        ValueError, match=r"\(Read-only file system\); fix its permissions or set run\.out_dir"
    ):
        rundir.check_writable(run, new=True)


def test_the_write_probe_is_the_process_s_own_and_never_follows_a_link(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / f".write-test-{os.getpid()}").symlink_to(victim)
    with pytest.raises(ValueError, match=rf"\.write-test-{os.getpid()} is a symbolic link"):
        rundir.check_writable(run)
    assert victim.read_text() == "precious\n"
    (run / ".write-test").write_text("another process's probe")
    (run / f".write-test-{os.getpid()}").unlink()
    rundir.check_writable(run)
    assert sorted(p.name for p in run.iterdir()) == [".write-test"]


def test_a_copied_run_directory_resumes(tmp_path, demo_cache):
    proc = start_run(tmp_path, "r", demo_cache, [*RESUMABLE_DEMO, "train.steps=1"], "run.threads=1")
    code, _, err = finish_run(proc)
    assert code == 0, err
    copy = tmp_path / "elsewhere" / "copy of r"
    shutil.copytree(tmp_path / "r", copy, symlinks=True)
    before = run_tree(tmp_path / "r")
    proc = start_run(tmp_path, "r", demo_cache, [], "--resume", str(copy), "train.steps=2")
    code, out, err = finish_run(proc)
    assert code == 0, err
    assert f"run directory: {copy}" in out
    steps = [json.loads(x)["step"] for x in (copy / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2 and (copy / "checkpoints" / "step_000002").is_dir()
    assert run_tree(tmp_path / "r") == before  # the original is untouched
