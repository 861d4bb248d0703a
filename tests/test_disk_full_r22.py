"""A disk that fills (or a file size limit met) while a run writes: metrics.jsonl or TensorBoard
failing is one error naming the file and the resume, not two chained tracebacks, and the resume
logs every step once; a checkpoint that cannot be written says what frees space (the run's
older checkpoints; lowering train.keep_checkpoints frees nothing) or, under ``ulimit -f``, to
lift the limit."""

from __future__ import annotations

import copy
import errno
import io
import json
import resource
from pathlib import Path

import pytest
import torch
import torch.utils.tensorboard
from helpers import logged_metrics, quiet_fit, setup_run
from safetensors import SafetensorError

from dapo.run import checkpoint, nofollow, state_files
from dapo.run.metrics import MetricsLogger

FULL = "No space left on device"


class FillingDisk(io.FileIO):
    """A file whose disk fills once ``lines`` more lines are in it: the next write puts what
    fits (20 bytes) and returns short, the one after fails with ENOSPC, as a kernel does."""

    def __init__(self, path: Path, lines: int) -> None:
        super().__init__(path, "a+")
        self.lines_left, self.full = lines, False

    def write(self, data) -> int:
        data = bytes(data)
        if self.lines_left > 0:
            self.lines_left -= data.count(b"\n")
            return super().write(data)
        if not self.full:
            self.full = True
            return super().write(data[:20])
        raise OSError(errno.ENOSPC, FULL)


def _fill_metrics_after(monkeypatch, lines: int) -> None:
    """metrics.jsonl opened on a disk that fills after ``lines`` lines; other files as ever."""
    real = nofollow.open_binary

    def open_binary(path, **kwargs):
        if Path(path).name != "metrics.jsonl":
            return real(path, **kwargs)
        return io.BufferedWriter(FillingDisk(path, lines))

    monkeypatch.setattr(nofollow, "open_binary", open_binary)


# ----------------------------------------------------------------------------- metrics.jsonl


def test_a_full_disk_in_metrics_jsonl_is_one_error_and_the_resume_logs_each_step_once(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    """The flush of step 3's line failed, and the close in the loop's finally failed again on
    what was left buffered: two chained OSError tracebacks, no file named, no resume said."""
    untrained = copy.deepcopy(tiny_model)
    (tmp_path / "ref").mkdir()
    cfg, train, val, run_dir, start = setup_run(tmp_path, tiny_model)
    _fill_metrics_after(monkeypatch, lines=3)  # steps 0, 1, 2; step 3's line meets a full disk
    with pytest.raises(checkpoint.CheckpointError) as err:
        quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    ckpts = run_dir / "checkpoints"
    assert str(err.value) == (
        f"could not write {run_dir / 'metrics.jsonl'} (the metrics of step 3): the disk is "
        f"full; the previous checkpoint {ckpts / 'step_000002'} is intact. Free space, for "
        f"example by deleting this run's older checkpoints (rm -r {ckpts / 'step_000001'}; "
        "lowering train.keep_checkpoints frees nothing, as it prunes only after a save) and "
        f"resume with: dapo train --resume {run_dir}"
    )
    # One error: the close in the loop's finally raised nothing more.
    assert err.value.__cause__.errno == errno.ENOSPC
    assert err.value.__context__ is err.value.__cause__
    # The 20 bytes of step 3's line that reached the disk are cut off: whole lines only.
    assert [x["step"] for x in logged_metrics(run_dir)] == [0, 1, 2]
    monkeypatch.undo()
    quiet_fit(cfg, start, tokenizer, train, val, run_dir, resume=True)
    cfg_ref, *_, ref_dir, _ = setup_run(tmp_path / "ref", untrained)
    quiet_fit(cfg_ref, untrained, tokenizer, train, val, ref_dir)
    assert [x["step"] for x in logged_metrics(run_dir)] == [0, 1, 2, 3, 4]
    assert logged_metrics(run_dir) == logged_metrics(
        ref_dir
    )  # step 3 neither lost nor logged twice


def test_a_full_disk_before_the_first_checkpoint_says_to_start_again(tmp_path, monkeypatch):
    _fill_metrics_after(monkeypatch, lines=0)
    log = MetricsLogger(tmp_path / "metrics.jsonl")
    with pytest.raises(checkpoint.CheckpointError) as err:
        log.log(0, {"val/accuracy": 0.5})
    assert str(err.value) == (
        f"could not write {tmp_path / 'metrics.jsonl'} (the metrics of step 0): the disk is "
        "full; no checkpoint yet. Free space and start the run again with the same command "
        "and --overwrite: it stopped before its first checkpoint, so there is nothing to resume"
    )
    log.close()  # nothing raised again: the unwritten rest of the line was dropped
    assert (tmp_path / "metrics.jsonl").read_bytes() == b""


class _FullTensorBoard:
    """A SummaryWriter on a full disk: its writer thread's ENOSPC, raised at each call."""

    made: list[_FullTensorBoard] = []

    def __init__(self, log_dir, purge_step=None) -> None:
        self.closed = False
        self.made.append(self)

    def add_scalar(self, *args) -> None:
        raise OSError(errno.ENOSPC, FULL)

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, FULL)

    def close(self) -> None:
        self.closed = True
        raise OSError(errno.ENOSPC, FULL)


def test_a_full_disk_under_tensorboard_is_named_once(tmp_path, monkeypatch):
    monkeypatch.setattr(_FullTensorBoard, "made", [])
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", _FullTensorBoard)
    log = MetricsLogger(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tensorboard")
    with pytest.raises(checkpoint.CheckpointError) as err:
        log.log(1, {"rollout/accuracy": 0.5})
    assert str(err.value) == (
        f"could not write {tmp_path / 'tensorboard'} (TensorBoard events of step 1): the disk "
        "is full; no checkpoint yet. Free space and start the run again with the same command "
        "and --overwrite: it stopped before its first checkpoint, so there is nothing to resume"
    )
    assert log.sync() == len((tmp_path / "metrics.jsonl").read_bytes())  # the line is whole
    log.close()  # TensorBoard's close fails again, unreported: its failure was
    assert [w.closed for w in _FullTensorBoard.made] == [True]


class _TensorBoardFullAtClose(_FullTensorBoard):
    """A SummaryWriter whose events fit, until its close flushes them onto the full disk."""

    def add_scalar(self, *args) -> None:
        """Queued, as a writer thread does."""


def test_a_full_disk_met_again_by_tensorboard_at_close_is_not_a_second_error(tmp_path, monkeypatch):
    """After metrics.jsonl's error, TensorBoard's close in the loop's finally met the full
    disk too: raised there, it would replace the error that named metrics.jsonl."""
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", _TensorBoardFullAtClose)
    monkeypatch.setattr(_FullTensorBoard, "made", [])
    _fill_metrics_after(monkeypatch, lines=1)
    log = MetricsLogger(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tensorboard")
    log.log(0, {"val/accuracy": 0.5})
    with pytest.raises(checkpoint.CheckpointError, match="metrics.jsonl .the metrics of step 1"):
        log.log(1, {"rollout/accuracy": 0.5})
    log.close()
    assert [w.closed for w in _FullTensorBoard.made] == [True]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").open()] == [0]


# ----------------------------------------------------------------------------- checkpoints


def _save(run_dir: Path, model, tokenizer, step: int) -> Path:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"sampler": {"epoch": 0, "pos": step}}
    return checkpoint.save(
        run_dir,
        step=step,
        model=model,
        tokenizer=tokenizer,
        optimizer=opt,
        trainer_state=state,
        keep=3,
    )


def test_a_full_disk_names_the_older_checkpoints_to_delete(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    """It said "Free space (or lower train.keep_checkpoints)": a lower keep prunes only after
    a save succeeds, and so frees nothing for the save that failed."""
    for step in (1, 2, 3):
        _save(tmp_path, tiny_model, tokenizer, step)

    def full(*args, **kwargs):
        raise SafetensorError(f"Error while serializing: I/O error: {FULL} (os error 28)")

    monkeypatch.setattr(state_files, "save_file", full)
    with pytest.raises(checkpoint.CheckpointError) as err:
        _save(tmp_path, tiny_model, tokenizer, 4)
    ckpts = tmp_path / "checkpoints"
    assert str(err.value) == (
        f"could not write the checkpoint of step 4 under {ckpts}: the disk is full; the "
        f"previous checkpoint {ckpts / 'step_000003'} is intact. Free space, for example by "
        f"deleting this run's older checkpoints (rm -r {ckpts / 'step_000001'} "
        f"{ckpts / 'step_000002'}; lowering train.keep_checkpoints frees nothing, as it prunes "
        f"only after a save) and resume with: dapo train --resume {tmp_path}"
    )


def test_a_full_disk_at_the_first_checkpoint_says_to_start_again(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    """It said to resume, from no checkpoint: a resume refuses that."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, FULL)

    monkeypatch.setattr(state_files, "save_file", full)
    with pytest.raises(checkpoint.CheckpointError) as err:
        _save(tmp_path, tiny_model, tokenizer, 1)
    assert str(err.value) == (
        f"could not write the checkpoint of step 1 under {tmp_path / 'checkpoints'}: the disk "
        "is full; no checkpoint yet. Free space and start the run again with the same command "
        "and --overwrite: it stopped before its first checkpoint, so there is nothing to resume"
    )


@pytest.fixture()
def file_size_limit():
    """``ulimit -f 64`` (KiB) in this process for the test: safetensors then meets a real
    EFBIG (Python ignores SIGXFSZ, so the write fails instead of killing the process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_file_size_limit_says_to_lift_it(tmp_path, tiny_model, tokenizer, file_size_limit):
    """It said "the disk is full"'s fix, free space, for a limit that freeing space never lifts."""
    with torch.no_grad():  # weights over 64 KiB, so that the limit is met
        tiny_model.resize_token_embeddings(1024)
    with pytest.raises(checkpoint.CheckpointError) as err:
        _save(tmp_path, tiny_model, tokenizer, 1)
    assert str(err.value) == (
        f"could not write the checkpoint of step 1 under {tmp_path / 'checkpoints'}: a file "
        "reached the file size limit of 64 KiB (ulimit -f); no checkpoint yet. Lift the limit "
        "(ulimit -f unlimited, in the shell that starts dapo) and start the run again with the "
        "same command and --overwrite: it stopped before its first checkpoint, so there is "
        "nothing to resume"
    )
    model = tmp_path / "run" / "model"
    assert checkpoint.export_failed(model, OSError(errno.EFBIG, "File too large")) == (
        f"could not write the model {model}: a file reached the file size limit of 64 KiB "
        "(ulimit -f); nothing was left there, and the run's checkpoints are as they were. Lift "
        "the limit (ulimit -f unlimited, in the shell that starts dapo) and finish the run "
        f"with: dapo train --resume {model.parent} (or export its last checkpoint: dapo export "
        f"{model.parent} --out {model})"
    )


def test_a_file_too_large_for_its_file_system_says_to_move_the_run(tmp_path, tokenizer):
    """EFBIG with no ulimit: the file system's own largest file (FAT32's 4 GiB)."""
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        pytest.skip("this process has a file size limit")
    (tmp_path / "checkpoints").mkdir()
    nofollow.write_atomic(tmp_path / "checkpoints" / "latest", "step_000002\n")
    too_large = SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    assert checkpoint.write_failed(tmp_path, 3, too_large) == (
        f"could not write the checkpoint of step 3 under {tmp_path / 'checkpoints'}: a file "
        "grew past the largest size its file system allows (File too large); the previous "
        f"checkpoint {tmp_path / 'checkpoints' / 'step_000002'} is intact. Move the run "
        "directory to a file system that allows larger files and resume with: dapo train "
        f"--resume {tmp_path}"
    )


def test_the_commands_in_a_failed_export_message_are_shell_quoted(tmp_path):
    run = tmp_path / "my run"
    message = checkpoint.export_failed(run / "model", OSError(errno.ENOSPC, "No space"))
    assert f"dapo train --resume '{run}' (or export its last checkpoint: " in message
    assert f"dapo export '{run}' --out '{run / 'model'}')" in message
