"""The rollout sources: the step takes its rollouts from one, and the source, not the step,
says what the trainer must know of them (whether the sampler is the policy, how stale each
group is, who takes the new weights). A generator thread stops between two rounds through its
own stop. Nothing after the run's checks writes into its config."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import yaml
from helpers import LENGTH_SHAPED, TINY_DEMO, plus_one_problems

from dapo.config import load_config
from dapo.data.batch import Episode
from dapo.training import sampling
from dapo.training.generator_thread import GeneratorThread
from dapo.training.sampling import Group, SamplingResult
from dapo.training.sources import InTurn, StepRollouts, drawn_ahead_metrics
from dapo.training.state import build_state
from dapo.training.step import train_step

PROBLEMS = plus_one_problems(9)


def _cfg(*overrides: str):
    return load_config(
        None,
        [
            *LENGTH_SHAPED,
            "train.responses_per_minibatch=8",
            "train.recompute_old_logprobs=false",  # the sampler's may stand in for pi_old
            *overrides,
        ],
    )


class Recording(InTurn):
    """Drawn in turn, with every call the step makes recorded, and the sampler declared the
    policy or not."""

    def __init__(self, sampler_is_policy: bool) -> None:
        super().__init__()
        self.declared = sampler_is_policy
        self.calls: list[str] = []

    def take(self, state):
        self.calls.append("take")
        rollouts = super().take(state)
        rollouts.sampler_is_policy = self.declared
        return rollouts

    def episodes(self, rollouts, plan):
        self.calls.append("episodes")
        return super().episodes(rollouts, plan)

    def weights_changed(self, state):
        self.calls.append("weights_changed")
        super().weights_changed(state)

    def finish_step(self, state, rollouts, metrics, waited):
        self.calls.append("finish_step")
        return {"test/declared": float(rollouts.sampler_is_policy)}


def test_the_step_takes_the_rollouts_and_what_to_know_of_them_from_its_source(
    tiny_model, tokenizer
):
    """The same weights drawn in turn: declared the policy, the sampler's log-probs stand in
    for pi_old after one check (the gap is logged); declared another policy, pi_old is
    recomputed and the rollout correction measures the mismatch (none: same weights). The
    step calls the source in its order and writes nothing into the config."""
    out = {}
    for declared in (True, False):
        state = build_state(_cfg(), copy.deepcopy(tiny_model), tokenizer, PROBLEMS)
        before = copy.deepcopy(state.cfg.to_dict())
        source = Recording(declared)
        out[declared] = train_step(state, source)
        assert source.calls == ["take", "episodes", "weights_changed", "finish_step"]
        assert out[declared]["test/declared"] == float(declared)
        assert state.cfg.to_dict() == before
    assert "train/sampler_logprob_gap" in out[True] and "mismatch/kl" not in out[True]
    assert "train/sampler_logprob_gap" not in out[False]
    assert out[False]["mismatch/kl"] < 1e-9 and out[False]["mismatch/corrected_frac"] == 0.0
    # Taking turns by default: the same step as the source the loop builds.
    state = build_state(_cfg(), copy.deepcopy(tiny_model), tokenizer, PROBLEMS)
    assert train_step(state)["train/sampler_logprob_gap"] == out[True]["train/sampler_logprob_gap"]


def test_a_generator_threads_rollouts_are_never_the_policys_own(tiny_model, tokenizer):
    state = build_state(
        _cfg("train.async_staleness=1", "train.steps=3"), tiny_model, tokenizer, PROBLEMS
    )
    source = GeneratorThread(state, pool=None, threads=1)
    try:
        metrics = train_step(state, source)
    finally:
        source.close()
    assert source.current.sampler_is_policy is False  # step 0: the same weights, yet older
    assert "train/sampler_logprob_gap" not in metrics and "mismatch/kl" in metrics
    assert metrics["async/staleness_max"] == 0.0
    assert metrics["perf/trainer_idle_s"] >= 0.0 and metrics["perf/generator_idle_s"] >= 0.0
    assert not any(k.startswith("async/") and k.endswith("_s") for k in metrics)


def test_staleness_is_measured_per_group():
    def group(version: int) -> Group:
        return Group(f"g{version}", [], version=version)

    groups = [group(3), group(5), group(5)]
    rollouts = StepRollouts(6, 3, SamplingResult(groups, generated=groups), {}, 2.0, 0.5)
    state = type("State", (), {"step": 6})()
    metrics = drawn_ahead_metrics(state, rollouts, waited=0.25)
    assert metrics["async/staleness_mean"] == pytest.approx((3 + 1 + 1) / 3)
    assert metrics["async/staleness_max"] == 3.0
    assert (metrics["perf/trainer_idle_s"], metrics["perf/generator_idle_s"]) == (0.25, 0.5)


def test_dynamic_sampling_stops_between_two_rounds_when_asked():
    drawn = []

    def draw_round(round_index: int, size: int) -> list[Group]:
        drawn.append(round_index)
        one = torch.ones(1, dtype=torch.long)
        right = Episode(one, one, torch.zeros(1), False, True, 1.0)
        return [Group(f"u{round_index}", [right, right])]  # all right: never kept

    result = sampling.collect_groups(
        draw_round,
        num_groups=2,
        dynamic=True,
        max_rounds=0,
        on_max_rounds="error",
        stopping=lambda: len(drawn) == 3,
    )
    assert result is None and drawn == [0, 1, 2]


def test_closing_a_generator_thread_mid_step_stops_it_without_an_error(tiny_model, tokenizer):
    """Rounds that keep nothing (one prompt of G identical rewards a round, no bound) would go
    on for ever: closing stops the thread between two of them, and nothing is raised."""
    cfg = _cfg(
        "train.async_staleness=1",
        "train.steps=4",
        "sampling.dynamic=true",
        "sampling.max_rounds=0",
        "sampling.prompts_per_round=1",
        "reward.mode=dapo",  # no 'Answer:' line: every response wrong, no group mixed
    )
    state = build_state(cfg, tiny_model, tokenizer, PROBLEMS)
    source = GeneratorThread(state, pool=None, threads=1)
    deadline = time.monotonic() + 60
    while state.sampler.state_dict()["pos"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # a few rounds of step 0 drawn
    source.close()
    assert not source.thread.is_alive() and source.error is None
    assert source.ready == {}  # step 0 never finished


def test_a_run_leaves_the_config_it_was_given_as_it_was(tmp_path, demo_cache):
    """The checks settle what they find (here ``eval.num_samples=0``: the data's copies) in a
    new config, which the run saves; the caller's is never written."""
    from dapo.api import training

    cfg = load_config(
        None,
        [
            *TINY_DEMO,
            "train.steps=1",
            "eval.num_samples=0",
            "eval.every=0",
            f"run.out_dir={tmp_path}",
            "run.name=r",
            f"embedded.cache_dir={demo_cache}",
            "run.progress=plain",
        ],
    )
    before = copy.deepcopy(cfg.to_dict())
    run_dir = training.run(cfg)
    assert cfg.to_dict() == before
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["eval"]["num_samples"] == 1 and cfg.eval.num_samples == 0
    assert torch.isfinite(torch.tensor(saved["optim"]["lr"]))
