"""Review r27: the ablation table's tokens per kept group is the run's generated tokens over its
kept groups (a step that kept none still cost its tokens), and ``async/staleness_*`` counts
training steps between the weights that drew a step's rollouts and the weights trained, not
optimizer updates (a step makes epochs x mini-batches of them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from helpers import LENGTH_SHAPED, plus_one_problems

from dapo.ablate.table import read_result
from dapo.config import load_config
from dapo.training.generator_thread import GeneratorThread
from dapo.training.state import build_state
from dapo.training.step import train_step


def _write_run(run_dir: Path, lines: list[dict], steps: int) -> None:
    """A finished run's metrics.jsonl (lines as written, in order) and summary.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (run_dir / "summary.json").write_text(json.dumps({"steps": steps, "val/accuracy_end": 0.3}))


def _step(step: int, tokens: float, kept: float) -> dict:
    ratio = tokens / kept if kept else None  # a step that kept no group logs null
    return {
        "step": step,
        "sampling/tokens_generated": tokens,
        "sampling/groups_kept": kept,
        "sampling/tokens_per_kept_group": ratio,
    }


def test_tokens_per_kept_group_counts_the_steps_that_kept_none_and_each_step_once(tmp_path):
    lines = [
        {"step": 0, "val/accuracy": 0.1},
        _step(1, 300.0, 2.0),
        _step(2, 500.0, 0.0),  # kept no group: its 500 tokens are still a cost
        _step(3, 999.0, 1.0),  # killed before a checkpoint, then done again on resume
        _step(3, 200.0, 2.0),
        _step(4, 200.0, 2.0) | {"val/accuracy": 0.3},
        _step(5, 7777.0, 1.0),  # a stopped extension past the summary's steps
    ]
    _write_run(tmp_path, lines, steps=4)
    # (300 + 500 + 200 + 200) / (2 + 0 + 2 + 2) = 1200 / 6; the mean of the steps' ratios
    # that were not null, (150 + 100 + 100) / 3, left out step 2's tokens.
    assert read_result(tmp_path)["tokens_per_kept_group"] == 200.0


def test_tokens_per_kept_group_is_nan_when_no_step_kept_a_group(tmp_path):
    _write_run(tmp_path, [_step(1, 300.0, 0.0), _step(2, 100.0, 0.0)], steps=2)
    assert math.isnan(read_result(tmp_path)["tokens_per_kept_group"])


def test_staleness_counts_steps_not_the_updates_each_step_makes(tiny_model, tokenizer):
    # 2 prompts x 4 responses in mini-batches of 4, two epochs: 4 updates a step.
    cfg = load_config(
        None,
        [
            *LENGTH_SHAPED,
            "train.responses_per_minibatch=4",
            "train.epochs=2",
            "train.async_staleness=1",
            "train.steps=3",
        ],
    )
    problems = plus_one_problems(9)
    state = build_state(cfg, tiny_model, tokenizer, problems)
    ahead = GeneratorThread(state, pool=None, threads=1)
    metrics, versions = [], []
    try:
        for _ in range(3):
            metrics.append(train_step(state, ahead))
            versions.append(ahead.current.version)
    finally:
        ahead.close()
    assert [m["train/updates"] for m in metrics] == [4.0, 4.0, 4.0]
    assert versions == [0, 0, 1]  # the weights after 0, 0 and 1 steps
    # Logged steps 1, 2, 3: min(step - 1, k) steps behind, where 4 and 4 updates were made.
    staleness = [(m["async/staleness_mean"], m["async/staleness_max"]) for m in metrics]
    assert staleness == [(0.0, 0.0), (1.0, 1.0), (1.0, 1.0)]
