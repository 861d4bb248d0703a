"""``env.tool_sandbox=process`` (the Python tool of recipes/demo-tools.yaml runs the model's
code with no namespaces): ``dapo train`` and ``dapo eval --config`` say which sandbox the tool
runs in and warn of ``process`` as ``code.sandbox=process`` does, once on stderr and, for a
run, in summary.json's ``warnings``; the default mode (``auto``, which never picks
``process``) warns of nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from dapo.config import load_config
from dapo.reward import sandbox
from dapo.training.inputs import RunData, check_verifiers

pytestmark = pytest.mark.skipif(
    "process" not in sandbox.available_modes() or len(sandbox.available_modes()) < 2,
    reason="needs the process mode and a mode that isolates",
)

# recipes/demo-tools.yaml at its smallest: a few seconds from a warm-start to one step.
TINY_TOOLS = [
    "--config",
    str(ROOT / "recipes" / "demo-tools.yaml"),
    "train.steps=1",
    "embedded.sft_steps=5",
    "arith.num_warmup=16",
    "arith.num_train=16",
    "arith.num_val=2",
    "rollout.group_size=2",
    "train.prompts_per_step=2",
    "sampling.prompts_per_round=2",
    "sampling.dynamic=false",
    "train.responses_per_minibatch=4",
    "eval.every=0",
    "eval.num_samples=1",
    "env.workers=1",
    "run.threads=1",
]


def _tool_warning() -> str:
    """The warning, whole: process_mode_warning's words, naming the tool's setting."""
    what = sandbox.process_mode_warning().removeprefix("code.sandbox=process: ")
    return f"env.tool_sandbox=process (the Python tool of env.class=math_tool): {what}"


def _dapo(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dapo", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def _train(tmp: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    name = f"tool-{mode}"
    cache = f"embedded.cache_dir={tmp / 'cache'}"
    run = [*TINY_TOOLS, f"env.tool_sandbox={mode}", cache, f"run.out_dir={tmp}", f"run.name={name}"]
    return _dapo("train", *run), tmp / name


def _eval(run_dir: Path, out: Path) -> subprocess.CompletedProcess:
    config = str(run_dir / "config.yaml")
    flags = ["--k", "1", "--num-problems", "1", "--max-new-tokens", "40", "--resamples", "10"]
    flags += ["--threads", "1", "--out", str(out)]
    return _dapo("eval", str(run_dir / "model"), "--data", "arith", "--config", config, *flags)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    tmp = tmp_path_factory.mktemp("tool_sandbox")
    return {mode: _train(tmp, mode) for mode in ("process", "auto")}


def test_train_warns_of_the_process_tool_sandbox_once_and_keeps_it(runs):
    done, run_dir = runs["process"]
    warning = _tool_warning()
    assert done.stderr.count(f"dapo: warning: {warning}\n") == 1
    assert done.stderr.count("tool_sandbox=process") == 1  # said once, nowhere else
    assert "tool calls: run in the process sandbox (env.tool_sandbox=process)\n" in done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["warnings"] == [warning]


def test_train_in_the_default_sandbox_warns_of_nothing(runs):
    done, run_dir = runs["auto"]
    mode = sandbox.pick_mode("auto")
    assert mode != "process"
    assert f"tool calls: run in the {mode} sandbox (env.tool_sandbox=auto)\n" in done.stdout
    assert "warning" not in done.stderr
    assert "warnings" not in json.loads((run_dir / "summary.json").read_text())


def test_eval_with_the_run_config_warns_of_the_process_tool_sandbox(runs, tmp_path):
    done = _eval(runs["process"][1], tmp_path / "eval")
    assert done.stderr.count(f"dapo: warning: {_tool_warning()}\n") == 1
    assert done.stderr.count("tool calls: run in the process sandbox\n") == 1


def test_eval_with_a_default_sandbox_config_warns_of_nothing(runs, tmp_path):
    done = _eval(runs["auto"][1], tmp_path / "eval")
    assert f"tool calls: run in the {sandbox.pick_mode('auto')} sandbox\n" in done.stderr
    assert "warning" not in done.stderr


def test_a_reward_function_keeps_the_tool_warning():
    # A reward function grades no code row (no code sandbox), but the tool still runs code.
    overrides = ["env.class=math_tool", "env.tool_sandbox=process", "reward.function=r.py:f"]
    data = RunData([], [])
    check_verifiers(load_config(None, overrides), data)
    assert data.warnings == [_tool_warning()]
