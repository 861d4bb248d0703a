"""Review r28's findings: a run refused mid-ablation leaves the table of the others and the
failed runs named (exit 1); the disk messages count the checkpoints a run can reach, a
resume's included; an ablation that cannot be locked is told to move --out."""

from __future__ import annotations

import argparse
import errno
import shutil
from collections import namedtuple

import pytest

import dapo.run.lock as lock_module
from dapo.ablate import expand, runs
from dapo.cli.ablate import cmd_ablate
from dapo.config import dump_yaml, load_config
from dapo.run import disk_space

MIB = 2**20


def test_a_run_refused_mid_ablation_is_counted_failed_and_the_table_written(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "abl"
    jobs = expand("eps-high", seeds=1)
    launched = []

    def launch(cmd, log, env=None):
        launched.append(cmd)
        if len(launched) == 1:  # meanwhile the second job's directory becomes another run's
            other = out / jobs[1].name
            (other / "checkpoints").mkdir(parents=True)
            (other / "checkpoints" / "latest").write_text("x")
            (other / "config.yaml").write_text(
                dump_yaml(load_config(None, list(jobs[0].overrides)))
            )
        return 1  # every launched run fails

    monkeypatch.setattr(runs, "launch", launch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    args = argparse.Namespace(
        plan="eps-high",
        seeds=1,
        budget=None,
        target=None,
        parallel=1,
        config=None,
        out=out,
        overrides=[],
    )
    assert cmd_ablate(args) == 1  # not the ValueError (exit 2) that hid the failures
    err = capsys.readouterr().err
    assert f"dapo: error: {len(jobs)} run(s) failed: " in err and jobs[1].name in err
    table = (out / "table.md").read_text()
    assert "Not in the table" in table and jobs[1].name in table


def test_a_resumes_warning_counts_the_checkpoints_already_there(tmp_path):
    cfg = load_config(overrides=["train.keep_checkpoints=3"])
    space = disk_space.RunSpace(100 * MIB, 0, 50 * MIB, saves=5, existing=1, free=200 * MIB)
    assert space.on_disk(3) == (4, 3)  # 1 there + 3 more during a save; 3 once pruned
    assert space.need(3) == 300 * MIB  # what the disk must give beyond the one there
    warning = disk_space.run_space_warning(space, tmp_path, cfg)
    assert "5 more checkpoints of about 100 MiB" in warning
    assert "at most 4 checkpoints on the disk at once and 3 beside the final model/" in warning


def test_the_refusal_counts_what_the_run_can_reach(tmp_path, monkeypatch):
    cfg = load_config(overrides=["train.steps=3", "train.save_every=1", "train.keep_checkpoints=5"])
    one = disk_space.estimate_checkpoint_bytes(cfg, None)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(2**40, 0, one))
    with pytest.raises(ValueError) as refused:
        disk_space.check_space(tmp_path, cfg, None)
    assert str(refused.value).endswith("(train.keep_checkpoints=5 will keep up to 3 at once)")


def test_an_ablation_on_a_file_system_without_flock_is_told_to_move_out(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_flock)
    with pytest.raises(ValueError) as refused, runs.ablation_lock(tmp_path / "abl"):
        pass
    assert str(refused.value) == (
        f"cannot lock ablation directory {tmp_path / 'abl'} (No locks available): its file "
        "system does not support flock; give --out on a local or NFS file system"
    )
