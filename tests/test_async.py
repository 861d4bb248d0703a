"""Generation ahead of training (``train.async_staleness``, dapo/training/generator_thread.py):
step t samples from the weights after step max(0, t - k), exactly; the sampler's log-probs
are that policy's, weighed against pi_old by the rollout correction; a run repeats itself, and
kill -9 then --resume continues it exactly (the rollouts generated ahead are checkpointed)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import RESUMABLE_DEMO, finish_run, plus_one_problems, start_run
from safetensors.torch import load_file

from dapo.config import load_config
from dapo.run.checkpoint import CheckpointError
from dapo.training import inputs
from dapo.training.generator_thread import GeneratorThread
from dapo.training.old_logprobs import fill_logprobs
from dapo.training.rollout_files import rollouts_from_files, rollouts_to_files
from dapo.training.state import build_state
from dapo.training.step import train_step


def _cfg(*overrides: str):
    return load_config(
        None,
        [
            "rollout.max_new_tokens=40",
            "algo.l_cache=36",  # lengths past 4 shape the rewards: advantages without a verifier
            "rollout.group_size=4",
            "sampling.dynamic=false",
            "train.prompts_per_step=2",
            "train.responses_per_minibatch=8",
            "optim.lr=0.01",
            "optim.warmup_steps=0",
            "run.threads=1",
            *overrides,
        ],
    )


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("k", [1, 2])
def test_step_t_samples_from_the_weights_after_step_t_minus_k(eager_eos_model, tokenizer, k):
    """Every step's rollouts come from version max(0, t - k): their sampler log-probs are that
    version's forward pass, and not the next version's (the weights change every step)."""
    steps = 5
    cfg = _cfg(f"train.async_staleness={k}", f"train.steps={steps}")
    problems = plus_one_problems(9)
    state = build_state(cfg, eager_eos_model, tokenizer, problems)
    versions, drawn, metrics = [_weights(state.model)], [], []
    ahead = GeneratorThread(state, pool=None, threads=1)
    try:
        for _ in range(steps):
            metrics.append(train_step(state, ahead))
            drawn.append(ahead.current)
            versions.append(_weights(state.model))
    finally:
        ahead.close()
    probe = build_state(
        _cfg(), eager_eos_model, tokenizer, problems
    )  # a model to load versions into
    for t, d in enumerate(drawn):
        assert (d.step, d.version) == (t, max(0, t - k))
        assert (
            metrics[t]["async/staleness_max"] == metrics[t]["async/staleness_mean"] == t - d.version
        )
        episodes = [e for g in d.result.generated for e in g.episodes]
        gaps = []
        for v in (d.version, d.version + 1):
            probe.model.load_state_dict(versions[v])
            fill_logprobs(probe.model, episodes, "ref_logprobs", probe)
            gaps.append(max((e.ref_logprobs - e.sampler_logprobs).abs().max() for e in episodes))
        assert gaps[0] < 1e-5 < 1e-3 < gaps[1], (t, gaps)
    for m, d in zip(metrics, drawn, strict=True):
        # The trainer's phases add up to its step; generate and reward are the generator's.
        phases = ("trainer_idle_s", "logprobs_s", "train_s", "other_s")
        assert sum(m[f"perf/{p}"] for p in phases) == pytest.approx(m["perf/step_s"], rel=1e-9)
        assert m["perf/reward_s"] == d.timers["reward"] > 0  # it read the trainer's: 0
    # The correction sees the stale sampler: no mismatch while it is the policy (step 0).
    assert metrics[0]["mismatch/kl"] < 1e-9 < 1e-4 < metrics[-1]["mismatch/kl"]


def test_async_refusals_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"train.async_staleness must be >= 0.*got -1"):
        _cfg("train.async_staleness=-1")
    for engine, why in (("hf", "global generator"), ("vllm", "weights live in vLLM")):
        with pytest.raises(ValueError, match=rf"rollout.engine={engine} cannot \(.*{why}.*"):
            _cfg("train.async_staleness=1", f"rollout.engine={engine}")
    with pytest.raises(ValueError, match=r"under torchrun \(2 ranks\).*async_staleness=0"):
        inputs.check_async(_cfg("train.async_staleness=1"), world_size=2)
    inputs.check_async(_cfg("train.async_staleness=1"), world_size=1)
    # The sampler is never the policy ahead of training: pi_old is recomputed, not refused.
    assert _cfg("train.async_staleness=1", "train.recompute_old_logprobs=false")


def test_rollouts_round_trip_through_a_checkpoint_file_and_a_damaged_one_is_named(
    tiny_model, tokenizer, tmp_path
):
    cfg = _cfg("train.async_staleness=1", "train.steps=3")
    problems = plus_one_problems(4)
    state = build_state(cfg, tiny_model, tokenizer, problems)
    ahead = GeneratorThread(state, pool=None, threads=1)
    try:
        meta, tensors = ahead.settle(state)
    finally:
        ahead.close()
    assert [m["step"] for m in meta["rollouts"]] == [0, 1]  # through step + k
    path = tmp_path / "rollouts.safetensors"
    from safetensors.torch import save_file

    save_file(tensors, path)
    back = rollouts_from_files(json.loads(json.dumps(meta["rollouts"])), load_file(path), path)
    again, _ = rollouts_to_files(back)
    assert again == meta["rollouts"]
    for a, b in zip(back, ahead.ready.values(), strict=True):
        for ga, gb in zip(a.result.generated, b.result.generated, strict=True):
            for ea, eb in zip(ga.episodes, gb.episodes, strict=True):
                assert torch.equal(ea.response_ids, eb.response_ids)
                assert torch.equal(ea.sampler_logprobs, eb.sampler_logprobs)
    tensors["response_ids_lengths"][0] += 1  # a file that does not match its JSON
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"rollouts.safetensors does not match.*earlier one"):
        rollouts_from_files(meta["rollouts"], load_file(path), path)
    with pytest.raises(CheckpointError, match=r"rollouts.safetensors does not match"):
        rollouts_from_files(meta["rollouts"], {}, path)  # the file is missing


# ----------------------------------------------------------------------------- whole runs

TINY = [*RESUMABLE_DEMO, "train.async_staleness=2"]


def _start(out: Path, name: str, cache: Path, *extra: str) -> subprocess.Popen:
    return start_run(out, name, cache, TINY, "--quiet", *extra)


def _run(run_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The metrics lines without timings, and the final weights."""
    timed = ("perf/",)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in m.items() if not k.startswith(timed)} for m in lines]
    return metrics, load_file(run_dir / "model" / "model.safetensors")


def test_a_run_killed_with_sigkill_resumes_into_the_uninterrupted_run(tmp_path, demo_cache):
    """k = 2, a checkpoint every step: two uninterrupted runs are identical, and a run killed
    with SIGKILL at a random moment after its second checkpoint, then resumed, ends with the
    same metrics and weights."""
    cache = demo_cache
    code, _, err = finish_run(_start(tmp_path, "reference", cache))
    assert code == 0, err
    ref_metrics, ref_weights = _run(tmp_path / "reference")
    assert [m.get("async/staleness_max") for m in ref_metrics[1:]] == [0, 1, 2, 2, 2, 2]
    proc = _start(tmp_path, "killed", cache)
    run_dir = tmp_path / "killed"
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or (
        (run_dir / "metrics.jsonl").read_text().count("\n") < 3
    ):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended first"
        time.sleep(0.01)
    time.sleep(random.Random(0).uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    assert finish_run(proc)[0] == -signal.SIGKILL
    code, out, err = finish_run(_start(tmp_path, "killed", cache, "--resume", str(run_dir)))
    assert code == 0, err
    assert "resumed from" in out
    metrics, weights = _run(run_dir)
    assert metrics == ref_metrics
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def _drawn(s: int, version: int):
    """Step ``s``'s rollouts, one group of one episode, drawn from the weights of ``version``."""
    from dapo.data.batch import Episode
    from dapo.training.sampling import Group, SamplingResult
    from dapo.training.sources import StepRollouts

    e = Episode(torch.tensor([1]), torch.tensor([5, 6]), torch.zeros(2), False, True, 1.0)
    g = Group(f"g{s}", [e], version=version)
    return StepRollouts(s, version, SamplingResult([g], rounds=1, generated=[g]), {}, 0.0, 0.0)


def test_rollouts_drawn_ahead_are_resumed_only_where_they_belong(tmp_path):
    """A checkpoint's steps drawn ahead go on at the step it stopped at, drawn from weights no
    staler than train.async_staleness; a run that draws in turn (dist.rollout_ranks dropped at
    k = 0, a resume-safe field) passed over them, their prompts never trained: refused."""
    from safetensors.torch import save_file

    from dapo.training.rollout_files import restore_ahead

    meta, tensors = rollouts_to_files([_drawn(4, 3), _drawn(5, 4)])
    save_file(tensors, tmp_path / "rollouts.safetensors")
    info = {"ahead": {"rollouts": meta, "prior": [3, 8]}}
    drawn, prior = restore_ahead(info, tmp_path, step=4, staleness=1, consumed=True)
    assert [d.step for d in drawn] == [4, 5] and prior == (3, 8)
    with pytest.raises(CheckpointError, match="drawn in turn would pass over"):
        restore_ahead(info, tmp_path, step=4, staleness=0, consumed=False)
    for where in (5, 3):  # another step
        with pytest.raises(CheckpointError, match=r"for steps \[4, 5\].*is damaged"):
            restore_ahead(info, tmp_path, step=where, staleness=1, consumed=True)
    bad_prior = {"ahead": {"rollouts": meta, "prior": [3, -1]}}
    with pytest.raises(CheckpointError, match="kept fraction"):
        restore_ahead(bad_prior, tmp_path, step=4, staleness=1, consumed=True)
    assert restore_ahead({}, tmp_path, step=4, staleness=0, consumed=False) is None
    empty = {"ahead": {"rollouts": [], "prior": [1, 2]}}
    assert restore_ahead(empty, tmp_path, step=4, staleness=1, consumed=True) == ([], (1, 2))
    meta, tensors = rollouts_to_files([_drawn(4, 5)])  # from weights not trained yet
    save_file(tensors, tmp_path / "rollouts.safetensors")
    future = {"ahead": {"rollouts": meta, "prior": [3, 8]}}
    with pytest.raises(CheckpointError, match=r"weights of steps \[5\].*is damaged"):
        restore_ahead(future, tmp_path, step=4, staleness=1, consumed=True)


def test_resuming_with_a_smaller_staleness_names_the_saved_one_not_damage(tmp_path):
    """A sound checkpoint drawn at train.async_staleness=2, resumed (--force) at 1 or 0: the
    error names the field and the value to resume with; the checkpoint is not called damaged,
    nor is its directory to be deleted (every checkpoint of the run would fail alike)."""
    from safetensors.torch import save_file

    from dapo.training.rollout_files import restore_ahead

    drawn = [_drawn(4, 2), _drawn(5, 3), _drawn(6, 4)]  # k = 2: steps 4 to 6
    meta, tensors = rollouts_to_files(drawn)
    save_file(tensors, tmp_path / "rollouts.safetensors")
    info = {"ahead": {"rollouts": meta, "prior": [3, 8]}}
    for k in (1, 0):
        with pytest.raises(CheckpointError) as err:
            restore_ahead(info, tmp_path, step=4, staleness=k, consumed=True)
        message = str(err.value)
        assert "resume with train.async_staleness=2" in message
        assert f"resumes with train.async_staleness={k}" in message
        assert "damaged" not in message and "delete" not in message
    assert len(restore_ahead(info, tmp_path, step=4, staleness=2, consumed=True)[0]) == 3
    assert len(restore_ahead(info, tmp_path, step=4, staleness=3, consumed=True)[0]) == 3


def test_a_second_ctrl_c_does_not_wait_for_the_generators_round(tmp_path, demo_cache):
    """The generator thread grading a response that takes an hour (reward.workers=0: in the
    thread): the second Ctrl-C, which aborts the step, waited for that round to end."""
    marker = tmp_path / "grading"
    reward = tmp_path / "slow.py"
    reward.write_text(
        "import pathlib, threading, time\n"
        "def score(response, ground_truth):\n"
        "    if threading.current_thread() is not threading.main_thread():\n"
        f"        pathlib.Path({str(marker)!r}).touch()\n"
        "        time.sleep(3600)\n"
        "    return 0.0\n"
    )
    slow = (f"reward.function={reward}:score", "reward.workers=0")
    proc = _start(tmp_path, "slow", demo_cache, *slow)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        code, _, err = finish_run(proc, timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the run waited for the generator's round") from None
    assert code == 130 and "received twice: step 1 aborted and not saved" in err, err
