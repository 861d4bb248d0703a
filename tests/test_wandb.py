"""Weights & Biases is optional: metrics reach it under the same names when asked for, and
asking for it without the package installed is an up-front error."""

import importlib.util
import io

import pytest

from dapo import cli
from dapo.run.metrics import MetricsLogger
from dapo.training import loop


class FakeRun:
    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


def test_metrics_reach_wandb_under_the_same_names(tmp_path):
    run = FakeRun()
    log = MetricsLogger(tmp_path / "metrics.jsonl", wandb_run=run)
    log.log(0, {"val/accuracy": 0.25})
    log.log(1, {"rollout/accuracy": 0.5, "train/loss": float("nan")})
    log.close()
    assert run.logged == [(0, {"val/accuracy": 0.25}), (1, {"rollout/accuracy": 0.5})]
    assert run.finished


def test_asking_for_wandb_without_it_fails_before_loading(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    code = cli.main(["train", "run.wandb=true", f"run.out_dir={tmp_path}", "run.name=r"])
    assert code == 2
    assert "run.wandb=true needs the wandb package: pip install wandb" in capsys.readouterr().err


def test_an_offline_wandb_run_is_written_into_the_run_directory(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    pytest.importorskip("wandb")
    from helpers import setup_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, "train.steps=1", "run.wandb=true")
    loop.fit(cfg, tiny_model, tokenizer, train, val, run_dir=run_dir, stream=io.StringIO())
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
