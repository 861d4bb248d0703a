"""The machine around a command (review r34b): a closed stdout, the file modes a run's weights
get, a venv under /tmp for bwrap, no home directory, a cache directory torch cannot make, and
output names near the 255-byte limit."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from dapo.cli.host import NO_HOME, host_refused
from dapo.data.output import current_umask, plain_mode, temp_prefix, write_records
from dapo.models import sharded_load
from dapo.models.demo import TinyModelSpec, WarmupSpec, load_embedded
from dapo.reward import sandbox
from dapo.reward.tasks.arith import make_splits
from dapo.run.console import ReaderMayLeave

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
TWO_STEPS = [
    "train.steps=2", "train.prompts_per_step=4", "sampling.prompts_per_round=6",
    "rollout.group_size=4", "train.responses_per_minibatch=16", "sampling.on_max_rounds=train",
    "eval.every=0", "eval.num_samples=1", "arith.num_val=16", "train.save_every=1",
]  # fmt: skip


def closed_pipe() -> int:
    """The write end of a pipe whose reader has gone."""
    read, write = os.pipe()
    os.close(read)
    return write


def test_a_closed_stdout_neither_stops_training_nor_keeps_its_weights_private(tmp_path):
    # `dapo train | head -1`: the next console line raised BrokenPipeError, and the run died
    # before its first checkpoint. And safetensors wrote every weights file 0600.
    cmd = [sys.executable, "-m", "dapo", "train", *TWO_STEPS, f"run.out_dir={tmp_path}"]
    with subprocess.Popen(
        [*cmd, "run.name=r", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=ENV, preexec_fn=lambda: os.umask(0o027),
    ) as proc:  # fmt: skip
        first = proc.stdout.readline()
        proc.stdout.close()  # as head -1 does
        err = proc.stderr.read()
    assert first.startswith("preset dapo on base demo: ")
    assert proc.returncode == 0, err
    run = tmp_path / "r"
    assert err.count("dapo: warning: stdout was closed (its reader ended); dapo train goes") == 1
    assert "Traceback" not in err
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]  # validation at 0, two steps
    written = list((run / "model").iterdir())
    written += [p for p in (run / "checkpoints" / "step_000002").rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"model.safetensors", "optimizer.safetensors"}
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in written} == {
        p.name: 0o640 for p in written
    }


def test_a_stream_whose_reader_left_is_silenced_once(capsys):
    write = closed_pipe()
    stream = ReaderMayLeave(os.fdopen(write, "w"), "eval")
    print("a line", file=stream, flush=True)
    print("another", file=stream)
    stream.flush()
    assert stream.left and os.readlink(f"/proc/self/fd/{write}") == "/dev/null"
    assert capsys.readouterr().err == (
        "dapo: warning: stdout was closed (its reader ended); dapo eval goes on, its results "
        "in its files\n"
    )


def test_a_command_whose_output_reader_left_ends_quietly(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    out = closed_pipe()
    cmd = [sys.executable, "-m", "dapo", "data", "check", str(data)]
    done = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=ENV)
    os.close(out)
    assert (done.returncode, done.stderr) == (1, "")


def test_a_cache_directory_torch_cannot_make_is_named_with_its_variable(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    env = {**ENV, "TORCHINDUCTOR_CACHE_DIR": "/proc/dapo-cache"}
    cmd = [sys.executable, "-m", "dapo", "data", "check", str(data)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "dapo: error: cannot start: torch cannot make /proc/dapo-cache as it loads (No such "
        "file or directory); it comes from TORCHINDUCTOR_CACHE_DIR=/proc/dapo-cache: set "
        "TORCHINDUCTOR_CACHE_DIR to a writable directory\n"
    )


def no_home(monkeypatch) -> None:
    """HOME unset and the uid without a passwd entry (a container's ``docker run -u 12345``)."""
    import pwd

    def missing(uid: int):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", missing)
    with pytest.raises(RuntimeError, match=NO_HOME):
        Path("~/x").expanduser()


def test_the_demo_runs_without_a_home_directory_and_says_it_cannot_cache(monkeypatch, capsys):
    no_home(monkeypatch)
    spec = TinyModelSpec(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)
    lines: list[str] = []
    pairs = make_splits(4, 1, seed=0)[0]
    model, _ = load_embedded(
        pairs, cache_dir="~/.cache/dapo", spec=spec, warmup=WarmupSpec(2, 2), log=lines.append
    )
    assert model.config.hidden_size == 16
    assert lines[0].startswith("building the embedded policy: 2 supervised warm-up steps on ")
    assert "cached at" not in lines[0]
    assert capsys.readouterr().err == (
        "dapo: warning: cannot cache the warmed-up demo model at ~/.cache/dapo: this user has "
        "no home directory (HOME is unset and the uid has no passwd entry); set "
        "embedded.cache_dir (or HOME) to a writable directory\n"
    )


def test_a_path_with_a_tilde_and_no_home_is_one_line(monkeypatch):
    no_home(monkeypatch)
    try:
        Path("~/data.jsonl").expanduser()
    except RuntimeError as exc:
        refused = host_refused(exc)
    assert refused == (
        f"a path that starts with ~ needs a home directory, and this user has none (HOME is "
        f"unset and uid {os.getuid()} has no passwd entry): set HOME, or give the path in full",
        2,
    )
    assert host_refused(RuntimeError("a bug")) is None


def test_weights_that_may_not_be_read_are_named_as_such(tmp_path, monkeypatch):
    # safetensors reports EACCES as "No such file or directory": the fix named was a download.
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "model.safetensors").chmod(0o600)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root may read anything
    error = sharded_load.damaged_weights(
        tmp_path / "model.safetensors", tmp_path, FileNotFoundError("No such file or directory")
    )
    assert str(error) == (
        f"model.path={tmp_path}: model.safetensors cannot be read: permission denied (mode "
        f"0600, owner uid {os.getuid()}); have its owner make it readable (chmod a+r "
        f"{tmp_path / 'model.safetensors'}), or load the model as that user"
    )


def test_the_umask_is_read_without_being_changed():
    before = os.umask(0o027)
    try:
        assert current_umask() == 0o027 and plain_mode() == 0o640
        assert plain_mode(directory=True) == 0o750 and current_umask() == 0o027
    finally:
        os.umask(before)


@pytest.mark.parametrize("name", ["o" * 250 + ".jsonl", "é" * 124 + ".jsonl"])
def test_an_output_name_near_the_limit_is_written(tmp_path, name):
    # mkstemp's temporary beside it added 14 bytes to the name: "File name too long".
    assert len(name.encode()) in (256, 254) or len(name.encode()) <= 255
    name = name.encode()[:255].decode(errors="ignore")
    write_records([{"q": "1"}], pa.schema([("q", pa.string())]), tmp_path / name)
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert len(temp_prefix(name).encode()) <= 202


BWRAP_HERE = "bwrap" in sandbox.available_modes()
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(not BWRAP_HERE, reason="bwrap mode does not work here")
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason=f"no {SYSTEM_PYTHON}")
def test_bwrap_runs_from_an_interpreter_under_tmp(tmp_path):
    # bwrap mounts a private /tmp: a venv there was invisible inside, and bwrap was lost.
    # The system's Python, which every uid may run (a venv of it); the sandbox needs no more.
    link = Path("/tmp") / f"dapo-python-{tmp_path.name}"
    link.symlink_to(SYSTEM_PYTHON)
    code = (
        "from dapo.reward import sandbox; print(sandbox.available_modes()); "
        "print(sandbox.run_python('print(6 * 7)', mode='bwrap').stdout)"
    )
    try:
        done = subprocess.run([str(link), "-c", code], capture_output=True, text=True, env=ENV)
    finally:
        link.unlink()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(sandbox.available_modes()), "b'42\\n'"]
