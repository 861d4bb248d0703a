"""Careless and hostile input, in one place: nothing dapo did not write is deleted, a run
directory is used by one run at a time, ranks die with their launcher, and checkpoints from
elsewhere are data, not code. Every case here was a real failure before it was fixed."""

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import Started, fake_checkpoint, save_model
from test_scale_out import TINY

from dapo import cli
from dapo.config import load_config
from dapo.dist import dcp
from dapo.models import policy
from dapo.run import rundir
from dapo.run.lock import RunLock

ROOT = Path(__file__).resolve().parents[1]


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


def test_a_failed_start_in_a_directory_the_user_made_keeps_it(tmp_path, monkeypatch, no_training):
    (tmp_path / "r").mkdir()  # made by the user, empty: a new run may go there

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt  # Ctrl-C during the warm-start

    monkeypatch.setattr(policy, "load_policy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["train", f"run.out_dir={tmp_path}", "run.name=r"])
    assert (tmp_path / "r").is_dir() and list((tmp_path / "r").iterdir()) == []
    with pytest.raises(KeyboardInterrupt):  # a directory it made is removed
        cli.main(["train", f"run.out_dir={tmp_path}", "run.name=new"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


def test_a_run_refused_by_the_lock_removes_nothing_of_the_run_holding_it(tmp_path):
    # Two runs started at once under one name: both planned an empty directory; the first
    # made it and holds its lock. The second's undo once removed the first's live directory.
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "run.name=r"])
    first, second = rundir.plan_new_run(cfg), rundir.plan_new_run(cfg)
    run = rundir.start_new_run(first)
    held = sorted(p.name for p in run.iterdir())
    with pytest.raises(ValueError, match="in use by process"):
        rundir.start_new_run(second)
    assert sorted(p.name for p in run.iterdir()) == held and first.lock is not None
    rundir.undo_new_run(first)
    assert not run.exists()


def test_a_symlinked_run_directory_is_refused(tmp_path, capsys, no_training):
    elsewhere = _a_run(tmp_path, "real")
    (tmp_path / "link").symlink_to(elsewhere)
    assert cli.main(["train", "--overwrite", f"run.out_dir={tmp_path}", "run.name=link"]) == 2
    assert "is a symbolic link" in _error(capsys)
    assert (elsewhere / "metrics.jsonl").is_file()


@pytest.mark.parametrize("out", ["afile", "afile/x"])
def test_an_out_dir_under_a_file_is_refused_by_the_dry_run_too(tmp_path, capsys, out):
    """The dry run called such a run valid; the run then failed with "File exists"."""
    (tmp_path / "afile").write_text("mine")
    for dry in (["--dry-run"], []):
        assert cli.main(["train", f"run.out_dir={tmp_path / out}", *dry]) == 2
        assert f"{tmp_path / 'afile'} is a file, not a directory" in _error(capsys)
    assert (tmp_path / "afile").read_text() == "mine"


def test_flags_and_overrides_mix_in_any_order(tmp_path, no_training):
    _a_run(tmp_path)
    with pytest.raises(Started):
        cli.main(["train", f"run.out_dir={tmp_path}", "--overwrite", "run.name=r", "--quiet"])
    assert "progress: plain" in (tmp_path / "r" / "config.yaml").read_text()


# --- one run at a time ---------------------------------------------------------------------------


def test_a_run_directory_in_use_is_refused_naming_the_process(tmp_path, capsys, no_training):
    run = _a_run(tmp_path)
    fake_checkpoint(run)
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


# --- links in a run directory -------------------------------------------------------------------


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file outside the run directory that a link in it points at."""
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def _linked(run: Path, name: str, target: Path) -> Path:
    link = run / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path, victim):
    run = tmp_path / "run"
    _linked(run, ".dapo-lock", victim)
    with pytest.raises(ValueError, match=r"\.dapo-lock is a symbolic link"):
        RunLock(run).acquire()
    assert victim.read_text() == "precious\n"


def test_the_write_probe_and_atomic_writes_never_follow_a_link(tmp_path, victim):
    from dapo.run import nofollow, run_files, rundir

    run = tmp_path / "run"
    _linked(run, f".write-test-{os.getpid()}", victim)  # the probe is the process's own
    with pytest.raises(ValueError, match=rf"\.write-test-{os.getpid()} is a symbolic link"):
        rundir.check_writable(run)
    _linked(run, ".summary.json.tmp", victim)  # the temporary of an atomic write
    with pytest.raises(ValueError, match=r"\.summary\.json\.tmp is a symbolic link"):
        run_files.write_summary(run, {"steps": 1})
    _linked(run, "samples.jsonl", victim)  # the file itself
    with pytest.raises(ValueError, match=r"samples\.jsonl is a symbolic link"):
        nofollow.write_atomic(run / "samples.jsonl", "{}\n")
    assert victim.read_text() == "precious\n"


def test_a_config_copy_never_lands_behind_a_dangling_link(tmp_path):
    from dapo.config import load_config
    from dapo.run import run_files

    run, target = tmp_path / "run", tmp_path / "created-elsewhere.yaml"
    run.mkdir()
    (run / "config.yaml").write_text("old: config\n")
    _linked(run, "config.before-resume-1.yaml", target)  # dangling: exists() says False
    run_files.write_config(run, load_config(None, []))
    assert not target.exists()
    assert (run / "config.before-resume-2.yaml").read_text() == "old: config\n"


def test_metrics_and_tensorboard_that_are_links_are_refused(tmp_path, victim):
    from dapo.run.metrics import MetricsLogger

    run = tmp_path / "run"
    _linked(run, "metrics.jsonl", victim)
    with pytest.raises(ValueError, match=r"metrics\.jsonl is a symbolic link"):
        MetricsLogger(run / "metrics.jsonl")
    (run / "metrics.jsonl").unlink()
    _linked(run, "tensorboard", tmp_path)
    with pytest.raises(ValueError, match=r"tensorboard is a symbolic link"):
        MetricsLogger(run / "metrics.jsonl", tensorboard_dir=run / "tensorboard")
    assert victim.read_text() == "precious\n"


def test_checkpoint_and_model_directories_that_are_links_are_refused(tmp_path, victim):
    from dapo.run import checkpoint

    model = torch.nn.Linear(2, 2)
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _linked(run, "checkpoints", elsewhere)
    save = dict(step=1, model=model, tokenizer=None, optimizer=None, trainer_state={}, keep=2)
    with pytest.raises(ValueError, match=r"checkpoints is a symbolic link"):
        checkpoint.save(run, **save)
    (run / "checkpoints").unlink()
    _linked(run, ".model.tmp", elsewhere)
    with pytest.raises(ValueError, match=r"\.model\.tmp is a symbolic link"):
        checkpoint.export_model(model, None, run / "model")
    assert list(elsewhere.iterdir()) == []


def test_a_resume_never_cuts_a_file_that_metrics_jsonl_links_to(
    tmp_path, victim, capsys, demo_cache
):
    from helpers import TINY_DEMO

    cache = demo_cache
    argv = ["train", *TINY_DEMO, "train.steps=1", "eval.every=0", f"run.out_dir={tmp_path}"]
    argv += ["run.name=r", f"embedded.cache_dir={cache}", "--quiet"]
    assert cli.main(argv) == 0
    run = tmp_path / "r"
    victim.write_text("x" * 10_000)  # longer than the checkpoint's offset: it would be cut
    (run / "metrics.jsonl").unlink()
    _linked(run, "metrics.jsonl", victim)
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run), "train.steps=2", "--force"]) == 2
    assert "metrics.jsonl is a symbolic link" in _error(capsys)
    assert victim.read_text() == "x" * 10_000


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


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters())


def test_a_sharded_checkpoint_is_safetensors_and_json_and_loads(tmp_path):
    state = tmp_path / "state"
    model, optimizer = _sharded_checkpoint(state)
    assert sorted(p.suffix for p in state.iterdir()) == [".json", ".safetensors"]
    for shard in state.glob("*.safetensors"):  # a JSON header, then raw tensor bytes
        assert shard.read_bytes()[8:9] == b"{"
    fresh, fresh_opt = _fresh()
    dcp.load(state, fresh, fresh_opt)
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


def _pickled_checkpoint(state: Path, marker: Path) -> None:
    """The attack on DCP's own format: its .metadata lists a non-tensor item whose bytes, in a
    shard, are a pickle that creates ``marker`` when torch's planner unpickles it."""
    import torch.distributed.checkpoint as torch_dcp

    model, optimizer = _fresh()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch_dcp.save(
        {"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=state
    )
    metadata = torch_dcp.FileSystemReader(str(state)).read_metadata()
    shard = next(state.glob("*.distcp"))
    evil = pickle.dumps(_CreatesAFile(marker))
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(evil)
    for index, info in metadata.storage_data.items():
        if index.fqn == "optim.param_groups.0.lr":  # a bytes item: torch.load(weights_only=False)
            info.offset, info.length = offset, len(evil)
    (state / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_pickled_dcp_checkpoint_is_refused_and_runs_nothing(tmp_path):
    import torch.distributed.checkpoint as torch_dcp

    state, marker = tmp_path / "state", tmp_path / "pwned"
    _pickled_checkpoint(state, marker)
    fresh, fresh_opt = _fresh()
    with pytest.raises(dcp.UnsafeCheckpointError, match=r"holds a pickled checkpoint \(\.metadata"):
        dcp.load(state, fresh, fresh_opt)
    assert not marker.exists()
    # What torch's own reader and planner would have done with it: run the payload (then fail
    # on what it returned).
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):
        torch_dcp.load(target, checkpoint_id=state)
    assert marker.exists()


def test_the_load_planner_refuses_an_item_that_is_not_a_tensor():
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "optim.param_groups"})()})()
    with pytest.raises(dcp.UnsafeCheckpointError, match="non-tensor item 'optim.param_groups'"):
        dcp.TensorsOnlyPlanner().load_bytes(item, b"\x80\x04")


def test_shards_outside_the_directory_and_garbled_shards_are_refused(tmp_path):
    state = tmp_path / "state"
    _sharded_checkpoint(state)
    shard = next(state.glob("*.safetensors"))
    elsewhere = tmp_path / "elsewhere.safetensors"
    shard.rename(elsewhere)
    (state / shard.name).symlink_to(elsewhere)
    with pytest.raises(dcp.UnsafeCheckpointError, match="outside its directory"):
        dcp.load(state, *_fresh())
    (state / shard.name).unlink()
    (state / shard.name).write_bytes(b"\xff" * 64)  # not safetensors
    with pytest.raises(dcp.UnsafeCheckpointError, match="unreadable checkpoint shards"):
        dcp.load(state, *_fresh())


def _load_on_rank(rank: int, port: int, state: str, out: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        dcp.load(Path(state), *_fresh())
    except dcp.UnsafeCheckpointError as exc:
        Path(out, f"refused_{rank}").write_text(str(exc))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_refuse_the_pickled_checkpoint_and_run_nothing(tmp_path):
    from helpers import spawn_ranks

    state, marker = tmp_path / "state", tmp_path / "pwned"
    _pickled_checkpoint(state, marker)
    spawn_ranks(_load_on_rank, str(state), str(tmp_path))
    for rank in range(2):
        assert "holds a pickled checkpoint" in (tmp_path / f"refused_{rank}").read_text()
    assert not marker.exists()


# --- ranks end with their launcher ---------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended; only its exit status remains


def test_ranks_end_when_the_launcher_is_killed(tmp_path, demo_cache):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += ["-m", "dapo", "train", *TINY, f"run.out_dir={tmp_path}", "run.name=r"]
    cmd += [f"embedded.cache_dir={demo_cache}", "train.steps=200", "run.threads=1"]
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


# --- bad data, named -----------------------------------------------------------------------------

GOOD_ROW = json.dumps(
    {
        "prompt": [{"role": "user", "content": "What is 1+1?"}],
        "reward_model": {"ground_truth": "2"},
        "data_source": "math_dapo",
    }
).encode()


def _row(content: str = "x", truth: str = '"1"') -> bytes:
    text = '{"prompt": [{"role": "user", "content": "%s"}], "reward_model": {"ground_truth": %s}}'
    return (text % (content, truth)).encode()


BAD_LINES = {
    "deep": (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests lists or objects"),
    "long-integer": (_row(truth="9" * 5000), "Exceeds the limit (4300 digits)"),
    "surrogate": (_row("a \\ud800 b"), "holds a lone surrogate (U+D800"),
    "invalid-utf8": (_row("a \xff b").replace(b"\xc3\xbf", b"\xff"), "is not UTF-8 (byte 0xff"),
    "huge-line": (_row("a" * (100 * 2**20)), "is over 16 MiB"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_a_bad_line_is_named_with_its_row_and_never_a_traceback(tmp_path, capsys, case):
    line, reason = BAD_LINES[case]
    path = tmp_path / f"{case}.jsonl"
    path.write_bytes(GOOD_ROW + b"\n" + line + b"\n" + GOOD_ROW + b"\n")
    assert cli.main(["data", "check", str(path)]) == 1  # the bad row counted, the rest read
    out = capsys.readouterr().out
    assert "bad rows: 1 (skipped)" in out and "row 1, field" in out and reason in out
    # Training reads it strictly: one line naming the file, the row and the fix.
    from dapo.data.files import DataError, load_problems

    with pytest.raises(DataError) as err:
        load_problems(path)
    assert str(err.value).startswith(f"{path}: row 1, field ") and reason in str(err.value)
    assert "data.on_bad_row=skip" in str(err.value)
    assert len(load_problems(path, on_bad_row="skip").problems) == 1  # skipped, and counted


@pytest.mark.parametrize("case", ["deep", "long-integer"])
def test_a_file_whose_only_row_is_bad_names_it_not_a_missing_column(tmp_path, capsys, case):
    """Such a file has no JSON object, so no columns: it used to be read as the flat format
    and refused for a missing 'question' column, sending the user the wrong way."""
    line, reason = BAD_LINES[case]
    path = tmp_path / f"{case}.jsonl"
    path.write_bytes(line + b"\n")
    assert cli.main(["data", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "row 0, field '(row)'" not in out and "row 0, field (row): line 1 " in out
    assert reason in out and "no column" not in out
    from dapo.data.files import DataError, load_problems

    with pytest.raises(DataError, match=rf"row 0, field '\(row\)': line 1 .*{re.escape(reason)}"):
        load_problems(path)


def test_a_byte_order_mark_is_read_as_nothing(tmp_path):
    from dapo.data.files import load_problems

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_ROW + b"\n")
    assert [p.answer for p in load_problems(path).problems] == ["2"]


def test_an_empty_file_and_a_file_of_only_bad_rows_stop_the_run_naming_the_file(tmp_path, capsys):
    empty, bad, good = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl", tmp_path / "good.jsonl"
    empty.write_text("\n\n")
    bad.write_bytes(_row(truth='""') + b"\n" + b'{"prompt": "x"}\n')
    good.write_bytes(GOOD_ROW + b"\n")
    assert cli.main(["data", "check", str(empty)]) == 2
    assert f"{empty}: holds no rows" in _error(capsys)
    model = save_model(tmp_path / "model", "qwen2")
    args = ["train", f"run.out_dir={tmp_path}", "data.on_bad_row=skip", f"model.path={model}"]
    assert cli.main([*args, f"data.train_file={bad}", f"data.val_file={good}"]) == 2
    err = _error(capsys)
    assert f"{bad}: none of its 2 rows is usable (2 bad; the first: row 0" in err
    assert f"dapo data check {bad}" in err
    assert cli.main([*args, f"data.train_file={good}", f"data.val_file={empty}"]) == 2
    assert f"{empty}: holds no rows" in _error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["model"]  # no run dir


# --- small ones ----------------------------------------------------------------------------------


def test_checkpoints_are_ordered_by_step_number_past_999999(tmp_path):
    from dapo.run import checkpoint

    root = tmp_path / "checkpoints"
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        ckpt = root / checkpoint.step_dir_name(step)
        ckpt.mkdir(parents=True)
        (ckpt / "manifest.json").write_text('{"files": {}}')
    assert [p.name for p in checkpoint.step_dirs(root)][-2:] == ["step_1000000", "step_1000001"]
    assert checkpoint.find_latest(tmp_path).name == "step_1000001"  # no pointer: the newest
    checkpoint.prune(root, keep=2, protect="")
    assert [p.name for p in checkpoint.step_dirs(root)] == ["step_1000000", "step_1000001"]


def test_a_latest_pointer_that_leads_outside_the_run_is_ignored(tmp_path):
    from dapo.run import checkpoint

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text('{"files": {}}')
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest").write_text("../../elsewhere\n")
    assert checkpoint.read_pointer(tmp_path / "run") is None
    assert checkpoint.find_latest(tmp_path / "run") is None


def test_ablation_runs_do_not_inherit_a_launchers_rank(monkeypatch):
    from dapo.ablate.runs import run_environment

    launched = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h"}
    launched |= {"MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0"}
    env = run_environment({**launched, "PATH": "/bin", "HOME": "/root", "OMP_NUM_THREADS": "2"})
    assert env == {"PATH": "/bin", "HOME": "/root", "OMP_NUM_THREADS": "2"}


def test_run_names_are_shown_literally_in_figures():
    from matplotlib.text import Text

    from dapo.report.style import legend_label

    for name in ("a$b$c", "cost_$5_run", "_hidden", "x^2_y"):
        label = legend_label(name)
        shown, is_math = Text(text=label)._preprocess_math(label)
        assert not is_math and shown.replace("\\$", "$") == name


# --- time bounds ---------------------------------------------------------------------------------


def test_a_verifier_that_hangs_on_every_response_costs_one_batch_deadline():
    from faulty_verifiers import resolve

    from dapo.reward.pool import FAULT_SCORE, Job, RewardPool

    jobs = [Job("ok", "Answer: 1", "1")] + [Job("sleep", f"r{i}", "1") for i in range(8)]
    with RewardPool(workers=2, timeout_s=1.0, resolve=resolve, batch_timeout_s=2.5) as pool:
        start = time.monotonic()
        result = pool.grade(jobs)
        took = time.monotonic() - start
        # Without the batch deadline: 8 responses x 1 s. With it: 2.5 s and the rest faulted.
        assert took < 4.5, took
        assert result.scores[0].correct and result.scores[1:] == [FAULT_SCORE] * 8
        assert [f.index for f in result.faults] == list(range(1, 9))
        assert {f.kind for f in result.faults} == {"timeout"}
        assert any("reward.batch_timeout_s" in f.detail for f in result.faults)
        # The pool goes on grading (fresh workers) in the next call.
        assert pool.grade([Job("ok", "Answer: 2", "2")]).scores[0].correct
