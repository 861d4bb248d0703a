"""Whole runs of the tools demo (recipes/demo-tools.yaml), tiny: kill -9 and resume give the
uninterrupted run, two gloo ranks under torchrun give the one-process run, and generation
ahead of training draws episodes and resumes exactly."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TORCHRUN_DEMO, dapo_train, finish_run, start_run
from safetensors.torch import load_file

from dapo.reward import sandbox

pytestmark = pytest.mark.skipif(
    not sandbox.available_modes(), reason="no sandbox mode works on this machine"
)

TOOLS_RUN = [
    "--config",
    str(ROOT / "recipes" / "demo-tools.yaml"),
    *TORCHRUN_DEMO,
    # The recipe's L_max and L_cache (a tool episode is ~30 tokens), a warm-start that shows
    # the tool's format often enough, and a step more.
    "rollout.max_new_tokens=40",
    "algo.l_cache=8",
    "embedded.sft_steps=150",
    "arith.num_warmup=512",
    "train.steps=4",
    "env.workers=2",
]
"""4 steps of the tools demo at a tiny scale, a checkpoint every step."""


def _lines(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in x.items() if not k.startswith(("perf/", "tools/seconds"))} for x in rows
    ]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run, and the warm-up cache every other run shares."""
    root = tmp_path_factory.mktemp("tools")
    code, _, err = finish_run(start_run(root, "reference", root / "cache", TOOLS_RUN))
    assert code == 0, err
    steps = _lines(root / "reference")[1:]
    # The runs exercise episodes: continued turns, tool calls, observations in the batch.
    assert max(m["episode/turns"] for m in steps) > 1
    assert sum(m["tools/calls_per_response"] for m in steps) > 0
    assert max(m["episode/env_tokens"] for m in steps) > 0
    return root / "reference", root / "cache"


def test_kill_9_then_resume_matches_the_uninterrupted_run(tmp_path, reference):
    ref, cache = reference
    proc = start_run(tmp_path, "run", cache, TOOLS_RUN)
    run_dir = tmp_path / "run"
    _kill_at_first_checkpoint(proc, run_dir)
    resumed = start_run(tmp_path, "run", cache, [], "--resume", str(run_dir))
    rcode, out, err = finish_run(resumed)
    assert rcode == 0, err
    assert "at step " in out
    assert _lines(ref) == _lines(run_dir)
    a, b = _weights(ref), _weights(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_torchrun_two_ranks_are_the_one_process_run(tmp_path, reference):
    ref, cache = reference
    dapo_train(2, *TOOLS_RUN, f"embedded.cache_dir={cache}", "run.name=two", out_dir=tmp_path)
    counters = ("sampling/", "episode/", "tools/calls", "tools/call_frac", "train/updates")
    ones, twos = _lines(ref), _lines(tmp_path / "two")
    for one, two in zip(ones, twos, strict=True):
        pick = sorted(k for k in one if k.startswith(counters) or k == "val/accuracy")
        assert {k: two.get(k) for k in pick} == {k: one[k] for k in pick}
    a, b = _weights(ref), _weights(tmp_path / "two")
    gap = max(float((b[k] - w).abs().max()) for k, w in a.items())
    assert gap <= 1e-6, f"weights differ by up to {gap:.3g}"


def _kill_at_first_checkpoint(proc, run_dir: Path) -> None:
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint came"
        time.sleep(0.01)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    assert finish_run(proc)[0] == -signal.SIGKILL


AHEAD = [*TOOLS_RUN, "train.async_staleness=1"]
"""The tools demo with its episodes drawn a step ahead of training."""


@pytest.fixture(scope="module")
def ahead(tmp_path_factory, reference) -> Path:
    """One uninterrupted run of :data:`AHEAD` (the generator thread draws the episodes)."""
    _, cache = reference
    root = tmp_path_factory.mktemp("ahead")
    code, _, err = finish_run(start_run(root, "ahead", cache, AHEAD))
    assert code == 0, err
    steps = _lines(root / "ahead")[1:]
    assert max(m["async/staleness_max"] for m in steps) == 1
    assert max(m["episode/turns"] for m in steps) > 1
    assert sum(m["tools/calls_per_response"] for m in steps) > 0
    return root / "ahead"


def test_generation_ahead_draws_episodes_and_a_kill_9_resumes_it_exactly(
    tmp_path, reference, ahead
):
    """``train.async_staleness=1``: the generator thread draws episodes (the runner on its
    engine), and the episodes it drew ahead, masks and traces, go through the checkpoint."""
    _, cache = reference
    proc = start_run(tmp_path, "run", cache, AHEAD)
    _kill_at_first_checkpoint(proc, tmp_path / "run")
    rcode, _, err = finish_run(
        start_run(tmp_path, "run", cache, [], "--resume", str(tmp_path / "run"))
    )
    assert rcode == 0, err
    assert _lines(tmp_path / "run") == _lines(ahead)
    a, b = _weights(ahead), _weights(tmp_path / "run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_generator_rank_draws_the_generator_threads_episodes(tmp_path, reference, ahead):
    """``dist.rollout_ranks=1`` under torchrun: the generator rank runs the episodes (its own
    runner and tool) and the trainer rank trains on them, bit for bit the one-process run
    whose generator thread drew them."""
    _, cache = reference
    args = [*AHEAD, "dist.rollout_ranks=1", f"embedded.cache_dir={cache}", "run.name=ranks"]
    dapo_train(2, *args, out_dir=tmp_path)
    assert _lines(tmp_path / "ranks") == _lines(ahead)
    a, b = _weights(ahead), _weights(tmp_path / "ranks")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
