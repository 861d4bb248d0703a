"""Faults during training: non-finite updates, signals, verifier failures. Each leaves a run
directory that a resume accepts, and a message that names the cause and the fix."""

import copy
import json
import os
import signal

import pytest
import torch
from helpers import quiet_fit, setup_run

from dapo.config import load_config
from dapo.data.batch import Episode
from dapo.data.problems import Problem
from dapo.reward import tasks
from dapo.reward.tasks.base import Task
from dapo.run import checkpoint
from dapo.run.interrupt import GracefulStop, RunStopped, StepAborted
from dapo.training import loop, update
from dapo.training import state as trainer


def _steps(run_dir):
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _nan_logits_when(model, predicate):
    """Make the policy's logits NaN on the forward passes where ``predicate()`` holds: its
    decoder's output, which both the chunked head and the model's own logits read, is NaN."""

    def hook(_module, _args, output):
        if predicate():
            # Multiplying keeps the graph, as a real NaN would.
            output.last_hidden_state = output.last_hidden_state * float("nan")
        return output

    return model.get_decoder().register_forward_hook(hook)


# ----------------------------------------------------------------------------- non-finite


def _update_state(model, tokenizer, *, responses_per_minibatch):
    cfg = load_config(
        None,
        [
            f"train.responses_per_minibatch={responses_per_minibatch}",
            "train.recompute_old_logprobs=false",  # every forward is then a training one
        ],
    )
    state = trainer.build_state(cfg, model, tokenizer, [Problem("p", (), "1")])
    state.sampler_logprobs_checked = True  # made-up sampler log-probs: skip the check
    return state


def test_a_non_finite_update_is_skipped_and_counted(tiny_model, tokenizer):
    state = _update_state(tiny_model, tokenizer, responses_per_minibatch=2)
    eps = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        e = Episode(
            prompt_ids=torch.randint(5, 60, (4,), generator=g),
            response_ids=torch.randint(5, 60, (3 + i,), generator=g),
            sampler_logprobs=-torch.rand(3 + i, generator=g),
            truncated=False,
            correct=i % 2 == 0,
            reward=1.0,
            advantage=(-1.0) ** i,
        )
        eps.append(e)
    calls = {"n": 0}

    def first_minibatch_only():
        calls["n"] += 1
        return calls["n"] == 1

    _nan_logits_when(tiny_model, first_minibatch_only)
    out = update.update(state, eps, lr=1e-3)
    assert out["train/skipped_updates"] == 1.0 and out["train/updates"] == 1.0
    assert state.consecutive_skips == 0  # the good update after it resets the count
    assert all(torch.isfinite(p).all() for p in tiny_model.parameters())


def test_all_updates_non_finite_leave_weights_and_adam_untouched(tiny_model, tokenizer):
    state = _update_state(tiny_model, tokenizer, responses_per_minibatch=1)
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    e = Episode(
        prompt_ids=torch.tensor([5, 6, 7]),
        response_ids=torch.tensor([8, 9]),
        sampler_logprobs=torch.tensor([-1.0, -1.0]),
        truncated=False,
        correct=True,
        reward=1.0,
        advantage=1.0,
    )
    _nan_logits_when(tiny_model, lambda: True)
    out = update.update(state, [e, copy.deepcopy(e)], lr=1e-3)
    assert out["train/skipped_updates"] == 2.0 and out["train/updates"] == 0.0
    assert state.consecutive_skips == 2
    assert state.optimizer.state == {}
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_consecutive_non_finite_updates_stop_the_run_cleanly(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, "train.max_consecutive_skips=2")
    real_step = loop.train_step
    done = {"steps": 0}

    def counting_step(state, *source):
        out = real_step(state, *source)
        done["steps"] = state.step
        return out

    monkeypatch.setattr(loop, "train_step", counting_step)
    # From step 2 on, every training forward (the update's, with gradients) gives NaN logits.
    _nan_logits_when(tiny_model, lambda: torch.is_grad_enabled() and done["steps"] >= 1)
    with pytest.raises(update.NonFiniteError) as err:
        quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    msg = str(err.value)
    assert "step 2: 2 updates in a row had a non-finite loss or gradient norm" in msg
    assert f"dapo train --resume {run_dir} optim.lr=<lower> --force" in msg
    # The run directory is still valid: step 1's checkpoint is whole and the log ends there.
    ckpt = checkpoint.find_latest(run_dir)
    assert ckpt.name == "step_000001" and checkpoint.verify(ckpt) is None
    assert _steps(run_dir) == [0, 1]


# ----------------------------------------------------------------------------- signals


def test_graceful_stop_first_signal_requests_second_aborts():
    with GracefulStop(stream=open(os.devnull, "w")) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.name == "SIGTERM"
        with pytest.raises(StepAborted):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def _signal_during_step(monkeypatch, at_step: int, times: int):
    real_step = loop.train_step

    def step(state, *source):
        if state.step + 1 == at_step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGTERM)
        return real_step(state, *source)

    monkeypatch.setattr(loop, "train_step", step)


def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    cfg, train, val, run_dir, start = setup_run(tmp_path, tiny_model, "train.save_every=0")
    _signal_during_step(monkeypatch, at_step=2, times=1)
    with pytest.raises(RunStopped) as err:
        quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    assert err.value.exit_code == 128 + signal.SIGTERM
    assert str(err.value) == (
        f"stopped by SIGTERM after step 2 of 4; checkpoint saved. "
        f"Resume with: dapo train --resume {run_dir}"
    )
    assert checkpoint.find_latest(run_dir).name == "step_000002"
    assert _steps(run_dir) == [0, 1, 2]
    monkeypatch.undo()
    quiet_fit(cfg, start, tokenizer, train, val, run_dir, resume=True)
    assert _steps(run_dir) == [0, 1, 2, 3, 4]


def test_second_signal_aborts_the_step_without_saving_it(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    cfg, train, val, run_dir, start = setup_run(tmp_path, tiny_model)
    _signal_during_step(monkeypatch, at_step=3, times=2)
    with pytest.raises(RunStopped) as err:
        quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    assert err.value.exit_code == 128 + signal.SIGTERM
    assert "SIGTERM received twice: step 3 aborted and not saved" in str(err.value)
    assert "the last checkpoint is step_000002" in str(err.value)
    assert checkpoint.find_latest(run_dir).name == "step_000002"
    monkeypatch.undo()
    quiet_fit(cfg, start, tokenizer, train, val, run_dir, resume=True)
    assert _steps(run_dir) == [0, 1, 2, 3, 4]


def test_second_signal_during_a_save_names_the_step_that_ended_unsaved(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    """Two signals in the checkpoint of step 3: step 3 had ended (and was logged), and the
    message said step 4 was aborted, a step that never began."""
    cfg, train, val, run_dir, start = setup_run(tmp_path, tiny_model)
    real_save = checkpoint.save

    def save(run_dir, *, step, **kwargs):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(run_dir, step=step, **kwargs)

    monkeypatch.setattr(checkpoint, "save", save)
    with pytest.raises(RunStopped) as err:
        quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    assert str(err.value) == (
        "SIGTERM received twice: step 3 ended, but its evaluation or checkpoint was aborted, "
        "and not saved; the last checkpoint is step_000002. Resume with: dapo train --resume "
        f"{run_dir}"
    )
    assert checkpoint.find_latest(run_dir).name == "step_000002"
    monkeypatch.undo()
    quiet_fit(cfg, start, tokenizer, train, val, run_dir, resume=True)
    assert _steps(run_dir) == [0, 1, 2, 3, 4]


def test_second_signal_in_the_final_export_says_the_last_step_is_saved(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    """Two signals while model/ is written after the last step's checkpoint: the message said
    that step was not saved, and named its checkpoint as the last one in the same breath."""
    cfg, train, val, run_dir, start = setup_run(tmp_path, tiny_model)
    real_export = checkpoint.export_model

    def export_model(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        return real_export(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "export_model", export_model)
    with pytest.raises(RunStopped) as err:
        quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    assert str(err.value) == (
        "SIGTERM received twice after step 4 was saved (step_000004): what followed was "
        "aborted (a resume writes the model/ of a run's last step). Resume with: dapo train "
        f"--resume {run_dir}"
    )
    assert not (run_dir / "model").exists()
    monkeypatch.undo()
    quiet_fit(cfg, start, tokenizer, train, val, run_dir, resume=True)
    assert (run_dir / "model" / "config.json").is_file()


# ----------------------------------------------------------------------------- verifier faults


def _broken_verifier(response, ground_truth):
    raise RuntimeError("verifier bug")


def test_a_raising_verifier_grades_incorrect_and_training_goes_on(
    tmp_path, tiny_model, tokenizer, monkeypatch, capsys
):
    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, "train.steps=2")
    monkeypatch.setitem(tasks.REGISTRY, "arith", Task("arith", _broken_verifier, "broken"))
    summary = quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    assert summary["steps"] == 2
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["reward/faults"] for x in lines[1:]] == [8.0, 8.0]  # 2 prompts x 4 responses
    assert [x["rollout/accuracy"] for x in lines[1:]] == [0.0, 0.0]
    assert lines[0]["val/reward_faults"] == 3.0 and lines[0]["val/accuracy"] == 0.0
    err = capsys.readouterr().err
    assert "the verifier failed on 8 response(s), graded incorrect" in err
    assert "RuntimeError: verifier bug" in err


def test_a_resumed_run_syncs_its_engine_before_it_generates(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    cfg, train, val, run_dir, start = setup_run(tmp_path, tiny_model, "train.steps=1")
    quiet_fit(cfg, tiny_model, tokenizer, train, val, run_dir)
    calls = []
    real_make_engine = trainer.make_engine

    class Recording:
        exact_logprobs = True

        def __init__(self, *args):
            self.inner = real_make_engine("dapo", *args)

        def generate(self, prompts, **kwargs):
            calls.append("generate")
            return self.inner.generate(prompts, **kwargs)

        def sync_weights(self, model):
            calls.append("sync")

    monkeypatch.setattr(trainer, "make_engine", lambda _name, *args, **_: Recording(*args))
    cfg.train.steps = 2
    quiet_fit(cfg, start, tokenizer, train, val, run_dir, resume=True)
    assert calls[0] == "sync" and calls.count("sync") == 2  # on restore, after step 2
