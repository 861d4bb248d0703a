"""A generator thread's failed draw (``train.async_staleness``) waits for the step it belongs
to: a save before that step writes the checkpoint of the steps trained (the settle raised the
error at once, and the run lost them), with the steps drawn until the failure and the prompt
sampler where the failed step began; a run whose budget ends before that step ends as the
synchronous run does (dapo/training/generator_thread.py)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SMALL, logged_metrics, plus_one_problems, quiet_fit, setup_run
from safetensors.torch import load_file

from dapo.config import load_config
from dapo.training import generator_thread
from dapo.training.generator_thread import GeneratorThread
from dapo.training.sampling import DynamicSamplingExhausted
from dapo.training.state import build_state
from dapo.training.step import train_step

MESSAGE = "dynamic sampling kept 0 of 2 groups after 1 rounds (the test's failed draw)."


def _fail_at(monkeypatch, failing: int) -> list[int]:
    """Step ``failing``'s draw runs its rounds (its prompts drawn) and then fails as dynamic
    sampling does; every other step's is the real one. The steps drawn, in order."""
    real, steps = generator_thread.draw_step, []

    def draw_step(drawer, *, step, version, prior):
        steps.append(step)
        result = real(drawer, step=step, version=version, prior=prior)
        if step == failing:
            raise DynamicSamplingExhausted(MESSAGE)
        return result

    monkeypatch.setattr(generator_thread, "draw_step", draw_step)
    return steps


def _saved(ckpt: Path) -> tuple[int, list[int]]:
    """A checkpoint's prompt sampler position and the steps it holds drawn ahead."""
    info = json.loads((ckpt / "trainer.json").read_text())
    return info["sampler"]["pos"], [m["step"] for m in info["ahead"]["rollouts"]]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


def test_settle_saves_the_steps_drawn_before_a_failed_one_which_the_trainer_raises(
    tiny_model, tokenizer, monkeypatch
):
    """k = 1: step 2's draw fails while the trainer saves after step 0 (it needs steps 1 and
    2). The settle raised the error; now it hands over step 1, the sampler is back where
    step 2 began (2 prompts a step: position 4, not 6), and the error comes with step 2."""
    cfg = load_config(None, [*SMALL, "train.async_staleness=1", "run.threads=1"])
    problems = plus_one_problems(9)
    state = build_state(cfg, tiny_model, tokenizer, problems)
    drawn = _fail_at(monkeypatch, failing=2)
    ahead = GeneratorThread(state, pool=None, threads=1)
    try:
        train_step(state, ahead)  # step 0
        meta, _ = ahead.settle(state)
        assert [m["step"] for m in meta["rollouts"]] == [1]
        step1 = meta["rollouts"][0]  # its kept fraction, the one step 2 was drawn with
        assert meta["prior"] == [step1["groups_mixed"], step1["prompts_drawn"]] == [0, 2]
        assert state.sampler.state_dict()["pos"] == 4
        assert drawn == [0, 1, 2]
        train_step(state, ahead)  # step 1, drawn before the failure
        assert state.step == 2
        with pytest.raises(DynamicSamplingExhausted) as err:
            train_step(state, ahead)
        assert str(err.value) == MESSAGE
    finally:
        ahead.close()


def test_a_budget_that_ends_before_the_failed_step_ends_the_run_as_the_synchronous_one(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    """train.max_gen_tokens spent after step 1; step 1 (counted from 0, the second) fails to
    draw ahead while step 0 trains. The run exited 1 with no checkpoint, model/ or summary
    (the start-again hint said there was nothing to resume); now it ends as at k = 0, its
    checkpoint's sampler where the synchronous run's is."""
    budget = ("train.max_gen_tokens=1", "train.async_staleness=1")
    sync_model = copy.deepcopy(tiny_model)
    (tmp_path / "sync").mkdir()
    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, *budget)
    drawn = _fail_at(monkeypatch, failing=1)
    summary = quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    assert drawn == [0, 1]
    assert summary["steps"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000001"]
    assert _saved(run_dir / "checkpoints" / "step_000001") == (2, [])
    assert [m["step"] for m in logged_metrics(run_dir)] == [0, 1]

    sync_cfg, *_, sync_dir, _ = setup_run(tmp_path / "sync", sync_model, budget[0])
    assert quiet_fit(sync_cfg, sync_model, tokenizer, train, val, sync_dir)["steps"] == 1
    sync = json.loads((sync_dir / "checkpoints" / "step_000001" / "trainer.json").read_text())
    assert sync["sampler"]["pos"] == 2


def test_saves_before_the_failed_step_are_written_and_resume_into_the_run_that_never_failed(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    """k = 1, a save every step, step 2's draw fails: steps 1 and 2 are saved (the first save
    raised the error, nothing saved), then the error comes with step 2 and names the resume.
    Resumed from step 1's checkpoint (step 2 is drawn from its weights, as it was), the run
    ends with the metrics and weights of a run that never failed; from step 2's, the failed
    step is drawn again from the newest weights kept (staleness 0: its own were not kept)."""
    k1 = "train.async_staleness=1"
    starts = [copy.deepcopy(tiny_model) for _ in range(3)]
    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, k1)
    drawn = _fail_at(monkeypatch, failing=2)
    with pytest.raises(DynamicSamplingExhausted) as err:
        quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    monkeypatch.undo()
    assert drawn == [0, 1, 2]
    assert str(err.value).startswith(MESSAGE + " The run directory is intact; resume from")
    assert f"dapo train --resume {run_dir} sampling.max_rounds=<more> --force" in str(err.value)
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000001", "step_000002"]
    assert _saved(ckpts / "step_000001") == (4, [1])
    assert _saved(ckpts / "step_000002") == (4, [])
    assert [m["step"] for m in logged_metrics(run_dir)] == [0, 1, 2]

    (tmp_path / "ref").mkdir()
    ref_cfg, *_, ref_dir, _ = setup_run(tmp_path / "ref", starts[0], k1)
    quiet_fit(ref_cfg, starts[0], tokenizer, train, val, ref_dir)
    newest = tmp_path / "newest"
    shutil.copytree(run_dir, newest)

    shutil.rmtree(ckpts / "step_000002")  # resume from step 1's: latest falls back to it
    assert quiet_fit(cfg, starts[1], tokenizer, train, val, run_dir, resume=True)["steps"] == 4
    assert logged_metrics(run_dir) == logged_metrics(ref_dir)
    weights, ref = _weights(run_dir), _weights(ref_dir)
    assert weights.keys() == ref.keys()
    assert all(torch.equal(weights[n], ref[n]) for n in weights)

    assert quiet_fit(cfg, starts[2], tokenizer, train, val, newest, resume=True)["steps"] == 4
    again = logged_metrics(newest)
    assert again[:3] == logged_metrics(ref_dir)[:3]
    assert [m["async/staleness_max"] for m in again[1:]] == [0.0, 1.0, 0.0, 1.0]
